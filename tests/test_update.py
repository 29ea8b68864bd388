"""policy_update in one process: K micro-batches give the one-batch step; the result adds up."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import make_trajectory, rel_err
from support.settings import update_settings
from trl_plugins.algos import PPOClipLoss, aggregate, local_denominators
from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.trainers.update import policy_update
from trl_plugins.types import PolicyLossInput


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_single_process_update_equals_one_batch_sgd_step(tiny_model_factory):
    from accelerate import Accelerator

    rng = random.Random(3)
    datums = [build_datum(make_trajectory(rng, num_turns=rng.randint(1, 3)), trajectory_index=i) for i in range(9)]
    model = tiny_model_factory(torch.float32)
    reference = copy.deepcopy(model)
    before = _flat(model).clone()
    with torch.no_grad():
        mb = collate(datums, list(range(9)), pad_token_id=0)
        lp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)
    for row, d in enumerate(datums):
        d.behaviour_logprobs = [float(x) - 0.2 if m else 0.0 for x, m in zip(lp[row, : d.num_tokens], d.action_mask)]

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    # The fields of MultiTurnGRPOConfig that policy_update reads, stated for this test.
    config = update_settings(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=2,
        max_padded_tokens_per_micro_batch=300,
        rebalance_ranks=False,
        norm_length=None,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=False,
        padding_free=False,
    )
    result = policy_update(accelerator, model, optimizer, datums, PPOClipLoss(), config, pad_token_id=0)

    full = collate(datums, list(range(9)), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    logp = token_logprobs(reference, full.input_ids, full.attention_mask, full.target_ids)
    out = PPOClipLoss()(PolicyLossInput(logp, full.behaviour_logprobs, full.advantages, full.action_mask))
    loss = aggregate(out.per_token_loss, full.action_mask, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()

    assert result.num_micro_batches >= 5 and result.num_dummies == 0  # 9 datums, 2 per micro-batch
    assert result.num_loss_tokens == int(n_tok) and result.num_sequences == int(n_seq)
    assert abs(result.loss - float(loss)) < 1e-5
    assert result.num_input_tokens == sum(d.num_tokens for d in datums)
    assert result.num_padded_tokens >= result.num_input_tokens
    assert rel_err(_flat(model) - before, _flat(reference) - before) < 1e-5
    assert result.stats is not None and abs(result.stats.summary()["ratio_mean"] - 1.0) > 0.05


def _config(**overrides):
    # The fields of MultiTurnGRPOConfig that policy_update reads, stated for these tests.
    base = dict(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=2,
        max_padded_tokens_per_micro_batch=300,
        rebalance_ranks=False,
        norm_length=40,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=False,
        padding_free=False,
    )
    base.update(overrides)
    return update_settings(**base)


def _datums_with_zero_advantages(model, *, temperature=1.0, seed=5, n=10):
    """n datums; every third has advantage 0 everywhere; behaviour log-probs near the model's own."""
    rng = random.Random(seed)
    datums = []
    for i in range(n):
        adv = 0.0 if i % 3 == 0 else rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5)
        datums.append(build_datum(make_trajectory(rng, num_turns=rng.randint(1, 3)), advantage=adv, trajectory_index=i))
    with torch.no_grad():
        mb = collate(datums, list(range(n)), pad_token_id=0)
        lp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids, temperature=temperature)
    gen = torch.Generator().manual_seed(seed)
    for row, d in enumerate(datums):
        noisy = lp[row, : d.num_tokens] + 0.1 * torch.randn(d.num_tokens, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]
    return datums


def _update(model, datums, loss_fn, config):
    from accelerate import Accelerator

    model = copy.deepcopy(model)
    before = _flat(model).clone()
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = policy_update(accelerator, model, optimizer, datums, loss_fn, config, pad_token_id=0)
    return _flat(model) - before, result


