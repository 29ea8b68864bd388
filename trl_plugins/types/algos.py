"""What the maths seams exchange: aggregation modes, KL estimators, importance-sampling modes, and the inputs,
outputs and statistics of advantage estimators, policy losses and value losses."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

__all__ = [
    "AggregationMode",
    "KLEstimator",
    "ImportanceSamplingMode",
    "MismatchStats",
    "ImportanceWeights",
    "AdvantageInput",
    "AdvantageOutput",
    "PolicyLossInput",
    "PolicyLossStats",
    "PolicyLossOutput",
    "ValueLossOutput",
    "stat_reductions",
    "merge_stats",
]


class AggregationMode(enum.StrEnum):
    """How per-token losses become one scalar; every mode takes explicit global denominators."""

    TOKEN_MEAN = "token_mean"
    """Sum over all loss tokens / global number of loss tokens (DAPO)."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Mean over sequences of each sequence's token sum."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"
    """Token sum / (global sequences x a constant length), Dr. GRPO."""


class KLEstimator(enum.StrEnum):
    """Per-token estimators of KL(policy || reference) from samples of the policy (Schulman 2020)."""

    K1 = "k1"
    """``log p - log q``: unbiased, high variance, can be negative."""
    K2 = "k2"
    """``0.5 (log p - log q)^2``: biased, low variance, non-negative."""
    K3 = "k3"
    """``q/p - 1 - log(q/p)``: unbiased, low variance, non-negative."""


class ImportanceSamplingMode(enum.StrEnum):
    """How the sampler/trainer importance weight ``w = pi_old / pi_sampler`` is bounded (TRL's
    ``vllm_importance_sampling_mode``; verl's rollout correction). ``[C_min, C_max]`` are the bounds."""

    TOKEN_TRUNCATE = "token_truncate"
    """Per-token ratio clamped to ``[C_min, C_max]`` (truncated IS, TIS)."""
    TOKEN_MASK = "token_mask"
    """Per-token ratio, 0 where it leaves ``[C_min, C_max]`` (masked IS, MIS)."""
    SEQUENCE_TRUNCATE = "sequence_truncate"
    """One ratio per sequence (product over its action tokens), clamped, on every token of it."""
    SEQUENCE_MASK = "sequence_mask"
    """One ratio per sequence; a sequence whose ratio leaves ``[C_min, C_max]`` gets weight 0."""

    @property
    def is_sequence(self) -> bool:
        """True for the sequence-level modes."""
        return self in (ImportanceSamplingMode.SEQUENCE_TRUNCATE, ImportanceSamplingMode.SEQUENCE_MASK)

    @property
    def is_mask(self) -> bool:
        """True for the masking modes (out-of-bounds weights become 0 instead of the bound)."""
        return self in (ImportanceSamplingMode.TOKEN_MASK, ImportanceSamplingMode.SEQUENCE_MASK)


def _minimum() -> Any:
    return field(metadata={"reduce": "min"})


def _maximum() -> Any:
    return field(metadata={"reduce": "max"})


def stat_reductions(cls: type) -> dict[str, str]:
    """How each field of a statistics dataclass combines over micro-batches and ranks: ``"sum"`` unless the field
    declares ``"min"`` or ``"max"`` (``field(metadata={"reduce": ...})``)."""
    return {f.name: f.metadata.get("reduce", "sum") for f in fields(cls)}


def merge_stats(a: Any, b: Any) -> Any:
    """Two statistics records of one dataclass combined field by field (:func:`stat_reductions`)."""
    out = {}
    for name, how in stat_reductions(type(a)).items():
        x, y = getattr(a, name), getattr(b, name)
        out[name] = torch.minimum(x, y) if how == "min" else torch.maximum(x, y) if how == "max" else x + y
    return type(a)(**out)


