"""The output projection applied in chunks of positions: log-probs at a target and entropies without ever holding the
vocabulary's logits for every token.

A causal LM's ``.logits`` are ``lm_head(final hidden states)``. :func:`hidden_states_instead_of_logits` runs the
model's own forward (through its wrapper: DDP, DeepSpeed, PEFT) with the output projection passing its input
through, so ``.logits`` is the ``(..., H)`` final hidden states; :func:`chunked_logprobs_and_entropy` then applies the
projection, the temperature, the log-softmax at the target and the entropy to ``chunk_size`` positions at a time,
each chunk checkpointed (its logits recomputed in the backward), so the peak is ``chunk_size x V`` rather than
``T x V``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_LOGPROB_MEMORY_BYTES", "auto_chunk_size", "logprob_chunk_size", "output_head", "chunkable",
           "hidden_states_instead_of_logits", "chunked_logprobs_and_entropy"]

DEFAULT_LOGPROB_MEMORY_BYTES = 256 * 2**20
"""The memory one chunk's vocabulary-wide tensors may take when the chunk size is chosen automatically (256 MiB)."""

_FLOATS_PER_LOGIT = 4
"""float32 copies of a chunk's ``(chunk, V)`` logits alive at once: the scaled logits, their softmax, the product with
the logits and, in the backward, the logits' gradient."""

_NOT_A_PLAIN_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose ``.logits`` are not ``lm_head(hidden)`` alone (Gemma 2/3's soft-capping, Cohere's and
Granite's scaling): those keep the full-logits path."""


def auto_chunk_size(vocab_size: int, memory_bytes: int = DEFAULT_LOGPROB_MEMORY_BYTES) -> int:
    """Positions per chunk so that a chunk's vocabulary-wide float32 tensors fit ``memory_bytes``: at least 16.
    Qwen2.5's vocabulary (151,936) and the default 256 MiB give 110 positions."""
    return max(16, int(memory_bytes) // (max(int(vocab_size), 1) * 4 * _FLOATS_PER_LOGIT))


def logprob_chunk_size(model: torch.nn.Module, config: Any) -> int:
    """The chunk size a run's config asks for (``logprob_chunk_size``), or the one :func:`auto_chunk_size` picks for
    the model's vocabulary and ``logprob_chunk_memory_mb`` (256 MiB where the config has neither)."""
    size = getattr(config, "logprob_chunk_size", None)
    if size:
        return int(size)
    inner = _unwrapped(model)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    head = output_head(model)
    vocab = getattr(head, "out_features", None) or vocab or 1
    return auto_chunk_size(int(vocab), int(getattr(config, "logprob_chunk_memory_mb", 256) or 256) * 2**20)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP, DeepSpeed's engine
        model = model.module
    return model


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that maps final hidden states to logits (``lm_head``; PEFT's wrapper of it when adapters sit on
    it), or None where the model names none."""
    inner = _unwrapped(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its output head applied to the final hidden states and nothing else."""
    if output_head(model) is None:
        return False
    config = getattr(_unwrapped(model), "config", None)
    for sub in (config, getattr(config, "text_config", None)):
        for key in _NOT_A_PLAIN_HEAD:
            value = getattr(sub, key, None)
            if value not in (None, 1, 1.0):
                return False
    return True


_PASSING = threading.local()
"""Per thread: the heads whose forward passes its input through in this thread (their ``id``s)."""
_INSTALLED: dict[int, int] = {}
"""Per head (``id``): how many threads are inside :func:`hidden_states_instead_of_logits` for it."""
_INSTALL_LOCK = threading.Lock()


_OWN_FORWARD: dict[int, Any] = {}
"""Per head (``id``) with a pass-through installed: the instance ``forward`` it had before (a hook's), if any."""


def _thread_passthrough(head: torch.nn.Module) -> Any:
    original = head.forward  # bound: the class's, or an instance attribute a hook library set

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if id(head) in getattr(_PASSING, "heads", ()):
            return hidden
        return original(hidden, *args, **kwargs)

    return forward


@contextlib.contextmanager
def hidden_states_instead_of_logits(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within, in this thread: ``model(...).logits`` is the final hidden states (the head's forward passes its input
    through; the module's hooks, DeepSpeed's among them, still run). Yields the head, whose call outside applies it
    as usual. Another thread calling the model meanwhile (a replica generating while it probes pushed weights) gets
    the logits: the pass-through is this thread's only."""
    head = output_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)")
    key = id(head)
    with _INSTALL_LOCK:
        if not _INSTALLED.get(key):
            _OWN_FORWARD[key] = head.__dict__.get("forward")
            head.forward = _thread_passthrough(head)
        _INSTALLED[key] = _INSTALLED.get(key, 0) + 1
    mine = getattr(_PASSING, "heads", frozenset())
    _PASSING.heads = mine | {key}
    try:
        yield head
    finally:
        _PASSING.heads = mine
        with _INSTALL_LOCK:
            _INSTALLED[key] -= 1
            if not _INSTALLED[key]:
                del _INSTALLED[key]
                own = _OWN_FORWARD.pop(key)
                if own is None:
                    del head.forward
                else:
                    head.forward = own


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    z = head(hidden)
    if temperature != 1.0:
        z = z / temperature
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    log_z = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    return logp, log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def chunked_logprobs_and_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
                                 temperature: float = 1.0, with_entropy: bool = True,
                                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and (``with_entropy``) entropies from ``(N, H)`` final hidden states, ``(N,)`` each,
    ``chunk_size`` rows at a time. With a gradient, each chunk is checkpointed (non-reentrant): only its hidden rows
    and its two ``(chunk,)`` results are kept, its logits recomputed in the backward."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start: start + chunk_size], targets[start: start + chunk_size]
        if grad:
            # determinism_check off: under ZeRO-3 the head's weight is a partitioned parameter, gathered by its
            # module's hooks for the recompute and released again before torch would compare it with the forward's.
            lp, ent = checkpoint(_chunk, head, h, t, temperature, with_entropy, use_reentrant=False,
                                 determinism_check="none")
        else:
            lp, ent = _chunk(head, h, t, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        empty = hidden.new_zeros((0,), dtype=torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16)
                                 else hidden.dtype)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)
