"""The critic's settings (an advantage estimator that ``needs_values``, such as ``gae``, brings a critic; the critic
itself: :mod:`trl_plugins.trainers.critic`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Critic", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "sgd")
"""``critic_optim``'s values."""

FIELDS = ("critic_learning_rate", "critic_optim", "critic_warmup_steps", "vf_clip", "vf_coef")
"""The flat fields that configure it."""


@dataclass(frozen=True)
class Critic:
    """A value model trained beside the policy, once per step right after it, with an optimizer of its own."""

    learning_rate: float | None
    """Its constant learning rate (``critic_learning_rate``; None: the policy's ``learning_rate``)."""
    optim: str
    """``'adamw'`` or ``'sgd'`` (``critic_optim``; the run's ``weight_decay`` applies to both)."""
    warmup_steps: int
    """First steps in which only the critic learns, the policy update skipped (``critic_warmup_steps``)."""
    vf_clip: float
    """How far a value may move from its rollout-time value per update (the clipped value loss)."""
    vf_coef: float
    """The value loss's coefficient."""

    @classmethod
    def from_config(cls, config: Any, *, needs_values: bool) -> Critic | None:
        """The critic ``config`` configures, given whether its advantage estimator ``needs_values`` (known once the
        plugin is built): None when it needs none.

        Raises:
            ValueError: a critic setting given, or ``truncated_policy='bootstrap'`` (which reads the critic's values),
                while the estimator runs no critic; a value out of range.
        """
        from trl_plugins.run.settings import off_default

        if not needs_values:
            given = off_default(config, FIELDS)
            if given:
                raise ValueError(
                    f"{[g.split('=', 1)[0] for g in given]} configure the critic, but advantage {config.advantage!r} "
                    f"runs none (only an estimator that needs_values, such as 'gae', brings one); drop them or choose "
                    f"--advantage gae."
                )
            if config.truncated_policy == "bootstrap":
                raise ValueError(
                    "truncated_policy='bootstrap' replaces a truncated trajectory's outcome reward by the critic's "
                    f"value of where it stopped, but advantage {config.advantage!r} runs no critic; use --advantage "
                    "gae, or truncated_policy 'wrong' (score truncations as wrong) or 'mask' (leave them out)."
                )
            return None
        if config.critic_warmup_steps < 0 or config.vf_clip <= 0 or config.vf_coef <= 0:
            raise ValueError(
                f"need critic_warmup_steps >= 0, vf_clip > 0 and vf_coef > 0; got {config.critic_warmup_steps}, "
                f"{config.vf_clip}, {config.vf_coef}."
            )
        if config.critic_optim not in OPTIMIZERS:
            raise ValueError(f"critic_optim must be 'adamw' or 'sgd', got {config.critic_optim!r}.")
        if config.critic_learning_rate is not None and not config.critic_learning_rate > 0:
            raise ValueError(
                f"critic_learning_rate must be > 0 or None (the policy's learning_rate), got "
                f"{config.critic_learning_rate}."
            )
        return cls(
            learning_rate=config.critic_learning_rate,
            optim=config.critic_optim,
            warmup_steps=config.critic_warmup_steps,
            vf_clip=config.vf_clip,
            vf_coef=config.vf_coef,
        )
