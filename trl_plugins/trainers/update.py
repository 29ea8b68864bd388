"""One optimizer update from a batch of datums, exact on any number of ranks, and the no-gradient log-prob passes
it reads (glue, no maths).

Every rank calls :func:`policy_update` with the datums it holds (any number, any lengths). Its phases, each with
its collectives at its edges:

1. **denominators**: the global loss-token and sequence counts, over every datum given (zero-advantage ones
   whose forward is skipped included), so skipping or splitting never rescales the gradient;
2. **plan**: with ``rebalance_ranks`` every rank gathers every datum and builds one plan across all ranks with
   the configured packer (``balanced`` is made for it), otherwise each packs its own;
3. **pass**: the micro-batch loop (:mod:`~trl_plugins.trainers.micro_batches`): as many forward/backward passes
   on every rank (zero-weight dummies where a rank has fewer), each loss normalised by the global denominators
   and multiplied by the data-parallel size that DDP/DeepSpeed divide by, gradients synchronised once;
4. **step**: exactly one optimizer step (or, ``step_optimizer=False``, left to the HF loop);
5. **statistics**: the pass's figures merged over the ranks (:func:`~trl_plugins.trainers.ranks.merge_over_ranks`).

The gradient therefore equals the gradient of the one-batch loss on all datums of all ranks.

When the datums carry ``old_logprobs`` (the sampler/trainer mismatch correction: :func:`old_logprobs`,
decided by :func:`mismatch_correction_applies`), the PPO ratio is anchored on them instead of the
sampler's behaviour log-probs and each token's policy-gradient and reference-KL terms are weighted by the bounded
importance weight ``pi_old / pi_sampler`` (:func:`trl_plugins.algos.importance_weights`; ``pi_prox / pi_behaviour``
under the decoupled objective).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Protocol, Sequence

import torch

from trl_plugins.algos import aggregate, importance_ratios, importance_weights, kl_estimate, quantiles
from trl_plugins.modeling import micro_batch_logprobs, micro_batch_logprobs_and_divergence
from trl_plugins.modeling.sparse_divergence import micro_batch_logprobs_and_support_divergence
from trl_plugins.protocols import PolicyLossPlugin, as_policy_loss
from trl_plugins.run.settings import Features, MismatchCorrection
from trl_plugins.trainers.micro_batches import (
    GradientSync,
    ensure_layout_checked,
    forward_no_grad,
    local_plan,
    micro_batches,
    plan_for_ranks,
    shared_prefix_on,
)
from trl_plugins.trainers.ranks import gather_values, is_deepspeed, merge_over_ranks, reduce_over_ranks
from trl_plugins.trainers.sequence_parallel import SequenceParallel, group_plan, shard_micro_batch, split_attention
from trl_plugins.types import (
    Datum,
    KLEstimator,
    LogprobSource,
    MicroBatch,
    MismatchStats,
    PolicyLossInput,
    PolicyLossStats,
    TokenSource,
    Trajectory,
)

__all__ = [
    "UpdateSettings",
    "UpdateResult",
    "policy_update",
    "reference_logprobs",
    "teacher_logprobs",
    "old_logprobs",
    "mismatch_correction_applies",
    "datums_to_forward",
    "TRAINER_LOGPROB_SOURCE",
]

TRAINER_LOGPROB_SOURCE = LogprobSource.TEMPERATURE_SCALED
"""What the trainer's own forward computes (``log_softmax(logits / temperature)``, :mod:`trl_plugins.modeling`)."""


