"""Shared prefixes: which items begin with the same tokens, and what a micro-batch of them costs.

The G trajectories of a group begin with the same prompt; the shared-prefix layout
(:class:`~trl_plugins.types.SharedPrefixLayout`) forwards such a prefix once per micro-batch and each item's
remaining tokens (its *branch*) attending to it. :func:`prefix_trees` finds the trees (each a prefix length and its
members) that save the most tokens; :func:`tree_area` is a micro-batch's cost in that layout, by which
:func:`~trl_plugins.packing.packers.pack_trees` (the built-in packers given the seam's ``prefix_trees``) budgets.

Cost model: a micro-batch holding trees ``(P_k, members_k)`` runs two forwards, the prefixes left-padded to the
longest ``P`` and the branches right-padded to the longest branch ``Tb``: ``K * P + B * Tb`` positions, with
``K`` the prefix rows and ``B`` the items. An item that shares nothing (a tree of one) is forwarded as a branch or
as a prefix row of its own, whichever costs less (:func:`prefix_lengths`). Pure functions of token ids and lengths.
"""

from __future__ import annotations

from typing import Sequence

from trl_plugins.types import PrefixTree

BOTH_LAYOUTS = (
    "prefix_trees (the shared-prefix layout) and padding_free are two layouts of a micro-batch; pass one of them."
)

__all__ = ["prefix_trees", "prefix_lengths", "layout_trees", "tree_area", "tree_tokens"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def prefix_trees(sequences: Sequence[Sequence[int]]) -> list[PrefixTree]:
    """Partition ``sequences`` into trees that forward the fewest tokens: each tree's prefix is its members' longest
    common prefix, forwarded once; an item that shares nothing is a tree of one (``prefix_len=0``).

    Exact for this cost (``sum of lengths - sum over trees of (members - 1) * prefix_len``, minimised): in
    lexicographic order the members of some optimal tree are contiguous, and the best cut of that order into runs
    is a dynamic programme over it, ``O(n^2)``. Deterministic (ties keep items apart, then input order).

    Example: ``[[1, 2, 3, 4], [1, 2, 3, 9], [7, 7]]`` -> ``[PrefixTree(3, (0, 1)), PrefixTree(0, (2,))]``.
    """
    n = len(sequences)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (list(sequences[i]), i))
    adjacent = [_common_prefix(sequences[order[k]], sequences[order[k + 1]]) for k in range(n - 1)]
    best = [0] * (n + 1)  # best[j]: tokens saved over the first j sorted items
    cut = [0] * (n + 1)  # the run ending at j starts at cut[j]
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1  # item j-1 alone
        shared = None
        for i in range(j - 2, -1, -1):  # the run order[i:j], its common prefix the least adjacent one
            shared = adjacent[i] if shared is None else min(shared, adjacent[i])
            if shared == 0:
                break
            saved = best[i] + (j - 1 - i) * shared
            if saved > best[j]:
                best[j], cut[j] = saved, i
    trees = []
    j = n
    while j > 0:
        i = cut[j]
        members = tuple(sorted(order[i:j]))
        shared = min(adjacent[i : j - 1]) if j - i > 1 else 0
        trees.append(PrefixTree(prefix_len=shared, members=members))
        j = i
    return sorted(trees, key=lambda t: t.members[0])


def tree_tokens(lengths: Sequence[int], trees: Sequence[PrefixTree]) -> int:
    """Real tokens the shared-prefix layout forwards for ``trees``: each prefix once, then every branch."""
    return sum(t.prefix_len + sum(lengths[i] - t.prefix_len for i in t.members) for t in trees)


