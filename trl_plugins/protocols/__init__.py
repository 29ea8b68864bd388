"""What a plugin of each seam is and what it may declare: one typed ``Protocol`` per seam (:mod:`.seams`), and the
one adapter per seam that reads a plugin's declarations when the run is built (:mod:`.adapters`).

A plugin is any object with its seam's call and its *required* declarations (a dataclass or a plain class; a
``typing.Protocol`` is structural, so nothing needs to be inherited). *Optional* members have the defaults the
Protocols' docstrings give. The run (:mod:`trl_plugins.run`) wraps every plugin it builds in its seam's adapter
(:class:`AdvantagePlugin`, :class:`PolicyLossPlugin`, :class:`RolloutPlugin`, :class:`ToolPlugin`,
:class:`RewardPlugin`): the adapter reads each declaration once, checks its type, says which plugin got it
wrong, and from then on every decision asks the adapter. A third-party plugin that declares a capability
therefore takes part in the same decisions a built-in one does, and one that leaves an optional capability out
gets its default, never a surprise at step 1000.

==========================  ============================================  ==========================================
seam                        required                                      optional (default)
==========================  ============================================  ==========================================
advantage estimator         ``needs_values``, ``needs_groups`` (bools)    ``needs_turn_ids`` (False),
                                                                          ``needs_teacher_logprobs`` (False),
                                                                          ``step_metrics()``,
                                                                          ``step_metric_reductions()``, ``close()``
policy loss                 ``needs_ref_logprobs``, ``needs_entropy``     ``supports_is_weights`` (False),
                                                                          ``needs_turn_ids`` (False),
                                                                          ``token_local`` (False),
                                                                          ``teacher_divergence`` (None),
                                                                          ``step_metrics()``,
                                                                          ``step_metric_reductions()``, ``close()``
rollout                     ``token_budget`` (int or None)                ``tool_calls_per_turn`` (1),
                                                                          ``agent_conversation``, ``offers_tools``
                                                                          (False), ``rederive_stop()``, ``close()``
tool                        ``name``, ``schema()``, ``async __call__``    ``idempotent`` (False), ``start_up()``,
                                                                          ``step_metrics()``,
                                                                          ``step_metric_reductions()``, ``close()``
tool set (several tools     ``member_tools()`` (a list of tools)          ``close()``
configured as one plugin)
reward component            ``__call__(trajectory, example)``             ``is_success(value)``, ``close()``
==========================  ============================================  ==========================================

``step_metrics()`` returns ``{name: number}`` once per step (what happened since the last call) and
``step_metric_reductions()`` ``{name: "sum" | "max" | "min" | "mean"}`` (how each combines over ranks; mean when not
declared). A tool's metrics are logged under their own names; an advantage estimator's as ``advantage/<name>`` and a
policy loss's as ``policy_loss/<name>`` (a policy loss runs once per micro-batch: it accumulates, and reports when
asked).
"""

from trl_plugins.episodes import current_episode, tool_episode  # the tool seam's episodes
from trl_plugins.protocols.adapters import (
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
    close_plugin,
    is_tool_set,
    tools_of,
)
from trl_plugins.protocols.seams import (
    AdvantageEstimator,
    PluginDeclarationError,
    PolicyLoss,
    Reduction,
    RewardComponentFn,
    Rollout,
    Tool,
    ToolSet,
)

__all__ = [
    "Reduction",
    "PluginDeclarationError",
    "AdvantageEstimator",
    "PolicyLoss",
    "Rollout",
    "Tool",
    "ToolSet",
    "RewardComponentFn",
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
    "current_episode",
    "tool_episode",
]
