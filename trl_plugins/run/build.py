"""A run, resolved once: its validated settings (:class:`RunSpec`) and the objects built from them (:class:`Run`).

:func:`resolve_run` takes a config that has passed its own field checks (``MultiTurnGRPOConfig.__post_init__``:
each field honoured, mapped or refused), builds every plugin once, checks what needs them built (capabilities,
budgets, the sampler's needs, the LoRA adapter) and picks the sampler: before any model loads. The trainer, the
evaluation and the recipes all receive the :class:`Run`; nothing else builds a plugin or checks a setting. A
child process (an evaluation) or a process that gets the settings pickled rebuilds with :func:`build_run` from the
same :class:`RunSpec`, which re-checks nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from trl_plugins.protocols import AdvantagePlugin, PolicyLossPlugin, RewardPlugin, RolloutPlugin, ToolPlugin
from trl_plugins.rollout.chat import ChatFormat, tokenizer_digest
from trl_plugins.run.plugins import (
    SettingError,
    build_advantage,
    build_policy_loss,
    build_rewards,
    build_rollout,
    build_tools,
    check_plugin_settings,
    context_limit,
)
from trl_plugins.run.sampler import SamplerKind, check_sampler_available, sampler_kind
from trl_plugins.run.settings import Critic
from trl_plugins.types import RunVersion

__all__ = ["RunSpec", "Run", "RolloutParts", "resolve_run", "build_run", "KL_PENALTY_COMPONENT"]

logger = logging.getLogger(__name__)

KL_PENALTY_COMPONENT = "kl_penalty"
"""Name of the reward component that carries ``-sum_t KL_t`` when the reference KL is in the reward."""


@dataclass(frozen=True)
class RunSpec:
    """A run's settings, validated: what every process of the run builds from (picklable)."""

    config: Any
    """The ``MultiTurnGRPOConfig``, its fields checked and TRL's names mapped onto the plugins' settings."""
    provenance: Mapping[str, str] = field(default_factory=dict)
    """Where a setting's value came from (a config file, ``"the command line"``), by
    field name, as the caller that layered them recorded it (a recipe); fields not listed kept their defaults."""
    peft_config: Any = None
    """The LoRA adapter the policy trains (``peft.LoraConfig``), or None for full fine-tuning."""

    def origin(self, name: str) -> str:
        """Where ``name``'s value came from (``"default"`` when no layer set it)."""
        return self.provenance.get(name, "default")

    def explain(self, error: SettingError) -> SettingError:
        """``error`` with where its setting's value came from, when the caller recorded it (``tool_kwargs['x']`` is
        ``tool_kwargs``'s)."""
        base = error.setting.split("[", 1)[0]
        if base not in self.provenance:
            return error
        return SettingError(f"{error.setting} (from {self.provenance[base]})", error.what)


@dataclass(frozen=True)
class RolloutParts:
    """The part of a :class:`Run` that rolls out a batch (:func:`trl_plugins.pipeline.batch.rollout_rows`): what a
    generation replica process is handed, pickled, and what the vLLM server's rollout threads use. The advantage, the
    policy loss and the rewards, which the trainer runs, stay behind, but for the components that score as
    trajectories end (``prescorers``: a judge filling the cache the trainer's scoring reads)."""

    rollout: RolloutPlugin
    tools: dict[str, ToolPlugin]
    chat: ChatFormat
    config: Any
    """The run's ``MultiTurnGRPOConfig``."""
    version: RunVersion | None
    """The run-level policy version every trajectory refers to (None before :meth:`Run.bind_version`)."""
    prescorers: tuple[RewardPlugin, ...] = ()
    """The reward components that score as trajectories end, during the rollout (a judge with a cache:
    ``scores_during_rollout``); the others stay behind with the trainer."""

    def step_metrics(self) -> dict[str, float]:
        """The ``step_metrics()`` of what ran the rollout in this process (its tools and its prescorers), taken once
        the rollout is done: what a replica or the server path reports with its result."""
        metrics: dict[str, float] = {}
        for plugin in (*self.tools.values(), *self.prescorers):
            metrics.update(plugin.step_metrics())
        return metrics


