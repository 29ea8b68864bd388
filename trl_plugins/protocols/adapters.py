"""The adapters the run builds: one per seam, reading a plugin's declarations once (checked, defaulted, naming the
plugin that got one wrong), so every later decision asks the adapter (:mod:`trl_plugins.protocols`)."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from trl_plugins.aio import run_async
from trl_plugins.protocols.seams import PluginDeclarationError, Reduction

if TYPE_CHECKING:  # annotations only: the seams' own modules import this one
    from trl_plugins.types import AdvantageInput, AdvantageOutput, PolicyLossInput, PolicyLossOutput, Trajectory

__all__ = [
    "AdvantagePlugin",
    "PolicyLossPlugin",
    "RolloutPlugin",
    "ToolPlugin",
    "RewardPlugin",
    "as_advantage",
    "as_policy_loss",
    "as_rollout",
    "as_tool",
    "is_tool_set",
    "tools_of",
    "as_reward",
    "close_plugin",
]


def _label(seam: str, name: str | None, impl: Any) -> str:
    return f"{seam} {name!r}" if name else f"{seam} {type(impl).__name__}"


def _required_bool(impl: Any, member: str, label: str) -> bool:
    if not hasattr(impl, member):
        raise PluginDeclarationError(
            label, f"does not declare {member} (a bool); see docs/plugins.md for the seam's protocol."
        )
    value = getattr(impl, member)
    if not isinstance(value, bool):
        raise PluginDeclarationError(label, f"declares {member}={value!r}; it must be a bool (docs/plugins.md).")
    return value


def _optional(impl: Any, member: str, default: Any) -> Any:
    return getattr(impl, member) if hasattr(impl, member) else default


def _optional_bool(impl: Any, member: str, default: bool, label: str) -> bool:
    value = _optional(impl, member, default)
    if not isinstance(value, bool):
        raise PluginDeclarationError(label, f"declares {member}={value!r}; it must be a bool (docs/plugins.md).")
    return value


def _optional_beta(impl: Any, member: str, label: str) -> float | None:
    value = _optional(impl, member, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise PluginDeclarationError(
            label, f"declares {member}={value!r}; it must be None or a beta in [0, 1] (docs/plugins.md)."
        )
    return float(value)


def _optional_top_k(impl: Any, member: str, label: str) -> int | None:
    value = _optional(impl, member, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PluginDeclarationError(label, f"declares {member}={value!r}; it must be None or an int >= 1.")
    return value


def _optional_tail(impl: Any, member: str, label: str) -> bool | None:
    value = _optional(impl, member, None)
    if value is not None and not isinstance(value, bool):
        raise PluginDeclarationError(label, f"declares {member}={value!r}; it must be None or a bool.")
    return value


def _optional_method(impl: Any, member: str, label: str) -> Callable[..., Any] | None:
    method = _optional(impl, member, None)
    if method is not None and not callable(method):
        raise PluginDeclarationError(label, f"declares {member} = {method!r}, which is not callable.")
    return method


def close_plugin(plugin: Any) -> None:
    """Call ``plugin.close()`` when it has one; a coroutine it returns is run to completion."""
    close = _optional_method(plugin, "close", _label("plugin", None, plugin))
    if close is None:
        return
    result = close()
    if inspect.isawaitable(result):

        async def wait() -> None:
            await result

        run_async(wait())


@dataclass(frozen=True, eq=False)
class _Adapter:
    name: str
    """The name the run knows the plugin by (its registry name or ``pkg.mod:attr``)."""
    impl: Any
    """The plugin itself."""
    step_metrics_fn: Callable[[], Mapping[str, float]] | None = None
    reductions: Mapping[str, Reduction] = field(default_factory=dict)
    """How each of the plugin's step metrics combines over ranks (``step_metric_reductions()``; others: mean)."""

    metric_prefix = ""
    """Put before the names of the plugin's step metrics in the logs."""

    @property
    def label(self) -> str:
        """How messages name the plugin: its seam and name."""
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        """The plugin's metrics of the step now ending, prefixed (empty: it declares none).

        Raises:
            PluginDeclarationError: it returned something else than ``{name: number}``.
        """
        if self.step_metrics_fn is None:
            return {}
        metrics = self.step_metrics_fn()
        if not isinstance(metrics, Mapping):
            raise PluginDeclarationError(
                self.label, f"step_metrics() returned a {type(metrics).__name__}; it must return {{name: number}}."
            )
        bad = {
            k: v
            for k, v in metrics.items()
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
        }
        if bad:
            raise PluginDeclarationError(
                self.label, f"step_metrics() returned {bad}; each must be a str name and a number."
            )
        return {self.metric_prefix + k: float(v) for k, v in metrics.items()}

    def metric_reductions(self) -> dict[str, str]:
        """How the (prefixed) step metrics combine over ranks, as declared."""
        return {self.metric_prefix + k: str(v) for k, v in self.reductions.items()}

    @property
    def closes(self) -> bool:
        """Whether the plugin declares ``close()`` (it holds resources to release)."""
        return _optional_method(self.impl, "close", self.label) is not None

    def close(self) -> None:
        """The plugin's own ``close()`` (plain or async) when it has one."""
        close_plugin(self.impl)


