"""DAPO's dynamic sampling's settings (``dynamic_sampling``; the maths: :mod:`trl_plugins.algos.dynamic_sampling`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_plugins.run.plugins import SettingError, nearest

__all__ = ["DynamicSampling"]

FIELDS = ("dynamic_sampling_metric", "dynamic_sampling_max_groups")
"""The flat fields that configure it (beside the switch, ``dynamic_sampling``)."""


@dataclass(frozen=True)
class DynamicSampling:
    """Drop the groups whose members all got the same ``metric``, refill until the step holds its groups or
    ``max_groups`` x its groups were drawn."""

    metric: str
    """``'reward'`` (the weighted total) or a reward component of the run (``dynamic_sampling_metric``)."""
    max_groups: float
    """The most groups a step draws, as a multiple of its groups, the first round included (>= 1;
    ``dynamic_sampling_max_groups``)."""

    @classmethod
    def from_config(cls, config: Any) -> DynamicSampling | None:
        """The settings of ``config`` (None when ``dynamic_sampling`` is off).

        Raises:
            ValueError: a setting of it given while it is off, or a cap below 1.
            SettingError: a metric that is neither ``'reward'`` nor a reward component of the run.
        """
        from trl_plugins.run.settings import off_default

        given = off_default(config, FIELDS)
        if not config.dynamic_sampling:
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure dynamic sampling, which is off: set dynamic_sampling=True, "
                    f"or drop them."
                )
            return None
        metrics = ["reward", *config.reward_components]
        if config.dynamic_sampling_metric not in metrics:
            raise SettingError(
                "dynamic_sampling_metric",
                f"{config.dynamic_sampling_metric!r} is neither 'reward' nor a "
                f"reward component of the run; use one of {metrics}."
                f"{nearest(config.dynamic_sampling_metric, metrics)}",
            )
        if not config.dynamic_sampling_max_groups >= 1:
            raise ValueError(
                f"dynamic_sampling_max_groups={config.dynamic_sampling_max_groups}: the cap counts the step's "
                f"first round too, so it must be >= 1 (1: no refill, only the drop)."
            )
        return cls(metric=config.dynamic_sampling_metric, max_groups=config.dynamic_sampling_max_groups)