class Run:
    """The objects one run needs, built once per process from its :class:`RunSpec`.

    Attributes:
        spec: The settings.
        rollout, advantage, policy_loss: The plugins, with their declarations read.
        tools: By the name the model calls them.
        rewards: The reward components with their weights, in config order.
        sampler: What generates the turns.
        critic: The critic's settings when the advantage estimator ``needs_values`` (None: no critic).
        max_context_tokens: The longest datum a trajectory can make (None: unbounded).
        chat: The chat format, once :meth:`bind_tokenizer` has built it.
        version: The run-level policy version, once :meth:`bind_version` has recorded it.
    """

    def __init__(
        self,
        spec: RunSpec,
        *,
        rollout: RolloutPlugin,
        tools: dict[str, ToolPlugin],
        rewards: list[RewardPlugin],
        advantage: AdvantagePlugin,
        policy_loss: PolicyLossPlugin,
        sampler: SamplerKind,
    ) -> None:
        self.spec = spec
        self.rollout, self.tools, self.rewards = rollout, tools, rewards
        self.advantage, self.policy_loss = advantage, policy_loss
        self.sampler = sampler
        self.critic = Critic.from_config(spec.config, needs_values=advantage.needs_values)
        self.max_context_tokens = context_limit(spec.config, rollout)
        self.chat: ChatFormat | None = None
        self.version: RunVersion | None = None
        self._tool_start_up: dict[str, str] | None = None

    @property
    def config(self) -> Any:
        """The run's ``MultiTurnGRPOConfig``."""
        return self.spec.config

    def bind_tokenizer(self, tokenizer: Any) -> ChatFormat:
        """The run's chat format for ``tokenizer`` (its tools' schemas, ``final_answer_pattern``, ``stop_tokens``,
        ``chat_template_kwargs``, and the rollout's ``tool_calls_per_turn``), built once and checked against the
        template (parallel calls too, when the rollout runs more than one call of a turn).

        Raises:
            ChatTemplateError: the chat template cannot be followed token for token (says why and what to use).
            ValueError: the run is already bound to another tokenizer or chat template.
        """
        if self.chat is not None:
            if self.chat.tokenizer is tokenizer or self.chat.digest == tokenizer_digest(tokenizer):
                return self.chat
            raise ValueError(
                "this run's chat format was built for another tokenizer or chat template; build a run per tokenizer."
            )
        c = self.config
        self.chat = ChatFormat(
            tokenizer,
            [t.schema() for t in self.tools.values()],
            final_answer_pattern=c.final_answer_pattern,
            stop_tokens=c.stop_tokens,
            calls_per_turn=self.rollout.tool_calls_per_turn,
            **(c.chat_template_kwargs or {}),
        )
        return self.chat

    def bind_version(self, model: Any, others: Mapping[str, str | None] | None = None) -> RunVersion:
        """Record the run-level policy version of ``model`` (its dtype, quantization and adapters), the chat format,
        the sampler, the tool schemas and the version of every reward component, tool and the rollout, plus
        ``others`` (a distillation teacher's) (:func:`~trl_plugins.run.version.run_version`); once, after
        :meth:`bind_tokenizer`. Every trajectory the run rolls out refers to it by digest
        (``PolicyVersion.run_digest``)."""
        if self.chat is None:
            raise ValueError("bind_tokenizer() first: the version records the chat format's digest.")
        if self.version is None:
            from trl_plugins.run.version import run_version

            self.version = run_version(
                tokenizer_digest=self.chat.digest,
                tool_schemas=self.chat.tools,
                model=model,
                sampler=self.sampler,
                rewards=self.rewards,
                tools=self.tools,
                rollout=self.rollout,
                others=others,
            )
        return self.version

    def rollout_parts(self) -> RolloutParts:
        """What rolls out a batch (:class:`RolloutParts`); after :meth:`bind_tokenizer`."""
        if self.chat is None:
            raise ValueError("bind_tokenizer() first: a rollout needs the chat format.")
        return RolloutParts(self.rollout, self.tools, self.chat, self.config, self.version, self.prescorers)

    @property
    def prescorers(self) -> tuple[RewardPlugin, ...]:
        """The reward components that score during the rollout (:attr:`RolloutParts.prescorers`)."""
        return tuple(r for r in self.rewards if r.scores_during_rollout is not None)

    def start_tools(self) -> dict[str, str]:
        """Start every tool that declares ``start_up()`` (the code interpreter probes its sandbox's isolation) and
        return what each reported; the first call starts them, later calls return the same lines. Logged."""
        if self._tool_start_up is None:
            said = {}
            for name, tool in self.tools.items():
                line = tool.start_up()
                if line is not None:
                    said[name] = line
                    logger.info("tool %r: %s", name, line)
            self._tool_start_up = said
        return dict(self._tool_start_up)

    def reward_names(self) -> list[str]:
        """The reward components the run logs as ``reward/<name>``: the configured ones, plus ``kl_penalty`` when
        the reference KL is a reward (``beta > 0``, ``kl_penalty="reward"``)."""
        names = [r.name for r in self.rewards]
        if self.config.beta > 0 and self.config.kl_penalty == "reward":
            names.append(KL_PENALTY_COMPONENT)
        return names

    def reward(self, name: str) -> RewardPlugin:
        """The reward component ``name``.

        Raises:
            KeyError: no such component in the run.
        """
        for r in self.rewards:
            if r.name == name:
                return r
        raise KeyError(f"the run has no reward component {name!r}; it has {[r.name for r in self.rewards]}.")

    def close(self) -> None:
        """Close every plugin that holds resources (sandboxes, connections, servers): each tool, the rollout, each
        reward component, the advantage estimator and the policy loss that has a ``close()`` (plain or async). Every
        one is closed even when another fails; the failures are logged and the first is raised after."""
        errors = []
        seen: set[int] = set()
        for plugin in [*self.tools.values(), self.rollout, *self.rewards, self.advantage, self.policy_loss]:
            if id(plugin.impl) in seen:
                continue
            seen.add(id(plugin.impl))
            try:
                plugin.close()
            except Exception as exc:  # noqa: BLE001 - close the rest, then report
                logger.exception("closing %s failed", plugin.label)
                errors.append(exc)
        if errors:
            raise errors[0]


