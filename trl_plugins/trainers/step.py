"""One optimizer update from a batch of datums, exact on any number of ranks (glue, no maths).

Every rank calls :func:`policy_update` with the datums it holds (any number, any lengths). It

1. with ``rebalance_ranks``, gathers every rank's datums and builds one plan across all ranks with
   the configured packer (``balanced`` is made for it), otherwise packs its own datums;
2. all-reduces the global denominators (loss tokens, sequences, over every datum given, including the
   zero-advantage ones whose forward it skips) and the largest micro-batch count;
3. runs that many forward/backward passes on every rank, zero-weight dummy micro-batches where a
   rank has fewer (under ZeRO-3 every forward is a collective), each loss already normalised by the
   global denominators and multiplied by the data-parallel size that DDP/DeepSpeed divide by;
4. syncs gradients once, on the last micro-batch (DDP ``no_sync`` before it; DeepSpeed's
   accumulation boundary set explicitly, since ``accelerator.backward`` otherwise steps the engine
   after every micro-batch), then takes exactly one optimizer step.

The gradient therefore equals the gradient of the one-batch loss on all datums of all ranks.

When the datums carry ``old_logprobs`` (the sampler/trainer mismatch correction: :func:`old_logprobs`,
decided by :func:`mismatch_correction_applies`), the PPO ratio is anchored on them instead of the
sampler's behaviour log-probs and each token's policy-gradient term is weighted by the bounded
importance weight ``pi_old / pi_sampler`` (:func:`trl_plugins.algos.importance_weights`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from trl_plugins.algos import aggregate, importance_ratios, importance_weights, kl_estimate, quantiles
from trl_plugins.datum import collate, dummy_micro_batch
from trl_plugins.modeling import check_packed_isolation, micro_batch_logprobs
from trl_plugins.packing import pack_for_ranks
from trl_plugins.types import (
    Datum,
    ImportanceSamplingMode,
    KLEstimator,
    LogprobSource,
    MicroBatch,
    MismatchStats,
    PolicyLossInput,
    PolicyLossOutput,
    PolicyLossStats,
    Trajectory,
)

__all__ = [
    "UpdateSettings", "UpdateResult", "policy_update", "forward_packed", "reference_logprobs", "old_logprobs",
    "padding_free", "ensure_packed_isolation",
    "mismatch_correction_applies", "datums_to_forward", "TRAINER_LOGPROB_SOURCE",
]

TRAINER_LOGPROB_SOURCE = LogprobSource.TEMPERATURE_SCALED
"""What the trainer's own forward computes (``log_softmax(logits / temperature)``, :mod:`trl_plugins.modeling`)."""


class UpdateSettings(Protocol):
    """What :func:`policy_update` reads from its config: fields of :class:`MultiTurnGRPOConfig`, which
    is where their defaults and their validation live (any object with these attributes will do)."""

    aggregation: str
    packer: str
    max_items_per_micro_batch: int
    max_padded_tokens_per_micro_batch: int
    rebalance_ranks: bool
    norm_length: float | None
    temperature: float
    max_grad_norm: float | None
    drop_zero_advantage: bool
    # padding_free (read with getattr, default False): micro-batches without padding (MicroBatch).
    # Read only when the datums carry old_logprobs (the mismatch correction applies):
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_min: float | None
    vllm_importance_sampling_clip_max: float | None


@dataclass
class UpdateResult:
    """What one update did (global numbers, identical on every rank)."""

    loss: float
    """The aggregated loss of the whole step (sum over micro-batches and ranks)."""
    num_micro_batches: int
    """Forward/backward passes per rank."""
    num_dummies: int
    """Zero-weight micro-batches over all ranks."""
    num_loss_tokens: int
    """Global loss tokens (the token-mean denominator)."""
    num_sequences: int
    """Global sequences with at least one loss token."""
    num_padded_tokens: int
    """Global padded area processed (dummies included)."""
    num_input_tokens: int
    """Global real input tokens."""
    stats: PolicyLossStats | None
    """Merged policy-loss statistics over all ranks (None when nothing was trained)."""
    grad_norm: float | None = None
    """Gradient norm before clipping, when clipping is on and known."""
    packing_s: float = 0.0
    """Wall time spent planning micro-batches on this rank."""
    ratio_quantiles: dict[str, float] | None = None
    """p10/p50/p90 of the importance ratio over the loss tokens of every rank (gathered: exact)."""
    num_forwarded: int = 0
    """Global datums that went through forward/backward (zero-advantage ones may be skipped)."""
    reference: dict[str, float] | None = None
    """Means over the forwarded loss tokens of KL(current || reference) per estimator (``kl_k1``,
    ``kl_k2``, ``kl_k3``) and ``ref_logprob_gap`` (mean ``|log pi - log pi_ref|``), when the datums
    carry reference log-probs."""
    entropy: float | None = None
    """Mean per-token entropy of the current policy over the forwarded loss tokens, when computed."""
    mismatch: dict[str, float] | None = None
    """Sampler/trainer mismatch over the forwarded loss tokens of every rank, when the datums carry
    ``old_logprobs`` (:meth:`MismatchStats.summary`: ``is_mismatch_kl``, ``is_weight_mean``, ...)."""


