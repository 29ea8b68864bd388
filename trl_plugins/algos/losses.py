"""Policy and value losses, KL estimators: pure functions returning per-token matrices.

Nothing here aggregates: every function returns a ``(B, T)`` loss that is 0 off the mask, and
:mod:`trl_plugins.algos.aggregation` turns it into a scalar with explicit global denominators.
Policy-loss plugins share one call contract: ``loss(PolicyLossInput) -> PolicyLossOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.registry import POLICY_LOSSES
from trl_plugins.types import (
    KLEstimator,
    PolicyLossInput,
    PolicyLossOutput,
    PolicyLossStats,
    ValueLossOutput,
)

__all__ = [
    "ppo_clip_loss",
    "clip_stats",
    "clipped_value_loss",
    "kl_estimate",
    "kl_gradient_problem",
    "PPOClipLoss",
    "GeneralizedJSDLoss",
]


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator | str = KLEstimator.K3,
    *,
    clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token estimate of KL(p || q) from tokens sampled from ``p`` (Schulman, "Approximating KL").

    With ``log r = log q - log p``: ``k1 = -log r``, ``k2 = 0.5 (log r)^2``, ``k3 = r - 1 - log r`` (by its
    Taylor series for ``|log r| < 0.01``, so it stays accurate for a policy near its reference).
    Only k3's ``exp`` is guarded: ``r = exp(min(log r, clamp))``, so a token the reference finds far
    likelier than the policy cannot overflow; everywhere else the estimates (and their gradients) are
    exact, in particular on the tokens furthest below the reference, which the KL must keep pulling on.

    Args:
        logprobs: ``(B, T)`` log p (the policy, usually with gradient).
        ref_logprobs: ``(B, T)`` log q (the reference).
        clamp: Upper bound on ``log r`` inside k3's ``exp``.

    Returns:
        ``(B, T)`` estimates (not masked).
    """
    log_r = ref_logprobs - logprobs
    est = KLEstimator(estimator)
    if est == KLEstimator.K1:
        return -log_r
    if est == KLEstimator.K2:
        return 0.5 * log_r.pow(2)
    return _k3(log_r, clamp)


def _k3(log_r: torch.Tensor, clamp: float) -> torch.Tensor:
    """``exp(log_r) - 1 - log_r``, accurate near 0 and guarded above ``clamp``."""
    # exp(x) - 1 - x cancels to noise in float32 for small |x|, where k3 ~ x^2 / 2 is what gets logged: there
    # the Taylor series (error ~ x^5 / 120) is exact to float precision.
    series = log_r * log_r * (0.5 + log_r * (1.0 / 6.0 + log_r / 24.0))
    return torch.where(log_r.abs() < 1e-2, series, torch.expm1(log_r.clamp(max=clamp)) - log_r)


