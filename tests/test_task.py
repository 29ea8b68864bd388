"""The bundled arithmetic task: deterministic, disjoint splits, correct answers."""

from __future__ import annotations

import pytest

from retool.task import arithmetic_problems
from trl_plugins.rewards.math import CorrectReward
from trl_plugins.types import StopReason, Trajectory, Turn


def test_deterministic_and_disjoint():
    train = arithmetic_problems(300, seed=0, split="train")
    assert train == arithmetic_problems(300, seed=0, split="train")
    assert train != arithmetic_problems(300, seed=1, split="train")
    test = arithmetic_problems(100, seed=0, split="test")
    assert not {r["expression"] for r in train} & {r["expression"] for r in test}
    # Asking for more keeps the first ones: the split is a property of the problem, not of the size.
    assert arithmetic_problems(50, seed=0, split="test") == test[:50]


def test_answers_are_right_and_need_a_calculator():
    for row in arithmetic_problems(200, seed=3, split="train"):
        assert int(row["answer"]) == eval(row["expression"])  # noqa: S307 - our own generated arithmetic
        assert row["prompt"] == f"What is {row['expression']}?"
        assert int(row["answer"]) >= 72  # a*b - c >= a*b/2 >= 72; (a+b)*c >= 24*3: never a one-digit guess


def test_correct_reward_accepts_the_reference_answer():
    row = arithmetic_problems(1, seed=0)[0]
    traj = Trajectory(
        turns=[Turn([1], [2], [-0.1], text=f"So it is \\boxed{{{row['answer']}}}.")],
        stop_reason=StopReason.FINAL_ANSWER,
    )
    assert CorrectReward()(traj, row) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="split must be one of"):
        arithmetic_problems(1, split="validation")
    with pytest.raises(ValueError, match="n must be >= 1"):
        arithmetic_problems(0)
