"""The ``rank`` advantage estimator: a trajectory's advantage is how many members of its group it beats, minus how
many beat it, so only the order of the rewards matters, not their scale."""

from __future__ import annotations

import math

import torch

from trl_plugins.types import AdvantageInput, AdvantageOutput

__all__ = ["rank_advantages", "RankAdvantage"]


def rank_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Pairwise-rank advantages: ``A_i = scale * (wins_i - losses_i) / (n_g - 1)``.

    ``wins_i`` (``losses_i``) counts the other members of ``i``'s group ``g`` (``n_g`` members) whose reward is lower
    (higher) than ``r_i``; a tie counts as neither. This is ``r_i``'s rank in its group, tied members sharing their
    mean rank, centred and mapped onto ``[-scale, scale]``: ``scale * (2 * rank_i / (n_g - 1) - 1)`` (with
    ``scale=0.5``, the centred-rank transformation of Salimans et al. 2017). So the advantages of a group sum to 0,
    a group whose rewards are all equal (a group of one included) gets exactly 0, and any increasing transformation
    of the rewards (a weight, an offset, a squashing) leaves them unchanged: one outlier cannot dwarf its group.

    Args:
        rewards: ``(N,)`` float.
        group_ids: ``(N,)`` integer group of each trajectory (any labels, any order).
        scale: The advantage of the best member of a group without ties.

    Returns:
        ``(N,)`` advantages in ``rewards.dtype``. Compares every pair of the batch: ``(N, N)`` memory.
    """
    r = rewards.to(torch.float64)
    same_group = group_ids.reshape(-1, 1) == group_ids.reshape(1, -1)
    beats = torch.sign(r.reshape(-1, 1) - r.reshape(1, -1))  # +1 where i's reward is above j's, -1 below, 0 tied
    net = torch.where(same_group, beats, torch.zeros_like(beats)).sum(dim=1)
    others = same_group.sum(dim=1).to(torch.float64) - 1
    return (scale * net / others.clamp(min=1)).to(rewards.dtype)


class RankAdvantage:
    """``rank``: :func:`rank_advantages` of the batch's rewards, one advantage per trajectory, ``(N,)``.

    A plain class, not a dataclass, to show that one works: its capabilities are class attributes (the same for
    every instance, and not constructor arguments), its one setting an instance attribute. It defines no ``__eq__``,
    so the contract check compares its pickled copy by type and attributes (``vars()``): ``scale`` travels with it.
    """

    needs_values = False
    """Capability: reads no critic values (the run trains no critic for it)."""
    needs_groups = True
    """Capability: compares the members of a group, so the run asks for ``num_generations >= 2``."""

    def __init__(self, scale: float = 1.0) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"rank: scale must be a finite number > 0, got {scale!r}.")
        self.scale = float(scale)
        """The advantage of the best member of a group without ties (``advantage_kwargs: {scale: ...}``)."""

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        return AdvantageOutput(advantages=rank_advantages(inp.rewards, inp.group_ids, scale=self.scale))

    def __repr__(self) -> str:
        return f"RankAdvantage(scale={self.scale})"
