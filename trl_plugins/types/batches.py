"""What the packing seam and the trainer exchange: a collated micro-batch and a plan of micro-batches per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "PackPlan"]


@dataclass
class MicroBatch:
    """Datums collated into right-padded ``(B, T)`` tensors, ``T`` = longest datum in the batch.

    Padding positions have ``attention_mask == 0`` and ``action_mask == 0``. A *dummy* micro-batch
    (a rank with fewer micro-batches than the others) has ``weight == 0``.

    *Padding-free* (``position_ids`` set): the model sees the datums' real tokens concatenated into one
    ``(1, N)`` sequence (``input_ids[attention_mask == 1]``, row after row) with positions restarting at
    0 for each datum, and attends within each datum only; its per-token outputs are put back into the
    ``(B, T)`` layout (:func:`trl_plugins.modeling.micro_batch_logprobs`), so the loss side is the same in
    both layouts.
    """

    input_ids: torch.Tensor
    """``(B, T)`` long."""
    attention_mask: torch.Tensor
    """``(B, T)`` long, 1 on real tokens."""
    target_ids: torch.Tensor
    """``(B, T)`` long; pad id on padding."""
    behaviour_logprobs: torch.Tensor
    """``(B, T)`` float."""
    advantages: torch.Tensor
    """``(B, T)`` float, 0 off the action mask."""
    action_mask: torch.Tensor
    """``(B, T)`` float, 1 on sampled tokens."""
    datum_indices: list[int]
    """Indices of the datums in the list they were collated from (row order)."""
    ref_logprobs: torch.Tensor | None = None
    """``(B, T)`` float reference log-probs when the datums carry them (0 on padding)."""
    old_logprobs: torch.Tensor | None = None
    """``(B, T)`` float trainer log-probs of the sampling weights when the datums carry them (0 on padding)."""
    old_values: torch.Tensor | None = None
    """``(B, T)`` float rollout-time critic values when the datums carry them."""
    returns: torch.Tensor | None = None
    """``(B, T)`` float value targets when the datums carry them."""
    weight: float = 1.0
    """1.0 for real micro-batches, 0.0 for dummies."""
    position_ids: torch.Tensor | None = None
    """Padding-free only: ``(1, N)`` long, each datum's positions ``0..n-1`` one after the other."""
    turn_ids: torch.Tensor | None = None
    """``(B, T)`` long: each action position's turn within its row's trajectory (``Datum.turn_ids``), -1 elsewhere
    and on padding; None when a datum of the micro-batch carries none."""

    @property
    def num_padded_tokens(self) -> int:
        """Tokens the forward pass processes: ``B * T`` (the padded area), or ``N`` padding-free."""
        return int(self.input_ids.numel()) if self.position_ids is None else int(self.position_ids.numel())


@dataclass
class PackPlan:
    """A partition of item indices into micro-batches, per data-parallel rank.

    ``ranks[r][k]`` is the list of item indices in rank ``r``'s ``k``-th micro-batch. Every rank has
    the same number of micro-batches; an empty list is a *dummy* that the trainer runs with zero
    weight so that all ranks issue the same number of forward/backward passes.
    """

    ranks: list[list[list[int]]]
    """rank -> micro-batch -> item indices."""

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (dummies included); the same on every rank."""
        return len(self.ranks[0]) if self.ranks else 0

    def num_dummies(self) -> int:
        """Empty micro-batches over all ranks."""
        return sum(not mb for rank in self.ranks for mb in rank)

    def rank_padded_area(self, lengths: "list[int]") -> list[int]:
        """Per rank, the sum over its micro-batches of ``len(mb) * max length in mb``."""
        return [sum(len(mb) * max((lengths[i] for i in mb), default=0) for mb in rank) for rank in self.ranks]
