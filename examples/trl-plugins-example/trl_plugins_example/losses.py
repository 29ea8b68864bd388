"""The ``cispo`` policy loss: the policy gradient weighted by a capped, detached importance ratio (CISPO), so a
token far off-policy has its weight capped instead of its gradient cut."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from trl_plugins.types import PolicyLossInput, PolicyLossOutput, PolicyLossStats

__all__ = ["cispo_loss", "CISPOLoss"]


def cispo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    max_weight: float,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped-importance-sampling REINFORCE (CISPO; MiniMax-M1, MiniMax 2025)::

        ratio_t = exp(logprobs_t - behaviour_logprobs_t)
        w_t     = stop_gradient(min(ratio_t, max_weight))
        loss_t  = -w_t * v_t * A_t * logprobs_t          on the action mask, 0 elsewhere

    with ``v_t`` the sampler/trainer mismatch weight (``is_weights``, 1 when None). The gradient on an action token
    is ``-w_t * v_t * A_t * grad log pi_t``: every token keeps a gradient, a far off-policy one a capped weight
    (PPO's clip gives a token outside its range no gradient at all). The value is a weighted log-prob, not a
    surrogate objective: only its gradient means something.

    Args:
        logprobs: ``(B, T)`` current log-probs of the targets (with gradient).
        behaviour_logprobs: ``(B, T)`` log-probs under the sampling policy.
        advantages: ``(B, T)``.
        action_mask: ``(B, T)`` 1 on sampled tokens; the loss and its gradient are 0 elsewhere.
        max_weight: Cap on ``w_t`` (>= 1, so that an on-policy token keeps weight 1).
        is_weights: ``(B, T)`` detached mismatch weights, or None.

    Returns:
        :class:`PolicyLossOutput`: the ``(B, T)`` loss and statistics, in which ``clipped_high`` counts the tokens
        whose weight was capped, whatever their advantage's sign (their gradient is scaled down, not cut);
        ``clipped_low`` and ``dual_clipped`` are 0.
    """
    on = action_mask.bool()
    zeros = torch.zeros_like(logprobs)
    # Whatever sits off the mask (placeholders, padding, even inf) must reach neither the loss nor its gradient.
    log_ratio = torch.where(on, logprobs.detach() - behaviour_logprobs, zeros)
    weight = torch.exp(log_ratio.clamp(max=math.log(max_weight)))  # min(ratio, max_weight), without overflow
    if is_weights is not None:
        weight = weight * torch.where(on, is_weights.detach(), zeros)
    loss = -weight * torch.where(on, advantages, zeros) * torch.where(on, logprobs, zeros)
    with torch.no_grad():
        mask = on.to(logprobs.dtype)
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
        none = mask.new_zeros(())
        stats = PolicyLossStats(
            num_tokens=mask.sum(),
            clipped_low=none,
            clipped_high=((log_ratio > math.log(max_weight)) & on).sum().to(mask.dtype),
            dual_clipped=none,
            approx_kl_sum=((ratio - 1.0 - log_ratio) * mask).sum(),  # k3 estimate of KL(behaviour || current)
            abs_log_ratio_sum=(log_ratio.abs() * mask).sum(),
            ratio_sum=(ratio * mask).sum(),
            ratio_min=torch.where(on, ratio, torch.full_like(ratio, float("inf"))).min(),
            ratio_max=torch.where(on, ratio, torch.full_like(ratio, float("-inf"))).max(),
        )
    return PolicyLossOutput(per_token_loss=torch.where(on, loss, zeros), stats=stats)


@dataclass
class CISPOLoss:
    """``cispo``: :func:`cispo_loss` with an optional entropy bonus::

        loss_t = -w_t * v_t * A_t * logprobs_t - entropy_coef * H_t      on the action mask, 0 elsewhere

    ``H_t`` is the policy's per-token entropy (``PolicyLossInput.entropy``). It has no reference-KL term: with TRL's
    ``beta > 0`` use ``kl_penalty='reward'`` (the run refuses ``kl_penalty='loss'``, since this loss takes no
    ``kl_coef``). TRL's ``entropy_coef`` is written into its ``entropy_coef``.
    """

    needs_ref_logprobs: ClassVar[bool] = False
    """Capability, the same for every instance: a ``ClassVar``, so not a dataclass field (a constructor argument)."""
    supports_is_weights: ClassVar[bool] = True
    """Optional capability: multiplies its policy-gradient term by ``PolicyLossInput.is_weights``."""

    max_weight: float = 2.0
    """Cap on the detached importance weight (>= 1)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (>= 0)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_weight) and self.max_weight >= 1.0):
            raise ValueError(
                f"cispo: max_weight must be a finite number >= 1 (an on-policy token has weight 1), "
                f"got {self.max_weight}."
            )
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0.0):
            raise ValueError(f"cispo: entropy_coef must be a finite number >= 0, got {self.entropy_coef}.")

    @property
    def needs_entropy(self) -> bool:
        """Capability that depends on a setting: reads ``PolicyLossInput.entropy`` when the entropy bonus is on."""
        return self.entropy_coef != 0.0

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        out = cispo_loss(
            inp.logprobs,
            inp.behaviour_logprobs,
            inp.advantages,
            inp.action_mask,
            max_weight=self.max_weight,
            is_weights=inp.is_weights,
        )
        if not self.entropy_coef:
            return out
        if inp.entropy is None:
            raise ValueError("cispo with entropy_coef > 0 needs the per-token entropy on the input.")
        on = inp.action_mask.bool()
        bonus = self.entropy_coef * torch.where(on, inp.entropy, torch.zeros_like(inp.entropy))
        return PolicyLossOutput(per_token_loss=out.per_token_loss - bonus, stats=out.stats)
