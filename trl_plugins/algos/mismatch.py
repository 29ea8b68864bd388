"""Sampler/trainer mismatch correction: truncated (TIS) and masked (MIS) importance weights. Pure.

A fast sampler (vLLM) and the trainer give different log-probs for the same weights and tokens
(kernels, precision, logit processing). With ``pi_sampler`` the distribution that actually sampled
and ``pi_old`` the trainer's own forward of the same weights, the decoupled PPO objective is

    ``loss_t = w_t * ppo_clip(pi / pi_old, A)_t``,  ``w = pi_old / pi_sampler`` bounded, detached,

so the clip is anchored on the trainer's numbers and ``w`` re-weights sampler tokens towards the
trainer's distribution (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training" (TIS); Liu et al. 2025, "When speed kills stability" (MIS); TRL's
``vllm_importance_sampling_*``; verl's rollout correction). Bounding ``w`` trades bias for variance:
truncation clamps it to ``[C_min, C_max]``, masking drops tokens or whole sequences outside.
"""

from __future__ import annotations

import math

import torch

from trl_plugins.algos.losses import kl_estimate
from trl_plugins.types import (
    ImportanceSamplingMode,
    ImportanceWeights,
    KLEstimator,
    MismatchStats,
)

__all__ = ["importance_weights"]


def importance_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    mode: ImportanceSamplingMode | str,
    *,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    log_ratio_clamp: float = 20.0,
) -> ImportanceWeights:
    """Importance weights ``pi_old / pi_sampler`` per token, bounded by ``mode``, with their statistics.

    With ``d_t = old_t - sampler_t`` on the action tokens (0 elsewhere):

    - token modes: ``r_t = exp(d_t)``;
    - sequence modes: ``r_t = exp(sum_s d_s)`` over the row's action tokens (one datum per row), the
      same for every token of the row;
    - ``*_truncate``: ``w = clamp(r, C_min, C_max)``; ``*_mask``: ``w = r`` inside ``[C_min, C_max]``
      (bounds included), else 0. A bound that is None is absent (TRL's convention).

    The exponent is clamped to ``+-log_ratio_clamp`` (a ratio beyond ``e^20`` is then read as ``e^20``)
    so that no weight overflows; bounds inside that range act exactly.

    Args:
        old_logprobs: ``(B, T)`` the trainer's log-probs of the targets under the sampling weights.
        sampler_logprobs: ``(B, T)`` the sampler's (behaviour) log-probs.
        action_mask: ``(B, T)`` 1 on sampled tokens; whatever the other positions hold is never read.
        mode: One of :class:`ImportanceSamplingMode`.
        clip_min, clip_max: ``C_min``, ``C_max``.

    Returns:
        :class:`ImportanceWeights`: ``(B, T)`` detached weights, 0 off the mask, and the statistics
        (:class:`MismatchStats`; k3/k1 estimates of KL(sampler || trainer) are per token in every mode).

    Raises:
        ValueError: a negative bound, ``C_min >= C_max``, or a truncating mode without any bound.
    """
    mode = ImportanceSamplingMode(mode)
    if (clip_min is not None and clip_min < 0) or (clip_max is not None and clip_max <= 0):
        raise ValueError(f"need clip_min >= 0 and clip_max > 0, got clip_min={clip_min}, clip_max={clip_max}.")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"need clip_min < clip_max, got {clip_min} >= {clip_max}.")
    if not mode.is_mask and clip_min is None and clip_max is None:
        raise ValueError(f"{mode} needs at least one of clip_min and clip_max.")
    with torch.no_grad():
        on = action_mask.bool()
        m = on.to(torch.float32)
        d = torch.where(on, old_logprobs.detach().float() - sampler_logprobs.detach().float(), torch.zeros_like(m))
        if mode.is_sequence:
            log_r = d.sum(dim=1, keepdim=True).expand_as(d)
        else:
            log_r = d
        r = torch.exp(log_r.clamp(-log_ratio_clamp, log_ratio_clamp))
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        outside = (r < lo) | (r > hi)
        w = torch.where(outside, torch.zeros_like(r), r) if mode.is_mask else r.clamp(min=lo, max=hi)
        w = torch.where(on, w, torch.zeros_like(w))
        # The ratios the bounds act on: one per action token, or one per row that has action tokens.
        units, unit_r = (on.any(dim=1), r[:, 0]) if mode.is_sequence else (on, r)
        inf = torch.full_like(unit_r, math.inf)
        w_inf = torch.full_like(w, math.inf)
        stats = MismatchStats(
            num_tokens=m.sum(),
            log_ratio_sum=(d * m).sum(),
            # k3 of KL(sampler || trainer) from sampler tokens: log q/p = old - sampler = d.
            k3_sum=(kl_estimate(torch.zeros_like(d), d, KLEstimator.K3) * m).sum(),
            abs_log_ratio_sum=(d.abs() * m).sum(),
            weight_sum=(w * m).sum(),
            bounded_tokens=(outside & on).sum().to(torch.float32),
            ratio_min=torch.where(units, unit_r, inf).min(),
            ratio_max=torch.where(units, unit_r, -inf).max(),
            weight_min=torch.where(on, w, w_inf).min(),
            weight_max=torch.where(on, w, -w_inf).max(),
        )
    return ImportanceWeights(weights=w.to(old_logprobs.dtype), stats=stats)
