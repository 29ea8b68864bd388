"""Every field of TRL's ``GRPOConfig``: honoured, mapped onto our plugins, or refused.

``MultiTurnGRPOConfig`` inherits all of ``GRPOConfig`` (its own fields and ``TrainingArguments'``),
so ``--help`` offers each of them. This trainer replaces TRL's rollout, scoring, advantages and loss,
so a field TRL reads there would be silently ignored. :data:`TRL_FIELDS` says, for each one, what it
does here; :func:`apply_trl_fields` (run by ``MultiTurnGRPOConfig.__post_init__``, before any model
loads) refuses the settings that would have no or another effect and writes the mapped ones into our
plugin settings. ``tests/test_trl_fields.py`` fails when the installed TRL adds or drops a field, and
``docs/training.md`` carries :func:`render_table`'s output.

"The user set it" means: the value differs from ``GRPOConfig``'s default (after TRL's own
``__post_init__``), because a dataclass cannot tell an explicit default from an omitted one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable

from trl_plugins.run.plugins import plugin_params
from trl_plugins.types import AggregationMode

__all__ = ["FieldKind", "FieldRule", "TRL_FIELDS", "apply_trl_fields", "render_table", "is_set"]


class FieldKind(enum.StrEnum):
    """What a TRL field does in ``MultiTurnGRPOTrainer``."""

    HONOURED = "honoured"
    """Same meaning as in TRL (read by TRL's ``__init__``, the HF Trainer loop or our own code)."""
    MAPPED = "mapped"
    """TRL's name sets one of our settings (a plugin kwarg, ``aggregation``, ``truncated_policy``, ...)."""
    REFUSED = "refused"
    """A value other than the default raises at start-up, saying what to use instead."""


@dataclass(frozen=True)
class FieldRule:
    """The fate of one TRL field."""

    kind: FieldKind
    reason: str
    """One line: what it does here, or why it is refused and what to use instead."""
    ok: Callable[[Any], bool] | None = None
    """``config -> bool``: False refuses the config. Default for ``REFUSED``: the field is not set."""
    apply: Callable[[Any], None] | None = None
    """``MAPPED`` only: writes the field into our settings; idempotent, raises on a conflict."""
    owner: str | None = None
    """Where the rule is enforced when not here; :func:`apply_trl_fields` skips such fields."""


@functools.cache
def _trl_defaults() -> dict[str, Any]:
    from trl import GRPOConfig

    out = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def is_set(config: Any, name: str) -> bool:
    """Whether TRL field ``name`` differs from ``GRPOConfig``'s default (enums compared by value)."""
    return _plain(getattr(config, name)) != _plain(_trl_defaults().get(name))


def _own_default(config: Any, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(config)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _set_field(config: Any, trl_name: str, name: str, value: Any) -> None:
    """``config.<name> = value`` unless the user set ``name`` (off its default) to something else."""
    current = getattr(config, name)
    if current != _own_default(config, name) and current != value:
        raise ValueError(
            f"{trl_name}={getattr(config, trl_name)!r} means {name}={value!r}, but {name}={current!r} is set too; "
            f"set only one of them."
        )
    setattr(config, name, value)


def _set_kwarg(config: Any, trl_name: str, plugin_field: str, kwarg: str, value: Any) -> None:
    """``config.<plugin_field>_kwargs[kwarg] = value`` when the selected plugin takes ``kwarg``."""
    from trl_plugins.registry import ADVANTAGES, POLICY_LOSSES

    registry = {"policy_loss": POLICY_LOSSES, "advantage": ADVANTAGES}[plugin_field]
    plugin = getattr(config, plugin_field)
    kwargs_name = f"{plugin_field}_kwargs"
    params = plugin_params(registry.get(plugin))
    if params is not None and kwarg not in params:
        raise ValueError(
            f"{trl_name}={getattr(config, trl_name)!r} sets {kwargs_name}[{kwarg!r}], but {plugin_field} {plugin!r} "
            f"takes no {kwarg} (it takes {sorted(params)}); leave {trl_name} at its default and configure the plugin "
            f"in {kwargs_name}."
        )
    kwargs = getattr(config, kwargs_name)
    if kwarg in kwargs and kwargs[kwarg] != value:
        raise ValueError(
            f"{trl_name}={getattr(config, trl_name)!r} means {kwargs_name}[{kwarg!r}]={value!r}, but {kwargs_name} "
            f"sets {kwarg}={kwargs[kwarg]!r}; set only one of them."
        )
    kwargs[kwarg] = value


# -- mappings (each idempotent: a second run finds its own result and changes nothing) ----------------


def _map_epsilon(c: Any) -> None:
    if is_set(c, "epsilon"):
        _set_kwarg(c, "epsilon", "policy_loss", "clip_low", c.epsilon)


def _map_epsilon_high(c: Any) -> None:
    # None keeps the plugin's own upper bound (ppo_clip: 0.28), not TRL's "= epsilon".
    if c.epsilon_high is not None:
        _set_kwarg(c, "epsilon_high", "policy_loss", "clip_high", c.epsilon_high)


def _map_delta(c: Any) -> None:
    # TRL clamps the ratio at delta; for negative advantages that is ppo_clip's dual clip at delta, and for positive
    # ones it changes nothing while delta lies above the upper clip bound: ppo_clip itself refuses a dual clip at or
    # below 1 + clip_high when it is built (its clip_high default lives in its signature only).
    if c.delta is not None:
        _set_kwarg(c, "delta", "policy_loss", "dual_clip", c.delta)


_LOSS_TYPE_AGGREGATION = {
    "dapo": AggregationMode.TOKEN_MEAN,
    "grpo": AggregationMode.SEQ_MEAN_TOKEN_MEAN,
    "dr_grpo": AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM,
    "luspo": AggregationMode.SEQ_MEAN_TOKEN_SUM,
}
_LOSS_TYPE_REFUSED = {
    "bnpo": "divides by each micro-batch's own token count; use loss_type='dapo' (aggregation='token_mean', "
    "the exact global token mean)",
    "cispo": "is another policy loss (clipped-ratio REINFORCE)",
    "sapo": "is another policy loss (soft sigmoid gate instead of the clip)",
    "vespo": "is another policy loss (sequence-level gamma weights)",
}


def _map_loss_type(c: Any) -> None:
    if not is_set(c, "loss_type"):
        return
    if c.loss_type in _LOSS_TYPE_REFUSED:
        raise ValueError(
            f"loss_type={c.loss_type!r} {_LOSS_TYPE_REFUSED[c.loss_type]}; no built-in policy-loss plugin implements "
            f"it: register one in trl_plugins.registry.POLICY_LOSSES, select it with policy_loss, and leave loss_type "
            f"at 'dapo' (the aggregation is set by `aggregation`)."
        )
    if c.loss_type not in _LOSS_TYPE_AGGREGATION:
        raise ValueError(
            f"loss_type={c.loss_type!r} is not a TRL loss type; choose one of {sorted(_LOSS_TYPE_AGGREGATION)}."
        )
    _set_field(c, "loss_type", "aggregation", str(_LOSS_TYPE_AGGREGATION[c.loss_type]))
    if c.loss_type == "dr_grpo" and c.norm_length is None:
        # TRL's Dr. GRPO divides by max_completion_length: keep its scale.
        c.norm_length = float(c.max_completion_length)


def _map_max_completion_length(c: Any) -> None:
    if not is_set(c, "max_completion_length"):
        return
    if AggregationMode(c.aggregation) != AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM:
        raise ValueError(
            f"max_completion_length={c.max_completion_length}: the rollout has its own budgets, so it would only set "
            f"the Dr. GRPO constant (loss_type='dr_grpo'); set rollout_kwargs max_assistant_tokens (per turn) and "
            f"max_trajectory_tokens instead."
        )
    _set_field(c, "max_completion_length", "norm_length", float(c.max_completion_length))


def _map_scale_rewards(c: Any) -> None:
    if not is_set(c, "scale_rewards"):
        return
    if c.scale_rewards == "batch":
        raise ValueError(
            "scale_rewards='batch': advantages are scaled by the group's std or not at all; use scale_rewards='group' "
            "or 'none' (advantage_kwargs scale_by_std)."
        )
    if c.scale_rewards != "none":
        raise ValueError(f"scale_rewards={c.scale_rewards!r}: use 'group', 'none' or 'batch' (TRL's values).")
    _set_kwarg(c, "scale_rewards", "advantage", "scale_by_std", False)


def _map_mask_truncated_completions(c: Any) -> None:
    if c.mask_truncated_completions:
        _set_field(c, "mask_truncated_completions", "truncated_policy", "mask")


# -- the table ----------------------------------------------------------------------------------------

_H, _M, _R = FieldKind.HONOURED, FieldKind.MAPPED, FieldKind.REFUSED
_EVAL = "a setting of the evaluation loop, which is refused (see eval_strategy)"
_VLLM = "passed to vLLM by TRL's VLLMGeneration"
_ENTROPY = "adaptive entropy control (Skywork-OR1) is not implemented; set a fixed entropy_coef"
_REF_SYNC = "the reference model is never synchronised with the policy (TR-DPO is not implemented)"
_LOGS = "a setting of log_completions, which is refused; trajectory_table_steps/_rows log multi-turn tables"
_CB_OWNER = "MultiTurnGRPOConfig._check_continuous_batching"
_ONE_STEP = (
    "one step is one rollout batch and one optimizer update: keep gradient_accumulation_steps=1 and "
    "steps_per_generation=1 (micro-batching is the packer's job: max_items_per_micro_batch, "
    "max_padded_tokens_per_micro_batch; num_iterations reuses a rollout)"
)
_HF = "the HF Trainer loop"
_KL_OWNER = "MultiTurnGRPOConfig._map_kl_and_entropy"
_IS_OWNER = "MultiTurnGRPOConfig._check_mismatch_correction"


def _vllm_setting(name: str, mode: str | None) -> Callable[[Any], bool]:
    # A vLLM setting does something only with use_vllm, and a colocate (server) one only in that mode.
    def ok(c: Any) -> bool:
        return not is_set(c, name) or (bool(c.use_vllm) and (mode is None or c.vllm_mode == mode))

    return ok


_COLOCATE_ONLY = (
    "; refused when set (off TRL's default) without use_vllm or with vllm_mode='server', where it would "
    "do nothing: {instead}, or use vllm_mode='colocate'."
)
_ON_THE_SERVER = "set it where the server starts instead (trl vllm-serve {flag}) and drop it here"
_SERVER_ONLY = "; refused when set without use_vllm or with vllm_mode='colocate', where it would do nothing."


def _generation_batch_ok(c: Any) -> bool:
    # What TRL derives when neither generation_batch_size nor steps_per_generation is given.
    return c.generation_batch_size == c.per_device_train_batch_size * c.world_size * c.gradient_accumulation_steps


TRL_FIELDS: dict[str, FieldRule] = {
    # GRPOConfig's own fields: the algorithm
    "epsilon": FieldRule(
        _M, "policy_loss_kwargs['clip_low']: the ratio's lower bound 1 - epsilon.", apply=_map_epsilon
    ),
    "epsilon_high": FieldRule(
        _M,
        "policy_loss_kwargs['clip_high']: upper bound 1 + epsilon_high; None keeps the policy loss's own (ppo_clip: "
        "0.28, where TRL takes epsilon).",
        apply=_map_epsilon_high,
    ),
    "delta": FieldRule(
        _M,
        "policy_loss_kwargs['dual_clip']: caps a negative-advantage token's ratio at delta, exactly TRL's two-sided "
        "clip when delta > 1 + clip_high (refused otherwise).",
        apply=_map_delta,
    ),
    "loss_type": FieldRule(
        _M,
        "aggregation: dapo = token_mean, grpo = seq_mean_token_mean, dr_grpo = seq_mean_token_sum_norm (norm_length "
        "= max_completion_length), luspo = seq_mean_token_sum; bnpo, cispo, sapo, vespo refused.",
        apply=_map_loss_type,
    ),
    "max_completion_length": FieldRule(
        _M,
        "only the Dr. GRPO constant norm_length (with seq_mean_token_sum_norm); refused otherwise when changed: "
        "generation budgets are rollout_kwargs max_assistant_tokens / max_trajectory_tokens.",
        apply=_map_max_completion_length,
    ),
    "scale_rewards": FieldRule(
        _M,
        "advantage_kwargs['scale_by_std']: 'group' (or True) keeps the group std, 'none' (or False) sets False; "
        "'batch' refused.",
        apply=_map_scale_rewards,
    ),
    "mask_truncated_completions": FieldRule(
        _M,
        "True sets truncated_policy='mask' (which also leaves them out of their group's mean and std; TRL keeps "
        "their rewards there).",
        apply=_map_mask_truncated_completions,
    ),
    "entropy_coef": FieldRule(
        _M, "policy_loss_kwargs['entropy_coef'] (mapped with the entropy bonus's checks).", owner=_KL_OWNER
    ),
    "beta": FieldRule(
        _H,
        "reference-KL coefficient: policy_loss_kwargs kl_coef (kl_penalty='loss') or a KL reward "
        "(kl_penalty='reward').",
        owner=_KL_OWNER,
    ),
    "num_generations": FieldRule(_H, "group size: each question is rolled out this many times, on one rank."),
    "num_iterations": FieldRule(
        _H,
        "updates per rollout: one rollout's datums serve k steps; the ratio is taken against the sampler's log-probs "
        "(the trainer's own pi_old when the mismatch correction applies).",
    ),
    "temperature": FieldRule(
        _H, "sampling temperature (hf_backend) and the temperature of the update's log-probs, as in TRL."
    ),
    "top_p": FieldRule(
        _H,
        "passed to HF generate by hf_backend (behaviour log-probs are of the temperature-scaled distribution, as "
        "TRL's).",
    ),
    "top_k": FieldRule(_H, "passed to HF generate by hf_backend (0: off)."),
    "min_p": FieldRule(_H, "passed to HF generate by hf_backend (None: off)."),
    "repetition_penalty": FieldRule(_H, "passed to HF generate by hf_backend."),
    "shuffle_dataset": FieldRule(_H, "TRL's RepeatSampler shuffles the questions with seed."),
    "model_init_kwargs": FieldRule(
        _H, "TRL loads a policy given by name with them (ignored with TRL's warning for a model instance)."
    ),
    "trust_remote_code": FieldRule(_H, "TRL passes it to model and tokenizer loading."),
    "disable_dropout": FieldRule(
        _H,
        "True: every dropout of the policy, its reference and the critic set to 0, attention dropout included (TRL's "
        "disable_dropout_in_model sets nn.Dropout only). False (TRL's default) with any dropout in the policy's "
        "config or modules is refused, as lora_dropout is.",
    ),
    "cast_lm_head_to_fp32": FieldRule(
        _H, "TRL's __init__ casts the policy's lm_head to fp32; our forward and generation use that model."
    ),
    "importance_sampling_level": FieldRule(
        _R,
        "'sequence' (GSPO): the policy losses here use token-level ratios; register a sequence-level policy-loss "
        "plugin.",
    ),
    "top_entropy_quantile": FieldRule(_R, "below 1: the update has no high-entropy token mask."),
    "off_policy_mask_threshold": FieldRule(
        _R, "off-policy sequence masking is not implemented (the clip bounds and dual_clip limit stale tokens)."
    ),
    "use_bias_correction_kl": FieldRule(
        _M,
        "policy_loss_kwargs['kl_importance_weight'] with beta > 0 and kl_penalty='loss': the KL term times the "
        "differentiable importance ratio, as in TRL (default True).",
        owner=_KL_OWNER,
    ),
    "router_aux_loss_coef": FieldRule(
        _R,
        "the update adds no MoE load-balancing loss (TRL adds the model's own coefficient even at None, so train "
        "dense models).",
    ),
    "sapo_temperature_neg": FieldRule(_R, "read only by loss_type='sapo', which is refused."),
    "sapo_temperature_pos": FieldRule(_R, "read only by loss_type='sapo', which is refused."),
    "vespo_k_pos": FieldRule(_R, "read only by loss_type='vespo', which is refused."),
    "vespo_lambda_pos": FieldRule(_R, "read only by loss_type='vespo', which is refused."),
    "vespo_k_neg": FieldRule(_R, "read only by loss_type='vespo', which is refused."),
    "vespo_lambda_neg": FieldRule(_R, "read only by loss_type='vespo', which is refused."),
    "sync_ref_model": FieldRule(_R, _REF_SYNC + "."),
    "ref_model_mixup_alpha": FieldRule(_R, _REF_SYNC + "."),
    "ref_model_sync_steps": FieldRule(_R, _REF_SYNC + "."),
    "use_adaptive_entropy": FieldRule(_R, _ENTROPY + "."),
    "entropy_coef_min": FieldRule(_R, _ENTROPY + "."),
    "entropy_coef_max": FieldRule(_R, _ENTROPY + "."),
    "entropy_coef_delta": FieldRule(_R, _ENTROPY + "."),
    "entropy_target": FieldRule(_R, _ENTROPY + "."),
    # GRPOConfig: rewards, rollout, batching
    "reward_weights": FieldRule(_R, "use reward_component_weights (one weight per reward_components entry)."),
    "multi_objective_aggregation": FieldRule(
        _R,
        "the reward is the weighted sum of the components, normalised by the advantage plugin (TRL's "
        "'sum_then_normalize'); per-component normalisation is not implemented.",
    ),
    "max_tool_calling_iterations": FieldRule(_R, "use rollout_kwargs max_turns / max_tool_calls."),
    "generation_batch_size": FieldRule(
        _R,
        "one step is one rollout batch of per_device_train_batch_size x processes; leave it and steps_per_generation "
        "unset.",
        ok=_generation_batch_ok,
    ),
    "steps_per_generation": FieldRule(_R, _ONE_STEP + ".", ok=lambda c: c.steps_per_generation == 1),
    "generation_kwargs": FieldRule(
        _R, "hf_backend builds its GenerationConfig from temperature, top_p, top_k, min_p and repetition_penalty only."
    ),
    "chat_template_kwargs": FieldRule(
        _H,
        "passed to every apply_chat_template call of the run's ChatFormat (e.g. enable_thinking); its start-up check "
        "runs with them.",
    ),
    "cache_implementation": FieldRule(_R, "hf_backend passes no cache implementation to generate."),
    "ds3_gather_for_generation": FieldRule(
        _R,
        "False: the rollout always gathers ZeRO-3 weights once (per-turn collectives would hang when ranks take "
        "different turn counts).",
    ),
    "pad_to_multiple_of": FieldRule(
        _R,
        "an integer: the packer pads each micro-batch to its widest row ('auto' and None are accepted).",
        ok=lambda c: c.pad_to_multiple_of in (None, "auto"),
    ),
    "num_generations_eval": FieldRule(_R, _EVAL + "."),
    "use_vllm": FieldRule(
        _H,
        "rollout turns are sampled by vLLM (VLLMBackend over TRL's VLLMGeneration), each turn submitted on its own; "
        "weights are pushed before each rollout.",
    ),
    "vllm_mode": FieldRule(
        _H,
        "'colocate' (vLLM in each training process) or 'server' (every rank sends its own turns to the server); "
        "refused when set without use_vllm.",
        ok=lambda c: c.vllm_mode in ("colocate", "server") and _vllm_setting("vllm_mode", None)(c),
    ),
    "vllm_model_impl": FieldRule(
        _H,
        "passed to vLLM by TRL's VLLMGeneration (colocate)"
        + _COLOCATE_ONLY.format(instead=_ON_THE_SERVER.format(flag="--vllm_model_impl")),
        ok=_vllm_setting("vllm_model_impl", "colocate"),
    ),
    "vllm_enable_sleep_mode": FieldRule(
        _H,
        "colocate: vLLM sleeps (level 2) after each rollout and its weights are pushed again before the next"
        + _COLOCATE_ONLY.format(instead="a server keeps its own memory (trl vllm-serve has no sleep mode): drop it"),
        ok=_vllm_setting("vllm_enable_sleep_mode", "colocate"),
    ),
    "vllm_structured_outputs_regex": FieldRule(
        _R,
        "one regex would constrain every turn of a multi-turn rollout alike (tool calls, answers); constrain turns "
        "in a rollout plugin instead.",
    ),
    "vllm_server_base_url": FieldRule(
        _H, _VLLM + " (server)" + _SERVER_ONLY, ok=_vllm_setting("vllm_server_base_url", "server")
    ),
    "vllm_server_host": FieldRule(
        _H, _VLLM + " (server)" + _SERVER_ONLY, ok=_vllm_setting("vllm_server_host", "server")
    ),
    "vllm_server_port": FieldRule(
        _H, _VLLM + " (server)" + _SERVER_ONLY, ok=_vllm_setting("vllm_server_port", "server")
    ),
    "vllm_server_timeout": FieldRule(
        _H,
        _VLLM
        + " (server): how long every rank waits for the server to come up, and the deadline of each request to it"
        + " (a turn, each phase of a weight push: a stopped server ends the run with one line)"
        + _SERVER_ONLY,
        ok=_vllm_setting("vllm_server_timeout", "server"),
    ),
    "vllm_group_port": FieldRule(
        _H, _VLLM + " (server): the weight-update group" + _SERVER_ONLY, ok=_vllm_setting("vllm_group_port", "server")
    ),
    "vllm_gpu_memory_utilization": FieldRule(
        _H,
        _VLLM + " (colocate)" + _COLOCATE_ONLY.format(instead=_ON_THE_SERVER.format(flag="--gpu_memory_utilization")),
        ok=_vllm_setting("vllm_gpu_memory_utilization", "colocate"),
    ),
    "vllm_max_model_length": FieldRule(
        _H,
        _VLLM
        + " (colocate), refused at start-up when shorter than the rollout's token budget"
        + _COLOCATE_ONLY.format(instead=_ON_THE_SERVER.format(flag="--max_model_len")),
        ok=_vllm_setting("vllm_max_model_length", "colocate"),
    ),
    "vllm_tensor_parallel_size": FieldRule(
        _R,
        "colocate tensor parallelism gathers the prompts of a rank group on every generate call, a collective per "
        "turn that per-trajectory turns cannot keep in step; keep 1, or use vllm_mode='server' with the server's own "
        "--tensor-parallel-size.",
        ok=lambda c: c.vllm_tensor_parallel_size == 1,
    ),
    "vllm_importance_sampling_correction": FieldRule(
        _H,
        "switch of the sampler/trainer mismatch correction (TIS/MIS, docs/training.md): old log-probs from the "
        "trainer's forward, loss weighted by pi_old/pi_sampler; applies to batches whose log-probs are not the "
        "trainer's own (vLLM), or to every batch with mismatch_correction_scope='all'.",
        owner=_IS_OWNER,
    ),
    "vllm_importance_sampling_mode": FieldRule(
        _H,
        "token_truncate, token_mask, sequence_truncate or sequence_mask, as in TRL; refused when set but the "
        "correction cannot apply (HF generate with mismatch_correction_scope='foreign', or correction off).",
        owner=_IS_OWNER,
    ),
    "vllm_importance_sampling_clip_max": FieldRule(
        _H,
        "C_max of the importance weight, as in TRL (None: no upper bound); refused when set but the correction "
        "cannot apply.",
        owner=_IS_OWNER,
    ),
    "vllm_importance_sampling_clip_min": FieldRule(
        _H,
        "C_min of the importance weight, as in TRL (None: no lower bound); refused when set but the correction "
        "cannot apply.",
        owner=_IS_OWNER,
    ),
    "vllm_importance_sampling_cap": FieldRule(
        _H,
        "deprecated in TRL, whose __post_init__ copies it into vllm_importance_sampling_clip_max (same rules).",
        owner=_IS_OWNER,
    ),
    "use_transformers_continuous_batching": FieldRule(
        _H,
        "rollouts generate with transformers' continuous batching (ContinuousBatchingBackend): one request per turn, "
        "a trajectory's next turn submitted as soon as its tool returns; refused with use_vllm and with "
        "repetition_penalty != 1.",
        owner=_CB_OWNER,
    ),
    "transformers_continuous_batching_config": FieldRule(
        _H,
        "ContinuousBatchingConfig keyword arguments (max_memory_percent defaults to 0.5, as in TRL; num_blocks and "
        "max_batch_tokens left unset are sized from the workload: per_device_train_batch_size trajectories x the "
        "rollout's token budget), checked at start-up (the recipe also checks that the cache fits before the model "
        "loads); return_logprobs, seed, per_request_processors and drop_unsupported_processors are refused (the "
        "backend sets them); refused without use_transformers_continuous_batching.",
        owner=_CB_OWNER,
    ),
    "use_transformers_paged": FieldRule(
        _H,
        "deprecated in TRL, whose __post_init__ turns it into use_transformers_continuous_batching=True (same rules).",
        owner=_CB_OWNER,
    ),
    "log_completions": FieldRule(
        _R,
        "TRL's single-turn completions table; trajectory_table_steps/_rows log multi-turn trajectories (the trainer "
        "refuses it too).",
    ),
    "log_multimodal": FieldRule(_R, _LOGS + "."),
    "num_completions_to_print": FieldRule(_R, _LOGS + "."),
    "log_unique_prompts": FieldRule(_R, _LOGS + "."),
    "log_completions_hub_repo": FieldRule(_R, _LOGS + "."),
    # TrainingArguments: the update, the optimizer and precision
    "per_device_train_batch_size": FieldRule(
        _H, "trajectories per rank per step (TRL: completions per device), a multiple of num_generations."
    ),
    "gradient_accumulation_steps": FieldRule(_R, _ONE_STEP + ".", ok=lambda c: c.gradient_accumulation_steps == 1),
    "max_grad_norm": FieldRule(
        _H, "the HF loop clips after our backward (DeepSpeed: its gradient_clipping); 0 turns it off."
    ),
    "average_tokens_across_devices": FieldRule(
        _R,
        "False: the loss always divides by global token and sequence counts over all ranks; there is nothing to "
        "switch off.",
    ),
    "learning_rate": FieldRule(_H, _HF + " (optimizer)."),
    "lr_scheduler_type": FieldRule(_H, _HF + " (scheduler)."),
    "lr_scheduler_kwargs": FieldRule(_H, _HF + " (scheduler)."),
    "warmup_steps": FieldRule(_H, _HF + " (scheduler)."),
    "optim": FieldRule(
        _H,
        _HF + "; schedule_free_* refused (Trainer.training_step, which we replace, switches them to train mode).",
        ok=lambda c: not str(_plain(c.optim)).startswith("schedule_free"),
    ),
    "optim_args": FieldRule(_H, _HF + " (optimizer)."),
    "weight_decay": FieldRule(_H, _HF + " (optimizer)."),
    "adam_beta1": FieldRule(_H, _HF + " (optimizer)."),
    "adam_beta2": FieldRule(_H, _HF + " (optimizer)."),
    "adam_epsilon": FieldRule(_H, _HF + " (optimizer)."),
    "optim_target_modules": FieldRule(_H, _HF + " (GaLore/APOLLO optimizers)."),
    "bf16": FieldRule(_H, _HF + " (Accelerate mixed precision around our forward)."),
    "fp16": FieldRule(_H, _HF + " (Accelerate mixed precision and loss scaling in accelerator.backward)."),
    "tf32": FieldRule(_H, _HF + "."),
    "activation_checkpointing": FieldRule(
        _H, _HF + " enables it on the policy for our forward (generation runs in eval mode)."
    ),
    "activation_checkpointing_kwargs": FieldRule(_H, _HF + "."),
    "gradient_checkpointing": FieldRule(_H, _HF + " (deprecated alias of activation_checkpointing)."),
    "gradient_checkpointing_kwargs": FieldRule(_H, _HF + " (deprecated alias of activation_checkpointing_kwargs)."),
    "torch_compile": FieldRule(_H, _HF + " compiles the policy that our forward uses."),
    "torch_compile_backend": FieldRule(_H, _HF + "."),
    "torch_compile_mode": FieldRule(_H, _HF + "."),
    "use_liger_kernel": FieldRule(
        _H, _HF + " patches Liger's layer kernels into the policy (TRL refuses its fused cross-entropy)."
    ),
    "liger_kernel_config": FieldRule(_H, _HF + "."),
    "use_cache": FieldRule(
        _H,
        "no effect: training forwards pass use_cache=False and generate always uses its KV cache (in TRL it only "
        "costs memory).",
    ),
    "neftune_noise_alpha": FieldRule(
        _R,
        "NEFTune noise would perturb the training forward but not generation (eval mode), biasing every importance "
        "ratio.",
    ),
    "torch_empty_cache_steps": FieldRule(_R, "acted on in Trainer.training_step, which this trainer replaces."),
    "auto_find_batch_size": FieldRule(_R, "TRL refuses it: shrinking the batch would split the groups."),
    "label_smoothing_factor": FieldRule(_R, "there is no cross-entropy on labels in RL (TRL ignores it too)."),
    # TrainingArguments: the length of training, data, seeds
    "num_train_epochs": FieldRule(_H, _HF + " (passes over the questions)."),
    "max_steps": FieldRule(_H, _HF + "."),
    "seed": FieldRule(_H, _HF + " and TRL's sampler; every rollout's sampling seed derives from (seed, step, rank)."),
    "full_determinism": FieldRule(_H, _HF + "."),
    "data_seed": FieldRule(
        _R, "TRL's RepeatSampler shuffles with seed and never reads data_seed (TRL ignores it too)."
    ),
    "train_sampling_strategy": FieldRule(
        _R,
        "TRL's RepeatSampler replaces the HF sampler (TRL ignores it too); shuffle_dataset=False keeps dataset order.",
    ),
    "length_column_name": FieldRule(_R, "only read with train_sampling_strategy, which is refused."),
    "remove_unused_columns": FieldRule(
        _H, "as in TRL: True keeps only 'prompt', so reward components lose columns such as 'answer'."
    ),
    "label_names": FieldRule(_R, "there are no labels in RL (TRL ignores it too)."),
    "dataloader_drop_last": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_num_workers": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_pin_memory": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_persistent_workers": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_prefetch_factor": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_multiprocessing_context": FieldRule(_H, _HF + " (data loader)."),
    "dataloader_in_order": FieldRule(_H, _HF + " (data loader)."),
    # TrainingArguments: logging
    "logging_strategy": FieldRule(_H, _HF + "; our metrics are averaged over each logging window."),
    "logging_steps": FieldRule(_H, _HF + "; our metrics are averaged over each logging window."),
    "logging_first_step": FieldRule(_H, _HF + "."),
    "log_on_each_node": FieldRule(_H, _HF + "."),
    "logging_nan_inf_filter": FieldRule(_H, _HF + " (filters the returned loss)."),
    "log_level": FieldRule(_H, _HF + "."),
    "log_level_replica": FieldRule(_H, _HF + "."),
    "disable_tqdm": FieldRule(_H, _HF + "; also turns off the rollout progress bar."),
    "include_num_input_tokens_seen": FieldRule(
        _R, "counts the batches' input_ids, which question rows do not have; see the train/input_tokens metric."
    ),
    "report_to": FieldRule(_H, _HF + " (W&B also gets the trajectory tables)."),
    "run_name": FieldRule(_H, _HF + "."),
    "project": FieldRule(_H, _HF + " (Trackio)."),
    "trackio_space_id": FieldRule(_H, _HF + " (Trackio)."),
    "trackio_bucket_id": FieldRule(_H, _HF + " (Trackio)."),
    "trackio_static_space_id": FieldRule(_H, _HF + " (Trackio)."),
    "skip_memory_metrics": FieldRule(_H, _HF + "."),
    "debug": FieldRule(_H, _HF + "."),
    # TrainingArguments: evaluation (TRL's loop generates single-turn completions)
    "eval_strategy": FieldRule(
        _R,
        "TRL's evaluation loop generates single-turn completions; evaluate multi-turn with "
        "trl_plugins.evaluation.evaluate_policy (the recipes' held-out evaluation).",
    ),
    "do_eval": FieldRule(
        _R,
        "evaluation is trl_plugins.evaluation.evaluate_policy (the recipes' held-out evaluation), not the Trainer's.",
    ),
    "eval_steps": FieldRule(_R, _EVAL + "."),
    "eval_delay": FieldRule(_R, _EVAL + "."),
    "per_device_eval_batch_size": FieldRule(_R, _EVAL + "."),
    "prediction_loss_only": FieldRule(_R, _EVAL + "."),
    "eval_on_start": FieldRule(_R, _EVAL + "."),
    "eval_do_concat_batches": FieldRule(_R, _EVAL + "."),
    "eval_use_gather_object": FieldRule(_R, _EVAL + "."),
    "eval_accumulation_steps": FieldRule(_R, _EVAL + "."),
    "include_for_metrics": FieldRule(_R, _EVAL + "."),
    "batch_eval_metrics": FieldRule(_R, _EVAL + "."),
    "bf16_full_eval": FieldRule(_R, _EVAL + "."),
    "fp16_full_eval": FieldRule(_R, _EVAL + "."),
    "load_best_model_at_end": FieldRule(_R, "needs evaluation metrics, and the evaluation loop is refused."),
    "metric_for_best_model": FieldRule(_R, "needs evaluation metrics, and the evaluation loop is refused."),
    "greater_is_better": FieldRule(_R, "needs evaluation metrics, and the evaluation loop is refused."),
    # TrainingArguments: checkpoints and the Hub
    "output_dir": FieldRule(
        _H,
        "checkpoints, metrics.jsonl, logger files, trajectories/ (the viewer's batches) and run_config/ (the config "
        "and tokenizer, saved when training starts; docs/replay.md).",
    ),
    "save_strategy": FieldRule(
        _H, _HF + "; 'best' refused (it needs evaluation metrics).", ok=lambda c: _plain(c.save_strategy) != "best"
    ),
    "save_steps": FieldRule(_H, _HF + "."),
    "save_total_limit": FieldRule(_H, "older checkpoints are rotated out only after the new one is marked complete."),
    "save_on_each_node": FieldRule(_H, _HF + "."),
    "save_only_model": FieldRule(_H, _HF + " (no resume from such checkpoints, as in TRL)."),
    "enable_jit_checkpoint": FieldRule(
        _H, _HF + "; the SIGTERM checkpoint goes through our _save_checkpoint (completion marker)."
    ),
    "ignore_data_skip": FieldRule(_H, _HF + " (on resume)."),
    "restore_callback_states_from_checkpoint": FieldRule(_H, _HF + " (on resume)."),
    "resume_from_checkpoint": FieldRule(
        _H,
        "a script flag: a recipe passes it to train(), where True, 'true' or 'latest' mean the newest complete "
        "checkpoint, checked before it loads (docs/training.md#resuming).",
    ),
    "push_to_hub": FieldRule(_H, _HF + " (with TRL's model card)."),
    "hub_token": FieldRule(_H, _HF + "."),
    "hub_private_repo": FieldRule(_H, _HF + "."),
    "hub_model_id": FieldRule(_H, _HF + "."),
    "hub_strategy": FieldRule(_H, _HF + "."),
    "hub_always_push": FieldRule(_H, _HF + "."),
    "hub_revision": FieldRule(_H, _HF + "."),
    # TrainingArguments: devices and distribution
    "use_cpu": FieldRule(_H, "Accelerate (needed for CPU DDP and bf16 on CPU: docs/training.md)."),
    "accelerator_config": FieldRule(_H, "Accelerate, through the HF loop."),
    "deepspeed": FieldRule(
        _H, "ZeRO-2/3 through the HF loop (tested; the update sets DeepSpeed's accumulation boundary itself)."
    ),
    "fsdp": FieldRule(
        _R,
        "untested: the rollout gathers full weights for generation only under DeepSpeed ZeRO-3, and ranks take "
        "different turn counts; use accelerate_configs/zero3.yaml.",
    ),
    "fsdp_config": FieldRule(_R, "read only with fsdp, which is refused."),
    "parallelism_config": FieldRule(
        _M,
        "sequence_parallel_size: sp_size with sp_backend='deepspeed' (Ulysses in the policy update's forward and "
        "backward, docs/training.md); tensor, context and sharded data parallelism refused; an accelerate config's "
        "parallelism_config alike.",
        owner="MultiTurnGRPOConfig.__post_init__ (trl_plugins.run.parallelism)",
    ),
    "ddp_find_unused_parameters": FieldRule(_H, _HF + " (DDP)."),
    "ddp_bucket_cap_mb": FieldRule(_H, _HF + " (DDP)."),
    "ddp_broadcast_buffers": FieldRule(_H, _HF + " (DDP)."),
    "ddp_static_graph": FieldRule(_H, _HF + " (DDP)."),
    "ddp_backend": FieldRule(_H, _HF + " ('gloo' for CPU ZeRO-3)."),
    "ddp_timeout": FieldRule(_H, _HF + " (not applied with use_cpu=True)."),
    "local_rank": FieldRule(_H, "launcher plumbing."),
    "do_train": FieldRule(_H, "inert: a script flag that neither the HF Trainer nor TRL reads."),
    "do_predict": FieldRule(_H, "inert: a script flag that neither the HF Trainer nor TRL reads."),
}


def apply_trl_fields(config: Any) -> None:
    """Refuse TRL settings this trainer would ignore, then map TRL's names onto our settings.

    Runs inside ``MultiTurnGRPOConfig.__post_init__`` (after TRL's own ``__post_init__`` and after the
    ``*_kwargs`` fields are parsed into dicts), so a config that would silently differ from TRL fails
    before any model loads. Idempotent: a second run finds the mapped values in place. Fields with an
    ``owner`` (``beta``, ``entropy_coef``, ``use_vllm``) are enforced there and skipped here.

    Raises:
        ValueError: one message naming every refused field and what to use instead, or a mapping
            whose TRL field and our setting were both set to different values.
    """
    refused = []
    for name, rule in TRL_FIELDS.items():
        if rule.owner is not None or rule.kind == FieldKind.MAPPED:
            continue
        if rule.ok is not None:
            bad = not rule.ok(config)
        else:
            bad = rule.kind == FieldKind.REFUSED and is_set(config, name)
        if bad:
            refused.append(f"  - {name}={_plain(getattr(config, name))!r}: {rule.reason}")
    if refused:
        raise ValueError(
            "these TRL GRPOConfig settings would be ignored or mean something else in MultiTurnGRPOTrainer "
            "(docs/training.md lists every field):\n" + "\n".join(refused)
        )
    for rule in TRL_FIELDS.values():
        if rule.apply is not None and rule.owner is None:
            rule.apply(config)


def render_table() -> str:
    """The Markdown table of :data:`TRL_FIELDS` (mapped, refused, honoured; by name), as in docs/training.md."""
    order = {FieldKind.MAPPED: 0, FieldKind.REFUSED: 1, FieldKind.HONOURED: 2}
    rows = sorted(TRL_FIELDS.items(), key=lambda item: (order[item[1].kind], item[0]))
    lines = ["| TRL field | kind | in MultiTurnGRPOTrainer |", "|---|---|---|"]
    lines += [f"| `{name}` | {rule.kind} | {rule.reason} |" for name, rule in rows]
    return "\n".join(lines) + "\n"
