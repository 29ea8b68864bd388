"""Micro-batch packers: pure index partitions over sequence lengths.

Cost model: a right-padded micro-batch of ``n`` rows whose longest row has ``m`` tokens costs its
*padded area* ``n * m``. Limits: ``n <= max_items`` and ``n * m <= max_padded_tokens``.

Padding-free micro-batches (the rows concatenated, no padding) cost their *tokens* ``sum of lengths``;
a packer that declares ``supports_padding_free = True`` takes ``padding_free=True`` and then budgets
``sum of lengths <= max_padded_tokens``. The tokens processed are then the same however items are
grouped, so the packers minimise the number of micro-batches (each pass has a fixed cost) and, across
ranks, the slowest rank's tokens.

Every packer has one call contract::

    packer(lengths, *, max_items, max_padded_tokens, world_size=1[, padding_free=False]) -> PackPlan

and is registered in :data:`trl_plugins.registry.PACKERS`.

Shared-prefix layout: a packer that declares ``supports_prefix_trees = True`` also takes
``prefix_trees=[PrefixTree, ...]`` (which items share which leading tokens, :mod:`.prefix_trees`) and must keep a
tree's members in one micro-batch where the limits allow, budgeting ``max_padded_tokens`` by
:func:`~trl_plugins.packing.prefix_trees.tree_area`. A packer that does not declare it is called as before, on the
lengths alone; the trainer then shares the prefixes it finds within each of its micro-batches.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from trl_plugins.packing.prefix_trees import BOTH_LAYOUTS, tree_area
from trl_plugins.registry import PACKERS
from trl_plugins.types import PackPlan, PrefixTree

__all__ = [
    "PackingError",
    "ffd",
    "optimal",
    "balanced",
    "check_limits",
    "padded_area",
    "micro_batch_cost",
    "pack_trees",
]


class PackingError(ValueError):
    """Lengths or limits that no packing can satisfy; the message names the offending values."""


def check_limits(lengths: Sequence[int], max_items: int, max_padded_tokens: int, world_size: int = 1) -> None:
    """Raise :class:`PackingError` for bad limits, non-positive lengths or an item over budget."""
    if max_items < 1:
        raise PackingError(f"max_items must be >= 1, got {max_items}.")
    if max_padded_tokens < 1:
        raise PackingError(f"max_padded_tokens must be >= 1, got {max_padded_tokens}.")
    if world_size < 1:
        raise PackingError(f"world_size must be >= 1, got {world_size}.")
    for i, n in enumerate(lengths):
        if n < 1:
            raise PackingError(f"item {i} has length {n}; lengths must be positive.")
        if n > max_padded_tokens:
            raise PackingError(
                f"item {i} has length {n}, longer than the micro-batch budget "
                f"max_padded_tokens={max_padded_tokens}: it fits in no micro-batch. Raise "
                f"max_padded_tokens to at least {n}, or lower the rollout's trajectory token budget."
            )


def padded_area(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """``len(batch) * max(lengths[i] for i in batch)`` (0 for an empty batch)."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


def micro_batch_cost(lengths: Sequence[int], batch: Sequence[int], *, padding_free: bool = False) -> int:
    """Tokens a micro-batch's forward processes: its padded area, or padding-free the sum of its lengths."""
    return sum(lengths[i] for i in batch) if padding_free else padded_area(lengths, batch)


def _token_batches(lengths: Sequence[int], max_items: int, budget: int, *, best_fit: bool = False) -> list[list[int]]:
    # First-fit (or best-fit) decreasing by tokens: longest first, into the first (or the fullest) open
    # micro-batch with room for its tokens and a free row.
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in _sorted_desc(lengths):
        fits = [b for b in range(len(batches)) if len(batches[b]) < max_items and loads[b] + lengths[i] <= budget]
        if fits:
            b = max(fits, key=lambda b: (loads[b], -b)) if best_fit else fits[0]
            batches[b].append(i)
            loads[b] += lengths[i]
        else:
            batches.append([i])
            loads.append(lengths[i])
    return batches