def is_deepspeed(accelerator: Any) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def reduce_over_ranks(accelerator: Any, values: Sequence[float], op: str) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum") if op == "sum" else _all_reduce_max(t)
    return t.tolist()


def gather_values(accelerator: Any, local: torch.Tensor) -> torch.Tensor:
    """Every rank's values of a flat tensor, concatenated in rank order, on every rank (CPU, float32)."""
    local = local.detach().float().cpu().reshape(-1)
    if accelerator.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    return torch.cat(gather_object([local]))


def _all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t


def _merge_stats_across_ranks(accelerator: Any, stats: PolicyLossStats | None) -> PolicyLossStats | None:
    # Every field is a sum except the ratio extremes, which are reduced with max (min as -max(-x)).
    extremes = ("ratio_min", "ratio_max")
    sums_names = [f.name for f in dataclasses.fields(PolicyLossStats) if f.name not in extremes]
    if stats is None:
        sums, lo, hi = [0.0] * len(sums_names), float("inf"), float("-inf")
    else:
        sums = [float(getattr(stats, name)) for name in sums_names]
        lo, hi = float(stats.ratio_min), float(stats.ratio_max)
    sums = reduce_over_ranks(accelerator, sums, "sum")
    neg_lo, hi = reduce_over_ranks(accelerator, [-lo, hi], "max")
    if sums[sums_names.index("num_tokens")] == 0:
        return None
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return PolicyLossStats(**{n: t(v) for n, v in zip(sums_names, sums)}, ratio_min=t(-neg_lo), ratio_max=t(hi))


def _merge_mismatch_across_ranks(accelerator: Any, stats: MismatchStats | None) -> MismatchStats | None:
    names = [f.name for f in dataclasses.fields(MismatchStats)]
    sums = [n for n in names if n not in MismatchStats.MINIMA + MismatchStats.MAXIMA]
    # Extremes go through one max-reduction: a minimum as -max(-x).
    signs = {n: -1.0 for n in MismatchStats.MINIMA} | {n: 1.0 for n in MismatchStats.MAXIMA}
    if stats is None:
        local_sums, local_ext = [0.0] * len(sums), [float("-inf")] * len(signs)
    else:
        local_sums = [float(getattr(stats, n)) for n in sums]
        local_ext = [sign * float(getattr(stats, n)) for n, sign in signs.items()]
    total = reduce_over_ranks(accelerator, local_sums, "sum")
    ext = reduce_over_ranks(accelerator, local_ext, "max")
    if total[sums.index("num_tokens")] == 0:
        return None
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return MismatchStats(**{n: t(v) for n, v in zip(sums, total)}, **{n: t(sign * v) for (n, sign), v in zip(signs.items(), ext)})


def _capability(policy_loss: Any, name: str) -> bool:
    return bool(getattr(policy_loss, name, False))


def datums_to_forward(datums: Sequence[Datum], policy_loss: Any, config: UpdateSettings) -> list[int]:
    """Indices of the datums whose forward/backward can change the gradient.

    With ``drop_zero_advantage``, a datum whose advantages are all 0 adds exactly 0 to a PPO-clip
    loss and its gradient (``-A * ratio``), so it is skipped; it still counts in the global
    denominators (:func:`policy_update`), so skipping never rescales the gradient. When the loss has
    another per-token term (a reference KL, an entropy bonus: ``needs_ref_logprobs``/``needs_entropy``)
    nothing can be skipped.
    """
    per_token_terms = _capability(policy_loss, "needs_ref_logprobs") or _capability(policy_loss, "needs_entropy")
    if not config.drop_zero_advantage or per_token_terms:
        return list(range(len(datums)))
    return [i for i, d in enumerate(datums) if any(a != 0.0 for a in d.advantages)]


