"""The sampler/trainer mismatch correction's settings (TRL's ``vllm_importance_sampling_*`` fields and our
``mismatch_correction_scope``; the maths: :func:`trl_plugins.algos.importance_weights`, where it applies:
:func:`trl_plugins.trainers.update.mismatch_correction_applies`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_plugins.run.settings.async_rollouts import AsyncRollouts
from trl_plugins.types import ImportanceSamplingMode

__all__ = ["MismatchCorrection", "SCOPES"]

SCOPES = ("foreign", "all")
"""``mismatch_correction_scope``'s values."""

FIELDS = (
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_cap",
)
"""TRL's fields that configure it (beside the switch, ``vllm_importance_sampling_correction``)."""


@dataclass(frozen=True)
class MismatchCorrection:
    """Weigh each action token by the bounded importance weight ``pi_old / pi_sampler`` where the sampler's log-probs
    are not the trainer's own."""

    mode: ImportanceSamplingMode
    """How the weight is bounded: per token or per sequence, truncated or masked (``vllm_importance_sampling_mode``;
    unset: ``token_truncate`` under the decoupled objective, ``sequence_mask`` otherwise, TRL's default)."""
    clip_min: float | None
    """The lower bound ``C_min`` (``vllm_importance_sampling_clip_min``; None: unbounded below)."""
    clip_max: float | None
    """The upper bound ``C_max`` (``vllm_importance_sampling_clip_max``, or TRL's deprecated ``..._cap``)."""
    scope: str
    """``'foreign'``: batches holding trajectories whose log-probs are not the trainer's own (vLLM's); ``'all'``:
    every batch, HF generate's too (``mismatch_correction_scope``)."""

    @classmethod
    def from_config(cls, config: Any, async_rollouts: AsyncRollouts | None) -> MismatchCorrection | None:
        """The correction ``config`` configures (None when ``vllm_importance_sampling_correction`` is off), given its
        asynchronous rollouts (a replica's batches are corrected; under the decoupled objective, every batch). TRL's
        ``__post_init__`` has already copied the deprecated ``vllm_importance_sampling_cap`` into ``clip_max`` and
        checked ``clip_min < clip_max``; the config has filled an unset mode.

        Raises:
            ValueError: an unknown mode or scope, a bound out of range, scope ``'all'`` with the correction off, a
                mode or bound set (off TRL's defaults) where the correction cannot apply, so that it would be silently
                ignored (the correction off, or scope ``'foreign'`` without vLLM or a replica: HF generate records the
                trainer's own log-probs), or the decoupled objective with a truncating mode and no bound.
        """
        from trl_plugins.run.trl_fields import is_set

        scope = config.mismatch_correction_scope
        if scope not in SCOPES:
            raise ValueError(f"mismatch_correction_scope must be 'foreign' or 'all', got {scope!r}.")
        try:
            mode = ImportanceSamplingMode(config.vllm_importance_sampling_mode)
        except ValueError:
            raise ValueError(
                f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r}; use one of "
                f"{[str(m) for m in ImportanceSamplingMode]}."
            ) from None
        lo, hi = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
        if (lo is not None and lo < 0) or (hi is not None and hi <= 0):
            raise ValueError(f"need vllm_importance_sampling_clip_min >= 0 and clip_max > 0, got {lo} and {hi}.")
        on = config.vllm_importance_sampling_correction
        if not on and scope == "all":
            raise ValueError(
                "mismatch_correction_scope='all' asks for the mismatch correction on every batch, but "
                "vllm_importance_sampling_correction=False turns it off; set one of them."
            )
        given = [f"{n}={getattr(config, n)!r}" for n in FIELDS if is_set(config, n)]
        if given and not on:
            raise ValueError(
                f"{', '.join(given)} configure the mismatch correction, which "
                "vllm_importance_sampling_correction=False turns off; drop them or turn it on."
            )
        if given and scope == "foreign" and not config.use_vllm and async_rollouts is None:
            raise ValueError(
                f"{', '.join(given)} configure the sampler/trainer mismatch correction, which in "
                f"mismatch_correction_scope='foreign' applies only to trajectories whose log-probs are not the "
                f"trainer's own (vLLM); HF generate records the trainer's own, so they would be ignored. Set "
                f"mismatch_correction_scope='all' to apply the correction to HF-generated batches too, or drop them."
            )
        if not on:
            return None
        if (
            async_rollouts is not None
            and async_rollouts.decoupled
            and mode.value.endswith("truncate")
            and lo is None
            and hi is None
        ):
            raise ValueError(
                f"the decoupled objective truncates its importance weights "
                f"(vllm_importance_sampling_mode={mode.value!r}) but neither "
                f"vllm_importance_sampling_clip_min nor vllm_importance_sampling_clip_max is set: set one."
            )
        return cls(mode=mode, clip_min=lo, clip_max=hi, scope=scope)
