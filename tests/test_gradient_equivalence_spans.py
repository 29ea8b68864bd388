"""The gradient-equivalence checks of tests/test_gradient_equivalence.py for the span-ratio losses (gspo, turn_ppo
summed and normalised): whatever the packing or the rank split, the accumulated gradient is the one-batch gradient.
A file of its own so that the two xdist workers share the work (``--dist loadfile``)."""

from __future__ import annotations

import random

import pytest

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
)
from trl_plugins.datum import collate


@pytest.fixture(scope="module")
def setup(tiny_model_factory):
    return gradient_batch(tiny_model_factory)


SPAN_LOSSES = [name for name in LOSSES if name != "ppo_clip"]


@pytest.mark.parametrize("loss", SPAN_LOSSES)
def test_span_losses_clip_some_spans_and_not_others_here(setup, loss):
    # Otherwise the checks below would compare gradients of losses that are all clipped or all unclipped.
    model, datums = setup
    mb = collate(datums, list(range(len(datums))), pad_token_id=PAD)
    n_tok, n_seq = global_denominators(datums)
    _, stats = micro_batch_loss(model, mb, "token_mean", num_tokens=n_tok, num_sequences=n_seq, loss=loss)
    clipped = (float(stats.clipped_low) + float(stats.clipped_high)) / float(stats.num_tokens)
    assert 0.05 < clipped < 0.95, clipped


@pytest.mark.parametrize("loss", SPAN_LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_packing_does_not_change_the_gradient(setup, mode, loss):
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    assert float(reference.abs().max()) > 0
    for name, batches in packings(datums).items():
        err = rel_err(accumulate(model, datums, batches, mode, loss=loss), reference)
        assert err < TOL, f"{loss} / {mode} / {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("loss", SPAN_LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_two_data_parallel_ranks_match_one_batch(setup, mode, loss):
    model, datums = setup
    reference = accumulate(model, datums, [list(range(len(datums)))], mode, loss=loss)
    order = list(range(len(datums)))
    random.Random(5).shuffle(order)
    rank_items = [order[:5], order[5:]]  # unequal: 5 and 11 datums
    err = rel_err(ddp_gradient(model, datums, rank_items, mode, dp_size_factor=2, loss=loss), reference)
    assert err < TOL, f"{loss} / {mode}: 2-rank gradient error {err:.2e}"
    bad = rel_err(ddp_gradient(model, datums, rank_items, mode, dp_size_factor=1, loss=loss), reference)
    assert bad > 0.4  # negative control: forgetting that DDP averages