def _one_batch_step(model, datums, loss_fn, aggregation, *, temperature=1.0, norm_length=40):
    """Plain torch: the one-batch loss over every datum, one SGD step; returns the parameter change."""
    from trl_plugins.modeling import token_logprobs_and_entropy

    model = copy.deepcopy(model)
    before = _flat(model).clone()
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    logp, entropy = token_logprobs_and_entropy(
        model, full.input_ids, full.attention_mask, full.target_ids, temperature=temperature
    )
    out = loss_fn(
        PolicyLossInput(
            logp,
            full.behaviour_logprobs,
            full.advantages,
            full.action_mask,
            ref_logprobs=full.ref_logprobs,
            entropy=entropy,
        )
    )
    loss = aggregate(
        out.per_token_loss,
        full.action_mask,
        aggregation,
        num_tokens=n_tok,
        num_sequences=n_seq,
        norm_length=norm_length,
    )
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return _flat(model) - before, float(loss)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_skipping_zero_advantage_datums_leaves_the_gradient_unchanged(tiny_model_factory, aggregation):
    model = tiny_model_factory(torch.float32)
    datums = _datums_with_zero_advantages(model)
    on, r_on = _update(model, datums, PPOClipLoss(), _config(aggregation=aggregation, drop_zero_advantage=True))
    off, r_off = _update(model, datums, PPOClipLoss(), _config(aggregation=aggregation, drop_zero_advantage=False))
    expected, loss = _one_batch_step(model, datums, PPOClipLoss(), aggregation)
    assert r_on.num_forwarded == 6 and r_off.num_forwarded == 10  # 4 of 10 datums have advantage 0
    assert r_on.num_loss_tokens == r_off.num_loss_tokens and r_on.num_sequences == r_off.num_sequences == 10
    assert rel_err(on, expected) < 1e-5 and rel_err(off, expected) < 1e-5
    assert abs(r_on.loss - loss) < 1e-6 and abs(r_off.loss - loss) < 1e-6
    # Negative control: leaving the zero-advantage datums out of the update altogether (what the trainer
    # did before) changes the denominators and so the gradient.
    dropped, _ = _update(
        model, [d for d in datums if any(d.advantages)], PPOClipLoss(), _config(aggregation=aggregation)
    )
    assert rel_err(dropped, expected) > 0.1


@pytest.mark.parametrize(
    "kl_coef,entropy_coef,estimator,weighted",
    [(0.3, 0.0, "k3", False), (0.3, 0.0, "k1", True), (0.0, 0.05, "k3", False), (0.2, 0.05, "k2", False)],
)
def test_kl_and_entropy_terms_match_the_one_batch_loss(tiny_model_factory, kl_coef, entropy_coef, estimator, weighted):
    from trl_plugins.trainers.update import datums_to_forward, reference_logprobs

    model = tiny_model_factory(torch.float32)
    datums = _datums_with_zero_advantages(model)
    # The reference: another model (a perturbed copy), its log-probs filled by reference_logprobs.
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    from accelerate import Accelerator

    config = _config(drop_zero_advantage=True)
    reference_logprobs(Accelerator(cpu=True), ref_model, datums, config, pad_token_id=0)
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    direct = token_logprobs(ref_model, full.input_ids, full.attention_mask, full.target_ids)
    assert torch.allclose(full.ref_logprobs * full.action_mask, direct.detach() * full.action_mask, atol=1e-6)

    loss_fn = PPOClipLoss(
        kl_coef=kl_coef, entropy_coef=entropy_coef, kl_estimator=estimator, kl_importance_weight=weighted
    )
    # A per-token term other than the advantage: no datum may be skipped, even with drop_zero_advantage.
    assert datums_to_forward(datums, loss_fn, config) == list(range(10))
    got, result = _update(model, datums, loss_fn, config)
    expected, loss = _one_batch_step(model, datums, loss_fn, "token_mean")
    plain, _ = _one_batch_step(model, datums, PPOClipLoss(), "token_mean")
    assert result.num_forwarded == 10
    assert rel_err(got, expected) < 1e-5 and abs(result.loss - loss) < 1e-6
    assert rel_err(plain, expected) > 1e-3  # the term really changes the update
    if kl_coef:
        assert (
            result.reference is not None and result.reference["kl_k3"] > 0 and result.reference["ref_logprob_gap"] > 0
        )
    if entropy_coef:
        assert result.entropy is not None and result.entropy > 0


def test_update_log_probs_use_the_sampling_temperature(tiny_model_factory):
    model = tiny_model_factory(torch.float32)
    datums = _datums_with_zero_advantages(model, temperature=0.6)
    # Behaviour log-probs exactly the model's at temperature 0.6: the ratio is 1 when scored alike.
    with torch.no_grad():
        mb = collate(datums, list(range(len(datums))), pad_token_id=0)
        lp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids, temperature=0.6)
    for row, d in enumerate(datums):
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(lp[row, : d.num_tokens], d.action_mask)]
    _, hot = _update(model, datums, PPOClipLoss(), _config(temperature=0.6))
    _, plain = _update(model, datums, PPOClipLoss(), _config(temperature=1.0))
    assert abs(hot.stats.summary()["ratio_mean"] - 1.0) < 1e-5 and hot.stats.summary()["behaviour_logprob_gap"] < 1e-5
    assert plain.stats.summary()["behaviour_logprob_gap"] > 0.05  # scored at the wrong temperature
    got, _ = _update(model, datums, PPOClipLoss(), _config(temperature=0.6))
    expected, _ = _one_batch_step(model, datums, PPOClipLoss(), "token_mean", temperature=0.6)
    assert rel_err(got, expected) < 1e-5