def kl_gradient_problem(estimator: KLEstimator | str, importance_weighted: bool) -> str | None:
    """Why a KL term in the loss would not follow the gradient of KL(policy || reference), or None when it does.

    On tokens sampled from the behaviour policy ``b``, the loss term ``w * k`` with ``w = pi / b`` (the importance
    ratio, differentiable) has expected value ``E_pi[k]`` and expected gradient ``grad E_pi[k]``: exact for k1 and k3,
    whose expectations under ``pi`` are the KL, but not for k2 (``E_pi[k2]`` is not the KL: 20% to 86% off in 6-token
    examples). Without the ratio the term is ``v * k``, ``v = pi_old / b`` the detached weight the policy term carries
    (1 when the loss's anchor is ``b`` itself), with expected gradient ``E_pi_old[grad k]``; at ``pi = pi_old`` (the
    first optimizer step on a batch) that is exact for k2 (``grad k2 = log(pi/ref) grad log pi``), zero for k1
    (``E_pi[grad log pi] = 0``), and for k3 the gradient of the forward KL(reference || policy), GRPO's usual choice
    (kept). ``tests/test_algos.py`` checks each by exact enumeration, with ``b != pi_old != pi``.
    """
    est = KLEstimator(estimator)
    if est == KLEstimator.K2 and importance_weighted:
        return (
            "k2 weighted by the importance ratio (use_bias_correction_kl, TRL's default) has a biased gradient: "
            "E_pi[k2] is not the KL, so its gradient is not the KL's"
        )
    if est == KLEstimator.K1 and not importance_weighted:
        return (
            "k1 without the importance ratio has zero expected gradient (E_pi[grad log pi] = 0): the term does nothing"
        )
    return None


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric bounds (Schulman et al. 2017; DAPO clip-higher).

    ``ratio = exp(logprobs - behaviour_logprobs)`` (log-ratio clamped to ``+-log_ratio_clamp``),
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``. With ``dual_clip = c > 1``
    (Ye et al. 2020) the loss of a negative-advantage token is further capped at ``-A * c``, so a
    huge ratio on a bad token cannot dominate the update.

    Args:
        logprobs: ``(B, T)`` current log-probs of the targets (with gradient).
        behaviour_logprobs: ``(B, T)`` log-probs under the sampling policy.
        advantages: ``(B, T)``.
        action_mask: ``(B, T)`` 1 on sampled tokens; the loss is 0 elsewhere.

    Returns:
        :class:`PolicyLossOutput` with the ``(B, T)`` loss and detached statistics.

    Raises:
        ValueError: if the clip range is invalid.
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}.")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}.")
    mask = action_mask.to(logprobs.dtype)
    on = mask.bool()
    # Whatever sits at masked positions (placeholders, padding, even inf) must not reach the loss or
    # its gradient: neutralise it before any arithmetic (0 * inf would be nan in the backward).
    advantages = torch.where(on, advantages, torch.zeros_like(advantages))
    behaviour_logprobs = torch.where(on, behaviour_logprobs, logprobs.detach())
    log_ratio = (logprobs - behaviour_logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    loss = torch.where(on, loss, torch.zeros_like(loss))
    stats = clip_stats(
        ratio,
        log_ratio,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual=dual,
        log_ratio_clamp=log_ratio_clamp,
    )
    return PolicyLossOutput(per_token_loss=loss, stats=stats)


def clip_stats(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossStats:
    """The detached :class:`PolicyLossStats` of a clipped surrogate over the tokens of ``mask``: ``ratio`` is the ratio
    each token was clipped with (its own, or its span's), ``log_ratio`` the token's own log-ratio (for the k3 estimate
    of KL(behaviour || current) and the log-prob gap), ``advantages`` the advantage whose sign says which bound cuts
    the gradient, ``dual`` where a dual clip bound the loss."""
    with torch.no_grad():
        on = mask.bool()
        r = ratio.detach()
        lr = log_ratio.detach()
        dual = torch.zeros_like(on) if dual is None else dual
        return PolicyLossStats(
            num_tokens=mask.sum(),
            clipped_low=((r < 1.0 - clip_low) & (advantages < 0) & on).sum().to(mask.dtype),
            clipped_high=((r > 1.0 + clip_high) & (advantages > 0) & on).sum().to(mask.dtype),
            dual_clipped=(dual & on).sum().to(mask.dtype),
            # k3 estimate of KL(behaviour || current) from behaviour samples: ratio - 1 - log ratio.
            approx_kl_sum=(_k3(lr, log_ratio_clamp) * mask).sum(),
            abs_log_ratio_sum=(lr.abs() * mask).sum(),
            ratio_sum=(r * mask).sum(),
            ratio_min=torch.where(on, r, torch.full_like(r, float("inf"))).min(),
            ratio_max=torch.where(on, r, torch.full_like(r, float("-inf"))).max(),
        )


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_range: float = 0.2,
) -> ValueLossOutput:
    """Clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    Args:
        values: ``(B, T)`` current critic values (with gradient).
        old_values: ``(B, T)`` critic values at rollout time.
        returns: ``(B, T)`` value targets.
        action_mask: ``(B, T)``; the loss is 0 elsewhere.

    Returns:
        :class:`ValueLossOutput` with the ``(B, T)`` loss and the count of clipped tokens.
    """
    mask = action_mask.to(values.dtype)
    on = mask.bool()
    old_values = torch.where(on, old_values, values.detach())
    returns = torch.where(on, returns, values.detach())
    # V itself clamped to [V_old - c, V_old + c]: exactly V where nothing is clipped (V_old + clamp(V - V_old)
    # is not, in floating point, and miscounted such tokens as clipped).
    v_clipped = torch.clamp(values, min=old_values - clip_range, max=old_values + clip_range)
    unclipped = (values - returns).pow(2)
    clipped = (v_clipped - returns).pow(2)
    loss = torch.where(on, 0.5 * torch.maximum(unclipped, clipped), torch.zeros_like(values))
    with torch.no_grad():
        n_clipped = ((clipped > unclipped) & on).sum().to(mask.dtype)
    return ValueLossOutput(per_token_loss=loss, clipped=n_clipped)


@POLICY_LOSSES.register("ppo_clip")
@dataclass
class PPOClipLoss:
    """Asymmetric-clip PPO, optionally with a reference-KL term and an entropy bonus in the loss.

    ``loss_t = v_t * (ppo_clip_t + kl_coef * rho_t * KL_t(policy || reference)) - entropy_coef * H_t``, with
    ``rho_t = pi / pi_old`` (differentiable, ``pi_old`` the anchor ``PolicyLossInput.behaviour_logprobs``) when
    ``kl_importance_weight`` and 1 otherwise, and ``v_t`` the detached importance weight ``pi_old / pi_behaviour``
    (``PolicyLossInput.is_weights``: the sampler/trainer mismatch correction's, or the decoupled objective's
    ``pi_prox / pi_behaviour``, truncated or masked) when the trainer passes it and 1 otherwise. ``v_t`` weights the
    KL term as it weights the policy term, so the weighted KL term's importance weight is ``pi / pi_behaviour``, the
    policy that sampled the token, and its truncation is the policy term's. (TRL weights the KL term by
    ``pi / pi_old`` only, which is biased wherever ``pi_old != pi_behaviour``.) The entropy bonus is the
    full-vocabulary entropy of each position's state, the same whichever token was sampled, so it takes no token
    weight (untruncated, ``E_b[v_t | state] = 1``).
    """

    clip_low: float = 0.2
    """Ratio lower bound is ``1 - clip_low``."""
    clip_high: float = 0.28
    """Ratio upper bound is ``1 + clip_high``."""
    dual_clip: float | None = None
    """Cap on the loss of negative-advantage tokens, as a multiple of ``-A`` (e.g. 3.0)."""
    log_ratio_clamp: float = 20.0
    """Clamp on ``|log ratio|`` before exponentiating."""
    kl_coef: float = 0.0
    """Weight of the reference KL in the loss (needs ``ref_logprobs``)."""
    kl_estimator: KLEstimator = KLEstimator.K3
    """KL estimator for the loss term."""
    kl_importance_weight: bool = False
    """Weight the KL term by the importance ratio ``pi / pi_behaviour`` of the policy that sampled the token:
    ``v * pi / pi_old``, the detached ``v = is_weights`` (1 when absent: the anchor is then the behaviour policy)
    times the differentiable ratio to the anchor. On behaviour samples the term's expected value is then
    ``E_pi[k]`` and its expected gradient ``grad E_pi[k]``: KL(pi || ref) and its gradient for k1 and k3
    (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``, which stops at ``pi / pi_old``), except where ``v`` is
    truncated or masked, biased there exactly as the policy term is. Changes the gradient even on-policy, where the
    ratio is 1. False: the term is ``v * k``, expected value ``E_pi_old[k]`` and gradient ``E_pi_old[grad k]``,
    the on-policy unweighted term wherever ``pi = pi_old`` (the first optimizer step on a batch): for k2 the
    reverse-KL gradient, for k3 the forward KL(ref || pi)'s. Refused with k2 (biased) and required with k1 (zero
    expected gradient without it): :func:`kl_gradient_problem`."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs ``entropy``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(
                f"ppo_clip needs 0 <= clip_low < 1 and clip_high >= 0 (ratio in [1-clip_low, 1+clip_high]); "
                f"got clip_low={self.clip_low}, clip_high={self.clip_high}."
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0 + self.clip_high:
            raise ValueError(
                f"ppo_clip: dual_clip={self.dual_clip} must be above 1 + clip_high = {1.0 + self.clip_high}: at or "
                "below "
                f"it the cap would stop negative-advantage tokens inside the clip range, not only far beyond it (TRL's "
                f"delta maps onto dual_clip: raise delta, or lower epsilon_high/clip_high)."
            )
        self.kl_estimator = KLEstimator(self.kl_estimator)
        problem = kl_gradient_problem(self.kl_estimator, self.kl_importance_weight) if self.kl_coef else None
        if problem:
            raise ValueError(
                f"ppo_clip: {problem}. Use kl_estimator='k3' (with or without kl_importance_weight), "
                f"k1 with kl_importance_weight=True, or k2 with kl_importance_weight=False."
            )

    @property
    def needs_ref_logprobs(self) -> bool:
        """Capability: reads ``PolicyLossInput.ref_logprobs`` (a reference-KL term is on)."""
        return self.kl_coef != 0.0

    @property
    def needs_entropy(self) -> bool:
        """Capability: reads ``PolicyLossInput.entropy`` (an entropy bonus is on)."""
        return self.entropy_coef != 0.0

    supports_is_weights = True
    """Capability: applies ``PolicyLossInput.is_weights`` (the mismatch correction's or the decoupled objective's
    weight) to its policy and KL terms."""
    token_local = True
    """Capability: each token's loss reads that token's inputs alone (a datum may be split over ranks)."""

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        out = ppo_clip_loss(
            inp.logprobs,
            inp.behaviour_logprobs,
            inp.advantages,
            inp.action_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            log_ratio_clamp=self.log_ratio_clamp,
        )
        loss = out.per_token_loss
        on = inp.action_mask.bool()
        v = (
            None
            if inp.is_weights is None
            else torch.where(on, inp.is_weights.detach(), torch.zeros_like(inp.is_weights))
        )
        if v is not None:
            loss = loss * v
        if self.kl_coef:
            if inp.ref_logprobs is None:
                raise ValueError("ppo_clip with kl_coef > 0 needs ref_logprobs (enable the reference model).")
            ref = torch.where(on, inp.ref_logprobs, inp.logprobs.detach())
            kl = kl_estimate(inp.logprobs, ref, self.kl_estimator)
            if self.kl_importance_weight:
                anchor = torch.where(on, inp.behaviour_logprobs, inp.logprobs.detach())
                kl = kl * torch.exp((inp.logprobs - anchor).clamp(-self.log_ratio_clamp, self.log_ratio_clamp))
            if v is not None:
                # The anchor is pi_old, not the policy that sampled: v = pi_old / pi_behaviour carries the ratio the
                # rest of the way to pi / pi_behaviour, bounded as the policy term's is.
                kl = kl * v
            loss = loss + self.kl_coef * torch.where(on, kl, torch.zeros_like(kl))
        if self.entropy_coef:
            if inp.entropy is None:
                raise ValueError("ppo_clip with entropy_coef > 0 needs per-token entropy on the input.")
            loss = loss - self.entropy_coef * torch.where(on, inp.entropy, torch.zeros_like(inp.entropy))
        return PolicyLossOutput(per_token_loss=loss, stats=out.stats)


@POLICY_LOSSES.register("jsd")
@dataclass
class GeneralizedJSDLoss:
    """On-policy distillation's loss: the generalised Jensen-Shannon divergence between the student's and the
    teacher's next-token distributions over the whole vocabulary at each action position, as TRL's
    ``DistillationTrainer`` computes it (``_chunked_divergence_loss``), plus optionally the PPO-clip term.

    ``loss_t = JSD_beta(p_student,t || p_teacher,t) + rl_weight * ppo_clip_t``, with
    ``JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1 - beta) p_s + beta p_t``; ``beta`` 0 is the
    forward KL(teacher || student) and 1 the reverse KL(student || teacher), each special-cased (not the limit of
    the mixture), both logits divided by the sampling temperature. The trainer computes the divergence
    (``PolicyLossInput.teacher_divergence``, with gradient to the student only) from both models' final hidden
    states and output heads without materialising either ``(tokens, vocabulary)`` logits, by TRL's own
    ``ChunkedDivergenceFunction`` (:func:`~trl_plugins.modeling.logprobs.micro_batch_logprobs_and_divergence`).
    The divergence is a property of each position's state, the same whichever token was sampled, so it takes no
    importance weight; the PPO term takes ``is_weights`` as :class:`PPOClipLoss` does. Prompt, tool-output and
    template-glue positions carry none: only the action mask's positions are scored. With a server teacher (which
    returns log-probs, not distributions) the divergence is computed over the support ``top_k`` and ``tail`` name, as
    TRL's ``ServerDistillationTrainer`` computes it (:mod:`trl_plugins.modeling.sparse_divergence`).
    """

    beta: float = 1.0
    """0: forward KL(teacher || student); 1: reverse KL(student || teacher), TRL's default; in between the
    generalised JSD with the mixture ``(1 - beta) p_student + beta p_teacher``."""
    rl_weight: float = 0.0
    """Weight of the PPO-clip term on the run's advantages (0: pure distillation, TRL's objective)."""
    clip_low: float = 0.2
    """The PPO term's ratio lower bound is ``1 - clip_low``."""
    clip_high: float = 0.28
    """The PPO term's ratio upper bound is ``1 + clip_high``."""
    top_k: int | None = None
    """A server teacher only (it returns its top-k log-probs, not whole distributions): the divergence is computed on
    the teacher's ``top_k`` most likely tokens at beta 0, on the sampled token (and the teacher's top token, below
    beta 1) otherwise, which needs ``top_k`` 1, as TRL's ``ServerDistillationTrainer`` does. None: 1."""
    tail: bool | None = None
    """A server teacher only: the mass outside that support is one more bucket (True, None's meaning, TRL's
    ``loss_add_tail``), or both distributions are renormalised over the support (False)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"jsd needs 0 <= beta <= 1 (0 forward KL, 1 reverse KL), got beta={self.beta}.")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ValueError(f"jsd needs top_k to be an int (a server teacher's top-k), got top_k={self.top_k!r}.")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"jsd needs top_k >= 1 (how many of a server teacher's tokens), got top_k={self.top_k}.")
        if self.top_k not in (None, 1) and self.beta > 0:
            raise ValueError(
                f"jsd with top_k={self.top_k} needs beta=0 (the forward KL over the teacher's top-k): at beta > 0 the "
                f"support is the sampled token, whose teacher log-prob a server gives, so top_k must be 1 (as TRL's "
                f"ServerDistillationTrainer); got beta={self.beta}."
            )
        if self.tail is False and (self.beta == 1.0 or (self.beta == 0.0 and self.top_k in (None, 1))):
            raise ValueError(
                f"jsd with tail=False renormalises over a one-token support here (beta={self.beta}, "
                f"top_k={self.top_k or 1}), where the divergence is always 0: keep the tail bucket, or at beta 0 raise "
                f"top_k."
            )
        if self.rl_weight < 0.0:
            raise ValueError(f"jsd needs rl_weight >= 0 (the PPO term's weight), got rl_weight={self.rl_weight}.")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(
                f"jsd needs 0 <= clip_low < 1 and clip_high >= 0 (the PPO term's ratio in [1-clip_low, 1+clip_high]); "
                f"got clip_low={self.clip_low}, clip_high={self.clip_high}."
            )
        self._sum = 0.0
        self._tokens = 0.0

    needs_ref_logprobs = False
    needs_entropy = False
    supports_is_weights = True
    """Capability: the PPO term takes ``PolicyLossInput.is_weights``; the divergence needs none."""
    token_local = True

    @property
    def teacher_divergence(self) -> float:
        """Declaration: reads ``PolicyLossInput.teacher_divergence``, the generalised JSD at this ``beta``."""
        return self.beta

    @property
    def teacher_top_k(self) -> int | None:
        """Declaration: a server teacher's support size (``top_k``)."""
        return self.top_k

    @property
    def teacher_tail(self) -> bool | None:
        """Declaration: a server teacher's tail bucket (``tail``)."""
        return self.tail

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        if inp.teacher_divergence is None:
            raise ValueError("jsd needs PolicyLossInput.teacher_divergence (the run's teacher_model_name_or_path).")
        on = inp.action_mask.bool()
        divergence = torch.where(on, inp.teacher_divergence, torch.zeros_like(inp.teacher_divergence))
        out = ppo_clip_loss(
            inp.logprobs,
            inp.behaviour_logprobs,
            inp.advantages,
            inp.action_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        loss = divergence
        if self.rl_weight:
            ppo = out.per_token_loss
            if inp.is_weights is not None:
                ppo = ppo * torch.where(on, inp.is_weights.detach(), torch.zeros_like(inp.is_weights))
            loss = loss + self.rl_weight * ppo
        self._sum += float(divergence.detach().sum())
        self._tokens += float(on.sum())
        return PolicyLossOutput(per_token_loss=loss, stats=out.stats)

    def step_metrics(self) -> dict[str, float]:
        """``teacher_divergence``: the mean divergence per action token of this rank's micro-batches since the last
        call (averaged over ranks)."""
        mean = self._sum / self._tokens if self._tokens else 0.0
        self._sum = self._tokens = 0.0
        return {"teacher_divergence": mean}
