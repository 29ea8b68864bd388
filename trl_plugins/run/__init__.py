"""A run, resolved once before any model loads: its settings and what is built from them.

- :mod:`.config`: ``MultiTurnGRPOConfig``, each field checked when it is built (:mod:`.trl_fields` says what each of
  TRL's fields does here; :mod:`.lora` the same for TRL's ``ModelConfig``).
- :mod:`.plugins`: the plugins built from the registries, and the checks that need them built.
- :mod:`.sampler`: what generates the turns, and the one factory of its backend.
- :mod:`.build`: :func:`resolve_run` (check and build, once) and :func:`build_run` (rebuild a resolved
  :class:`RunSpec` in another process, checking nothing again); the :class:`Run` they return is what the trainer,
  the evaluation and the recipes receive.
"""

from trl_plugins.run.build import KL_PENALTY_COMPONENT, RolloutParts, Run, RunSpec, build_run, resolve_run
from trl_plugins.run.sampler import SamplerKind, sampling_settings

__all__ = [
    "Run",
    "RunSpec",
    "RolloutParts",
    "resolve_run",
    "build_run",
    "SamplerKind",
    "sampling_settings",
    "KL_PENALTY_COMPONENT",
    "MultiTurnGRPOConfig",
]


def __getattr__(name: str):
    # TRL is imported only when the config is asked for.
    if name == "MultiTurnGRPOConfig":
        from trl_plugins.run.config import MultiTurnGRPOConfig

        return MultiTurnGRPOConfig
    raise AttributeError(name)