@dataclass(frozen=True, eq=False)
class AdvantagePlugin(_Adapter):
    """An advantage estimator and its declarations."""

    needs_values: bool = False
    needs_groups: bool = False
    needs_turn_ids: bool = False
    """Reads ``AdvantageInput.turn_ids`` (turn-level credit); optional, default False."""
    needs_teacher_logprobs: bool = False
    """Reads ``AdvantageInput.teacher_logprobs`` and ``behaviour_logprobs`` (on-policy distillation: the run must have
    a teacher); optional, default False."""

    metric_prefix = "advantage/"

    @property
    def label(self) -> str:
        return _label("advantage", self.name, self.impl)

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        return self.impl(inp)


@dataclass(frozen=True, eq=False)
class PolicyLossPlugin(_Adapter):
    """A policy loss and its declarations."""

    needs_ref_logprobs: bool = False
    needs_entropy: bool = False
    supports_is_weights: bool = False
    """Applies ``PolicyLossInput.is_weights`` (the sampler/trainer mismatch correction); optional, default False."""
    needs_turn_ids: bool = False
    """Reads ``PolicyLossInput.turn_ids`` (a turn- or sequence-level ratio); optional, default False."""
    token_local: bool = False
    """Each token's loss reads that token's inputs alone, so a datum's tokens may be split over ranks (sequence
    parallelism, which refuses a loss without it); optional, default False."""
    teacher_divergence: float | None = None
    """The ``beta`` of the generalised JSD to the teacher the loss reads as ``PolicyLossInput.teacher_divergence``
    (on-policy distillation: over the whole vocabulary with a local teacher, over a server teacher's top-k
    otherwise); optional, default None (not read)."""
    teacher_top_k: int | None = None
    """With a server teacher, how many of its most likely tokens the divergence is computed on (None: 1, as TRL's
    ``loss_top_k``); a local teacher, which gives the whole vocabulary, refuses it; optional, default None."""
    teacher_tail: bool | None = None
    """With a server teacher, whether the mass outside the top-k is one more bucket (None: True, as TRL's
    ``loss_add_tail``) or both distributions are renormalised over it (False); a local teacher refuses it; optional,
    default None."""

    metric_prefix = "policy_loss/"

    @property
    def label(self) -> str:
        return _label("policy_loss", self.name, self.impl)

    @property
    def per_token_terms(self) -> bool:
        """A term besides ``-A * ratio`` (a reference KL, an entropy bonus, a divergence to the teacher): a
        zero-advantage datum still counts."""
        return self.needs_ref_logprobs or self.needs_entropy or self.teacher_divergence is not None

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput:
        return self.impl(inp)