@dataclass
class MismatchStats:
    """Detached, additive statistics of the sampler/trainer mismatch over the action tokens of a batch.

    ``r = pi_old / pi_sampler`` per token; "unit" = token (token modes) or sequence (sequence modes).
    Sums, counts and extremes, so micro-batches and ranks combine exactly (:func:`merge_stats`).
    """

    num_tokens: torch.Tensor
    """Action tokens counted."""
    log_ratio_sum: torch.Tensor
    """Sum of ``log r``; minus its mean is the k1 estimate of KL(sampler || trainer)."""
    k3_sum: torch.Tensor
    """Sum of ``r - 1 - log r``: the k3 estimate of KL(sampler || trainer) from sampler tokens."""
    abs_log_ratio_sum: torch.Tensor
    """Sum of ``|log pi_old - log pi_sampler|`` (TRL's ``sampling_logp_difference``)."""
    weight_sum: torch.Tensor
    """Sum of the weights applied to the tokens (after truncation or masking)."""
    bounded_tokens: torch.Tensor
    """Tokens whose unit's ratio left ``[C_min, C_max]`` (truncated or masked)."""
    ratio_min: torch.Tensor = _minimum()
    """Smallest unit ratio before bounding (``+inf`` when no token)."""
    ratio_max: torch.Tensor = _maximum()
    """Largest unit ratio before bounding (``-inf`` when no token)."""
    weight_min: torch.Tensor = _minimum()
    """Smallest applied token weight (``+inf`` when no token)."""
    weight_max: torch.Tensor = _maximum()
    """Largest applied token weight (``-inf`` when no token)."""

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """Combine two micro-batches' statistics (sums add, extremes take min/max)."""
        return merge_stats(self, other)

    def summary(self, mode: "ImportanceSamplingMode | str") -> dict[str, float]:
        """Means, fractions and extremes as floats, keyed by metric name (for logging only)."""
        n = max(float(self.num_tokens), 1.0)
        bounded = "is_masked_frac" if ImportanceSamplingMode(mode).is_mask else "is_truncated_frac"
        return {
            "is_mismatch_kl": float(self.k3_sum) / n,
            "is_mismatch_k1": -float(self.log_ratio_sum) / n,
            "is_logprob_gap": float(self.abs_log_ratio_sum) / n,
            "is_ratio_min": float(self.ratio_min),
            "is_ratio_max": float(self.ratio_max),
            "is_weight_mean": float(self.weight_sum) / n,
            "is_weight_min": float(self.weight_min),
            "is_weight_max": float(self.weight_max),
            bounded: float(self.bounded_tokens) / n,
        }


@dataclass
class ImportanceWeights:
    """Sampler/trainer importance weights of a batch and their statistics."""

    weights: torch.Tensor
    """``(B, T)`` detached weight of each token's loss; 0 off the action mask."""
    stats: MismatchStats
    """Detached statistics."""


