"""Trainer glue: the subclassed TRL trainer that runs a resolved run's plugins, its step's phases, and the exact
multi-rank passes over datums (the update, the critic, the no-gradient log-probs)."""

from trl_plugins.trainers.interrupts import TrainingInterrupted
from trl_plugins.trainers.update import UpdateResult, UpdateSettings, policy_update

__all__ = [
    "UpdateSettings",
    "UpdateResult",
    "policy_update",
    "MultiTurnGRPOConfig",
    "MultiTurnGRPOTrainer",
    "TrainingInterrupted",
    "NoPolicyUpdate",
]


def __getattr__(name: str):
    # TRL is imported only when the trainer or its config is asked for.
    if name == "MultiTurnGRPOConfig":
        from trl_plugins.run.config import MultiTurnGRPOConfig

        return MultiTurnGRPOConfig
    if name == "MultiTurnGRPOTrainer":
        from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

        return MultiTurnGRPOTrainer
    if name == "NoPolicyUpdate":  # what train() raises when a run trained nothing
        from trl_plugins.trainers.resilience import NoPolicyUpdate

        return NoPolicyUpdate
    raise AttributeError(name)
