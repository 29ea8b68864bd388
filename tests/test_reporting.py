"""What a run reports: the compact console line, the tokens/s rates, and the rows of the W&B trajectory tables."""

from __future__ import annotations

import pytest

from trl_plugins.rollout.metrics import throughput_metrics
from trl_plugins.trainers.console import CompactProgressCallback, compact_line
from trl_plugins.trainers.trajectory_table import TURN_COLUMNS, trajectory_columns, trajectory_rows, turn_rows
from trl_plugins.types import RewardComponent, StopReason, ToolCall, Trajectory, Turn


def test_compact_line_holds_the_key_numbers():
    logs = {
        "reward/total": 0.4123,
        "reward/correct": 0.55,
        "reward/format": 0.9,
        "reward/verifier_error_rate": 0.0,
        "reward/verifier_error_rate/correct": 0.0,
        "rollout/tool_calls_mean": 1.25,
        "train/policy_loss": 0.0123,
        "loss": 0.0123,
        "train/kl_k3": 0.0031,
        "rollout/generated_tokens_per_s": 850.4,
        "train/forward_tokens_per_s": 41234.0,
        "timing/step_s": 12.31,
        "memory/peak_rss_mb": 1945.6,
        "rollout/turns_mean": 2.0,
        "train/ratio_p50": 1.0,
    }
    line = compact_line(logs, step=3, max_steps=40)
    assert line == (
        "step 3/40 | reward 0.412 | correct 0.55 | format 0.9 | tools 1.25 | loss 0.0123 | kl 0.0031 | "
        "gen 850 tok/s | train 41.2k tok/s | 12.3 s | rss 1.9 GB"
    )
    # Under async_rollouts the trainer's wait for its sampler follows the step time.
    assert "| 12.3 s | idle 4.2 s | rss" in compact_line({**logs, "timing/trainer_idle_s": 4.2}, step=3)
    # Thousands read as k, never in exponent notation (2770 tok/s is "2.77k", not "2.77e+03").
    assert "gen 2.77k tok/s" in compact_line({**logs, "rollout/generated_tokens_per_s": 2770.4}, step=3)
    assert "gen 1k tok/s" in compact_line({**logs, "rollout/generated_tokens_per_s": 999.7}, step=3)
    assert "e+" not in compact_line({**logs, "rollout/generated_tokens_per_s": 123456789.0}, step=3)
    # A record that is not a step's (the end-of-training summary) shows what it holds.
    assert (
        compact_line({"train_runtime": 4.129, "epoch": 1.0}, step=2, max_steps=2)
        == "step 2/2 | train_runtime 4.13 | epoch 1"
    )


def test_the_compact_progress_callback_writes_above_the_bar():
    class Bar:
        def __init__(self):
            self.written = []

        def write(self, text):
            self.written.append(text)

    class State:
        is_world_process_zero, global_step, max_steps = True, 5, 10

    cb = CompactProgressCallback()
    cb.training_bar = Bar()
    cb.on_log(None, State(), None, logs={"reward/total": 0.5, "timing/step_s": 2.0})
    assert cb.training_bar.written == ["step 5/10 | reward 0.5 | 2 s"]


def test_throughput_is_total_tokens_over_total_time():
    # Two steps in one logging record: (100 + 100) tokens over (1 + 3) s = 50 tok/s, not the mean of the
    # per-step rates, (100 + 33.3) / 2 = 66.7; the record's averaged tokens over its averaged seconds agree: 100 / 2.
    values = {
        "rollout/action_tokens": [100.0, 100.0],
        "timing/generation_s": [1.0, 3.0],
        "train/forward_tokens": [400.0],
        "timing/forward_backward_s": [0.5],
    }
    assert throughput_metrics(values) == {
        "rollout/generated_tokens_per_s": pytest.approx(50.0),
        "train/forward_tokens_per_s": pytest.approx(800.0),
    }
    assert throughput_metrics({"rollout/action_tokens": [10.0], "timing/generation_s": [0.0]}) == {}


def _trajectories():
    call = ToolCall(name="code_interpreter", arguments={"code": "print(2 + 2)"}, output="4\n", ok=True)
    bad = ToolCall(
        name="code_interpreter", arguments={"code": "1/0"}, output="ZeroDivisionError", ok=False, timed_out=False
    )
    t1 = Trajectory(
        turns=[
            Turn([1], [2], [0.0], text="<tool_call>...</tool_call>", tool_calls=[call]),
            Turn([1, 2, 3], [4], [0.0], text="So \\boxed{4}"),
        ],
        question_id="q0",
        group_id=0,
        sample_index=0,
        stop_reason=StopReason.FINAL_ANSWER,
        reward_components=[RewardComponent("correct", 1.0, 1.0), RewardComponent("format", 1.0, 0.1)],
        advantage=0.5,
    )
    t2 = Trajectory(
        turns=[Turn([5], [6], [0.0], text="try", tool_calls=[bad])],
        question_id="q1",
        group_id=1,
        sample_index=1,
        stop_reason=StopReason.VERIFIER_ERROR,
        error="reward component 'correct': boom",
    )
    return [t1, t2]


def test_trajectory_rows_have_prompt_turns_answer_components_and_stop_reason():
    rows = [
        {"prompt": "What is 2 + 2?", "answer": "4"},
        {"prompt": [{"role": "user", "content": "What is 3 / 0?"}], "answer": 7},
    ]
    columns = trajectory_columns(["correct", "format"])
    got = [
        dict(zip(columns, r))
        for r in trajectory_rows(_trajectories(), rows, step=3, reward_names=["correct", "format"])
    ]
    assert got[0]["prompt"] == "What is 2 + 2?" and got[0]["answer"] == "4"
    assert got[1]["prompt"] == "user: What is 3 / 0?" and got[1]["answer"] == "7"
    assert (got[0]["reward/correct"], got[0]["reward/format"], got[0]["reward"]) == (1.0, 1.0, pytest.approx(1.1))
    assert got[0]["stop_reason"] == "final_answer" and got[0]["turns"] == 2 and got[0]["tool_calls"] == 1
    assert got[0]["transcript"] == (
        "[assistant 1]\n<tool_call>...</tool_call>\n"
        '[tool call 1] code_interpreter {"code": "print(2 + 2)"}\n'
        "[tool output 1] (ok)\n4\n\n"
        "[assistant 2]\nSo \\boxed{4}"
    )
    # A verifier failure: no components (None, not 0), the stop reason and the error kept.
    assert got[1]["reward/correct"] is None and got[1]["stop_reason"] == "verifier_error" and "boom" in got[1]["error"]
    assert got[1]["advantage"] is None and "[tool output 1] (error)\nZeroDivisionError" in got[1]["transcript"]
    assert len(trajectory_rows(_trajectories(), rows, step=3, reward_names=["correct"], max_rows=1)) == 1


def test_turn_rows_have_one_row_per_assistant_turn():
    got = [dict(zip(TURN_COLUMNS, r)) for r in turn_rows(_trajectories(), step=3)]
    assert [(r["question_id"], r["turn"], r["tool"], r["tool_ok"]) for r in got] == [
        ("q0", 1, "code_interpreter", True),
        ("q0", 2, "", None),
        ("q1", 1, "code_interpreter", False),
    ]
    assert got[0]["arguments"] == '{"code": "print(2 + 2)"}' and got[0]["tool_output"] == "4\n"
