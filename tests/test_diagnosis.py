"""What a run says when its world fails or a step trains nothing (trl_plugins.trainers.diagnosis), and the start-up
checks of the settings that make it stop (max_environment_error_rate, max_steps_without_update)."""

from __future__ import annotations

import pytest

from trl_plugins.trainers.diagnosis import (
    SKIP_COUNTS,
    environment_error_message,
    error_kind,
    likely_cause,
    nothing_to_train,
    skip_counts,
    top_error_kinds,
)
from trl_plugins.types import LeftOutReason


def test_errors_differing_only_in_quoted_parts_are_one_kind():
    a = "the agent failed: NotFoundError: Error code: 404 - no such endpoint '/q0/chat/completions'\nTraceback ..."
    b = "the agent failed: NotFoundError: Error code: 404 - no such endpoint '/q1/chat/completions'"
    assert error_kind(a) == error_kind(b) == "the agent failed: NotFoundError: Error code: 404 - no such endpoint '...'"
    assert error_kind(None) == error_kind("  ") == "no message"
    assert error_kind("tool 'calc': " + "x" * 500) == ("tool '...': " + "x" * 500)[:200]
    # 3 of one kind, 1 of another: the kinds by count, each with its first error as the example.
    assert top_error_kinds([b, a, b, "the agent ran past agent_time_limit_s=1.0"]) == [
        (error_kind(a), 3, b),
        ("the agent ran past agent_time_limit_s=1.0", 1, "the agent ran past agent_time_limit_s=1.0"),
    ]


def test_the_most_common_error_is_counted_over_the_ranks_with_its_usual_cause():
    # Rank 0: 2 time limits and 1 crash; rank 1: 3 time limits. Merged: 5 time limits of 6 errors, then 1 crash.
    rank0 = top_error_kinds(["the agent ran past agent_time_limit_s=60"] * 2 + ["the agent failed: KeyError: 'x'"])
    rank1 = top_error_kinds(["the agent ran past agent_time_limit_s=60"] * 3)
    message = environment_error_message(0.75, 0.5, rank0 + rank1, 6)
    assert message.startswith(
        "75% of this step's trajectories (all ranks, cancelled ones not counted) ended "
        "environment_error, over max_environment_error_rate=0.5"
    )
    assert (
        "Most common error (5 of 6): the agent ran past agent_time_limit_s=60; then (1) the agent failed: "
        "KeyError: 'x'. Likely cause: the agent or a request ran past its time limit"
    ) in message


@pytest.mark.parametrize(
    "error,cause",
    [
        ("the agent failed: NotFoundError: Error code: 404 - {'error': ...}", "the agent could not reach the endpoint"),
        ("the agent failed: APIConnectionError: Connection error.", "something the rollout calls is not reachable"),
        (
            "tool 'code_interpreter': RuntimeError: could not start a warm sandbox server under bwrap: ...",
            "sandbox failed",
        ),
        ("the agent failed: ZeroDivisionError: division by zero", "the agent raises on every call"),
        ("the agent command exited with status 2: ...", "the agent raises on every call"),
        ("the agent returned 'yes', not None, a number or a mapping of numbers", "the agent returns something"),
        ("tool 'search': ValueError: bad query", "a tool fails on every call"),
        ("something else entirely", "the rollout's world"),
    ],
)
def test_each_kind_of_error_names_its_usual_cause(error, cause):
    assert cause in likely_cause(error_kind(error))


def test_a_skip_names_what_each_rank_left_out_summed_over_the_ranks():
    W, T = LeftOutReason.WORLD_FAILURE, LeftOutReason.TRUNCATED
    # Rank 0: 4 trajectories, all truncated and masked (no datum). Rank 1: 4, 2 failed by the world, 2 datums whose
    # advantage is 0 (not forwarded). Sums: 8 trajectories, 2 datums, 0 forwarded, 2 world failures, 4 truncated.
    rank0 = skip_counts(4, 0, 0, [T, T, T, T])
    rank1 = skip_counts(4, 2, 0, [W, W, None, None])
    total = [a + b for a, b in zip(rank0, rank1)]
    assert dict(zip(SKIP_COUNTS, total)) == {
        "trajectories": 8,
        "datums": 2,
        "forwarded": 0,
        "world_failure": 2,
        "truncated": 4,
        "group_too_small": 0,
        "equal_rewards": 0,
        "surplus": 0,
        "filler": 0,
    }
    assert nothing_to_train(total) == (
        "no trajectory to train on: of the step's 8 trajectories (all ranks), 2 failed by the world (environment_error, "
        "verifier_error or cancelled), 4 truncated (truncated_policy='mask' leaves them out), 2 with zero advantage "
        "(equal rewards within their group)"
    )
    # Every trajectory a datum with advantage 0: the groups' rewards were all equal.
    assert nothing_to_train(skip_counts(4, 4, 0, [None] * 4)) == (
        "no trajectory to train on: every group's rewards were equal (all 4 trajectories of the step, all ranks, have "
        "advantage 0)"
    )


@pytest.mark.parametrize(
    "setting,value,message",
    [
        (
            "max_environment_error_rate",
            1.5,
            r"max_environment_error_rate and min_valid_group_fraction are shares in \[0, 1\]",
        ),
        ("max_environment_error_rate", -0.1, r"shares in \[0, 1\]; got 0.5, -0.1, 0.5"),
        ("max_steps_without_update", -1, r"max_steps_without_update must be >= 0 \(0: never stop for it\), got -1"),
    ],
)
def test_the_stop_settings_are_refused_at_start_up_when_out_of_range(tmp_path, setting, value, message):
    from trl_plugins.run.config import MultiTurnGRPOConfig

    common = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        reward_components=["length"],
        per_device_train_batch_size=4,
        num_generations=2,
        bf16=False,
    )
    with pytest.raises(ValueError, match=message):
        MultiTurnGRPOConfig(**common, **{setting: value})
    # The edges are settings, not errors: 1.0 never stops for the world, 0 never for skipped steps.
    ok = MultiTurnGRPOConfig(**common, max_environment_error_rate=1.0, max_steps_without_update=0)
    assert (
        ok.max_environment_error_rate,
        ok.max_steps_without_update,
        MultiTurnGRPOConfig.max_steps_without_update,
    ) == (1.0, 0, 20)
