"""GAE over multi-turn datums, global whitening, and the value loss under micro-batching.

Layout (as built by the datum builder): positions are datum positions, right-shifted, so position t
scores target t. ``action_mask`` is 1 on sampled tokens; prompt, tool-observation, template-glue and
padding positions are 0 and the GAE recursion skips them. The outcome reward sits on the last action
position; a truncated row (``bootstrap_mask`` 1) bootstraps from ``bootstrap_values``, a terminated
one from 0. Everything is float64 so that equivalences can be asserted to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from trl_plugins.algos import (
    aggregate,
    clipped_value_loss,
    gae_advantages,
    local_denominators,
    masked_whiten,
)
from trl_plugins.registry import ADVANTAGES
from trl_plugins.types import AdvantageInput

F64 = torch.float64
TOL = 1e-12


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def assert_close(got: torch.Tensor, expected, tol: float = TOL) -> None:
    torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), atol=tol, rtol=0.0)


# ------------------------------------------------------------------ hand-worked multi-turn batch

GAMMA, LAM = 0.9, 0.8  # gamma * lam = 0.72
X = 99.0  # a value at a masked position: must never be read

# pos:               0  1  2    3    4  5  6  7    8    9  10   11
#   (a) terminated:  p  p  act  act  o  o  o  act  act  .  .    .     (o = tool output + glue, . = pad)
#   (b) truncated:   p  p  p    p    p  p  act act  o   o  act  act   (cut at the length cap)
#   (c) = (b), but terminated
MASK = t64(
    [
        [0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1],
    ]
)
VALUES = t64(
    [
        [X, X, 0.2, 0.4, X, X, X, 0.5, 0.6, X, X, X],
        [X, X, X, X, X, X, 0.3, 0.1, X, X, 0.4, 0.5],
        [X, X, X, X, X, X, 0.3, 0.1, X, X, 0.4, 0.5],
    ]
)
REWARDS = t64([1.0, 0.0, 0.0])
BOOTSTRAP_MASK = t64([0.0, 1.0, 0.0])
BOOTSTRAP_VALUES = t64([0.7, 0.7, 0.7])  # read on row (b) only

# Row (a), terminated, reward 1 on position 8 (its last action position):
#   t=8: delta8 = 1 + 0.9 * 0   - 0.6 = 0.4                       A8 = 0.4
#   t=7: delta7 = 0 + 0.9 * 0.6 - 0.5 = 0.04                      A7 = 0.04 + 0.72 * 0.4     = 0.328
#   t=6, 5, 4: tool output + glue, skipped: next value V7 = 0.5 and running A7 = 0.328 carried over
#   t=3: delta3 = 0 + 0.9 * 0.5 - 0.4 = 0.05                      A3 = 0.05 + 0.72 * 0.328   = 0.28616
#   t=2: delta2 = 0 + 0.9 * 0.4 - 0.2 = 0.16                      A2 = 0.16 + 0.72 * 0.28616 = 0.3660352
#   The state before the tool call (t=3) bootstraps from V7, the first action AFTER the observation,
#   with one gamma and one gamma*lam. Decaying through the three observation positions as if they were
#   steps would give delta3' = 0.9^4 * 0.5 - 0.4 = -0.07195, A3' = -0.07195 + 0.72^4 * 0.328
#   = 0.0161962477 instead.
# Row (b), truncated, reward 0, bootstraps from 0.7 after position 11:
#   t=11: delta11 = 0 + 0.9 * 0.7 - 0.5 = 0.13                   A11 = 0.13
#   t=10: delta10 = 0 + 0.9 * 0.5 - 0.4 = 0.05                   A10 = 0.05 + 0.72 * 0.13     = 0.1436
#   t=9, 8: skipped (next value V10 = 0.4, running 0.1436)
#   t=7:  delta7  = 0 + 0.9 * 0.4 - 0.1 = 0.26                   A7  = 0.26 + 0.72 * 0.1436   = 0.363392
#   t=6:  delta6  = 0 + 0.9 * 0.1 - 0.3 = -0.21                  A6  = -0.21 + 0.72 * 0.363392 = 0.05164224
# Row (c), terminated, same values:
#   t=11: delta11 = 0 + 0.9 * 0   - 0.5 = -0.5                   A11 = -0.5
#   t=10: delta10 = 0.05                                         A10 = 0.05 + 0.72 * -0.5     = -0.31
#   t=7:  delta7  = 0.26                                         A7  = 0.26 + 0.72 * -0.31    = 0.0368
#   t=6:  delta6  = -0.21                                        A6  = -0.21 + 0.72 * 0.0368  = -0.183504
#   (b) - (c) is the bootstrap term gamma * 0.7 = 0.63 carried back one gamma*lam per action step:
#   0.63, 0.63 * 0.72 = 0.4536, 0.63 * 0.72^2 = 0.326592, 0.63 * 0.72^3 = 0.23514624.
ADV = t64(
    [
        [0, 0, 0.3660352, 0.28616, 0, 0, 0, 0.328, 0.4, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0.05164224, 0.363392, 0, 0, 0.1436, 0.13],
        [0, 0, 0, 0, 0, 0, -0.183504, 0.0368, 0, 0, -0.31, -0.5],
    ]
)
# returns = A + V on action positions, 0 elsewhere.
RET = t64(
    [
        [0, 0, 0.5660352, 0.68616, 0, 0, 0, 0.828, 1.0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0.35164224, 0.463392, 0, 0, 0.5436, 0.63],
        [0, 0, 0, 0, 0, 0, 0.116496, 0.1368, 0, 0, 0.09, 0.0],
    ]
)


def _hand_worked(values=VALUES, bootstrap_values=BOOTSTRAP_VALUES, **kw):
    return gae_advantages(
        values,
        MASK,
        REWARDS,
        gamma=GAMMA,
        lam=LAM,
        bootstrap_mask=BOOTSTRAP_MASK,
        bootstrap_values=bootstrap_values,
        **kw,
    )


def test_gae_hand_worked_multi_turn_batch():
    adv, ret = _hand_worked()
    assert_close(adv, ADV)
    assert_close(ret, RET)


def test_gae_skips_the_observation_span_with_one_gamma_lambda():
    """Position 3 (before the tool call) is one MDP step from position 7 (after the tool output)."""
    adv, _ = _hand_worked()
    gl = GAMMA * LAM
    assert_close(adv[0, 3], (GAMMA * VALUES[0, 7] - VALUES[0, 3]) + gl * adv[0, 7])
    decayed = (GAMMA**4 * VALUES[0, 7] - VALUES[0, 3]) + gl**4 * adv[0, 7]  # the wrong recursion
    assert_close(decayed, 0.0161962477, tol=1e-9)
    assert (adv[0, 3] - decayed).abs() > 0.25


def test_gae_bootstrap_term_propagates_back_through_the_truncated_row():
    """(b) - (c) = gamma * V_boot * (gamma*lam)^k at the action k steps before the end, 0 elsewhere."""
    adv, ret = _hand_worked()
    gl = GAMMA * LAM
    boot = GAMMA * 0.7
    expected = t64([0, 0, 0, 0, 0, 0, boot * gl**3, boot * gl**2, 0, 0, boot * gl, boot])
    assert_close(adv[1] - adv[2], expected)
    assert_close(ret[1] - ret[2], expected)  # same values, so the returns differ by the same amount


def test_gae_ignores_values_at_masked_positions_and_bootstrap_values_of_terminated_rows():
    adv, ret = _hand_worked()
    on = MASK.bool()
    other_values = torch.where(on, VALUES, t64(-123.0))
    other_values[0, 4:7] = t64([1e6, -1e6, 3.0])  # the observation span of row (a)
    adv2, ret2 = _hand_worked(values=other_values, bootstrap_values=t64([5.0, 0.7, -5.0]))
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    # Negative control: a value on an action position does change the result.
    moved = VALUES.clone()
    moved[0, 7] += 0.1
    assert not torch.allclose(_hand_worked(values=moved)[0], adv)


def test_gae_non_finite_values_at_masked_positions_do_not_leak():
    """Returns are 0 off the mask even when a masked value is inf/nan (0 * inf would be nan)."""
    values = torch.where(MASK.bool(), VALUES, t64(float("nan")))
    values[0, 0] = float("inf")
    adv, ret = _hand_worked(values=values)
    assert_close(adv, ADV)
    assert_close(ret, RET)


def test_gae_non_finite_bootstrap_value_of_terminated_row_is_ignored():
    """A terminated row's bootstrap value is never read, whatever it holds."""
    adv, ret = _hand_worked(bootstrap_values=t64([float("nan"), 0.7, float("inf")]))
    assert_close(adv, ADV)
    assert_close(ret, RET)


