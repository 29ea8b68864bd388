"""Asynchronous rollouts' settings (``async_rollouts``: a generation replica, or a vLLM server's threads, samples up to
``max_staleness`` optimizer steps ahead of the update; the trainer's side: :mod:`trl_plugins.trainers.async_rollouts`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from trl_plugins.run.plugins import SettingError, nearest

__all__ = ["AsyncRollouts", "OBJECTIVES"]

OBJECTIVES = ("decoupled", "behaviour")
"""``off_policy_objective``'s values."""

FIELDS = (
    "max_staleness",
    "off_policy_objective",
    "async_streaming",
    "async_probe_tolerance",
    "async_max_logprob_gap",
    "async_min_importance_ess",
    "async_replica_threads",
)
"""The flat fields that configure it (beside the switch, ``async_rollouts``)."""


@dataclass(frozen=True)
class AsyncRollouts:
    """The settings of a run whose rollouts run ahead of its update (``max_staleness >= 1``)."""

    max_staleness: int
    """The most optimizer steps between the weights that sampled a token and the weights it trains (>= 1)."""
    off_policy_objective: str
    """``'decoupled'`` (the ratio against the proximal policy, the behaviour policy in a truncated importance weight)
    or ``'behaviour'`` (the ratio against the behaviour log-probs)."""
    streaming: bool
    """The replica rolls out every batch it may at once (``async_streaming``; None there: on with HF generate, off
    with continuous batching, which runs one batch at a time)."""
    probe_tolerance: float | None
    """The weight-push probe's bound (``async_probe_tolerance``; None: by dtype, see
    :func:`trl_plugins.trainers.async_rollouts.probe_tolerance`; negative: off)."""
    max_logprob_gap: float | None
    """The decoupled objective's tripwire on the step's mean proximal-behaviour log-prob gap (None: off)."""
    min_importance_ess: float | None
    """The decoupled objective's tripwire on the importance weights' effective sample size, a share (None: off)."""
    replica_threads: int | None
    """Torch threads of the replica process (None: half the cores, at least 1)."""

    @property
    def decoupled(self) -> bool:
        """Stale tokens train with the decoupled PPO objective: the old log-probs are the proximal policy's,
        recomputed by a forward at the update's start, and the behaviour policy enters as a truncated importance
        weight (so the sampler/trainer mismatch correction applies to every batch)."""
        return self.off_policy_objective == "decoupled"

    @classmethod
    def from_config(cls, config: Any, environ: Mapping[str, str] | None = None) -> AsyncRollouts | None:
        """The settings of ``config``: None when ``async_rollouts`` is off or ``max_staleness`` is 0 (the synchronous
        loop, bit for bit). ``environ``: the launcher's environment (default: this process's).

        Raises:
            ValueError: a setting of it given while it is off (or with ``max_staleness=0``), a value out of range, a
                combination it cannot serve, or what the replica path cannot do in this run (each says what to set).
            SettingError: an unknown ``off_policy_objective``.
        """
        from trl_plugins.run.settings import off_default

        given = off_default(config, FIELDS)
        if not config.async_rollouts:
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure asynchronous rollouts, which are off: set "
                    f"async_rollouts=True, or drop them."
                )
            return None
        if config.max_staleness < 0:
            raise ValueError(
                f"max_staleness={config.max_staleness}: it counts optimizer steps (0: the synchronous loop)."
            )
        if config.off_policy_objective not in OBJECTIVES:
            raise SettingError(
                "off_policy_objective",
                f"{config.off_policy_objective!r} is not one of 'decoupled', "
                f"'behaviour'.{nearest(config.off_policy_objective, list(OBJECTIVES))}",
            )
        if config.async_replica_threads is not None and config.async_replica_threads < 1:
            raise ValueError(f"async_replica_threads must be >= 1 or None, got {config.async_replica_threads}.")
        if config.async_min_importance_ess is not None and not 0 <= config.async_min_importance_ess <= 1:
            raise ValueError(
                f"async_min_importance_ess is a share in [0, 1] (or None: off), got {config.async_min_importance_ess}."
            )
        if config.max_staleness == 0:
            extra = [g for g in given if not g.startswith("max_staleness")]
            if extra:
                raise ValueError(
                    f"{', '.join(extra)} configure how stale rollouts are trained, but max_staleness=0 is the "
                    f"synchronous loop (no replica, nothing stale): drop them or set max_staleness >= 1."
                )
            return None
        if config.off_policy_objective == "decoupled" and not config.vllm_importance_sampling_correction:
            raise ValueError(
                "off_policy_objective='decoupled' weighs stale tokens by the truncated importance weight "
                "pi_prox / pi_behaviour, which vllm_importance_sampling_correction=False turns off: turn it on, "
                "or set off_policy_objective='behaviour'."
            )
        continuous_batching = config.use_transformers_continuous_batching
        if config.async_streaming and continuous_batching:
            raise ValueError(
                "async_streaming=True rolls out several batches at once, which the replica does with HF "
                "generate only (continuous batching's manager serves one rollout at a time): set "
                "async_streaming=False or leave it unset, or use HF generate."
            )
        # Honour or refuse: what the replica path does not do yet is refused before anything loads.
        missing = unavailable(config, os.environ if environ is None else environ)
        if missing:
            raise ValueError(
                f"async_rollouts with max_staleness={config.max_staleness} is not available with "
                f"{'; '.join(missing)}. Or set max_staleness=0 (the synchronous loop). docs/training.md says "
                f"what the asynchronous path supports."
            )
        return cls(
            max_staleness=config.max_staleness,
            off_policy_objective=config.off_policy_objective,
            streaming=not continuous_batching if config.async_streaming is None else bool(config.async_streaming),
            probe_tolerance=config.async_probe_tolerance,
            max_logprob_gap=config.async_max_logprob_gap,
            min_importance_ess=config.async_min_importance_ess,
            replica_threads=config.async_replica_threads,
        )


def unavailable(config: Any, environ: Mapping[str, str]) -> list[str]:
    """What asynchronous rollouts with a replica cannot do yet in this run, given the launcher's ``environ``; each
    with what to use instead. Empty: available."""
    missing = []
    if config.use_vllm and config.vllm_mode != "server":
        missing.append(
            "vLLM colocate mode (the engine shares the trainer's device and process): use "
            "vllm_mode='server', HF generate or use_transformers_continuous_batching"
        )
    if config.num_iterations > 1:
        missing.append(f"num_iterations={config.num_iterations} (several updates per rollout): use 1")
    import torch

    if not config.use_vllm and not config.use_cpu and (torch.cuda.is_available() or torch.backends.mps.is_available()):
        missing.append(
            "an accelerator device with a generation replica (built and measured on the CPU only): set "
            "use_cpu=True, or generate with a vLLM server (vllm_mode='server')"
        )
    return missing
