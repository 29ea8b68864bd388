"""The critic of actor-critic PPO: a value model initialised from the policy, its own optimizer, and
an exact value update on any number of ranks (glue; the maths is in :mod:`trl_plugins.algos`).

The critic is the policy's architecture with a one-output token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``, the head zero-initialised so every value starts
at 0), its backbone copied from the policy. ``V_t`` is read at datum position ``t``: the state before
``target_ids[t]``, the same right-shifted positions as the log-probs. It is prepared like the policy
(DDP; under DeepSpeed its own engine from the run's DeepSpeed config, sharded under ZeRO-3) and trained
with its own AdamW and learning rate (``critic_learning_rate``), once per step, right after the policy.

:func:`rollout_values` takes the values once per rollout batch (the clipped value loss's "old" values,
plus, for a datum that bootstraps (a truncated trajectory under ``truncated_policy='bootstrap'``), the value
of the state after its last token); :func:`value_update` minimises the clipped value loss with the same global
denominators, dummy micro-batches and single synchronisation as :func:`~trl_plugins.trainers.update.policy_update`,
through the same micro-batch loop.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from trl_plugins.algos import aggregate, clipped_value_loss
from trl_plugins.modeling import gather_positions, model_inputs, shared_prefix_outputs, unpack
from trl_plugins.trainers.micro_batches import (
    GradientSync,
    ensure_layout_checked,
    forward_no_grad,
    local_plan,
    micro_batches,
    shared_prefix_on,
)
from trl_plugins.trainers.ranks import is_deepspeed, merge_over_ranks, reduce_over_ranks
from trl_plugins.trainers.update import UpdateSettings
from trl_plugins.types import Datum, MicroBatch

__all__ = [
    "build_critic",
    "prepare_critic",
    "critic_values",
    "micro_batch_values",
    "rollout_values",
    "value_update",
    "ValueUpdateResult",
    "save_critic",
    "load_critic",
    "critic_state_dict",
]

CRITIC_DIR = "critic"
"""Sub-folder of a checkpoint that holds the critic and its optimizer."""


def build_critic(policy: Any, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A value model with the policy's architecture and backbone weights and a zero-initialised 1-output head.

    Args:
        policy: The policy model (an instance, not yet wrapped) or its path.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if isinstance(policy, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(policy)
        source = AutoModelForCausalLM.from_pretrained(policy, dtype=dtype or "auto")
    else:
        config, source = copy.deepcopy(policy.config), policy
    config.num_labels = 1
    config.classifier_dropout = 0.0  # values must not depend on train/eval mode
    dtype = next(source.parameters()).dtype
    # Under ZeRO-3, transformers builds the critic partitioned (zero.Init); its weights are then written
    # inside GatheredParameters by rank 0 and scattered when the context exits.
    critic = AutoModelForTokenClassification.from_config(config, dtype=dtype)
    from transformers.integrations import is_deepspeed_zero3_enabled

    source_backbone = getattr(source, source.base_model_prefix)
    if is_deepspeed_zero3_enabled():
        import deepspeed

        # The policy may be partitioned too (from_pretrained under ZeRO-3): gather it to copy (every rank).
        with deepspeed.zero.GatheredParameters(list(source_backbone.parameters())):
            backbone = {k: v.detach().clone() for k, v in source_backbone.state_dict().items()}
        with deepspeed.zero.GatheredParameters(list(critic.parameters()), modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                _initialise(critic, backbone)
    else:
        _initialise(critic, source_backbone.state_dict())
    return critic


def _initialise(critic: torch.nn.Module, backbone: dict) -> None:
    getattr(critic, critic.base_model_prefix).load_state_dict(backbone)
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()


def prepare_critic(
    accelerator: Any,
    critic: torch.nn.Module,
    *,
    learning_rate: float,
    weight_decay: float = 0.0,
    optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Wrap the critic like the policy and give it its own optimizer (AdamW): ``(model, optimizer)``.

    Under DeepSpeed it becomes its own engine (the run's DeepSpeed config without the optimizer and
    scheduler blocks; ZeRO-3 shards it like the policy); otherwise ``accelerator.prepare_model`` (DDP
    when several processes).
    """
    if is_deepspeed(accelerator):
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        config.setdefault("zero_allow_untested_optimizer", True)  # a torch optimizer, as the HF Trainer allows
        optimizer = optimizer_cls(critic.parameters(), lr=learning_rate, weight_decay=weight_decay)
        engine, optimizer, *_ = deepspeed.initialize(model=critic, optimizer=optimizer, config=config)
        return engine, optimizer
    model = accelerator.prepare_model(critic)
    return model, optimizer_cls(model.parameters(), lr=learning_rate, weight_decay=weight_decay)


