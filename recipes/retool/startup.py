"""Start-up of the recipe: the run resolved once and the chat template checked, before any model loads, and the
banner that says what the run will do (plugins, sandbox, processes and precision, generation, outputs).

:func:`start_up` lists the recipe's start-up checks in the order they run; a run and its dry run
(``--dry_run``) go through the same list, the dry run checking only where the run would act (output_dir, W&B,
the builds of the embedded default and of the teacher ``embedded-rl``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "StartUp",
    "start_up",
    "DRY_RUN_UNCHECKED",
    "resolve",
    "check_plugins",
    "check_chat_template",
    "check_sampler_memory",
    "check_update_fits",
    "distributed_mode",
    "evaluation_backend",
    "precision",
    "format_banner",
]


def resolve(script_args: Any, training_args: Any) -> Any:
    """The run, resolved once before anything is built or loaded (:func:`trl_plugins.run.resolve_run`): TRL's
    ``ModelConfig`` fields honoured or refused, every plugin built with its kwargs and checked, the sampler picked,
    the LoRA adapter checked, and each tool that declares ``start_up()`` started (the code interpreter resolves and
    probes its sandbox's isolation: no warm interpreter is started). The trainer, the evaluations and the banner
    all take this run; the settings' provenance (``script_args.provenance``) travels in it.

    Raises:
        SystemExit: a setting or a plugin refused, or a tool that could not start; the message is the check's own.
    """
    from retool.tasks import TASK_TOOLS
    from trl_plugins.run import resolve_run
    from trl_plugins.run.lora import check_model_config, peft_config_from

    try:
        check_model_config(script_args, training_args)  # --use_peft, --lora_*, quantisation, ...
        run = resolve_run(training_args, provenance=script_args.provenance, peft_config=peft_config_from(script_args))
    except (LookupError, ValueError, TypeError, RuntimeError) as exc:  # LookupError: the registry's unknown names
        raise SystemExit(f"configuration error (before any model loads): {exc}") from exc
    missing = [name for name in TASK_TOOLS.get(script_args.task, ()) if name not in run.tools]
    if missing:
        run.close()
        raise SystemExit(
            f"configuration error (before any model loads): task {script_args.task!r} needs the tool(s) "
            f"{missing} (the run has {sorted(run.tools)}): its problems cannot be solved without them. "
            f"The task brings its tools where nothing else sets --tools (recipes/retool/tasks.py): drop "
            f"the --tools you set (its provenance: {run.spec.origin('tools')}), or add them to it."
        )
    from retool.default_model import check_embedded_default

    try:
        if script_args.reasoning_gym_task is not None:
            from retool.reasoning_gym_task import check_run

            check_run(run)
        check_embedded_default(script_args, training_args)  # what its build would refuse minutes later, refused now
        check_plot(script_args)
    except ValueError as exc:
        run.close()
        raise SystemExit(f"configuration error (before any model loads): {exc}") from None
    try:
        run.start_tools()
    except (ValueError, TypeError, RuntimeError) as exc:
        run.close()
        raise SystemExit(f"configuration error (before any model loads): a tool could not start: {exc}") from exc
    return run


def check_plot(script_args: Any) -> None:
    """``--plot`` (the default) draws with matplotlib at the run's end: an interpreter without it (vLLM's,
    ``.venv-vllm``, installs the project without its dependencies) is refused now, not after the training."""
    import importlib.util

    if getattr(script_args, "plot", False) and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot draws the run's PNG with matplotlib, which this interpreter lacks; pip install matplotlib, or "
            "pass --plot false (metrics.jsonl and summary.json are written either way)"
        )


DRY_RUN_UNCHECKED = (
    "the trainer's checks of the loaded policy (a LoRA adapter's target modules among its layers, the critic built "
    "from it, shared_prefix's automatic choice by its attention): skipped in a dry run: they need the weights",
)
"""What a dry run cannot check, said at its end."""


@dataclass
class StartUp:
    """What the start-up checks (:func:`start_up`) settled, for the run that follows them."""

    state: Any
    """accelerate's ``PartialState`` (the process group is up)."""
    say: Callable[..., None]
    """``print`` on the main process, nothing on the others."""
    ks: list[int]
    """The pass@k values the evaluations report."""
    resume: Any
    """The checkpoint to resume from (``trl_plugins.trainers.checkpoints.ResumePoint``), or None."""
    train_rows: list[dict]
    heldout_rows: list[dict]
    model_path: str | None
    """The model to load; None in a dry run that checked the embedded default's stand-in (no weights exist yet)."""
    tokenizer: Any
    """The model's tokenizer, its pad token set; the run's chat format is bound to it."""
    wandb_mode: str | None = None
    lines: list[str] = field(default_factory=list)


