"""Building a run's plugins from the registries, and the checks that need them built.

Each plugin is resolved by name (unknown names raise with "did you mean"), its kwargs checked against its
signature, constructed once, and wrapped in its seam's adapter (:mod:`trl_plugins.protocols`), which reads its
declarations. :func:`check_plugin_settings` then refuses what the selected plugins need but the run does not
provide, and budgets that cannot fit: the checks that a config alone cannot make.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

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
    as_tool,
)
from trl_plugins.registry import ADVANTAGES, REWARDS, ROLLOUTS, TOOLS, Registry
from trl_plugins.types import AggregationMode

__all__ = ["plugin_params", "construct", "build_tools", "build_rewards", "build_rollout", "build_advantage",
           "build_policy_loss", "context_limit", "check_plugin_settings"]


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


def construct(registry: Registry[Any], name: str, kwargs: Mapping[str, Any], setting: str) -> Any:
    """The plugin ``name`` of ``registry`` built with ``kwargs`` (``setting`` names them in errors).

    Raises:
        LookupError: an unknown name (the registry's error, with "did you mean").
        ValueError: a key the plugin does not take (the accepted keys are listed), or a value it refuses.
    """
    target = registry.get(name)
    params = plugin_params(target)
    if params is not None:
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ValueError(f"{setting} for {registry.seam} plugin {name!r} has unknown keys {unknown}; it accepts "
                             f"{list(params)}.")
    try:
        return target(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{registry.seam} plugin {name!r} rejected its settings {dict(kwargs)}: {exc}. Fix {setting}.") from exc


def build_tools(config: Any, given: Mapping[str, Any] | None = None) -> dict[str, ToolPlugin]:
    """The configured tools by the name the model calls them (``tool.name``, which may differ from the configured
    plugin name, e.g. ``"pkg.module:Tool"``); ``given`` supplies instances instead of building them.

    Raises:
        ValueError: a configured tool that ``given`` lacks, or two tools sharing a name.
    """
    if given is not None:
        missing = set(config.tools) - set(given)
        if missing:
            raise ValueError(f"tools {sorted(missing)} are configured but not provided.")
        return {name: as_tool(tool, name) for name, tool in given.items()}
    built = [as_tool(construct(TOOLS, name, config.tool_kwargs.get(name, {}), f"tool_kwargs[{name!r}]"), name)
             for name in config.tools]
    tools = {tool.name: tool for tool in built}
    if len(tools) != len(built):
        raise ValueError(f"two configured tools share a name: {[t.name for t in built]}.")
    return tools


def build_rewards(config: Any, given: Mapping[str, Any] | None = None) -> list[RewardPlugin]:
    """The configured reward components with their weights, in config order (``given`` supplies instances)."""
    given = dict(given or {})
    return [as_reward(given[name] if name in given else
                      construct(REWARDS, name, config.reward_component_kwargs.get(name, {}),
                                f"reward_component_kwargs[{name!r}]"), name, weight)
            for name, weight in zip(config.reward_components, config.reward_component_weights)]


def build_rollout(config: Any) -> RolloutPlugin:
    return as_rollout(construct(ROLLOUTS, config.rollout, config.rollout_kwargs, "rollout_kwargs"), config.rollout)


def build_advantage(config: Any) -> AdvantagePlugin:
    return as_advantage(construct(ADVANTAGES, config.advantage, config.advantage_kwargs, "advantage_kwargs"), config.advantage)


def build_policy_loss(config: Any) -> PolicyLossPlugin:
    from trl_plugins.registry import POLICY_LOSSES

    return as_policy_loss(construct(POLICY_LOSSES, config.policy_loss, config.policy_loss_kwargs, "policy_loss_kwargs"),
                          config.policy_loss)


def context_limit(config: Any, rollout: RolloutPlugin) -> int | None:
    """Longest datum a trajectory can make: ``max_context_tokens`` when set, else the rollout's
    ``token_budget - 1`` (a datum is the trajectory shifted by one), None when both are unbounded."""
    if config.max_context_tokens is not None:
        return config.max_context_tokens
    return None if rollout.token_budget is None else rollout.token_budget - 1


def check_plugin_settings(config: Any, rollout: RolloutPlugin, advantage: AdvantagePlugin, policy_loss: PolicyLossPlugin,
                          *, correction_applies_always: bool) -> None:
    """Refuse what the selected plugins need but the run does not provide, and budgets that cannot fit.

    Args:
        correction_applies_always: The sampler's log-probs are never the trainer's own (vLLM) or the mismatch
            correction covers every batch (``mismatch_correction_scope='all'``): a policy loss must then apply
            importance weights.

    Raises:
        ValueError: what cannot work, and what to set instead.
    """
    critic_defaults = {"critic_learning_rate": None, "critic_warmup_steps": 0, "critic_optim": "adamw"}
    if not advantage.needs_values:
        changed = [n for n, d in critic_defaults.items() if getattr(config, n) != d]
        if changed:
            raise ValueError(
                f"{changed} configure the critic, but advantage {config.advantage!r} runs none (only an estimator that "
                f"needs_values, such as 'gae', brings one); drop them or choose --advantage gae."
            )
    if advantage.needs_groups and config.num_generations < 2:
        raise ValueError(f"advantage {config.advantage!r} is group-relative and needs num_generations >= 2, got "
                         f"{config.num_generations}.")
    if config.vllm_importance_sampling_correction and correction_applies_always and not policy_loss.supports_is_weights:
        raise ValueError(
            f"the sampler/trainer mismatch correction is on (vllm_importance_sampling_correction) and applies to every "
            f"batch here, but policy_loss {config.policy_loss!r} does not declare supports_is_weights (it would drop the "
            f"importance weights); use policy_loss='ppo_clip' or set vllm_importance_sampling_correction=False."
        )
    if policy_loss.needs_ref_logprobs and not config.beta > 0:
        raise ValueError(
            f"policy_loss {config.policy_loss!r} reads reference log-probs, and the reference model is built only "
            f"when beta > 0; set --beta (the KL coefficient) instead of kl_coef in policy_loss_kwargs."
        )
    budget = rollout.token_budget
    if AggregationMode(config.aggregation) == AggregationMode.SEQ_MEAN_TOKEN_SUM_NORM and not (config.norm_length or 0) > 0:
        raise ValueError(
            "aggregation='seq_mean_token_sum_norm' (Dr. GRPO) divides by a constant length: set norm_length, "
            f"e.g. the most action tokens a trajectory can have{f' (the rollout budget is {budget})' if budget else ''}."
        )
    if config.use_vllm and config.vllm_max_model_length is not None and budget is not None and budget > config.vllm_max_model_length:
        raise ValueError(
            f"vllm_max_model_length={config.vllm_max_model_length} is shorter than the rollout's token budget of {budget} "
            f"(rollout_kwargs max_trajectory_tokens): vLLM would refuse the longest trajectories' turns. "
            f"Raise vllm_max_model_length or lower max_trajectory_tokens."
        )
    context = context_limit(config, rollout)
    if budget is not None and context is not None and budget - 1 > context:
        raise ValueError(
            f"the rollout's token budget of {budget} makes datums of up to {budget - 1} tokens, over "
            f"max_context_tokens={context}; lower the rollout budget to {context + 1} or raise max_context_tokens."
        )
    if context is not None and context > config.max_padded_tokens_per_micro_batch:
        raise ValueError(
            f"a datum can have {context} tokens but max_padded_tokens_per_micro_batch is "
            f"{config.max_padded_tokens_per_micro_batch}: the longest datum would fit in no micro-batch. Raise "
            f"max_padded_tokens_per_micro_batch to at least {context} or lower the rollout budget."
        )
