"""policy_update in one process: K micro-batches give the one-batch step; the result adds up."""

from __future__ import annotations

from types import SimpleNamespace

import copy
import random

import torch

from conftest import make_trajectory, rel_err
from trl_plugins.algos import PPOClipLoss, aggregate, local_denominators
from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.trainers.step import policy_update
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
    config = SimpleNamespace(aggregation="token_mean", packer="optimal", max_items_per_micro_batch=2,
                             max_padded_tokens_per_micro_batch=300, rebalance_ranks=False, norm_length=None,
                             temperature=1.0, max_grad_norm=None)
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
