"""The shared vocabulary every seam exchanges: turns, trajectories, provenance, datums, loss I/O.

Plugins exchange these dataclasses, never loose dicts. The contract, in one paragraph: a
:class:`Trajectory` is a list of :class:`Turn` s; each turn records the exact prompt token ids the
sampler saw and the completion token ids it produced, with the behaviour policy's log-prob of every
sampled token. Every token has a :class:`TokenSource`. A trajectory ends for one
:class:`StopReason`, which is either *terminated* (the episode is over: nothing to bootstrap) or
*truncated* (a budget cut it: the value of the last state may be bootstrapped). The
:class:`PolicyVersion` says which weights, tokenizer/template and sampling distribution produced it.

The vocabulary is split by seam: :mod:`.trajectory` (the trajectory contract and datums), :mod:`.algos` (the maths
seams' inputs, outputs and statistics), :mod:`.batches` (micro-batches and packing plans). Import from here.
"""

from trl_plugins.types.algos import (
    AdvantageInput,
    AdvantageOutput,
    AggregationMode,
    ImportanceSamplingMode,
    ImportanceWeights,
    KLEstimator,
    MismatchStats,
    PolicyLossInput,
    PolicyLossOutput,
    PolicyLossStats,
    ValueLossOutput,
    merge_stats,
    stat_reductions,
)
from trl_plugins.types.batches import MicroBatch, PackPlan, PrefixTree, SharedPrefixLayout
from trl_plugins.types.trajectory import (
    PLACEHOLDER_LOGPROB,
    Datum,
    LeftOutReason,
    LogprobSource,
    PolicyVersion,
    RewardComponent,
    SamplingSettings,
    StopReason,
    TokenSource,
    ToolCall,
    Trajectory,
    TrajectoryError,
    TrajectoryReport,
    Turn,
)
from trl_plugins.types.version import AdapterSpec, RunVersion

__all__ = [
    "PLACEHOLDER_LOGPROB",
    "LeftOutReason",
    "TokenSource",
    "StopReason",
    "LogprobSource",
    "SamplingSettings",
    "PolicyVersion",
    "AdapterSpec",
    "RunVersion",
    "RewardComponent",
    "ToolCall",
    "Turn",
    "Trajectory",
    "TrajectoryReport",
    "TrajectoryError",
    "Datum",
    "AggregationMode",
    "KLEstimator",
    "ImportanceSamplingMode",
    "MismatchStats",
    "ImportanceWeights",
    "AdvantageInput",
    "AdvantageOutput",
    "PolicyLossInput",
    "PolicyLossStats",
    "PolicyLossOutput",
    "ValueLossOutput",
    "merge_stats",
    "stat_reductions",
    "MicroBatch",
    "PackPlan",
    "PrefixTree",
    "SharedPrefixLayout",
]
