"""Built-in reward components: hand-worked cases."""

from __future__ import annotations

import pickle

import pytest

from trl_plugins.registry import REWARDS
from trl_plugins.rewards.math import CorrectReward, FormatReward, OverlongPenalty, ToolUseReward, last_boxed
from trl_plugins.types import StopReason, ToolCall, Trajectory, Turn


def traj(text: str, stop=StopReason.FINAL_ANSWER, *, tool_ok=None, prompt_len=10, completion_len=5) -> Trajectory:
    turns = []
    if tool_ok is not None:
        turns.append(
            Turn(
                [1] * prompt_len,
                [2] * 3,
                [-0.1] * 3,
                text="call",
                tool_calls=[ToolCall("code_interpreter", {"code": "1"}, "1", ok=tool_ok)],
            )
        )
    turns.append(Turn([1] * prompt_len, [3] * completion_len, [-0.1] * completion_len, text=text + "<|im_end|>"))
    return Trajectory(turns=turns, stop_reason=stop)


def test_builtins_are_registered_and_pickle():
    for name, cls in (
        ("correct", CorrectReward),
        ("format", FormatReward),
        ("tool_use", ToolUseReward),
        ("overlong", OverlongPenalty),
    ):
        assert REWARDS.get(name) is cls
        assert pickle.loads(pickle.dumps(cls())) == cls()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, nested braces kept
        ("\\boxed{unclosed", None),
        ("nothing", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text,answer,stop,value",
    [
        ("The answer is \\boxed{56877}.", "56877", StopReason.FINAL_ANSWER, 1.0),
        ("The answer is \\boxed{56,877}.", "56877", StopReason.FINAL_ANSWER, 1.0),  # math-verify equivalence
        ("\\boxed{\\frac{1}{2}}", "0.5", StopReason.FINAL_ANSWER, 1.0),
        ("The answer is \\boxed{56878}.", "56877", StopReason.FINAL_ANSWER, -1.0),
        ("The answer is 56877.", "56877", StopReason.FINAL_ANSWER, -1.0),  # a bare number is not an answer
        ("\\boxed{}", "1", StopReason.FINAL_ANSWER, -1.0),
        ("The answer is \\boxed{56877}.", "56877", StopReason.TURN_LENGTH, -1.0),  # truncated counts as wrong
        ("The answer is \\boxed{56877}.", "56877", StopReason.INVALID_ACTION, -1.0),
        ("\\boxed{56877}" + " padding" * 60, "56877", StopReason.FINAL_ANSWER, -1.0),  # outside the last 300 chars
    ],
)
def test_correct(text, answer, stop, value):
    assert CorrectReward()(traj(text, stop), {"answer": answer}) == value


def test_correct_names_a_missing_answer_column():
    with pytest.raises(KeyError, match="needs the reference answer in column 'answer'"):
        CorrectReward()(traj("\\boxed{1}"), {"solution": "1"})


def test_format_tool_use_and_overlong():
    assert FormatReward()(traj("\\boxed{1}"), {}) == 1.0
    assert FormatReward()(traj("\\boxed{1} or \\boxed{2}"), {}) == 0.0
    assert FormatReward()(traj("\\boxed{1}", StopReason.MAX_TURNS), {}) == 0.0
    assert ToolUseReward()(traj("x", tool_ok=True), {}) == 1.0
    assert ToolUseReward()(traj("x", tool_ok=False), {}) == 0.0
    assert ToolUseReward()(traj("x"), {}) == 0.0
    # 10 prompt + 5 completion = 15 tokens; budget 20 with a 10-token ramp starting at 10: 5/10 -> -0.5.
    assert OverlongPenalty(max_tokens=20, buffer_tokens=10)(traj("x"), {}) == -0.5
    assert OverlongPenalty(max_tokens=100, buffer_tokens=10)(traj("x"), {}) == 0.0
    with pytest.raises(ValueError, match="0 < buffer_tokens <= max_tokens"):
        OverlongPenalty(max_tokens=10, buffer_tokens=20)
