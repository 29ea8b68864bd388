"""Sampler/trainer mismatch correction (TIS/MIS): the weights by hand, the update's gradient by hand,
the trainer with a sampler that reports shifted log-probs, and the config rules.

Throughout, ``d = log pi_old - log pi_sampler`` and ``r = exp(d)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_plugins.algos import PPOClipLoss, importance_weights
from trl_plugins.types import ImportanceSamplingMode, PolicyLossInput

LN2 = math.log(2.0)

# Three rows. Row 0: action tokens with d = ln 2, 0, ln 1/4 (r = 2, 1, 1/4), then a masked position
# whose sampler log-prob is nan (never read). Row 1: d = ln 4, ln 2 (r = 4, 2), then padding. Row 2: no
# action token. Bounds [C_min, C_max] = [0.4, 3].
OLD = torch.tensor([[-1.0, -2.0, -3.0, -0.7], [-0.5, -1.5, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
D = torch.tensor([[LN2, 0.0, -2 * LN2, 0.0], [2 * LN2, LN2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
SAMPLER = OLD - D
SAMPLER[0, 3] = float("nan")
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
LO, HI = 0.4, 3.0

EXPECTED_WEIGHTS = {
    # clamp(r, 0.4, 3): 1/4 -> 0.4, 4 -> 3.
    "token_truncate": [[2.0, 1.0, 0.4, 0.0], [3.0, 2.0, 0.0, 0.0]],
    # r outside [0.4, 3] -> 0: 1/4 and 4.
    "token_mask": [[2.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]],
    # Row ratios: exp(ln 2 + 0 - 2 ln 2) = 1/2 (inside), exp(3 ln 2) = 8 -> clamped to 3.
    "sequence_truncate": [[0.5, 0.5, 0.5, 0.0], [3.0, 3.0, 0.0, 0.0]],
    # Row 1's 8 leaves [0.4, 3]: the whole row gets 0.
    "sequence_mask": [[0.5, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]],
}


@pytest.mark.parametrize("mode", list(EXPECTED_WEIGHTS))
def test_weights_and_statistics_by_hand(mode):
    out = importance_weights(OLD, SAMPLER, MASK, mode, clip_min=LO, clip_max=HI)
    expected = torch.tensor(EXPECTED_WEIGHTS[mode] + [[0.0] * 4])
    assert torch.allclose(out.weights, expected, atol=1e-6), out.weights
    s = out.stats.summary(mode)
    # 5 action tokens. k3 = r - 1 - ln r: r=2: 1 - ln 2; r=1: 0; r=1/4: -3/4 + 2 ln 2; r=4: 3 - 2 ln 2;
    # r=2: 1 - ln 2. Sum = 4.25 - 2 ln 2.
    assert s["is_mismatch_kl"] == pytest.approx((4.25 - 2 * LN2) / 5, rel=1e-6)
    # k1 = -mean d = -(ln 2 + 0 - 2 ln 2 + 2 ln 2 + ln 2) / 5 = -2 ln 2 / 5.
    assert s["is_mismatch_k1"] == pytest.approx(-2 * LN2 / 5, rel=1e-6)
    assert s["is_logprob_gap"] == pytest.approx(6 * LN2 / 5, rel=1e-6)
    # Token modes bound tokens 1/4 and 4 (2 of 5); sequence modes bound row 1 (2 tokens of 5).
    bounded = "is_masked_frac" if ImportanceSamplingMode(mode).is_mask else "is_truncated_frac"
    assert s[bounded] == pytest.approx(0.4)
    assert s["is_weight_mean"] == pytest.approx(float(expected.sum()) / 5, rel=1e-6)
    assert s["is_weight_min"] == pytest.approx(float(expected[MASK.bool()].min()), rel=1e-6)
    assert s["is_weight_max"] == pytest.approx(float(expected[MASK.bool()].max()), rel=1e-6)
    # The ratios the bounds act on, before bounding: tokens 1/4 .. 4, or rows 1/2 and 8.
    lo, hi = (0.5, 8.0) if ImportanceSamplingMode(mode).is_sequence else (0.25, 4.0)
    assert (s["is_ratio_min"], s["is_ratio_max"]) == (pytest.approx(lo, rel=1e-6), pytest.approx(hi, rel=1e-6))


def test_a_missing_bound_is_absent_as_in_trl():
    # C_max = None: nothing above is cut; C_min = None: nothing below.
    w = importance_weights(OLD, SAMPLER, MASK, "token_mask", clip_min=0.4, clip_max=None).weights
    assert torch.allclose(w[:2], torch.tensor([[2.0, 1.0, 0.0, 0.0], [4.0, 2.0, 0.0, 0.0]]), atol=1e-6)
    w = importance_weights(OLD, SAMPLER, MASK, "token_truncate", clip_min=None, clip_max=3.0).weights
    assert torch.allclose(w[:2], torch.tensor([[2.0, 1.0, 0.25, 0.0], [3.0, 2.0, 0.0, 0.0]]), atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(clip_min=3.0, clip_max=2.0), "clip_min < clip_max"),
    (dict(clip_min=-1.0, clip_max=2.0), "clip_min >= 0"),
    (dict(clip_min=None, clip_max=None), "needs at least one"),
])
def test_bad_bounds_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        importance_weights(OLD, SAMPLER, MASK, "token_truncate", **kwargs)


@pytest.mark.parametrize("mode", list(EXPECTED_WEIGHTS))
def test_no_mismatch_gives_weight_one_and_nothing_bounded(mode):
    # Negative control: the sampler's numbers are the trainer's.
    out = importance_weights(OLD, OLD, MASK, mode, clip_min=0.5, clip_max=2.0)
    assert torch.equal(out.weights, MASK)
    s = out.stats.summary(mode)
    assert s["is_mismatch_kl"] == 0.0 and s["is_weight_mean"] == 1.0 and s["is_ratio_min"] == s["is_ratio_max"] == 1.0
    assert s["is_masked_frac" if ImportanceSamplingMode(mode).is_mask else "is_truncated_frac"] == 0.0


@pytest.mark.parametrize("mode", list(EXPECTED_WEIGHTS))
def test_values_at_masked_positions_never_matter(mode):
    junk = SAMPLER.clone()
    junk[~MASK.bool()] = torch.tensor([1e9, -1e9, float("inf"), float("nan")]).repeat(8)[: int((~MASK.bool()).sum())]
    a = importance_weights(OLD, SAMPLER, MASK, mode, clip_min=LO, clip_max=HI)
    b = importance_weights(OLD, junk, MASK, mode, clip_min=LO, clip_max=HI)
    assert torch.equal(a.weights, b.weights) and a.stats.summary(mode) == b.stats.summary(mode)


@pytest.mark.parametrize("mode", list(EXPECTED_WEIGHTS))
def test_statistics_merge_over_micro_batches_as_one_batch(mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 7, generator=g) * 3
    sampler = old + 0.4 * torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) < 0.7).float()
    whole = importance_weights(old, sampler, mask, mode, clip_min=0.6, clip_max=1.5)
    parts = [importance_weights(old[i:j], sampler[i:j], mask[i:j], mode, clip_min=0.6, clip_max=1.5) for i, j in ((0, 2), (2, 3), (3, 6))]
    merged = parts[0].stats.merge(parts[1].stats).merge(parts[2].stats)
    assert torch.equal(torch.cat([p.weights for p in parts]), whole.weights)
    for k, v in whole.stats.summary(mode).items():
        assert merged.summary(mode)[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_ppo_clip_weights_only_the_policy_gradient_term():
    # At ratio 1 the clipped surrogate is -A per token, with gradient -A d(log pi); the weight scales
    # both. The KL term (beta * KL) is added unweighted, as in TRL.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.tensor([[3.0, 0.0, 7.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.5]])
    plain = PPOClipLoss(kl_coef=0.1, kl_importance_weight=False)(PolicyLossInput(logp, logp.detach(), adv, mask, ref_logprobs=ref))
    loss = PPOClipLoss(kl_coef=0.1, kl_importance_weight=False)(PolicyLossInput(logp, logp.detach(), adv, mask, ref_logprobs=ref, is_weights=w))
    # k3 of KL(pi || ref) at token 0: log r = -0.5, r - 1 - log r = e^-0.5 - 0.5; token 1: 0.
    kl0 = math.exp(-0.5) - 0.5
    assert torch.allclose(loss.per_token_loss, torch.tensor([[3.0 * -1.0 + 0.1 * kl0, 0.0, 0.0]]))
    assert torch.allclose(plain.per_token_loss, torch.tensor([[-1.0 + 0.1 * kl0, 2.0, 0.0]]))
    loss.per_token_loss.sum().backward()
    # d/dlogp: token 0: -A w = -3, plus 0.1 * d k3/dlogp = 0.1 * (1 - e^-0.5); token 1: weight 0 -> 0.
    assert torch.allclose(logp.grad, torch.tensor([[-3.0 + 0.1 * (1 - math.exp(-0.5)), 0.0, 0.0]]))
    # Weight one everywhere is today's loss, bit for bit.
    ones = PPOClipLoss()(PolicyLossInput(logp, logp.detach() + 0.1, adv, mask, is_weights=torch.ones_like(adv)))
    assert torch.equal(ones.per_token_loss, PPOClipLoss()(PolicyLossInput(logp, logp.detach() + 0.1, adv, mask)).per_token_loss)
