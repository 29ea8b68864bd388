"""The ``concise`` reward component: a penalty for sampling more tokens than a budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trl_plugins.types import Trajectory

__all__ = ["ConciseReward"]


@dataclass
class ConciseReward:
    """0 while the trajectory's sampled (ACTION) tokens fit in ``budget_tokens``, then falling
    linearly: ``-(num_action_tokens - budget_tokens) / budget_tokens``, so -1 at twice the budget.

    Only tokens the policy sampled count: the prompt, tool output and template glue do not, so a
    trajectory is not punished for what a tool printed.
    """

    budget_tokens: int = 256
    """Sampled tokens, over all turns, allowed before the penalty starts."""

    def __post_init__(self) -> None:
        if self.budget_tokens < 1:
            raise ValueError(f"budget_tokens must be >= 1, got {self.budget_tokens}.")

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        excess = trajectory.num_action_tokens - self.budget_tokens
        return -excess / self.budget_tokens if excess > 0 else 0.0
