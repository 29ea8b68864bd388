"""Packers: reference examples, exactness of `optimal` against brute force, rank balance, inverse."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_plugins.contracts import plan_violations
from trl_plugins.packing import (
    PackingError,
    inverse_permutation,
    pack,
    pack_for_ranks,
    padded_area,
    restore_order,
)
from trl_plugins.registry import PACKERS
from trl_plugins.types import PackPlan

REFERENCE = [8000, 7800] + [3000] * 10


def total_area(lengths, batches) -> int:
    return sum(padded_area(lengths, b) for b in batches)


def test_checker_catches_bad_plans():
    # Negative control for plan_violations: each defect is reported.
    lengths = [5, 5, 5]
    assert plan_violations(PackPlan([[[0, 1, 2]]]), lengths, 2, 100, 1) == ["rank 0 mb 0: 3 items > 2"]
    assert plan_violations(PackPlan([[[0, 1, 2]]]), lengths, 3, 14, 1) == ["rank 0 mb 0: area 15 > 14"]
    assert plan_violations(PackPlan([[[0, 1]]]), lengths, 3, 100, 1) == ["not a partition of the items"]
    assert plan_violations(PackPlan([[[0]], [[1], [2]]]), lengths, 3, 100, 2) == ["unequal micro-batch counts [1, 2]"]


def test_ffd_reference_example():
    batches = pack(REFERENCE, strategy="ffd", max_items=32, max_padded_tokens=64_000)
    # 8000 opens a batch that holds 64000 // 8000 = 8 rows: 8000, 7800 and six 3000s -> 8 x 8000.
    # The other four 3000s -> 4 x 3000. Total 64,000 + 12,000 = 76,000.
    assert batches == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]
    assert total_area(REFERENCE, batches) == 76_000


def test_optimal_reference_example():
    batches = pack(REFERENCE, strategy="optimal", max_items=32, max_padded_tokens=64_000)
    # 2 x 8000 = 16,000 and 10 x 3000 = 30,000: still 2 micro-batches, 46,000 padded tokens.
    assert batches == [[0, 1], list(range(2, 12))]
    assert total_area(REFERENCE, batches) == 46_000


@pytest.mark.parametrize("strategy", ["ffd", "optimal", "balanced"])
def test_item_longer_than_budget_is_an_error(strategy):
    with pytest.raises(
        PackingError, match=r"item 2 has length 70000, longer than the micro-batch budget max_padded_tokens=64000"
    ):
        pack([10, 20, 70_000], strategy=strategy, max_items=4, max_padded_tokens=64_000)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(max_items=0, max_padded_tokens=10), "max_items must be >= 1"),
        (dict(max_items=1, max_padded_tokens=0), "max_padded_tokens must be >= 1"),
    ],
)
def test_bad_limits_are_errors(kwargs, msg):
    with pytest.raises(PackingError, match=msg):
        pack([1], strategy="ffd", **kwargs)


def test_non_positive_length_is_an_error():
    with pytest.raises(PackingError, match="item 1 has length 0"):
        pack([3, 0], strategy="optimal", max_items=2, max_padded_tokens=10)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1 :]
        yield [[first]] + part


def _brute_force_best(lengths, max_items, budget):
    best = None
    for part in _set_partitions(list(range(len(lengths)))):
        if all(len(b) <= max_items and padded_area(lengths, b) <= budget for b in part):
            key = (len(part), total_area(lengths, part))
            best = key if best is None or key < best else best
    return best


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    max_items=st.integers(1, 5),
    budget=st.integers(12, 40),
)
def test_optimal_matches_brute_force(lengths, max_items, budget):
    batches = pack(lengths, strategy="optimal", max_items=max_items, max_padded_tokens=budget)
    assert plan_violations(PackPlan([batches]), lengths, max_items, budget, 1) == []
    assert (len(batches), total_area(lengths, batches)) == _brute_force_best(lengths, max_items, budget)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=0, max_size=80),
    max_items=st.integers(1, 16),
    world_size=st.integers(1, 4),
    strategy=st.sampled_from(["ffd", "optimal", "balanced"]),
)
def test_every_packer_gives_a_valid_plan_and_round_trips(lengths, max_items, world_size, strategy):
    budget = 8000
    plan = pack_for_ranks(
        lengths, strategy=strategy, max_items=max_items, max_padded_tokens=budget, world_size=world_size
    )
    assert plan_violations(plan, lengths, max_items, budget, world_size) == []
    batches = [mb for rank in plan.ranks for mb in rank]
    assert restore_order(batches, [[lengths[i] for i in b] for b in batches]) == lengths


def test_optimal_never_worse_than_ffd():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [int(rng.paretovariate(1.2) * 200) % 7000 + 1 for _ in range(rng.randint(1, 300))]
        f = pack(lengths, strategy="ffd", max_items=32, max_padded_tokens=16_000)
        o = pack(lengths, strategy="optimal", max_items=32, max_padded_tokens=16_000)
        assert (len(o), total_area(lengths, o)) <= (len(f), total_area(lengths, f))


def test_restore_order_inverts_packing_and_detects_a_wrong_inverse():
    lengths = [4, 9, 1, 7, 3, 8]
    batches = pack(lengths, strategy="optimal", max_items=2, max_padded_tokens=16)
    assert [i for b in batches for i in b] != list(range(6))  # the packing really permutes
    per_batch = [[f"item{i}" for i in b] for b in batches]
    assert restore_order(batches, per_batch) == [f"item{i}" for i in range(6)]
    # Negative control: reading the values back in packed order is not the original order.
    assert [v for vs in per_batch for v in vs] != [f"item{i}" for i in range(6)]
    with pytest.raises(ValueError, match="not a partition"):
        inverse_permutation([[0, 1], [1]])


def test_balanced_spreads_items_over_ranks_with_dummies():
    # Two items on two ranks: one each, not both on one rank with a dummy on the other.
    plan = pack_for_ranks([50, 40], strategy="balanced", max_items=8, max_padded_tokens=1000, world_size=2)
    assert sorted(plan.ranks) == [[[0]], [[1]]]
    # Three items, two ranks, one item per micro-batch: one rank gets a dummy micro-batch.
    plan = pack_for_ranks([50, 40, 30], strategy="balanced", max_items=1, max_padded_tokens=1000, world_size=2)
    assert plan.num_micro_batches == 2 and plan.num_dummies() == 1
    assert max(plan.rank_padded_area([50, 40, 30])) == 70  # {50} + dummy vs {40, 30}
    # Fewer items than ranks: every rank still gets the same count.
    plan = pack_for_ranks([5], strategy="balanced", max_items=8, max_padded_tokens=1000, world_size=3)
    assert [len(r) for r in plan.ranks] == [1, 1, 1] and plan.num_dummies() == 2


def test_balanced_beats_spreading_the_global_packing():
    rng = random.Random(7)
    for _ in range(20):
        lengths = [rng.choice([rng.randint(50, 400), rng.randint(2000, 6000)]) for _ in range(rng.randint(8, 200))]
        kw = dict(max_items=16, max_padded_tokens=24_000, world_size=4)
        slowest = {
            s: max(pack_for_ranks(lengths, strategy=s, **kw).rank_padded_area(lengths))
            for s in ("ffd", "optimal", "balanced")
        }
        # Within the 1% area tolerance that balanced trades for fewer micro-batches.
        assert slowest["balanced"] <= 1.01 * min(slowest["ffd"], slowest["optimal"])
        assert slowest["balanced"] >= max(max(lengths), sum(lengths) / 4)  # the lower bound holds


def test_balanced_groups_long_items_on_one_rank_when_that_is_cheaper():
    # 4 long + 12 short items, 2 ranks, one micro-batch holds everything a rank gets.
    # Spreading the optimal single micro-batch per rank: each rank gets 2 long + 6 short -> 8 x 100.
    # Putting the 4 long items together: rank 0: 4 x 100 = 400, rank 1: 12 x 10 = 120.
    lengths = [100] * 4 + [10] * 12
    plan = pack_for_ranks(lengths, strategy="balanced", max_items=16, max_padded_tokens=10_000, world_size=2)
    assert sorted(plan.rank_padded_area(lengths)) == [120, 400]


def test_all_packers_are_registered_and_deterministic():
    lengths = [random.Random(5).randint(1, 500) for _ in range(100)]
    for name in ("ffd", "optimal", "balanced"):
        packer = PACKERS.get(name)
        a = packer(lengths, max_items=8, max_padded_tokens=2000, world_size=2)
        b = packer(list(lengths), max_items=8, max_padded_tokens=2000, world_size=2)
        assert a == b
