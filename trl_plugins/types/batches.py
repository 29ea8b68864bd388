"""What the packing seam and the trainer exchange: a collated micro-batch and a plan of micro-batches per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MicroBatch", "PackPlan", "PrefixTree", "SharedPrefixLayout"]


@dataclass(frozen=True)
class PrefixTree:
    """Items that begin with the same tokens: the shared-prefix layout forwards those ``prefix_len`` tokens once and
    each member's remaining tokens (its *branch*) attending to them.

    ``prefix_len == 0`` for an item that shares nothing (a tree of one): it is forwarded whole, as a branch or as a
    prefix row of its own, whichever costs less."""

    prefix_len: int
    """Leading tokens every member has in common (at most the shortest member's length)."""
    members: tuple[int, ...]
    """Indices of the items (into the list the trees were found in), in order."""


@dataclass
class SharedPrefixLayout:
    """How a micro-batch is forwarded with each shared prefix once (:mod:`trl_plugins.modeling`).

    Two forwards, on every micro-batch and every rank alike: the ``K`` prefixes, left-padded to ``P`` so that each
    ends where its branches begin, keeping their key/value states; then the ``B`` branches (right-padded to ``Tb``),
    each attending to its own tree's prefix states (gradients flow back into them) and to itself, at positions
    continuing from its prefix. A datum's per-position outputs are gathered from both forwards' outputs, flattened
    as ``cat(prefix (K * P), branch (B * Tb))``, by :attr:`index`.
    """

    prefix_ids: torch.Tensor
    """``(K, P)`` long, left-padded (a micro-batch with no shared prefix has one 1-token placeholder row)."""
    prefix_mask: torch.Tensor
    """``(K, P)`` long, 1 on real prefix tokens."""
    prefix_positions: torch.Tensor
    """``(K, P)`` long, ``0..n-1`` on a prefix's ``n`` real tokens (0 on padding)."""
    branch_ids: torch.Tensor
    """``(B, Tb)`` long, one row per datum (row order of the micro-batch), right-padded; may be all padding."""
    branch_mask: torch.Tensor
    """``(B, P + Tb)`` long: the branch forward's mask, the row's prefix columns (all 0 for a datum forwarded whole as
    a branch) then its own tokens."""
    branch_positions: torch.Tensor
    """``(B, Tb)`` long, positions continuing from the row's prefix length."""
    row_prefix: torch.Tensor
    """``(B,)`` long: the prefix row each datum's branch reads (any row when it shares nothing: its mask hides it)."""
    index: torch.Tensor
    """``(B, T)`` long: where each datum position's output lies in the flattened outputs (0 on padding)."""

    @property
    def num_tokens(self) -> int:
        """Real tokens the two forwards compute: each shared prefix once, then every branch."""
        return int(self.prefix_mask.sum()) + int(self.branch_mask[:, self.prefix_ids.shape[1] :].sum())

    @property
    def area(self) -> int:
        """Positions the two forwards process, padding included: ``K * P + B * Tb``."""
        return int(self.prefix_ids.numel() + self.branch_ids.numel())


@dataclass
class MicroBatch:
    """Datums collated into right-padded ``(B, T)`` tensors, ``T`` = longest datum in the batch.

    Padding positions have ``attention_mask == 0`` and ``action_mask == 0``. A *dummy* micro-batch
    (a rank with fewer micro-batches than the others) has ``weight == 0``.

    *Padding-free* (``position_ids`` set): the model sees the datums' real tokens concatenated into one
    ``(1, N)`` sequence (``input_ids[attention_mask == 1]``, row after row) with positions restarting at
    0 for each datum, and attends within each datum only; its per-token outputs are put back into the
    ``(B, T)`` layout (:func:`trl_plugins.modeling.micro_batch_logprobs`), so the loss side is the same in
    every layout.

    *Shared-prefix* (``shared_prefix`` set, :class:`SharedPrefixLayout`): each prefix its datums share is forwarded
    once and the rest of every datum attends to its states; outputs come back in the ``(B, T)`` layout likewise.
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
    shared_prefix: SharedPrefixLayout | None = None
    """The shared-prefix layout (:class:`SharedPrefixLayout`): each prefix its datums share forwarded once; the
    ``(B, T)`` tensors above stay what the loss side reads."""

    @property
    def num_padded_tokens(self) -> int:
        """Tokens the forward passes process: ``B * T`` (the padded area), ``N`` padding-free, or the shared-prefix
        layout's two areas."""
        if self.shared_prefix is not None:
            return self.shared_prefix.area
        return int(self.input_ids.numel()) if self.position_ids is None else int(self.position_ids.numel())

    @property
    def num_forwarded_tokens(self) -> int:
        """Real tokens the forward computes: every datum's, or each shared prefix once in the shared-prefix layout."""
        if self.shared_prefix is not None:
            return self.shared_prefix.num_tokens
        return int(self.attention_mask.sum())


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
