"""The seams' ``Protocol`` classes: what a plugin of each seam implements and declares (the table in
:mod:`trl_plugins.protocols`), the reductions a plugin's step metrics may declare, and the error a wrong declaration
raises."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the seams' own modules import this one
    from trl_plugins.types import AdvantageInput, AdvantageOutput, PolicyLossInput, PolicyLossOutput, Trajectory

__all__ = [
    "Reduction",
    "PluginDeclarationError",
    "AdvantageEstimator",
    "PolicyLoss",
    "Rollout",
    "Tool",
    "ToolSet",
    "RewardComponentFn",
]


class Reduction(enum.StrEnum):
    """How a per-rank figure combines over the data-parallel ranks (a tool's ``step_metric_reductions()``, the
    trainer's own statistics)."""

    SUM = "sum"
    """Counts and totals."""
    MAX = "max"
    """Peaks and worst cases."""
    MIN = "min"
    """Best cases."""
    MEAN = "mean"
    """Rates that every rank measures alike."""

    def combine(self, values: list[float]) -> float:
        """The combined value of the ranks' ``values`` (the arithmetic, for gathered figures)."""
        if self is Reduction.SUM:
            return float(sum(values))
        if self is Reduction.MAX:
            return float(max(values))
        if self is Reduction.MIN:
            return float(min(values))
        return float(sum(values) / len(values))


class PluginDeclarationError(ValueError):
    """A plugin's declaration is missing or of the wrong type; the message names the plugin and the member.

    Attributes:
        label: The plugin (``advantage 'gae'``).
        what: What is wrong with it (``does not declare needs_values (a bool); ...``).
    """

    def __init__(self, label: str, what: str) -> None:
        super().__init__(f"{label} {what}")
        self.label, self.what = label, what


# -- what a plugin implements ---------------------------------------------------------------------


class AdvantageEstimator(Protocol):
    """Advantages (and, with a critic, value targets) from a batch's rewards."""

    needs_values: bool
    """A critic runs and its values reach ``AdvantageInput.values`` (e.g. GAE)."""
    needs_groups: bool
    """Group-relative: ``num_generations`` must be at least 2."""

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput: ...


class PolicyLoss(Protocol):
    """A per-token policy loss before aggregation."""

    needs_ref_logprobs: bool
    """Reads ``PolicyLossInput.ref_logprobs`` (a reference model runs: ``beta > 0``)."""
    needs_entropy: bool
    """Reads ``PolicyLossInput.entropy``."""

    def __call__(self, inp: PolicyLossInput) -> PolicyLossOutput: ...


class Rollout(Protocol):
    """Trajectories for a :class:`~trl_plugins.rollout.RolloutRequest`."""

    token_budget: int | None
    """The most tokens one trajectory can hold, or None when unbounded."""
    # Optional: ``tool_calls_per_turn`` (int >= 1, default 1), the most calls of one turn it runs (parallel calls);
    # above 1 the run's chat format checks at start-up that the template renders that many exactly.
    # ``agent_conversation`` (bool, default False): an agent writes the conversation, so the run refuses its own
    # ``tools`` and ``system_prompt``. ``rederive_stop(trajectory, chat)``: where and why its rules end a saved
    # trajectory (the replay compares it with the saved stop reason). ``rows()``: the rollout's own dataset (an
    # environment's tasks), which the recipe trains and evaluates on instead of its task's. ``version`` (str) and
    # ``versions()`` (any plugin): see :func:`trl_plugins.run.version.plugin_versions`.

    def __call__(self, request: Any) -> Any: ...


@runtime_checkable
class Tool(Protocol):
    """A tool the model calls: a name, an OpenAI function schema, an async call on the parsed arguments."""

    name: str

    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        ...

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        """Run the tool on the model's parsed arguments; returns a ``ToolOutput``."""
        ...


@runtime_checkable
class ToolSet(Protocol):
    """Several tools configured as one tool plugin (the ``mcp`` plugin: every tool of its servers).

    The run calls ``member_tools()`` once, when it is built (before any model loads; it may start servers), and each
    member becomes a tool of the run under its own name, shown to the model with its own schema and called like any
    tool (:func:`tools_of`). The set itself has no schema and is never called. Optional: ``close()``, which the run
    reaches through the members (each member's ``close()`` may close what the set holds)."""

    def member_tools(self) -> list[Tool]:
        """The tools, in the order the model is shown them; at least one."""
        ...


class RewardComponentFn(Protocol):
    """One named reward component: a finite number for a scored trajectory and its dataset row."""

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float: ...