def critic_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T)`` values ``V_t`` of the states ``input_ids[:, : t + 1]``, in float32 at least (``position_ids``
    with ``attention_mask=None``: packed sequences)."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    values = critic(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits[..., 0]
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def micro_batch_values(critic: torch.nn.Module, mb: MicroBatch, device: Any) -> torch.Tensor:
    """:func:`critic_values` of a micro-batch in any layout (:func:`~trl_plugins.modeling.model_inputs`; the
    shared-prefix one: :func:`~trl_plugins.modeling.shared_prefix_outputs`), ``(B, T)``, 0 on padding in the
    padding-free and shared-prefix layouts."""
    if mb.shared_prefix is not None:
        values = gather_positions(
            tuple(part[..., 0] for part in shared_prefix_outputs(critic, mb.shared_prefix, device)), mb
        )
        return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values
    return unpack(critic_values(critic, **model_inputs(mb, device)), mb)


def rollout_values(
    accelerator: Any, critic: torch.nn.Module, datums: Sequence[Datum], config: UpdateSettings, *, pad_token_id: int
) -> list[float]:
    """Fill ``datum.old_values`` and return, per datum, the value of the state after its last token (0.0 for a datum
    that does not bootstrap).

    One forward per packed micro-batch (:func:`~trl_plugins.trainers.micro_batches.forward_no_grad`); a datum with
    ``bootstrap_mask`` 1 is forwarded as ``input_ids + [last target]``, so that position ``T`` is the state it
    bootstraps from (the one token more that the start-up check counts), the others as they are. Every rank must
    call it.
    """
    forwarded = [
        Datum(
            input_ids=d.input_ids + d.target_ids[-1:],
            target_ids=d.target_ids + [pad_token_id],
            behaviour_logprobs=d.behaviour_logprobs + [0.0],
            advantages=d.advantages + [0.0],
            action_mask=d.action_mask + [0],
            sources=list(d.sources) + [d.sources[-1]],
        )
        if d.bootstrap_mask
        else d
        for d in datums
    ]
    after = [0.0] * len(datums)

    for idx, values in forward_no_grad(
        accelerator, critic, forwarded, config, micro_batch_values, pad_token_id=pad_token_id, name="the critic"
    ):
        for row, i in enumerate(idx):
            n = datums[i].num_tokens
            datums[i].old_values = [float(v) for v in values[row, :n]]
            if datums[i].bootstrap_mask:
                after[i] = float(values[row, n])
    return after


@dataclass
class ValueUpdateResult:
    """What one critic update did (global numbers, the same on every rank)."""

    loss: float
    """Aggregated clipped value loss of the step (token mean over the global action tokens, times ``vf_coef``)."""
    clip_frac: float
    """Action tokens where the clipped branch of the value loss was taken."""
    explained_variance: float
    """``1 - Var(returns - old values) / Var(returns)`` over the global action tokens."""
    returns_mean: float
    returns_std: float
    values_mean: float
    """Mean rollout-time value over the global action tokens."""
    num_micro_batches: int


@dataclass
class _TargetSums:
    """Sums over the action tokens of the value targets and rollout-time values (each a sum over ranks)."""

    num_tokens: float = 0.0
    returns: float = 0.0
    returns_sq: float = 0.0
    errors: float = 0.0
    errors_sq: float = 0.0
    values: float = 0.0
    sequences: float = 0.0