def padding_free(config: Any) -> bool:
    """Whether micro-batches are padding-free (``config.padding_free``; absent means False)."""
    return bool(getattr(config, "padding_free", False))


def _limits(config: UpdateSettings) -> dict[str, Any]:
    return {"max_items": config.max_items_per_micro_batch, "max_padded_tokens": config.max_padded_tokens_per_micro_batch,
            "padding_free": padding_free(config)}


def ensure_packed_isolation(accelerator: Any, model: torch.nn.Module, config: Any, *, name: str = "the policy") -> None:
    """With padding-free micro-batches, check once per model that its attention keeps packed datums apart
    (:func:`~trl_plugins.modeling.check_packed_isolation`); every rank must call it (a forward)."""
    if not padding_free(config):
        return
    inner = accelerator.unwrap_model(model) if accelerator is not None else model
    if getattr(inner, "_trl_plugins_packing_checked", False):
        return
    vocab = int(getattr(getattr(inner, "config", None), "vocab_size", 2) or 2)
    check_packed_isolation(model, accelerator.device, vocab_size=vocab, name=name)
    inner._trl_plugins_packing_checked = True


def micro_batches_with_dummies(accelerator: Any, datums: Sequence[Datum], config: UpdateSettings) -> list[list[int]]:
    """This rank's micro-batches (local plan), padded with empty ones to the largest count over ranks."""
    batches = pack_for_ranks([d.num_tokens for d in datums], strategy=config.packer, world_size=1, **_limits(config)).ranks[0]
    (steps,) = reduce_over_ranks(accelerator, [len(batches)], "max")
    return list(batches) + [[] for _ in range(int(steps) - len(batches))]


@torch.no_grad()
def forward_packed(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    config: UpdateSettings,
    forward: Callable[[torch.nn.Module, MicroBatch, Any], torch.Tensor],
    *,
    pad_token_id: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    name: str = "the model",
) -> list[tuple[list[int], torch.Tensor]]:
    """One no-gradient, eval-mode pass of ``model`` over ``datums``; every rank must call it.

    Packed like the update (the configured packer and limits), with the same number of forwards on
    every rank (empty dummies where a rank has fewer: under ZeRO-3 each forward is a collective).

    Args:
        forward: ``forward(model, micro_batch, device) -> (B, T)`` (either layout: :mod:`trl_plugins.modeling`).
        context: A factory of the context the pass runs in (e.g. PEFT adapters off).

    Returns:
        ``(datum indices, (B, T) float output on the CPU)`` per real micro-batch, rows in index order.
    """
    device = accelerator.device
    out = []
    was_training = model.training
    model.eval()
    try:
        with context() if context is not None else contextlib.nullcontext():
            ensure_packed_isolation(accelerator, model, config, name=name)
            for idx in micro_batches_with_dummies(accelerator, datums, config):
                mb = (collate(datums, idx, pad_token_id=pad_token_id, padding_free=padding_free(config)) if idx
                      else dummy_micro_batch(pad_token_id=pad_token_id))
                result = forward(model, mb, device)
                if idx:
                    out.append((list(idx), result.float().cpu()))
    finally:
        model.train(was_training)
    return out


