"""Start-up of the recipe: the plugin and chat-template checks that run before any model loads, and the
banner that says what the run will do (plugins, sandbox, processes and precision, generation, outputs)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["PluginCheck", "check_plugins", "check_chat_template", "distributed_mode", "generation_backend",
           "precision", "format_banner"]


@dataclass
class _Schema:
    value: dict

    def schema(self) -> dict:
        return self.value


@dataclass
class PluginCheck:
    """What :func:`check_plugins` learnt from building the run's plugins once."""

    tool_start_up: dict[str, str] = field(default_factory=dict)
    """Per tool that declares ``start_up()``, the line it reported (the code interpreter: its sandbox's isolation)."""
    tools: dict[str, Any] = field(default_factory=dict)
    """Per tool, its schema as an object with ``schema()`` (what the chat template shows the model)."""


def check_plugins(training_args: Any) -> PluginCheck:
    """Build every plugin ``training_args`` selects, with its kwargs, without a model; start each tool that
    declares ``start_up()`` (the code interpreter resolves and probes its sandbox's isolation: no warm
    interpreter is started), then close them all.

    A kwarg a plugin refuses (a name it does not take, or a value its constructor or start-up rejects) thus
    stops the run before the model loads and before the "before" evaluation, not when the trainer builds it.

    Raises:
        SystemExit: a plugin refused its settings or could not start; the message is the plugin's.
    """
    from trl_plugins.trainers.plugins import build_plugins

    try:
        plugins = build_plugins(training_args)
    except (LookupError, ValueError, TypeError, RuntimeError) as exc:  # LookupError: the registry's unknown names
        raise SystemExit(f"configuration error (before any model loads): {exc}") from exc
    check = PluginCheck()
    try:
        for name, tool in plugins.tools.items():
            start_up = getattr(tool, "start_up", None)
            if callable(start_up):
                check.tool_start_up[name] = str(start_up())
            check.tools[name] = _Schema(tool.schema())
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SystemExit(f"configuration error (before any model loads): tool {name!r}: {exc}") from exc
    finally:
        plugins.close()
    return check


def check_chat_template(tokenizer: Any, check: PluginCheck, training_args: Any) -> None:
    """The chat template's checks (prefix-preserving, shows the tools' schemas, stop tokens, ...) on the run's
    tokenizer and tools, right after the tokenizer loads: before the model loads and before any evaluation.

    Raises:
        SystemExit: the template cannot be followed token for token (the message says why and what to use).
    """
    from trl_plugins.rollout import ChatTemplateError
    from trl_plugins.trainers.batch import chat_format

    try:
        chat_format(tokenizer, check, training_args)
    except ChatTemplateError as exc:
        raise SystemExit(f"configuration error (before any model loads): the chat template: {exc}") from exc


