"""Reward-component plugins (registry: ``REWARDS``).

Contract: a component is constructed with its own settings and called as
``component(trajectory, example) -> float``, where ``example`` is the dataset row the question came
from (its reference answer, for instance). The trainer stores each component on the trajectory as a
:class:`~trl_plugins.types.RewardComponent` with its configured weight; the trajectory's reward is the
weighted sum. Built-ins (:mod:`trl_plugins.rewards.math`): ``correct`` (math-verify on the last
``\\boxed{}``), ``format``, ``tool_use`` and ``overlong``; ``agent_reward`` (:mod:`trl_plugins.rewards.agent`) and
``reasoning_gym`` (:mod:`trl_plugins.rewards.reasoning_gym`: a reasoning-gym dataset's own ``score_answer``).
"""

from __future__ import annotations

from math import isfinite  # not `import math`: the submodule rewards.math takes that name here
from typing import Any, Mapping, Protocol

from trl_plugins.types import Trajectory

__all__ = ["RewardFn", "reward_value"]


class RewardFn(Protocol):
    """One call contract for every reward component."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        """Score one finished trajectory."""
        ...


def reward_value(value: Any) -> float:
    """The float a component's return value stands for: what the trainer stores as its
    :class:`~trl_plugins.types.RewardComponent` value (and what ``trl_plugins.contracts.check_reward_contract``
    demands).

    Accepted: a real number with ``__float__`` (``int``, ``float``, a numpy scalar, a 0-d tensor), finite.

    Raises:
        TypeError: ``value`` is not one number (a ``str``, ``None``, a list of scores, a ``bool``).
        ValueError: it is ``nan`` or infinite.
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"returned {value!r}, a bool; return a float (e.g. 1.0 for true, 0.0 for false).")
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(
            f"returned {value!r} ({type(value).__name__}), not a number; a component scores one "
            f"trajectory with one float."
        )
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a tensor of several scores
        raise TypeError(
            f"returned {value!r} ({type(value).__name__}), not one number ({exc}); a component scores "
            f"one trajectory with one float."
        ) from None
    if not isfinite(number):
        raise ValueError(f"returned {number}; a reward must be finite.")
    return number
