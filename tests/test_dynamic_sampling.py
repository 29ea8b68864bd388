"""DAPO's dynamic sampling: the pure decisions against the paper's rule (and verl's), the batch-level stage of the
step (what it keeps, drops, draws and reports), and the update it feeds: exactly the one-batch loss over the kept
groups. The two-rank runs (DDP, ZeRO-3) equal to one process are in tests/test_distributed.py
(``dynamic-sampling``)."""

from __future__ import annotations

import copy
import json
import math
import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import make_trajectory, rel_err
from trl_plugins.algos import choose_groups, draw_rows, informative_groups, rank_share, refill_size
from trl_plugins.algos.dynamic_sampling import plan_fill, plan_round, refill_share
from trl_plugins.types import LeftOutReason, RewardComponent

# -- the group rule ----------------------------------------------------------------------------------------------


def test_informative_groups_by_hand():
    # group 0: 1, 1, 1 -> all equal; group 1: 0, 1 -> informative; group 2: 0.5, 0.5 but the second left out, so one
    # member -> not; group 3: -0.0 and 0.0 are equal -> not; group 4: no member -> not.
    values = [1, 1, 1, 0, 1, 0.5, 0.2, -0.0, 0.0]
    groups = [0, 0, 0, 1, 1, 2, 2, 3, 3]
    trained = [True] * 9
    trained[6] = False
    assert informative_groups(values, groups, trained, 5) == [False, True, False, False, False]
    # The member left out no longer counts: 0.5 vs 0.2 would have made group 2 informative.
    assert informative_groups(values, groups, [True] * 9, 5)[2] is True


def test_informative_groups_refuse_mismatched_inputs():
    with pytest.raises(ValueError, match="one group id and one trained flag per value"):
        informative_groups([1.0, 2.0], [0], [True, True], 1)
    with pytest.raises(ValueError, match="outside range"):
        informative_groups([1.0], [3], [True], 2)


def _dapo_keeps(correct: list[int]) -> bool:
    """DAPO eq. 11: 0 < |{o_i : is_equivalent(a, o_i)}| < G."""
    return 0 < sum(correct) < len(correct)


def _verl_keeps(metric: list[float]) -> bool:
    """verl's DAPO recipe: std of the group's metric > 0 (it also keeps a group of one, which the config refuses)."""
    return bool(np.std(metric) > 0) or len(metric) == 1


@pytest.mark.parametrize("seed", range(5))
def test_the_rule_is_dapo_for_outcomes_and_verl_for_any_metric(seed):
    rng = random.Random(seed)
    for _ in range(200):
        size = rng.randint(2, 8)
        correct = [rng.random() < rng.choice([0.0, 0.3, 0.9, 1.0]) for _ in range(size)]
        assert informative_groups([float(c) for c in correct], [0] * size, [True] * size, 1) == [_dapo_keeps(correct)]
        graded = [rng.choice([0.0, 0.25, 0.5, 1.0, -1.0]) for _ in range(size)]  # ties are common
        assert informative_groups(graded, [0] * size, [True] * size, 1) == [_verl_keeps(graded)]


# -- the global choice, the refill size and the draws -------------------------------------------------------------


def test_choose_groups_keeps_the_first_informative_groups_in_global_order():
    # Rank 0 holds groups a b c, rank 1 holds d e; informative: a, c, d, e; 3 wanted -> a, c, d.
    assert choose_groups([[True, False, True], [True, True]], 3) == [[True, False, True], [True, False]]
    assert choose_groups([[True, True], [True]], 0) == [[False, False], [False]]
    assert choose_groups([[False], [True]], 5) == [[False], [True]]
    with pytest.raises(ValueError):
        choose_groups([[True]], -1)