def test_gae_token_rewards_enter_the_deltas_on_action_positions_only():
    """Per-token -beta * KL (beta 0.1) on row (a); garbage token rewards at masked positions are ignored."""
    # KL on the action positions 2, 3, 7, 8: 0.5, 1.0, 0.2, 0.3 -> token rewards -0.05, -0.1, -0.02, -0.03.
    kl = t64([[X, X, 0.5, 1.0, X, X, X, 0.2, 0.3, X, X, X]])
    token_rewards = -0.1 * kl  # -9.9 at masked positions
    #   t=8: delta8 = (1 - 0.03) + 0.9 * 0   - 0.6 = 0.37        A8 = 0.37
    #   t=7: delta7 = -0.02      + 0.9 * 0.6 - 0.5 = 0.02        A7 = 0.02 + 0.72 * 0.37     = 0.2864
    #   t=3: delta3 = -0.1       + 0.9 * 0.5 - 0.4 = -0.05       A3 = -0.05 + 0.72 * 0.2864  = 0.156208
    #   t=2: delta2 = -0.05      + 0.9 * 0.4 - 0.2 = 0.11        A2 = 0.11 + 0.72 * 0.156208 = 0.22246976
    expected = t64([[0, 0, 0.22246976, 0.156208, 0, 0, 0, 0.2864, 0.37, 0, 0, 0]])
    args = (VALUES[:1], MASK[:1], REWARDS[:1])
    adv, ret = gae_advantages(*args, gamma=GAMMA, lam=LAM, token_rewards=token_rewards)
    assert_close(adv, expected)
    assert_close(ret, (expected + VALUES[:1]) * MASK[:1])
    other = torch.where(MASK[:1].bool(), token_rewards, t64(7.0))
    adv2, ret2 = gae_advantages(*args, gamma=GAMMA, lam=LAM, token_rewards=other)
    assert torch.equal(adv2, adv) and torch.equal(ret2, ret)
    # Zero token rewards give the plain row (a) back.
    adv0, _ = gae_advantages(*args, gamma=GAMMA, lam=LAM, token_rewards=torch.zeros_like(kl))
    assert_close(adv0, ADV[:1])


