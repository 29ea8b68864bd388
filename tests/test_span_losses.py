"""Span-ratio policy losses (GSPO, turn-level PPO) against their reference formulas, and the turn ids of the
trajectory contract they read (datum -> micro-batch -> PolicyLossInput). Gradient exactness under micro-batching and
ranks: tests/test_gradient_equivalence.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import make_trajectory
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
    """The span objective written out span by span: sum over spans of mean_t -min(r A_t, clip(r) A_t)."""
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for k in sorted({int(x) for x, m in zip(spans[b], mask[b]) if m}):
            idx = [t for t in range(logp.shape[1]) if mask[b, t] and spans[b, t] == k]
            delta = torch.stack([logp[b, t] - behaviour[b, t] for t in idx])
            r = torch.exp(delta.mean() if normalize else delta.sum())
            terms = [-torch.minimum(r * adv[b, t], r.clamp(1 - clip_low, 1 + clip_high) * adv[b, t]) for t in idx]
            total = total + torch.stack(terms).mean()
    return total


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("normalize,clip", [(False, (0.2, 0.28)), (True, (0.02, 0.03))])
def test_turn_ratio_loss_is_the_span_objective_in_value_and_gradient(seed, normalize, clip):
    logp, behaviour, adv, mask, turns = _batch(seed)
    out = span_ratio_loss(logp, behaviour, adv, mask, turns, normalize=normalize, clip_low=clip[0], clip_high=clip[1])
    (g_out,) = torch.autograd.grad(out.per_token_loss.sum(), logp)
    ref = _reference(logp, behaviour, adv, mask, turns, normalize=normalize, clip_low=clip[0], clip_high=clip[1])
    (g_ref,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(out.per_token_loss.sum(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-7)
    assert float(g_out[mask == 0].abs().max()) == 0.0 and float(out.per_token_loss.detach()[mask == 0].abs().max()) == 0.0
    assert 0 < float(out.stats.clipped_low + out.stats.clipped_high) < float(out.stats.num_tokens)  # both branches used


def test_one_token_turns_give_ppo_clip_exactly():
    # A turn of one token: its span ratio is the token ratio (sum or mean), so turn_ppo is PPO's token clip.
    logp, behaviour, adv, mask, _ = _batch(5)
    spans = torch.arange(mask.shape[1]).expand_as(mask).clone()
    for normalize in (False, True):
        ppo = PPOClipLoss()(PolicyLossInput(logprobs=logp, behaviour_logprobs=behaviour, advantages=adv, action_mask=mask))
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
    value = aggregate(out.per_token_loss, mask, "seq_mean_token_sum", num_tokens=float(mask.sum()),
                      num_sequences=float(mask.shape[0]), norm_length=1, dp_size=1)
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
    assert mb.turn_ids[1, other.num_tokens:].eq(-1).all() and mb.turn_ids[0, : d.num_tokens].tolist() == d.turn_ids
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