@pytest.mark.parametrize("seed", range(3))
def test_the_kept_groups_do_not_depend_on_the_number_of_ranks(seed):
    # One round's global stream of groups split over 1-5 ranks as the trainer splits a refill round: the groups kept
    # are the stream's first `wanted` informative ones, whatever the split.
    rng = random.Random(seed)
    for _ in range(50):
        stream = [rng.random() < 0.4 for _ in range(rng.randint(1, 20))]
        wanted = rng.randint(0, len(stream))
        expected = [i for i, f in enumerate(stream) if f][:wanted]
        for world in range(1, 6):
            shares = [rank_share(len(stream), r, world) for r in range(world)]
            keep = choose_groups([[stream[i] for i in s] for s in shares], wanted)
            kept = [i for s, k in zip(shares, keep) for i, flag in zip(s, k) if flag]
            assert kept == expected
    # Negative control: each rank keeping its own share of `wanted` is not the same choice.
    stream, wanted = [True, True, True, False, False, False], 2
    naive = [i for s in (range(0, 3), range(3, 6)) for i in [j for j in s if stream[j]][:1]]
    assert naive != [0, 1]


def test_rank_share_partitions_in_rank_order():
    for count in range(0, 12):
        for world in range(1, 5):
            shares = [rank_share(count, r, world) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(count))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_refill_size_by_hand():
    # 6 missing, 4 informative of 8 drawn: 6 * 8 / 4 = 12 more, but a round is at most the step's 8 groups.
    assert refill_size(missing=6, drawn=8, informative=4, per_round=8, budget=100) == 8
    # 2 missing at a share of 1/2: 4; the budget leaves 3.
    assert refill_size(missing=2, drawn=8, informative=4, per_round=8, budget=3) == 3
    # none informative yet: as if one had been, 1 * 8 = 8 for one missing group.
    assert refill_size(missing=1, drawn=8, informative=0, per_round=8, budget=100) == 8
    # at least what is missing; a budget of one group still gives a round of one (the ranks add fillers).
    assert refill_size(missing=3, drawn=8, informative=8, per_round=8, budget=100) == 3
    assert refill_size(missing=5, drawn=8, informative=1, per_round=8, budget=1) == 1
    # nothing missing, or nothing left of the budget: no round.
    assert refill_size(missing=0, drawn=8, informative=0, per_round=8, budget=100) == 0
    assert refill_size(missing=5, drawn=8, informative=1, per_round=8, budget=0) == 0


