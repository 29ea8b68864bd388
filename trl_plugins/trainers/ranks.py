"""What the data-parallel ranks exchange, in one place: sums and extremes of figures, the one merge of statistics
records, and gathers of values. Every function here is a collective: every rank calls it at the same point."""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch

from trl_plugins.types import stat_reductions

__all__ = ["is_deepspeed", "reduce_over_ranks", "all_reduce_sum", "merge_over_ranks", "gather_values"]

S = TypeVar("S")


def is_deepspeed(accelerator: Any) -> bool:
    """Whether the accelerator runs DeepSpeed (its engines step themselves; see the update)."""
    return accelerator.state.deepspeed_plugin is not None


def reduce_over_ranks(accelerator: Any, values: Sequence[float], op: str) -> list[float]:
    """``values`` summed (``op="sum"``) or maximised (``"max"``) over the ranks, in float64; the same on every rank."""
    t = torch.tensor(list(values), dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        if op == "sum":
            t = accelerator.reduce(t, reduction="sum")
        else:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def all_reduce_sum(accelerator: Any, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, back on its own device (what a plugin's global statistics use)."""
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").to(tensor.device)


def merge_over_ranks(accelerator: Any, stats: S | None, cls: type[S]) -> S | None:
    """The one merge of per-rank statistics records (``PolicyLossStats``, ``MismatchStats``, the update's and the
    critic's sums): each field combined as its dataclass declares (:func:`~trl_plugins.types.stat_reductions`:
    a sum, or a min/max), in one all-reduce for the sums and one for the extremes (a minimum as ``-max(-x)``).

    ``stats`` is None on a rank that counted nothing. Returns float64 tensors, or None when no rank counted a
    token (the record's ``num_tokens`` sums to 0).
    """
    how = stat_reductions(cls)
    sums = [n for n, h in how.items() if h == "sum"]
    extremes = [n for n, h in how.items() if h != "sum"]
    sign = {n: -1.0 if how[n] == "min" else 1.0 for n in extremes}
    if stats is None:
        local_sums, local_ext = [0.0] * len(sums), [float("-inf")] * len(extremes)
    else:
        local_sums = [float(getattr(stats, n)) for n in sums]
        local_ext = [sign[n] * float(getattr(stats, n)) for n in extremes]
    total = reduce_over_ranks(accelerator, local_sums, "sum")
    ext = reduce_over_ranks(accelerator, local_ext, "max") if extremes else []
    if "num_tokens" in sums and total[sums.index("num_tokens")] == 0:
        return None
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return cls(**{n: t(v) for n, v in zip(sums, total)}, **{n: t(sign[n] * v) for n, v in zip(extremes, ext)})


def gather_values(accelerator: Any, local: torch.Tensor) -> torch.Tensor:
    """Every rank's values of a flat tensor, concatenated in rank order, on every rank (CPU, float32)."""
    local = local.detach().float().cpu().reshape(-1)
    if accelerator.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    return torch.cat(gather_object([local]))
