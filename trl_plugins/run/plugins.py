"""Building a run's plugins from the registries, and the checks that need them built.

Each plugin is resolved by name (unknown names raise with "did you mean"), its kwargs checked against its
signature, constructed once, and wrapped in its seam's adapter (:mod:`trl_plugins.protocols`), which reads its
declarations. :func:`check_plugin_settings` then refuses what the selected plugins need but the run does not
provide, and budgets that cannot fit: the checks that a config alone cannot make.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import inspect
import types
import typing
from typing import Any, Mapping, Sequence

from trl_plugins.protocols import (
    AdvantagePlugin,
    PolicyLossPlugin,
    RewardPlugin,
    RolloutPlugin,
    ToolPlugin,
    as_advantage,
    as_policy_loss,
    as_reward,
    as_rollout,
    tools_of,
)
from trl_plugins.registry import ADVANTAGES, REWARDS, ROLLOUTS, TOOLS, Registry
from trl_plugins.tools.base import schema_problem
from trl_plugins.types import AggregationMode

__all__ = [
    "SettingError",
    "nearest",
    "fits",
    "check_kwargs",
    "describe_plugin",
    "plugin_params",
    "construct",
    "build_tools",
    "build_rewards",
    "build_rollout",
    "build_advantage",
    "build_policy_loss",
    "context_limit",
    "check_plugin_settings",
]


def plugin_params(target: Any) -> Mapping[str, inspect.Parameter] | None:
    """Keyword parameters of a plugin, or None when it takes ``**kwargs`` or has no signature (a builtin
    or C callable): then nothing can be checked statically."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class SettingError(ValueError):
    """A setting the run cannot use. The message names the setting, says what is wrong and what is accepted, and
    the nearest accepted name; :func:`trl_plugins.run.resolve_run` adds where the value came from."""

    def __init__(self, setting: str, what: str) -> None:
        super().__init__(f"{setting}: {what}")
        self.setting, self.what = setting, what


def nearest(name: str, accepted: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for the accepted name closest to ``name`` (empty when none is close)."""
    close = difflib.get_close_matches(name, [str(a) for a in accepted], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _annotations(target: Any) -> dict[str, Any]:
    """The resolved annotations of a plugin's keyword parameters (empty when they cannot be resolved)."""
    try:
        if inspect.isclass(target):
            hints = (
                typing.get_type_hints(target)
                if dataclasses.is_dataclass(target)
                else typing.get_type_hints(target.__init__)
            )
        else:
            hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation we cannot resolve is not checked
        return {}
    return {k: v for k, v in hints.items() if k != "return" and typing.get_origin(v) is not typing.ClassVar}


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(str(m.value)) for m in tp)
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    names = {
        bool: "a bool (true or false, unquoted)",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        list: "a list",
        tuple: "a list",
    }
    return names.get(typing.get_origin(tp) or tp, getattr(tp, "__name__", str(tp)))


