"""Multi-turn tool-call rollout: token-in/token-out chat, generation backends, the engine.

The registered rollout plugin is ``multi_turn`` (:class:`~trl_plugins.rollout.engine.MultiTurnRollout`).
"""

from trl_plugins.rollout.backends import GenerationBackend, HFGenerationBackend, Sample, ScriptedBackend, VLLMBackend
from trl_plugins.rollout.chat import ChatFormat, ChatTemplateError, ParsedTurn, ToolTurn, TurnKind
from trl_plugins.rollout.engine import MultiTurnRollout
from trl_plugins.rollout.request import (
    RolloutCancelled,
    RolloutError,
    RolloutQuestion,
    RolloutRequest,
    RolloutResult,
    derive_seed,
    questions_from_rows,
)

__all__ = [
    "GenerationBackend",
    "HFGenerationBackend",
    "Sample",
    "ScriptedBackend",
    "VLLMBackend",
    "ChatFormat",
    "ChatTemplateError",
    "ParsedTurn",
    "TurnKind",
    "ToolTurn",
    "MultiTurnRollout",
    "RolloutCancelled",
    "RolloutError",
    "questions_from_rows",
    "RolloutQuestion",
    "RolloutRequest",
    "RolloutResult",
    "derive_seed",
]
