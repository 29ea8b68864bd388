"""The plugins of a run, resolved once from the config: used by the trainer AND the evaluation.

:func:`check_plugin_config` runs inside ``MultiTurnGRPOConfig.__post_init__``, so a bad plugin name,
a kwarg the plugin does not take or a capability this trainer cannot serve fails when the config is
built, before any model loads. :func:`build_plugins` constructs the plugins for a run. The trainer
never compares plugin names: it asks the capabilities each seam's protocol declares
(``needs_values``, ``needs_groups``, ``needs_ref_logprobs``, ``needs_entropy``, ``token_budget``).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from trl_plugins.registry import ADVANTAGES, PACKERS, POLICY_LOSSES, REWARDS, ROLLOUTS, TOOLS, Registry
from trl_plugins.types import AggregationMode

__all__ = ["RunPlugins", "build_plugins", "log_tool_start_up", "plugin_params", "check_plugin_config", "check_named_plugins", "check_capabilities", "context_limit"]

logger = logging.getLogger(__name__)


@dataclass
class RunPlugins:
    """The constructed plugins of one run."""

    rollout: Any
    """The rollout plugin."""
    tools: dict[str, Any]
    """Tools by the name the model calls them (``tool.name``)."""
    reward_components: list[tuple[str, float, Any]]
    """``(name, weight, component)`` in config order."""
    advantage: Any
    """The advantage estimator."""
    policy_loss: Any
    """The policy loss."""
    max_context_tokens: int | None = field(default=None)
    """Longest datum (model input tokens) a trajectory can make; None when unbounded."""

    def close(self) -> None:
        """Close every plugin that holds resources (sandboxes, connections, servers): each tool, the
        rollout, each reward component, the advantage estimator and the policy loss that has a
        ``close()`` (a coroutine function is run to completion). Every one is closed even when another
        fails; the failures are logged and the first is raised after the others were closed."""
        from trl_plugins.tools.base import close_plugin

        errors = []
        plugins = [*self.tools.values(), self.rollout, *(c for _, _, c in self.reward_components), self.advantage,
                   self.policy_loss]
        seen: set[int] = set()
        for obj in plugins:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            try:
                close_plugin(obj)
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                logger.exception("closing plugin %r failed", obj)
                errors.append(exc)
        if errors:
            raise errors[0]


def _construct(registry: Registry[Any], name: str, kwargs: Mapping[str, Any], what: str) -> Any:
    target = registry.get(name)
    try:
        return target(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{what} {name!r} rejected its settings {dict(kwargs)}: {exc}. Fix {what}_kwargs.") from exc


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


def _check_kwargs(registry: Registry[Any], name: str, kwargs: Mapping[str, Any], setting: str) -> None:
    """Resolve ``name`` (unknown names raise with "did you mean") and check ``kwargs`` against its signature."""
    params = plugin_params(registry.get(name))
    if params is None:
        return
    accepted = list(params)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"{setting} for {registry.seam} plugin {name!r} has unknown keys {unknown}; it accepts {accepted}."
        )


def context_limit(args: Any, rollout: Any) -> int | None:
    """Longest datum a trajectory can make: ``max_context_tokens`` when set, else the rollout's
    ``token_budget - 1`` (a datum is the trajectory shifted by one), None when both are unbounded."""
    if args.max_context_tokens is not None:
        return args.max_context_tokens
    budget = rollout.token_budget
    return None if budget is None else budget - 1


def check_plugin_config(args: Any) -> None:
    """The start-up checks of the plugins a config selects; raises ``ValueError`` saying what to set.

    The rollout, the advantage estimator and the policy loss hold only settings: they are resolved,
    constructed and asked their capabilities (:func:`check_capabilities`). Tools and reward components
    can be handed to the trainer as instances instead, so their names are checked by
    :func:`check_named_plugins`, which :func:`build_plugins` runs first (a recipe can build every plugin
    once, and close it, before any model loads).
    """
    PACKERS.get(args.packer)
    rollout = _construct(ROLLOUTS, args.rollout, args.rollout_kwargs, "rollout")
    advantage = _construct(ADVANTAGES, args.advantage, args.advantage_kwargs, "advantage")
    policy_loss = _construct(POLICY_LOSSES, args.policy_loss, args.policy_loss_kwargs, "policy_loss")
    check_capabilities(args, rollout, advantage, policy_loss)


def check_named_plugins(args: Any, *, provided_tools: Any = (), provided_rewards: Any = ()) -> None:
    """Resolve every tool and reward component ``args`` names (unknown names raise with "did you mean")
    and check their kwargs against their signatures, without constructing them (a tool may start a
    sandbox, a reward may load a model). Names in ``provided_*`` are instances the caller supplies."""
    for name in args.tools:
        if name not in provided_tools:
            _check_kwargs(TOOLS, name, args.tool_kwargs.get(name, {}), f"tool_kwargs[{name!r}]")
    for name in args.reward_components:
        if name not in provided_rewards:
            _check_kwargs(REWARDS, name, args.reward_component_kwargs.get(name, {}), f"reward_component_kwargs[{name!r}]")


def check_capabilities(args: Any, rollout: Any, advantage: Any, policy_loss: Any) -> None:
    """Refuse what the selected plugins need but this trainer does not provide, and budgets that cannot fit."""
    for obj, flags, what in (
        (advantage, ("needs_values", "needs_groups"), f"advantage {args.advantage!r}"),
        (policy_loss, ("needs_ref_logprobs", "needs_entropy"), f"policy_loss {args.policy_loss!r}"),
    ):
        missing = [f for f in flags if not isinstance(getattr(obj, f, None), bool)]
        if missing:
            raise ValueError(f"{what} does not declare {missing} (bools); see docs/plugins.md for the seam's protocol.")
    if not hasattr(rollout, "token_budget"):
        raise ValueError(
            f"rollout {args.rollout!r} does not declare token_budget (max tokens of one trajectory, or None); "
            f"see docs/plugins.md."
        )
    critic_defaults = {"critic_learning_rate": None, "critic_warmup_steps": 0, "critic_optim": "adamw"}
    if not advantage.needs_values:
        changed = [n for n, d in critic_defaults.items() if getattr(args, n, d) != d]
        if changed:
            raise ValueError(
                f"{changed} configure the critic, but advantage {args.advantage!r} runs none (only an estimator that "
                f"needs_values, such as 'gae', brings one); drop them or choose --advantage gae."
            )
    if advantage.needs_groups and args.num_generations < 2:
        raise ValueError(f"advantage {args.advantage!r} is group-relative and needs num_generations >= 2, got {args.num_generations}.")
    correction_certain = getattr(args, "mismatch_correction_scope", "foreign") == "all" or getattr(args, "use_vllm", False)
    if getattr(args, "vllm_importance_sampling_correction", False) and correction_certain and not getattr(policy_loss, "supports_is_weights", False):
        raise ValueError(
            f"the sampler/trainer mismatch correction is on (vllm_importance_sampling_correction) and applies to every "
            f"batch here, but policy_loss {args.policy_loss!r} does not declare supports_is_weights (it would drop the "
            f"importance weights); use policy_loss='ppo_clip' or set vllm_importance_sampling_correction=False."
        )
    if policy_loss.needs_ref_logprobs and not args.beta > 0:
        raise ValueError(
            f"policy_loss {args.policy_loss!r} reads reference log-probs, and the reference model is built only "
            f"when beta > 0; set --beta (the KL coefficient) instead of kl_coef in policy_loss_kwargs."
        )
    if AggregationMode(args.aggregation) == AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM and not (args.norm_length or 0) > 0:
        budget = rollout.token_budget
        raise ValueError(
            "aggregation='seq_mean_token_sum_norm' (Dr. GRPO) divides by a constant length: set norm_length, "
            f"e.g. the most action tokens a trajectory can have{f' (the rollout budget is {budget})' if budget else ''}."
        )
    budget = rollout.token_budget
    vllm_length = getattr(args, "vllm_max_model_length", None)
    if getattr(args, "use_vllm", False) and vllm_length is not None and budget is not None and budget > vllm_length:
        raise ValueError(
            f"vllm_max_model_length={vllm_length} is shorter than the rollout's token budget of {budget} "
            f"(rollout_kwargs max_trajectory_tokens): vLLM would refuse the longest trajectories' turns. "
            f"Raise vllm_max_model_length or lower max_trajectory_tokens."
        )
    context = context_limit(args, rollout)
    if budget is not None and context is not None and budget - 1 > context:
        raise ValueError(
            f"the rollout's token budget of {budget} makes datums of up to {budget - 1} tokens, over "
            f"max_context_tokens={context}; lower the rollout budget to {context + 1} or raise max_context_tokens."
        )
    if context is not None and context > args.max_padded_tokens_per_micro_batch:
        raise ValueError(
            f"a datum can have {context} tokens but max_padded_tokens_per_micro_batch is "
            f"{args.max_padded_tokens_per_micro_batch}: the longest datum would fit in no micro-batch. Raise "
            f"max_padded_tokens_per_micro_batch to at least {context} or lower the rollout budget."
        )


def build_plugins(
    args: Any,
    *,
    tools: Mapping[str, Any] | None = None,
    reward_components: Mapping[str, Any] | None = None,
) -> RunPlugins:
    """Construct the plugins ``args`` selects (a ``MultiTurnGRPOConfig``, already checked).

    Args:
        tools: Tool instances by name, instead of building ``args.tools`` (each configured name must be given).
        reward_components: Component instances by name, used instead of building those names.

    Raises:
        ValueError: a configured tool that ``tools`` lacks, or two tools sharing a name.
    """
    check_named_plugins(args, provided_tools=tools or {}, provided_rewards=reward_components or {})
    if tools is not None:
        built_tools = dict(tools)
        missing = set(args.tools) - set(built_tools)
        if missing:
            raise ValueError(f"tools {sorted(missing)} are configured but not provided.")
    else:
        # Keyed by the name the model calls (the tool's own ``name``), which may differ from the
        # configured plugin name (e.g. "pkg.module:Tool").
        built = [_construct(TOOLS, name, args.tool_kwargs.get(name, {}), "tool") for name in args.tools]
        built_tools = {getattr(tool, "name", name): tool for name, tool in zip(args.tools, built)}
        if len(built_tools) != len(built):
            raise ValueError(f"two configured tools share a name: {[getattr(t, 'name', None) for t in built]}.")
    provided = dict(reward_components or {})
    components = [
        (name, float(weight),
         provided.get(name) or _construct(REWARDS, name, args.reward_component_kwargs.get(name, {}), "reward_component"))
        for name, weight in zip(args.reward_components, args.reward_component_weights)
    ]
    rollout = _construct(ROLLOUTS, args.rollout, args.rollout_kwargs, "rollout")
    advantage = _construct(ADVANTAGES, args.advantage, args.advantage_kwargs, "advantage")
    policy_loss = _construct(POLICY_LOSSES, args.policy_loss, args.policy_loss_kwargs, "policy_loss")
    check_capabilities(args, rollout, advantage, policy_loss)
    return RunPlugins(rollout, built_tools, components, advantage, policy_loss, context_limit(args, rollout))


def log_tool_start_up(tools: Mapping[str, Any]) -> None:
    """Start each tool that declares ``start_up()`` now and log what it reports (for the code
    interpreter: the sandbox isolation in force), so that a run says how it runs model code before
    training and fails at start-up, not at the first tool call, when it cannot run it safely."""
    for name, tool in tools.items():
        start_up = getattr(tool, "start_up", None)
        if callable(start_up):
            logger.info("tool %r: %s", name, start_up())
