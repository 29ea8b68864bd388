"""Parallelism settings of a run: TRL's and accelerate's ``parallelism_config`` taken over as
``sequence_parallel_size``, and what sequence parallelism needs from the run, checked before any model loads
(the runtime side: :mod:`trl_plugins.trainers.sequence_parallel`)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["take_over_parallelism_config", "sequence_parallel_problems", "check_sequence_parallel"]

_UNSUPPORTED_ATTENTION = ("eager", "paged|eager")


def take_over_parallelism_config(config: Any) -> None:
    """TRL's ``parallelism_config`` (or the one an accelerate config puts in the environment, which the Accelerator
    would build) sets ``sequence_parallel_size`` and is then removed, so that neither TRL, which refuses it, nor
    the HF Trainer, whose Accelerator would shard every dataloader and run Ulysses in every forward (rollouts
    and no-gradient passes included), sees it: the update splits its own forwards
    (:mod:`trl_plugins.trainers.sequence_parallel`). Tensor, context and sharded data parallelism are refused.

    Raises:
        ValueError: a size other than ``sp_size`` off 1, or a fixed sequence length or an attention implementation
            in its DeepSpeed settings, each with what to use instead.
    """
    pc, where = config.parallelism_config, "parallelism_config"
    if pc is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        from accelerate.parallelism_config import ParallelismConfig

        pc, where = ParallelismConfig(), "the accelerate config's parallelism_config"
    if pc is None:
        return
    others = {
        n: getattr(pc, n) for n in ("tp_size", "cp_size", "dp_shard_size", "dp_replicate_size") if getattr(pc, n) != 1
    }
    if others:
        raise ValueError(
            f"{where} sets {others}: the update treats every process as a data-parallel rank, with "
            f"only sequence parallelism (sp_size, sp_backend='deepspeed') on top; drop the other sizes "
            f"(ZeRO-3 through accelerate_configs/zero3.yaml shards the weights)."
        )
    handler = pc.sp_handler
    if handler is not None and (not handler.sp_seq_length_is_variable or handler.sp_attn_implementation):
        raise ValueError(
            f"{where}: the update pads each datum to a multiple of sp_size and splits the attention the "
            f"model loaded with; drop sp_seq_length_is_variable=False / sp_seq_length and "
            f"sp_attn_implementation (load the model with attn_implementation='sdpa' or a flash kernel)."
        )
    if pc.sp_size > 1:
        if config.sequence_parallel_size not in (1, pc.sp_size):
            raise ValueError(
                f"{where} sets sp_size={pc.sp_size} but sequence_parallel_size="
                f"{config.sequence_parallel_size}; set only one of them."
            )
        config.sequence_parallel_size = pc.sp_size
    config.parallelism_config = None
    if where != "parallelism_config":
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"  # the Accelerator must not build it again


def sequence_parallel_problems(
    config: Any,
    model_config: Any = None,
    *,
    world_size: int | None = None,
    deepspeed: bool | None = None,
    policy_loss: Any = None,
    attention: str | None = None,
) -> list[str]:
    """What keeps ``config.sequence_parallel_size`` from running, each with what to change (empty: it can); the
    checks whose inputs are not given are skipped (the recipe runs them before the model loads, the trainer again on
    the loaded model). ``attention``: the implementation the model will load with, where ``model_config`` (read
    from disk) does not say (None there: transformers' default, sdpa)."""
    size = config.sequence_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return [f"it must be a positive number of ranks (1: off), got {size!r}"]
    if size == 1:
        return []
    out = []
    if world_size is not None and world_size % size:
        out.append(
            f"{world_size} processes cannot form groups of {size}: launch a multiple of {size} processes "
            f"(accelerate launch --num_processes) or change sequence_parallel_size"
        )
    if deepspeed is False:
        out.append(
            "it runs under DeepSpeed only (Ulysses attention, accelerate's sp_backend='deepspeed'): launch with "
            "accelerate_configs/zero2.yaml or zero3.yaml, or set sequence_parallel_size=1"
        )
    if config.shared_prefix:
        out.append(
            "shared_prefix=True forwards several datums per micro-batch, and a split micro-batch holds one: set "
            "shared_prefix=False (or leave it None: off under sequence parallelism)"
        )
    if policy_loss is not None:
        from trl_plugins.protocols import as_policy_loss

        loss = as_policy_loss(policy_loss)
        if not loss.token_local:
            out.append(
                f"{loss.label} does not declare token_local (each token's loss reads that token's inputs "
                f"alone): a sequence- or turn-level ratio would span the shards. Use policy_loss='ppo_clip', or "
                f"declare token_local=True on a plugin whose loss is per token"
            )
    if model_config is not None:
        text = getattr(model_config, "text_config", None) or model_config
        impl = attention or getattr(model_config, "_attn_implementation", None) or "sdpa"
        if impl in _UNSUPPORTED_ATTENTION:
            out.append(
                f"attention {impl!r} needs a full attention mask, which Ulysses discards: load the model with "
                f"attn_implementation='sdpa' or a flash-attention kernel"
            )
        kinds = set(getattr(text, "layer_types", None) or [])
        windowed = "flash" in impl and kinds <= {"full_attention", "sliding_attention"}  # flash takes the window
        if kinds - {"full_attention"} and not windowed:
            out.append(
                f"the model's {sorted(kinds - {'full_attention'})} layers need more than causal attention over "
                f"the gathered sequence (a window needs a flash-attention kernel, which takes it; a linear "
                f"layer's state would restart on every shard): load it with a flash-attention kernel, or use "
                f"a model with full attention only"
            )
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        if heads and heads % size:
            out.append(
                f"the model's {heads} attention heads do not split over {size} ranks: choose a "
                f"sequence_parallel_size that divides {heads}"
            )
        if kv and kv % size and size % kv:
            out.append(
                f"the model's {kv} key/value heads and {size} ranks: one must divide the other; choose another "
                f"sequence_parallel_size"
            )
    return out


def check_sequence_parallel(config: Any, model_config: Any = None, **given: Any) -> None:
    """:func:`sequence_parallel_problems`, raised.

    Raises:
        ValueError: every problem found, each with what to change.
    """
    problems = sequence_parallel_problems(config, model_config, **given)
    if problems:
        size = config.sequence_parallel_size
        raise ValueError(f"sequence_parallel_size={size} cannot run: " + "; ".join(problems) + ".")
