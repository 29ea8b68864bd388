"""Datum builder: the worked example array by array, prefix checks, split option, context limit."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import make_trajectory
from trl_plugins.datum import DatumError, build_datum, build_datums, collate, dummy_micro_batch
from trl_plugins.types import PLACEHOLDER_LOGPROB, StopReason, TokenSource, Trajectory, Turn

P, A, O, G = TokenSource.PROMPT, TokenSource.ACTION, TokenSource.OBSERVATION, TokenSource.GLUE


def worked_example(**kw) -> Trajectory:
    # P1=[101,102,103], C1=[201,202,90] with log-probs [-0.1,-0.2,-0.3],
    # D2=[91,301,302,303,104] (glue, three tool-output tokens, glue), C2=[401,402] with [-0.4,-0.5].
    p1, c1 = [101, 102, 103], [201, 202, 90]
    d2, c2 = [91, 301, 302, 303, 104], [401, 402]
    return Trajectory(
        turns=[
            Turn(prompt_ids=p1, completion_ids=c1, completion_logprobs=[-0.1, -0.2, -0.3]),
            Turn(
                prompt_ids=p1 + c1 + d2,
                completion_ids=c2,
                completion_logprobs=[-0.4, -0.5],
                prompt_sources=[G, O, O, O, G],
            ),
        ],
        stop_reason=StopReason.FINAL_ANSWER,
        advantage=0.75,
        **kw,
    )


def test_worked_example_array_by_array():
    d = build_datum(worked_example())
    # full = P1 + C1 + D2 + C2: 3 + 3 + 5 + 2 = 13 tokens; after the shift 12 positions.
    full = [101, 102, 103, 201, 202, 90, 91, 301, 302, 303, 104, 401, 402]
    assert d.input_ids == full[:-1] == [101, 102, 103, 201, 202, 90, 91, 301, 302, 303, 104, 401]
    assert d.target_ids == full[1:] == [102, 103, 201, 202, 90, 91, 301, 302, 303, 104, 401, 402]
    assert d.num_tokens == 12
    # Targets 201, 202, 90 (C1) and 401, 402 (C2) were sampled: 5 loss positions.
    assert d.action_mask == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert d.num_loss_tokens == 5
    assert d.behaviour_logprobs == [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0, -0.4, -0.5]
    assert d.advantages == [0.0, 0.0, 0.75, 0.75, 0.75, 0.0, 0.0, 0.0, 0.0, 0.0, 0.75, 0.75]
    assert d.sources == [P, P, A, A, A, G, O, O, O, G, A, A]
    assert d.bootstrap_mask == 0
    assert PLACEHOLDER_LOGPROB == 0.0


def test_datum_positions_predict_their_targets_from_the_prefix():
    # Position t reads input_ids[: t + 1] and predicts target_ids[t] = full[t + 1].
    rng = random.Random(3)
    for _ in range(20):
        traj = make_trajectory(rng, num_turns=rng.randint(1, 4))
        d = build_datum(traj)
        full = traj.turns[-1].prompt_ids + traj.turns[-1].completion_ids
        assert d.input_ids + [d.target_ids[-1]] == full
        # Every sampled token appears exactly once as a loss target, with its own log-prob.
        sampled = [(tok, lp) for t in traj.turns for tok, lp in zip(t.completion_ids, t.completion_logprobs)]
        got = [(tok, lp) for tok, lp, m in zip(d.target_ids, d.behaviour_logprobs, d.action_mask) if m]
        assert got == sampled


def test_advantage_argument_overrides_and_missing_advantage_is_an_error():
    d = build_datum(worked_example(), advantage=-2.0)
    assert set(a for a, m in zip(d.advantages, d.action_mask) if m) == {-2.0}
    traj = worked_example()
    traj.advantage = None
    with pytest.raises(DatumError, match="compute advantages before building datums"):
        build_datum(traj)


def test_non_prefix_prompt_is_an_error_naming_the_turn():
    traj = worked_example()
    traj.turns[1].prompt_ids[4] = 999  # history re-tokenised: 202 became 999
    with pytest.raises(
        DatumError,
        match=r"turn 1: the prompt does not extend the previous turns \(first difference at token 4: expected 202, got 999",
    ):
        build_datum(traj)


def test_shorter_prompt_is_an_error():
    traj = worked_example()
    traj.turns[1].prompt_ids = [101, 102, 103, 201]
    traj.turns[1].prompt_sources = None
    with pytest.raises(DatumError, match="first difference at token 4: expected 202, got <end of prompt>"):
        build_datum(traj)


def test_split_option_makes_one_datum_per_consistent_run():
    traj = worked_example(group_id=4)
    traj.turns[1].prompt_ids = [101, 102, 777, 301]  # a rewritten history
    traj.turns[1].prompt_sources = None
    first, second = build_datums(traj, on_prefix_mismatch="split")
    assert first.input_ids == [101, 102, 103, 201, 202] and first.target_ids == [102, 103, 201, 202, 90]
    assert first.action_mask == [0, 0, 1, 1, 1]
    assert first.bootstrap_mask == 1  # cut by the split, not terminated
    assert second.input_ids == [101, 102, 777, 301, 401] and second.target_ids == [102, 777, 301, 401, 402]
    assert second.action_mask == [0, 0, 0, 1, 1] and second.behaviour_logprobs[-2:] == [-0.4, -0.5]
    # Turn 1's prompt is a fresh prompt in the second datum; sources default to PROMPT there.
    assert second.sources == [P, P, P, A, A]
    assert second.bootstrap_mask == 0 and second.group_id == 4
    with pytest.raises(DatumError):
        build_datums(traj, on_prefix_mismatch="error")


def test_context_limit_error_names_limit_and_budget():
    assert build_datum(worked_example(), max_context_tokens=12).num_tokens == 12
    with pytest.raises(
        DatumError,
        match=r"12 tokens .* max_context_tokens=11\. Lower the rollout's trajectory token budget \(max_trajectory_tokens\) to at most 12",
    ):
        build_datum(worked_example(), max_context_tokens=11)


def test_truncated_trajectory_bootstraps():
    traj = worked_example()
    traj.stop_reason = StopReason.MAX_TURNS
    assert build_datum(traj).bootstrap_mask == 1


def test_spliced_observation_in_completion_is_context_not_action():
    traj = worked_example()
    traj.turns[1].completion_ids = [401, 55, 402]
    traj.turns[1].completion_logprobs = [-0.4, math.nan, -0.5]
    traj.turns[1].completion_sources = [A, O, A]
    d = build_datum(traj)
    assert d.action_mask[-3:] == [1, 0, 1]
    assert d.behaviour_logprobs[-3:] == [-0.4, 0.0, -0.5]
    assert all(math.isfinite(x) for x in d.behaviour_logprobs)


def test_empty_first_prompt_is_an_error():
    traj = worked_example()
    traj.turns = [Turn(prompt_ids=[], completion_ids=[5], completion_logprobs=[-1.0])]
    with pytest.raises(DatumError, match="empty prompt"):
        build_datum(traj)


def test_collate_right_pads_and_masks():
    rng = random.Random(1)
    datums = [build_datum(make_trajectory(rng, num_turns=n)) for n in (1, 3, 2)]
    mb = collate(datums, [2, 0], pad_token_id=0)
    width = max(datums[2].num_tokens, datums[0].num_tokens)
    assert mb.input_ids.shape == (2, width) and mb.num_padded_tokens == 2 * width
    assert mb.datum_indices == [2, 0]
    for row, i in enumerate([2, 0]):
        n = datums[i].num_tokens
        assert mb.input_ids[row, :n].tolist() == datums[i].input_ids
        assert mb.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
        assert mb.action_mask[row, n:].sum() == 0 and mb.advantages[row, n:].abs().sum() == 0
        assert mb.action_mask[row, :n].tolist() == [float(m) for m in datums[i].action_mask]
        assert torch.allclose(mb.behaviour_logprobs[row, :n], torch.tensor(datums[i].behaviour_logprobs))
    with pytest.raises(ValueError, match="dummy_micro_batch"):
        collate(datums, [], pad_token_id=0)
    dummy = dummy_micro_batch(pad_token_id=0)
    assert dummy.weight == 0.0 and dummy.action_mask.sum() == 0 and dummy.attention_mask.sum() == 1