def fits(value: Any, tp: Any) -> bool | None:
    """Whether ``value`` (as parsed from YAML or JSON) has the annotated type ``tp``: True, False, or None when the
    annotation is one this check does not judge."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        verdicts = [fits(value, a) for a in args]
        return True if any(v for v in verdicts) else (None if None in verdicts else False)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if inspect.isclass(tp) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in {m.value for m in tp}
    if origin in (list, tuple, collections.abc.Sequence) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return isinstance(value, dict)
    return None


def check_kwargs(target: Any, kwargs: Mapping[str, Any], setting: str, plugin: str) -> None:
    """``kwargs`` against the plugin's signature and annotations: an unknown key (with the accepted ones and the
    nearest), or a value of another type than annotated (a string ``"false"`` where a bool is expected, say), is
    refused. Nothing is checked for a plugin that takes ``**kwargs``.

    Raises:
        SettingError: naming the key, what it takes and what it got.
    """
    params = plugin_params(target)
    if params is None:
        return
    accepted = list(params)
    for key in kwargs:
        if key not in params:
            raise SettingError(setting, f"{plugin} takes no {key!r}; it accepts {accepted}.{nearest(key, accepted)}")
    hints = _annotations(target)
    for key, value in kwargs.items():
        tp = hints.get(key)
        if tp is not None and fits(value, tp) is False:
            quoted = (
                " (quoted: write it without quotes)"
                if isinstance(value, str) and value.lower() in ("true", "false", "null", "none") or _is_number(value)
                else ""
            )
            raise SettingError(
                f"{setting}[{key!r}]",
                f"{plugin} takes {_describe(tp)}, got {value!r} ({type(value).__name__}){quoted}.",
            )


def _is_number(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def construct(registry: Registry[Any], name: str, kwargs: Mapping[str, Any], setting: str, name_setting: str) -> Any:
    """The plugin ``name`` of ``registry`` built with ``kwargs`` (``setting`` names the kwargs in errors,
    ``name_setting`` the field that chose the plugin).

    Raises:
        SettingError: an unknown name (with the nearest and the known ones), a key the plugin does not take (with the
            accepted keys), a value of the wrong type, or a value the plugin itself refuses.
    """
    try:
        target = registry.get(name)
    except LookupError as exc:
        raise SettingError(name_setting, str(exc)) from None
    label = f"{registry.seam} plugin {name!r}"
    check_kwargs(target, kwargs, setting, label)
    try:
        return target(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SettingError(setting, f"{label} refused {dict(kwargs)}: {exc}") from exc


def check_keyed_kwargs(kwargs: Mapping[str, Any], names: Sequence[str], setting: str, names_setting: str) -> None:
    """Per-plugin kwargs (``tool_kwargs``, ``reward_component_kwargs``) must be keyed by configured plugins: settings
    for a misspelled or unconfigured name would otherwise be silently unused.

    Raises:
        SettingError: naming the key, the configured names and the nearest.
    """
    for key, value in kwargs.items():
        if key not in names:
            raise SettingError(
                setting,
                f"has settings for {key!r}, which is not among {names_setting} {list(names)}; "
                f"they would be used by nothing.{nearest(key, names)}",
            )
        if not isinstance(value, Mapping):
            raise SettingError(f"{setting}[{key!r}]", f"must be a mapping of the plugin's settings, got {value!r}.")


def describe_plugin(plugin: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What ``summary.json`` records of one built plugin (an adapter or the plugin itself): ``object`` (its
    ``module:qualname``), the ``package`` that installed its module and its ``version`` (None for a module no
    installed distribution provides: a local file), and ``kwargs``: every keyword the plugin takes, with the value in
    force (the instance's own attribute where it has one, else what was given, else the default)."""
    from importlib import metadata

    from trl_plugins.run.version import distributions_of

    impl = getattr(plugin, "impl", plugin)
    target = impl if inspect.isfunction(impl) or inspect.isclass(impl) else type(impl)
    module = getattr(target, "__module__", None) or ""
    package = version = None
    dists = distributions_of(module.split(".")[0])
    if dists:
        package = dists[0]
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = None
    given = dict(given or {})
    resolved: dict[str, Any] = {}
    for key, param in (plugin_params(target) or {}).items():
        if hasattr(impl, key) and not inspect.isclass(impl) and not inspect.isfunction(impl):
            resolved[key] = getattr(impl, key)
        elif key in given:
            resolved[key] = given[key]
        elif param.default is not inspect.Parameter.empty:
            resolved[key] = param.default
    resolved.update({k: v for k, v in given.items() if k not in resolved})
    return {
        "object": f"{module}:{getattr(target, '__qualname__', type(target).__name__)}",
        "package": package,
        "version": version,
        "kwargs": resolved,
    }


def build_tools(config: Any, given: Mapping[str, Any] | None = None) -> dict[str, ToolPlugin]:
    """The configured tools by the name the model calls them (``tool.name``, which may differ from the configured
    plugin name, e.g. ``"pkg.module:Tool"``); ``given`` supplies instances instead of building them.

    Each tool's schema is checked against its name (:func:`~trl_plugins.tools.base.schema_problem`: the model calls
    a tool by the name its schema shows), without calling the tool.

    Raises:
        ValueError: a configured tool that ``given`` lacks, or two tools sharing a name.
        SettingError: a tool whose schema is not an OpenAI function schema naming it.
    """
    if given is not None:
        missing = set(config.tools) - set(given)
        if missing:
            raise ValueError(f"tools {sorted(missing)} are configured but not provided.")
        plugins = dict(given)
    else:
        check_keyed_kwargs(config.tool_kwargs, config.tools, "tool_kwargs", "tools")
        plugins = {
            name: construct(TOOLS, name, config.tool_kwargs.get(name, {}), f"tool_kwargs[{name!r}]", "tools")
            for name in config.tools
        }
    # A tool set (the mcp plugin) is as many tools as it lists at start-up, each shown to the model.
    built = [tool for name, impl in plugins.items() for tool in tools_of(impl, name)]
    tools = {tool.name: tool for tool in built}
    if len(tools) != len(built):
        raise ValueError(f"two configured tools share a name: {[t.name for t in built]}.")
    for tool in tools.values():
        problem = schema_problem(tool.schema(), tool.name)
        if problem is not None:
            raise SettingError("tools", f"{tool.label}: {problem}.")
    return tools


