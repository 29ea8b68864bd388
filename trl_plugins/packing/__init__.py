"""Micro-batch packing: partitions of item indices, and their inverse.

``pack(lengths, strategy=..., max_items=..., max_padded_tokens=...)`` returns micro-batches as lists
of indices into ``lengths``; ``restore_order(batches, per_batch_values)`` puts per-item results back in
input order. ``pack_for_ranks`` returns a :class:`~trl_plugins.types.PackPlan` with the same number of
micro-batches on every data-parallel rank. Strategies come from :data:`trl_plugins.registry.PACKERS`.
``prefix_trees(sequences)`` finds the items that share leading tokens, for the shared-prefix layout
(:mod:`.prefix_trees`).
"""

from __future__ import annotations

from typing import Sequence, TypeVar

from trl_plugins.packing.packers import (
    PackingError,
    balanced,
    check_limits,
    ffd,
    micro_batch_cost,
    optimal,
    pack_trees,
    padded_area,
)
from trl_plugins.packing.prefix_trees import (
    BOTH_LAYOUTS,
    layout_trees,
    prefix_lengths,
    prefix_trees,
    tree_area,
    tree_tokens,
)
from trl_plugins.registry import PACKERS
from trl_plugins.types import PackPlan, PrefixTree

__all__ = [
    "PackingError",
    "pack",
    "pack_for_ranks",
    "inverse_permutation",
    "restore_order",
    "padded_area",
    "micro_batch_cost",
    "supports_padding_free",
    "supports_prefix_trees",
    "prefix_trees",
    "prefix_lengths",
    "layout_trees",
    "pack_trees",
    "tree_area",
    "tree_tokens",
    "check_limits",
    "ffd",
    "optimal",
    "balanced",
]

V = TypeVar("V")


def _declares(strategy: str, capability: str) -> bool:
    declared = getattr(PACKERS.get(strategy), capability, False)
    if not isinstance(declared, bool):
        raise PackingError(f"packer {strategy!r} declares {capability}={declared!r}; it must be a bool.")
    return declared


def supports_padding_free(strategy: str) -> bool:
    """Whether the named packer declares ``supports_padding_free = True`` (it budgets tokens for padding-free
    micro-batches); a packer that does not declare it budgets padded area only. Read here and nowhere else."""
    return _declares(strategy, "supports_padding_free")


def supports_prefix_trees(strategy: str) -> bool:
    """Whether the named packer declares ``supports_prefix_trees = True``: it takes ``prefix_trees=`` and keeps a
    tree's members together, budgeting the shared-prefix layout's area. A packer that does not declare it gets the
    lengths alone (the trainer then shares what it finds within each micro-batch). Read here and nowhere else."""
    return _declares(strategy, "supports_prefix_trees")


def pack_for_ranks(
    lengths: Sequence[int],
    *,
    strategy: str,
    max_items: int,
    max_padded_tokens: int,
    world_size: int,
    padding_free: bool = False,
    prefix_trees: Sequence[PrefixTree] | None = None,
) -> PackPlan:
    """Pack ``lengths`` into micro-batches for ``world_size`` ranks with the named strategy; with
    ``padding_free`` the budget is tokens (the packer must declare ``supports_padding_free``). ``prefix_trees``
    (the shared-prefix layout) reach a packer that declares ``supports_prefix_trees``; any other packer is called
    on the lengths alone, as before.

    Raises:
        PackingError: bad limits, an item longer than ``max_padded_tokens``, or ``padding_free`` with a packer
            that budgets padded area only.
        trl_plugins.registry.RegistryError: unknown strategy.
    """
    packer = PACKERS.get(strategy)
    if prefix_trees is not None and padding_free:
        raise PackingError(BOTH_LAYOUTS)
    if prefix_trees is not None and supports_prefix_trees(strategy):
        return packer(
            list(lengths),
            max_items=max_items,
            max_padded_tokens=max_padded_tokens,
            world_size=world_size,
            prefix_trees=list(prefix_trees),
        )
    if not padding_free:
        return packer(list(lengths), max_items=max_items, max_padded_tokens=max_padded_tokens, world_size=world_size)
    if not supports_padding_free(strategy):
        raise PackingError(
            f"packer {strategy!r} budgets padded area only (it does not declare supports_padding_free): "
            f"use ffd, optimal or balanced, or set padding_free=False."
        )
    return packer(
        list(lengths),
        max_items=max_items,
        max_padded_tokens=max_padded_tokens,
        world_size=world_size,
        padding_free=True,
    )


def pack(lengths: Sequence[int], *, strategy: str, max_items: int, max_padded_tokens: int) -> list[list[int]]:
    """Pack ``lengths`` into micro-batches on one rank; returns lists of indices into ``lengths``.

    Every index appears exactly once; each micro-batch has at most ``max_items`` rows and a padded
    area (rows x longest row) of at most ``max_padded_tokens``.

    Raises:
        PackingError: bad limits or an item longer than ``max_padded_tokens``.
        trl_plugins.registry.RegistryError: unknown strategy.
    """
    plan = pack_for_ranks(
        lengths, strategy=strategy, max_items=max_items, max_padded_tokens=max_padded_tokens, world_size=1
    )
    return plan.ranks[0]


def inverse_permutation(batches: Sequence[Sequence[int]]) -> list[int]:
    """``pos[i]`` = position of item ``i`` in the concatenation of ``batches``.

    Raises:
        ValueError: if the batches are not a partition of ``range(n)``.
    """
    flat = [i for b in batches for i in b]
    pos = [-1] * len(flat)
    for p, i in enumerate(flat):
        if not 0 <= i < len(flat) or pos[i] != -1:
            raise ValueError(f"batches are not a partition of range({len(flat)}): bad or repeated index {i}.")
        pos[i] = p
    return pos


def restore_order(batches: Sequence[Sequence[int]], per_batch_values: Sequence[Sequence[V]]) -> list[V]:
    """Inverse of packing: per-micro-batch values (row order) back to the original item order.

    ``restore_order(batches, [[x[i] for i in b] for b in batches]) == x``.

    Raises:
        ValueError: if shapes do not match the batches.
    """
    if len(batches) != len(per_batch_values) or any(len(b) != len(v) for b, v in zip(batches, per_batch_values)):
        raise ValueError("per_batch_values must have one value per index in each micro-batch.")
    flat = [v for vs in per_batch_values for v in vs]
    return [flat[p] for p in inverse_permutation(batches)]
