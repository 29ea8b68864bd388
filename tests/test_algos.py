"""Hand-worked cases for advantages, PPO/value losses, KL estimators and aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from trl_plugins.algos import (
    PPOClipLoss,
    aggregate,
    clipped_value_loss,
    gae_advantages,
    group_advantages,
    kl_estimate,
    kl_gradient_problem,
    local_denominators,
    masked_whiten,
    ppo_clip_loss,
    rloo_advantages,
)
from trl_plugins.registry import ADVANTAGES
from trl_plugins.types import AdvantageInput, PolicyLossInput

T = torch.tensor


def close(a, b, tol=1e-6):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol
    )


# ---------------------------------------------------------------- advantages

REWARDS = T([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0], dtype=torch.float64)
GROUPS = T([7, 7, 7, 7, 3, 3, 9])


def test_group_advantage_with_std():
    # Group 7: mean 0.5, centred [.5, -.5, -.5, .5], unbiased var = 4 * .25 / 3 = 1/3, std = .57735
    #   -> +-0.5 / 0.57735 = +-0.866025. Group 3: all equal -> 0. Group 9 (one member) -> 0.
    adv = group_advantages(REWARDS, GROUPS, scale_by_std=True, eps=0.0 + 1e-12)
    s = 0.5 / math.sqrt(1 / 3)
    assert close(adv[:4], [s, -s, -s, s]) and close(adv[4:], [0.0, 0.0, 0.0])


def test_dr_grpo_drops_std():
    adv = ADVANTAGES.get("dr_grpo")()(AdvantageInput(rewards=REWARDS, group_ids=GROUPS)).advantages
    assert close(adv, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])


def test_rloo():
    # r=1: baseline = (1 + 0 + 0) / 3 = 1/3 -> 2/3; r=0: baseline = 2/3 -> -2/3 (= 4/3 * (r - mean)).
    adv = rloo_advantages(REWARDS, GROUPS)
    assert close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [2, 3, 8, 16, 64])
@pytest.mark.parametrize("value", [-0.9, 1.1, 0.1, -1.0, 0.3, 1e6 + 0.1])
def test_equal_reward_groups_get_exactly_zero(value, size, dtype):
    # The recipe's rewards (correct +-1 plus 0.1 * format) give values like -0.9 and 1.1; a float32
    # group mean leaves a ~1e-8 residue that the std division turned into +-0.05..0.1 for every member.
    rewards = torch.full((size,), value, dtype=dtype)
    groups = torch.zeros(size, dtype=torch.long)
    for name in ("group", "dr_grpo", "rloo"):
        adv = ADVANTAGES.get(name)()(AdvantageInput(rewards=rewards, group_ids=groups)).advantages
        assert adv.dtype == dtype
        assert bool((adv == 0.0).all()), (name, adv)


def test_equal_reward_group_next_to_a_mixed_one():
    rewards = T([-0.9] * 8 + [1.1, -0.9, 1.1, -0.9], dtype=torch.float32)
    groups = T([0] * 8 + [1] * 4)
    adv = group_advantages(rewards, groups)
    assert bool((adv[:8] == 0).all())
    assert close(adv[8:], [0.866025, -0.866025, 0.866025, -0.866025], tol=1e-5)


def test_group_ids_need_not_be_contiguous_or_sorted():
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    adv = group_advantages(REWARDS, GROUPS)
    assert close(group_advantages(REWARDS[perm], GROUPS[perm]), adv[perm])


# positions:      0 prompt, 1 act, 2 act, 3 obs, 4 obs, 5 act
MASK = T([[0, 1, 1, 0, 0, 1]], dtype=torch.float64)
VALUES = T([[9.0, 0.5, 0.6, 9.0, 9.0, 0.8]], dtype=torch.float64)  # the 9s sit off-mask: never read


def test_gae_skips_observation_positions():
    adv, ret = gae_advantages(VALUES, MASK, T([1.0], dtype=torch.float64), gamma=1.0, lam=0.5)
    # t=5: delta = 1 + 0 - 0.8 = 0.2                  A5 = 0.2
    # t=4, t=3: tool output, skipped (next value 0.8 and running 0.2 carried over)
    # t=2: delta = 0 + 0.8 - 0.6 = 0.2               A2 = 0.2 + 0.5 * 0.2 = 0.3
    # t=1: delta = 0 + 0.6 - 0.5 = 0.1               A1 = 0.1 + 0.5 * 0.3 = 0.25
    assert close(adv, [[0.0, 0.25, 0.3, 0.0, 0.0, 0.2]])
    assert close(ret, [[0.0, 0.75, 0.9, 0.0, 0.0, 1.0]])


def _naive_gae(values, mask, reward, gamma, lam):
    # Steps through every position, as a single-turn implementation does: the negative control.
    t_len = values.shape[1]
    last = int(mask[0].nonzero().max())
    r = torch.zeros_like(values)
    r[0, last] = reward
    adv = torch.zeros_like(values)
    running, nxt = 0.0, 0.0
    for t in reversed(range(t_len)):
        delta = r[0, t] + gamma * nxt - values[0, t]
        running = delta + gamma * lam * running
        adv[0, t] = running
        nxt = values[0, t]
    return adv * mask


def test_gae_matches_the_same_trajectory_without_observation_positions():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t_len = 30
        mask = (torch.rand(1, t_len, generator=g) < 0.5).double()
        mask[0, -1] = 1
        values = torch.randn(1, t_len, generator=g, dtype=torch.float64)
        reward = T([1.0], dtype=torch.float64)
        adv, _ = gae_advantages(values, mask, reward, gamma=0.99, lam=0.9)
        keep = mask[0].bool()
        compact, _ = gae_advantages(values[:, keep], mask[:, keep], reward, gamma=0.99, lam=0.9)
        assert close(adv[:, keep], compact)
        # Negative control: decaying credit through every position gives other numbers.
        assert not close(_naive_gae(values, mask, 1.0, 0.99, 0.9)[:, keep], compact, tol=1e-3)


def test_gae_bootstraps_truncated_rows_only():
    rewards = T([1.0, 1.0], dtype=torch.float64)
    adv, _ = gae_advantages(
        VALUES.repeat(2, 1),
        MASK.repeat(2, 1),
        rewards,
        gamma=1.0,
        lam=0.5,
        bootstrap_mask=T([0.0, 1.0]),
        bootstrap_values=T([0.4, 0.4], dtype=torch.float64),
    )
    # Row 1 (truncated): t=5 delta = 1 + 0.4 - 0.8 = 0.6 instead of 0.2.
    assert close(adv[0, 5], 0.2) and close(adv[1, 5], 0.6)


def test_gae_plugin_whitens_over_action_tokens_only():
    est = ADVANTAGES.get("gae")(gamma=1.0, lam=0.5, whiten=True)
    out = est(AdvantageInput(rewards=T([1.0], dtype=torch.float64), group_ids=T([0]), action_mask=MASK, values=VALUES))
    a = out.advantages[MASK.bool()]
    assert close(a.mean(), 0.0) and close(a.pow(2).mean(), 1.0, tol=1e-5)
    assert close(out.advantages[~MASK.bool()], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="needs critic values"):
        est(AdvantageInput(rewards=T([1.0]), group_ids=T([0])))


def test_masked_whiten_ignores_masked_values():
    x = T([[1.0, 100.0, 3.0]])
    m = T([[1.0, 0.0, 1.0]])
    assert close(masked_whiten(x, m, eps=0.0), [[-1.0, 0.0, 1.0]])


# ---------------------------------------------------------------- policy loss

RATIOS = T([[1.0, 1.5, 0.5, 1.1, 0.7]], dtype=torch.float64)
ADV = T([[1.0, 1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
ONES = torch.ones_like(RATIOS)


def test_ppo_clip_hand_worked():
    logp = RATIOS.log().requires_grad_(True)
    out = ppo_clip_loss(logp, torch.zeros_like(logp), ADV, ONES, clip_low=0.2, clip_high=0.28)
    # tok0: r=1.0, A=1:  max(-1.0, -1.0)            = -1.0
    # tok1: r=1.5, A=1:  max(-1.5, -1.28)           = -1.28  (clipped high: no gradient)
    # tok2: r=0.5, A=-1: max(0.5, 0.8)              =  0.8   (clipped low: no gradient)
    # tok3: r=1.1, A=-1: max(1.1, 1.1)              =  1.1
    # tok4: r=0.7, A=2:  max(-1.4, -1.6)            = -1.4   (below range but A>0: not clipped)
    assert close(out.per_token_loss, [[-1.0, -1.28, 0.8, 1.1, -1.4]])
    out.per_token_loss.sum().backward()
    # d/dlogp(-A r) = -A r on unclipped tokens, 0 on clipped ones.
    assert close(logp.grad, [[-1.0, 0.0, 0.0, 1.1, -1.4]])
    s = out.stats.summary()
    assert s["clip_frac_high"] == 0.2 and s["clip_frac_low"] == 0.2
    assert close(s["ratio_min"], 0.5) and close(s["ratio_max"], 1.5) and close(s["ratio_mean"], 0.96)
    expected_kl = float(sum(r - 1 - math.log(r) for r in [1.0, 1.5, 0.5, 1.1, 0.7]) / 5)
    assert close(s["approx_kl"], expected_kl)
    assert close(s["behaviour_logprob_gap"], sum(abs(math.log(r)) for r in [1.0, 1.5, 0.5, 1.1, 0.7]) / 5)


def test_ppo_clip_is_inactive_on_policy_and_fires_off_policy():
    # On-policy (behaviour == current), nothing is clipped and the gradient is -A.
    logp = torch.full((1, 5), -1.0, dtype=torch.float64, requires_grad=True)
    out = ppo_clip_loss(logp, logp.detach(), ADV, ONES, clip_low=0.2, clip_high=0.28)
    out.per_token_loss.sum().backward()
    assert close(logp.grad, -ADV) and out.stats.summary()["clip_frac_high"] == 0.0
    # With behaviour log-probs from a different sampler, the clip acts.
    out = ppo_clip_loss(RATIOS.log(), torch.zeros_like(RATIOS), ADV, ONES, clip_low=0.2, clip_high=0.28)
    assert float(out.stats.clipped_high + out.stats.clipped_low) == 2


def test_dual_clip_caps_negative_advantage_loss():
    logp = T([[math.log(5.0), math.log(5.0)]], dtype=torch.float64, requires_grad=True)
    adv = T([[-1.0, 1.0]], dtype=torch.float64)
    out = ppo_clip_loss(
        logp, torch.zeros_like(logp), adv, torch.ones_like(adv), clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    # tok0: A=-1, r=5: max(5, 1.28) = 5 > 3 * 1 -> capped at 3 (no gradient).
    # tok1: A=+1, r=5: max(-5, -1.28) = -1.28 (ordinary clip; dual clip only touches A < 0).
    assert close(out.per_token_loss, [[3.0, -1.28]])
    assert float(out.stats.dual_clipped) == 1
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(logp, logp, adv, adv, clip_low=0.2, clip_high=0.28, dual_clip=0.5)


def test_ppo_clip_plugin_adds_kl_and_entropy_terms():
    logp = torch.log(T([[0.5, 0.5]], dtype=torch.float64))
    ref = torch.log(T([[0.25, 0.5]], dtype=torch.float64))
    ent = T([[2.0, 2.0]], dtype=torch.float64)
    zero_adv = torch.zeros_like(logp)
    loss = PPOClipLoss(kl_coef=0.1, entropy_coef=0.01)(
        PolicyLossInput(
            logprobs=logp,
            behaviour_logprobs=logp,
            advantages=zero_adv,
            action_mask=torch.ones_like(logp),
            ref_logprobs=ref,
            entropy=ent,
        )
    )
    # pg = 0 (A = 0). tok0: k3 = 0.5 - 1 + ln 2 = 0.193147 -> 0.1 * 0.193147 - 0.01 * 2 = -0.000685
    # tok1: k3 = 0 -> -0.02
    assert close(loss.per_token_loss, [[0.1 * (math.log(2) - 0.5) - 0.02, -0.02]])
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        PPOClipLoss(kl_coef=0.1)(
            PolicyLossInput(
                logprobs=logp, behaviour_logprobs=logp, advantages=zero_adv, action_mask=torch.ones_like(logp)
            )
        )
    with pytest.raises(ValueError, match=r"ratio in \[1-clip_low, 1\+clip_high\]"):
        PPOClipLoss(clip_low=1.2)


def test_kl_estimators():
    logp, ref = torch.log(T([0.5])), torch.log(T([0.25]))
    # log r = ln(0.25 / 0.5) = -ln 2
    assert close(kl_estimate(logp, ref, "k1"), [math.log(2)])  # -log r
    assert close(kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2])  # 0.240227
    assert close(kl_estimate(logp, ref, "k3"), [0.5 - 1 + math.log(2)])  # r - 1 - log r = 0.193147


def test_clipped_value_loss():
    v = T([[1.0, 2.0]], dtype=torch.float64)
    old = T([[0.5, 2.0]], dtype=torch.float64)
    ret = T([[2.0, 1.0]], dtype=torch.float64)
    out = clipped_value_loss(v, old, ret, torch.ones_like(v), clip_range=0.2)
    # tok0: V_clip = 0.5 + 0.2 = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845, clipped branch wins.
    # tok1: V_clip = 2.0; both (2-1)^2 = 1 -> 0.5.
    assert close(out.per_token_loss, [[0.845, 0.5]]) and float(out.clipped) == 1


# ---------------------------------------------------------------- aggregation

LOSS = T([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])  # 100s sit off-mask
AMASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token_mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq_mean_token_mean", 3.0),  # (6 / 3 + 4 / 1) / 2 sequences
        ("seq_mean_token_sum", 5.0),  # (6 + 4) / 2 sequences
        ("seq_mean_token_sum_norm", 1.0),  # 10 / (2 sequences * norm_length 5)
    ],
)
def test_aggregation_modes(mode, expected):
    n_tok, n_seq = local_denominators(AMASK)
    assert float(n_tok) == 4 and float(n_seq) == 2
    got = aggregate(LOSS, AMASK, mode, num_tokens=n_tok, num_sequences=n_seq, norm_length=5)
    assert close(got, expected)
    assert close(
        aggregate(LOSS, AMASK, mode, num_tokens=n_tok, num_sequences=n_seq, norm_length=5, dp_size=2), 2 * expected
    )


def test_aggregation_needs_norm_length_for_dr_grpo():
    with pytest.raises(ValueError, match="needs a positive norm_length"):
        aggregate(LOSS, AMASK, "seq_mean_token_sum_norm", num_tokens=4, num_sequences=2)


def test_k3_is_accurate_for_tiny_log_ratios():
    # A policy a step away from its reference: |log r| ~ 1e-4 to 1e-6 in float32. k3 = r - 1 - log r ~ (log r)^2 / 2;
    # computed as exp(log r) - 1 - log r it cancels to 0 or noise (the metric then read 0).
    log_r = torch.tensor([1e-4, -1e-4, 3e-5, -2e-6], dtype=torch.float32)
    k3 = kl_estimate(torch.zeros(4), log_r, "k3")
    exact = (log_r.double().exp() - 1 - log_r.double()).float()
    assert torch.allclose(k3, exact, rtol=1e-4, atol=0)
    # The gradient stays that of r - 1 - log r (d/d log p = 1 - r) on both sides of the switch.
    for x in (1e-3, 5e-2):
        logp = torch.zeros(1, requires_grad=True)
        kl_estimate(logp, torch.tensor([x]), "k3").sum().backward()
        assert abs(float(logp.grad) - (1 - math.exp(x))) < 1e-6


def test_kl_estimates_are_exact_far_below_the_reference_and_k3_cannot_overflow():
    # logp = 0, ref = -25 (log r = -25): k1 = 25, k2 = 312.5, k3 = e^-25 - 1 + 25 ~ 24, with their true
    # gradients (a clamp of log r to +-20 gave 20, 200, 19 and gradient 0: the KL stopped pulling on exactly
    # the tokens furthest from the reference). log r = +100: k3's exp is guarded, still finite.
    logp = T([[0.0, -0.1, -2.0]], dtype=torch.float32, requires_grad=True)
    ref = T([[-25.0, 99.9, -2.5]], dtype=torch.float32)
    k1, k2, k3 = (kl_estimate(logp, ref, e, clamp=20.0) for e in ("k1", "k2", "k3"))
    assert close(k1[0, 0], 25.0) and close(k2[0, 0], 312.5) and close(k3[0, 0], math.exp(-25.0) - 1 + 25.0, tol=1e-5)
    assert close(k1[0, 1], -100.0, tol=1e-5) and close(k2[0, 1], 5000.0, tol=1e-3)
    assert bool(torch.isfinite(k3).all()) and close(k3[0, 1], math.exp(20.0) - 1 - 100.0, tol=1e-2)
    for kl, dk_at_minus25 in ((k1, 1.0), (k2, 25.0), (k3, 1.0 - math.exp(-25.0))):
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert bool(torch.isfinite(grad).all())
        assert close(grad[0, 0], dk_at_minus25, tol=1e-5)  # d/dlogp of each estimate at log r = -25
    # Without the guard, k3 at log r = 100 overflows float32.
    assert not bool(torch.isfinite(kl_estimate(logp, ref, "k3", clamp=1e9)).all())


def test_value_clip_fraction_counts_only_clipped_tokens_in_float32():
    # Nothing is clipped here (|V - V_old| = 0.0964 < 0.2); V_old + clamp(V - V_old) is not exactly V in
    # float32, which counted such tokens as clipped.
    v = T([[-0.03976007]], dtype=torch.float32)
    old = T([[-0.13618681]], dtype=torch.float32)
    ret = T([[0.5]], dtype=torch.float32)
    assert float(clipped_value_loss(v, old, ret, torch.ones_like(v), clip_range=0.2).clipped) == 0.0
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(64, 32, generator=gen)
    old = v + 0.19 * (2 * torch.rand(64, 32, generator=gen) - 1)  # all inside the clip range
    out = clipped_value_loss(v, old, torch.randn(64, 32, generator=gen), torch.ones_like(v), clip_range=0.2)
    assert float(out.clipped) == 0.0
    far = clipped_value_loss(v, v + 0.5, torch.full_like(v, -10.0), torch.ones_like(v), clip_range=0.2)
    assert (
        float(far.clipped) == v.numel()
    )  # returns far below: the clipped value (V_old - c = V + 0.3) is worse everywhere


def test_kl_importance_weight_multiplies_the_kl_term_by_the_ratio():
    # TRL's use_bias_correction_kl: the per-token KL times pi/pi_behaviour (with gradient through the ratio).
    logp = torch.log(T([[0.5, 0.4]], dtype=torch.float64)).requires_grad_(True)
    behaviour = torch.log(T([[0.25, 0.4]], dtype=torch.float64))
    ref = torch.log(T([[0.25, 0.2]], dtype=torch.float64))
    mask, zero = torch.ones_like(behaviour), torch.zeros_like(behaviour)
    inp = PolicyLossInput(
        logprobs=logp, behaviour_logprobs=behaviour, advantages=zero, action_mask=mask, ref_logprobs=ref
    )
    plain = PPOClipLoss(kl_coef=0.1)(inp).per_token_loss
    weighted = PPOClipLoss(kl_coef=0.1, kl_importance_weight=True)(inp).per_token_loss
    ratio = T([[2.0, 1.0]], dtype=torch.float64)
    assert close(weighted, plain * ratio)
    # On-policy (ratio 1) the values agree, the gradients do not: d(ratio)/dlogp = 1 adds k3 itself.
    (g_plain,) = torch.autograd.grad(plain[0, 1], logp)
    (g_weighted,) = torch.autograd.grad(weighted[0, 1], logp)
    k3 = 0.5 - 1 + math.log(2)  # q/p = 0.5
    assert close(g_weighted[0, 1] - g_plain[0, 1], 0.1 * k3)


def _kl_term_expectation(
    estimator: str,
    weighted: bool,
    theta: torch.Tensor,
    behaviour: torch.Tensor,
    ref: torch.Tensor,
    proximal: torch.Tensor | None = None,
    with_is_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact expectation, over tokens drawn from ``behaviour``, of the loss's KL term and of its gradient with respect
    to the policy's logits ``theta`` (enumeration over the vocabulary: sum_x b(x) * term(x)).

    ``proximal`` None: the loss is anchored on the behaviour log-probs (no correction). Otherwise it is anchored on
    ``proximal`` (pi_old: the decoupled objective's pi_prox, or the mismatch correction's trainer forward) and given
    the trainer's weights ``is_weights = pi_prox / pi_behaviour`` (untruncated here), or none with
    ``with_is_weights=False`` (how the KL term was weighted before issue 49: as if sampled by pi_prox)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    vocab = theta.numel()
    rows = logp.expand(vocab, vocab).gather(1, torch.arange(vocab)[:, None])  # (V, 1): log pi(x) for each token x
    anchor_rows, ref_rows = (behaviour if proximal is None else proximal)[:, None], ref[:, None]
    is_weights = None if proximal is None or not with_is_weights else (proximal - behaviour).exp()[:, None]
    if kl_gradient_problem(estimator, weighted) is None:  # the loss's own term
        loss = PPOClipLoss(kl_coef=1.0, kl_estimator=estimator, kl_importance_weight=weighted)
        inp = PolicyLossInput(
            logprobs=rows,
            behaviour_logprobs=anchor_rows,
            advantages=torch.zeros_like(rows),
            action_mask=torch.ones_like(rows),
            ref_logprobs=ref_rows,
            is_weights=is_weights,
        )
        per_token = loss(inp).per_token_loss[:, 0]
    else:  # refused by the loss: the term as it would be
        assert proximal is None
        ratio = (rows - anchor_rows).exp() if weighted else torch.ones_like(rows)
        per_token = (kl_estimate(rows, ref_rows, estimator) * ratio)[:, 0]
    value = (behaviour.exp() * per_token).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.detach(), grad


def _expected_kl_term_gradient(
    estimator: str, weighted: bool, theta: torch.Tensor, behaviour: torch.Tensor, ref: torch.Tensor
) -> torch.Tensor:
    return _kl_term_expectation(estimator, weighted, theta, behaviour, ref)[1]


def test_the_kl_terms_the_loss_accepts_follow_the_reverse_kl_gradient_exactly():
    # Point 1 of issue 30, by exact enumeration over a 6-token vocabulary: the expected gradient of the KL term on
    # behaviour samples must be grad KL(pi || ref). Weighted k1 and k3, unweighted k2: exact. Weighted k2 is 86%
    # off here and unweighted k1 has zero expected gradient: both refused (unweighted k3 follows the forward KL, GRPO's
    # usual term, and is kept).
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, generator=gen)
    behaviour = torch.log_softmax(theta + 0.3 * torch.randn(6, dtype=torch.float64, generator=gen), -1)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=gen), -1)
    t = theta.clone().requires_grad_(True)
    p = torch.log_softmax(t, -1)
    (truth,) = torch.autograd.grad((p.exp() * (p - ref)).sum(), t)  # grad KL(pi || ref)

    def off(estimator: str, weighted: bool) -> float:
        grad = _expected_kl_term_gradient(estimator, weighted, theta, behaviour, ref)
        return float((grad - truth).norm() / truth.norm())

    assert off("k1", True) < 1e-12 and off("k3", True) < 1e-12
    # Unweighted k2 is exact on-policy (behaviour = pi), as its gradient is log(pi/ref) grad log pi.
    assert (
        float((_expected_kl_term_gradient("k2", False, theta, torch.log_softmax(theta, -1), ref) - truth).norm())
        < 1e-12
    )
    assert off("k2", True) > 0.05  # the bias the loss refuses
    assert float(_expected_kl_term_gradient("k1", False, theta, torch.log_softmax(theta, -1), ref).norm()) < 1e-12
    for estimator, weighted, why in (("k2", True, "biased gradient"), ("k1", False, "zero expected gradient")):
        with pytest.raises(ValueError, match=why):
            PPOClipLoss(kl_coef=0.1, kl_estimator=estimator, kl_importance_weight=weighted)
        assert kl_gradient_problem(estimator, weighted) is not None
        PPOClipLoss(kl_coef=0.0, kl_estimator=estimator, kl_importance_weight=weighted)  # no KL term: nothing to refuse
    assert all(kl_gradient_problem(e, w) is None for e, w in (("k1", True), ("k2", False), ("k3", True), ("k3", False)))


def test_the_logged_approx_kl_is_accurate_for_tiny_log_ratios():
    # train/approx_kl (k3 of behaviour vs current) cancelled to 0 or noise in float32 as r - 1 - log r.
    behaviour = torch.full((1, 4), -3.0)
    log_r = torch.tensor([[1e-5, -1e-5, 3e-5, -2e-6]])
    out = ppo_clip_loss(behaviour + log_r, behaviour, torch.ones(1, 4), torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    lr = (behaviour + log_r) - behaviour  # the log ratio float32 can represent
    exact = float((lr.double().exp() - 1 - lr.double()).sum())
    assert exact > 0 and abs(float(out.stats.approx_kl_sum) - exact) < 1e-3 * exact


def _stale_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 6-token categorical one update stale: the current policy's logits, the proximal policy's logits (another
    point), a direction in which behaviour policies move away from the proximal one, and reference log-probs."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, generator=gen)
    proximal = theta + 0.3 * torch.randn(6, dtype=torch.float64, generator=gen)
    direction = torch.randn(6, dtype=torch.float64, generator=gen)
    ref = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=gen), -1)
    return theta, proximal, direction, ref


STALE_SCALES = (0.03, 0.1, 0.15)
"""Behaviour logits ``proximal + s * direction``: mean ``|log pi_prox - log pi_behaviour|`` under the behaviour policy
0.018, 0.062 and 0.094 (the async tripwire's figure; measured 0.04-0.13 on the tests' tiny model)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_weighted_kl_term_is_unbiased_on_stale_samples(estimator):
    # Issue 49, point 2, by exact enumeration: tokens sampled by a stale behaviour policy b, the loss anchored on the
    # proximal policy (the decoupled objective's pi_prox; pi_old under the mismatch correction) and given the
    # trainer's is_weights = pi_prox / b, with the current pi != pi_prox != b. The weighted term's importance weight
    # is then pi / b, so over b's tokens its expected value is KL(pi || ref) and its expected gradient
    # grad KL(pi || ref), at every gap. Negative control: weighted by pi / pi_prox only (TRL's use_bias_correction_kl,
    # and this loss before issue 49), k3's value is off by 0.7%, 2.4%, 3.6% and its gradient by 1.6%, 5.7%, 8.7%
    # (k1's: 1.2%, 4.0%, 6.0% and 2.7%, 9.3%, 14.2%) at the gaps of STALE_SCALES.
    theta, prox_logits, direction, ref = _stale_problem()
    prox = torch.log_softmax(prox_logits, -1)
    t = theta.clone().requires_grad_(True)
    p = torch.log_softmax(t, -1)
    kl = (p.exp() * (p - ref)).sum()
    (truth,) = torch.autograd.grad(kl, t)
    kl = kl.detach()
    old_value_bias, old_grad_bias = [], []
    for scale in STALE_SCALES:
        b = torch.log_softmax(prox_logits + scale * direction, -1)
        value, grad = _kl_term_expectation(estimator, True, theta, b, ref, proximal=prox)
        assert abs(float(value / kl) - 1) < 1e-12 and _rel(grad, truth) < 1e-12
        old_value, old_grad = _kl_term_expectation(estimator, True, theta, b, ref, proximal=prox, with_is_weights=False)
        old_value_bias.append(abs(float(old_value / kl) - 1))
        old_grad_bias.append(_rel(old_grad, truth))
    assert old_value_bias == sorted(old_value_bias) and old_value_bias[-1] > 0.03
    assert old_grad_bias == sorted(old_grad_bias) and old_grad_bias[-1] > 0.08
    # With b = pi_prox (is_weights 1: on-policy sampling, or a sampler that agrees with the trainer) both are exact.
    value, grad = _kl_term_expectation(estimator, True, theta, prox, ref, proximal=prox, with_is_weights=False)
    assert abs(float(value / kl) - 1) < 1e-12 and _rel(grad, truth) < 1e-12


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_the_unweighted_kl_term_is_the_on_policy_term_under_pi_old(estimator):
    # kl_importance_weight=False: the term is v * k with v = is_weights = pi_prox / b, the policy term's weight, so over
    # b's tokens its expected value is E_prox[k] and its expected gradient E_prox[grad k], whatever the gap to b. At
    # pi = pi_prox (the decoupled update's one optimizer step; the first step on a batch) that is the on-policy term:
    # k2's gradient is grad KL(pi || ref), k3's grad KL(ref || pi) (GRPO's). Negative control: k without v (before
    # issue 49) is E_b[k]: at the largest gap k2's value is off by 4.5-4.9% and its gradient by 9.8-10.6%, k3's by
    # 3.1-3.5% and 6.0-6.6%.
    theta, prox_logits, direction, ref = _stale_problem()
    prox = torch.log_softmax(prox_logits, -1)
    for current in (theta, prox_logits):  # pi != pi_prox, then pi = pi_prox
        t = current.clone().requires_grad_(True)
        p = torch.log_softmax(t, -1)
        exact_value = (prox.exp() * kl_estimate(p, ref, estimator)).sum()  # E_prox[k], prox held fixed
        (exact_grad,) = torch.autograd.grad(exact_value, t)
        exact_value = exact_value.detach()
        for scale in STALE_SCALES:
            b = torch.log_softmax(prox_logits + scale * direction, -1)
            value, grad = _kl_term_expectation(estimator, False, current, b, ref, proximal=prox)
            assert abs(float(value / exact_value) - 1) < 1e-12 and _rel(grad, exact_grad) < 1e-12
        old_value, old_grad = _kl_term_expectation(
            estimator, False, current, b, ref, proximal=prox, with_is_weights=False
        )
        assert abs(float(old_value / exact_value) - 1) > 0.03 and _rel(old_grad, exact_grad) > 0.05
    t = prox_logits.clone().requires_grad_(True)
    p = torch.log_softmax(t, -1)
    on_policy = (p.exp() * (p - ref)).sum() if estimator == "k2" else (ref.exp() * (ref - p)).sum()
    (truth,) = torch.autograd.grad(on_policy, t)
    assert _rel(exact_grad, truth) < 1e-12