def build_rewards(config: Any, given: Mapping[str, Any] | None = None) -> list[RewardPlugin]:
    """The configured reward components with their weights, in config order (``given`` supplies instances)."""
    given = dict(given or {})
    check_keyed_kwargs(
        config.reward_component_kwargs, config.reward_components, "reward_component_kwargs", "reward_components"
    )
    return [
        as_reward(
            given[name]
            if name in given
            else construct(
                REWARDS,
                name,
                config.reward_component_kwargs.get(name, {}),
                f"reward_component_kwargs[{name!r}]",
                "reward_components",
            ),
            name,
            weight,
        )
        for name, weight in zip(config.reward_components, config.reward_component_weights)
    ]


def build_rollout(config: Any) -> RolloutPlugin:
    return as_rollout(
        construct(ROLLOUTS, config.rollout, config.rollout_kwargs, "rollout_kwargs", "rollout"), config.rollout
    )


def build_advantage(config: Any) -> AdvantagePlugin:
    return as_advantage(
        construct(ADVANTAGES, config.advantage, config.advantage_kwargs, "advantage_kwargs", "advantage"),
        config.advantage,
    )


def build_policy_loss(config: Any) -> PolicyLossPlugin:
    from trl_plugins.registry import POLICY_LOSSES

    return as_policy_loss(
        construct(POLICY_LOSSES, config.policy_loss, config.policy_loss_kwargs, "policy_loss_kwargs", "policy_loss"),
        config.policy_loss,
    )


def context_limit(config: Any, rollout: RolloutPlugin) -> int | None:
    """Longest datum a trajectory can make: ``max_context_tokens`` when set, else the rollout's
    ``token_budget - 1`` (a datum is the trajectory shifted by one), None when both are unbounded."""
    if config.max_context_tokens is not None:
        return config.max_context_tokens
    return None if rollout.token_budget is None else rollout.token_budget - 1