def test_plan_by_hand():
    # 4 groups wanted, cap 1.25 x 4 = 5 groups. First round: informative a, c -> kept; 2 missing at a share of 2/4:
    # 4 more, but the budget leaves 1 -> the refill round counts 1 group, from the stream's start.
    plan = plan_fill(4, 1.25)
    assert (plan.budget, plan.next_count) == (5, 4)
    plan, keep = plan_round(plan, [True, False, True, False])
    assert keep == [True, False, True, False]
    assert (plan.rounds, plan.drawn, plan.informative, plan.kept) == (1, 4, 2, 2)
    assert (plan.next_count, plan.next_start) == (1, 0)
    # On 2 ranks the round draws 2 rows, stream positions 0 (counted, rank 0) and 1 (a filler, rank 1); on 3 ranks 3.
    assert [refill_share(plan, r, 2) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [refill_share(plan, r, 3) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert refill_share(plan, 0, 1) == range(0, 1)
    # The counted group is informative: kept; the budget is spent, the step is one group short.
    plan, keep = plan_round(plan, [True])
    assert keep == [True] and (plan.drawn, plan.kept, plan.next_count) == (5, 3, 0)
    with pytest.raises(ValueError, match="counts 0 groups"):
        plan_round(plan, [])
    with pytest.raises(ValueError, match="max_groups >= 1"):
        plan_fill(4, 0.5)


CAPS = (1.0, 1.25, 1.5, 2.25, 3.0)


def _step_case(seed: int) -> tuple[int, list[bool], list[int]]:
    """A dataset of ``num_rows`` rows, each informative or not (its group's rewards as a function of the row), and
    the rows of the step's first round in global order (3-12 groups: at least one per rank for up to 3 ranks)."""
    rng = random.Random(seed)
    num_rows = rng.randint(4, 30)
    share = rng.choice([0.05, 0.2, 0.4, 0.6, 0.9])
    informative = [rng.random() < share for _ in range(num_rows)]
    return num_rows, informative, [rng.randrange(num_rows) for _ in range(rng.randint(3, 12))]


def _kept_rows(case, cap: float, world: int, seed: int):
    """The step's kept rows in global order on ``world`` simulated ranks, driving the planner as ``StepRunner.fill``
    does (each rank's flags gathered in rank order, the round's first ``next_count`` groups counted), and the rows
    each refill round drew over the ranks."""
    num_rows, informative, first = case
    plan = plan_fill(len(first), cap)
    by_rank = [[first[i] for i in rank_share(len(first), r, world)] for r in range(world)]
    kept, drawn_per_round = [], []
    while True:
        in_order = [row for rows in by_rank for row in rows]
        counted = plan.next_count
        plan, keep = plan_round(plan, [informative[row] for row in in_order[:counted]])
        kept += [row for row, k in zip(in_order, keep) if k]
        if plan.next_count == 0:
            return kept, plan, drawn_per_round
        shares = [refill_share(plan, r, world) for r in range(world)]
        by_rank = [draw_rows(num_rows, s.start, len(s), seed=seed) for s in shares]
        drawn_per_round.append(sum(map(len, by_rank)))


def _kept_rows_before_issue_49(case, cap: float, world: int, seed: int) -> list[int]:
    """The loop of ``StepRunner.fill`` before issue 49: every group drawn counted, and no refill round once the
    budget left fewer groups than ranks (``refill_size(..., minimum=world)`` returned 0)."""
    num_rows, informative, first = case
    target = len(first)
    budget, kept, drawn, seen, k = int(cap * target + 1e-9), [], 0, 0, 0
    by_rank = [[first[i] for i in rank_share(target, r, world)] for r in range(world)]
    while True:
        keep = choose_groups([[informative[row] for row in rows] for rows in by_rank], target - k)
        kept += [row for rows, ks in zip(by_rank, keep) for row, kk in zip(rows, ks) if kk]
        drawn += sum(map(len, by_rank))
        seen += sum(informative[row] for rows in by_rank for row in rows)
        k += sum(map(sum, keep))
        missing, left = target - k, budget - drawn
        if missing <= 0 or left < world:
            return kept
        count = min(max(missing, math.ceil(missing * drawn / max(seen, 1)), world), max(target, world), left)
        by_rank = [
            draw_rows(num_rows, drawn - target + s.start, len(s), seed=seed)
            for s in (rank_share(count, r, world) for r in range(world))
        ]


def test_the_kept_groups_of_a_step_do_not_depend_on_the_number_of_ranks():
    # 40 seeded steps x 5 caps, each on 1, 2 and 3 simulated ranks: the same rows kept in the same global order, the
    # same plan (rounds, groups counted, informative, kept), every rank drawing in every refill round, the counted
    # groups within the cap, and no more than world - 1 fillers per round.
    differing_before = 0
    for seed in range(40):
        case = _step_case(seed)
        for cap in CAPS:
            kept, plan, _ = _kept_rows(case, cap, 1, seed)
            assert plan.drawn <= plan.budget == int(cap * len(case[2]) + 1e-9)
            for world in (2, 3):
                kept_w, plan_w, drawn_w = _kept_rows(case, cap, world, seed)
                assert (kept_w, plan_w) == (kept, plan), (seed, cap, world)
                fillers = sum(drawn_w) - (plan.drawn - plan.target)
                assert all(world <= d for d in drawn_w) and 0 <= fillers <= (world - 1) * len(drawn_w)
            before = [_kept_rows_before_issue_49(case, cap, world, seed) for world in (1, 2, 3)]
            assert before[0] == kept  # one rank: the old loop made the same choice
            differing_before += before[1] != before[0] or before[2] != before[0]
    # Negative control: the loop before issue 49 kept other groups on 2 or 3 ranks than on 1 for some of these steps.
    assert differing_before >= 5, differing_before


def test_draw_rows_is_a_stream_of_permutations():
    first = draw_rows(10, 0, 25, seed=7)
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert draw_rows(10, 0, 4, seed=7) + draw_rows(10, 4, 9, seed=7) + draw_rows(10, 13, 12, seed=7) == first
    assert draw_rows(10, 0, 10, seed=8) != first[:10]  # another step draws other rows
    with pytest.raises(ValueError, match="empty dataset"):
        draw_rows(0, 0, 1, seed=0)


# -- the stage in the step ----------------------------------------------------------------------------------------


def _round(rewards: list[list[float]], *, start: int, world_failure: tuple[int, int] | None = None):
    """A scored round: one group per entry of ``rewards`` (each a list of member rewards), rows named by number."""
    from trl_plugins.rollout import RolloutResult
    from trl_plugins.trainers.phases import StepBatch
    from trl_plugins.types import StopReason

    rng = random.Random(start)
    trajs, left_out = [], []
    for g, members in enumerate(rewards):
        for k, r in enumerate(members):
            failed = world_failure == (g, k)
            t = make_trajectory(
                rng,
                num_turns=1,
                group_id=g,
                sample_index=k,
                stop_reason=StopReason.ENVIRONMENT_ERROR if failed else StopReason.FINAL_ANSWER,
            )
            t.reward_components = (
                [] if failed else [RewardComponent("correct", r, 1.0), RewardComponent("format", 0.1 * k, 1.0)]
            )
            trajs.append(t)
            left_out.append(LeftOutReason.WORLD_FAILURE if failed else None)
    rows = [{"prompt": f"row {start + g}"} for g in range(len(rewards))]
    result = RolloutResult(trajs, rounds=1, total_s=1.0, generation_s=1.0, critical_path_s=0.5)
    return result, StepBatch(
        0, rows, trajs, left_out, [], metrics={"reward/verifier_error_rate": 0.0, "timing/scoring_s": 0.25}
    )


def _runner(dynamic_sampling_metric="correct", dynamic_sampling_max_groups=3.0):
    from trl_plugins.run.settings import DynamicSampling, Features
    from trl_plugins.trainers.phases import StepRunner

    settings = DynamicSampling(metric=dynamic_sampling_metric, max_groups=dynamic_sampling_max_groups)
    cfg = SimpleNamespace(num_generations=2, features=Features(async_rollouts=None, dynamic_sampling=settings))
    accelerator = SimpleNamespace(num_processes=1, process_index=0, device="cpu")
    return StepRunner(SimpleNamespace(config=cfg), accelerator, pad_token_id=0)


def test_fill_keeps_informative_groups_and_refills_in_order():
    # First round: 4 groups, informative: 1 and 3 (group 2 lost a member to the world: one left, not informative).
    # Refill 1 (size 4 * 4 / 2 = 8 capped at the step's 4): rows 0-3 of the draw: groups 1 and 2 informative -> full.
    first = _round([[1, 1], [0, 1], [1, 0], [1, 0]], start=0, world_failure=(2, 0))
    refills = {1: [[0, 0], [1, 0], [0, 1], [0, 1]]}
    asked = []

    def sample(indices, round_index, id_offset):
        asked.append((list(indices), round_index, id_offset))
        return _round(refills[round_index], start=100 * round_index)

    batch = _runner().fill(*first, sample=sample, num_rows=50, seed=3)
    assert asked == [(draw_rows(50, 0, 4, seed=3), 1, 4)]  # question ids after the first round's 4 rows
    # 8 groups in the merged batch, their group ids renumbered in round order, one row each.
    assert len(batch.rows) == 8 and [t.group_id for t in batch.trajectories] == [g for g in range(8) for _ in range(2)]
    assert batch.rows[4] == {"prompt": "row 100"}
    reasons = [r and r.value for r in batch.left_out]
    assert (
        reasons
        == ["equal_rewards"] * 2
        + [None] * 2
        + ["world_failure", "equal_rewards"]
        + [None] * 2
        + ["equal_rewards"] * 2
        + [None] * 2
        + [None] * 2
        + ["surplus"] * 2
    )
    m = batch.metrics
    assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/groups_drawn"], m["dynamic_sampling/kept_groups"]) == (
        2,
        8,
        4,
    )
    assert m["dynamic_sampling/short_groups"] == 0 and m["dynamic_sampling/surplus_groups"] == 1
    assert m["dynamic_sampling/informative_frac"] == pytest.approx(5 / 8) and m["dynamic_sampling/draw_factor"] == 2
    # The two rounds as one rollout: times add up; scoring time too.
    assert m["timing/rollout_s"] == 2.0 and m["rollout/critical_path_s"] == 1.0 and m["timing/scoring_s"] == 0.5


def test_fill_stops_at_the_cap_and_trains_on_what_it_kept():
    # Nothing informative ever: the cap of 1.5 x 4 groups allows one refill round of 2 groups, then the step is short.
    first = _round([[1, 1]] * 4, start=0)
    calls = []

    def sample(indices, round_index, id_offset):
        calls.append(len(indices))
        return _round([[0, 0]] * len(indices), start=100 * round_index)

    batch = _runner(dynamic_sampling_max_groups=1.5).fill(*first, sample=sample, num_rows=50, seed=0)
    assert calls == [2]
    assert all(r == LeftOutReason.EQUAL_REWARDS for r in batch.left_out)
    assert batch.metrics["dynamic_sampling/short_groups"] == 4 and batch.metrics["dynamic_sampling/groups_drawn"] == 6


def test_fill_compares_the_configured_metric():
    # Equal outcomes, different format rewards: informative under the total reward, not under 'correct'.
    for metric, kept in (("correct", 0.0), ("reward", 1.0)):
        first = _round([[1, 1]], start=0)
        batch = _runner(dynamic_sampling_metric=metric, dynamic_sampling_max_groups=1.0).fill(
            *first, sample=None, num_rows=1, seed=0
        )
        assert batch.metrics["dynamic_sampling/kept_groups"] == kept


class _SimulatedRanks:
    """Threads standing for ranks, and the two collectives ``StepRunner.fill`` makes (a sum, a gather) between them."""

    def __init__(self, world: int) -> None:
        self.barrier, self.slots = threading.Barrier(world, timeout=30), [None] * world

    def gather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody writes the next round's value before everyone has read this one
        return out


def _row_round(rows: list[int], informative: list[bool]):
    """A scored round of the dataset rows ``rows``: rewards 0, 1 for an informative row, 1, 1 otherwise."""
    result, batch = _round([[0, 1] if informative[row] else [1, 1] for row in rows], start=0)
    batch.rows = [{"prompt": f"row {row}"} for row in rows]
    return result, batch


def _fill_on_ranks(case, cap: float, world: int, seed: int) -> list:
    """``StepRunner.fill`` on ``world`` simulated ranks: each rank's merged batch, in rank order."""
    num_rows, informative, first = case
    ranks = _SimulatedRanks(world)

    def rank_main(rank: int):
        runner = _runner(dynamic_sampling_max_groups=cap)
        runner.accelerator = SimpleNamespace(num_processes=world, process_index=rank, device="cpu", ranks=ranks)
        mine = [first[i] for i in rank_share(len(first), rank, world)]
        return runner.fill(
            *_row_round(mine, informative),
            sample=lambda rows, *_: _row_round(rows, informative),
            num_rows=num_rows,
            seed=seed,
        )

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_main, range(world)))


