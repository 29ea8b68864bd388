"""The gradient-equivalence harness: a seeded batch on the tiny model, the losses under test, and gradients
accumulated over micro-batches, packings and data-parallel ranks."""

from __future__ import annotations

import copy
import random

import torch

from conftest import make_trajectory
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
    """The model's log-prob of each target token of ``mb``, ``(B, T)``."""
    return modeling.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)


LOSSES = {
    "ppo_clip": PPOClipLoss(clip_low=0.2, clip_high=0.28),
    # Wider than the paper's 3e-4 / 4e-4 so that, with these noisy behaviour log-probs, some sequences clip and some not.
    "gspo": GSPOLoss(clip_low=0.02, clip_high=0.03),
    "turn_ppo": TurnPPOLoss(),
    "turn_ppo_mean": TurnPPOLoss(normalize=True, clip_low=0.02, clip_high=0.03),
}


def micro_batch_loss(model, mb: MicroBatch, mode, *, num_tokens, num_sequences, dp_size=1, loss="ppo_clip"):
    """One micro-batch's aggregated policy loss under the given global denominators, and the loss's stats."""
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
    """A micro-batch's loss normalised by its own counts, averaged over micro-batches (the classic bug)."""
    n_tok, n_seq = local_denominators(mb.action_mask)
    loss, _ = micro_batch_loss(model, mb, mode, num_tokens=n_tok, num_sequences=n_seq)
    return loss / num_micro_batches


def flat_grad(model) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def global_denominators(datums: list[Datum]) -> tuple[float, float]:
    """The token and sequence counts of the whole batch ``datums``."""
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


def gradient_batch(tiny_model_factory):
    """The tiny model and 16 seeded datums whose behaviour log-probs put some ratios beyond the clip range."""
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


def packings(datums):
    """Several ways to split ``datums`` into micro-batches: ffd, optimal, and three seeded random cuts."""
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


def ddp_gradient(model, datums, rank_items, mode, *, dp_size_factor, loss="ppo_clip"):
    # Each rank packs its own datums, accumulates with the *global* denominators, then the
    # gradients are averaged over ranks as DDP's all-reduce does.
    """The gradient of ranks that each take ``rank_items``, pack their own and average as DDP does."""
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
