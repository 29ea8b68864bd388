"""The proof: however a batch is packed into micro-batches or split over data-parallel ranks, the
accumulated gradient equals the gradient of the one-batch loss, for every aggregation mode and every
policy loss (the token-level PPO clip, and the span-ratio losses whose ratio combines a whole row or turn).

A tiny 2-layer Qwen2 (built from config) scores a batch of multi-turn datums with varied lengths
and masks; behaviour log-probs sit near the model's own so the PPO clip is active on some tokens.
Negative controls (a per-micro-batch mean, DDP averaging without the ``dp_size`` factor) must fail
the same assertion.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import make_trajectory, rel_err
from trl_plugins import modeling
from trl_plugins.algos import GSPOLoss, PPOClipLoss, TurnPPOLoss, aggregate, local_denominators
from trl_plugins.datum import build_datum, collate
from trl_plugins.packing import pack
from trl_plugins.types import AggregationMode, Datum, MicroBatch, PolicyLossInput

MODES = list(AggregationMode)
TOL = 1e-5
NORM_LENGTH = 64
PAD = 0


def token_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    return modeling.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)


LOSSES = {
    "ppo_clip": PPOClipLoss(clip_low=0.2, clip_high=0.28),
    # Wider than the paper's 3e-4 / 4e-4 so that, with these noisy behaviour log-probs, some sequences clip and some not.
    "gspo": GSPOLoss(clip_low=0.02, clip_high=0.03),
    "turn_ppo": TurnPPOLoss(),
    "turn_ppo_mean": TurnPPOLoss(normalize=True, clip_low=0.02, clip_high=0.03),
}


def micro_batch_loss(model, mb: MicroBatch, mode, *, num_tokens, num_sequences, dp_size=1, loss="ppo_clip"):
    logp = token_logprobs(model, mb)
    out = LOSSES[loss](
        PolicyLossInput(
            logprobs=logp,
            behaviour_logprobs=mb.behaviour_logprobs,
            advantages=mb.advantages,
            action_mask=mb.action_mask,
            turn_ids=mb.turn_ids,
        )
    )
    return aggregate(
        out.per_token_loss,
        mb.action_mask,
        mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=NORM_LENGTH,
        dp_size=dp_size,
    ), out.stats


def naive_micro_batch_loss(model, mb: MicroBatch, mode, *, num_micro_batches):
    # The classic bug: normalise by the micro-batch's own counts, then average over micro-batches.
    n_tok, n_seq = local_denominators(mb.action_mask)
    loss, _ = micro_batch_loss(model, mb, mode, num_tokens=n_tok, num_sequences=n_seq)
    return loss / num_micro_batches


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def global_denominators(datums: list[Datum]) -> tuple[float, float]:
    mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
    n_tok, n_seq = local_denominators(mb.action_mask)
    return float(n_tok), float(n_seq)


def accumulate(
    model, datums, batches, mode, *, dp_size=1, denominators=None, naive=False, loss="ppo_clip"
) -> torch.Tensor:
    """Sum of gradients over the micro-batches ``batches`` (lists of indices into ``datums``)."""
    model.zero_grad(set_to_none=True)
    n_tok, n_seq = denominators or global_denominators(datums)
    for idx in batches:
        mb = collate(datums, idx, pad_token_id=PAD)
        if naive:
            value = naive_micro_batch_loss(model, mb, mode, num_micro_batches=len(batches))
        else:
            value, _ = micro_batch_loss(
                model, mb, mode, num_tokens=n_tok, num_sequences=n_seq, dp_size=dp_size, loss=loss
            )
        value.backward()
    return flat_grad(model).clone()


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    model = tiny_model_factory(torch.float32)
    rng = random.Random(1234)
    trajs = []
    for g in range(4):
        for s in range(4):
            trajs.append(make_trajectory(rng, num_turns=rng.randint(1, 4), group_id=g, sample_index=s))
    datums = [build_datum(t, trajectory_index=i) for i, t in enumerate(trajs)]
    # Behaviour log-probs near the model's own (a slightly different sampler): ratios around 1,
    # some beyond the clip range in both directions.
    with torch.no_grad():
        mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
        logp = token_logprobs(model, mb)
    gen = torch.Generator().manual_seed(0)
    for row, d in enumerate(datums):
        n = d.num_tokens
        noisy = logp[row, :n] + 0.25 * torch.randn(n, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]
    return model, datums


def test_the_batch_is_varied_and_the_clip_is_active(setup):
    model, datums = setup
    lengths = [d.num_tokens for d in datums]
    assert max(lengths) > 2 * min(lengths)
    mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
    n_tok, n_seq = global_denominators(datums)
    _, stats = micro_batch_loss(model, mb, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    s = stats.summary()
    assert s["clip_frac_low"] > 0.02 and s["clip_frac_high"] > 0.02


def _packings(datums):
    lengths = [d.num_tokens for d in datums]
    limits = dict(max_items=4, max_padded_tokens=3 * max(lengths))
    out = {
        "ffd": pack(lengths, strategy="ffd", **limits),
        "optimal": pack(lengths, strategy="optimal", **limits),
    }
    rng = random.Random(99)
    for k in range(3):
        order = list(range(len(datums)))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(order)), 3 + k))
        out[f"random{k}"] = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(order)])]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_packing_does_not_change_the_gradient(setup, mode, loss="ppo_clip"):
    # The span-ratio losses run the same checks in test_gradient_equivalence_spans.py (on the other xdist worker).
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    assert float(reference.abs().max()) > 0
    for name, batches in _packings(datums).items():
        assert len(batches) > 1 and len({len(b) for b in batches}) > 1, f"{name} should split unevenly"
        err = rel_err(accumulate(model, datums, batches, mode, loss=loss), reference)
        assert err < TOL, f"{loss} / {mode} / {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_naive_micro_batch_mean_fails_the_same_check(setup, mode):
    # Negative control: the per-micro-batch mean weights tokens by their micro-batch's size.
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode)
    batches = _packings(datums)["random1"]
    err = rel_err(accumulate(model, datums, batches, mode, naive=True), reference)
    assert err > 100 * TOL, f"{mode}: the naive mean should differ, got {err:.2e}"


def _ddp(model, datums, rank_items, mode, *, dp_size_factor, loss="ppo_clip"):
    # Each rank packs its own datums, accumulates with the *global* denominators, then the
    # gradients are averaged over ranks as DDP's all-reduce does.
    denominators = global_denominators(datums)
    grads = []
    for items in rank_items:
        local = [datums[i] for i in items]
        lengths = [d.num_tokens for d in local]
        batches = pack(lengths, strategy="ffd", max_items=3, max_padded_tokens=2 * max(lengths))
        rank_model = copy.deepcopy(model)
        grads.append(
            accumulate(rank_model, local, batches, mode, dp_size=dp_size_factor, denominators=denominators, loss=loss)
        )
    return torch.stack(grads).mean(dim=0)


@pytest.mark.parametrize("mode", MODES)
def test_two_data_parallel_ranks_match_one_batch(setup, mode, loss="ppo_clip"):
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    rng = random.Random(5)
    order = list(range(len(datums)))
    rng.shuffle(order)
    rank_items = [order[:5], order[5:]]  # unequal: 5 and 11 datums
    err = rel_err(_ddp(model, datums, rank_items, mode, dp_size_factor=2, loss=loss), reference)
    assert err < TOL, f"{loss} / {mode}: 2-rank gradient error {err:.2e}"
    # Negative control: forgetting that DDP averages (dp_size=1) halves the gradient.
    bad = rel_err(_ddp(model, datums, rank_items, mode, dp_size_factor=1, loss=loss), reference)
    assert bad > 0.4


def _perturb_masked(datums: list[Datum], seed: int) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for d in datums:
        d = copy.deepcopy(d)
        for t, m in enumerate(d.action_mask):
            if not m:
                d.behaviour_logprobs[t] = rng.choice([1e6, -1e6, float("inf")])
                d.advantages[t] = rng.uniform(-1e3, 1e3)
                d.target_ids[t] = rng.randrange(3, 200)
        out.append(d)
    return out


def test_values_at_masked_positions_never_change_loss_or_gradient(setup):
    model, datums = setup
    batches = _packings(datums)["random0"]
    perturbed = _perturb_masked(datums, seed=3)
    for loss in LOSSES:
        for mode in MODES:
            g_ref = accumulate(model, datums, batches, mode, loss=loss)
            g_new = accumulate(model, perturbed, batches, mode, loss=loss)
            assert torch.equal(g_ref, g_new), (loss, mode)
    # Padding token ids do not matter either.
    mb = collate(datums, batches[0], pad_token_id=PAD)
    mb_other_pad = collate(datums, batches[0], pad_token_id=7)
    n_tok, n_seq = global_denominators(datums)
    a, _ = micro_batch_loss(model, mb, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    b, _ = micro_batch_loss(model, mb_other_pad, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    assert torch.allclose(a, b, rtol=1e-6, atol=0)


def test_masked_value_check_has_teeth(setup):
    # Negative control: a loss that forgets the mask does see the perturbation.
    model, datums = setup
    batches = _packings(datums)["random0"]
    perturbed = _perturb_masked(datums, seed=3)

    def unmasked_sum(ds):
        mb = collate(ds, batches[0], pad_token_id=PAD)
        return (token_logprobs(model, mb) * mb.advantages).sum()

    with torch.no_grad():
        assert not torch.allclose(unmasked_sum(datums), unmasked_sum(perturbed))


def test_zero_advantages_give_zero_policy_gradient(setup):
    model, datums = setup
    zeroed = copy.deepcopy(datums)
    for d in zeroed:
        d.advantages = [0.0] * len(d.advantages)
    g = accumulate(model, zeroed, [list(range(len(zeroed)))], "token_mean")
    assert float(g.abs().max()) == 0.0
    assert float(accumulate(model, datums, [list(range(len(datums)))], "token_mean").abs().max()) > 0.0
