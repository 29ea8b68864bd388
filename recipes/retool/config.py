"""The recipe's arguments: ``ScriptArguments`` (task, model and LoRA, evaluation) beside ``MultiTurnGRPOConfig``,
parsed from ``recipes/retool_ppo.yaml``, the user's config files and the command line by both entry points.

Values come in layers, each over the one before: the dataclasses' defaults < the recipe's YAML < the task's own
settings (its reward components and what else it needs: :mod:`retool.tasks`) < each ``--config FILE`` in the order
given < the command line. A key in a higher layer replaces the lower value whole (a ``*_kwargs`` mapping too, as on
the command line). ``--config none`` drops the recipe's YAML (and any file named before it): the layers then start
from the dataclasses' defaults and the task's settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from trl import ModelConfig

from retool.layers import DEFAULT_CONFIG, load_config_layers

__all__ = ["DEFAULT_CONFIG", "ScriptArguments", "parse_args", "split_config_args", "load_config_layers"]


CONFIG_HELP = (
    "A YAML file of field: value pairs (any field below; 'env: {VAR: value}' sets environment variables). "
    "It layers OVER the recipe's YAML (recipes/retool_ppo.yaml), so it needs only the keys it changes; repeat "
    "--config to stack files (later ones win); the command line wins over every file. A key replaces the value "
    "below it whole (a *_kwargs mapping too). 'none' drops the recipe's YAML (fields start from their "
    "defaults). --config=FILE works too. An unknown key is refused with its name."
)


@dataclass
class ScriptArguments(ModelConfig):
    """The task, model and evaluation; TRL's ``ModelConfig`` brings ``--use_peft`` and the ``--lora_*``
    fields (``trl_plugins.run.lora`` honours or refuses each one)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub name or local path; default: the embedded tiny model after its cold-start SFT."},
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={
            "help": "LoRA dropout: 0 (TRL's default 0.05 is refused: dropout in the update but not in generation "
            "biases every importance ratio)."
        },
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset or local file/dir; default: the bundled task named by --task."}
    )
    task: str = field(
        default="arithmetic",
        metadata={
            "help": "The bundled task (without --dataset_name), and the embedded default built for it: 'arithmetic' "
            "(one code call) or 'lookup' (a number behind a key, then arithmetic on it; some keys moved: "
            "recipes/retool_lookup.yaml sets it up); or 'reasoning_gym': reasoning-gym's datasets named by "
            "--task_kwargs (recipes/retool_reasoning_gym.yaml; docs/environments.md), with an embedded "
            "default of its own where the datasets' entries carry their expression (chain_sum, "
            "basic_arithmetic)."
        },
    )
    task_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": '--task reasoning_gym only: the datasets, e.g. \'{"datasets": {"chain_sum": {"weight": 1.0, '
            '"config": {"min_terms": 3}}}}\' (several: a composite mixed by weight; each config takes the '
            "dataset's own fields), and optionally held_out_pool (default 1000). Checked against "
            "reasoning-gym when the config is parsed."
        },
    )
    success_component: str | None = field(
        default=None,
        metadata={
            "help": "The reward component whose is_success(value) counts a held-out sample correct (accuracy, "
            "pass@k); default: the task's ('reasoning_gym' for --task reasoning_gym, else 'correct')."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "Held-out split for the before/after evaluation; never the training split. A dataset without it "
            "(a single local file always) holds out held_out_fraction of the training split instead."
        },
    )
    held_out_fraction: float = field(
        default=0.1,
        metadata={
            "help": "When the dataset has no dataset_test_split (a single local file has none): the share of the "
            "training split held out for evaluation, chosen by a hash of the prompt (the same rows every "
            "run); training leaves them out. 0: hold out nothing (the held-out evaluation is then refused)."
        },
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the question."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the reference answer."})
    train_size: int | None = field(
        default=None, metadata={"help": "Training questions (bundled task: generated; Hub: subsampled)."}
    )
    task_seed: int = field(default=0, metadata={"help": "Seed of the bundled task and of the embedded model's build."})
    eval_problems: int = field(
        default=128, metadata={"help": "Held-out problems for the before/after evaluation (0: skip it)."}
    )
    eval_samples: int = field(default=4, metadata={"help": "Samples per held-out problem."})
    eval_temperature: float = field(
        default=1.0, metadata={"help": "Evaluation temperature (0 = greedy, with eval_samples 1)."}
    )
    eval_every_steps: int = field(
        default=0,
        metadata={
            "help": "Held-out evaluation of the live policy every N steps, logged as heldout/* (0: only before and "
            "after)."
        },
    )
    eval_every_problems: int = field(
        default=64,
        metadata={
            "help": "Held-out problems of each periodic evaluation (the first of the held-out split), eval_samples "
            "each."
        },
    )
    embedded: str = field(
        default="{}", metadata={"help": "EmbeddedSettings overrides (JSON), e.g. '{\"cold_start_epochs\": 3}'."}
    )
    rebuild_embedded: bool = field(default=False, metadata={"help": "Rebuild the cached embedded default."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir an earlier run left files in: they are moved to "
            "output_dir/previous-<time>/ (nothing is deleted). Without it (or --resume_from_checkpoint) a "
            "non-empty output_dir is refused."
        },
    )
    dry_run: bool = field(
        default=False,
        metadata={
            "help": "Run every start-up check (settings, plugins and their contract checks, tools and their schemas, "
            "the data, the chat template, dropout, memory, output_dir, the checkpoint to resume) and print "
            "the start-up lines, then exit: 0, or non-zero with the refusal. Trains and evaluates nothing, "
            "writes or moves nothing in output_dir, starts no tracker and loads no weights (the embedded "
            "default: the cached build, else only the tokenizer and model config its build makes). "
            "docs/recipe.md, 'Checking a config'."
        },
    )
    wandb_project: str | None = field(
        default="trl-plugins-retool", metadata={"help": "W&B project (offline when no API key is configured)."}
    )
    plot: bool = field(default=True, metadata={"help": "Write a PNG of reward, accuracy and tool calls per step."})
    reasoning_gym_task: Any = field(default=None, init=False)
    """``--task reasoning_gym``: its ``task_kwargs`` checked (:class:`retool.reasoning_gym_task.ReasoningGymTask`)."""
    embedded_teacher: Any = field(default=None, init=False)
    """``--teacher_model_name_or_path embedded-rl``: the teacher it names (:class:`retool.teacher.EmbeddedTeacher`),
    whose cache entry is then the teacher path; set by parse_args, built (or found) at start-up."""
    # Set by parse_args (not arguments): where the values came from, for the start-up banner and summary.json.
    config_files: list[str] = field(default_factory=list, init=False)
    """The YAML files layered under the command line, lowest first."""
    dropped_kwargs: list[str] = field(default_factory=list, init=False)
    """Plugin kwargs a lower layer wrote for another plugin than the one a higher layer chose, dropped (one line
    each, for the banner and summary.json; see ``_kwargs_for_their_plugins``)."""
    task_settings: list[str] = field(default_factory=list, init=False)
    """The fields whose value came from the task's own settings (:mod:`retool.tasks`), for the banner."""
    reward_weight_origins: dict[str, str] = field(default_factory=dict, init=False)
    """Per reward component, where its weight came from when the components were changed without weights
    (empty when the weights were given with the components)."""
    provenance: dict[str, str] = field(default_factory=dict, init=False)
    """Per field a layer set, where its value came from: a config file's name, ``the command line`` or ``the CPU
    defaults`` (:func:`retool.launch.cpu_defaults`); a field no layer set has its default. The run carries it
    (``trl_plugins.run.RunSpec.provenance``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}.")
        from retool.coldstart import TASKS
        from retool.reasoning_gym_task import TASK as REASONING_GYM

        if self.task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)}, got {self.task!r}.")
        if self.dataset_name is not None and self.task != "arithmetic":
            raise ValueError(
                f"task {self.task!r} names a bundled task, but dataset_name {self.dataset_name!r} replaces the "
                f"bundled tasks: drop one of them."
            )
        if self.task == REASONING_GYM:
            from retool.reasoning_gym_task import parse_task_kwargs

            self.reasoning_gym_task = parse_task_kwargs(self.task_kwargs if self.task_kwargs is not None else {})
        elif self.task_kwargs not in (None, "", {}, "{}"):
            raise ValueError(
                f"task_kwargs are the settings of --task reasoning_gym; task {self.task!r} takes none: drop "
                f"task_kwargs or set --task reasoning_gym."
            )
        if (
            self.success_component is None
        ):  # parse_args sets the task's (retool.tasks); a caller that builds these may not
            from retool.tasks import default_success_component

            self.success_component = default_success_component(self.task)


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(config values, the other arguments)``: every ``--config FILE`` / ``--config=FILE``, in order.

    Raises:
        SystemExit: ``--config`` is last, with no file after it.
    """
    configs, rest, i = [], [], 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise SystemExit("--config needs a YAML file (or 'none'): --config my.yaml")
            configs.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return configs, rest


