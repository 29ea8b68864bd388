"""Built-in reward components for maths with a final ``\\boxed{}`` answer.

Each is a registered plugin called as ``component(trajectory, example) -> float`` (see
:mod:`trl_plugins.rewards`). Answer equivalence uses math-verify (``56,877`` == ``56877``,
``\\frac{1}{2}`` == ``0.5``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trl_plugins.registry import REWARDS
from trl_plugins.types import StopReason, Trajectory, Turn

__all__ = ["last_boxed", "turn_text", "final_text", "CorrectReward", "FormatReward", "ToolUseReward", "OverlongPenalty"]

_BOX = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind(_BOX)
    while start != -1:
        depth, i = 1, start + len(_BOX)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOX) : i - 1]
        start = text.rfind(_BOX, 0, start)
    return None


def turn_text(turn: Turn) -> str:
    """Decoded text of one assistant turn, without a trailing end-of-turn marker."""
    text = turn.text
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        text = text.removesuffix(marker)
    return text


def final_text(trajectory: Trajectory) -> str:
    """Decoded text of the last assistant turn, without a trailing end-of-turn marker."""
    return turn_text(trajectory.turns[-1]) if trajectory.turns else ""


@REWARDS.register("correct")
@dataclass
class CorrectReward:
    """+1 when the last ``\\boxed{}`` in the final ``window_chars`` characters of the last turn equals
    ``example[answer_key]`` (math-verify), -1 otherwise: a missing or unparsable answer, an invalid
    action and a truncated trajectory are all wrong."""

    answer_key: str = "answer"
    """Dataset column with the reference answer."""
    window_chars: int = 300
    """Only the end of the last turn is searched for the answer."""
    correct: float = 1.0
    """Value for a right answer."""
    wrong: float = -1.0
    """Value for anything else."""

    def is_success(self, value: float) -> bool:
        """Whether a value this component returned means a right answer (what evaluations count)."""
        return value == self.correct

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        if trajectory.stop_reason != StopReason.FINAL_ANSWER:
            return self.wrong
        if self.answer_key not in example:
            raise KeyError(
                f"the 'correct' reward needs the reference answer in column {self.answer_key!r}; the example has "
                f"{sorted(example)}. Set answer_key= in reward_component_kwargs."
            )
        content = last_boxed(final_text(trajectory)[-self.window_chars :])
        if content is None or not content.strip():
            return self.wrong
        from math_verify import parse, verify

        gold = parse(str(example[self.answer_key]))
        pred = parse(_BOX + content + "}")
        return self.correct if gold and pred and verify(gold, pred) else self.wrong


@REWARDS.register("format")
@dataclass
class FormatReward:
    """1 when the trajectory ends with a final answer whose last turn holds exactly one ``\\boxed{}``,
    0 otherwise (invalid tool calls, no answer, several boxes, truncation)."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        if trajectory.stop_reason != StopReason.FINAL_ANSWER:
            return 0.0
        return 1.0 if final_text(trajectory).count(_BOX) == 1 else 0.0


@REWARDS.register("tool_use")
@dataclass
class ToolUseReward:
    """1 when at least one tool call ran successfully, else 0 (an optional shaping term)."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        return 1.0 if any(c.ok for t in trajectory.turns for c in t.tool_calls) else 0.0


@REWARDS.register("overlong")
@dataclass
class OverlongPenalty:
    """DAPO-style soft overlong penalty: 0 up to ``max_tokens - buffer_tokens`` trajectory tokens, then
    falling linearly to -1 at ``max_tokens`` (and below for longer)."""

    max_tokens: int = 4096
    """The trajectory token budget."""
    buffer_tokens: int = 512
    """Length of the linear ramp before the budget."""

    def __post_init__(self) -> None:
        if not 0 < self.buffer_tokens <= self.max_tokens:
            raise ValueError(f"need 0 < buffer_tokens <= max_tokens, got {self.buffer_tokens} and {self.max_tokens}.")

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        excess = trajectory.num_tokens - (self.max_tokens - self.buffer_tokens)
        return -excess / self.buffer_tokens if excess > 0 else 0.0
