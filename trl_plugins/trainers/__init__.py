"""Trainer glue: the exact multi-rank update step and the subclassed TRL trainer that runs the plugins."""

from trl_plugins.trainers.interrupts import TrainingInterrupted
from trl_plugins.trainers.step import UpdateResult, UpdateSettings, policy_update

__all__ = ["UpdateSettings", "UpdateResult", "policy_update", "MultiTurnGRPOConfig", "MultiTurnGRPOTrainer",
           "TrainingInterrupted"]


def __getattr__(name: str):
    # TRL is imported only when the trainer is asked for.
    if name == "MultiTurnGRPOConfig":
        from trl_plugins.trainers.multi_turn_config import MultiTurnGRPOConfig

        return MultiTurnGRPOConfig
    if name == "MultiTurnGRPOTrainer":
        from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

        return MultiTurnGRPOTrainer
    raise AttributeError(name)