def distributed_mode(env: Mapping[str, str] | None = None, training_args: Any = None) -> str:
    """How the processes share the model: ``DeepSpeed ZeRO-<stage>``, ``FSDP``, ``DDP`` or ``single process``
    (from accelerate launch's environment, or ``training_args.deepspeed``)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    deepspeed = getattr(training_args, "deepspeed", None)
    if deepspeed:
        config = deepspeed if isinstance(deepspeed, dict) else _read_json(deepspeed)
        stage = (config or {}).get("zero_optimization", {}).get("stage")
        return f"DeepSpeed ZeRO-{stage}" if stage is not None else "DeepSpeed"
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "FSDP"
    return "DDP" if world > 1 else "single process"


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def precision(training_args: Any) -> str:
    """``bf16``, ``fp16`` or ``fp32`` (the trainer's mixed precision)."""
    if getattr(training_args, "bf16", False):
        return "bf16"
    if getattr(training_args, "fp16", False):
        return "fp16"
    return "fp32"


def generation_backend(training_args: Any) -> str:
    """What generates the rollouts: vLLM (and its mode), transformers continuous batching, or HF generate."""
    if getattr(training_args, "use_vllm", False):
        return f"vLLM ({training_args.vllm_mode} mode)"
    if getattr(training_args, "use_transformers_continuous_batching", False):
        keep = "kept" if getattr(training_args, "continuous_batching_keep_cache", False) else "freed"
        return f"transformers continuous batching (KV cache {keep} between rollouts)"
    return "HF generate"


def evaluation_backend(training_args: Any) -> str:
    """What generates the held-out evaluations: vLLM serves the training rollouts only (the before/after evaluation
    runs in a child process with HF generate), continuous batching serves both."""
    if getattr(training_args, "use_vllm", False):
        return "HF generate (vLLM serves the training rollouts only)"
    return generation_backend(training_args)


def _kwargs(values: Any) -> str:
    return json.dumps(values, sort_keys=True, default=str) if values else "{}"


def format_banner(script_args: Any, training_args: Any, *, world_size: int, device: str, distributed: str,
                  tool_start_up: Mapping[str, str] | None = None, wandb_mode: str | None = None) -> str:
    """The start-up banner: every plugin in force with its settings, the sandbox's isolation, processes and
    precision, the generation backend, and where outputs go. Pure: everything comes in as arguments."""
    a, s = training_args, script_args
    tool_start_up = dict(tool_start_up or {})
    lines = ["=" * 72, "ReTool PPO: the run", "-" * 72]
    model = s.model_name_or_path or "the embedded default (tiny Qwen2 after its cold-start SFT; built or read from the cache)"
    lines.append(f"model:        {model}" + (f"  [LoRA adapter, r={s.lora_r}]" if getattr(s, "use_peft", False) else ""))
    lines.append(f"dataset:      {s.dataset_name or 'the bundled arithmetic task'}"
                 f" (train split {s.dataset_train_split!r}, held-out split {s.dataset_test_split!r})")
    if getattr(s, "config_files", None):
        lines.append(f"config files: {' < '.join(s.config_files)} < command line")
    lines.append(f"rollout:      {a.rollout} {_kwargs(a.rollout_kwargs)}")
    for name in a.tools:
        lines.append(f"tool:         {name} {_kwargs(a.tool_kwargs.get(name))}")
        if name in tool_start_up:
            lines.append(f"                {tool_start_up[name]}")
        else:
            lines.append("                (reports how it runs when the tools start)")
        if name not in (a.system_prompt or ""):
            lines.append(f"                warning: system_prompt does not mention {name!r}; only its schema reaches the "
                         f"model, which may never call it (docs/plugins.md, 'Tools and the system prompt')")
    origins = getattr(s, "reward_weight_origins", None) or {}
    weighted = []
    for name, weight in zip(a.reward_components, a.reward_component_weights):
        note = f" ({origins[name]})" if name in origins else ""
        weighted.append(f"{name} x {weight:g}{note}")
    lines.append(f"rewards:      {'; '.join(weighted)} (total = weighted sum; truncated: {a.truncated_policy})")
    if a.reward_component_kwargs:
        lines.append(f"              reward_component_kwargs {_kwargs(a.reward_component_kwargs)}")
    lines.append(f"advantage:    {a.advantage} {_kwargs(a.advantage_kwargs)}")
    lines.append(f"policy loss:  {a.policy_loss} {_kwargs(a.policy_loss_kwargs)}, aggregation {a.aggregation}"
                 + (f", reference KL beta={a.beta:g} ({a.kl_estimator}, in the {a.kl_penalty})" if a.beta > 0 else ""))
    padding_free = {None: "auto", True: "on", False: "off"}[a.padding_free]
    lines.append(f"packer:       {a.packer} (<= {a.max_items_per_micro_batch} rows, <= {a.max_padded_tokens_per_micro_batch}"
                 f" padded tokens per micro-batch; padding-free {padding_free})")
    lines.append(f"batch:        {a.per_device_train_batch_size} trajectories per process per step "
                 f"({a.per_device_train_batch_size // a.num_generations} questions x {a.num_generations}), "
                 f"{world_size * a.per_device_train_batch_size} per step in all; max_steps {a.max_steps}, "
                 f"learning_rate {a.learning_rate:g}")
    lines.append(f"processes:    {world_size} on {device}, {distributed}, {precision(a)}")
    lines.append(f"generation:   {generation_backend(a)}, temperature {a.temperature:g}")
    lines.append(f"seeds:        seed {a.seed}, task_seed {s.task_seed}"
                 + (f", data_seed {a.data_seed}" if a.data_seed is not None else ""))
    evaluation = (f"{s.eval_problems} held-out problems x {s.eval_samples} samples before and after"
                  + (f", {s.eval_every_problems} every {s.eval_every_steps} steps" if s.eval_every_steps else "")
                  + f", generated with {evaluation_backend(a)}"
                  if s.eval_problems > 0 else "none (--eval_problems 0)")
    lines.append(f"evaluation:   {evaluation}")
    report = ", ".join(a.report_to) if a.report_to else "none"
    lines.append(f"outputs:      {a.output_dir} (metrics.jsonl, summary.json, final/, checkpoints every "
                 f"{a.save_steps} steps)" if getattr(a.save_strategy, "value", a.save_strategy) == "steps" else
                 f"outputs:      {a.output_dir} (metrics.jsonl, summary.json, final/)")
    if a.viewer_steps:
        lines.append(f"viewer:       {a.output_dir}/trajectories/step-N.html every {a.viewer_steps} steps "
                     f"({a.viewer_trajectories} trajectories; python -m trl_plugins.viewer redraws a saved batch)")
    lines.append(f"logging:      report_to {report}" + (f"; W&B {wandb_mode}" if wandb_mode else ""))
    lines.append("=" * 72)
    return "\n".join(lines)