def _fewest_token_batches(lengths: Sequence[int], max_items: int, budget: int) -> list[list[int]]:
    # Bin packing is NP-hard: the better of first-fit and best-fit decreasing (fewest micro-batches, then the
    # lighter heaviest one). Both are within 11/9 of the optimum plus one.
    plans = [_token_batches(lengths, max_items, budget), _token_batches(lengths, max_items, budget, best_fit=True)]
    return min(plans, key=lambda p: (len(p), max((sum(lengths[i] for i in b) for b in p), default=0)))


def _capacity(longest: int, max_items: int, max_padded_tokens: int) -> int:
    # Rows a micro-batch whose longest row is `longest` can hold.
    return min(max_items, max_padded_tokens // longest)


def _sorted_desc(lengths: Sequence[int]) -> list[int]:
    # Stable: equal lengths keep their input order, so plans are deterministic.
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _ffd_batches(lengths: Sequence[int], max_items: int, max_padded_tokens: int) -> list[list[int]]:
    # First-fit decreasing. Items arrive longest first, so a micro-batch's longest row is its first
    # one and its row capacity is fixed when it opens; an item fits wherever a row is free.
    batches: list[list[int]] = []
    capacity: list[int] = []
    open_batches: list[int] = []  # min-heap of indices of micro-batches with a free row
    for i in _sorted_desc(lengths):
        if open_batches:
            b = open_batches[0]
            batches[b].append(i)
            if len(batches[b]) == capacity[b]:
                heapq.heappop(open_batches)
        else:
            batches.append([i])
            capacity.append(_capacity(lengths[i], max_items, max_padded_tokens))
            if capacity[-1] > 1:
                heapq.heappush(open_batches, len(batches) - 1)
    return batches


def _optimal_batches(lengths: Sequence[int], max_items: int, max_padded_tokens: int) -> list[list[int]]:
    # Exact: fewest micro-batches, then least padded area. With items sorted longest first, some
    # optimal packing uses contiguous runs (swapping a batch's shorter item for a longer one from a
    # later batch never raises either batch's max or size), so a DP over prefixes is exact.
    order = _sorted_desc(lengths)
    n = len(order)
    if n == 0:
        return []
    a = np.asarray([lengths[i] for i in order], dtype=np.int64)
    big = int(a.sum()) * 1 + int(a.max()) * n + 1  # > any total padded area
    inf = np.iinfo(np.int64).max
    # cost[i] = best (batches * big + area) for the first i sorted items; lexicographic order.
    cost = np.full(n + 1, inf, dtype=np.int64)
    cost[0] = 0
    parent = np.zeros(n + 1, dtype=np.int64)
    for j in range(n):
        cap = min(_capacity(int(a[j]), max_items, max_padded_tokens), n - j)
        sizes = np.arange(1, cap + 1, dtype=np.int64)
        cand = cost[j] + big + sizes * a[j]
        window = cost[j + 1 : j + cap + 1]
        better = cand < window
        window[better] = cand[better]
        parent[j + 1 : j + cap + 1][better] = j
    batches = []
    i = n
    while i > 0:
        j = int(parent[i])
        batches.append(order[j:i])
        i = j
    batches.reverse()
    return batches


def _lpt_assign(costs: Sequence[int], world_size: int) -> list[list[int]]:
    # Longest-processing-time: largest cost first onto the least-loaded rank (ties: fewer items).
    heap = [(0, 0, r) for r in range(world_size)]
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        load, count, r = heapq.heappop(heap)
        assignment[r].append(k)
        heapq.heappush(heap, (load + costs[k], count + 1, r))
    return assignment


def _equalise(per_rank: list[list[list[int]]]) -> PackPlan:
    # Pad every rank with dummy (empty) micro-batches up to the largest count.
    most = max((len(r) for r in per_rank), default=0)
    return PackPlan(ranks=[r + [[] for _ in range(most - len(r))] for r in per_rank])


def _distribute_batches(
    lengths: Sequence[int], batches: list[list[int]], world_size: int, *, padding_free: bool = False
) -> PackPlan:
    if world_size == 1:
        return PackPlan(ranks=[batches])
    assignment = _lpt_assign([micro_batch_cost(lengths, b, padding_free=padding_free) for b in batches], world_size)
    return _equalise([[batches[k] for k in sorted(ks)] for ks in assignment])


def _greedy_area_assign(
    lengths: Sequence[int], world_size: int, max_items: int, max_padded_tokens: int
) -> list[list[int]]:
    # Longest first, each item onto the rank whose padded area grows least-loaded-after: joining a
    # rank's open micro-batch costs that batch's width (its first, longest row), opening one costs
    # the item's own length. Packs each rank first-fit-decreasing as it goes.
    areas = [0] * world_size
    open_width = [0] * world_size  # width of the rank's open micro-batch (0: none open)
    open_free = [0] * world_size  # free rows in it
    groups: list[list[int]] = [[] for _ in range(world_size)]
    for i in _sorted_desc(lengths):

        def after(r: int) -> int:
            return areas[r] + (open_width[r] if open_free[r] > 0 else lengths[i])

        r = min(range(world_size), key=lambda r: (after(r), len(groups[r]), r))
        if open_free[r] > 0:
            areas[r] += open_width[r]
            open_free[r] -= 1
        else:
            areas[r] += lengths[i]
            open_width[r] = lengths[i]
            open_free[r] = _capacity(lengths[i], max_items, max_padded_tokens) - 1
        groups[r].append(i)
    return groups


def _contiguous_assign(
    lengths: Sequence[int], world_size: int, max_items: int, max_padded_tokens: int
) -> list[list[int]]:
    # Split the longest-first order into `world_size` contiguous runs (similar lengths share a
    # rank, so little padding) with the smallest feasible cap on a run's first-fit-decreasing
    # area, found by bisection on the cap.
    order = _sorted_desc(lengths)

    def split(cap: int) -> list[list[int]] | None:
        groups: list[list[int]] = [[]]
        area = width = free = 0
        for i in order:
            cost = width if free > 0 else lengths[i]
            if area + cost > cap and groups[-1]:
                if len(groups) == world_size:
                    return None
                groups.append([])
                area = free = 0
                cost = lengths[i]
            if free > 0:
                free -= 1
            else:
                width, free = lengths[i], _capacity(lengths[i], max_items, max_padded_tokens) - 1
            area += cost
            groups[-1].append(i)
        return groups + [[] for _ in range(world_size - len(groups))]

    lo = max(max(lengths), -(-sum(lengths) // world_size))
    hi = sum(padded_area(lengths, b) for b in _ffd_batches(lengths, max_items, max_padded_tokens))
    while lo < hi:
        mid = (lo + hi) // 2
        if split(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return split(hi)  # type: ignore[return-value]


def _plan_score(plan: PackPlan, lengths: Sequence[int], padding_free: bool = False) -> tuple[int, int, int]:
    areas = [sum(micro_batch_cost(lengths, mb, padding_free=padding_free) for mb in rank) for rank in plan.ranks]
    return (max(areas, default=0), plan.num_micro_batches, sum(areas))


@PACKERS.register("ffd")
def ffd(
    lengths: Sequence[int],
    *,
    max_items: int,
    max_padded_tokens: int,
    world_size: int = 1,
    padding_free: bool = False,
    prefix_trees: Sequence[PrefixTree] | None = None,
) -> PackPlan:
    """First-fit decreasing by padded area (the reference heuristic); ``padding_free``: by tokens.

    With ``world_size > 1`` the micro-batches are spread over ranks, largest area first onto the
    least-loaded rank, and short ranks get dummies.

    Example: ``[8000, 7800] + [3000] * 10``, ``max_items=32``, ``max_padded_tokens=64_000`` -> 2
    micro-batches (8 rows x 8000, 4 rows x 3000), 76,000 padded tokens.

    Raises:
        PackingError: bad limits, or an item longer than ``max_padded_tokens``.
    """
    check_limits(lengths, max_items, max_padded_tokens, world_size)
    if prefix_trees is not None:
        return _with_trees(lengths, prefix_trees, max_items, max_padded_tokens, world_size, padding_free, "ffd")
    if padding_free:
        return _distribute_batches(
            lengths, _token_batches(lengths, max_items, max_padded_tokens), world_size, padding_free=True
        )
    return _distribute_batches(lengths, _ffd_batches(lengths, max_items, max_padded_tokens), world_size)


@PACKERS.register("optimal")
def optimal(
    lengths: Sequence[int],
    *,
    max_items: int,
    max_padded_tokens: int,
    world_size: int = 1,
    padding_free: bool = False,
    prefix_trees: Sequence[PrefixTree] | None = None,
) -> PackPlan:
    """Fewest micro-batches, then least padded area: exact, by a DP over the sorted lengths.

    ``padding_free``: fewest micro-batches by tokens (the tokens are then the same for every grouping); bin
    packing is NP-hard, so this is the better of first-fit and best-fit decreasing, not always the optimum.

    ``O(n * c)`` with ``c`` the largest micro-batch row capacity. Same example as :func:`ffd` -> 2
    micro-batches (2 x 8000, 10 x 3000), 46,000 padded tokens. Ranks as in :func:`ffd`.

    Raises:
        PackingError: bad limits, or an item longer than ``max_padded_tokens``.
    """
    check_limits(lengths, max_items, max_padded_tokens, world_size)
    if prefix_trees is not None:
        return _with_trees(lengths, prefix_trees, max_items, max_padded_tokens, world_size, padding_free, "optimal")
    if padding_free:
        return _distribute_batches(
            lengths, _fewest_token_batches(lengths, max_items, max_padded_tokens), world_size, padding_free=True
        )
    return _distribute_batches(lengths, _optimal_batches(lengths, max_items, max_padded_tokens), world_size)


@PACKERS.register("balanced")
def balanced(
    lengths: Sequence[int],
    *,
    max_items: int,
    max_padded_tokens: int,
    world_size: int = 1,
    area_tolerance: float = 0.01,
    padding_free: bool = False,
    prefix_trees: Sequence[PrefixTree] | None = None,
) -> PackPlan:
    """Per-rank micro-batches minimising the slowest rank's padded area.

    Tries five plans and keeps the best by (slowest rank's area, micro-batches per rank, total
    area): (1) the optimal global packing spread over ranks largest-first; (2) items assigned to
    ranks longest-first onto the rank with the fewest tokens; (3) items dealt round-robin in snake
    order by length; (4) items assigned longest-first to the rank whose padded area (first-fit
    decreasing within the rank) stays smallest; (5) the longest-first order cut into contiguous
    runs, one per rank, with the smallest feasible cap on a run's area (bisection); (2)-(5) are
    then packed optimally per rank. Among plans whose slowest rank is within ``area_tolerance``
    (relative) of the best, the one with the fewest micro-batches per rank wins: each pass has a
    fixed cost, and doubling the passes for a 0.3% smaller area is a bad trade. Every
    rank gets the same number of micro-batches (dummies pad the short ones). With ``world_size=1``
    it equals :func:`optimal`.

    Raises:
        PackingError: bad limits, or an item longer than ``max_padded_tokens``.
    """
    check_limits(lengths, max_items, max_padded_tokens, world_size)
    if prefix_trees is not None:
        return _with_trees(lengths, prefix_trees, max_items, max_padded_tokens, world_size, padding_free, "balanced")
    if padding_free:
        return _balanced_tokens(lengths, max_items, max_padded_tokens, world_size)
    if world_size == 1:
        return PackPlan(ranks=[_optimal_batches(lengths, max_items, max_padded_tokens)])

    def per_rank(groups: list[list[int]]) -> PackPlan:
        ranks = []
        for items in groups:
            sub = [lengths[i] for i in items]
            ranks.append([[items[k] for k in b] for b in _optimal_batches(sub, max_items, max_padded_tokens)])
        return _equalise(ranks)

    candidates = [_distribute_batches(lengths, _optimal_batches(lengths, max_items, max_padded_tokens), world_size)]
    candidates.append(per_rank([sorted(g) for g in _lpt_assign(lengths, world_size)]))
    snake: list[list[int]] = [[] for _ in range(world_size)]
    for pos, i in enumerate(_sorted_desc(lengths)):
        lap, k = divmod(pos, world_size)
        snake[k if lap % 2 == 0 else world_size - 1 - k].append(i)
    candidates.append(per_rank([sorted(g) for g in snake]))
    candidates.append(
        per_rank([sorted(g) for g in _greedy_area_assign(lengths, world_size, max_items, max_padded_tokens)])
    )
    if lengths:
        candidates.append(
            per_rank([sorted(g) for g in _contiguous_assign(lengths, world_size, max_items, max_padded_tokens)])
        )
    scores = [_plan_score(p, lengths) for p in candidates]
    best_area = min(sc[0] for sc in scores)
    near = [k for k, sc in enumerate(scores) if sc[0] <= best_area * (1.0 + area_tolerance)]
    return candidates[min(near, key=lambda k: (scores[k][1], scores[k][0], scores[k][2]))]


def _balanced_tokens(lengths: Sequence[int], max_items: int, budget: int, world_size: int) -> PackPlan:
    # Padding-free: the fewest micro-batches spread over ranks largest-first, or items spread over ranks
    # by tokens (longest first onto the lightest rank) and packed per rank; the slowest rank's tokens
    # decide, then micro-batches per rank.
    if world_size == 1:
        return PackPlan(ranks=[_fewest_token_batches(lengths, max_items, budget)])
    candidates = [
        _distribute_batches(lengths, _fewest_token_batches(lengths, max_items, budget), world_size, padding_free=True)
    ]
    ranks = []
    for items in _lpt_assign(lengths, world_size):
        items = sorted(items)
        ranks.append(
            [[items[k] for k in b] for b in _fewest_token_batches([lengths[i] for i in items], max_items, budget)]
        )
    candidates.append(_equalise(ranks))
    return min(candidates, key=lambda p: _plan_score(p, lengths, padding_free=True)[:2])


class _Bin:
    """An open micro-batch's aggregates, enough to price adding a tree in O(1): an upper bound of its
    :func:`tree_area` (lone items priced as branches)."""

    __slots__ = ("trees", "shared", "width", "rows", "branch")

    def __init__(self) -> None:
        self.trees: list[PrefixTree] = []
        self.shared = self.width = self.rows = self.branch = 0

    def area_with(self, tree: PrefixTree, branch: int) -> int:
        shared = self.shared + (tree.prefix_len > 0)
        return shared * max(self.width, tree.prefix_len) + (self.rows + len(tree.members)) * max(self.branch, branch, 1)

    def add(self, tree: PrefixTree, branch: int) -> None:
        self.trees.append(tree)
        self.shared += tree.prefix_len > 0
        self.width = max(self.width, tree.prefix_len)
        self.rows += len(tree.members)
        self.branch = max(self.branch, branch)

    @property
    def area(self) -> int:
        return self.shared * self.width + self.rows * max(self.branch, 1)

    def items(self) -> list[int]:
        return [i for t in self.trees for i in t.members]


def _tree_chunks(lengths: Sequence[int], trees: Sequence[PrefixTree], max_items: int, budget: int) -> list[PrefixTree]:
    # A tree too big for one micro-batch is cut into chunks with the same prefix (each forwards it again): members
    # longest branch first, each chunk as full as the limits allow. A member alone always fits (its area is at most
    # its length, which the caller checked against the budget).
    out = []
    for tree in trees:
        chunk: list[int] = []
        for i in sorted(tree.members, key=lambda i: (-lengths[i], i)):
            candidate = PrefixTree(tree.prefix_len, tuple(chunk + [i]))
            if chunk and (len(candidate.members) > max_items or tree_area(lengths, [candidate]) > budget):
                out.append(_chunk(tree.prefix_len, chunk))
                chunk = []
            chunk.append(i)
        out.append(_chunk(tree.prefix_len, chunk))
    return out


def _chunk(prefix_len: int, members: list[int]) -> PrefixTree:
    # A chunk of one member shares nothing: it is forwarded whole, as a branch.
    return PrefixTree(prefix_len if len(members) > 1 else 0, tuple(sorted(members)))


def _tree_bins(
    lengths: Sequence[int], chunks: Sequence[PrefixTree], max_items: int, budget: int, *, best_fit: bool
) -> list[_Bin]:
    # First-fit (or best-fit: the fullest) decreasing by a chunk's own area.
    bins: list[_Bin] = []
    for chunk in sorted(chunks, key=lambda c: (-tree_area(lengths, [c]), c.members[0])):
        branch = max(lengths[i] - chunk.prefix_len for i in chunk.members)
        fits = [b for b in bins if b.rows + len(chunk.members) <= max_items and b.area_with(chunk, branch) <= budget]
        if fits:
            target = max(fits, key=lambda b: b.area) if best_fit else fits[0]
        else:
            target = _Bin()
            bins.append(target)
        target.add(chunk, branch)
    return bins


def _tree_plan_score(plan: PackPlan, lengths: Sequence[int], trees_of: dict[int, PrefixTree]) -> tuple[int, int, int]:
    areas = []
    for rank in plan.ranks:
        total = 0
        for mb in rank:
            if mb:
                inside = {trees_of[i] for i in mb}
                total += tree_area(lengths, list(inside))
        areas.append(total)
    return max(areas, default=0), plan.num_micro_batches, sum(areas)


def pack_trees(
    lengths: Sequence[int],
    trees: Sequence[PrefixTree],
    *,
    max_items: int,
    max_padded_tokens: int,
    world_size: int = 1,
    strategy: str = "optimal",
) -> PackPlan:
    """Micro-batches that keep each tree's members together, budgeted by
    :func:`~trl_plugins.packing.prefix_trees.tree_area`: the built-in packers' planner given ``prefix_trees``.

    Trees that do not fit one micro-batch are cut into chunks sharing the prefix. ``strategy``: ``"ffd"`` first-fit
    decreasing by area; ``"optimal"`` the better of first-fit and best-fit (fewest micro-batches, then least area);
    ``"balanced"`` also tries spreading chunks over the ranks before packing each rank, and keeps the plan whose
    slowest rank processes the least. Across ranks micro-batches go largest first to the least-loaded rank, and
    short ranks get dummies. The caller checks the limits (:func:`~trl_plugins.packing.check_limits`).
    """
    chunks = _tree_chunks(lengths, trees, max_items, max_padded_tokens)
    trees_of = {i: c for c in chunks for i in c.members}
    plans = [_tree_bins(lengths, chunks, max_items, max_padded_tokens, best_fit=False)]
    if strategy != "ffd":
        plans.append(_tree_bins(lengths, chunks, max_items, max_padded_tokens, best_fit=True))
    bins = min(plans, key=lambda p: (len(p), sum(b.area for b in p)))
    batches = [b.items() for b in bins]
    if world_size == 1:
        return PackPlan(ranks=[batches])
    candidates = [
        _equalise([[batches[k] for k in sorted(ks)] for ks in _lpt_assign([b.area for b in bins], world_size)])
    ]
    if strategy == "balanced":
        per_rank = []
        for ks in _lpt_assign([tree_area(lengths, [c]) for c in chunks], world_size):
            mine = [chunks[k] for k in sorted(ks)]
            per_rank.append([b.items() for b in _tree_bins(lengths, mine, max_items, max_padded_tokens, best_fit=True)])
        candidates.append(_equalise(per_rank))
    return min(candidates, key=lambda p: _tree_plan_score(p, lengths, trees_of))


def _with_trees(
    lengths: Sequence[int],
    trees: Sequence[PrefixTree],
    max_items: int,
    max_padded_tokens: int,
    world_size: int,
    padding_free: bool,
    strategy: str,
) -> PackPlan:
    if padding_free:
        raise PackingError(BOTH_LAYOUTS)
    members = sorted(i for t in trees for i in t.members)
    if members != list(range(len(lengths))):
        raise PackingError(f"prefix_trees must partition the {len(lengths)} items (each index in exactly one tree).")
    for t in trees:
        if t.prefix_len < 0 or any(t.prefix_len > lengths[i] for i in t.members):
            raise PackingError(f"prefix tree {t} has a prefix longer than one of its members (or negative).")
    return pack_trees(
        lengths,
        trees,
        max_items=max_items,
        max_padded_tokens=max_padded_tokens,
        world_size=world_size,
        strategy=strategy,
    )


for _packer in (ffd, optimal, balanced):
    _packer.supports_padding_free = True  # type: ignore[attr-defined]
    _packer.supports_prefix_trees = True  # type: ignore[attr-defined]