class UpdateSettings(Protocol):
    """What the update reads from its config: fields of :class:`MultiTurnGRPOConfig`, which is where their defaults
    and their validation live (any object with these attributes will do)."""

    aggregation: str
    packer: str
    max_items_per_micro_batch: int
    max_padded_tokens_per_micro_batch: int
    padding_free: bool | None
    shared_prefix: bool | None  # a namespace without it keeps the padded layout (micro_batches.shared_prefix_on)
    rebalance_ranks: bool
    norm_length: float | None
    temperature: float
    max_grad_norm: float | None
    drop_zero_advantage: bool
    features: Features
    """Its ``long_trajectories`` (the chunked head's chunk size) and, read only when the datums carry old_logprobs
    (the mismatch correction applies), its ``mismatch_correction``."""


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
    num_computed_tokens: int
    """Global real tokens the forwards computed: :attr:`num_input_tokens` less the repeats of each shared prefix in
    the shared-prefix layout (dummies' included)."""
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
    ``kl_k2``, ``kl_k3``), each token's estimate weighted by ``pi / pi_behaviour`` as the loss's importance-weighted
    KL term is (the ratio to the anchor times the bounded ``is_weights``), so that stale or foreign tokens estimate
    the current policy's KL and not the sampler's; and ``ref_logprob_gap`` (mean ``|log pi - log pi_ref|``,
    unweighted), when the datums carry reference log-probs."""
    entropy: float | None = None
    """Mean per-token entropy of the current policy over the forwarded loss tokens, when computed."""
    mismatch: dict[str, float] | None = None
    """Sampler/trainer mismatch over the forwarded loss tokens of every rank, when the datums carry
    ``old_logprobs`` (:meth:`MismatchStats.summary`: ``is_mismatch_kl``, ``is_weight_mean``, ...)."""


@dataclass
class _PassSums:
    """This rank's sums over one pass (every field a sum over the ranks: :func:`merge_over_ranks`)."""

    loss: float = 0.0
    dummies: float = 0.0
    padded: float = 0.0
    real: float = 0.0
    computed: float = 0.0
    forwarded_tokens: float = 0.0
    kl_k1: float = 0.0
    kl_k2: float = 0.0
    kl_k3: float = 0.0
    ref_logprob_gap: float = 0.0
    entropy: float = 0.0


@dataclass
class _Pass:
    """What one pass collected on this rank."""

    sums: _PassSums = field(default_factory=_PassSums)
    stats: PolicyLossStats | None = None
    mismatch: MismatchStats | None = None
    ratios: list[torch.Tensor] = field(default_factory=list)
    steps: int = 0


def datums_to_forward(datums: Sequence[Datum], policy_loss: Any, config: UpdateSettings) -> list[int]:
    """Indices of the datums whose forward/backward can change the gradient.

    With ``drop_zero_advantage``, a datum whose advantages are all 0 adds exactly 0 to a PPO-clip
    loss and its gradient (``-A * ratio``), so it is skipped; it still counts in the global
    denominators (:func:`policy_update`), so skipping never rescales the gradient. When the loss has
    another per-token term (a reference KL, an entropy bonus: ``needs_ref_logprobs``/``needs_entropy``)
    nothing can be skipped.
    """
    if not config.drop_zero_advantage or as_policy_loss(policy_loss).per_token_terms:
        return list(range(len(datums)))
    return [i for i, d in enumerate(datums) if any(a != 0.0 for a in d.advantages)]


