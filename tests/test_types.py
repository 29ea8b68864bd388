"""The trajectory contract: stop reasons, validation errors that name turn and token, bootstrap mask."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from conftest import make_trajectory
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.types import (
    PolicyVersion,
    RewardComponent,
    SamplingSettings,
    StopReason,
    TokenSource,
    Trajectory,
    TrajectoryError,
    Turn,
)

TERMINATED = {StopReason.FINAL_ANSWER, StopReason.NO_TOOL_CALL, StopReason.INVALID_ACTION}
TRUNCATED = {StopReason.TURN_LENGTH, StopReason.TOKEN_BUDGET, StopReason.MAX_TURNS, StopReason.MAX_TOOL_CALLS}
WORLD_FAILURES = {StopReason.ENVIRONMENT_ERROR, StopReason.VERIFIER_ERROR, StopReason.CANCELLED}


def test_stop_reasons_partition_into_terminated_truncated_and_world_failures():
    assert TERMINATED | TRUNCATED | WORLD_FAILURES == set(StopReason)
    for r in StopReason:
        assert r.is_terminated == (r in TERMINATED)
        assert r.is_truncated == (r in TRUNCATED)
        assert r.is_world_failure == (r in WORLD_FAILURES)
        assert sum((r.is_terminated, r.is_truncated, r.is_world_failure)) == 1
        assert StopReason(r.value) is r


def _two_turns(**kw) -> Trajectory:
    t0 = Turn(prompt_ids=[10, 11], completion_ids=[20, 21], completion_logprobs=[-0.5, -0.25])
    t1 = Turn(prompt_ids=[10, 11, 20, 21, 30], completion_ids=[40], completion_logprobs=[-1.0])
    return Trajectory(turns=[t0, t1], question_id="q7", **kw)


@pytest.mark.parametrize(
    "reason,expected", [(StopReason.FINAL_ANSWER, 0), (StopReason.MAX_TURNS, 1), (StopReason.TOKEN_BUDGET, 1)]
)
def test_valid_trajectory_reports_bootstrap_mask(reason, expected):
    report = validate_trajectory(_two_turns(stop_reason=reason))
    assert report.bootstrap_mask == expected
    assert report.num_turns == 2
    assert report.num_action_tokens == 3


def test_unfinished_trajectory_rejected():
    with pytest.raises(TrajectoryError, match="has no stop_reason"):
        validate_trajectory(_two_turns())


def test_logprob_length_mismatch_names_turn():
    traj = _two_turns(stop_reason=StopReason.FINAL_ANSWER)
    traj.turns[1].completion_logprobs = [-1.0, -2.0]
    with pytest.raises(TrajectoryError, match=r"turn 1: 1 completion tokens but 2 behaviour log-probs"):
        validate_trajectory(traj)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_behaviour_logprob_names_turn_and_token(bad):
    traj = _two_turns(stop_reason=StopReason.FINAL_ANSWER)
    traj.turns[0].completion_logprobs = [-0.5, bad]
    with pytest.raises(TrajectoryError, match=r"turn 0, completion token 1 \(id 21\): behaviour log-prob is"):
        validate_trajectory(traj)


def test_observation_token_carrying_a_logprob_is_rejected():
    # A TRL-style turn that spliced tool output (ids 50, 51) into the completion.
    traj = _two_turns(stop_reason=StopReason.FINAL_ANSWER)
    traj.turns[1] = Turn(
        prompt_ids=[10, 11, 20, 21, 30],
        completion_ids=[40, 50, 51, 41],
        completion_logprobs=[-1.0, math.nan, -0.3, -0.7],
        completion_sources=[TokenSource.ACTION, TokenSource.OBSERVATION, TokenSource.OBSERVATION, TokenSource.ACTION],
    )
    with pytest.raises(
        TrajectoryError, match=r"turn 1, completion token 2 \(id 51\): a OBSERVATION token carries log-prob -0.3"
    ):
        validate_trajectory(traj)
    traj.turns[1].completion_logprobs[2] = math.nan
    assert validate_trajectory(traj).num_action_tokens == 2 + 2


def test_both_terminated_and_truncated_is_rejected():
    traj = _two_turns(stop_reason=StopReason.FINAL_ANSWER)
    traj.turns[1].truncated = True
    with pytest.raises(TrajectoryError, match="both terminated and truncated"):
        validate_trajectory(traj)
    traj.stop_reason = StopReason.TURN_LENGTH
    assert validate_trajectory(traj).bootstrap_mask == 1


def test_turn_length_stop_needs_a_cut_turn():
    with pytest.raises(TrajectoryError, match="'turn_length' but the last turn"):
        validate_trajectory(_two_turns(stop_reason=StopReason.TURN_LENGTH))


def test_prompt_sources_must_cover_new_prompt_tokens_and_not_claim_actions():
    traj = _two_turns(stop_reason=StopReason.FINAL_ANSWER)
    traj.turns[1].prompt_sources = [TokenSource.OBSERVATION, TokenSource.GLUE]
    with pytest.raises(TrajectoryError, match=r"turn 1: prompt_sources has 2 entries but the prompt adds 1 tokens"):
        validate_trajectory(traj)
    traj.turns[1].prompt_sources = [TokenSource.ACTION]
    with pytest.raises(TrajectoryError, match=r"turn 1, new prompt token 0: marked ACTION"):
        validate_trajectory(traj)


def test_reward_is_weighted_sum_of_components():
    traj = _two_turns(
        stop_reason=StopReason.FINAL_ANSWER,
        reward_components=[RewardComponent("correct", 1.0, 1.0), RewardComponent("format", -1.0, 0.25)],
    )
    assert traj.reward == 0.75  # 1*1 + 0.25*(-1)
    assert traj.reward_component("format").value == -1.0
    with pytest.raises(KeyError, match="have \\['correct', 'format'\\]"):
        traj.reward_component("tool")


def test_trajectories_pickle_round_trip():
    traj = make_trajectory(random.Random(0), num_turns=3)
    traj.policy_version = PolicyVersion(step=3, tokenizer_digest="abc", sampling=SamplingSettings(temperature=0.7))
    back = pickle.loads(pickle.dumps(traj))
    assert back == traj
    assert validate_trajectory(back).bootstrap_mask == 0
