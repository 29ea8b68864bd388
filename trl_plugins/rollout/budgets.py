"""The budgets of one trajectory, shared by the rollout plugins that apply them (``multi_turn``, ``agent_endpoint``):
the fields, the two capabilities they declare, and their check."""

from __future__ import annotations

from dataclasses import dataclass

from trl_plugins.rollout.request import RolloutError

__all__ = ["TrajectoryBudgets"]


@dataclass
class TrajectoryBudgets:
    """Per-turn and per-trajectory budgets (a base of rollout plugins' configs)."""

    max_turns: int = 8
    """Assistant turns per trajectory."""
    max_tool_calls: int = 8
    """Tool calls per trajectory (each call of a turn with parallel calls counts)."""
    max_tool_calls_per_turn: int = 1
    """Tool calls one assistant turn may make (parallel calls). A turn with more is an invalid action and none of
    its calls runs. Above 1 the chat template must render that many calls of a turn exactly (checked at start-up
    by the run's chat format; a template that cannot is refused, saying so)."""
    max_assistant_tokens: int = 512
    """Tokens per assistant turn."""
    max_trajectory_tokens: int = 4096
    """Tokens per trajectory: first prompt, all completions, all tool messages."""
    max_tool_response_tokens: int = 512
    """Tokens per tool response as they reach the model (the observation tokens of the rendered tool message,
    control-token text spelled out); a longer response keeps its tail."""

    @property
    def tool_calls_per_turn(self) -> int:
        """Capability: the most tool calls of one turn this rollout runs (``max_tool_calls_per_turn``)."""
        return self.max_tool_calls_per_turn

    @property
    def token_budget(self) -> int:
        """Capability: the most tokens one trajectory can hold (first prompt, completions, tool messages)."""
        return self.max_trajectory_tokens

    def __post_init__(self) -> None:
        for name in (
            "max_turns",
            "max_tool_calls",
            "max_tool_calls_per_turn",
            "max_assistant_tokens",
            "max_trajectory_tokens",
            "max_tool_response_tokens",
        ):
            if getattr(self, name) < 1:
                raise RolloutError(f"{name} must be >= 1, got {getattr(self, name)}.")

    def check_chat(self, chat: object) -> None:
        """Refuse a chat format checked for fewer calls per turn than ``max_tool_calls_per_turn``."""
        calls = getattr(chat, "calls_per_turn", 1)
        if self.max_tool_calls_per_turn > calls:
            raise RolloutError(
                f"max_tool_calls_per_turn={self.max_tool_calls_per_turn}, but the chat format was checked for "
                f"{calls} call(s) per turn, so the tool messages of a turn with more calls may not be "
                f"what the template renders. Build it with ChatFormat(..., calls_per_turn="
                f"{self.max_tool_calls_per_turn}) (Run.bind_tokenizer does, from the rollout), or lower "
                f"max_tool_calls_per_turn."
            )
