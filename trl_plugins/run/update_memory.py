"""The start-up check of the update's memory: from the run's own limits, what its largest micro-batch's activations
will take, against what the machine has free; a run that cannot fit is refused before the model loads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["UpdateMemory", "update_memory", "check_update_memory"]


@dataclass(frozen=True)
class UpdateMemory:
    """Estimated bytes of one micro-batch's forward and backward (an estimate: kernels' workspaces not counted)."""

    tokens: int
    """Positions of the largest micro-batch on one rank (``max_padded_tokens_per_micro_batch``; under sequence
    parallelism ``1 / sequence_parallel_size`` of it)."""
    layers: int
    """The layers' saved activations (each layer's input under activation checkpointing, plus one layer recomputed;
    every layer's intermediates without)."""
    head: int
    """One chunk's vocabulary-wide float32 tensors (4 copies of ``chunk x V``)."""
    full_logits: int
    """What the same tensors take without chunking (``tokens x V``): for comparison."""

    @property
    def total(self) -> int:
        return self.layers + self.head


def update_memory(
    *,
    tokens: int,
    hidden: int,
    intermediate: int,
    num_layers: int,
    vocab: int,
    chunk: int,
    bytes_per_value: int,
    checkpointing: bool,
) -> UpdateMemory:
    """The activations of a ``tokens``-position micro-batch: a layer keeps about ``10 H + 4 I`` values per position
    (attention's projections, norms and residuals, the MLP's gate, up, activation and product); under activation
    checkpointing each layer keeps only its ``H`` input and one layer at a time is recomputed."""
    per_layer = tokens * (10 * hidden + 4 * intermediate) * bytes_per_value
    layers = (num_layers * tokens * hidden * bytes_per_value + per_layer) if checkpointing else num_layers * per_layer
    return UpdateMemory(
        tokens=tokens, layers=layers, head=4 * 4 * min(chunk, tokens) * vocab, full_logits=4 * 4 * tokens * vocab
    )


def _free_bytes() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0]), "free on the GPU"
    try:  # what the kernel says can be had without swapping (the page cache counts)
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available on this machine"
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "free on this machine"


def check_update_memory(
    training_args: Any,
    model_config: Any,
    *,
    weights_bytes: int,
    trainable_fraction: float,
    free: tuple[int, str] | None = None,
) -> str:
    """One line of figures for the banner (and ``--dry_run``).

    Raises:
        ValueError: the update's activations and the training state exceed the free memory; the message gives the
            figures and what to change.
    """

    text = getattr(model_config, "text_config", None) or model_config
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    dtype = (
        "bf16" if getattr(training_args, "bf16", False) else "fp16" if getattr(training_args, "fp16", False) else "fp32"
    )
    long = training_args.features.long_trajectories
    chunk = long.chunk_size_for_vocab(vocab)
    checkpointing = bool(
        getattr(training_args, "activation_checkpointing", None)
        or getattr(training_args, "gradient_checkpointing", False)
    )
    split = long.sequence_parallel_size  # each rank forwards 1/N of a datum
    est = update_memory(
        tokens=-(-int(training_args.max_padded_tokens_per_micro_batch) // split),
        hidden=hidden,
        intermediate=intermediate,
        num_layers=int(text.num_hidden_layers),
        vocab=vocab,
        chunk=chunk,
        bytes_per_value=4 if dtype == "fp32" else 2,
        checkpointing=checkpointing,
    )
    state = int(weights_bytes * (1 + 3 * trainable_fraction))
    available, where = free or _free_bytes()
    shard = (
        f" (1/{split} of {training_args.max_padded_tokens_per_micro_batch}: sequence parallelism)" if split > 1 else ""
    )
    line = (
        f"update memory: ~{est.total / 1e9:.2f} GB of activations for a {est.tokens}-token micro-batch{shard} "
        f"({est.layers / 1e9:.2f} GB layers{' checkpointed' if checkpointing else ''}, {dtype}; "
        f"{est.head / 1e9:.2f} GB log-prob chunk of {chunk} x {vocab}, against {est.full_logits / 1e9:.2f} GB "
        f"for the full logits) + ~{state / 1e9:.2f} GB weights and training state, of {available / 1e9:.2f} GB {where}"
    )
    if est.total + state > available:
        raise ValueError(
            f"the update will not fit: {line}. Lower max_padded_tokens_per_micro_batch (the micro-batch budget; "
            f"a trajectory longer than it cannot be trained), raise sequence_parallel_size (DeepSpeed: each rank "
            f"forwards 1/N of a datum), turn on activation_checkpointing, lower "
            f"logprob_chunk_memory_mb, use LoRA or ZeRO-3 for the training state, or a machine with more memory."
        )
    return line
