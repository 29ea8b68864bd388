"""Reward-component plugins (registry: ``REWARDS``).

Contract: a component is constructed with its own settings and called as
``component(trajectory, example) -> float``, where ``example`` is the dataset row the question came
from (its reference answer, for instance). The trainer stores each component on the trajectory as a
:class:`~trl_plugins.types.RewardComponent` with its configured weight; the trajectory's reward is the
weighted sum. Built-ins (:mod:`trl_plugins.rewards.math`): ``correct`` (math-verify on the last
``\\boxed{}``), ``format``, ``tool_use`` and ``overlong``.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from trl_plugins.types import Trajectory

__all__ = ["RewardFn"]


class RewardFn(Protocol):
    """One call contract for every reward component."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        """Score one finished trajectory."""
        ...
