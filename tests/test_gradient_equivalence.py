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

from conftest import rel_err
from support.gradients import (
    LOSSES,
    MODES,
    PAD,
    TOL,
    accumulate,
    ddp_gradient,
    global_denominators,
    gradient_batch,
    micro_batch_loss,
    packings,
    token_logprobs,
)
from trl_plugins.datum import collate
from trl_plugins.types import Datum


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    return gradient_batch(tiny_model_factory)


def test_the_batch_is_varied_and_the_clip_is_active(setup):
    model, datums = setup
    lengths = [d.num_tokens for d in datums]
    assert max(lengths) > 2 * min(lengths)
    mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
    n_tok, n_seq = global_denominators(datums)
    _, stats = micro_batch_loss(model, mb, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    s = stats.summary()
    assert s["clip_frac_low"] > 0.02 and s["clip_frac_high"] > 0.02


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_packing_does_not_change_the_gradient(setup, mode, loss="ppo_clip"):
    # The span-ratio losses run the same checks in test_gradient_equivalence_spans.py (on the other xdist worker).
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    assert float(reference.abs().max()) > 0
    for name, batches in packings(datums).items():
        assert len(batches) > 1 and len({len(b) for b in batches}) > 1, f"{name} should split unevenly"
        err = rel_err(accumulate(model, datums, batches, mode, loss=loss), reference)
        assert err < TOL, f"{loss} / {mode} / {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_naive_micro_batch_mean_fails_the_same_check(setup, mode):
    # Negative control: the per-micro-batch mean weights tokens by their micro-batch's size.
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode)
    batches = packings(datums)["random1"]
    err = rel_err(accumulate(model, datums, batches, mode, naive=True), reference)
    assert err > 100 * TOL, f"{mode}: the naive mean should differ, got {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_two_data_parallel_ranks_match_one_batch(setup, mode, loss="ppo_clip"):
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    rng = random.Random(5)
    order = list(range(len(datums)))
    rng.shuffle(order)
    rank_items = [order[:5], order[5:]]  # unequal: 5 and 11 datums
    err = rel_err(ddp_gradient(model, datums, rank_items, mode, dp_size_factor=2, loss=loss), reference)
    assert err < TOL, f"{loss} / {mode}: 2-rank gradient error {err:.2e}"
    # Negative control: forgetting that DDP averages (dp_size=1) halves the gradient.
    bad = rel_err(ddp_gradient(model, datums, rank_items, mode, dp_size_factor=1, loss=loss), reference)
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
    batches = packings(datums)["random0"]
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
    batches = packings(datums)["random0"]
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
