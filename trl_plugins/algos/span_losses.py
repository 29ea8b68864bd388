"""Policy losses whose importance ratio is taken over a span of tokens: a whole sequence (GSPO) or one assistant turn.

The trajectory contract's action is one assistant turn (its log-prob is the sum over its tokens); PPO's ratio is per
token. These losses clip one ratio per span instead:

- ``gspo`` (Zheng et al. 2025, "Group Sequence Policy Optimization"): the span is the datum's whole response (every
  action token of the row), and the ratio is length-normalised, ``s = exp(mean_t log(pi_t / pi_old_t))``, clipped to
  the paper's small range ``[1 - 3e-4, 1 + 4e-4]``;
- ``turn_ppo``: the span is one assistant turn (``PolicyLossInput.turn_ids``), the ratio either the turn's likelihood
  ratio ``exp(sum_t log(pi_t / pi_old_t))`` (``normalize=False``: the contract's exact span likelihood, clipped like
  PPO's token ratio to ``[0.8, 1.28]``) or its length-normalised form (``normalize=True``: GSPO's quantity on a turn,
  with GSPO's range). The two are different objectives: the summed ratio of a 30-token turn moves ~30 times as far
  as a token's for the same per-token change, so its clip binds on far smaller per-token moves; the normalised one
  treats a turn like GSPO treats a sequence.

Each span ``k`` with ratio ``r_k`` and advantages ``A_t`` contributes, on each of its tokens ``t``, the clipped
per-token surrogate ``max(-A_t s_t, -A_t clip(s_t)) / |k|`` of a per-token ratio whose *value* is the span's and whose
*gradient* is the token's own (GSPO-token, the paper's eq. 13-14, verl's ``compute_policy_loss_gspo``):

- normalised (``gspo``, ``turn_ppo`` with ``normalize=True``): ``s_t = sg[r_k] * pi_t / sg[pi_t]``, so
  ``grad s_t = r_k grad log pi_t`` and the span's gradient is ``-r_k mean_t(A_t grad log pi_t)`` (a token whose
  clip binds adds 0);
- summed (``turn_ppo``): ``s_t = sg[r_k] * (pi_t / sg[pi_t]) ** |k|``, so ``grad s_t / |k| = r_k grad log pi_t`` and
  the span's gradient is ``-r_k sum_t A_t grad log pi_t``: the turn's likelihood ratio weighting each token's own
  policy gradient.

In general ``s_t = sg[r_k] * exp(|k| (d log r_k / d log pi_t) (log pi_t - sg[log pi_t]))``. For an advantage that is the
same on every token of the span (outcome advantages; ``turn_group`` under ``turn_ppo``) this is exactly the span
objective ``-min(r_k A_k, clip(r_k) A_k)`` in value and gradient (``grad r_k = r_k sum_t (d log r_k / d log pi_t)
grad log pi_t``); for advantages that vary within the span (``turn_group`` or ``gae`` under ``gspo``, ``gae`` under
``turn_ppo``) each token keeps its own advantage, where the span form ``-r_k mean_t(A_t) grad log r_k`` would
average them away. Clipping follows verl: ``s_t`` equals ``r_k`` in value, so whether a token's gradient is cut is
decided by the *span's* ratio and the sign of the token's *own* ``A_t`` (a span whose ratio is above
``1 + clip_high`` keeps the gradient of its negative-advantage tokens and drops that of its positive ones); the clip
statistics count tokens by that same rule. The per-token matrix sums to the span objectives in value (``1/|k|`` per
token). The aggregation then decides how spans weigh: ``seq_mean_token_sum`` averages each sequence's sum of span
objectives (for ``gspo``, the paper's mean over sequences), ``token_mean`` sums the span objectives over the batch and
divides by its action tokens (a constant: every span counts once, whatever its length).

A row is one datum and never split across micro-batches, so each span is whole in one micro-batch: the losses are
exact under any packing and rank count (``tests/test_gradient_equivalence.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_plugins.algos.losses import clip_stats
from trl_plugins.registry import POLICY_LOSSES
from trl_plugins.types import PolicyLossInput, PolicyLossOutput

__all__ = ["span_ratio_loss", "GSPOLoss", "TurnPPOLoss"]


def span_ratio_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    span_ids: torch.Tensor,
    *,
    normalize: bool,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossOutput:
    """Clipped surrogate with one importance ratio per span (see the module docstring).

    Args:
        logprobs: ``(B, T)`` current log-probs (with gradient).
        behaviour_logprobs: ``(B, T)`` log-probs of the policy the ratio is anchored to.
        advantages: ``(B, T)``.
        action_mask: ``(B, T)``; the loss is 0 elsewhere.
        span_ids: ``(B, T)`` long: the span of each action position within its row (e.g. ``turn_ids``; all 0 for
            one span per row), ignored off the mask.
        normalize: ``log r`` is the mean over the span's tokens (else their sum).

    Returns:
        :class:`PolicyLossOutput`: the ``(B, T)`` loss (its gradient GSPO-token's: each token's own advantage times
        its own score, weighted by its span's ratio) and statistics over the action tokens (each token counted with
        its span's ratio and the sign of its own advantage).

    Raises:
        ValueError: an invalid clip range, or a negative span id on an action position.
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}.")
    mask = action_mask.to(logprobs.dtype)
    on = mask.bool()
    if bool((span_ids[on] < 0).any()):
        raise ValueError("an action position has no span (span id -1): every sampled token belongs to a turn.")
    # Neutralise masked positions before any arithmetic (placeholders, padding, inf).
    advantages = torch.where(on, advantages, torch.zeros_like(advantages))
    behaviour_logprobs = torch.where(on, behaviour_logprobs, logprobs.detach())
    delta = torch.where(on, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
    # One key per (row, span): the span's sums come from index_add, and go back to its tokens by gather.
    rows = torch.arange(span_ids.shape[0], device=span_ids.device)[:, None].expand_as(span_ids)
    width = int(span_ids.max().clamp(min=0)) + 1
    key = torch.where(on, rows * width + span_ids.clamp(min=0), torch.zeros_like(span_ids)).reshape(-1)
    num_keys = span_ids.shape[0] * width
    flat_mask = mask.reshape(-1)
    length = torch.zeros(num_keys, dtype=mask.dtype, device=mask.device).index_add(0, key, flat_mask)
    flat_delta = delta.detach().reshape(
        -1
    )  # the span ratio's value only: each token's gradient comes from its own term
    span_delta = torch.zeros(num_keys, dtype=delta.dtype, device=delta.device).index_add(0, key, flat_delta)
    safe_length = length.clamp(min=1.0)
    raw_log_ratio = span_delta / safe_length if normalize else span_delta
    inside = (raw_log_ratio >= -log_ratio_clamp) & (raw_log_ratio <= log_ratio_clamp)  # where clamp passes a gradient
    log_ratio = raw_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    token_length = safe_length[key].reshape(span_ids.shape)
    # |k| * d log r_k / d log pi_t: 1 for the mean, |k| for the sum. The token term is 0 in value: s_t is r_k.
    scale = torch.ones_like(token_length) if normalize else token_length
    own = torch.where(inside[key].reshape(span_ids.shape), scale * (delta - delta.detach()), torch.zeros_like(delta))
    token_ratio = torch.exp(log_ratio[key].reshape(span_ids.shape) + own)
    unclipped = -advantages * token_ratio
    clipped = -advantages * token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.where(on, torch.maximum(unclipped, clipped) / token_length, torch.zeros_like(logprobs))
    # A token's gradient is cut by its span's ratio and the sign of its own advantage (verl's GSPO-token rule).
    stats = clip_stats(
        token_ratio, delta, advantages, mask, clip_low=clip_low, clip_high=clip_high, log_ratio_clamp=log_ratio_clamp
    )
    return PolicyLossOutput(per_token_loss=loss, stats=stats)


def _check_clip(name: str, clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(
            f"{name} needs 0 <= clip_low < 1 and clip_high >= 0 (ratio in [1-clip_low, 1+clip_high]); "
            f"got clip_low={clip_low}, clip_high={clip_high}."
        )


@POLICY_LOSSES.register("gspo")
@dataclass
class GSPOLoss:
    """GSPO: one length-normalised ratio per sequence, ``exp(mean log(pi / pi_old))`` over the datum's action tokens,
    clipped to ``[1 - clip_low, 1 + clip_high]`` (the paper's 3e-4 and 4e-4), in its GSPO-token form (eq. 13-14): each
    token keeps its own advantage, so per-token advantages (``turn_group``, ``gae``) are exact, and a constant one gives
    GSPO. Use ``aggregation: seq_mean_token_sum`` for the paper's mean over sequences (see
    :mod:`trl_plugins.algos.span_losses`)."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    log_ratio_clamp: float = 20.0

    needs_ref_logprobs = False
    needs_entropy = False

    def __post_init__(self) -> None:
        _check_clip("gspo", self.clip_low, self.clip_high)

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        spans = torch.zeros_like(inp.action_mask, dtype=torch.long)  # one span per row: the whole response
        return span_ratio_loss(
            inp.logprobs,
            inp.behaviour_logprobs,
            inp.advantages,
            inp.action_mask,
            spans,
            normalize=True,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            log_ratio_clamp=self.log_ratio_clamp,
        )


@POLICY_LOSSES.register("turn_ppo")
@dataclass
class TurnPPOLoss:
    """One ratio per assistant turn (``PolicyLossInput.turn_ids``): the turn's likelihood ratio (``normalize=False``,
    the contract's exact span log-prob; clip ``[0.8, 1.28]`` by default) or its length-normalised form
    (``normalize=True``; set GSPO's ``clip_low=3e-4, clip_high=4e-4`` for it). Different objectives: see
    :mod:`trl_plugins.algos.span_losses`. Per-token form of either ratio: advantages that vary within a turn (``gae``)
    keep their own gradient; ``turn_group``'s, constant over a turn, give the turn objective exactly."""

    normalize: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.28
    log_ratio_clamp: float = 20.0

    needs_ref_logprobs = False
    needs_entropy = False
    needs_turn_ids = True

    def __post_init__(self) -> None:
        _check_clip("turn_ppo", self.clip_low, self.clip_high)

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        if inp.turn_ids is None:
            raise ValueError(
                "turn_ppo needs PolicyLossInput.turn_ids (the trainer passes them to a loss that "
                "declares needs_turn_ids)."
            )
        return span_ratio_loss(
            inp.logprobs,
            inp.behaviour_logprobs,
            inp.advantages,
            inp.action_mask,
            inp.turn_ids,
            normalize=self.normalize,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            log_ratio_clamp=self.log_ratio_clamp,
        )
