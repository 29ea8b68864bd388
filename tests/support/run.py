"""Counting plugins for every seam and a tiny run config that names them, to count how often a run builds each."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from trl_plugins.algos.advantages import GroupAdvantage
from trl_plugins.algos.losses import PPOClipLoss
from trl_plugins.rollout import MultiTurnRollout
from trl_plugins.tools.base import ToolOutput

BUILT: Counter = Counter()
"""Constructions of the counting plugins below, by seam."""


@dataclass
class CountingRollout(MultiTurnRollout):
    """multi_turn, counted in ``BUILT``."""

    def __post_init__(self) -> None:
        BUILT["rollout"] += 1
        super().__post_init__()


@dataclass
class CountingAdvantage(GroupAdvantage):
    """The group advantage, counted in ``BUILT``."""

    def __post_init__(self) -> None:
        BUILT["advantage"] += 1


@dataclass
class CountingLoss(PPOClipLoss):
    """ppo_clip, counted in ``BUILT``."""

    def __post_init__(self) -> None:
        BUILT["policy_loss"] += 1
        super().__post_init__()


class CountingTool:
    """An echo tool, counted in ``BUILT``."""

    name = "echo"

    def __init__(self) -> None:
        BUILT["tool"] += 1

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "echo",
                "description": "Echo the text.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            },
        }

    async def __call__(self, arguments: dict) -> ToolOutput:
        return ToolOutput(text=str(arguments.get("text")), ok=True)


class CountingReward:
    """A reward on the last turn's tokens, counted in ``BUILT``."""

    def __init__(self) -> None:
        BUILT["reward"] += 1

    def __call__(self, trajectory, example) -> float:
        return (sum(trajectory.turns[-1].completion_ids) % 7) / 7.0

    def is_success(self, value: float) -> bool:
        return value > 0.5


PLUGINS = dict(
    rollout="support.run:CountingRollout",
    advantage="support.run:CountingAdvantage",
    policy_loss="support.run:CountingLoss",
    tools=["support.run:CountingTool"],
    reward_components=["support.run:CountingReward"],
)


def counting_config(tmp_path, **overrides):
    """A one-step tiny run config whose every seam is a counting plugin."""
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=5e-3,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
        max_padded_tokens_per_micro_batch=4000,
        reward_components=["support.run:CountingReward"],
        system_prompt="You may use the echo tool.",
    )
    kwargs.update(PLUGINS)
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)
