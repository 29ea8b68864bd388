"""Span-ratio policy losses (GSPO, turn-level PPO) against their reference formulas (the span objective for an
advantage constant over each span; GSPO-token, eq. 13-14 and verl's form, for per-token advantages), and the turn ids
of the trajectory contract they read (datum -> micro-batch -> PolicyLossInput). Gradient exactness under
micro-batching and ranks: tests/test_gradient_equivalence.py."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from conftest import make_trajectory, rel_err
from trl_plugins.algos import GSPOLoss, PPOClipLoss, TurnPPOLoss, aggregate, span_ratio_loss
from trl_plugins.contracts import check_policy_loss_contract
from trl_plugins.contracts.algos import turns_of
from trl_plugins.datum import build_datum, build_datums, collate, dummy_micro_batch
from trl_plugins.registry import POLICY_LOSSES
from trl_plugins.types import PolicyLossInput, TokenSource


def _batch(seed: int, *, rows: int = 4, width: int = 24):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) < 0.7).float()
    mask[:, 0] = 1
    logp = (-torch.rand(rows, width, generator=g) * 2).requires_grad_(True)
    behaviour = logp.detach() + 0.15 * torch.randn(rows, width, generator=g)
    adv = torch.randn(rows, 1, generator=g).expand(rows, width) * mask  # outcome advantages: one per row
    adv = adv + 0.3 * torch.randn(rows, width, generator=g) * mask * (seed % 2)  # odd seeds: per-token advantages
    return logp, behaviour, adv, mask, turns_of(mask)


def _reference(logp, behaviour, adv, mask, spans, *, normalize, clip_low, clip_high):
    """The span form written out span by span: sum over spans of mean_t -min(r A_t, clip(r) A_t), r carrying the
    gradient of every token of its span. It is the objective when the advantage is constant over each span; for
    advantages that vary within a span its gradient averages them away (the code before GSPO-token)."""
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for k in sorted({int(x) for x, m in zip(spans[b], mask[b]) if m}):
            idx = [t for t in range(logp.shape[1]) if mask[b, t] and spans[b, t] == k]
            delta = torch.stack([logp[b, t] - behaviour[b, t] for t in idx])
            r = torch.exp(delta.mean() if normalize else delta.sum())
            terms = [-torch.minimum(r * adv[b, t], r.clamp(1 - clip_low, 1 + clip_high) * adv[b, t]) for t in idx]
            total = total + torch.stack(terms).mean()
    return total


def _gspo_token_reference(logp, behaviour, adv, mask, spans, *, clip_low, clip_high):
    """GSPO-token (Zheng et al. 2025, eq. 13; verl's compute_policy_loss_gspo) on each span of a length-normalised
    ratio: s_t = sg[s] * pi_t / sg[pi_t], the token's loss max(-A_t s_t, -A_t clip(s_t)), mean over the span's tokens,
    summed over spans."""
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for k in sorted({int(x) for x, m in zip(spans[b], mask[b]) if m}):
            idx = [t for t in range(logp.shape[1]) if mask[b, t] and spans[b, t] == k]
            log_s = torch.stack([logp[b, t] - behaviour[b, t] for t in idx]).mean().detach()
            terms = []
            for t in idx:
                s_t = torch.exp(log_s + logp[b, t] - logp[b, t].detach())
                a = adv[b, t]
                terms.append(torch.maximum(-a * s_t, -a * s_t.clamp(1 - clip_low, 1 + clip_high)))
            total = total + torch.stack(terms).mean()
    return total


def _token_gradient(logp, behaviour, adv, mask, spans, *, normalize, clip_low, clip_high):
    """GSPO-token's gradient written out (eq. 14): d/d log pi_t = -A_t r_k w_t on a token whose clip does not bind
    (A_t > 0 and r_k > 1 + clip_high, or A_t < 0 and r_k < 1 - clip_low, cut it), w_t = d log r_k / d log pi_t
    (1/|k| for the mean, 1 for the sum). For an advantage constant over the span it sums to -A_k grad r_k."""
    grad = torch.zeros_like(logp)
    for b in range(logp.shape[0]):
        for k in sorted({int(x) for x, m in zip(spans[b], mask[b]) if m}):
            idx = [t for t in range(logp.shape[1]) if mask[b, t] and spans[b, t] == k]
            delta = sum(float(logp[b, t].detach() - behaviour[b, t]) for t in idx)
            r = math.exp(delta / len(idx) if normalize else delta)
            w = 1 / len(idx) if normalize else 1.0
            for t in idx:
                a = float(adv[b, t])
                cut = (a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low)
                grad[b, t] = 0.0 if cut else -a * r * w
    return grad


def _grad(value, logp):
    return torch.autograd.grad(value, logp)[0]


@pytest.mark.parametrize("seed", [0, 2])
@pytest.mark.parametrize("normalize,clip", [(False, (0.2, 0.28)), (True, (0.02, 0.03))])
def test_an_advantage_constant_over_each_span_gives_the_span_objective(seed, normalize, clip):
    # Outcome advantages (one per row): the per-token form is the span objective -min(r A, clip(r) A) exactly.
    logp, behaviour, adv, mask, turns = _batch(seed)
    kw = dict(normalize=normalize, clip_low=clip[0], clip_high=clip[1])
    out = span_ratio_loss(logp, behaviour, adv, mask, turns, **kw)
    g_out = _grad(out.per_token_loss.sum(), logp)
    ref = _reference(logp, behaviour, adv, mask, turns, **kw)
    torch.testing.assert_close(out.per_token_loss.sum(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out, _grad(ref, logp), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_out, _token_gradient(logp, behaviour, adv, mask, turns, **kw), rtol=1e-5, atol=1e-7)
    assert (
        float(g_out[mask == 0].abs().max()) == 0.0 and float(out.per_token_loss.detach()[mask == 0].abs().max()) == 0.0
    )
    assert 0 < float(out.stats.clipped_low + out.stats.clipped_high) < float(out.stats.num_tokens)  # both branches used


@pytest.mark.parametrize("seed", [1, 3])
@pytest.mark.parametrize("normalize,clip", [(False, (0.2, 0.28)), (True, (0.02, 0.03))])
def test_per_token_advantages_keep_their_own_gradient_gspo_token(seed, normalize, clip):
    # Advantages that vary within a turn (turn_group under gspo, gae): each token's gradient is its own advantage
    # times its own score, weighted by its span's ratio (GSPO-token), not the span's mean advantage.
    logp, behaviour, adv, mask, turns = _batch(seed)
    kw = dict(normalize=normalize, clip_low=clip[0], clip_high=clip[1])
    out = span_ratio_loss(logp, behaviour, adv, mask, turns, **kw)
    g_out = _grad(out.per_token_loss.sum(), logp)
    torch.testing.assert_close(g_out, _token_gradient(logp, behaviour, adv, mask, turns, **kw), rtol=1e-5, atol=1e-7)
    if normalize:
        verl = _gspo_token_reference(logp, behaviour, adv, mask, turns, clip_low=clip[0], clip_high=clip[1])
        torch.testing.assert_close(out.per_token_loss.sum(), verl, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_out, _grad(verl, logp), rtol=1e-5, atol=1e-7)
    # The value is the span form's (s_t equals r_k); its gradient is not: the negative control the checks could fail.
    span = _reference(logp, behaviour, adv, mask, turns, **kw)
    torch.testing.assert_close(out.per_token_loss.sum(), span, rtol=1e-5, atol=1e-6)
    assert rel_err(_grad(span, logp), g_out) > 0.1  # 0.17-0.31 on these batches
    assert 0 < float(out.stats.clipped_low + out.stats.clipped_high) < float(out.stats.num_tokens)


@pytest.mark.parametrize("normalize", [True, False])
def test_a_clipped_span_cuts_the_gradient_of_its_tokens_by_their_own_advantages_sign(normalize):
    # One span of 3 tokens, each log-ratio 0.1, clip [0.8, 1.05]. Mean: r = e^0.1 = 1.10517; sum: r = e^0.3 = 1.34986;
    # both above 1.05. A = [1, -1, 2]: tokens 0 and 2 (A > 0) are clipped (loss -A * 1.05 / 3, no gradient), token 1
    # (A < 0) is not: loss r / 3, gradient r * w_t = r / 3 (mean) or r (sum: s_t = sg[r] (pi_t / sg[pi_t])^3, / 3).
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    behaviour = logp.detach() - 0.1
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    out = span_ratio_loss(
        logp,
        behaviour,
        adv,
        mask,
        torch.zeros(1, 3, dtype=torch.long),
        normalize=normalize,
        clip_low=0.2,
        clip_high=0.05,
    )
    r = math.exp(0.1 if normalize else 0.3)
    torch.testing.assert_close(out.per_token_loss.detach(), torch.tensor([[-1.05 / 3, r / 3, -2.1 / 3]]))
    grad = _grad(out.per_token_loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, r / 3 if normalize else r, 0.0]]))
    # The span form gave every token r/3 * w: 0.1228 (mean) or 0.4500 (sum), the wrong sign's push included.
    assert float(out.stats.clipped_high) == 2.0 and float(out.stats.clipped_low) == 0.0


def test_one_token_turns_give_ppo_clip_exactly():
    # A turn of one token: its span ratio is the token ratio (sum or mean), so turn_ppo is PPO's token clip.
    logp, behaviour, adv, mask, _ = _batch(5)
    spans = torch.arange(mask.shape[1]).expand_as(mask).clone()
    for normalize in (False, True):
        ppo = PPOClipLoss()(
            PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask)
        )
        turn = span_ratio_loss(logp, behaviour, adv, mask, spans, normalize=normalize, clip_low=0.2, clip_high=0.28)
        torch.testing.assert_close(turn.per_token_loss, ppo.per_token_loss)
        g_turn, g_ppo = (torch.autograd.grad(x.per_token_loss.sum(), logp)[0] for x in (turn, ppo))
        torch.testing.assert_close(g_turn, g_ppo)


def test_gspo_is_the_papers_sequence_objective_under_seq_mean_token_sum():
    # J = mean_i -min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i), s_i = exp(mean_t log(pi / pi_old)) over the response.
    logp, behaviour, adv, mask, _ = _batch(2)
    behaviour = logp.detach() + 0.0005 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9))
    loss = GSPOLoss()
    out = loss(PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask))
    value = aggregate(
        out.per_token_loss,
        mask,
        "seq_mean_token_sum",
        num_tokens=float(mask.sum()),
        num_sequences=float(mask.shape[0]),
        norm_length=1,
        dp_size=1,
    )
    terms = []
    for b in range(mask.shape[0]):
        on = mask[b].bool()
        s = torch.exp((logp[b][on] - behaviour[b][on]).mean())
        a = adv[b][on][0]
        terms.append(-torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a))
    paper = torch.stack(terms).mean()
    torch.testing.assert_close(value, paper)
    torch.testing.assert_close(torch.autograd.grad(value, logp)[0], torch.autograd.grad(paper, logp)[0])
    # An unclipped sequence's gradient is s_i A_i times the MEAN of its tokens' score functions (not their sum).
    s = out.stats
    assert float(s.clipped_low + s.clipped_high) < float(s.num_tokens)


def test_gspo_with_per_token_advantages_is_gspo_token_under_seq_mean_token_sum():
    # GSPO-token (eq. 13): J = mean_i (1/|y_i|) sum_t max(-A_t s_t, -A_t clip(s_t)), s_t = sg[s_i] pi_t / sg[pi_t], in
    # verl's seq-mean-token-mean aggregation: our seq_mean_token_sum of the per-token matrix (each token / |y_i|).
    logp, behaviour, adv, mask, _ = _batch(3)
    behaviour = logp.detach() + 0.002 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(9))
    out = GSPOLoss()(PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask))
    value = aggregate(
        out.per_token_loss,
        mask,
        "seq_mean_token_sum",
        num_tokens=float(mask.sum()),
        num_sequences=float(mask.shape[0]),
        norm_length=1,
        dp_size=1,
    )
    terms = []
    for b in range(mask.shape[0]):
        on = mask[b].bool()
        log_s = (logp[b][on] - behaviour[b][on]).mean().detach()
        s_t = torch.exp(log_s + logp[b][on] - logp[b][on].detach())
        a = adv[b][on]
        terms.append(torch.maximum(-a * s_t, -a * s_t.clamp(1 - 3e-4, 1 + 4e-4)).mean())
    paper = torch.stack(terms).mean()
    torch.testing.assert_close(value, paper)
    torch.testing.assert_close(_grad(value, logp), _grad(paper, logp))
    s = out.stats
    assert 0 < float(s.clipped_low + s.clipped_high) < float(s.num_tokens)


def test_summed_and_normalised_turn_ratios_are_different_objectives():
    logp, behaviour, adv, mask, turns = _batch(4)
    inp = PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask, turn_ids=turns)
    summed = TurnPPOLoss(clip_low=0.2, clip_high=0.28)(inp).per_token_loss
    mean = TurnPPOLoss(normalize=True, clip_low=0.2, clip_high=0.28)(inp).per_token_loss
    assert not torch.allclose(summed, mean)


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match="turn_ppo needs 0 <= clip_low < 1"):
        TurnPPOLoss(clip_low=1.5)
    with pytest.raises(ValueError, match="gspo needs 0 <= clip_low < 1"):
        GSPOLoss(clip_high=-1)
    logp, behaviour, adv, mask, turns = _batch(0)
    with pytest.raises(ValueError, match="turn_ppo needs PolicyLossInput.turn_ids"):
        TurnPPOLoss()(PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask))
    bad = turns.clone()
    bad[mask.bool()] = -1
    with pytest.raises(ValueError, match="no span"):
        span_ratio_loss(logp, behaviour, adv, mask, bad, normalize=False, clip_low=0.2, clip_high=0.28)


def test_registered_with_their_contracts_and_declarations():
    from trl_plugins.protocols import as_policy_loss

    assert POLICY_LOSSES.get("gspo") is GSPOLoss and POLICY_LOSSES.get("turn_ppo") is TurnPPOLoss
    for name, kwargs in (("gspo", None), ("turn_ppo", None), ("turn_ppo", {"normalize": True})):
        check_policy_loss_contract(name, kwargs)
    assert as_policy_loss(TurnPPOLoss()).needs_turn_ids and not as_policy_loss(GSPOLoss()).needs_turn_ids
    assert not as_policy_loss(PPOClipLoss()).needs_turn_ids  # optional declaration, default False


def test_datums_carry_each_action_tokens_turn_and_micro_batches_collate_them():
    rng = random.Random(3)
    traj = make_trajectory(rng, num_turns=3, advantage=1.0)
    d = build_datum(traj)
    assert len(d.turn_ids) == d.num_tokens
    for t, (turn, m) in enumerate(zip(d.turn_ids, d.action_mask)):
        assert (turn >= 0) == bool(m)
    # Positions of turn i are exactly the targets of turn i's completion, in order.
    starts = [len(traj.turns[i].prompt_ids) - 1 for i in range(3)]
    for i, turn in enumerate(traj.turns):
        span = [t for t, k in enumerate(d.turn_ids) if k == i]
        assert span == list(range(starts[i], starts[i] + len(turn.completion_ids)))
        assert [d.target_ids[t] for t in span] == turn.completion_ids
    other = build_datum(make_trajectory(rng, num_turns=1, advantage=-1.0))
    mb = collate([d, other], [0, 1], pad_token_id=0)
    assert mb.turn_ids.shape == mb.action_mask.shape
    assert mb.turn_ids[1, other.num_tokens :].eq(-1).all() and mb.turn_ids[0, : d.num_tokens].tolist() == d.turn_ids
    assert (mb.turn_ids >= 0).eq(mb.action_mask.bool()).all()
    assert dummy_micro_batch(pad_token_id=0).turn_ids.eq(-1).all()
    # A datum built by hand without turn ids: its micro-batch carries none (a loss that needs them refuses it).
    bare = copy.deepcopy(other)
    bare.turn_ids = None
    assert collate([d, bare], [0, 1], pad_token_id=0).turn_ids is None


def test_a_split_trajectory_keeps_its_turn_numbers_in_each_datum():
    rng = random.Random(8)
    traj = make_trajectory(rng, num_turns=3, advantage=0.5)
    traj.turns[2].prompt_ids = [7] + traj.turns[2].prompt_ids[1:]  # the history was rewritten before turn 2
    traj.turns[2].prompt_sources = None  # a new datum: its whole prompt is context
    first, second = build_datums(traj, on_prefix_mismatch="split")
    assert {k for k in first.turn_ids if k >= 0} == {0, 1} and {k for k in second.turn_ids if k >= 0} == {2}
    assert all(s == TokenSource.ACTION for s, k in zip(second.sources, second.turn_ids) if k >= 0)


def test_the_update_refuses_a_turn_loss_on_datums_without_turn_ids():
    from trl_plugins.trainers.update import _turn_ids

    mb = dummy_micro_batch(pad_token_id=0)
    assert _turn_ids(mb, "cpu").eq(-1).all()
    mb.turn_ids = None
    with pytest.raises(ValueError, match="needs turn ids"):
        _turn_ids(mb, "cpu")
