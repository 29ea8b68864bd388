"""Sampler/trainer mismatch correction (TIS/MIS): the weights by hand, the update's gradient by hand,
the trainer with a sampler that reports shifted log-probs, and the config rules.

Throughout, ``d = log pi_old - log pi_sampler`` and ``r = exp(d)``.
"""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch

from conftest import make_trajectory, rel_err
from support.settings import update_settings
from trl_plugins.algos import (
    PPOClipLoss,
    aggregate,
    importance_weights,
    local_denominators,
)
from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.rollout.backends import BackendBase
from trl_plugins.types import (
    ImportanceSamplingMode,
    LogprobSource,
    PolicyLossInput,
    TokenSource,
)

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


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(clip_min=3.0, clip_max=2.0), "clip_min < clip_max"),
        (dict(clip_min=-1.0, clip_max=2.0), "clip_min >= 0"),
        (dict(clip_min=None, clip_max=None), "needs at least one"),
    ],
)
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
    parts = [
        importance_weights(old[i:j], sampler[i:j], mask[i:j], mode, clip_min=0.6, clip_max=1.5)
        for i, j in ((0, 2), (2, 3), (3, 6))
    ]
    merged = parts[0].stats.merge(parts[1].stats).merge(parts[2].stats)
    assert torch.equal(torch.cat([p.weights for p in parts]), whole.weights)
    for k, v in whole.stats.summary(mode).items():
        assert merged.summary(mode)[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_ppo_clip_weights_the_policy_gradient_and_kl_terms_alike():
    # At ratio 1 the clipped surrogate is -A per token, with gradient -A d(log pi); the weight scales both. The KL term
    # (beta * KL) carries the same weight (issue 49: its importance weight is pi / pi_sampler = w * pi / pi_old, not
    # TRL's pi / pi_old), weighted by the ratio or not; the entropy bonus does not.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = torch.tensor([[3.0, 0.0, 7.0]])
    ref = torch.tensor([[-1.5, -3.0, -0.5]])
    ent = torch.tensor([[2.0, 1.0, 5.0]])
    plain = PPOClipLoss(kl_coef=0.1, kl_importance_weight=False)(
        PolicyLossInput(logp, logp.detach(), adv, mask, ref_logprobs=ref)
    )
    loss = PPOClipLoss(kl_coef=0.1, kl_importance_weight=False, entropy_coef=0.01)(
        PolicyLossInput(logp, logp.detach(), adv, mask, ref_logprobs=ref, entropy=ent, is_weights=w)
    )
    # k3 of KL(pi || ref): token 0: log r = -0.5, r - 1 - log r = e^-0.5 - 0.5; token 1: log r = -1, e^-1.
    kl0, kl1 = math.exp(-0.5) - 0.5, math.exp(-1.0)
    # token 0: 3 * (-1 + 0.1 kl0) - 0.01 * 2; token 1: weight 0 drops both terms, the entropy bonus stays: -0.01.
    assert torch.allclose(loss.per_token_loss, torch.tensor([[3.0 * (-1.0 + 0.1 * kl0) - 0.02, -0.01, 0.0]]))
    assert torch.allclose(plain.per_token_loss, torch.tensor([[-1.0 + 0.1 * kl0, 2.0 + 0.1 * kl1, 0.0]]))
    loss.per_token_loss.sum().backward()
    # d/dlogp: token 0: 3 * (-A + 0.1 * d k3/dlogp) = 3 * (-1 + 0.1 * (1 - e^-0.5)); token 1: weight 0 -> 0.
    assert torch.allclose(logp.grad, torch.tensor([[3.0 * (-1.0 + 0.1 * (1 - math.exp(-0.5))), 0.0, 0.0]]))
    # Ratio-weighted: the anchor pi_old sits 0.2 below pi on token 0, so the KL term is w * e^0.2 * k3 there.
    old = logp.detach() - torch.tensor([[0.2, 0.0, 0.0]])
    weighted = PPOClipLoss(kl_coef=0.1, kl_importance_weight=True)(
        PolicyLossInput(logp, old, torch.zeros_like(adv), mask, ref_logprobs=ref, is_weights=w)
    )
    assert torch.allclose(weighted.per_token_loss, torch.tensor([[3.0 * math.exp(0.2) * 0.1 * kl0, 0.0, 0.0]]))
    # Weight one everywhere is today's loss, bit for bit.
    ones = PPOClipLoss()(PolicyLossInput(logp, logp.detach() + 0.1, adv, mask, is_weights=torch.ones_like(adv)))
    assert torch.equal(
        ones.per_token_loss, PPOClipLoss()(PolicyLossInput(logp, logp.detach() + 0.1, adv, mask)).per_token_loss
    )


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_the_kl_terms_weight_is_truncated_or_masked_as_the_policy_terms(mode):
    # The weighted KL term's importance weight is pi / pi_behaviour = v * pi / pi_old with v the policy term's bounded
    # weight: truncated at C_max = 2 (token_truncate: the decoupled objective's default mode), or 0 beyond it
    # (token_mask: AReaL's behaviour-weight cap). pi = pi_old here (ratio 1), so each token's term is v * k3.
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    sampler = logp - torch.tensor([[0.0, 0.5, 1.0]], dtype=torch.float64)  # r = 1, e^0.5 = 1.65, e = 2.72
    mask = torch.ones_like(logp)
    ref = torch.tensor([[-2.0, -2.0, -2.0]], dtype=torch.float64)
    v = importance_weights(logp, sampler, mask, mode, clip_max=2.0).weights
    expected_v = [1.0, math.exp(0.5), 2.0 if mode == "token_truncate" else 0.0]
    assert torch.allclose(v, torch.tensor([expected_v], dtype=torch.float64))
    k3 = math.exp(-1.0)  # log r = -1: e^-1 - 1 + 1
    out = PPOClipLoss(kl_coef=1.0, kl_importance_weight=True)(
        PolicyLossInput(logp, logp, torch.zeros_like(logp), mask, ref_logprobs=ref, is_weights=v)
    )
    assert torch.allclose(out.per_token_loss, torch.tensor([[x * k3 for x in expected_v]], dtype=torch.float64))


# -- the update ---------------------------------------------------------------------------------------

SHIFT = 1.0  # the sampler under-reports shifted tokens by 1 nat: r = pi_old / pi_sampler = e


def _config(**overrides):
    base = dict(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=2,
        max_padded_tokens_per_micro_batch=300,
        rebalance_ranks=False,
        norm_length=None,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=False,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=2.0,
        padding_free=False,
    )
    base.update(overrides)
    return update_settings(**base)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _shifted_datums(model, n=8, seed=4):
    """Datums whose behaviour log-probs are the model's own, minus SHIFT on every other action token of
    the even datums. Returns the datums and, per datum, the 0/1 list of shifted positions."""
    rng = random.Random(seed)
    datums = [
        build_datum(
            make_trajectory(rng, num_turns=rng.randint(1, 3)),
            advantage=rng.choice([-1, 1]) * rng.uniform(0.3, 1.5),
            trajectory_index=i,
        )
        for i in range(n)
    ]
    with torch.no_grad():
        mb = collate(datums, list(range(n)), pad_token_id=0)
        lp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)
    shifted = []
    for row, d in enumerate(datums):
        k, marks = 0, []
        for m in d.action_mask:
            marks.append(int(bool(m) and row % 2 == 0 and k % 2 == 0))
            k += m
        shifted.append(marks)
        d.behaviour_logprobs = [
            float(x) - SHIFT * s if m else 0.0 for x, m, s in zip(lp[row, : d.num_tokens], d.action_mask, marks)
        ]
    return datums, shifted