@dataclass(frozen=True, eq=False)
class RolloutPlugin(_Adapter):
    """A rollout plugin, its token budget and how many calls of one turn it runs."""

    token_budget: int | None = None
    tool_calls_per_turn: int = 1
    """The most tool calls of one turn it runs (parallel calls); optional, default 1."""
    agent_conversation: bool = False
    """The conversation is written by an agent (its own system prompt, messages and tools), not from the run's
    ``tools`` and ``system_prompt``, which the run then refuses; optional, default False."""
    offers_tools: bool = False
    """With ``agent_conversation``: the run's ``tools`` are offered to the agent (which may send them as a request's
    tools), so the run takes them and refuses only ``system_prompt``; optional, default False."""
    rederive_stop_fn: Callable[[Any, Any], Any] | None = None
    """``rederive_stop(trajectory, chat) -> (turn, StopReason | None)``: where and why its rules end a saved
    trajectory (what ``python -m trl_plugins.replay --rewards`` compares with the saved stop reason); optional,
    None: the replay says it cannot re-derive this rollout's stop reasons."""
    rows_fn: Callable[[], Any] | None = None
    """``rows() -> list[dict]``: the rollout's own dataset (a verifiers environment's tasks), the rows the recipe trains
    and evaluates on instead of its task's; optional, None: the recipe's task gives the rows."""

    @property
    def label(self) -> str:
        return _label("rollout", self.name, self.impl)

    def __call__(self, request: Any) -> Any:
        return self.impl(request)


@dataclass(frozen=True, eq=False)
class ToolPlugin(_Adapter):
    """A tool and its optional members, read once."""

    idempotent: bool = False
    """Running a call twice is harmless: a call that failed for infrastructure reasons is retried."""
    start_up_fn: Callable[[], Any] | None = None
    configured: str | None = None
    """The configured tool plugin it came from (``config.tools``' entry; a tool set such as ``mcp`` gives several
    tools); None for a tool given as an instance."""
    tool_set: Any = None
    """The :class:`ToolSet` it is a member of (None: a tool configured on its own)."""
    end_episode_fn: Callable[[Any], Any] | None = None
    """``end_episode(key)``: the trajectory ``key`` (:data:`current_episode` during its calls) has ended; the tool
    releases what it kept for it (a per-trajectory server process). Plain or ``async``."""

    @property
    def label(self) -> str:
        return _label("tool", self.name, self.impl)

    async def end_episode(self, key: Any) -> None:
        """Tell the tool the trajectory ``key`` ended (nothing when it declares no ``end_episode``)."""
        if self.end_episode_fn is not None:
            result = self.end_episode_fn(key)
            if inspect.isawaitable(result):
                await result

    def schema(self) -> dict[str, Any]:
        return self.impl.schema()

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        return await self.impl(arguments)

    def start_up(self) -> str | None:
        """Start the tool's resources now and say how it runs (None: it declares no ``start_up()``)."""
        return None if self.start_up_fn is None else str(self.start_up_fn())


@dataclass(frozen=True, eq=False)
class RewardPlugin(_Adapter):
    """A reward component, its weight in the total, and its optional ``is_success``."""

    weight: float = 1.0
    is_success_fn: Callable[[float], bool] | None = None
    score_batch_fn: Callable[[Sequence[Trajectory], Sequence[Mapping[str, Any]]], list] | None = None
    """The optional ``score_batch(trajectories, rows) -> [value or exception]``: one call for many trajectories (a
    judge runs its requests concurrently, or one per group); else the trainer calls the component per trajectory."""
    scores_during_rollout: str | None = None
    """What it declares as ``scores_during_rollout``: ``"trajectory"`` or ``"group"`` to have ``score_batch`` called
    as each trajectory (or each whole group) ends, during the rollout, to warm a cache the scoring reads afterwards
    (a judge's calls then overlap the generation); None (the default): scored after the rollout only."""

    @property
    def label(self) -> str:
        return _label("reward component", self.name, self.impl)

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> Any:
        return self.impl(trajectory, example)

    def is_success(self, value: float) -> bool:
        """Whether ``value`` means success (what an evaluation counts as correct).

        Raises:
            PluginDeclarationError: the component defines no ``is_success``.
        """
        if self.is_success_fn is None:
            raise PluginDeclarationError(
                self.label,
                "has no is_success(value) method, so an evaluation cannot tell a success from a failure by it.",
            )
        return bool(self.is_success_fn(value))