def _fill_logprobs(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    config: UpdateSettings,
    field_name: str,
    *,
    pad_token_id: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    temperature = config.temperature or 1.0

    def forward(m: torch.nn.Module, mb: MicroBatch, device: Any) -> torch.Tensor:
        return micro_batch_logprobs(
            m,
            mb,
            device,
            temperature=temperature,
            needed=mb.action_mask,
            chunk_size=config.features.long_trajectories.chunk_size_for(m),
        )[0]

    name = {"ref_logprobs": "the reference model", "teacher_logprobs": "the teacher"}.get(field_name, "the policy")
    for idx, lp in forward_no_grad(
        accelerator, model, datums, config, forward, pad_token_id=pad_token_id, context=context, name=name
    ):
        for row, i in enumerate(idx):
            n = datums[i].num_tokens
            setattr(datums[i], field_name, [float(x) if m else 0.0 for x, m in zip(lp[row, :n], datums[i].action_mask)])


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
    every rank must call it. Called once per rollout batch, so reused rollouts keep them.

    Args:
        model: The prepared reference model, or the policy when ``context`` disables its adapter (PEFT).
        context: A factory of the context in which ``model`` is the reference (e.g. adapters off).
    """
    _fill_logprobs(accelerator, model, datums, config, "ref_logprobs", pad_token_id=pad_token_id, context=context)


def teacher_logprobs(
    accelerator: Any,
    model: Any,
    datums: Sequence[Datum],
    config: UpdateSettings,
    *,
    pad_token_id: int,
    prompts: Sequence[tuple[list[int], int]] | None = None,
    top_k: int = 0,
) -> None:
    """Fill ``datum.teacher_logprobs`` with the teacher's log-probs of the action tokens at the sampling temperature
    (on-policy distillation); every rank must call it, once per rollout batch. A server teacher scores each datum's
    whole sequence (its ``input_ids`` and last target) from this rank alone, at temperature 1 (the only one a server
    teacher is allowed with); with ``top_k`` it also fills ``datum.teacher_top``, its ``top_k`` most likely tokens at
    each action position (for the ``jsd`` loss).

    Args:
        model: The prepared teacher, or a server teacher's client (:func:`~trl_plugins.trainers.teacher.load_teacher`).
        prompts: Self-distillation: per datum, ``(the teacher's first prompt, the length of the datum's own)``: the
            teacher scores the datum's tokens after its first prompt under that one instead (privileged context), and
            each log-prob goes back to its token's place in the datum.
    """
    scored = list(datums) if prompts is None else [_with_prompt(d, *p) for d, p in zip(datums, prompts)]
    if not isinstance(model, torch.nn.Module):
        real = [d for d in scored if d.num_tokens]
        answers = model.sequence_top_logprobs([list(d.input_ids) + [d.target_ids[-1]] for d in real], top_k=top_k)
        for d, (lp, top) in zip(real, answers):
            d.teacher_logprobs = [float(x) if m else 0.0 for x, m in zip(lp, d.action_mask)]
            if top_k:
                d.teacher_top = [list(t) if m else [] for t, m in zip(top, d.action_mask)]
    else:
        _fill_logprobs(accelerator, model, scored, config, "teacher_logprobs", pad_token_id=pad_token_id)
    if prompts is not None:
        for d, shadow, (prompt, own) in zip(datums, scored, prompts):
            shift = len(prompt) - own
            d.teacher_logprobs = [0.0] * (own - 1) + shadow.teacher_logprobs[own - 1 + shift :]


def server_support(datums: Sequence[Datum], mb: MicroBatch, *, beta: float, top_k: int) -> dict[str, torch.Tensor]:
    """The support a server teacher's divergence is computed on at each of ``mb``'s positions (rows: ``datums``, its
    datums in order; none for a dummy), as ``support_ids``, ``teacher_support`` (the teacher's log-probs there) and
    ``support_mask``, each ``(B, T, S)``: at beta 0 the teacher's ``top_k`` most likely tokens
    (``Datum.teacher_top``); at beta 1 the sampled token (``Datum.teacher_logprobs``); in between the teacher's top
    token and the sampled one, unless they are the same. As TRL's ``ServerDistillationTrainer`` chooses it.

    Raises:
        ValueError: a datum lacks what its support needs (the teacher's phase did not run for it).
    """
    rows, width = mb.target_ids.shape
    size = top_k if beta == 0.0 else 1 if beta == 1.0 else 2
    ids = torch.zeros((rows, width, size), dtype=torch.long)
    teacher = torch.zeros((rows, width, size), dtype=torch.float32)
    mask = torch.zeros((rows, width, size), dtype=torch.bool)
    for b, d in enumerate(datums):
        if d.teacher_logprobs is None or (beta < 1.0 and d.teacher_top is None):
            raise ValueError(
                f"datum of trajectory {d.trajectory_index} has no server teacher's "
                f"{'top tokens' if d.teacher_logprobs is not None else 'log-probs'}: the jsd loss with a server "
                f"teacher reads them from the teacher's phase (teacher_logprobs(..., top_k=)) of every batch."
            )
        for t, on in enumerate(d.action_mask):
            if not on:
                continue
            sampled = (int(d.target_ids[t]), float(d.teacher_logprobs[t]))
            top = [(int(tok), float(lp)) for tok, lp in d.teacher_top[t][:top_k]] if beta < 1.0 else []
            support = top if beta == 0.0 else [sampled] if beta == 1.0 else top[:1] + [sampled] * (top[0] != sampled)
            for k, (tok, lp) in enumerate(support):
                ids[b, t, k], teacher[b, t, k], mask[b, t, k] = tok, lp, True
    return {"support_ids": ids, "teacher_support": teacher, "support_mask": mask}


def _with_prompt(d: Datum, prompt: list[int], own: int) -> Datum:
    """``d`` with its first ``own`` tokens replaced by ``prompt``: a shadow for the teacher's forward (only the fields
    it reads; the tokens after the prompt keep their action mask)."""
    if not 1 <= own <= len(d.input_ids) or not prompt:
        raise ValueError(f"a datum's first prompt of {own} tokens does not fit its {len(d.input_ids) + 1} tokens")
    full = list(prompt) + list(d.input_ids[own:]) + [d.target_ids[-1]]
    head = len(prompt) - 1
    mask = [0] * head + list(d.action_mask[own - 1 :])
    return Datum(
        input_ids=full[:-1],
        target_ids=full[1:],
        behaviour_logprobs=[0.0] * len(mask),
        advantages=[0.0] * len(mask),
        action_mask=mask,
        sources=[TokenSource.PROMPT] * head + list(d.sources[own - 1 :]),
        trajectory_index=d.trajectory_index,
        group_id=d.group_id,
    )


def old_logprobs(
    accelerator: Any, model: torch.nn.Module, datums: Sequence[Datum], config: UpdateSettings, *, pad_token_id: int
) -> None:
    """Fill ``datum.old_logprobs`` with the policy's own no-gradient log-probs at the sampling temperature;
    every rank must call it (same packing, same number of forwards per rank).

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

    It applies when ``vllm_importance_sampling_correction`` is on and either it covers every batch
    (:meth:`~trl_plugins.run.settings.Features.correction_on_every_batch`: scope ``"all"``, or the decoupled
    objective) or any rank holds a trajectory whose log-probs are not the trainer's own
    (``policy_version.logprob_source != TRAINER_LOGPROB_SOURCE``, e.g. vLLM's ``processed``). Every rank
    must call it (one all-reduce in scope ``"foreign"``).

    The run refuses, before any model loads, a loss without ``supports_is_weights`` wherever its sampler makes the
    correction apply; a rollout plugin that brings foreign log-probs the run could not foresee is refused here.

    Raises:
        ValueError: it applies but the policy loss does not declare ``supports_is_weights`` (raised on
            every rank alike).
    """
    features = config.features
    if features.mismatch_correction is None:
        return False
    if features.correction_on_every_batch(foreign_sampler=False):  # scope 'all', or stale tokens (decoupled)
        applies = True
    else:
        foreign = any(
            t.policy_version is not None and t.policy_version.logprob_source != TRAINER_LOGPROB_SOURCE
            for t in trajectories
        )
        (any_foreign,) = reduce_over_ranks(accelerator, [float(foreign)], "max")
        applies = bool(any_foreign)
    loss = as_policy_loss(policy_loss)
    if applies and not loss.supports_is_weights:
        raise ValueError(
            f"the sampler/trainer mismatch correction applies to this batch (vllm_importance_sampling_correction=True, "
            f"mismatch_correction_scope={features.mismatch_correction.scope!r}: its trajectories' log-probs are not "
            f"the trainer's own), but {loss.label} does not declare supports_is_weights: it would drop the importance "
            f"weights. Use policy_loss='ppo_clip', make the plugin apply PolicyLossInput.is_weights, or set "
            f"vllm_importance_sampling_correction=False."
        )
    return applies


def _denominators(accelerator: Any, datums: Sequence[Datum]) -> tuple[float, float]:
    local_tokens = float(sum(d.num_loss_tokens for d in datums))
    local_seqs = float(sum(d.num_loss_tokens > 0 for d in datums))
    num_tokens, num_seqs = reduce_over_ranks(accelerator, [local_tokens, local_seqs], "sum")
    return num_tokens, num_seqs


def _check_inputs(datums: Sequence[Datum], loss: PolicyLossPlugin) -> tuple[bool, bool]:
    with_ref = bool(datums) and all(d.ref_logprobs is not None for d in datums)
    if loss.needs_ref_logprobs and datums and not with_ref:
        raise ValueError(
            "the policy loss reads reference log-probs but the datums carry none; call reference_logprobs() first."
        )
    with_old = bool(datums) and all(d.old_logprobs is not None for d in datums)
    if datums and not with_old and any(d.old_logprobs is not None for d in datums):
        raise ValueError(
            "some datums carry old_logprobs and some do not; call old_logprobs() on every datum the update forwards."
        )
    if with_old and not loss.supports_is_weights:
        raise ValueError(
            f"the datums carry old_logprobs (mismatch correction) but {loss.label} does not declare "
            f"supports_is_weights."
        )
    return with_ref, with_old


def _plan(
    accelerator: Any, datums: list[Datum], config: UpdateSettings, sp: SequenceParallel | None
) -> tuple[list[Datum], list[list[int]], float]:
    """``(datums, this rank's micro-batches, planning seconds)``; with ``rebalance_ranks`` the datums are every
    rank's (gathered, in rank order) and the plan spans the ranks; under sequence parallelism the plan is its group's
    (:func:`~trl_plugins.trainers.sequence_parallel.group_plan`)."""
    start = time.perf_counter()
    world = accelerator.num_processes
    if sp is not None:
        datums, batches = group_plan(datums, config, sp)
    elif config.rebalance_ranks and world > 1:
        from accelerate.utils import gather_object

        datums = [d for part in gather_object([datums]) for d in part]
        batches = plan_for_ranks(datums, config, world)[accelerator.process_index]
    else:
        batches = local_plan(datums, config)
    return datums, batches, time.perf_counter() - start


def _run_pass(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    batches: list[list[int]],
    loss_fn: PolicyLossPlugin,
    config: UpdateSettings,
    *,
    pad_token_id: int,
    num_tokens: float,
    num_seqs: float,
    any_ref: bool,
    correction: MismatchCorrection | None,
    sp: SequenceParallel | None,
    teacher: Any,
) -> _Pass:
    world, device = accelerator.num_processes, accelerator.device
    temperature = config.temperature or 1.0  # greedy sampling keeps log-probs of the unscaled logits
    sync = GradientSync(accelerator, model)
    out = _Pass()
    ensure_layout_checked(accelerator, model, config)
    chunk_size = config.features.long_trajectories.chunk_size_for(model)
    model.train()
    for step in micro_batches(
        accelerator,
        datums,
        batches,
        pad_token_id=pad_token_id,
        padding_free=bool(config.padding_free),
        shared_prefix=shared_prefix_on(config),
        with_ref=any_ref,
    ):
        mb, idx = step.batch, step.datum_indices
        out.steps += 1
        # The importance weights from the whole row (a sequence-level weight spans the shards), before any split.
        is_w = None
        if mb.old_logprobs is not None:
            is_w = importance_weights(
                mb.old_logprobs.to(device),
                mb.behaviour_logprobs.to(device),
                mb.action_mask.to(device),
                correction.mode,
                clip_min=correction.clip_min,
                clip_max=correction.clip_max,
            )
        # Under sequence parallelism this rank's shard of the (one-datum) micro-batch; figures per datum counted once
        # per group, per token on each shard.
        view = mb if sp is None else shard_micro_batch(mb, sp, pad_token_id=pad_token_id)
        first = sp is None or sp.rank == 0
        out.sums.dummies += first and not idx
        out.sums.padded += mb.num_padded_tokens if sp is None else view.input_ids.numel()
        out.sums.real += int(mb.attention_mask.sum()) if sp is None else int(view.real.sum())
        out.sums.computed += mb.num_forwarded_tokens if sp is None else int(view.real.sum())
        mask = view.action_mask.to(device)
        with sync.context(step.last), split_attention() if sp is not None else contextlib.nullcontext():
            divergence = None
            if loss_fn.teacher_divergence is not None and not isinstance(teacher, torch.nn.Module):
                logp, entropy, divergence = micro_batch_logprobs_and_support_divergence(
                    model,
                    mb,
                    device,
                    **server_support(
                        [datums[i] for i in idx], mb, beta=loss_fn.teacher_divergence, top_k=loss_fn.teacher_top_k or 1
                    ),
                    beta=loss_fn.teacher_divergence,
                    tail=loss_fn.teacher_tail is not False,
                    temperature=temperature,
                    with_entropy=loss_fn.needs_entropy,
                    chunk_size=chunk_size,
                )
            elif loss_fn.teacher_divergence is not None:
                logp, entropy, divergence = micro_batch_logprobs_and_divergence(
                    model,
                    teacher,
                    mb,
                    device,
                    beta=loss_fn.teacher_divergence,
                    temperature=temperature,
                    with_entropy=loss_fn.needs_entropy,
                    needed=mb.action_mask,
                    chunk_size=chunk_size,
                )
            elif sp is None:
                logp, entropy = micro_batch_logprobs(
                    model,
                    mb,
                    device,
                    temperature=temperature,
                    with_entropy=loss_fn.needs_entropy,
                    needed=mb.action_mask,
                    chunk_size=chunk_size,
                )
            else:
                logp, entropy = view.logprobs(
                    model, device, temperature=temperature, with_entropy=loss_fn.needs_entropy, chunk_size=chunk_size
                )
            ref = None if view.ref_logprobs is None else view.ref_logprobs.to(device)
            # The PPO anchor: the sampler's log-probs, or with the mismatch correction the trainer's own
            # (pi_old), the sampler-to-trainer gap then going into the importance weights.
            anchor = view.behaviour_logprobs.to(device) if view.old_logprobs is None else view.old_logprobs.to(device)
            weights = None if is_w is None else is_w.weights if sp is None else view.take(is_w.weights).to(device)
            result = loss_fn(
                PolicyLossInput(
                    logprobs=logp,
                    behaviour_logprobs=anchor,
                    advantages=view.advantages.to(device),
                    action_mask=mask,
                    ref_logprobs=ref if loss_fn.needs_ref_logprobs else None,
                    entropy=entropy,
                    is_weights=weights,
                    turn_ids=_turn_ids(view, device) if loss_fn.needs_turn_ids else None,
                    teacher_divergence=divergence,
                )
            )
            loss = (
                aggregate(
                    result.per_token_loss,
                    mask,
                    config.aggregation,
                    num_tokens=num_tokens,
                    num_sequences=num_seqs,
                    norm_length=config.norm_length,
                    dp_size=world,
                    row_tokens=None if sp is None else view.row_tokens.to(device),
                )
                * mb.weight
            )
            sync.backward(loss)
        out.sums.loss += float(loss.detach()) / world
        if not idx:
            continue
        out.stats = result.stats if out.stats is None else out.stats.merge(result.stats)
        if is_w is not None and first:
            out.mismatch = is_w.stats if out.mismatch is None else out.mismatch.merge(is_w.stats)
        out.ratios.append(importance_ratios(logp, anchor, mask).cpu())
        out.sums.forwarded_tokens += float(mask.sum())
        with torch.no_grad():
            if ref is not None:
                on = mask.bool()
                safe_ref = torch.where(on, ref, logp.detach())
                # pi / pi_behaviour, as in PPOClipLoss's importance-weighted KL term: ~1 on fresh HF generate tokens.
                kl_w = torch.exp((logp.detach() - torch.where(on, anchor, logp.detach())).clamp(-20.0, 20.0)) * mask
                if weights is not None:
                    kl_w = kl_w * weights
                for est in KLEstimator:
                    setattr(
                        out.sums,
                        f"kl_{est.value}",
                        getattr(out.sums, f"kl_{est.value}")
                        + float((kl_estimate(logp.detach(), safe_ref, est) * kl_w).sum()),
                    )
                out.sums.ref_logprob_gap += float(((logp.detach() - safe_ref).abs() * mask).sum())
            if entropy is not None:
                out.sums.entropy += float((entropy.detach() * mask).sum())
    sync.finish()
    return out


def policy_update(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    datums: Sequence[Datum],
    policy_loss: Any,
    config: UpdateSettings,
    *,
    pad_token_id: int,
    step_optimizer: bool = True,
    sequence_parallel: SequenceParallel | None = None,
    teacher: Any = None,
) -> UpdateResult:
    """Run one exact update on this rank's ``datums``; every rank must call it (collectives inside).

    Args:
        accelerator: The ``accelerate.Accelerator`` that prepared ``model`` and ``optimizer``.
        model: The prepared (DDP- or DeepSpeed-wrapped) policy.
        optimizer: The prepared optimizer.
        datums: This rank's datums (may be empty).
        policy_loss: A policy-loss plugin (its declarations are read: :func:`~trl_plugins.protocols.as_policy_loss`).
        config: The run's config (:class:`UpdateSettings`): aggregation, packer and its limits, ``padding_free``,
            ``rebalance_ranks``, ``norm_length``, the sampling ``temperature`` (log-probs are taken from
            ``logits / temperature`` like the behaviour ones; 0, greedy, keeps the unscaled logits), ``max_grad_norm``
            (clipping when > 0; skipped under DeepSpeed, which clips by its own config) and ``drop_zero_advantage``
            (skip the forward of datums that add exactly 0: :func:`datums_to_forward`).
        pad_token_id: Padding id for collation.
        step_optimizer: Step and zero the optimizer here (DDP/single process). ``False`` when a caller
            such as the HF Trainer loop clips and steps itself right after. Under DeepSpeed the engine
            steps in the last backward either way.
        sequence_parallel: This rank's group (:func:`~trl_plugins.trainers.sequence_parallel.setup_sequence_parallel`):
            each datum's tokens are split over the group's ranks in the forward and backward; None: off.
        teacher: The prepared teacher (:func:`~trl_plugins.trainers.teacher.load_teacher`), for a loss that declares
            ``teacher_divergence``; forwarded in each micro-batch without gradient. A server teacher's client: its top
            tokens, which the datums carry (``Datum.teacher_top``), are compared instead (:func:`server_support`).

    Returns:
        Global numbers of the update (the same on every rank).
    """
    loss_fn = as_policy_loss(policy_loss)
    if loss_fn.teacher_divergence is not None and (teacher is None or sequence_parallel is not None):
        raise ValueError(
            f"{loss_fn.label} reads the divergence to a teacher: policy_update needs teacher= (the run's "
            f"teacher_model_name_or_path)"
            + (", without sequence parallelism." if sequence_parallel is not None else ".")
        )
    datums = list(datums)
    # 1. denominators: every datum this step trains on, skipped zero-advantage ones included.
    num_tokens, num_seqs = _denominators(accelerator, datums)
    datums = [datums[i] for i in datums_to_forward(datums, loss_fn, config)]
    with_ref, with_old = _check_inputs(datums, loss_fn)
    # 2. plan.
    sp = sequence_parallel
    datums, batches, packing_s = _plan(accelerator, datums, config, sp)
    mine = float(sum(len(idx) for idx in batches)) if sp is None or sp.rank == 0 else 0.0  # a group's datums once
    forwarded, any_ref, any_old = reduce_over_ranks(accelerator, [mine, float(with_ref), float(with_old)], "sum")
    any_ref, any_old = any_ref > 0, any_old > 0
    correction = config.features.mismatch_correction if any_old else None
    if any_old and correction is None:
        raise ValueError(
            "the datums carry old_logprobs, which only the sampler/trainer mismatch correction reads, but it is off "
            "(vllm_importance_sampling_correction=False): call old_logprobs() only where mismatch_correction_applies()."
        )
    # 3. pass.
    done = _run_pass(
        accelerator,
        model,
        datums,
        batches,
        loss_fn,
        config,
        pad_token_id=pad_token_id,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        any_ref=any_ref,
        correction=correction,
        sp=sp,
        teacher=teacher,
    )
    # 4. step.
    grad_norm = None
    if not is_deepspeed(accelerator) and step_optimizer:
        if config.max_grad_norm is not None and config.max_grad_norm > 0:
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # 5. statistics over the ranks.
    qs = (0.1, 0.5, 0.9)
    all_r = gather_values(accelerator, torch.cat(done.ratios) if done.ratios else torch.zeros(0))
    ratio_qs = (
        {f"ratio_p{int(q * 100)}": v for q, v in zip(qs, quantiles(all_r, qs).tolist())} if all_r.numel() else None
    )
    sums = merge_over_ranks(accelerator, done.sums, _PassSums)
    total = {f.name: float(getattr(sums, f.name)) for f in fields(_PassSums)}
    denom = max(total["forwarded_tokens"], 1.0)
    mismatch = merge_over_ranks(accelerator, done.mismatch, MismatchStats) if any_old else None
    return UpdateResult(
        loss=total["loss"],
        num_micro_batches=done.steps,
        num_dummies=int(total["dummies"]),
        num_loss_tokens=int(num_tokens),
        num_sequences=int(num_seqs),
        num_padded_tokens=int(total["padded"]),
        num_input_tokens=int(total["real"]),
        num_computed_tokens=int(total["computed"]),
        stats=merge_over_ranks(accelerator, done.stats, PolicyLossStats),
        grad_norm=grad_norm,
        packing_s=packing_s,
        ratio_quantiles=ratio_qs,
        num_forwarded=int(forwarded),
        reference={k: total[k] / denom for k in ("kl_k1", "kl_k2", "kl_k3", "ref_logprob_gap")} if any_ref else None,
        entropy=total["entropy"] / denom if loss_fn.needs_entropy else None,
        mismatch=None if mismatch is None else mismatch.summary(correction.mode),
    )


def _turn_ids(mb: Any, device: Any) -> torch.Tensor:
    """The micro-batch's turn ids on ``device`` for a loss that needs them.

    Raises:
        ValueError: datums built without turn ids (by hand, before they existed).
    """
    if mb.turn_ids is None:
        raise ValueError(
            "the policy loss needs turn ids (needs_turn_ids), but the micro-batch's datums carry none: "
            "build them with trl_plugins.datum.build_datums."
        )
    return mb.turn_ids.to(device)
