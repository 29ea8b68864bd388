"""The reward an agent behind the endpoint returned, as a reward component (``agent_reward``).

The ``agent_endpoint`` rollout records what the agent returned (``agent_return``) and the row's ``reward``
(``row_reward``) as components of weight 0: a record, counted only when a configured component reads them. This one
does: it scores a trajectory with the agent's reward, else the row's. With other components configured instead, those
win and the agent's and the row's stay recorded (docs/agents.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trl_plugins.registry import REWARDS
from trl_plugins.types import Trajectory

__all__ = ["AGENT_REWARD", "ROW_REWARD", "AgentReward"]

AGENT_REWARD = "agent_return"
"""The component holding the number the agent returned."""
ROW_REWARD = "row_reward"
"""The component holding the row's ``reward``."""


@REWARDS.register("agent_reward")
@dataclass
class AgentReward:
    """The agent's returned reward, else the row's ``reward``; a trajectory with neither is a verifier error (its
    score is unknown, not zero)."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        for component in trajectory.reward_components:
            if component.name == AGENT_REWARD:
                return component.value
        reward = example.get("reward")
        if isinstance(reward, (int, float)) and not isinstance(reward, bool):
            return float(reward)
        raise ValueError(
            "the agent returned no reward and the row has no 'reward': return a number from the agent, or "
            "configure a reward component that scores the trajectory."
        )
