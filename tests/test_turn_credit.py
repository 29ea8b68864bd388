"""Turn-level credit (turn_group, GiGPO-style step groups of identical states): the reference formula, the state ids
the trainer derives from datums, and exactness of the update it feeds across micro-batches and ranks."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import make_trajectory, rel_err
from trl_plugins.algos import TurnGroupAdvantage, group_advantages, turn_group_advantages
from trl_plugins.contracts import check_advantage_contract
from trl_plugins.datum import build_datum
from trl_plugins.pipeline.batch import turn_tensors
from trl_plugins.registry import ADVANTAGES
from trl_plugins.types import AdvantageInput, Trajectory, Turn


def _reference(rewards, groups, mask, turns, states, *, step_weight, scale_by_std=True, eps=1e-6):
    """Written out turn by turn: A_episode of the trajectory plus step_weight times the group formula over the turns
    of its group taken from the same state."""
    n, width = mask.shape
    episode = group_advantages(rewards, groups, scale_by_std=scale_by_std, eps=eps).tolist()
    spans = {}  # (row, turn) -> (group, state)
    for r in range(n):
        for t in range(width):
            if mask[r, t] and turns[r, t] >= 0:
                spans.setdefault((r, int(turns[r, t])), (int(groups[r]), int(states[r, t])))
    out = torch.zeros(n, width, dtype=torch.float64)
    for (r, k), key in spans.items():
        members = [row for (row, _), other in spans.items() if other == key]
        values = [float(rewards[m]) for m in members]
        mean = sum(values) / len(values)
        if len(values) < 2 or max(values) == min(values):
            step = 0.0
        else:
            std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            step = (float(rewards[r]) - mean) / ((std + eps) if scale_by_std else 1.0)
        for t in range(width):
            if mask[r, t] and turns[r, t] == k:
                out[r, t] = episode[r] + step_weight * step
    return out


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, width = 12, 20
    groups = torch.arange(n) // 4
    rewards = (torch.rand(n, generator=g) < 0.5).double() + 0.1 * torch.randint(0, 3, (n,), generator=g).double()
    mask = torch.zeros(n, width)
    turns = torch.full((n, width), -1, dtype=torch.long)
    states = torch.full((n, width), -1, dtype=torch.long)
    for r in range(n):
        pos, k = 2, 0
        while pos < width - 3 and k < 3:
            length = int(torch.randint(1, 4, (1,), generator=g))
            mask[r, pos : pos + length] = 1
            turns[r, pos : pos + length] = k
            # First turns share the prompt; later ones share a state with probability 1/2 within their group.
            states[r, pos : pos + length] = 100 * int(groups[r]) + (
                0 if k == 0 else 10 * k + int(torch.randint(0, 2, (1,), generator=g))
            )
            pos, k = pos + length + 2, k + 1
    return rewards, groups, mask, turns, states


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("step_weight,scale", [(1.0, True), (0.5, False)])
def test_turn_group_is_the_step_group_formula_written_out(seed, step_weight, scale):
    rewards, groups, mask, turns, states = _batch(seed)
    got = turn_group_advantages(rewards, groups, mask, turns, states, step_weight=step_weight, scale_by_std=scale)
    torch.testing.assert_close(
        got, _reference(rewards, groups, mask, turns, states, step_weight=step_weight, scale_by_std=scale)
    )


def test_a_small_example_by_hand():
    # One group of 4: first turns from the prompt; the second turns of 0 and 1 from one state (say, the same error),
    # of 2 and 3 from two others.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]] * 4, dtype=torch.float64)
    turns = torch.tensor([[0, -1, 1]] * 4)
    states = torch.tensor([[0, -1, 1], [0, -1, 1], [0, -1, 2], [0, -1, 3]])
    adv = turn_group_advantages(
        rewards, torch.zeros(4, dtype=torch.long), mask, turns, states, step_weight=1.0, scale_by_std=False
    )
    episode = [0.5, -0.5, 0.5, -0.5]
    assert adv[:, 0].tolist() == [2 * e for e in episode]  # the first turn's step group is the episode's group
    assert adv[:, 2].tolist() == [0.5 + 0.5, -0.5 - 0.5, 0.5, -0.5]  # 0 and 1 compared; 2 and 3 alone
    assert adv[:, 1].tolist() == [0.0] * 4
    # step_weight 0: the group advantage on every action token.
    plain = turn_group_advantages(
        rewards, torch.zeros(4, dtype=torch.long), mask, turns, states, step_weight=0.0, scale_by_std=False
    )
    assert plain[:, 0].tolist() == episode and plain[:, 2].tolist() == episode


def test_state_ids_are_equal_exactly_for_equal_prefixes_before_the_turn():
    def traj(first: list[int], obs: list[int], second: list[int]) -> Trajectory:
        prompt = [5, 6, 7]
        return Trajectory(
            turns=[Turn(prompt, first, [-0.1] * len(first)), Turn(prompt + first + obs, second, [-0.2] * len(second))],
            advantage=0.0,
        )

    datums = [
        build_datum(t)
        for t in (
            traj([10, 11], [3, 4], [20]),
            traj([10, 11], [3, 4], [21, 22]),
            traj([10, 12], [3, 4], [20]),
            traj([10, 11], [3, 9], [20]),
        )
    ]
    width = max(d.num_tokens for d in datums)
    turns, states = turn_tensors(datums, width)
    first = [int(states[r][turns[r] == 0][0]) for r in range(4)]
    second = [int(states[r][turns[r] == 1][0]) for r in range(4)]
    assert len(set(first)) == 1  # every first turn starts from the prompt
    assert second[0] == second[1] and len({second[0], second[2], second[3]}) == 3  # same history vs another call/output
    assert ((states >= 0) == (turns >= 0)).all()
    bare = copy.deepcopy(datums[0])
    bare.turn_ids = None
    with pytest.raises(ValueError, match="turn_group needs turn ids"):
        turn_tensors([bare], width, label="turn_group")


def test_registered_checked_and_refused_without_its_inputs():
    assert ADVANTAGES.get("turn_group") is TurnGroupAdvantage
    check_advantage_contract("turn_group")
    check_advantage_contract("turn_group", {"step_weight": 0.0})
    with pytest.raises(ValueError, match="step_weight must be >= 0"):
        TurnGroupAdvantage(step_weight=-1)
    with pytest.raises(ValueError, match="needs AdvantageInput.action_mask, turn_ids and turn_state_ids"):
        TurnGroupAdvantage()(AdvantageInput(rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long)))


def test_groups_held_by_different_ranks_get_the_advantages_of_one_batch():
    # Each rank holds whole groups; the estimator on each rank's share gives what it gives on the whole batch.
    rewards, groups, mask, turns, states = _batch(7)
    whole = turn_group_advantages(rewards, groups, mask, turns, states)
    for share in ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]):
        idx = torch.tensor(share)
        part = turn_group_advantages(rewards[idx], groups[idx], mask[idx], turns[idx], states[idx])
        torch.testing.assert_close(part, whole[idx])


def test_the_update_it_feeds_is_exact_across_packings_and_ranks(tiny_model_factory):
    # Per-token turn-level advantages through the gradient-equivalence machinery: any packing, two ranks.
    from support.gradients import PAD, accumulate, ddp_gradient, packings  # noqa: F401 - the suite's own helpers
    from trl_plugins import modeling
    from trl_plugins.datum import collate

    model = tiny_model_factory(torch.float32)
    rng = random.Random(77)
    trajs = [
        make_trajectory(rng, num_turns=rng.randint(1, 4), group_id=g, sample_index=s)
        for g in range(4)
        for s in range(4)
    ]
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in trajs], dtype=torch.float64)
    datums = [build_datum(t, trajectory_index=i, advantage=0.0) for i, t in enumerate(trajs)]
    width = max(d.num_tokens for d in datums)
    turns, _ = turn_tensors(datums, width)
    # Random histories share no prefix: give the turns of each group shared states by hand (half of the later ones).
    group = torch.tensor([t.group_id for t in trajs])[:, None]
    parity = (torch.arange(len(trajs)) % 2)[:, None]
    states = torch.where(turns >= 0, 100 * group + 10 * turns + torch.where(turns > 0, parity, 0), -1)
    mask = torch.zeros(len(datums), width)
    for r, d in enumerate(datums):
        mask[r, : d.num_tokens] = torch.tensor(d.action_mask, dtype=torch.float32)
    adv = turn_group_advantages(rewards, torch.tensor([t.group_id for t in trajs]), mask, turns, states)
    with torch.no_grad():
        mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
        logp = modeling.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)
    gen = torch.Generator().manual_seed(1)
    for r, d in enumerate(datums):
        d.advantages = adv[r, : d.num_tokens].float().tolist()
        noisy = logp[r, : d.num_tokens] + 0.25 * torch.randn(d.num_tokens, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]
    assert len({round(a, 6) for d in datums for a, m in zip(d.advantages, d.action_mask) if m}) > 4  # per-turn values
    reference = accumulate(model, datums, [list(range(len(datums)))], "token_mean")
    for name, batches in packings(datums).items():
        assert rel_err(accumulate(model, datums, batches, "token_mean"), reference) < 1e-5, name
    order = list(range(len(datums)))
    random.Random(5).shuffle(order)
    assert (
        rel_err(ddp_gradient(model, datums, [order[:5], order[5:]], "token_mean", dp_size_factor=2), reference) < 1e-5
    )