def as_advantage(impl: Any, name: str = "") -> AdvantagePlugin:
    """``impl`` with its declarations read (an :class:`AdvantagePlugin` is returned as it is)."""
    if isinstance(impl, AdvantagePlugin):
        return impl
    label = _label("advantage", name, impl)
    return AdvantagePlugin(
        name,
        impl,
        **_metric_members(impl, label),
        needs_values=_required_bool(impl, "needs_values", label),
        needs_groups=_required_bool(impl, "needs_groups", label),
        needs_turn_ids=_optional_bool(impl, "needs_turn_ids", False, label),
        needs_teacher_logprobs=_optional_bool(impl, "needs_teacher_logprobs", False, label),
    )


def as_policy_loss(impl: Any, name: str = "") -> PolicyLossPlugin:
    """``impl`` with its declarations read (a :class:`PolicyLossPlugin` is returned as it is)."""
    if isinstance(impl, PolicyLossPlugin):
        return impl
    label = _label("policy_loss", name, impl)
    return PolicyLossPlugin(
        name,
        impl,
        **_metric_members(impl, label),
        needs_ref_logprobs=_required_bool(impl, "needs_ref_logprobs", label),
        needs_entropy=_required_bool(impl, "needs_entropy", label),
        supports_is_weights=_optional_bool(impl, "supports_is_weights", False, label),
        needs_turn_ids=_optional_bool(impl, "needs_turn_ids", False, label),
        token_local=_optional_bool(impl, "token_local", False, label),
        teacher_divergence=_optional_beta(impl, "teacher_divergence", label),
        teacher_top_k=_optional_top_k(impl, "teacher_top_k", label),
        teacher_tail=_optional_tail(impl, "teacher_tail", label),
    )


def as_rollout(impl: Any, name: str = "") -> RolloutPlugin:
    """``impl`` with its token budget read (a :class:`RolloutPlugin` is returned as it is)."""
    if isinstance(impl, RolloutPlugin):
        return impl
    label = _label("rollout", name, impl)
    if not hasattr(impl, "token_budget"):
        raise PluginDeclarationError(
            label, "does not declare token_budget (max tokens of one trajectory, or None); see docs/plugins.md."
        )
    budget = impl.token_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise PluginDeclarationError(label, f"declares token_budget={budget!r}; it must be a positive int or None.")
    per_turn = _optional(impl, "tool_calls_per_turn", 1)
    if isinstance(per_turn, bool) or not isinstance(per_turn, int) or per_turn < 1:
        raise PluginDeclarationError(
            label,
            f"declares tool_calls_per_turn={per_turn!r}; it must be an int >= 1 (the "
            f"most tool calls of one turn it runs).",
        )
    return RolloutPlugin(
        name,
        impl,
        token_budget=budget,
        tool_calls_per_turn=per_turn,
        agent_conversation=_optional_bool(impl, "agent_conversation", False, label),
        offers_tools=_optional_bool(impl, "offers_tools", False, label),
        rederive_stop_fn=_optional_method(impl, "rederive_stop", label),
        rows_fn=_optional_method(impl, "rows", label),
    )


