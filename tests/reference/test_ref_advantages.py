"""Reference equivalence: advantage estimators and whitening against the published formulas.

Each reference below is written from the paper, plainly and loop-based, independently of
``trl_plugins.algos``; seeded random inputs include the awkward cases (all-equal groups of values
float32 cannot represent, groups of one, rows without action tokens, multi-turn observation spans,
truncated rows). See ``docs/reference_equivalence.md`` for the conventions and tolerances.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from trl_plugins.algos import gae_advantages, group_advantages, masked_whiten, rloo_advantages

F64 = torch.float64
F32 = torch.float32


# ------------------------------------------------------------------ references


def ref_grpo(rewards: list[float], groups: list[int], *, scale_by_std: bool, eps: float) -> list[float]:
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath sec. 4.1.2): A_i = (r_i - mean(r)) / std(r).

    The std is the unbiased (n - 1) sample std with ``eps`` added to it, as in TRL 1.16 ``nanstd`` and
    verl ``compute_grpo_outcome_advantage`` (``torch.std``). Dr. GRPO (Liu et al. 2025, eq. 5 vs 3)
    drops the division. Exact rational arithmetic up to the std, so an all-equal group is exactly 0
    without any special case; a group of one has no spread (std 0, centred reward 0).
    """
    out = []
    for i, r_i in enumerate(rewards):
        members = [Fraction(r) for r, g in zip(rewards, groups) if g == groups[i]]
        n = len(members)
        mean = sum(members) / n
        centred = Fraction(r_i) - mean
        if not scale_by_std:
            out.append(float(centred))
            continue
        var = sum((m - mean) ** 2 for m in members) / (n - 1) if n > 1 else Fraction(0)
        out.append(float(centred) / (math.sqrt(var) + eps))
    return out


def ref_rloo(rewards: list[float], groups: list[int]) -> list[float]:
    """RLOO (Ahmadian et al. 2024, eq. 5 / Kool et al. 2019): A_i = r_i - 1/(n-1) sum_{j != i} r_j."""
    out = []
    for i, r_i in enumerate(rewards):
        others = [Fraction(r) for j, (r, g) in enumerate(zip(rewards, groups)) if g == groups[i] and j != i]
        out.append(float(Fraction(r_i) - sum(others) / len(others)) if others else 0.0)
    return out


def ref_gae_row(
    values: list[float],
    mask: list[int],
    reward: float,
    token_rewards: list[float],
    gamma: float,
    lam: float,
    bootstrap: float,
) -> tuple[list[float], list[float]]:
    """GAE (Schulman et al. 2016, eq. 16) over one row's *action* positions only.

    The MDP steps are the action positions, compacted (observation spans are not steps, so nothing
    decays across them). r_k is the token reward plus, on the last step, the outcome reward; the
    value after the last step is ``bootstrap`` (0 for a terminated row). Then
    delta_k = r_k + gamma V_{k+1} - V_k and A_k = sum_{l >= 0} (gamma lam)^l delta_{k+l} (the sum
    written out, not the recursion); the value target is A_k + V_k. Scattered back, 0 off the mask.
    """
    pos = [t for t, m in enumerate(mask) if m]
    adv, ret = [0.0] * len(values), [0.0] * len(values)
    if not pos:
        return adv, ret
    v = [values[t] for t in pos]
    r = [token_rewards[t] for t in pos]
    r[-1] += reward
    v_next = v[1:] + [bootstrap]
    delta = [r[k] + gamma * v_next[k] - v[k] for k in range(len(pos))]
    for k, t in enumerate(pos):
        a = sum((gamma * lam) ** l * delta[k + l] for l in range(len(pos) - k))
        adv[t], ret[t] = a, a + v[k]
    return adv, ret


def ref_whiten(
    x: list[float], mask: list[int], *, unbiased: bool, eps: float = 1e-8, shift_mean: bool = True
) -> list[float]:
    """Masked whitening (PPO advantage normalisation): (x - mean) / sqrt(var + eps) over masked positions.

    ``unbiased`` picks the variance divisor (n - 1 vs n); off-mask positions are 0.
    """
    xs = [v for v, m in zip(x, mask) if m]
    n = len(xs)
    mean = math.fsum(xs) / n
    var = math.fsum((v - mean) ** 2 for v in xs) / (n - 1 if unbiased else n)
    scale = 1.0 / math.sqrt(var + eps)
    return [((v - mean) * scale + (0.0 if shift_mean else mean)) if m else 0.0 for v, m in zip(x, mask)]


# ------------------------------------------------------------------ inputs

INEXACT = (-0.9, 1.1, 0.1)  # not representable in float32: a float32 mean leaves a residue


def random_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """Shuffled rewards with arbitrary group labels; returns (rewards f32, group ids, equal-group labels)."""
    rng = random.Random(seed)
    rewards, groups, equal = [], [], set()
    labels = rng.sample(range(1000), 14)
    for k, label in enumerate(labels):
        size = [1, 1, 2, 3, 4, 5, 8][k % 7]
        if k < 6:  # all-equal groups: inexact constants, and groups of one
            value = INEXACT[k % 3]
            members = [value] * size
            equal.add(label)
        elif k % 2:
            members = [float(rng.random() < 0.5) for _ in range(size)]  # binary verifier rewards
        else:
            members = [rng.choice(INEXACT + (rng.gauss(0, 1),)) for _ in range(size)]
        if len(set(members)) == 1:
            equal.add(label)
        rewards += members
        groups += [label] * size
    order = list(range(len(rewards)))
    rng.shuffle(order)
    return (
        torch.tensor([rewards[i] for i in order], dtype=F32),
        torch.tensor([groups[i] for i in order]),
        equal,
    )