def _check_keys(layers: list[tuple[str, dict]], known: set[str]) -> None:
    for path, values in layers:
        for key in values:
            if key == "env" or key in known:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SystemExit(
                f"the config {path} sets {key!r}, which is no field of the recipe "
                f"(ScriptArguments) or of MultiTurnGRPOConfig.{hint} Fix or remove it; "
                f"`python recipes/retool_ppo.py --help` lists the fields."
            )


def _command_line_values(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, Any]:
    # Parse with every default suppressed: the namespace then holds only what argv set (abbreviations,
    # --flag=value and --no_flag included, as argparse reads them).
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return vars(namespace)


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    return set(_command_line_values(parser, argv))


PLUGIN_KWARGS = (
    ("rollout", "rollout_kwargs"),
    ("advantage", "advantage_kwargs"),
    ("policy_loss", "policy_loss_kwargs"),
)
"""A plugin's name field and the kwargs written for the plugin it names."""
KEYED_KWARGS = (("tools", "tool_kwargs"), ("reward_components", "reward_component_kwargs"))
"""A list of plugin names and the kwargs written per name."""


def _kwargs_for_their_plugins(layers: list[tuple[str, dict]], cli: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Plugin kwargs stay with the plugin they were written for.

    The recipe's YAML gives ``policy_loss_kwargs`` for ``ppo_clip``; a higher layer that sets ``--policy_loss
    sym_ppo`` without restating ``policy_loss_kwargs`` would otherwise feed them to ``sym_ppo``. So when the plugin a
    layer's kwargs were written for (the name in force at that layer) is not the one a higher layer chose, the
    kwargs are dropped; for ``tool_kwargs`` / ``reward_component_kwargs`` (keyed by name) only the entries of names a
    higher layer took out of the list are. Returns ``(the replacement values, one note per drop for the banner)``.
    """
    from trl_plugins.trainers import MultiTurnGRPOConfig

    defaults = {
        f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        for f in fields(MultiTurnGRPOConfig)
    }
    stack = [(Path(path).name, values) for path, values in layers] + [("the command line", cli)]

    def highest(name: str, upto: int | None = None) -> int | None:
        found = [i for i, (_, values) in enumerate(stack[: None if upto is None else upto + 1]) if name in values]
        return found[-1] if found else None

    def value(name: str, at: int | None) -> Any:
        return defaults[name] if at is None else stack[at][1][name]

    replaced, notes = {}, []
    for name_field, kwargs_field in PLUGIN_KWARGS + KEYED_KWARGS:
        k_at, n_at = highest(kwargs_field), highest(name_field)
        if k_at is None or n_at is None or n_at <= k_at:
            continue  # the kwargs were written with (or over) the layer that chose the plugin
        written_for, now = value(name_field, highest(name_field, k_at)), value(name_field, n_at)
        written_in, chosen_in = stack[k_at][0], stack[n_at][0]
        kwargs = stack[k_at][1][kwargs_field]
        if (name_field, kwargs_field) in PLUGIN_KWARGS:
            if now == written_for or not kwargs:
                continue
            replaced[kwargs_field] = {}
            notes.append(
                f"{kwargs_field} {_json(kwargs)} from {written_in} were written for {name_field} {written_for!r}; "
                f"{chosen_in} chose {now!r}, so they are dropped (restate {kwargs_field} to pass settings to "
                f"{now!r})"
            )
            continue
        if not isinstance(kwargs, dict):  # a JSON string from the command line is never below another layer
            continue
        kept = {k: v for k, v in kwargs.items() if k in list(now)}
        if len(kept) == len(kwargs):
            continue
        replaced[kwargs_field] = kept
        gone = sorted(set(kwargs) - set(kept))
        notes.append(
            f"{kwargs_field} for {gone} from {written_in} dropped: {chosen_in} set {name_field} {list(now)} "
            f"without them"
        )
    return replaced, notes


def _json(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)


def _weights_by_name(
    layers: list[tuple[str, dict]], cli: set[str], argv: list[str], parser: argparse.ArgumentParser
) -> tuple[list[float] | None, dict[str, str]]:
    """Weights for components that a higher layer changed without restating weights.

    The highest layer that sets ``reward_components`` decides: when neither it nor any layer above sets
    ``reward_component_weights``, the weights below it belonged to other components, so they are carried
    over BY NAME (a component that was there keeps its weight) and a new component gets 1.0; returns
    ``(weights, origin per component)``, or ``(None, {})`` when nothing needs it.
    """
    stack = [(path, values) for path, values in layers] + [("the command line", None)]
    top = None
    for i, (path, values) in enumerate(stack):
        sets = ("reward_components" in cli) if values is None else ("reward_components" in values)
        if sets:
            top = i
    if top is None:
        return None, {}
    for path, values in stack[top:]:
        if ("reward_component_weights" in cli) if values is None else ("reward_component_weights" in values):
            return None, {}
    previous_components: list[str] = []
    previous_weights: list[float] | None = None
    previous_from = "the defaults"
    for path, values in stack[:top]:
        if "reward_components" in values:
            previous_components, previous_weights, previous_from = list(values["reward_components"]), None, path
        if "reward_component_weights" in values:
            previous_weights = values["reward_component_weights"]
    if previous_weights is None or len(previous_weights) != len(previous_components):
        previous_weights = [1.0] * len(previous_components)
    known = dict(zip(previous_components, (float(w) for w in previous_weights)))
    if top == len(stack) - 1:
        components = list(vars(parser.parse_known_args(argv)[0])["reward_components"])
    else:
        components = list(stack[top][1]["reward_components"])
    changed_in = stack[top][0]
    weights, origins = [], {}
    for name in components:
        if name in known:
            weights.append(known[name])
            origins[name] = f"kept by name from {Path(previous_from).name}"
        else:
            weights.append(1.0)
            where = changed_in if changed_in == "the command line" else Path(changed_in).name
            origins[name] = f"defaulted to 1.0: not in {Path(previous_from).name}, added by {where}"
    return weights, origins


def _group_help(parser: argparse.ArgumentParser, dataclass_types: Sequence[type]) -> None:
    """Order --help: --config, then each recipe/plugin class's own fields, then what they inherit from TRL and
    transformers (each in its own titled group)."""
    from trl_plugins.trainers import MultiTurnGRPOConfig

    def own(cls: type) -> set[str]:
        return set(vars(cls).get("__annotations__", {}))

    groups: list[tuple[str, str | None, set[str]]] = []
    for cls in dataclass_types:
        if cls is ScriptArguments:
            groups.append(("the recipe (retool/config.py:ScriptArguments)", None, own(ScriptArguments)))
        elif cls is MultiTurnGRPOConfig:
            groups.append(
                (
                    "trl_plugins: plugins and training (MultiTurnGRPOConfig's own fields)",
                    "Plugins are registry names or 'pkg.module:attr'; *_kwargs take a JSON object on the "
                    "command line. docs/plugins.md lists each plugin's settings.",
                    own(MultiTurnGRPOConfig),
                )
            )
        else:
            groups.append((f"{cls.__module__}:{cls.__name__}", None, {f.name for f in fields(cls)}))
    inherited_model = {f.name for f in fields(ModelConfig)} - own(ScriptArguments)
    groups.append(("TRL's ModelConfig (LoRA, quantisation), inherited by ScriptArguments", None, inherited_model))
    groups.append(
        (
            "TRL's GRPOConfig and transformers' TrainingArguments, inherited by MultiTurnGRPOConfig",
            "Each is honoured, mapped or refused at start-up (trl_plugins/run/trl_fields.py).",
            None,
        )
    )
    default_group = parser._optionals
    made = []
    for title, description, names in groups:
        group = parser.add_argument_group(title, description)
        made.append((group, names))
    for action in list(default_group._group_actions):
        if action.dest in ("help", "config"):
            continue
        for group, names in made:
            if names is None or action.dest in names:
                default_group._group_actions.remove(action)
                group._group_actions.append(action)
                break


def _build_parser(extra: Sequence[type]):
    from trl import TrlParser

    from trl_plugins.trainers import MultiTurnGRPOConfig

    dataclass_types = (*extra, ScriptArguments, MultiTurnGRPOConfig)
    parser = TrlParser(
        dataclass_types,
        usage="[accelerate launch [--config_file ...]] %(prog)s [--config FILE ...] [--FIELD VALUE ...]",
        description="Every field below can be set in a --config file or on the command line; "
        "'(default: ...)' shows the value in force from the config files.",
    )
    # Listed for --help only: parse_args takes every --config out of argv before argparse sees it.
    parser.add_argument("--config", metavar="FILE", action="append", default=argparse.SUPPRESS, help=CONFIG_HELP)
    _group_help(parser, dataclass_types)
    return parser


def parse_args(argv: list[str], *extra: type) -> tuple:
    """Parse ``argv`` into ``(*extra, ScriptArguments, MultiTurnGRPOConfig)``: the recipe's YAML, the user's
    ``--config`` files over it, then the command line (see the module docstring), plus the CPU defaults
    (:func:`retool.launch.cpu_defaults`).

    Reward weights are never reused by position: when a layer changes ``reward_components`` without giving
    ``reward_component_weights``, a component that was configured below keeps its weight by name and a new
    one gets 1.0 (``ScriptArguments.reward_weight_origins`` says which; the start-up banner prints it).

    Raises:
        SystemExit: a config file cannot be read or sets a key that is no field (the key is named), or a value the
            dataclasses refuse (their ``__post_init__`` checks), with where each field the refusal names was set;
            or the teacher ``embedded-rl`` with a student other than the embedded default.
    """
    from retool.launch import cpu_defaults
    from retool.teacher import EMBEDDED_RL
    from trl_plugins.trainers import MultiTurnGRPOConfig

    configs, argv = split_config_args(argv)
    layers = load_config_layers(configs)
    parser = _build_parser(extra)
    known = {action.dest for action in parser._actions} - {"help", "config"}
    _check_keys(layers, known)
    layers, task_layer = _with_task_layer(layers, parser, argv)
    merged: dict[str, Any] = {}
    env: dict[str, Any] = {}
    for path, values in layers:
        values = dict(values)
        env_values = values.pop("env", {}) or {}
        if not isinstance(env_values, dict):
            raise SystemExit(f"the config {path}: 'env' must be a mapping of variable: value.")
        env.update(env_values)
        merged.update(values)
    for key, value in env.items():
        os.environ[key] = str(value)
    user_argv = list(argv)
    defaults = cpu_defaults(argv, merged)
    argv = argv + defaults
    parser.set_defaults_with_config(**merged)
    origins: dict[str, str] = {}
    provenance: dict[str, str] = {}
    dropped: list[str] = []
    if not any(a in ("-h", "--help") for a in argv):
        weights, origins = _weights_by_name(layers, _given_on_command_line(parser, argv), argv, parser)
        if weights is not None:
            parser.set_defaults_with_config(reward_component_weights=weights)
        replaced, dropped = _kwargs_for_their_plugins(layers, _command_line_values(parser, user_argv))
        if replaced:
            parser.set_defaults_with_config(**replaced)
        provenance = _provenance(
            layers,
            _given_on_command_line(parser, user_argv),
            _given_on_command_line(parser, defaults),
            reweighted=weights is not None,
        )
        for key in replaced:
            provenance[key] = f"{provenance[key]}, less what was written for other plugins"
    try:
        outputs = tuple(parser.parse_args_into_dataclasses(argv))
    except (
        ValueError,
        LookupError,
    ) as exc:  # a __post_init__ check: one line, with where the settings it names came from
        raise SystemExit(
            f"configuration error (before any model loads): {exc}{_origins_of(str(exc), provenance)}"
        ) from exc
    script_args = next(o for o in outputs if isinstance(o, ScriptArguments))
    training_args = next(o for o in outputs if isinstance(o, MultiTurnGRPOConfig))
    if training_args.teacher_model_name_or_path == EMBEDDED_RL:
        outputs = _with_embedded_teacher(parser, argv, script_args, training_args, provenance)
        script_args = next(o for o in outputs if isinstance(o, ScriptArguments))
    script_args.config_files = [path for path, _ in layers if path != task_layer]
    script_args.task_settings = sorted(key for key, where in provenance.items() if where == task_layer)
    script_args.reward_weight_origins = origins
    script_args.dropped_kwargs = dropped
    script_args.provenance = provenance
    return outputs


def _with_embedded_teacher(
    parser: argparse.ArgumentParser, argv: list[str], script_args: Any, training_args: Any, provenance: dict[str, str]
) -> tuple:
    """The arguments parsed again with the teacher ``embedded-rl`` resolved to its cache entry's model folder
    (:func:`retool.teacher.embedded_teacher`; nothing is built here), that teacher on ``script_args.embedded_teacher``
    and the provenance of ``teacher_model_name_or_path`` naming it.

    Raises:
        SystemExit: the student is not the embedded default (``model_name_or_path`` set), or its ``--embedded``
            settings are refused.
    """
    from retool.teacher import EMBEDDED_RL, embedded_teacher

    if script_args.model_name_or_path is not None:
        message = (
            f"teacher_model_name_or_path {EMBEDDED_RL!r} is the embedded default after its task's RL recipe and "
            f"teaches only the embedded default; with model_name_or_path {script_args.model_name_or_path!r}, give a "
            f"teacher path: --teacher_model_name_or_path path/to/teacher (a model with the student's tokenizer)."
        )
        raise SystemExit(f"configuration error (before any model loads): {message}{_origins_of(message, provenance)}")
    try:
        teacher = embedded_teacher(script_args, training_args)
    except ValueError as exc:
        raise SystemExit(
            f"configuration error (before any model loads): --embedded {script_args.embedded}: {exc}"
        ) from None
    outputs = tuple(parser.parse_args_into_dataclasses([*argv, "--teacher_model_name_or_path", str(teacher.model_dir)]))
    next(o for o in outputs if isinstance(o, ScriptArguments)).embedded_teacher = teacher
    where = provenance.get("teacher_model_name_or_path", "the command line")
    provenance["teacher_model_name_or_path"] = f"{EMBEDDED_RL} in {where}, the cache entry {teacher.key}"
    return outputs


def _with_task_layer(
    layers: list[tuple[str, dict]], parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[list[tuple[str, dict]], str]:
    """``layers`` with the chosen task's own settings (:func:`retool.tasks.task_layer`) over the recipe's YAML and
    under the user's files, and that layer's name. The task is the command line's ``--task``, else the highest
    file's, else the field's default."""
    from retool.tasks import task_layer

    task = next((f.default for f in fields(ScriptArguments) if f.name == "task"), None)
    for _, values in layers:
        task = values.get("task", task)
    if not any(a in ("-h", "--help") for a in argv):
        task = _command_line_values(parser, argv).get("task", task)
    name, values = task_layer(str(task))
    at = 1 if layers and layers[0][0] == str(DEFAULT_CONFIG) else 0
    return [*layers[:at], (name, values), *layers[at:]], name


def _origins_of(message: str, provenance: dict[str, str]) -> str:
    """`` [reward_components: the command line; reward_component_weights: retool_ppo.yaml]`` for the fields
    ``message`` names that a layer set (empty when it names none)."""
    named = [key for key in provenance if re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message)]
    return f" [set by: {'; '.join(f'{key} in {provenance[key]}' for key in named)}]" if named else ""


def _provenance(layers: list[tuple[str, dict]], cli: set[str], cpu: set[str], *, reweighted: bool) -> dict[str, str]:
    """Where each field's value came from: the highest layer that set it (a config file by name, the command line,
    the CPU defaults); reward weights carried over by name come from the layer that changed the components."""
    out: dict[str, str] = {}
    for path, values in layers:
        for key in values:
            if key != "env":
                out[key] = Path(path).name
    out.update({key: "the CPU defaults" for key in cpu})
    out.update({key: "the command line" for key in cli})
    if reweighted and "reward_components" in out:
        out["reward_component_weights"] = f"kept by name as {out['reward_components']} changed reward_components"
    return dict(sorted(out.items()))