def _build(spec: RunSpec, tools: Mapping[str, Any] | None, reward_components: Mapping[str, Any] | None) -> Run:
    config = spec.config
    built_tools = build_tools(config, tools)
    rewards = build_rewards(config, reward_components)
    return Run(
        spec,
        rollout=build_rollout(config),
        tools=built_tools,
        rewards=rewards,
        advantage=build_advantage(config),
        policy_loss=build_policy_loss(config),
        sampler=sampler_kind(config),
    )


def resolve_run(
    config: Any,
    *,
    provenance: Mapping[str, str] | None = None,
    peft_config: Any = None,
    tools: Mapping[str, Any] | None = None,
    reward_components: Mapping[str, Any] | None = None,
) -> Run:
    """Build the run ``config`` describes and check what needs its plugins built; before any model loads.

    Args:
        config: A ``MultiTurnGRPOConfig`` (its own fields were checked when it was built).
        provenance: Where each setting came from (a recipe that layers config files records it).
        peft_config: The LoRA adapter to train, if any (checked here, once).
        tools: Tool instances by name, instead of building ``config.tools`` (each configured name must be given).
        reward_components: Component instances by name, used instead of building those names.

    Raises:
        LookupError: an unknown plugin name (with "did you mean").
        ValueError: a kwarg a plugin does not take or refuses, a capability the run cannot serve, a budget that
            cannot fit, vLLM asked for but missing, or an adapter that cannot train here (each says what to set).
    """
    from trl_plugins.run.lora import check_peft_config
    from trl_plugins.run.parallelism import check_sequence_parallel

    spec = RunSpec(config, dict(provenance or {}), peft_config)
    kind = sampler_kind(config)
    check_sampler_available(kind, config)
    try:
        run = _build(spec, tools, reward_components)
    except SettingError as exc:
        raise spec.explain(exc) from exc.__cause__
    try:
        # vLLM's log-probs are never the trainer's own; scope 'all' corrects HF-generated batches too.
        always = config.features.correction_on_every_batch(foreign_sampler=kind.is_vllm)
        check_plugin_settings(config, run.rollout, run.advantage, run.policy_loss, correction_applies_always=always)
        check_peft_config(peft_config, config, needs_values=run.advantage.needs_values)
        check_sequence_parallel(config, policy_loss=run.policy_loss)  # a loss that spans shards
    except BaseException:
        run.close()
        raise
    return run


def build_run(
    spec: RunSpec, *, tools: Mapping[str, Any] | None = None, reward_components: Mapping[str, Any] | None = None
) -> Run:
    """The run of an already resolved ``spec`` (a child process, a process that received it pickled): its plugins
    built, nothing checked again."""
    return _build(spec, tools, reward_components)
