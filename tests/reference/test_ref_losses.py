"""Reference equivalence: PPO policy/value losses, KL estimators and aggregation vs the published formulas.

References are written from the papers (cited at each), independently of ``trl_plugins.algos``, and
compared on seeded random inputs that include dual-clip-active tokens, tokens near the value-clip
boundary, large |log r|, rows without action tokens and unequal micro-batches.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from trl_plugins.algos import aggregate, clipped_value_loss, kl_estimate, local_denominators, ppo_clip_loss

F64 = torch.float64
F32 = torch.float32


# ------------------------------------------------------------------ PPO clipped surrogate


def ref_ppo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss = -objective, on 1-D tensors of action tokens only.

    L^CLIP (Schulman et al. 2017, eq. 7) = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with the
    asymmetric range of DAPO clip-higher (Yu et al. 2025, eq. 10). Dual clip (Ye et al. 2020,
    eq. 5): for A < 0 the objective is max(L^CLIP, c A). Also returns which tokens had the clipped
    term strictly lower (split by sign of A) and which took the dual bound c A.
    """
    ratio = torch.exp(logp - old_logp)
    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    objective = torch.minimum(surr, surr_clipped)
    clip_active = (surr_clipped < surr).detach()
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        dual_active = ((adv < 0) & (dual_clip * adv > objective)).detach()
        objective = torch.where(adv < 0, torch.maximum(objective, dual_clip * adv), objective)
    return -objective, clip_active & (adv < 0), clip_active & (adv > 0), dual_active


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clip_low, clip_high, dual_clip", [(0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.5, 2.0)])
def test_ppo_clip_matches_eq7_and_dual_clip(
    seed: int, clip_low: float, clip_high: float, dual_clip: float | None
) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t = 8, 24
    logp = -3.0 * torch.rand(b, t, generator=gen, dtype=F64)
    old = logp + 1.2 * torch.randn(b, t, generator=gen, dtype=F64)  # ratios from ~e^-4 to ~e^4
    adv = torch.randn(b, t, generator=gen, dtype=F64)
    adv[0, :4] = 0.0
    mask = (torch.rand(b, t, generator=gen) < 0.7).long()
    mask[1] = 0  # a row without action tokens
    mask[2, 5:12] = 0  # an observation span
    old_garbage = torch.where(mask.bool(), old, torch.full_like(old, 1e4))  # never read off the mask
    logp_ours = logp.clone().requires_grad_(True)
    out = ppo_clip_loss(logp_ours, old_garbage, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)

    on = mask.bool()
    logp_ref = logp.clone().requires_grad_(True)
    loss_on, low, high, dual = ref_ppo_objective(logp_ref[on], old[on], adv[on], clip_low, clip_high, dual_clip)
    expected = torch.zeros_like(logp).masked_scatter(on, loss_on.detach())
    torch.testing.assert_close(out.per_token_loss, expected, rtol=0, atol=1e-12)
    out.per_token_loss.sum().backward()
    loss_on.sum().backward()
    torch.testing.assert_close(logp_ours.grad, logp_ref.grad, rtol=0, atol=1e-12)
    assert low.sum() > 0 and high.sum() > 0
    assert float(out.stats.clipped_low) == low.sum().item()
    assert float(out.stats.clipped_high) == high.sum().item()
    assert float(out.stats.dual_clipped) == dual.sum().item()
    if dual_clip is not None:
        assert dual.sum() >= 5  # the dual bound is exercised


# ------------------------------------------------------------------ clipped value loss