def as_tool(impl: Any, name: str = "") -> ToolPlugin:
    """``impl`` with its optional members read (a :class:`ToolPlugin` is returned as it is). ``name`` defaults to
    the tool's own ``name``, the one the model calls."""
    if isinstance(impl, ToolPlugin):
        return impl
    own = _optional(impl, "name", None)
    label = _label("tool", name or own, impl)
    if not isinstance(own, str) or not own:
        raise PluginDeclarationError(
            label, f"has name {own!r}; a tool needs a non-empty name (the one the model calls)."
        )
    return ToolPlugin(
        own,
        impl,
        **_metric_members(impl, label),
        idempotent=_optional_bool(impl, "idempotent", False, label),
        start_up_fn=_optional_method(impl, "start_up", label),
        end_episode_fn=_optional_method(impl, "end_episode", label),
    )


def is_tool_set(impl: Any) -> bool:
    """Whether ``impl`` is a :class:`ToolSet` (it declares ``member_tools()``), not a tool."""
    return not isinstance(impl, ToolPlugin) and callable(getattr(type(impl), "member_tools", None))


def tools_of(impl: Any, configured: str) -> list[ToolPlugin]:
    """The tools of the run that the tool plugin configured as ``configured`` gives: the tool itself (called by its
    own ``name``), or each member of a :class:`ToolSet`, in its order; each knows the plugin it came from.

    Raises:
        PluginDeclarationError: a tool set that lists no tool, or a member that is no tool.
    """
    if not is_tool_set(impl):
        return [replace(as_tool(impl, configured), configured=configured)]
    members = list(impl.member_tools())
    if not members:
        raise PluginDeclarationError(_label("tool set", configured, impl), "member_tools() listed no tool.")
    return [replace(as_tool(m, configured), configured=configured, tool_set=impl) for m in members]


def _metric_members(impl: Any, label: str) -> dict[str, Any]:
    """The optional ``step_metrics()`` and what ``step_metric_reductions()`` declares, checked."""
    reductions_fn = _optional_method(impl, "step_metric_reductions", label)
    declared = dict(reductions_fn()) if reductions_fn is not None else {}
    bad = {k: v for k, v in declared.items() if v not in Reduction.__members__.values()}
    if bad:  # an unknown one would silently become a mean over ranks
        raise PluginDeclarationError(
            label, f"step_metric_reductions() returned {bad}; each value must be one of {[str(r) for r in Reduction]}."
        )
    return {
        "step_metrics_fn": _optional_method(impl, "step_metrics", label),
        "reductions": {k: Reduction(v) for k, v in declared.items()},
    }


def as_reward(impl: Any, name: str = "", weight: float = 1.0) -> RewardPlugin:
    """``impl`` with its weight and optional ``is_success`` (a :class:`RewardPlugin` is returned as it is)."""
    if isinstance(impl, RewardPlugin):
        return impl
    label = _label("reward component", name, impl)
    if not callable(impl):
        raise PluginDeclarationError(
            label, f"is a {type(impl).__name__}, not callable as component(trajectory, example)."
        )
    if not math.isfinite(float(weight)):
        raise PluginDeclarationError(label, f"has weight {weight!r}; a weight must be a finite number.")
    return RewardPlugin(
        name,
        impl,
        **_metric_members(impl, label),
        weight=float(weight),
        is_success_fn=_optional_method(impl, "is_success", label),
        score_batch_fn=_optional_method(impl, "score_batch", label),
        scores_during_rollout=_during_rollout(impl, label),
    )


def _during_rollout(impl: Any, label: str) -> str | None:
    value = _optional(impl, "scores_during_rollout", None)
    if value not in (None, "trajectory", "group"):
        raise PluginDeclarationError(
            label, f"declares scores_during_rollout={value!r}; it must be 'trajectory', 'group' or None."
        )
    if value is not None:
        method = _optional_method(impl, "score_batch", label)
        if method is None or "during_rollout" not in inspect.signature(method).parameters:
            raise PluginDeclarationError(
                label,
                "declares scores_during_rollout, which calls score_batch(trajectories, rows, during_rollout=True); "
                "it has no such method.",
            )
    return value