def test_fill_keeps_the_same_groups_on_one_two_and_three_simulated_ranks(monkeypatch):
    # The real stage on 1, 2 and 3 ranks (threads, their collectives in memory) for 12 seeded steps x 5 caps: the same
    # rows kept (those the planner's simulation keeps), the same dynamic_sampling/* figures but the fillers, and every
    # filler group left out as such.
    from trl_plugins.trainers import phases

    def gather(accelerator, flags):
        return [list(f) for f in accelerator.ranks.gather(accelerator.process_index, list(flags))]

    def reduce_sum(accelerator, values, op):
        assert op == "sum"
        return [float(sum(v)) for v in zip(*accelerator.ranks.gather(accelerator.process_index, list(values)))]

    monkeypatch.setattr(phases, "_gather_lists", gather)
    monkeypatch.setattr(phases, "reduce_over_ranks", reduce_sum)
    differing, fillers_seen = [], 0
    for seed in range(12):
        case = _step_case(seed)
        for cap in CAPS:
            expected = Counter(f"row {row}" for row in _kept_rows(case, cap, 1, seed)[0])
            figures = None
            for world in (1, 2, 3):
                batches = _fill_on_ranks(case, cap, world, seed)
                kept = Counter(
                    b.rows[t.group_id]["prompt"]
                    for b in batches
                    for t, reason in zip(b.trajectories, b.left_out)
                    if reason is None and not t.sample_index
                )
                mine = {k: v for k, v in batches[0].metrics.items() if k.startswith("dynamic_sampling/")}
                fillers = mine.pop("dynamic_sampling/filler_groups")
                assert all({k: v for k, v in b.metrics.items() if k in mine} == mine for b in batches)
                left_as_filler = sum(r == LeftOutReason.FILLER for b in batches for r in b.left_out)
                assert left_as_filler == 2 * fillers and (fillers == 0 or world > 1)
                fillers_seen += fillers
                figures = figures or mine
                if kept != expected or mine != figures:
                    differing.append((seed, cap, world))
    assert not differing, f"{len(differing)} of {12 * len(CAPS) * 3} (seed, cap, world) cases differ: {differing}"
    assert fillers_seen > 0  # the cases reach rounds that count fewer groups than there are ranks


