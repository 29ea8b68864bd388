"""Each feature's settings as one typed object, built once from the config's flat fields when the config is checked
(the command line's and the YAML's keys stay flat, TRL users' habit), owning the feature's defaults, checks and derived
rules. A feature that is off is ``None``, so a setting of it given while it is off is refused in one place, by
construction (its ``from_config``). Consumers read ``config.features``, never the flat fields of a feature.

The critic's settings are the one exception to "built with the config": whether a run has a critic is known once its
advantage estimator is built (``needs_values``), so :class:`Critic` is built with the run
(:attr:`trl_plugins.run.build.Run.critic`).

The objects live in the run's settings wing rather than beside each feature's code: the config is checked below the
trainers (``run/`` is imported by ``trainers/``, never the reverse), so a feature implemented there keeps its settings
here, one module per feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_plugins.run.settings.async_rollouts import AsyncRollouts
from trl_plugins.run.settings.critic import Critic
from trl_plugins.run.settings.distillation import Distillation
from trl_plugins.run.settings.dynamic_sampling import DynamicSampling
from trl_plugins.run.settings.long_trajectories import LongTrajectories
from trl_plugins.run.settings.mismatch_correction import MismatchCorrection

__all__ = [
    "Features",
    "AsyncRollouts",
    "Critic",
    "Distillation",
    "DynamicSampling",
    "LongTrajectories",
    "MismatchCorrection",
]


@dataclass(frozen=True)
class Features:
    """The run's features with settings of their own; each ``None`` when off."""

    async_rollouts: AsyncRollouts | None = None
    """A generation replica (or a vLLM server's threads) samples ahead of the update (``async_rollouts`` with
    ``max_staleness > 0``)."""
    dynamic_sampling: DynamicSampling | None = None
    """DAPO's dynamic sampling (``dynamic_sampling``)."""
    mismatch_correction: MismatchCorrection | None = None
    """The sampler/trainer mismatch correction (TRL's ``vllm_importance_sampling_correction``, on by default)."""
    long_trajectories: LongTrajectories = LongTrajectories()
    """The chunked output head (always on) and sequence parallelism."""
    distillation: Distillation | None = None
    """On-policy distillation's teacher (``teacher_model_name_or_path``)."""

    @property
    def decoupled(self) -> bool:
        """Whether stale tokens train with the decoupled PPO objective (:attr:`AsyncRollouts.decoupled`)."""
        return self.async_rollouts is not None and self.async_rollouts.decoupled

    def correction_on_every_batch(self, *, foreign_sampler: bool) -> bool:
        """Whether the mismatch correction applies to every rollout batch: it is on and either the sampler's log-probs
        are never the trainer's own (``foreign_sampler``: vLLM), its scope is ``'all'``, or stale tokens train with
        the decoupled objective (whose behaviour weight it is). Otherwise it applies to a batch only when that batch
        holds foreign log-probs."""
        m = self.mismatch_correction
        return m is not None and (foreign_sampler or m.scope == "all" or self.decoupled)


def off_default(config: Any, names: tuple[str, ...]) -> list[str]:
    """``name=value`` of each of ``config``'s fields ``names`` set off its default (what a user gave)."""
    fields = config.__dataclass_fields__
    return [f"{n}={getattr(config, n)!r}" for n in names if getattr(config, n) != fields[n].default]