def _fill_logprobs(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    config: UpdateSettings,
    field: str,
    *,
    pad_token_id: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    temperature = config.temperature or 1.0

    def forward(m: torch.nn.Module, mb: MicroBatch, device: Any) -> torch.Tensor:
        return micro_batch_logprobs(m, mb, device, temperature=temperature)[0]

    name = "the reference model" if field == "ref_logprobs" else "the policy"
    for idx, lp in forward_packed(accelerator, model, datums, config, forward, pad_token_id=pad_token_id, context=context,
                                  name=name):
        for row, i in enumerate(idx):
            n = datums[i].num_tokens
            setattr(datums[i], field, [float(x) if m else 0.0 for x, m in zip(lp[row, :n], datums[i].action_mask)])


def reference_logprobs(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    config: UpdateSettings,
    *,
    pad_token_id: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """Fill ``datum.ref_logprobs`` with the reference model's log-probs at the sampling temperature;
    every rank must call it (:func:`forward_packed`). Called once per rollout batch, so reused
    rollouts keep them.

    Args:
        model: The prepared reference model, or the policy when ``context`` disables its adapter (PEFT).
        context: A factory of the context in which ``model`` is the reference (e.g. adapters off).
    """
    _fill_logprobs(accelerator, model, datums, config, "ref_logprobs", pad_token_id=pad_token_id, context=context)


def old_logprobs(
    accelerator: Any, model: torch.nn.Module, datums: Sequence[Datum], config: UpdateSettings, *, pad_token_id: int
) -> None:
    """Fill ``datum.old_logprobs`` with the policy's own no-gradient log-probs at the sampling temperature;
    every rank must call it (:func:`forward_packed`: same packing, same number of forwards per rank).

    Call it once per rollout batch, before the first optimizer step on it: ``model`` then holds the
    weights that sampled, so these are the trainer's numbers for the sampling policy (``pi_old``), and
    reused rollouts (``num_iterations > 1``) keep them.

    Args:
        model: The prepared policy (DDP- or DeepSpeed-wrapped; with PEFT, adapters on).
        datums: The datums the update will forward (:func:`datums_to_forward`).
    """
    _fill_logprobs(accelerator, model, datums, config, "old_logprobs", pad_token_id=pad_token_id)


def mismatch_correction_applies(
    accelerator: Any, trajectories: Sequence[Trajectory], policy_loss: Any, config: Any
) -> bool:
    """Whether this rollout batch gets the sampler/trainer mismatch correction; the same answer on every rank.

    It applies when ``vllm_importance_sampling_correction`` is on and either ``mismatch_correction_scope``
    is ``"all"`` or any rank holds a trajectory whose log-probs are not the trainer's own
    (``policy_version.logprob_source != TRAINER_LOGPROB_SOURCE``, e.g. vLLM's ``processed``). Every rank
    must call it (one all-reduce in scope ``"foreign"``).

    Raises:
        ValueError: it applies but the policy loss does not declare ``supports_is_weights`` (raised on
            every rank alike).
    """
    if not config.vllm_importance_sampling_correction:
        return False
    if config.mismatch_correction_scope == "all":
        applies = True
    else:
        foreign = any(t.policy_version is not None and t.policy_version.logprob_source != TRAINER_LOGPROB_SOURCE
                      for t in trajectories)
        (any_foreign,) = reduce_over_ranks(accelerator, [float(foreign)], "max")
        applies = bool(any_foreign)
    if applies and not _capability(policy_loss, "supports_is_weights"):
        raise ValueError(
            f"the sampler/trainer mismatch correction applies to this batch (vllm_importance_sampling_correction=True, "
            f"mismatch_correction_scope={config.mismatch_correction_scope!r}), but policy_loss "
            f"{type(policy_loss).__name__} does not declare supports_is_weights: it would drop the importance weights. "
            f"Use policy_loss='ppo_clip', make the plugin apply PolicyLossInput.is_weights, or set "
            f"vllm_importance_sampling_correction=False."
        )
    return applies


def policy_update(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    datums: Sequence[Datum],
    policy_loss: Callable[[PolicyLossInput], PolicyLossOutput],
    config: UpdateSettings,
    *,
    pad_token_id: int,
    step_optimizer: bool = True,
) -> UpdateResult:
    """Run one exact update on this rank's ``datums``; every rank must call it (collectives inside).

    Args:
        accelerator: The ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``.
        model: The prepared (DDP- or DeepSpeed-wrapped) policy.
        optimizer: The prepared optimizer.
        datums: This rank's datums (may be empty).
        policy_loss: A policy-loss plugin.
        config: The run's config (a ``MultiTurnGRPOConfig``): aggregation, packer and its limits,
            ``rebalance_ranks``, ``norm_length``, the sampling ``temperature`` (log-probs are taken from
            ``logits / temperature`` like the behaviour ones; 0, greedy, keeps the unscaled logits) and
            ``max_grad_norm`` (clipping when > 0; skipped under DeepSpeed, which clips by its own config) and
            ``drop_zero_advantage`` (skip the forward of datums that add exactly 0: :func:`datums_to_forward`;
            every datum still counts in the denominators).
        pad_token_id: Padding id for collation.
        step_optimizer: Step and zero the optimizer here (DDP/single process). ``False`` when a caller
            such as the HF Trainer loop clips and steps itself right after. Under DeepSpeed the engine
            steps in the last backward either way.

    Returns:
        Global numbers of the update (the same on every rank).
    """
    world = accelerator.num_processes
    rank = accelerator.process_index
    datums = list(datums)
    # Denominators count every datum this step trains on, skipped zero-advantage ones included.
    local_tokens = float(sum(d.num_loss_tokens for d in datums))
    local_seqs = float(sum(d.num_loss_tokens > 0 for d in datums))
    num_tokens, num_seqs = reduce_over_ranks(accelerator, [local_tokens, local_seqs], "sum")
    needs_ref = _capability(policy_loss, "needs_ref_logprobs")
    needs_entropy = _capability(policy_loss, "needs_entropy")
    datums = [datums[i] for i in datums_to_forward(datums, policy_loss, config)]
    with_ref = bool(datums) and all(d.ref_logprobs is not None for d in datums)
    if needs_ref and datums and not with_ref:
        raise ValueError(
            "the policy loss reads reference log-probs but the datums carry none; call reference_logprobs() first."
        )
    with_old = bool(datums) and all(d.old_logprobs is not None for d in datums)
    if datums and not with_old and any(d.old_logprobs is not None for d in datums):
        raise ValueError("some datums carry old_logprobs and some do not; call old_logprobs() on every datum the update forwards.")
    t_pack = time.perf_counter()
    limits = _limits(config)
    if config.rebalance_ranks and world > 1:
        from accelerate.utils import gather_object

        # Every rank gathers every datum and builds the same plan across all ranks with the packer.
        everything = gather_object([datums])  # one list per rank, in rank order
        datums = [d for part in everything for d in part]
        plan = pack_for_ranks([d.num_tokens for d in datums], strategy=config.packer, world_size=world, **limits)
        batches = plan.ranks[rank]
    else:
        plan = pack_for_ranks([d.num_tokens for d in datums], strategy=config.packer, world_size=1, **limits)
        batches = plan.ranks[0]
    packing_s = time.perf_counter() - t_pack
    (forwarded,) = reduce_over_ranks(accelerator, [float(sum(len(idx) for idx in batches))], "sum")
    any_ref, any_old = reduce_over_ranks(accelerator, [float(with_ref), float(with_old)], "max")
    is_mode = ImportanceSamplingMode(config.vllm_importance_sampling_mode) if any_old else None
    if any_old and not _capability(policy_loss, "supports_is_weights"):
        raise ValueError(
            f"the datums carry old_logprobs (mismatch correction) but policy_loss {type(policy_loss).__name__} "
            f"does not declare supports_is_weights."
        )
    (steps,) = reduce_over_ranks(accelerator, [len(batches)], "max")
    steps = int(steps)
    batches = list(batches) + [[] for _ in range(steps - len(batches))]

    deepspeed = is_deepspeed(accelerator)
    temperature = config.temperature or 1.0  # greedy sampling keeps log-probs of the unscaled logits
    loss_total = 0.0
    padded = real = dummies = 0
    stats: PolicyLossStats | None = None
    mismatch: MismatchStats | None = None
    ratios: list[torch.Tensor] = []
    # Sums over this rank's forwarded loss tokens: KL to the reference per estimator, |log-prob gap|, entropy.
    aux = {"kl_k1": 0.0, "kl_k2": 0.0, "kl_k3": 0.0, "ref_logprob_gap": 0.0, "entropy": 0.0}
    ensure_packed_isolation(accelerator, model, config)
    model.train()
    for k, idx in enumerate(batches):
        last = k == steps - 1
        mb = (collate(datums, idx, pad_token_id=pad_token_id, padding_free=padding_free(config)) if idx
              else dummy_micro_batch(pad_token_id=pad_token_id, with_ref=bool(any_ref)))
        dummies += not idx
        padded += mb.num_padded_tokens
        real += int(mb.attention_mask.sum())
        device = accelerator.device
        if deepspeed:
            accelerator.sync_gradients = last
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        else:
            ctx = contextlib.nullcontext() if last or world == 1 else accelerator.no_sync(model)
        with ctx:
            logp, entropy = micro_batch_logprobs(model, mb, device, temperature=temperature, with_entropy=needs_entropy)
            ref = None if mb.ref_logprobs is None else mb.ref_logprobs.to(device)
            # The PPO anchor: the sampler's log-probs, or with the mismatch correction the trainer's own
            # (pi_old), the sampler-to-trainer gap then going into the importance weights.
            anchor = mb.behaviour_logprobs.to(device) if mb.old_logprobs is None else mb.old_logprobs.to(device)
            is_w = None
            if mb.old_logprobs is not None:
                is_w = importance_weights(
                    anchor, mb.behaviour_logprobs.to(device), mb.action_mask.to(device), is_mode,
                    clip_min=config.vllm_importance_sampling_clip_min, clip_max=config.vllm_importance_sampling_clip_max,
                )
            out = policy_loss(
                PolicyLossInput(
                    logprobs=logp,
                    behaviour_logprobs=anchor,
                    advantages=mb.advantages.to(device),
                    action_mask=mb.action_mask.to(device),
                    ref_logprobs=ref if needs_ref else None,
                    entropy=entropy,
                    is_weights=None if is_w is None else is_w.weights,
                )
            )
            loss = aggregate(
                out.per_token_loss, mb.action_mask.to(device), config.aggregation,
                num_tokens=num_tokens, num_sequences=num_seqs, norm_length=config.norm_length, dp_size=world,
            ) * mb.weight
            if deepspeed:
                accelerator.backward(loss, scale_wrt_gas=False)
            else:
                accelerator.backward(loss)
        loss_total += float(loss.detach()) / world
        if idx:
            stats = out.stats if stats is None else stats.merge(out.stats)
            if is_w is not None:
                mismatch = is_w.stats if mismatch is None else mismatch.merge(is_w.stats)
            ratios.append(importance_ratios(logp, anchor, mb.action_mask.to(device)).cpu())
            with torch.no_grad():
                m = mb.action_mask.to(device)
                on = m.bool()
                if ref is not None:
                    safe_ref = torch.where(on, ref, logp.detach())
                    for est in KLEstimator:
                        aux[f"kl_{est.value}"] += float((kl_estimate(logp.detach(), safe_ref, est) * m).sum())
                    aux["ref_logprob_gap"] += float(((logp.detach() - safe_ref).abs() * m).sum())
                if entropy is not None:
                    aux["entropy"] += float((entropy.detach() * m).sum())

    grad_norm = None
    if not deepspeed and step_optimizer:
        if config.max_grad_norm is not None and config.max_grad_norm > 0:
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        accelerator.sync_gradients = True
    (loss_sum,) = reduce_over_ranks(accelerator, [loss_total], "sum")
    qs = (0.1, 0.5, 0.9)
    all_r = gather_values(accelerator, torch.cat(ratios) if ratios else torch.zeros(0))
    ratio_qs = {f"ratio_p{int(q * 100)}": v for q, v in zip(qs, quantiles(all_r, qs).tolist())} if all_r.numel() else None
    dummies_all, padded_all, real_all = reduce_over_ranks(accelerator, [dummies, padded, real], "sum")
    aux_all = dict(zip(aux, reduce_over_ranks(accelerator, list(aux.values()), "sum")))
    (fwd_tokens,) = reduce_over_ranks(accelerator, [float(sum(datums[i].num_loss_tokens for idx in batches for i in idx))], "sum")
    denom = max(fwd_tokens, 1.0)
    reference = {k: aux_all[k] / denom for k in ("kl_k1", "kl_k2", "kl_k3", "ref_logprob_gap")} if any_ref else None
    mismatch_all = _merge_mismatch_across_ranks(accelerator, mismatch) if any_old else None
    return UpdateResult(
        loss=loss_sum,
        num_micro_batches=steps,
        num_dummies=int(dummies_all),
        num_loss_tokens=int(num_tokens),
        num_sequences=int(num_seqs),
        num_padded_tokens=int(padded_all),
        num_input_tokens=int(real_all),
        stats=_merge_stats_across_ranks(accelerator, stats),
        grad_norm=grad_norm,
        packing_s=packing_s,
        ratio_quantiles=ratio_qs,
        num_forwarded=int(forwarded),
        reference=reference,
        entropy=aux_all["entropy"] / denom if needs_entropy else None,
        mismatch=None if mismatch_all is None else mismatch_all.summary(is_mode),
    )