# ------------------------------------------------------------------ group advantages


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scale_by_std, eps", [(True, 1e-6), (True, 1e-4), (False, 0.0)])
def test_group_advantages_match_grpo_formula(seed: int, scale_by_std: bool, eps: float) -> None:
    rewards, groups, equal = random_groups(seed)
    got = group_advantages(rewards, groups, scale_by_std=scale_by_std, eps=eps)
    expected = ref_grpo(rewards.tolist(), groups.tolist(), scale_by_std=scale_by_std, eps=eps)
    assert got.dtype == F32
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F32), rtol=1e-6, atol=1e-7)
    on_equal = torch.tensor([g in equal for g in groups.tolist()])
    assert on_equal.sum() >= 10
    assert torch.equal(got[on_equal], torch.zeros_like(got[on_equal]))  # exactly 0, not ~1e-2


def test_group_advantages_float64_tight() -> None:
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(40, generator=gen, dtype=F64)
    groups = torch.randint(0, 9, (40,), generator=gen)
    for scale in (True, False):
        got = group_advantages(rewards, groups, scale_by_std=scale)
        expected = ref_grpo(rewards.tolist(), groups.tolist(), scale_by_std=scale, eps=1e-6)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_rloo_matches_leave_one_out(seed: int) -> None:
    rewards, groups, equal = random_groups(seed)
    got = rloo_advantages(rewards, groups)
    expected = ref_rloo(rewards.tolist(), groups.tolist())
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F32), rtol=1e-6, atol=1e-7)
    on_equal = torch.tensor([g in equal for g in groups.tolist()])
    assert torch.equal(got[on_equal], torch.zeros_like(got[on_equal]))


# ------------------------------------------------------------------ GAE over action positions


def random_multiturn_batch(seed: int, dtype: torch.dtype = F64):
    """(values, mask, rewards, token_rewards, bootstrap_mask, bootstrap_values); rows of T = 16.

    Row 0 has no action token; row 1 one action token at the last position; row 2 starts with an
    action at position 0; the others alternate prompt, action and tool-observation spans.
    """
    rng = random.Random(seed)
    n, t_len = 7, 16
    mask = torch.zeros(n, t_len, dtype=torch.long)
    mask[1, t_len - 1] = 1
    mask[2, :3] = 1
    mask[2, 6:9] = 1
    for i in range(3, n):
        t = rng.randint(1, 3)  # prompt
        while t < t_len:
            span = rng.randint(1, 4)
            mask[i, t : t + span] = 1  # assistant turn
            t += span + rng.randint(1, 4)  # tool observation / template glue
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, t_len, generator=gen, dtype=dtype)
    rewards = torch.randn(n, generator=gen, dtype=dtype)
    token_rewards = 0.1 * torch.randn(n, t_len, generator=gen, dtype=dtype)
    bootstrap_mask = torch.tensor([i % 2 for i in range(n)])  # odd rows truncated
    bootstrap_values = torch.randn(n, generator=gen, dtype=dtype)
    return values, mask, rewards, token_rewards, bootstrap_mask, bootstrap_values


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_eq16_on_action_positions(seed: int, gamma: float, lam: float) -> None:
    values, mask, rewards, token_rewards, boot_mask, boot_values = random_multiturn_batch(seed)
    adv, ret = gae_advantages(
        values,
        mask,
        rewards,
        gamma=gamma,
        lam=lam,
        bootstrap_mask=boot_mask,
        bootstrap_values=boot_values,
        token_rewards=token_rewards,
    )
    for i in range(values.shape[0]):
        bootstrap = float(boot_values[i]) if boot_mask[i] else 0.0
        e_adv, e_ret = ref_gae_row(
            values[i].tolist(), mask[i].tolist(), float(rewards[i]), token_rewards[i].tolist(), gamma, lam, bootstrap
        )
        torch.testing.assert_close(adv[i], torch.tensor(e_adv, dtype=F64), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[i], torch.tensor(e_ret, dtype=F64), rtol=0, atol=1e-12)
    assert torch.equal(adv[0], torch.zeros_like(adv[0]))  # the empty row


def test_gae_float32_close_to_reference() -> None:
    values, mask, rewards, token_rewards, boot_mask, boot_values = random_multiturn_batch(11, F32)
    adv, _ = gae_advantages(
        values, mask, rewards, gamma=0.99, lam=0.95, bootstrap_mask=boot_mask, bootstrap_values=boot_values
    )
    for i in range(values.shape[0]):
        bootstrap = float(boot_values[i]) if boot_mask[i] else 0.0
        e_adv, _ = ref_gae_row(
            values[i].tolist(), mask[i].tolist(), float(rewards[i]), [0.0] * 16, 0.99, 0.95, bootstrap
        )
        torch.testing.assert_close(adv[i], torch.tensor(e_adv, dtype=F32), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ whitening


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_is_population_variance(shift_mean: bool) -> None:
    values, mask, *_ = random_multiturn_batch(5)
    x = 3.0 * values + 1.5
    got = masked_whiten(x, mask, shift_mean=shift_mean)
    flat_x, flat_m = x.flatten().tolist(), mask.flatten().tolist()
    expected = torch.tensor(ref_whiten(flat_x, flat_m, unbiased=False, shift_mean=shift_mean), dtype=F64).view_as(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # verl's masked_whiten divides by n - 1 (masked_var's default unbiased=True): a different convention.
    verl_like = torch.tensor(ref_whiten(flat_x, flat_m, unbiased=True, shift_mean=shift_mean), dtype=F64).view_as(x)
    assert not torch.allclose(got, verl_like, rtol=0, atol=1e-6)