# ------------------------------------------------------------------ brute-force reference


def _reference_gae(values, mask, rewards, gamma, lam, bootstrap_mask, bootstrap_values, token_rewards):
    """Textbook GAE on each row's compacted list of action positions, in Python floats, scattered back."""
    adv = torch.zeros_like(values)
    for i in range(values.shape[0]):
        pos = [t for t in range(values.shape[1]) if mask[i, t] == 1]
        if not pos:
            continue
        v = [float(values[i, t]) for t in pos]
        r = [float(token_rewards[i, t]) for t in pos]
        r[-1] += float(rewards[i])
        v_next = v[1:] + [float(bootstrap_values[i]) if bootstrap_mask[i] == 1 else 0.0]
        running = 0.0
        for k in reversed(range(len(pos))):
            running = r[k] + gamma * v_next[k] - v[k] + gamma * lam * running
            adv[i, pos[k]] = running
    return adv, (adv + values) * mask


def _random_multi_turn_batch(g: torch.Generator, n_rows: int):
    """Rows of random widths: prompt, 1-3 turns of (actions, observation span), then padding."""
    rows = []
    for _ in range(n_rows):
        row = [0] * int(torch.randint(0, 4, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.1:
            row += [0] * 3  # a row without any action token (e.g. a failed rollout)
        else:
            for turn in range(int(torch.randint(1, 4, (1,), generator=g))):
                if turn:
                    row += [0] * int(torch.randint(0, 4, (1,), generator=g))
                row += [1] * int(torch.randint(1, 5, (1,), generator=g))
        rows.append(row)
    width = max(len(r) for r in rows) + 2
    mask = t64([r + [0] * (width - len(r)) for r in rows])
    return (
        mask,
        torch.randn(n_rows, width, generator=g, dtype=F64),  # values, garbage off-mask too
        torch.randn(n_rows, generator=g, dtype=F64),  # outcome rewards
        (torch.rand(n_rows, generator=g) < 0.5).to(F64),  # bootstrap_mask
        torch.randn(n_rows, generator=g, dtype=F64),  # bootstrap_values
        0.1 * torch.randn(n_rows, width, generator=g, dtype=F64),  # token_rewards
    )


def test_gae_matches_a_brute_force_reference_on_random_multi_turn_rows():
    g = torch.Generator().manual_seed(1234)
    for trial in range(6):
        mask, values, rewards, boot_mask, boot_values, token_rewards = _random_multi_turn_batch(g, 20)
        if trial == 0:
            gamma, lam = 1.0, 1.0
        else:
            gamma, lam = (1.0 - torch.rand(2, generator=g, dtype=F64)).tolist()  # in (0, 1]
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
        ref_adv, ref_ret = _reference_gae(values, mask, rewards, gamma, lam, boot_mask, boot_values, token_rewards)
        assert_close(adv, ref_adv)
        assert_close(ret, ref_ret)


# ------------------------------------------------------------------ global whitening across ranks


def _run_ranks_in_lockstep(fn, shards):
    """Run ``fn(shard, all_reduce)`` once per simulated rank with an ``all_reduce`` that sums over ranks.

    Replays the ranks until every all_reduce call has its global answer: on a pass, call k returns the
    already-known sum of call k over ranks (or, for the first unknown call, records this rank's tensor
    and returns it unreduced). Each pass makes one more call exact, as a real collective would.
    """
    known: list[torch.Tensor] = []
    while True:
        sent: list[list[torch.Tensor]] = []
        outputs = []
        for shard in shards:
            calls: list[torch.Tensor] = []

            def all_reduce(t: torch.Tensor, calls=calls) -> torch.Tensor:
                calls.append(t.detach().clone())
                k = len(calls) - 1
                return known[k].clone() if k < len(known) else t

            outputs.append(fn(shard, all_reduce))
            sent.append(calls)
        n_calls = {len(c) for c in sent}
        assert len(n_calls) == 1, f"ranks made different numbers of all_reduce calls: {n_calls}"
        if len(known) == n_calls.pop():
            return outputs
        k = len(known)
        assert len({tuple(c[k].shape) for c in sent}) == 1, "ranks all_reduce tensors of different shapes"
        known.append(torch.stack([c[k] for c in sent]).sum(dim=0))


# Row splits over simulated ranks: even, uneven, and one where a rank's only row has no action token.
RANK_SPLITS = [
    [range(4), range(4, 8)],
    [range(1), range(1, 6), range(6, 8)],
    [range(4), range(4, 7), range(7, 8)],
]


def _whitening_batch():
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(8, 9, generator=g) < 0.6).to(F64)
    mask[7] = 0  # a row with nothing to train on
    mask[0, 0] = 1
    # Ranks get rows of different distributions, so per-rank statistics are visibly wrong.
    x = torch.randn(8, 9, generator=g, dtype=F64) * torch.linspace(0.5, 3.0, 8, dtype=F64)[:, None]
    x = x + torch.linspace(-2.0, 2.0, 8, dtype=F64)[:, None]
    x = torch.where(mask.bool(), x, t64(50.0))  # finite garbage off-mask: ignored
    return x, mask


@pytest.mark.parametrize("split", RANK_SPLITS, ids=["2-even", "3-uneven", "3-one-empty"])
def test_masked_whiten_with_all_reduce_equals_whitening_the_whole_batch(split):
    x, mask = _whitening_batch()
    whole = masked_whiten(x, mask)
    on = mask.bool()
    assert_close(whole[on].mean(), 0.0)
    assert_close(whole[on].pow(2).mean(), 1.0, tol=1e-7)  # eps = 1e-8 in the variance
    shards = [(x[list(rows)], mask[list(rows)]) for rows in split]
    per_rank = _run_ranks_in_lockstep(lambda s, ar: masked_whiten(s[0], s[1], all_reduce=ar), shards)
    assert_close(torch.cat(per_rank), whole)
    # Negative control: each rank whitening with its own statistics gives other numbers.
    local = torch.cat([masked_whiten(xs, ms) for xs, ms in shards])
    assert (local - whole).abs().max() > 0.1


def test_gae_plugin_whitens_with_global_statistics_across_ranks():
    g = torch.Generator().manual_seed(11)
    mask, values, rewards, boot_mask, boot_values, _ = _random_multi_turn_batch(g, 9)
    est = ADVANTAGES.get("gae")(gamma=0.95, lam=0.9, whiten=True)

    def inp(rows, all_reduce=None):
        rows = list(rows)
        return AdvantageInput(
            rewards=rewards[rows],
            group_ids=torch.arange(len(rows)),
            action_mask=mask[rows],
            values=values[rows],
            bootstrap_mask=boot_mask[rows],
            bootstrap_values=boot_values[rows],
            all_reduce=all_reduce,
        )

    whole = est(inp(range(9)))
    split = [range(2), range(2, 9)]
    per_rank = _run_ranks_in_lockstep(lambda rows, ar: est(inp(rows, ar)), split)
    assert_close(torch.cat([o.advantages for o in per_rank]), whole.advantages)
    assert_close(torch.cat([o.returns for o in per_rank]), whole.returns)
    local = torch.cat([est(inp(rows)).advantages for rows in split])
    assert (local - whole.advantages).abs().max() > 1e-3  # negative control


# ------------------------------------------------------------------ value loss under micro-batching


def _value_loss_batch():
    g = torch.Generator().manual_seed(3)
    n, width = 7, 10
    mask = (torch.rand(n, width, generator=g) < 0.5).to(F64)
    mask[:, 0] = 0  # prompt
    mask[0, 1:] = 1  # rows with very different token counts, so the weighting matters
    mask[1, 2:] = 0
    mask[1, 1] = 1
    on = mask.bool()
    values = torch.randn(n, width, generator=g, dtype=F64)
    # Old values up to +-0.5 away, so some tokens sit outside the 0.2 clip range and some inside.
    old_values = values + 0.5 * (2 * torch.rand(n, width, generator=g, dtype=F64) - 1)
    returns = torch.randn(n, width, generator=g, dtype=F64)
    # Non-finite garbage off-mask must not reach the loss or its gradient.
    old_values = torch.where(on, old_values, t64(float("inf")))
    returns = torch.where(on, returns, t64(float("nan")))
    return values, old_values, returns, mask


def _value_grad(split, *, local_mean: bool = False):
    values, old_values, returns, mask = _value_loss_batch()
    leaf = values.clone().requires_grad_(True)
    micro = [list(rows) for rows in split]
    counts = [local_denominators(mask[rows]) for rows in micro]
    n_tok = sum(c[0] for c in counts)
    n_seq = sum(c[1] for c in counts)
    total = torch.zeros((), dtype=F64)
    clipped = 0.0
    for rows, (tok, seq) in zip(micro, counts):
        out = clipped_value_loss(leaf[rows], old_values[rows], returns[rows], mask[rows], clip_range=0.2)
        clipped += float(out.clipped)
        if local_mean:  # "mean over the micro-batch, then average the micro-batches"
            share = aggregate(out.per_token_loss, mask[rows], "token_mean", num_tokens=tok, num_sequences=seq)
            total = total + share / len(micro)
        else:
            total = total + aggregate(
                out.per_token_loss, mask[rows], "token_mean", num_tokens=n_tok, num_sequences=n_seq
            )
    (grad,) = torch.autograd.grad(total, leaf)
    return grad, clipped, mask


VALUE_SPLITS = {
    "halves": [range(3), range(3, 7)],
    "uneven": [range(1), range(1, 2), range(2, 7)],
    "shuffled": [[5, 1], [0, 6, 3], [2, 4]],
}


@pytest.mark.parametrize("name", list(VALUE_SPLITS))
def test_value_loss_gradient_does_not_depend_on_the_micro_batch_split(name):
    one_batch, clipped, mask = _value_grad([range(7)])
    n_tok = float(mask.sum())
    assert 0 < clipped < n_tok  # both the clipped and the unclipped branch are exercised
    assert torch.isfinite(one_batch).all()
    assert torch.equal(one_batch[~mask.bool()], torch.zeros(int((~mask.bool()).sum()), dtype=F64))
    grad, _, _ = _value_grad(VALUE_SPLITS[name])
    assert_close(grad, one_batch)


def test_value_loss_with_per_micro_batch_denominators_changes_the_gradient():
    """Negative control: dividing each micro-batch by its own token count reweights the tokens."""
    one_batch, _, _ = _value_grad([range(7)])
    local, _, _ = _value_grad(VALUE_SPLITS["uneven"], local_mean=True)
    assert (local - one_batch).abs().max() > 1e-3


# ------------------------------------------------------------------ the gae plugin


def test_gae_plugin_equals_the_function_and_whitens_advantages_not_returns():
    def inp() -> AdvantageInput:
        return AdvantageInput(
            rewards=REWARDS,
            group_ids=torch.arange(3),
            action_mask=MASK,
            values=VALUES,
            bootstrap_mask=BOOTSTRAP_MASK,
            bootstrap_values=BOOTSTRAP_VALUES,
        )

    raw = ADVANTAGES.get("gae")(gamma=GAMMA, lam=LAM, whiten=False)(inp())
    adv, ret = _hand_worked()
    assert torch.equal(raw.advantages, adv) and torch.equal(raw.returns, ret)
    assert_close(raw.advantages, ADV)

    white = ADVANTAGES.get("gae")(gamma=GAMMA, lam=LAM, whiten=True)(inp())
    on = MASK.bool()
    a = white.advantages[on]
    assert_close(a.mean(), 0.0)
    assert_close(a.var(unbiased=False), 1.0, tol=1e-6)  # eps = 1e-8 against a variance of ~0.05
    assert torch.equal(white.advantages[~on], torch.zeros(int((~on).sum()), dtype=F64))
    # Exactly the raw advantages whitened over the action positions of the batch.
    assert_close(white.advantages, masked_whiten(adv, MASK))
    # Returns are the raw value targets, not whitened advantages + values.
    assert torch.equal(white.returns, ret)
    assert_close(white.returns, RET)
    assert not torch.allclose(white.returns, (white.advantages + VALUES) * MASK)


# ------------------------------------------------------------------ truncated trajectories under a critic


@pytest.mark.parametrize("policy", ["wrong", "bootstrap"])
def test_a_truncation_is_counted_once_under_a_critic(policy):
    # Issue 30.2: two identical trajectories, both scored -1 (a wrong answer; a missing one, cut by the budget).
    # 'wrong' (default): the truncation is an outcome, so both returns are -1 (it used to bootstrap on top of the -1,
    # and hitting the budget scored -0.4, above a wrong answer). 'bootstrap': a time limit, so the truncated one's
    # return is the critic's value of where it stopped, and its -1 is not counted.
    import random

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.pipeline.batch import assign_advantages, build_datums_for_update
    from trl_plugins.types import RewardComponent, StopReason

    trajs = [
        make_trajectory(random.Random(3), num_turns=2, stop_reason=reason)
        for reason in (StopReason.FINAL_ANSWER, StopReason.TOKEN_BUDGET)
    ]
    for t in trajs:
        t.reward_components = [RewardComponent(name="correct", value=-1.0, weight=1.0)]
    datums = build_datums_for_update(
        trajs, [None, None], max_context_tokens=None, bootstrap_truncated=policy == "bootstrap"
    )
    assert datums[0].input_ids == datums[1].input_ids  # the same tokens, only the stop reason differs
    for d in datums:
        d.old_values = [0.25] * d.num_tokens
    after = [0.6, 0.6]  # the critic's value of the state after the last token (read where a datum bootstraps)
    gae = ADVANTAGES.get("gae")(gamma=1.0, lam=1.0, whiten=False)
    assign_advantages(gae, trajs, datums, bootstrap_values=after)
    last = max(i for i, m in enumerate(datums[0].action_mask) if m)
    terminated, truncated = (d.returns[last] for d in datums)
    assert terminated == pytest.approx(-1.0)
    if policy == "wrong":
        assert [d.bootstrap_mask for d in datums] == [0, 0]
        assert truncated == pytest.approx(terminated) and datums[1].returns == datums[0].returns
    else:
        assert [d.bootstrap_mask for d in datums] == [0, 1]
        assert truncated == pytest.approx(0.6)  # the bootstrapped value, without the -1
        assert trajs[1].reward == -1.0  # the components are still stored (and logged) as scored