def ref_value_loss(
    v: torch.Tensor, v_old: torch.Tensor, ret: torch.Tensor, c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) (PPO2 / verl ``compute_value_loss`` /
    MiniMind), with V itself clamped; returns (loss, tokens whose clipped branch is strictly larger)."""
    v_clipped = torch.clamp(v, min=v_old - c, max=v_old + c)
    unclipped = (v - ret) ** 2
    clipped = (v_clipped - ret) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def test_value_clip_issue_case_is_not_clipped() -> None:
    # |V - V_old| = 0.0964 < c: not clipped, whichever side of V the return lies on. (V_old +
    # clamp(V - V_old) rounds to V + 1 ulp here, which looked "clipped" when R < V.)
    v, v_old = torch.full((1, 2), -0.03976007), torch.full((1, 2), -0.13618681)
    ret = torch.tensor([[0.5, -0.5]])
    assert abs(float(v[0, 0] - v_old[0, 0])) < 0.2
    out = clipped_value_loss(v, v_old, ret, torch.ones(1, 2), clip_range=0.2)
    assert float(out.clipped) == 0.0


@pytest.mark.parametrize("seed", range(2))
def test_value_loss_and_clip_fraction_exact_in_float32(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, t, c = 64, 512, 0.2
    # V_old of the size of c, V drawn in float64 and rounded (as a critic's output is, not V_old + step
    # in float32): most steps lie just inside the clip range (within 1e-3 of c), a quarter outside it.
    v_old = (0.3 * torch.randn(b, t, generator=gen, dtype=F64)).to(F32)
    near = c * (1.0 - 1e-3 * torch.rand(b, t, generator=gen, dtype=F64))
    step = torch.where(
        torch.rand(b, t, generator=gen) < 0.25, c * (1.0 + torch.rand(b, t, generator=gen, dtype=F64)), near
    )
    v = (v_old.to(F64) + torch.where(torch.rand(b, t, generator=gen) < 0.5, step, -step)).to(F32)
    ret = v_old + 0.5 * torch.randn(b, t, generator=gen)
    mask = (torch.rand(b, t, generator=gen) < 0.9).long()
    mask[3] = 0
    v_ours = v.clone().requires_grad_(True)
    out = clipped_value_loss(v_ours, v_old, ret, mask, clip_range=c)

    on = mask.bool()
    assert ((v - v_old).abs() < c).float().mean() > 0.7
    v_ref = v.clone().requires_grad_(True)
    loss_on, clipped_on = ref_value_loss(v_ref[on], v_old[on], ret[on], c)
    assert float(out.clipped) == clipped_on.sum().item()  # exact count, in float32
    torch.testing.assert_close(
        out.per_token_loss, torch.zeros_like(v).masked_scatter(on, loss_on.detach()), rtol=1e-6, atol=0
    )
    out.per_token_loss.sum().backward()
    loss_on.sum().backward()
    # At V == V_old +- c exactly (a kink; a few float32 tokens land there) any subgradient is valid
    # and torch.clamp / torch.minimum pick different ones: compare the gradient everywhere else.
    kink = (v == v_old + c) | (v == v_old - c)
    torch.testing.assert_close(v_ours.grad[~kink], v_ref.grad[~kink], rtol=1e-6, atol=0)


# ------------------------------------------------------------------ KL estimators


def ref_kl(logp: float, ref_logp: float) -> dict[str, tuple[float, float]]:
    """Schulman (2020), "Approximating KL Divergence": with log r = log q - log p (x ~ p),
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r; each with d/d(log p) (d log r / d log p = -1)."""
    lr = ref_logp - logp
    return {
        "k1": (-lr, 1.0),
        "k2": (0.5 * lr * lr, -lr),
        "k3": (math.expm1(lr) - lr, 1.0 - math.exp(lr)),
    }


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_definitions(estimator: str) -> None:
    clamp = 20.0
    gen = torch.Generator().manual_seed(3)
    logp = -5.0 * torch.rand(200, generator=gen, dtype=F64)
    log_r = torch.cat(
        [
            torch.tensor([-100.0, -50.0, -25.0, -20.5, 0.0, 19.9, 25.0, 50.0], dtype=F64),
            8.0 * torch.randn(192, generator=gen, dtype=F64),
        ]
    )
    ref_logp = logp + log_r
    if estimator == "k3":  # exact wherever log r <= clamp (above it only exp's argument is bounded)
        keep = log_r <= clamp
        logp, ref_logp = logp[keep], ref_logp[keep]
    p = logp.clone().requires_grad_(True)
    got = kl_estimate(p, ref_logp, estimator, clamp=clamp)
    got.sum().backward()
    expected = [ref_kl(a, b)[estimator] for a, b in zip(logp.tolist(), ref_logp.tolist())]
    torch.testing.assert_close(got.detach(), torch.tensor([e[0] for e in expected], dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.grad, torch.tensor([e[1] for e in expected], dtype=F64), rtol=1e-12, atol=1e-12)


def test_kl_issue_case_float32() -> None:
    p = torch.zeros(3, requires_grad=True)
    ref = torch.full((3,), -25.0)
    values = [kl_estimate(p[i : i + 1], ref[i : i + 1], k) for i, k in enumerate(["k1", "k2", "k3"])]
    assert [float(v.detach()) for v in values] == [25.0, 312.5, 24.0]
    torch.stack(values).sum().backward()
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 25.0, 1.0]), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ aggregation over micro-batches


def ref_aggregate(loss: list[list[float]], mask: list[list[int]], mode: str, norm_length: int) -> float:
    """One-batch losses. ``token_mean``: DAPO token-level mean (Yu et al. 2025, eq. 8);
    ``seq_mean_token_mean``: GRPO (Shao et al. 2024, eq. 3: 1/G sum_i 1/|o_i| sum_t); ``seq_mean_token_sum``;
    ``seq_mean_token_sum_norm``: Dr. GRPO (Liu et al. 2025), a constant length in place of |o_i|.
    Sequences without loss tokens are not counted (they carry no loss)."""
    rows = [[l for l, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    rows = [r for r in rows if r]
    n_tok, n_seq = sum(len(r) for r in rows), len(rows)
    if mode == "token_mean":
        return math.fsum(math.fsum(r) for r in rows) / n_tok
    if mode == "seq_mean_token_mean":
        return math.fsum(math.fsum(r) / len(r) for r in rows) / n_seq
    if mode == "seq_mean_token_sum":
        return math.fsum(math.fsum(r) for r in rows) / n_seq
    return math.fsum(math.fsum(r) for r in rows) / (n_seq * norm_length)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregate_over_random_splits_equals_one_batch(seed: int, mode: str) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, t = 13, 20
    loss = torch.randn(b, t, generator=gen, dtype=F64)
    lengths = [rng.choice([0, 1, 3, 7, 12, 20]) for _ in range(b)]
    mask = torch.tensor([[int(j < n) for j in range(t)] for n in lengths])
    mask[4, 2:5] = 0  # an observation span
    cuts = sorted(rng.sample(range(1, b), 3))  # 4 micro-batches of unequal sizes
    parts = [slice(a, z) for a, z in zip([0] + cuts, cuts + [b])]
    n_tok = sum(local_denominators(mask[s])[0] for s in parts)
    n_seq = sum(local_denominators(mask[s])[1] for s in parts)
    total = sum(aggregate(loss[s], mask[s], mode, num_tokens=n_tok, num_sequences=n_seq, norm_length=t) for s in parts)
    expected = ref_aggregate(loss.tolist(), mask.tolist(), mode, t)
    assert math.isclose(float(total), expected, rel_tol=1e-12, abs_tol=1e-12)
