"""Every TRL GRPOConfig field is honoured, mapped or refused (trl_plugins/run/trl_fields.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trl_plugins.run.trl_fields import TRL_FIELDS, FieldKind, apply_trl_fields, render_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "training.md"

# A value for each field that a config refuses (kind "refused", or an honoured field with refused values).
REFUSED_VALUES = {
    "importance_sampling_level": "sequence",
    "top_entropy_quantile": 0.2,
    "off_policy_mask_threshold": 0.5,
    "router_aux_loss_coef": 0.01,
    "sapo_temperature_neg": 2.0,
    "sapo_temperature_pos": 2.0,
    "vespo_k_pos": 1.0,
    "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0,
    "vespo_lambda_neg": 1.0,
    "sync_ref_model": True,
    "ref_model_mixup_alpha": 0.5,
    "ref_model_sync_steps": 10,
    "use_adaptive_entropy": True,
    "entropy_coef_min": 0.01,
    "entropy_coef_max": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_target": 0.3,
    "reward_weights": [2.0],
    "multi_objective_aggregation": "normalize_then_sum",
    "max_tool_calling_iterations": 3,
    "generation_batch_size": 8,
    "steps_per_generation": 2,
    "generation_kwargs": {"no_repeat_ngram_size": 3},
    "cache_implementation": "static",
    "ds3_gather_for_generation": False,
    "pad_to_multiple_of": 64,
    "num_generations_eval": 4,
    "vllm_mode": "remote",
    "vllm_structured_outputs_regex": "[0-9]+",
    "vllm_tensor_parallel_size": 2,
    # vLLM settings that do nothing without use_vllm (and in the other vLLM mode: see the test below)
    "vllm_gpu_memory_utilization": 0.5,
    "vllm_model_impl": "transformers",
    "vllm_max_model_length": 2048,
    "vllm_enable_sleep_mode": True,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_host": "10.0.0.2",
    "vllm_server_port": 8001,
    "vllm_server_timeout": 60.0,
    "vllm_group_port": 51217,
    "log_completions": True,
    "log_multimodal": False,
    "num_completions_to_print": 2,
    "log_unique_prompts": True,
    "log_completions_hub_repo": "me/completions",
    "gradient_accumulation_steps": 2,
    "average_tokens_across_devices": False,
    "optim": "schedule_free_adamw",
    "neftune_noise_alpha": 5.0,
    "torch_empty_cache_steps": 10,
    "auto_find_batch_size": True,
    "label_smoothing_factor": 0.1,
    "data_seed": 1,
    "train_sampling_strategy": "sequential",
    "length_column_name": "n_tokens",
    "label_names": ["labels"],
    "include_num_input_tokens_seen": "all",
    "eval_strategy": "steps",
    "do_eval": True,
    "eval_steps": 5,
    "eval_delay": 1,
    "per_device_eval_batch_size": 4,
    "prediction_loss_only": True,
    "eval_on_start": True,
    "eval_do_concat_batches": False,
    "eval_use_gather_object": True,
    "eval_accumulation_steps": 2,
    "include_for_metrics": ["loss"],
    "batch_eval_metrics": True,
    "bf16_full_eval": True,
    "fp16_full_eval": True,
    "load_best_model_at_end": True,
    "metric_for_best_model": "reward",
    "greater_is_better": True,
    "save_strategy": "best",
    "fsdp": "full_shard",
    "fsdp_config": {"min_num_params": 1000},
}
EXTRA: dict[str, dict] = {}


def _config(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        reward_components=["correct"],
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


def test_every_trl_field_has_a_rule_and_every_rule_a_field():
    # A TRL upgrade that adds, renames or drops a field fails here until the table says what it does.
    from trl import GRPOConfig

    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert sorted(set(fields) - set(TRL_FIELDS)) == [], "TRL fields without a rule in TRL_FIELDS"
    assert sorted(set(TRL_FIELDS) - set(fields)) == [], "rules for fields TRL no longer has"
    for name, rule in TRL_FIELDS.items():
        assert rule.reason and "|" not in rule.reason and "\n" not in rule.reason, name
        if rule.owner is None:  # beta, entropy_coef, use_vllm are enforced by MultiTurnGRPOConfig itself
            assert (rule.apply is not None) == (rule.kind == FieldKind.MAPPED), name


def test_every_refusable_field_has_an_example():
    refusable = {n for n, r in TRL_FIELDS.items() if r.kind == FieldKind.REFUSED or r.ok is not None}
    assert refusable == set(REFUSED_VALUES)


def test_the_defaults_pass(tmp_path):
    config = _config(tmp_path)
    assert (config.policy_loss_kwargs, config.advantage_kwargs, config.aggregation) == ({}, {}, "token_mean")


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refused_setting_names_its_field(tmp_path, name):
    value = REFUSED_VALUES[name]
    # TRL and transformers refuse some of these themselves; either way the message names the field.
    with pytest.raises(ValueError, match=re.escape(name)):
        _config(tmp_path, **{name: value, **EXTRA.get(name, {})})


_SERVE = "set it where the server starts instead (trl vllm-serve {}) and drop it here"
COLOCATE_ONLY = {  # a value off TRL's default, and what the refusal in server mode tells the user to do instead
    "vllm_gpu_memory_utilization": (0.5, _SERVE.format("--gpu_memory_utilization")),
    "vllm_max_model_length": (8192, _SERVE.format("--max_model_len")),
    "vllm_model_impl": ("transformers", _SERVE.format("--vllm_model_impl")),
    "vllm_enable_sleep_mode": (True, "a server keeps its own memory (trl vllm-serve has no sleep mode): drop it"),
}


@pytest.mark.parametrize("name", sorted(COLOCATE_ONLY))
def test_a_colocate_only_vllm_setting_is_refused_in_server_mode_saying_what_to_do(tmp_path, name):
    # Issue 30.13: in server mode vLLM runs in `trl vllm-serve`, which takes its own flags; TRL's client never passes
    # these on, so a value set here would silently do nothing. Refused when the config is built, with what to do.
    from trl import GRPOConfig

    value, instead = COLOCATE_ONLY[name]
    default = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}[name]
    assert value != default  # TRL 1.16: 0.3, None, "vllm", False
    server = dict(use_vllm=True, vllm_mode="server")
    with pytest.raises(
        ValueError,
        match=re.escape(f"{name}={value!r}") + ".*vllm_mode='server', where it would do "
        "nothing: " + re.escape(instead) + r", or use vllm_mode='colocate'\.",
    ):
        _config(tmp_path, **server, **{name: value})
    # At TRL's default the field is not set: server mode accepts it, given or not.
    assert getattr(_config(tmp_path, **server, **{name: default}), name) == default
    assert getattr(_config(tmp_path, **server), name) == default
    # In colocate mode it is honoured (passed to TRL's VLLMGeneration).
    assert getattr(_config(tmp_path, use_vllm=True, vllm_mode="colocate", **{name: value}), name) == value


def test_a_vllm_setting_of_the_other_mode_is_refused(tmp_path):
    # Colocate-only settings do nothing against a server (it has its own flags), and server-only ones nothing in
    # colocate mode: refused, not silently inert. In their own mode they are accepted.
    on = dict(use_vllm=True)
    for name, value in [
        ("vllm_gpu_memory_utilization", 0.5),
        ("vllm_enable_sleep_mode", True),
        ("vllm_model_impl", "transformers"),
        ("vllm_max_model_length", 8192),
    ]:
        assert getattr(_config(tmp_path, **on, vllm_mode="colocate", **{name: value}), name) == value
        with pytest.raises(ValueError, match=f"{name}=.*vllm_mode='server', where it would do nothing"):
            _config(tmp_path, **on, vllm_mode="server", **{name: value})
    for name, value in [
        ("vllm_server_port", 8001),
        ("vllm_server_base_url", "http://h:1"),
        ("vllm_group_port", 51217),
        ("vllm_server_host", "10.0.0.2"),
        ("vllm_server_timeout", 60.0),
    ]:
        assert getattr(_config(tmp_path, **on, vllm_mode="server", **{name: value}), name) == value
        with pytest.raises(ValueError, match=f"{name}=.*vllm_mode='colocate', where it would do nothing"):
            _config(tmp_path, **on, vllm_mode="colocate", **{name: value})
    with pytest.raises(ValueError, match="vllm_mode='server'.*refused when set without use_vllm"):
        _config(tmp_path, vllm_mode="server")
    with pytest.raises(ValueError, match="vllm_max_concurrent_requests=8 is set but only server mode uses it"):
        _config(tmp_path, **on, vllm_mode="colocate", vllm_max_concurrent_requests=8)
    assert _config(tmp_path, **on, vllm_mode="server", vllm_max_concurrent_requests=8).vllm_max_concurrent_requests == 8


def test_beta_and_use_bias_correction_kl_map_to_the_policy_losss_kl_term(tmp_path):
    assert _config(tmp_path, use_bias_correction_kl=True).policy_loss_kwargs == {}  # beta = 0: no KL term, as in TRL
    weighted = _config(tmp_path, beta=0.1).policy_loss_kwargs  # TRL's default: the ratio-weighted KL
    assert weighted == {"kl_coef": 0.1, "kl_estimator": "k3", "kl_importance_weight": True}
    plain = _config(tmp_path, beta=0.1, use_bias_correction_kl=False, kl_estimator="k2").policy_loss_kwargs
    assert plain == {"kl_coef": 0.1, "kl_estimator": "k2", "kl_importance_weight": False}
    assert _config(tmp_path, beta=0.1, kl_penalty="reward").policy_loss_kwargs == {}
    with pytest.raises(ValueError, match="set only --use_bias_correction_kl"):
        _config(tmp_path, beta=0.1, policy_loss_kwargs={"kl_importance_weight": False})


def test_clip_bounds_map_to_the_policy_loss(tmp_path):
    config = _config(tmp_path, epsilon=0.1, epsilon_high=0.3, delta=2.0)
    assert config.policy_loss_kwargs == {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 2.0}
    apply_trl_fields(config)  # idempotent: a second run finds its own result
    assert config.policy_loss_kwargs == {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 2.0}
    # epsilon_high=None keeps ppo_clip's own 0.28 (TRL would take epsilon).
    assert _config(tmp_path, epsilon=0.1).policy_loss_kwargs == {"clip_low": 0.1}
    # The same value in both places is no conflict.
    assert _config(tmp_path, epsilon=0.1, policy_loss_kwargs={"clip_low": 0.1}).policy_loss_kwargs == {"clip_low": 0.1}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(epsilon=0.1, policy_loss_kwargs={"clip_low": 0.3}),
            r"epsilon=0.1 means policy_loss_kwargs\['clip_low'\]=0.1",
        ),
        (dict(epsilon_high=0.4, policy_loss_kwargs={"clip_high": 0.28}), "set only one of them"),
        (dict(delta=2.0, policy_loss_kwargs={"dual_clip": 3.0}), "set only one of them"),
        (
            dict(loss_type="grpo", aggregation="seq_mean_token_sum"),
            "aggregation='seq_mean_token_mean', but aggregation=",
        ),
        (
            dict(loss_type="dr_grpo", max_completion_length=256, norm_length=100.0),
            "norm_length=256.0, but norm_length=100.0",
        ),
        (
            dict(scale_rewards="none", advantage_kwargs={"scale_by_std": True}),
            r"advantage_kwargs\['scale_by_std'\]=False",
        ),
        # The selected plugin does not take the kwarg: say which plugin and what it takes.
        (dict(scale_rewards="none", advantage="rloo"), r"advantage 'rloo' takes no scale_by_std \(it takes \[\]\)"),
        (dict(scale_rewards="batch"), "scale_rewards='batch'"),
        (dict(loss_type="bnpo"), "use loss_type='dapo'"),
        (dict(loss_type="sapo"), "register one in trl_plugins.registry.POLICY_LOSSES"),
        (dict(max_completion_length=256), "set rollout_kwargs max_assistant_tokens"),
    ],
)
def test_mapping_conflicts_and_refusals(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_a_delta_at_or_below_the_upper_clip_bound_is_refused_by_the_loss_it_maps_onto(tmp_path):
    # TRL's clamp at delta would also cut positive-advantage ratios, the dual clip does not; ppo_clip, whose
    # clip_high default lives in its own signature only, refuses it when the run builds it.
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match=r"dual_clip=1.2 must be above 1 \+ clip_high = 1.28.*TRL's delta"):
        resolve_run(_config(tmp_path, delta=1.2))
    with pytest.raises(ValueError, match=r"dual_clip=1.35 must be above 1 \+ clip_high = 1.4"):
        resolve_run(_config(tmp_path, delta=1.35, epsilon_high=0.4))
    assert resolve_run(_config(tmp_path, delta=1.5)).policy_loss.impl.dual_clip == 1.5


@pytest.mark.parametrize(
    "loss_type,aggregation",
    [("grpo", "seq_mean_token_mean"), ("dr_grpo", "seq_mean_token_sum_norm"), ("luspo", "seq_mean_token_sum")],
)
def test_loss_type_sets_the_aggregation(tmp_path, loss_type, aggregation):
    config = _config(tmp_path, loss_type=loss_type)
    assert config.aggregation == aggregation
    apply_trl_fields(config)
    assert config.aggregation == aggregation


def test_dr_grpo_divides_by_max_completion_length_unless_norm_length_is_set(tmp_path):
    assert _config(tmp_path, loss_type="dr_grpo").norm_length == 512.0  # TRL's default constant
    config = _config(tmp_path, loss_type="dr_grpo", max_completion_length=1024)
    assert config.norm_length == 1024.0
    apply_trl_fields(config)
    assert config.norm_length == 1024.0
    assert _config(tmp_path, loss_type="dr_grpo", norm_length=300.0).norm_length == 300.0


def test_scale_rewards_and_truncation_map_to_the_advantage_settings(tmp_path):
    for value in ("none", False):  # TRL turns False into "none"
        config = _config(tmp_path, scale_rewards=value, mask_truncated_completions=True)
        assert config.advantage_kwargs == {"scale_by_std": False} and config.truncated_policy == "mask"
        apply_trl_fields(config)
        assert config.advantage_kwargs == {"scale_by_std": False} and config.truncated_policy == "mask"
    assert _config(tmp_path, scale_rewards=True).advantage_kwargs == {}  # "group": the default


def test_docs_carry_the_rendered_table():
    text = DOCS.read_text()
    start = text.index("## Every TRL field: honoured, mapped or refused")
    section = text[start:]
    assert render_table() in section, "docs/training.md is stale: paste trl_fields.render_table() into its last section"


def test_the_rollouts_calls_per_turn_reach_the_runs_chat_format_and_a_template_that_cannot_is_refused(tmp_path):
    from trl_plugins.rollout import ChatTemplateError
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tokenizer

    config = _config(tmp_path, rollout_kwargs={"max_tool_calls_per_turn": 3})
    run = resolve_run(config)
    assert run.rollout.tool_calls_per_turn == 3
    assert run.bind_tokenizer(build_tokenizer("qwen2_5")).calls_per_turn == 3
    # Llama 3.1's template raises on a turn with two calls: refused when the run is set up, saying what to do.
    with pytest.raises(
        ChatTemplateError,
        match=r"cannot follow a turn with 3 calls token for token.*"
        r"Set rollout_kwargs max_tool_calls_per_turn: 1",
    ):
        resolve_run(config).bind_tokenizer(build_tokenizer("llama3_1"))
    # The default runs one call per turn, and every template that renders tool turns exactly is accepted.
    assert resolve_run(_config(tmp_path)).bind_tokenizer(build_tokenizer("llama3_1")).calls_per_turn == 1


def test_chat_template_kwargs_and_stop_tokens_reach_the_runs_chat_format(tmp_path):
    from trl_plugins.rollout import ChatTemplateError
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tokenizer

    config = _config(
        tmp_path, chat_template_kwargs='{"enable_thinking": false}', stop_tokens=["<|im_end|>", "<|endoftext|>"]
    )
    assert config.chat_template_kwargs == {"enable_thinking": False}
    tok = build_tokenizer("qwen3_training")
    chat = resolve_run(config).bind_tokenizer(tok)
    assert chat.template_kwargs == {"enable_thinking": False} and not chat.reasoning
    assert chat.stop_token_ids == sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    prompt = tok.decode(chat.initial_prompt_ids([{"role": "user", "content": "q"}]))
    assert prompt.endswith("<think>\n\n</think>\n\n")  # thinking off, as asked
    # Qwen3's own template rewrites history when thinking is off: refused, naming the training variant.
    with pytest.raises(ChatTemplateError, match="training variant"):
        resolve_run(config).bind_tokenizer(build_tokenizer("qwen3"))