@dataclass
class AdvantageInput:
    """Everything an advantage estimator may read. Shapes: ``N`` trajectories, ``T`` positions.

    Outcome estimators (``group``, ``rloo``) read ``rewards`` and ``group_ids``; ``gae`` also reads
    the token-level fields, aligned with datum positions.
    """

    rewards: torch.Tensor
    """``(N,)`` total reward of each trajectory; for an estimator that ``needs_values``, 0 where ``bootstrap_mask``
    is 1 (the bootstrapped value stands for the rest of the episode)."""
    group_ids: torch.Tensor
    """``(N,)`` integer group of each trajectory."""
    action_mask: torch.Tensor | None = None
    """``(N, T)`` datum action mask (gae)."""
    values: torch.Tensor | None = None
    """``(N, T)`` critic value of the state before each position's target (gae)."""
    bootstrap_mask: torch.Tensor | None = None
    """``(N,)`` 1 for truncated trajectories whose last state is bootstrapped (``truncated_policy='bootstrap'``;
    gae)."""
    bootstrap_values: torch.Tensor | None = None
    """``(N,)`` value of the state after the last token, used where ``bootstrap_mask`` is 1 (gae)."""
    token_rewards: torch.Tensor | None = None
    """``(N, T)`` extra per-token rewards, e.g. ``-beta * KL`` to a reference (gae)."""
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums a tensor over the data-parallel ranks, for batch statistics that must be global (e.g.
    whitening); None in one process. Every rank calls the estimator, so every rank must call it alike."""
    turn_ids: torch.Tensor | None = None
    """``(N, T)`` long, aligned with ``action_mask``: the assistant turn of each action position (0, 1, ... within
    its trajectory), -1 elsewhere (``Datum.turn_ids``). Passed to an estimator that ``needs_turn_ids``, for
    turn-level credit; None otherwise. Added after the first release: an estimator that ignores it is unchanged."""
    turn_state_ids: torch.Tensor | None = None
    """``(N, T)`` long, with ``turn_ids``: at each action position, an id of the state its turn was taken from (the
    datum's tokens before the turn's first sampled token); two turns share an id exactly when those token prefixes
    are equal (ids are interned over the estimator's batch). -1 elsewhere. For step-level groups of turns taken from
    the same state (GiGPO's anchor states); None unless the estimator ``needs_turn_ids``."""
    behaviour_logprobs: torch.Tensor | None = None
    """``(N, T)`` float64, aligned with ``action_mask``: the log-prob the sampler drew each action token with (the
    student's, in on-policy distillation), 0 elsewhere. With ``teacher_logprobs``, for an estimator that
    ``needs_teacher_logprobs``; None otherwise."""
    teacher_logprobs: torch.Tensor | None = None
    """``(N, T)`` float64: the teacher's log-prob of each action token at the sampling temperature
    (``Datum.teacher_logprobs``), 0 elsewhere; None unless the estimator ``needs_teacher_logprobs``."""


@dataclass
class AdvantageOutput:
    """Advantages and, for critic-based estimators, value targets."""

    advantages: torch.Tensor
    """``(N,)`` per trajectory (outcome estimators) or ``(N, T)`` per position (gae, 0 off-mask)."""
    returns: torch.Tensor | None = None
    """``(N, T)`` value-function targets (gae), 0 off-mask."""


@dataclass
class PolicyLossInput:
    """Everything a policy loss may read; all ``(B, T)`` and aligned with datum positions."""

    logprobs: torch.Tensor
    """Current policy log-probs of the targets (carries the gradient)."""
    behaviour_logprobs: torch.Tensor
    """Log-probs of the PPO "old" policy ``pi_old``, the ratio's anchor: the sampler's behaviour log-probs, or,
    when the trainer passes ``is_weights``, its own forward (of the sampling weights under the mismatch correction;
    of the weights at the start of this update, ``pi_prox``, under the decoupled objective), the gap to the policy
    that sampled then being carried by ``is_weights``."""
    advantages: torch.Tensor
    """Per-position advantages (0 off-mask)."""
    action_mask: torch.Tensor
    """1 on sampled tokens."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-model log-probs, for a KL term in the loss."""
    entropy: torch.Tensor | None = None
    """Per-position entropy of the current policy, for an entropy bonus."""
    is_weights: torch.Tensor | None = None
    """Detached importance weights ``pi_old / pi_behaviour`` (truncated or masked), when the mismatch correction or
    the decoupled objective applies (the trainer passes them only to a loss that declares ``supports_is_weights``);
    None otherwise. They multiply the policy-gradient term and any per-token term estimated from the sampled token
    (a reference KL: with them, ``pi / pi_behaviour = is_weights * pi / pi_old``), so both are bounded alike."""
    turn_ids: torch.Tensor | None = None
    """``(B, T)`` long: the assistant turn of each action position within its row's trajectory (``Datum.turn_ids``),
    -1 off the action mask and on padding. Each row is one datum, so ``(row, turn)`` names one span: the positions of
    one action of the trajectory contract. Rows are never split across micro-batches, so a loss that combines a
    span's or a row's tokens (a sequence- or turn-level ratio) stays exact under any packing. Passed to a loss that
    ``needs_turn_ids``; None otherwise. Added after the first release: a loss that ignores it is unchanged."""
    teacher_divergence: torch.Tensor | None = None
    """``(B, T)``: the generalised JSD between the student's and the teacher's next-token distributions at each action
    position (0 elsewhere), at the ``beta`` the loss declares as ``teacher_divergence``, with gradient to the student;
    passed to a loss that declares it, None otherwise."""


@dataclass
class PolicyLossStats:
    """Detached, additive statistics of a policy loss over the masked tokens of one micro-batch.

    Sums and counts (not means) so that micro-batches and ranks combine exactly (:func:`merge_stats`).
    """

    num_tokens: torch.Tensor
    """Masked tokens counted."""
    clipped_low: torch.Tensor
    """Tokens with negative advantage whose ratio fell below ``1 - clip_low`` (gradient cut)."""
    clipped_high: torch.Tensor
    """Tokens with positive advantage whose ratio rose above ``1 + clip_high`` (gradient cut)."""
    dual_clipped: torch.Tensor
    """Tokens where the dual clip bound the loss."""
    approx_kl_sum: torch.Tensor
    """Sum of the k3 estimate of KL(behaviour || current)."""
    abs_log_ratio_sum: torch.Tensor
    """Sum of ``|log pi_current - log pi_behaviour|``: the behaviour-vs-trainer log-prob gap."""
    ratio_sum: torch.Tensor
    """Sum of importance ratios."""
    ratio_min: torch.Tensor = _minimum()
    """Smallest ratio (``+inf`` when no token)."""
    ratio_max: torch.Tensor = _maximum()
    """Largest ratio (``-inf`` when no token)."""

    def merge(self, other: "PolicyLossStats") -> "PolicyLossStats":
        """Combine two micro-batches' statistics."""
        return merge_stats(self, other)

    def summary(self) -> dict[str, float]:
        """Fractions and means as floats, keyed by metric name (for logging only)."""
        n = max(float(self.num_tokens), 1.0)
        return {
            "clip_frac_low": float(self.clipped_low) / n,
            "clip_frac_high": float(self.clipped_high) / n,
            "dual_clip_frac": float(self.dual_clipped) / n,
            "approx_kl": float(self.approx_kl_sum) / n,
            "behaviour_logprob_gap": float(self.abs_log_ratio_sum) / n,
            "ratio_mean": float(self.ratio_sum) / n,
            "ratio_min": float(self.ratio_min),
            "ratio_max": float(self.ratio_max),
        }


@dataclass
class PolicyLossOutput:
    """A policy loss before aggregation."""

    per_token_loss: torch.Tensor
    """``(B, T)`` loss at every position (masked positions hold 0)."""
    stats: PolicyLossStats
    """Detached statistics."""


@dataclass
class ValueLossOutput:
    """A value loss before aggregation."""

    per_token_loss: torch.Tensor
    """``(B, T)`` loss at every position (masked positions hold 0)."""
    clipped: torch.Tensor
    """Detached count of masked tokens where the clipped branch was the larger."""