# -- the config --------------------------------------------------------------------------------------------------


def _config(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=0.5,
        optim="sgd",
        max_grad_norm=0.0,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
        reward_components=["slot"],
        max_padded_tokens_per_micro_batch=4000,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        dynamic_sampling=True,
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dynamic_sampling": False, "dynamic_sampling_metric": "slot"}, "configure dynamic sampling, which is off"),
        ({"dynamic_sampling": False, "dynamic_sampling_max_groups": 5.0}, "configure dynamic sampling, which is off"),
        ({"dynamic_sampling_metric": "slots"}, "Did you mean 'slot'"),
        ({"dynamic_sampling_max_groups": 0.5}, "must be >= 1"),
    ],
)
def test_config_refuses_what_dynamic_sampling_cannot_honour(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_trainer_refuses_a_streamed_training_set(tmp_path):
    from datasets import IterableDataset

    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "What is 1 + 1?"}]))
    with pytest.raises(ValueError, match="drawn by index from the training set"):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            _config(tmp_path),
            train_dataset=stream,
            processing_class=tok,
            reward_components={"slot": SlotReward()},
        )


# -- the trainer's step ------------------------------------------------------------------------------------------


class SlotReward:
    """Constant for the even questions (all-equal groups), sampled-token-dependent for the odd ones."""

    def __call__(self, trajectory, example) -> float:
        i = int(example["prompt"].split()[2])
        return 1.0 if i % 2 == 0 else (sum(trajectory.turns[-1].completion_ids) % 7) / 7.0