def prefix_lengths(lengths: Sequence[int], trees: Sequence[PrefixTree]) -> list[int]:
    """The prefix each tree is forwarded with in one micro-batch, chosen to keep its area ``K * P + B * Tb`` smallest.

    The prefix forward's width ``W`` and the branch width trade off: a tree forwards ``min(prefix_len, W)`` tokens as
    its prefix (the rest of what its members share goes with their branches: forwarded once per member, but a long
    prefix no longer widens every prefix row); an item that shares nothing forwards either nothing (it is a branch,
    whole) or ``min(length, W)`` as a prefix row of its own (its tail a branch), the longest ones first. Every
    candidate ``W`` (each tree's prefix length, each lone item's length) and cut of the lone items is priced;
    ``O(n^2)`` for ``n`` trees.
    """
    shared = [k for k, t in enumerate(trees) if t.prefix_len > 0]
    lone = sorted(
        (k for k, t in enumerate(trees) if t.prefix_len == 0), key=lambda k: (-lengths[trees[k].members[0]], k)
    )
    alone = [lengths[trees[k].members[0]] for k in lone]
    rows = sum(len(t.members) for t in trees)
    best: tuple[int, int, int] | None = None  # (area, W, cut)
    for width in sorted({0, *(trees[k].prefix_len for k in shared), *alone}):
        heads = [min(trees[k].prefix_len, width) for k in shared]
        branch = max((lengths[i] - h for k, h in zip(shared, heads) for i in trees[k].members), default=0)
        for cut in range(len(alone) + 1 if width else 1):  # alone[:cut] as prefix rows (longest first)
            used_width = max(heads + [min(alone[0], width)] if cut else heads, default=0)
            tail = max(alone[0] - width, 0) if cut else 0
            widest = max([branch, tail, 1] + alone[cut : cut + 1])
            area = (len(heads) + cut) * used_width + rows * widest
            if best is None or area < best[0]:
                best = (area, width, cut)
    _, width, cut = best  # type: ignore[misc]
    used = [min(t.prefix_len, width) for t in trees]
    for k in lone[:cut]:
        used[k] = min(lengths[trees[k].members[0]], width)
    return used


def _area(lengths: Sequence[int], trees: Sequence[PrefixTree], used: Sequence[int]) -> int:
    prefixes = [p for p in used if p > 0]
    branch = max((lengths[i] - p for t, p in zip(trees, used) for i in t.members), default=0)
    return len(prefixes) * max(prefixes, default=0) + sum(len(t.members) for t in trees) * max(branch, 1)


def layout_trees(lengths: Sequence[int], trees: Sequence[PrefixTree]) -> tuple[list[PrefixTree], list[int]]:
    """The trees as one micro-batch forwards them, with each one's prefix length (:func:`prefix_lengths`).

    Every branch row is padded to the longest branch, so one long trajectory would widen them all: while the member
    with the longest branch can leave its tree and lower the area (it is then forwarded whole, most often as a prefix
    row of its own, recomputing the prefix it shared), it does. Minimises area greedily: only the longest branch sets
    the branch forward's width.
    """
    trees = list(trees)
    used = prefix_lengths(lengths, trees)
    area = _area(lengths, trees, used)
    while True:
        shared = [
            (lengths[i] - p, k, i) for k, (t, p) in enumerate(zip(trees, used)) if t.prefix_len > 0 for i in t.members
        ]
        if not shared:
            break
        _, k, i = max(shared)
        rest = tuple(m for m in trees[k].members if m != i)
        moved = (
            trees[:k]
            + trees[k + 1 :]
            + [PrefixTree(trees[k].prefix_len if len(rest) > 1 else 0, rest), PrefixTree(0, (i,))]
        )
        moved_used = prefix_lengths(lengths, moved)
        moved_area = _area(lengths, moved, moved_used)
        if moved_area >= area:
            break
        trees, used, area = moved, moved_used, moved_area
    return trees, used


def tree_area(lengths: Sequence[int], trees: Sequence[PrefixTree]) -> int:
    """Positions one micro-batch holding ``trees`` processes, padding included: ``K * P + B * Tb`` (module doc), the
    trees as :func:`layout_trees` forwards them."""
    return _area(lengths, *layout_trees(lengths, trees))