def _expected_weights(mode, shifted, datums, clip_max=2.0):
    """Hand-made weights: r = e on shifted tokens, 1 elsewhere; C_max = 2, no C_min."""
    out = []
    for marks, d in zip(shifted, datums):
        k = sum(marks)
        if mode == "token_truncate":
            w = [min(math.e, clip_max) if s else 1.0 for s in marks]
        elif mode == "token_mask":
            w = [0.0 if s else 1.0 for s in marks]
        elif mode == "sequence_truncate":
            w = [min(math.exp(k), clip_max)] * len(marks)
        else:
            w = [0.0 if math.exp(k) > clip_max else 1.0] * len(marks)
        out.append([x if m else 0.0 for x, m in zip(w, d.action_mask)])
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_update_anchors_on_pi_old_and_weights_the_gradient_by_hand(tiny_model_factory, mode):
    from accelerate import Accelerator

    from trl_plugins.trainers.update import old_logprobs, policy_update

    model = tiny_model_factory(torch.float32)
    datums, shifted = _shifted_datums(model)
    config = _config(vllm_importance_sampling_mode=mode)
    reference = copy.deepcopy(model)
    before = _flat(model).clone()
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    old_logprobs(accelerator, model, datums, config, pad_token_id=0)
    result = policy_update(accelerator, model, optimizer, datums, PPOClipLoss(), config, pad_token_id=0)

    # By hand: pi_old is the model itself, so the ratio pi / pi_old is 1 (value), never clipped, and the
    # loss is sum_t w_t * -A_t * exp(logp_t - stopgrad(logp_t)) / N_tok with the hand-made w. Anchored on
    # the sampler instead, the shifted tokens would have ratio e > 1.28 and a positive advantage's
    # gradient would be clipped away.
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    w = torch.zeros_like(full.action_mask)
    for row, ws in enumerate(_expected_weights(mode, shifted, datums)):
        w[row, : len(ws)] = torch.tensor(ws)
    logp = token_logprobs(reference, full.input_ids, full.attention_mask, full.target_ids)
    per_token = w * -full.advantages * torch.exp(logp - logp.detach()) * full.action_mask
    loss = aggregate(per_token, full.action_mask, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    assert rel_err(_flat(model) - before, _flat(reference) - before) < 1e-4
    assert abs(result.loss - float(loss)) < 1e-5
    n_shift = sum(map(sum, shifted))
    n_all = int(n_tok)
    assert 0 < n_shift < n_all
    s = result.mismatch
    # d = +1 on shifted tokens, ~0 elsewhere: k3 = e - 2 there, k1 = -1.
    assert s["is_mismatch_kl"] == pytest.approx((math.e - 2) * n_shift / n_all, rel=1e-4)
    assert s["is_mismatch_k1"] == pytest.approx(-n_shift / n_all, rel=1e-4)
    # Bounded tokens: the shifted ones (token modes) or every token of a row with a shift (sequence modes).
    rows_shifted = sum(d.num_loss_tokens for d, marks in zip(datums, shifted) if any(marks))
    bounded = n_shift if mode.startswith("token") else rows_shifted
    key = "is_masked_frac" if mode.endswith("mask") else "is_truncated_frac"
    assert s[key] == pytest.approx(bounded / n_all, abs=1e-9)
    assert s["is_weight_mean"] == pytest.approx(float(w.sum()) / n_all, rel=1e-4)
    # The PPO statistics are now against pi_old: ratios 1, no gap.
    assert result.stats.summary()["behaviour_logprob_gap"] < 1e-5


def test_the_update_weights_the_kl_term_and_the_logged_kl_by_pi_over_the_sampler(tiny_model_factory):
    # The update's KL plumbing (issue 49): with the correction on, the loss's ratio-weighted KL term and the logged
    # train/kl_k* carry w * pi / pi_old, i.e. pi / pi_sampler, with the hand-made bounded w. pi_old is the model
    # itself (ratio 1), so by hand the step is sum_t w_t * (-A_t + beta * k3_t) * exp(logp_t - sg(logp_t)) / N_tok
    # and kl_k3 = sum_t w_t * k3_t / N_tok. Unweighted (before), kl_k3 was the sampler's tokens' plain mean.
    from accelerate import Accelerator

    from trl_plugins.algos import kl_estimate
    from trl_plugins.trainers.update import old_logprobs, policy_update

    model = tiny_model_factory(torch.float32)
    datums, shifted = _shifted_datums(model)
    with torch.no_grad():
        full = collate(datums, list(range(len(datums))), pad_token_id=0)
        lp = token_logprobs(model, full.input_ids, full.attention_mask, full.target_ids)
    for row, d in enumerate(datums):  # the reference 0.3 nats below the policy on every other position
        d.ref_logprobs = [
            float(x) - 0.3 * (t % 2) if m else 0.0
            for t, (x, m) in enumerate(zip(lp[row, : d.num_tokens], d.action_mask))
        ]
    config = _config()
    reference = copy.deepcopy(model)
    before = _flat(model).clone()
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    old_logprobs(accelerator, model, datums, config, pad_token_id=0)
    beta = 0.5
    result = policy_update(
        accelerator,
        model,
        optimizer,
        datums,
        PPOClipLoss(kl_coef=beta, kl_importance_weight=True),
        config,
        pad_token_id=0,
    )

    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    w = torch.zeros_like(full.action_mask)
    for row, ws in enumerate(_expected_weights("token_truncate", shifted, datums)):
        w[row, : len(ws)] = torch.tensor(ws)
    ref = torch.where(full.action_mask.bool(), full.ref_logprobs, torch.zeros_like(full.ref_logprobs))
    logp = token_logprobs(reference, full.input_ids, full.attention_mask, full.target_ids)
    k3 = kl_estimate(logp, torch.where(full.action_mask.bool(), ref, logp.detach()), "k3") * full.action_mask
    per_token = w * (-full.advantages + beta * k3) * torch.exp(logp - logp.detach()) * full.action_mask
    loss = aggregate(per_token, full.action_mask, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    assert rel_err(_flat(model) - before, _flat(reference) - before) < 1e-4
    assert abs(result.loss - float(loss.detach())) < 1e-5
    weighted_k3 = float((w * k3.detach()).sum()) / float(n_tok)
    plain_k3 = float(k3.detach().sum()) / float(n_tok)
    assert result.reference["kl_k3"] == pytest.approx(weighted_k3, rel=1e-4)
    assert abs(weighted_k3 - plain_k3) > 0.05 * plain_k3  # the weights matter here


def test_update_without_mismatch_matches_todays_update(tiny_model_factory):
    # Negative control: behaviour log-probs are the trainer's own; with the correction every weight is 1
    # (nothing masked) and the step is the uncorrected one.
    from accelerate import Accelerator

    from trl_plugins.trainers.update import old_logprobs, policy_update

    base = tiny_model_factory(torch.float32)
    datums, _ = _shifted_datums(base)
    with torch.no_grad():
        full = collate(datums, list(range(len(datums))), pad_token_id=0)
        lp = token_logprobs(base, full.input_ids, full.attention_mask, full.target_ids)
    for row, d in enumerate(datums):
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(lp[row, : d.num_tokens], d.action_mask)]
    deltas, results = [], []
    for corrected in (False, True):
        model = copy.deepcopy(base)
        before = _flat(model).clone()
        ds = copy.deepcopy(datums)
        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = accelerator.prepare(model, optimizer)
        config = _config(
            vllm_importance_sampling_mode="sequence_mask",
            vllm_importance_sampling_clip_min=0.999,
            vllm_importance_sampling_clip_max=1.001,
        )
        if corrected:
            old_logprobs(accelerator, model, ds, config, pad_token_id=0)
        results.append(policy_update(accelerator, model, optimizer, ds, PPOClipLoss(), config, pad_token_id=0))
        deltas.append(_flat(model) - before)
    assert results[0].mismatch is None
    s = results[1].mismatch
    assert s["is_masked_frac"] == 0.0 and s["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert s["is_mismatch_kl"] < 1e-9
    assert rel_err(deltas[1], deltas[0]) < 1e-5 and abs(results[1].loss - results[0].loss) < 1e-6


class NoWeightsLoss(PPOClipLoss):
    """ppo_clip as a third-party loss that does not apply the importance weights."""

    supports_is_weights = False


def test_a_loss_that_cannot_take_weights_is_refused(tiny_model_factory):
    from accelerate import Accelerator

    from trl_plugins.trainers.update import (
        mismatch_correction_applies,
        old_logprobs,
        policy_update,
    )

    model = tiny_model_factory(torch.float32)
    datums, _ = _shifted_datums(model, n=2)
    accelerator = Accelerator(cpu=True)
    old_logprobs(accelerator, model, datums, _config(), pad_token_id=0)
    with pytest.raises(ValueError, match="supports_is_weights"):
        policy_update(
            accelerator,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            datums,
            NoWeightsLoss(),
            _config(),
            pad_token_id=0,
        )
    args = update_settings(vllm_importance_sampling_mode="sequence_mask", mismatch_correction_scope="all")
    with pytest.raises(ValueError, match="does not declare supports_is_weights"):
        mismatch_correction_applies(accelerator, [], NoWeightsLoss(), args)


def test_when_the_correction_applies():
    from accelerate import Accelerator

    from trl_plugins.trainers.update import mismatch_correction_applies
    from trl_plugins.types import PolicyVersion, Trajectory

    def traj(source):
        return Trajectory(turns=[], policy_version=PolicyVersion(step=0, tokenizer_digest="x", logprob_source=source))

    acc = Accelerator(cpu=True)
    hf, vllm = (
        [traj(LogprobSource.TEMPERATURE_SCALED)],
        [traj(LogprobSource.TEMPERATURE_SCALED), traj(LogprobSource.PROCESSED)],
    )

    def applies(trajs, on=True, scope="foreign"):
        mode = "sequence_mask" if on else None  # None: the correction is off
        args = update_settings(vllm_importance_sampling_mode=mode, mismatch_correction_scope=scope)
        return mismatch_correction_applies(acc, trajs, PPOClipLoss(), args)

    assert (applies(hf), applies(vllm), applies(hf, scope="all"), applies(vllm, on=False)) == (False, True, True, False)


# -- the trainer --------------------------------------------------------------------------------------


class _ShiftedBackend(BackendBase):
    """HF generate, but reporting vLLM's source and under-reporting every other sampled token's
    log-prob by ``shift`` (what a sampler whose numbers differ from the trainer's looks like)."""

    def __init__(self, inner, shift):
        self.inner, self.shift = inner, shift
        self.sampling, self.max_concurrency = inner.sampling, inner.max_concurrency
        self.logprob_source = LogprobSource.PROCESSED

    def session(self):
        return self.inner.session()

    def generate(self, prompts, max_new_tokens, *, seeds):
        samples = self.inner.generate(prompts, max_new_tokens, seeds=seeds)
        for s in samples:
            s.logprobs = [lp - self.shift * (k % 2 == 0) for k, lp in enumerate(s.logprobs)]
        return samples


class ShiftedRollout:
    """multi_turn with a :class:`_ShiftedBackend`."""

    shift = SHIFT

    def __init__(self, **kwargs) -> None:
        from trl_plugins.rollout import MultiTurnRollout

        self.inner = MultiTurnRollout(**kwargs)
        self.token_budget = self.inner.token_budget

    def __call__(self, request):
        request.backend = _ShiftedBackend(request.backend, self.shift)
        return self.inner(request)


class UnshiftedRollout(ShiftedRollout):
    shift = 0.0


def _train(tmp_path, **overrides):
    from support.trainer import TokenReward, tiny_dataset
    from support.trainer import tiny_config as trainer_config
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        trainer_config(tmp_path, max_steps=1, drop_zero_advantage=False, **overrides),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    return trainer, record


@pytest.mark.parametrize("mode", ["sequence_mask", "token_mask"])
def test_trainer_corrects_a_sampler_that_reports_shifted_logprobs(tmp_path, mode):
    # sequence_mask: TRL's defaults (C_max = 3, no C_min). token_mask: [1/2, 2]; setting them on a run
    # without use_vllm takes mismatch_correction_scope='all' (this sampler is a test double).
    overrides = (
        {}
        if mode == "sequence_mask"
        else dict(
            mismatch_correction_scope="all",
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=0.5,
            vllm_importance_sampling_clip_max=2.0,
            padding_free=False,
        )
    )
    trainer, record = _train(tmp_path, rollout="test_mismatch:ShiftedRollout", **overrides)
    # Which action tokens were shifted: every other token of each sampled completion.
    actions = [
        [src == TokenSource.ACTION for turn in t.turns for src in turn.sources()]
        for t in trainer.last_batch.trajectories
    ]
    shifts = [
        [src == TokenSource.ACTION and k % 2 == 0 for turn in t.turns for k, src in enumerate(turn.sources())]
        for t in trainer.last_batch.trajectories
    ]
    total, shifted = sum(map(sum, actions)), sum(map(sum, shifts))
    assert record["train/loss_tokens"] == total and 0 < shifted < total
    if mode == "sequence_mask":
        # A trajectory with k shifted tokens has ratio e^k, masked whole when e^k > 3, i.e. k >= 2.
        masked = sum(sum(a) for a, s in zip(actions, shifts) if math.exp(sum(s)) > 3.0)
        weight_sum = sum(sum(a) * math.exp(sum(s)) for a, s in zip(actions, shifts) if math.exp(sum(s)) <= 3.0)
        assert record["train/is_ratio_max"] == pytest.approx(math.exp(max(map(sum, shifts))), rel=1e-3)
    else:
        masked = shifted  # r = e > 2 on exactly the shifted tokens
        weight_sum = total - shifted
        assert record["train/is_ratio_max"] == pytest.approx(math.e, rel=1e-3)
        assert record["train/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert masked > 0
    assert record["train/is_masked_frac"] == pytest.approx(masked / total, abs=1e-9)
    assert record["train/is_weight_mean"] == pytest.approx(weight_sum / total, abs=1e-4)
    assert record["train/is_mismatch_kl"] == pytest.approx((math.e - 2) * shifted / total, rel=1e-3)
    assert record["train/is_mismatch_k1"] == pytest.approx(-shifted / total, rel=1e-3)
    # The PPO ratio is anchored on the trainer's own forward: ~1, not e.
    assert record["train/behaviour_logprob_gap"] < 1e-4 and record["train/ratio_max"] < 1.001
    assert "timing/old_logprobs_s" in record


def test_trainer_negative_controls(tmp_path):
    # A foreign source without a mismatch: weights 1, nothing masked.
    _, record = _train(tmp_path / "a", rollout="test_mismatch:UnshiftedRollout")
    assert record["train/is_masked_frac"] == 0.0 and record["train/is_mismatch_kl"] < 1e-6
    assert record["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # HF generate in the default scope: no correction, no extra forward, no is_* metrics (today's step).
    _, record = _train(tmp_path / "b")
    assert not any(k.startswith("train/is_") for k in record) and "timing/old_logprobs_s" not in record
    # Forced on for HF generate: applied, and the sampler agrees with the trainer.
    _, record = _train(
        tmp_path / "c",
        mismatch_correction_scope="all",
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
        padding_free=False,
    )
    assert record["train/is_masked_frac"] == 0.0 and record["train/is_logprob_gap"] < 1e-4


# -- the config ---------------------------------------------------------------------------------------


def _cfg(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        reward_components=["correct"],
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vllm_importance_sampling_mode="token_truncate"), "mismatch_correction_scope='all'"),
        (dict(vllm_importance_sampling_clip_min=0.5), "vllm_importance_sampling_clip_min=0.5 configure"),
        (dict(vllm_importance_sampling_cap=2.0), "vllm_importance_sampling_cap=2.0"),
        (
            dict(vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="token_mask"),
            "=False turns off",
        ),
        (dict(vllm_importance_sampling_correction=False, mismatch_correction_scope="all"), "set one of them"),
        (dict(mismatch_correction_scope="some"), "'foreign' or 'all'"),
        (dict(mismatch_correction_scope="all", vllm_importance_sampling_mode="seq_mask"), "use one of"),
        (dict(mismatch_correction_scope="all", vllm_importance_sampling_clip_max=-1.0), "clip_max > 0"),
        (
            dict(
                mismatch_correction_scope="all",
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_max=None,
            ),
            "must be set when",
        ),  # TRL's own check
        (
            dict(mismatch_correction_scope="all", policy_loss="test_mismatch:NoWeightsLoss"),
            "does not declare supports_is_weights",
        ),
    ],
)
def test_config_refusals(tmp_path, overrides, message):
    # The config's own fields are checked when it is built, what needs the plugins when the run is resolved.
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match=message):
        resolve_run(_cfg(tmp_path, **overrides)).close()


def test_config_accepts_what_it_honours(tmp_path):
    assert _cfg(tmp_path, vllm_importance_sampling_correction=False).vllm_importance_sampling_correction is False
    c = _cfg(
        tmp_path,
        mismatch_correction_scope="all",
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_cap=2.5,
    )
    assert c.vllm_importance_sampling_clip_max == 2.5  # TRL's own mapping of the deprecated cap