def start_up(script_args: Any, training_args: Any, run: Any, *, dry_run: bool) -> StartUp:
    """The recipe's start-up checks, in order, on every rank, after the run was resolved (:func:`resolve`: settings,
    plugins, tools and their isolation) and before any weights load; each refusal is a ``SystemExit`` that says why.

    The held-out evaluation's settings; the process group; ``output_dir`` (not two runs in one folder); the checkpoint
    to resume; the banner; the task's rows; each plugin's contract check on a real row; the teacher ``embedded-rl``
    (:mod:`retool.teacher`) and the model (built or read from the cache); its tokenizer with the chat template; the
    policy's dropout; the continuous-batching cache's size. A new check goes into this list where what it needs
    exists (its place in the banner's order). With ``dry_run``
    every check runs, but ``output_dir`` is checked and not claimed, W&B is described and not set up, no child
    interpreter starts, the teacher ``embedded-rl`` is looked up in the cache and not built, and the embedded default
    is read from the cache or stood in for by the tokenizer and model config its build makes
    (:func:`retool.default_model.model_for_dry_run`); the end says what was not checked.

    Raises:
        SystemExit: a refusal (the message is the check's own).
    """
    import torch
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from retool.data import task_rows
    from retool.default_model import model_for_dry_run, model_path_or_default
    from retool.evaluate import check_eval_settings
    from retool.launch import available_cpus, claim_output_dir, configure_wandb, prepare_child, wandb_mode
    from retool.teacher import dry_run_line, ensure_embedded_teacher
    from trl_plugins.run.lora import check_model_dropout, model_init_kwargs
    from trl_plugins.trainers.checkpoints import resolve_resume

    begun = time.perf_counter()
    ks = check_eval_settings(script_args, run)
    _ = training_args.device  # set up the process group the trainer's way (gloo on CPU) before anything else
    state = PartialState()
    main_process = state.is_main_process
    say = print if main_process else (lambda *a, **k: None)
    # One run per output folder: every rank refuses a folder an earlier run filled; the main process moves it aside.
    claim_output_dir(
        training_args.output_dir,
        resume=training_args.resume_from_checkpoint,
        overwrite=script_args.overwrite_output_dir,
        move=main_process,
        dry_run=dry_run,
        log=say,
    )
    state.wait_for_everyone()
    # The checkpoint to resume from is checked now, before any model loads; train() takes what was found.
    try:
        resume = resolve_resume(
            training_args.resume_from_checkpoint,
            training_args.output_dir,
            fallback=training_args.resume_fallback,
            needs_optimizer=not training_args.save_only_model,
            max_steps=training_args.max_steps,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    evaluate = script_args.eval_problems > 0
    if main_process and evaluate and not dry_run:
        prepare_child()  # the first evaluation's (or the embedded default's build's) interpreter imports meanwhile
    if state.num_processes == 1 and not torch.cuda.is_available() and torch.get_num_threads() < available_cpus():
        # accelerate launch sets OMP_NUM_THREADS=1 where it counts one physical core; one process may use them all.
        say(f"CPU threads: {torch.get_num_threads()} -> {available_cpus()} (one process on {available_cpus()} cores)")
        torch.set_num_threads(available_cpus())
    if dry_run:
        mode = wandb_mode(training_args.report_to)
    else:
        mode = configure_wandb(training_args.report_to, training_args.output_dir, script_args.wandb_project)
        if mode:
            say(f"W&B: {mode} (files under {os.environ['WANDB_DIR']}/wandb; 'wandb sync' uploads offline runs)")
    say(
        format_banner(
            script_args,
            run,
            world_size=state.num_processes,
            device=str(state.device),
            distributed=distributed_mode(training_args=training_args),
            tool_start_up=run.start_tools(),
            wandb_mode=mode,
            dry_run=dry_run,
        ),
        flush=True,
    )

    # The rows before any model: a missing column or split, or a held-out split that cannot be carved, stops here.
    # Training and every held-out evaluation split alike (retool.data.load_task_rows); the main process says how.
    said: list[str] = []
    try:
        train_rows = task_rows(script_args, "train", size=script_args.train_size, log=said.append, rollout=run.rollout)
        heldout_rows = (
            task_rows(script_args, "test", size=script_args.eval_problems, log=said.append, rollout=run.rollout)
            if evaluate
            else []
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    for line in dict.fromkeys(said):  # a carved split is described once, not once per side
        say(line)
    # Each plugin's cheap contract check (a reward returning NaN, a loss with gradient off the mask) on a pickled copy,
    # with a real row: seconds, where a failure would otherwise come after the model loaded and a step ran.
    for line in check_plugins(run, train_rows[0] if train_rows else None):
        say(f"start-up checks: {line}")

    teacher = script_args.embedded_teacher  # embedded-rl: resolved to its cache entry when the arguments were parsed
    with contextlib.ExitStack() as stack:
        if dry_run:  # the cached build, or a stand-in (its tokenizer + config) in a folder gone after the checks
            if teacher is not None:
                say(dry_run_line(teacher))
            model_path, stood_in = stack.enter_context(
                model_for_dry_run(script_args, training_args, rebuild=script_args.rebuild_embedded, log=say)
            )
        else:
            with state.main_process_first():  # only the main process builds the embedded default; the others find it
                if teacher is not None:  # its build trains from the embedded default, which it builds first
                    ensure_embedded_teacher(teacher, log=say)
                model_path = model_path_or_default(
                    script_args, training_args, rebuild=script_args.rebuild_embedded and main_process, log=say
                )
            stood_in = False
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        check_chat_template(tokenizer, run)
        try:  # before the model loads: its config is enough to see dropout the update would train with
            check_model_dropout(model_path, training_args)
        except ValueError as exc:
            raise SystemExit(f"configuration error (before the model loads): {exc}") from None
        sampler_memory = check_sampler_memory(run, model_path, model_init_kwargs(script_args, training_args))
        if sampler_memory:
            say(f"start-up checks: {sampler_memory}")
        attention = model_init_kwargs(script_args, training_args).get("attn_implementation")  # None: transformers' own
        say(f"start-up checks: {check_update_fits(run, model_path, training_args, attention=attention)}")
    if main_process and evaluate and not dry_run:
        prepare_child()  # for the evaluation of the starting model, if the build took the first one
    if dry_run:
        for line in DRY_RUN_UNCHECKED:
            say(f"dry run: not checked: {line}")
        say(
            f"dry run: every start-up check passed ({time.perf_counter() - begun:.1f} s); nothing was trained, "
            f"evaluated, written or moved (output_dir {training_args.output_dir}), no tracker started.",
            flush=True,
        )
    return StartUp(
        state=state,
        say=say,
        ks=ks,
        resume=resume,
        train_rows=train_rows,
        heldout_rows=heldout_rows,
        model_path=None if stood_in else model_path,
        tokenizer=tokenizer,
        wandb_mode=mode,
    )


def check_plugins(run: Any, example: Any) -> list[str]:
    """Each reward's, the advantage's and the policy loss's contract check on a pickled copy, before any model loads
    (:func:`trl_plugins.run.checks.startup_checks`; ``example`` is the first training row); returns what to print.

    Raises:
        SystemExit: a plugin failed its check (the message says how to skip it).
    """
    from trl_plugins.run.checks import startup_checks
    from trl_plugins.run.plugins import SettingError

    try:
        return startup_checks(run, example)
    except SettingError as exc:
        raise SystemExit(f"configuration error (before any model loads): {run.spec.explain(exc)}") from exc


def check_chat_template(tokenizer: Any, run: Any) -> None:
    """The chat template's checks (prefix-preserving, shows the tools' schemas, stop tokens, ...) on the run's
    tokenizer and tools, right after the tokenizer loads: before the model loads and before any evaluation. The
    run keeps the chat format it built (:meth:`trl_plugins.run.Run.bind_tokenizer`).

    Raises:
        SystemExit: the template cannot be followed token for token (the message says why and what to use).
    """
    from trl_plugins.rollout import ChatTemplateError

    try:
        run.bind_tokenizer(tokenizer)
    except ChatTemplateError as exc:
        raise SystemExit(f"configuration error (before any model loads): the chat template: {exc}") from exc


def check_sampler_memory(run: Any, model_path: str, model_kwargs: Mapping[str, Any]) -> str | None:
    """Whether the continuous-batching cache will fit
    (:func:`trl_plugins.run.sampler.check_continuous_batching_memory`),
    once the model's path is known and before its weights load (and before the first evaluation generates with it);
    returns the line to print, or None for another sampler.

    Raises:
        SystemExit: it will not fit (the message gives the figures and settings that fit).
    """
    from trl_plugins.run import SamplerKind
    from trl_plugins.run.sampler import check_continuous_batching_memory

    if run.sampler is not SamplerKind.CONTINUOUS_BATCHING:
        return None
    try:
        return check_continuous_batching_memory(
            run,
            model_path,
            dtype=model_kwargs.get("dtype"),
            trainable_fraction=0.0 if run.spec.peft_config is not None else 1.0,
        )
    except ValueError as exc:
        raise SystemExit(f"configuration error (before any model loads): {exc}") from exc


def check_update_fits(run: Any, model_path: str, training_args: Any, *, attention: str | None = None) -> str:
    """The update's largest activation against the free memory
    (:func:`trl_plugins.run.update_memory.check_update_memory`),
    from the model's config and the run's limits, before the weights load, after sequence parallelism's limits
    (:func:`trl_plugins.run.parallelism.check_sequence_parallel`); returns the line to print.

    Raises:
        SystemExit: it will not fit (the message gives the figures and what to change).
    """
    from accelerate import PartialState
    from transformers import AutoConfig

    from trl_plugins.run.parallelism import check_sequence_parallel
    from trl_plugins.run.update_memory import check_update_memory

    config = AutoConfig.from_pretrained(model_path)
    try:  # sequence parallelism's limits: the processes, DeepSpeed, the model's heads and attention
        check_sequence_parallel(
            training_args,
            config,
            world_size=PartialState().num_processes,
            deepspeed=distributed_mode(training_args=training_args).startswith("DeepSpeed"),
            policy_loss=run.policy_loss,
            attention=attention,
        )
    except ValueError as exc:
        raise SystemExit(f"configuration error (before any model loads): {exc}") from exc
    text = getattr(config, "text_config", None) or config
    hidden, vocab, layers = int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    # Parameters: the embeddings (twice untied) and, per layer, attention's 4 H x H and the MLP's 3 H x I.
    params = vocab * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2) + layers * (
        4 * hidden * hidden + 3 * hidden * intermediate
    )
    value_bytes = 2 if (training_args.bf16 or training_args.fp16) else 4
    try:
        return check_update_memory(
            training_args,
            config,
            weights_bytes=params * value_bytes,
            trainable_fraction=0.0 if run.spec.peft_config is not None else 1.0,
        )
    except ValueError as exc:
        raise SystemExit(f"configuration error (before any model loads): {exc}") from exc


def distributed_mode(env: Mapping[str, str] | None = None, training_args: Any = None) -> str:
    """How the processes share the model: ``DeepSpeed ZeRO-<stage>``, ``FSDP``, ``DDP`` or ``single process``
    (from accelerate launch's environment, or ``training_args.deepspeed``)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return f"DeepSpeed ZeRO-{stage}" if stage else "DeepSpeed"
    deepspeed = training_args.deepspeed if training_args is not None else None
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
    if training_args.bf16:
        return "bf16"
    if training_args.fp16:
        return "fp16"
    return "fp32"


def evaluation_backend(run: Any) -> str:
    """What generates the held-out evaluations: vLLM serves the training rollouts only (the before/after evaluation
    runs in a child process with HF generate), continuous batching serves both."""
    if run.sampler.is_vllm:
        return "HF generate (vLLM serves the training rollouts only)"
    return run.sampler.describe(run.config)


def _kwargs(values: Any) -> str:
    return json.dumps(values, sort_keys=True, default=str) if values else "{}"


def format_banner(
    script_args: Any,
    run: Any,
    *,
    world_size: int,
    device: str,
    distributed: str,
    tool_start_up: Mapping[str, str] | None = None,
    wandb_mode: str | None = None,
    dry_run: bool = False,
) -> str:
    """The start-up banner: every plugin in force with its settings, the sandbox's isolation, processes and
    precision, the generation backend, and where outputs go (``dry_run``: what the run would do; it says so). Pure:
    everything comes in as arguments (the run, and what its tools reported when they started:
    :meth:`trl_plugins.run.Run.start_tools`)."""
    from trl_plugins.run.checks import prompt_warnings

    a, s = run.config, script_args
    tool_start_up = dict(tool_start_up or {})
    lines = [
        "=" * 72,
        "ReTool PPO: the run" + (" (dry run: the start-up checks only; nothing trains)" if dry_run else ""),
        "-" * 72,
    ]
    model = (
        s.model_name_or_path
        or "the embedded default (tiny Qwen2 after its cold-start SFT; built or read from the cache)"
    )
    lines.append(f"model:        {model}" + (f"  [LoRA adapter, r={s.lora_r}]" if s.use_peft else ""))
    if s.reasoning_gym_task is not None:
        lines.append(
            f"dataset:      reasoning-gym: {s.reasoning_gym_task.describe()} (held-out rows from task_seed, "
            f"training rows from other seeds, none sharing a question)"
        )
    elif run.rollout.rows_fn is not None:  # a verifiers environment's tasks: retool.data.task_rows takes them
        lines.append(
            f"dataset:      the rows of {run.rollout.label} (held_out_fraction={s.held_out_fraction} held out)"
        )
    else:
        lines.append(
            f"dataset:      {s.dataset_name or f'the bundled {s.task} task'}"
            f" (train split {s.dataset_train_split!r}, held-out split {s.dataset_test_split!r})"
        )
    if s.config_files:
        lines.append(f"config files: {' < '.join(s.config_files)} < command line")
    if s.task_settings:
        lines.append(
            f"task:         {s.task!r} set {', '.join(s.task_settings)} (its own settings, under your config "
            f"files and the command line: recipes/retool/tasks.py)"
        )
    for note in s.dropped_kwargs:
        lines.append(f"note:         {note}")
    lines.append(f"rollout:      {a.rollout} {_kwargs(a.rollout_kwargs)}")
    describe = getattr(getattr(run.rollout, "impl", run.rollout), "describe", None)
    if callable(describe):
        lines.append(f"                {describe()}")
    pairs = [(t.configured, (n, t)) for n, t in run.tools.items()]  # a tool set (mcp) is several: each under its plugin
    previous = None
    for configured, (name, tool) in pairs:
        called = f" (the model calls it {name!r})" if configured != name else ""
        if configured == previous:
            lines.append(f"              {'':{len(configured)}} {called.strip()}")
        else:
            lines.append(f"tool:         {configured} {_kwargs(a.tool_kwargs.get(configured))}{called}")
        previous = configured
        if name in tool_start_up:
            lines.append(f"                {tool_start_up[name]}")
        else:
            lines.append("                (reports how it runs when the tools start)")
    for warning in prompt_warnings(a.system_prompt, run.tools):
        lines.append(f"warning:      {warning}")
    origins = s.reward_weight_origins
    weighted = []
    for name, weight in zip(a.reward_components, a.reward_component_weights):
        note = f" ({origins[name]})" if name in origins else ""
        weighted.append(f"{name} x {weight:g}{note}")
    lines.append(f"rewards:      {'; '.join(weighted)} (total = weighted sum; truncated: {a.truncated_policy})")
    if a.reward_component_kwargs:
        lines.append(f"              reward_component_kwargs {_kwargs(a.reward_component_kwargs)}")
    lines.append(f"advantage:    {a.advantage} {_kwargs(a.advantage_kwargs)}")
    if a.features.distillation is not None:
        lines.append(
            f"teacher:      {a.features.distillation.teacher}"
            + (
                f" (embedded-rl: the embedded default after the {s.task} task's RL recipe; built once, cached)"
                if s.embedded_teacher is not None
                else ""
            )
        )
    lines.append(
        f"policy loss:  {a.policy_loss} {_kwargs(a.policy_loss_kwargs)}, aggregation {a.aggregation}"
        + (f", reference KL beta={a.beta:g} ({a.kl_estimator}, in the {a.kl_penalty})" if a.beta > 0 else "")
    )
    skipped = "all" if "all" in a.skip_startup_checks else ", ".join(a.skip_startup_checks)
    lines.append(
        "checks:       each reward, the advantage and the policy loss run their contract check on a copy "
        "before any model loads" + (f"; skipped (skip_startup_checks): {skipped}" if skipped else "")
    )
    state = {None: "auto", True: "on", False: "off"}
    sp = a.features.long_trajectories.sequence_parallel_size
    rows = f"1 row split over {sp} ranks (sequence parallelism)" if sp > 1 else f"<= {a.max_items_per_micro_batch} rows"
    lines.append(
        f"packer:       {a.packer} ({rows}, <= {a.max_padded_tokens_per_micro_batch}"
        f" padded tokens per micro-batch; padding-free {state[a.padding_free]}; shared prefix "
        f"{state[a.shared_prefix]})"
    )
    lines.append(
        f"batch:        {a.per_device_train_batch_size} trajectories per process per step "
        f"({a.per_device_train_batch_size // a.num_generations} questions x {a.num_generations}), "
        f"{world_size * a.per_device_train_batch_size} per step in all; max_steps {a.max_steps}, "
        f"learning_rate {a.learning_rate:g}"
    )
    split = (
        f", each datum's tokens split over {sp} ranks in the update (sequence parallelism, "
        f"{world_size // sp} data-parallel groups)"
        if sp > 1
        else ""
    )
    lines.append(f"processes:    {world_size} on {device}, {distributed}{split}, {precision(a)}")
    lines.append(f"generation:   {run.sampler.describe(a)}, temperature {a.temperature:g}")
    lines.append(
        f"seeds:        seed {a.seed}, task_seed {s.task_seed}"
        + (f", data_seed {a.data_seed}" if a.data_seed is not None else "")
    )
    evaluation = (
        f"{s.eval_problems} held-out problems x {s.eval_samples} samples before and after"
        + (f", {s.eval_every_problems} every {s.eval_every_steps} steps" if s.eval_every_steps else "")
        + f", generated with {evaluation_backend(run)}"
        if s.eval_problems > 0
        else "none (--eval_problems 0)"
    )
    lines.append(f"evaluation:   {evaluation}")
    report = ", ".join(a.report_to) if a.report_to else "none"
    lines.append(
        f"outputs:      {a.output_dir} (metrics.jsonl, summary.json, run_config/, final/, checkpoints every "
        f"{a.save_steps} steps)"
        if getattr(a.save_strategy, "value", a.save_strategy) == "steps"
        else f"outputs:      {a.output_dir} (metrics.jsonl, summary.json, run_config/, final/)"
    )
    if a.viewer_steps:
        lines.append(
            f"viewer:       {a.output_dir}/trajectories/step-N.html every {a.viewer_steps} steps "
            f"({a.viewer_trajectories} trajectories; python -m trl_plugins.viewer redraws a saved batch)"
        )
    lines.append(
        f"logging:      report_to {report}"
        + (f"; W&B {wandb_mode}" if wandb_mode else "")
        + (" (not started in a dry run)" if wandb_mode and dry_run else "")
    )
    lines.append("=" * 72)
    return "\n".join(lines)