def _dataset(n=16):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)])


def _one_batch_step(model, datums, aggregation):
    """Plain torch: the one-batch loss over ``datums`` with the trainer's defaults (ppo_clip 0.2/0.28), one SGD step
    of 0.5; returns the parameter change."""
    from trl_plugins.algos import PPOClipLoss, aggregate, local_denominators
    from trl_plugins.datum import collate
    from trl_plugins.modeling import token_logprobs
    from trl_plugins.types import PolicyLossInput

    model = copy.deepcopy(model)
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    logp = token_logprobs(model, full.input_ids, full.attention_mask, full.target_ids)
    out = PPOClipLoss(clip_low=0.2, clip_high=0.28)(
        PolicyLossInput(logp, full.behaviour_logprobs, full.advantages, full.action_mask)
    )
    aggregate(out.per_token_loss, full.action_mask, aggregation, num_tokens=n_tok, num_sequences=n_seq).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before


@pytest.mark.slow
@pytest.mark.parametrize("aggregation,items", [("token_mean", 1), ("seq_mean_token_mean", 3)])
def test_the_step_trains_exactly_the_kept_groups(tmp_path, aggregation, items):
    # One step with dynamic sampling: the update equals one SGD step on the one-batch loss over the kept groups'
    # datums (whatever the micro-batches), and not the loss over every group drawn (negative control: the equal-reward
    # groups' tokens would count in the denominators).
    from trl_plugins.datum import build_datum
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    initial = copy.deepcopy(model)
    trainer = MultiTurnGRPOTrainer(
        model,
        _config(tmp_path, aggregation=aggregation, max_items_per_micro_batch=items),
        train_dataset=_dataset(),
        processing_class=tok,
        reward_components={"slot": SlotReward()},
    )
    trainer.train()
    batch = trainer.last_batch
    by_group: dict[int, list] = {}
    for t, reason in zip(batch.trajectories, batch.left_out):
        by_group.setdefault(t.group_id, []).append((t, reason))
    kept = [g for g, members in by_group.items() if all(r is None for _, r in members)]
    assert len(kept) == 2  # the step's 2 groups, filled
    for g, members in by_group.items():
        rewards = {t.reward for t, _ in members}
        reasons = {r for _, r in members}
        assert (len(rewards) > 1) == (reasons != {LeftOutReason.EQUAL_REWARDS})
    assert sorted({batch.trajectories[d.trajectory_index].group_id for d in batch.datums}) == kept
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    assert record["dynamic_sampling/rounds"] >= 2 and record["dynamic_sampling/kept_groups"] == 2
    assert (
        record["rollout/trajectories"]
        == len(batch.trajectories)
        == 2 * (record["dynamic_sampling/groups_drawn"] + record["dynamic_sampling/filler_groups"])
    )
    assert record["train/datums"] == 4

    after = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    change = after - torch.cat([p.detach().reshape(-1) for p in initial.parameters()])
    assert float(change.norm()) > 1e-6
    assert rel_err(change, _one_batch_step(initial, batch.datums, aggregation)) < 1e-5
    every = [
        build_datum(t, advantage=t.advantage, trajectory_index=i)
        for i, t in enumerate(batch.trajectories)
        if batch.left_out[i] in (None, LeftOutReason.EQUAL_REWARDS)
    ]
    assert rel_err(change, _one_batch_step(initial, every, aggregation)) > 1e-2


@pytest.mark.slow
def test_a_resumed_run_draws_and_trains_what_the_uninterrupted_one_did(tmp_path):
    # The refill rows are drawn from (seed, step) alone, not from state a checkpoint would have to keep: step 2 after a
    # resume from checkpoint-1 rolls out the same rows, keeps the same groups and ends with the same parameters.
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")

    def run(out, **overrides):
        return MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            _config(out, max_steps=2, **overrides),
            train_dataset=_dataset(),
            processing_class=tok,
            reward_components={"slot": SlotReward()},
        )

    straight = run(tmp_path / "straight")
    straight.train()
    run(tmp_path / "resumed", save_strategy="steps", save_steps=1).train()
    resumed = run(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-1"))
    a, b = straight.last_batch, resumed.last_batch
    assert a.metrics["dynamic_sampling/rounds"] >= 2  # step 2 refilled
    assert [r["prompt"] for r in a.rows] == [r["prompt"] for r in b.rows] and a.left_out == b.left_out
    for (name, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), name