def value_update(
    accelerator: Any,
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    datums: Sequence[Datum],
    config: UpdateSettings,
    *,
    vf_clip: float,
    vf_coef: float,
    max_grad_norm: float | None,
    pad_token_id: int,
) -> ValueUpdateResult:
    """One exact critic step on this rank's ``datums`` (with ``old_values`` and ``returns``); every rank calls it.

    The loss is ``vf_coef * sum_t 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old +- vf_clip) - R_t)^2) / N_tok``
    over action tokens, ``N_tok`` counted over every rank; micro-batches are the configured packer's, run by the
    update's own micro-batch loop (:mod:`~trl_plugins.trainers.micro_batches`).
    """
    world = accelerator.num_processes
    datums = list(datums)
    if any(d.old_values is None or d.returns is None for d in datums):
        raise ValueError(
            "value_update needs datums with old_values and returns; call rollout_values() and the advantages first."
        )
    # Global statistics of the targets (explained variance, logging), in float64.
    local = _TargetSums(sequences=float(sum(d.num_loss_tokens > 0 for d in datums)))
    for d in datums:
        m = torch.tensor(d.action_mask, dtype=torch.float64)
        r, v = torch.tensor(d.returns, dtype=torch.float64), torch.tensor(d.old_values, dtype=torch.float64)
        local.num_tokens += float(m.sum())
        local.returns += float((r * m).sum())
        local.returns_sq += float((r * r * m).sum())
        local.errors += float(((r - v) * m).sum())
        local.errors_sq += float(((r - v) ** 2 * m).sum())
        local.values += float((v * m).sum())
    g = merge_over_ranks(accelerator, local, _TargetSums)
    n = float(g.num_tokens) if g is not None else 0.0
    num_tokens = max(n, 1.0)
    num_seqs = float(g.sequences) if g is not None else 0.0
    device = accelerator.device
    sync = GradientSync(accelerator, critic, engine=True)
    loss_total = clipped = 0.0
    steps = 0
    ensure_layout_checked(accelerator, critic, config, name="the critic")
    critic.train()
    for step in micro_batches(
        accelerator,
        datums,
        local_plan(datums, config),
        pad_token_id=pad_token_id,
        padding_free=bool(config.padding_free),
        shared_prefix=shared_prefix_on(config),
        with_values=True,
    ):
        mb = step.batch
        steps += 1
        mask = mb.action_mask.to(device)
        with sync.context(step.last):
            values = micro_batch_values(critic, mb, device)
            out = clipped_value_loss(values, mb.old_values.to(device), mb.returns.to(device), mask, clip_range=vf_clip)
            loss = (
                vf_coef
                * aggregate(
                    out.per_token_loss, mask, "token_mean", num_tokens=num_tokens, num_sequences=num_seqs, dp_size=world
                )
                * mb.weight
            )
            sync.backward(loss)
        loss_total += float(loss.detach()) / world
        clipped += float(out.clipped)
    if is_deepspeed(accelerator):
        critic.step()
    else:
        if max_grad_norm is not None and max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss_sum, clipped_all = reduce_over_ranks(accelerator, [loss_total, clipped], "sum")
    r_sum, r_sq = (float(g.returns), float(g.returns_sq)) if g is not None else (0.0, 0.0)
    e_sum, e_sq = (float(g.errors), float(g.errors_sq)) if g is not None else (0.0, 0.0)
    v_sum = float(g.values) if g is not None else 0.0
    r_mean = r_sum / num_tokens
    r_var = max(r_sq / num_tokens - r_mean**2, 0.0)
    e_var = max(e_sq / num_tokens - (e_sum / num_tokens) ** 2, 0.0)
    return ValueUpdateResult(
        loss=loss_sum,
        clip_frac=clipped_all / num_tokens,
        explained_variance=1.0 - e_var / r_var if r_var > 0 else 0.0,
        returns_mean=r_mean,
        returns_std=r_var**0.5,
        values_mean=v_sum / num_tokens,
        num_micro_batches=steps,
    )


def save_critic(accelerator: Any, critic: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Save the critic and its optimizer under ``folder/critic`` (every rank calls it)."""
    path = os.path.join(folder, CRITIC_DIR)
    if is_deepspeed(accelerator):
        critic.save_checkpoint(path, tag="state")
        return
    if accelerator.is_main_process:
        os.makedirs(path, exist_ok=True)
        torch.save(
            {"model": accelerator.unwrap_model(critic).state_dict(), "optimizer": optimizer.state_dict()},
            os.path.join(path, "state.pt"),
        )
    accelerator.wait_for_everyone()


def load_critic(accelerator: Any, critic: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Restore what :func:`save_critic` wrote (every rank calls it).

    Raises:
        FileNotFoundError: the checkpoint has no critic (it was saved by a run without one).
    """
    path = os.path.join(folder, CRITIC_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{folder} has no {CRITIC_DIR}/ folder: it was saved by a run without a critic; resume with the "
            f"advantage estimator it was trained with, or start the critic afresh from a new run."
        )
    if is_deepspeed(accelerator):
        critic.load_checkpoint(path, tag="state")
        return
    state = torch.load(os.path.join(path, "state.pt"), map_location=accelerator.device, weights_only=True)
    accelerator.unwrap_model(critic).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def critic_state_dict(accelerator: Any, critic: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The critic's full weights on every rank (gathered under ZeRO-3); every rank must call it."""
    if is_deepspeed(accelerator):
        module = critic.module
        if critic.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {k: v.detach().clone() for k, v in module.state_dict().items()}
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(critic).state_dict().items()}