def check_plugin_settings(
    config: Any,
    rollout: RolloutPlugin,
    advantage: AdvantagePlugin,
    policy_loss: PolicyLossPlugin,
    *,
    correction_applies_always: bool,
) -> None:
    """Refuse what the selected plugins need but the run does not provide, and budgets that cannot fit.

    Args:
        correction_applies_always: The mismatch correction is on and covers every batch
            (:meth:`~trl_plugins.run.settings.Features.correction_on_every_batch`): a policy loss must then apply
            importance weights.

    Raises:
        ValueError: what cannot work, and what to set instead.
    """
    if advantage.needs_groups and config.num_generations < 2:
        raise ValueError(
            f"advantage {config.advantage!r} is group-relative and needs num_generations >= 2, got "
            f"{config.num_generations}."
        )
    if correction_applies_always and not policy_loss.supports_is_weights:
        raise ValueError(
            f"the sampler/trainer mismatch correction is on (vllm_importance_sampling_correction) and applies to every "
            f"batch here, but policy_loss {config.policy_loss!r} does not declare supports_is_weights (it would drop "
            "the "
            f"importance weights); use policy_loss='ppo_clip' or set vllm_importance_sampling_correction=False."
        )
    teacher = config.features.distillation
    if advantage.needs_teacher_logprobs and teacher is None:
        raise ValueError(
            f"advantage {config.advantage!r} distils from a teacher's log-probs, and the run has no teacher: set "
            f"teacher_model_name_or_path (a local model with the student's tokenizer)."
        )
    distilling_loss = policy_loss.teacher_divergence is not None
    if distilling_loss and teacher is None:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} distils from a teacher's next-token distributions, and the run has "
            f"no teacher: set teacher_model_name_or_path (a local model with the student's tokenizer)."
        )
    if distilling_loss and teacher is not None and teacher.privileged_field:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} forwards the teacher on the student's own tokens, without "
            f"teacher_privileged_field={teacher.privileged_field!r}: self-distill with advantage='opd', or drop the "
            f"field."
        )
    if teacher is not None and teacher.privileged_field and rollout.agent_conversation:
        raise ValueError(
            f"teacher_privileged_field={teacher.privileged_field!r} rewrites the first prompt the run renders from a "
            f"row, and {rollout.label} writes its own conversation: drop the field (self-distillation needs the run's "
            f"own prompts)."
        )
    if distilling_loss and teacher is not None and teacher.routes:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} distils from one teacher, and teacher_model_name_or_path names "
            f"{len(teacher.routes)} (routed by {teacher.route_field!r}): give one, or distil with advantage='opd'."
        )
    server_support = {"top_k": policy_loss.teacher_top_k, "tail": policy_loss.teacher_tail}
    server_support = {k: v for k, v in server_support.items() if v is not None}
    if distilling_loss and teacher is not None and not teacher.server and server_support:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} sets {', '.join(f'{k}={v}' for k, v in server_support.items())}, "
            f"which only a server teacher reads (it returns its top-k log-probs); the local teacher "
            f"{teacher.teacher!r} gives the whole vocabulary, over which the divergence is computed: drop them."
        )
    if distilling_loss and config.features.long_trajectories.sequence_parallel:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} (the divergence to the teacher) does not run under sequence "
            f"parallelism yet: set sequence_parallel_size=1, or distil with advantage='opd' (its per-token signal "
            f"runs there)."
        )
    if teacher is not None and not (advantage.needs_teacher_logprobs or distilling_loss):
        raise ValueError(
            f"teacher_model_name_or_path={teacher.teacher!r} is read by nothing: neither advantage "
            f"{config.advantage!r} nor policy_loss {config.policy_loss!r} uses a teacher; set advantage='opd' or "
            f"policy_loss='jsd' (docs/training.md), or drop the teacher."
        )
    if policy_loss.needs_ref_logprobs and not config.beta > 0:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} reads reference log-probs, and the reference model is built only "
            f"when beta > 0; set --beta (the KL coefficient) instead of kl_coef in policy_loss_kwargs."
        )
    unused_tools = bool(config.tools) and not rollout.offers_tools
    if rollout.agent_conversation and (unused_tools or config.system_prompt):
        given = [f"tools={config.tools}"] * unused_tools + [f"system_prompt={config.system_prompt!r:.60}"] * bool(
            config.system_prompt
        )
        offered = (
            " (its tools may be the run's: the agent asks for them, docs/agents.md#the-runs-tools)"
            if rollout.offers_tools
            else ""
        )
        raise ValueError(
            f"rollout {config.rollout!r} runs an agent that writes its own conversation (its system prompt and "
            f"tools){offered}, so {' and '.join(given)} would be used by nothing: set "
            f"{'tools: [] and ' * unused_tools}system_prompt: null, and give the agent its prompt in its own code."
        )
    budget = rollout.token_budget
    if (
        AggregationMode(config.aggregation) == AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM
        and not (config.norm_length or 0) > 0
    ):
        raise ValueError(
            "aggregation='seq_mean_token_sum_norm' (Dr. GRPO) divides by a constant length: set norm_length, "
            "e.g. the most action tokens a trajectory can "
            f"have{f' (the rollout budget is {budget})' if budget else ''}."
        )
    if (
        config.use_vllm
        and config.vllm_max_model_length is not None
        and budget is not None
        and budget > config.vllm_max_model_length
    ):
        raise ValueError(
            f"vllm_max_model_length={config.vllm_max_model_length} is shorter than the rollout's token budget of "
            f"{budget} "
            f"(rollout_kwargs max_trajectory_tokens): vLLM would refuse the longest trajectories' turns. "
            f"Raise vllm_max_model_length or lower max_trajectory_tokens."
        )
    context = context_limit(config, rollout)
    if budget is not None and context is not None and budget - 1 > context:
        raise ValueError(
            f"the rollout's token budget of {budget} makes datums of up to {budget - 1} tokens, over "
            f"max_context_tokens={context}; lower the rollout budget to {context + 1} or raise max_context_tokens."
        )
    # The critic's value pass forwards a bootstrapped datum with one token more: the state after its last token.
    longest = (
        None if context is None else context + int(advantage.needs_values and config.truncated_policy == "bootstrap")
    )
    if longest is not None and longest > config.max_padded_tokens_per_micro_batch:
        extra = (
            f" ({context} tokens plus the state after a truncated one's last token, which the critic's value pass "
            f"forwards under truncated_policy='bootstrap')"
            if longest > context
            else ""
        )
        raise ValueError(
            f"a datum can have {context} tokens but max_padded_tokens_per_micro_batch is "
            f"{config.max_padded_tokens_per_micro_batch}: the longest forward{extra} would fit in no micro-batch. "
            "Raise "
            f"max_padded_tokens_per_micro_batch to at least {longest} or lower the rollout budget."
        )
