"""Per-step rollout metrics, namespaced ``rollout/*``, ``reward/*``, ``train/*`` and ``timing/*``.

Metrics that describe trajectories (means, fractions, quantiles) are computed from
:class:`TrajectorySummary` records, which are small enough to gather from every rank: on several
processes the trainer gathers the summaries of all ranks and computes these metrics once over their
union, so an 8-process run reports the same numbers as a 1-process run of the same trajectories.
:func:`engine_metrics` are what one rank's rollout engine did (timings, rounds); the trainer reduces
those over ranks by their meaning (see :func:`reduce_rank_metrics`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from trl_plugins.protocols import Reduction
from trl_plugins.rollout.request import RolloutResult
from trl_plugins.types import StopReason, Trajectory

__all__ = [
    "TrajectorySummary",
    "summarize",
    "trajectory_metrics",
    "reward_metrics",
    "engine_metrics",
    "staleness_counts",
    "staleness_metrics",
    "rollout_metrics",
    "reduce_rank_metrics",
    "quantile",
    "throughput_metrics",
    "THROUGHPUT",
]


@dataclass(frozen=True)
class TrajectorySummary:
    """What the step's metrics need of one trajectory (no tokens: cheap to gather from every rank)."""

    group: tuple[int, int]
    """``(rank, group_id)``: group ids are per rank."""
    turns: int
    tool_calls: int
    stop_reason: str
    terminated: bool
    truncated: bool
    world_failure: bool
    tool_errors: int
    """Calls whose output was an error of the model's code."""
    outputs_truncated: int
    tokens: int
    action_tokens: int
    calls_by_tool: tuple[tuple[str, int, int], ...]
    """``(tool, calls, infrastructure failures)``."""
    reward: float
    components: tuple[tuple[str, float], ...]
    advantage: float
    masked: bool
    """Left out of the update (truncated under ``truncated_policy='mask'``, or its group fell apart)."""
    tool_latencies: tuple[float, ...] = ()
    """Wall time of each tool call, seconds."""


def summarize(traj: Trajectory, *, rank: int = 0, masked: bool = False) -> TrajectorySummary:
    """The :class:`TrajectorySummary` of ``traj`` (scored or not; reward 0 before scoring)."""
    per_tool: dict[str, list[int]] = {}
    calls = [c for u in traj.turns for c in u.tool_calls]  # each call of a turn with parallel calls counts
    for c in calls:
        if c.output is not None:
            counts = per_tool.setdefault(c.name, [0, 0])
            counts[0] += 1
            counts[1] += c.infra_error is not None
    return TrajectorySummary(
        group=(rank, traj.group_id),
        turns=len(traj.turns),
        tool_calls=traj.num_tool_calls,
        stop_reason=str(traj.stop_reason.value if traj.stop_reason is not None else "none"),
        terminated=traj.terminated,
        truncated=traj.truncated,
        world_failure=traj.world_failure,
        tool_errors=sum(1 for c in calls if c.output and not c.ok),
        outputs_truncated=sum(1 for c in calls if c.output_truncated),
        tokens=traj.num_tokens,
        action_tokens=traj.num_action_tokens,
        calls_by_tool=tuple((k, v[0], v[1]) for k, v in sorted(per_tool.items())),
        reward=float(traj.reward) if traj.reward_components else 0.0,
        components=tuple((c.name, float(c.value)) for c in traj.reward_components),
        advantage=float(traj.advantage or 0.0),
        masked=masked,
        tool_latencies=tuple(float(c.latency_s) for c in calls if c.output is not None),
    )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` with linear interpolation (numpy's default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def trajectory_metrics(summaries: Sequence[TrajectorySummary], tools: Sequence[str] = ()) -> dict[str, float]:
    """Turns, tool calls (in all and per tool: ``rollout/tool_calls_mean/<tool>``, 0 for each of ``tools`` nobody
    called), valid-call rate, tokens (mean and quantiles), stop-reason fractions, rewards, advantages: over every
    summary given (on several ranks, the union of all ranks')."""
    n = max(len(summaries), 1)
    calls = sum(s.tool_calls for s in summaries)
    invalid = sum(s.stop_reason == StopReason.INVALID_ACTION.value for s in summaries)
    reasons = Counter(s.stop_reason for s in summaries)
    tokens = [float(s.tokens) for s in summaries]
    out = {
        "rollout/trajectories": float(len(summaries)),
        "rollout/turns_mean": sum(s.turns for s in summaries) / n,
        "rollout/tool_calls_mean": calls / n,
        # Of the turns that tried to call a tool, the share that were well formed.
        "rollout/valid_tool_call_rate": calls / max(calls + invalid, 1),
        "rollout/tool_errors_mean": sum(s.tool_errors for s in summaries) / n,
        "rollout/tool_output_truncated_mean": sum(s.outputs_truncated for s in summaries) / n,
        "rollout/trajectory_tokens_mean": sum(tokens) / n,
        "rollout/trajectory_tokens_p50": quantile(tokens, 0.5) if tokens else 0.0,
        "rollout/trajectory_tokens_p90": quantile(tokens, 0.9) if tokens else 0.0,
        "rollout/trajectory_tokens_max": max(tokens, default=0.0),
        "rollout/action_tokens_mean": sum(s.action_tokens for s in summaries) / n,
        "rollout/action_tokens": float(sum(s.action_tokens for s in summaries)),
        "rollout/terminated_frac": sum(s.terminated for s in summaries) / n,
        "rollout/truncated_frac": sum(s.truncated for s in summaries) / n,
    }
    for reason in StopReason:
        out[f"rollout/stop/{reason.value}"] = reasons.get(reason.value, 0) / n
    # Tool calls that failed for infrastructure reasons, per tool (of that tool's calls).
    per_tool: dict[str, list[int]] = {name: [0, 0] for name in tools}
    for s in summaries:
        for name, c, failed in s.calls_by_tool:
            counts = per_tool.setdefault(name, [0, 0])
            counts[0] += c
            counts[1] += failed
    for name, (c, failed) in per_tool.items():
        out[f"rollout/tool_calls_mean/{name}"] = c / n
        out[f"rollout/environment_error_rate/{name}"] = failed / max(c, 1)
    latencies = [x for s in summaries for x in s.tool_latencies]
    if latencies:
        out["rollout/tool_latency_p50_s"] = quantile(latencies, 0.5)
        out["rollout/tool_latency_p90_s"] = quantile(latencies, 0.9)
        out["rollout/tool_latency_max_s"] = max(latencies)
    return out


def reward_metrics(summaries: Sequence[TrajectorySummary], names: Sequence[str]) -> dict[str, float]:
    """Reward means (total over the trajectories the world did not fail, each component over the
    trajectories that carry it), masked, zero-advantage and degenerate-group fractions."""
    n = max(len(summaries), 1)
    scored = [s for s in summaries if not s.world_failure]
    out = {
        "reward/total": sum(s.reward for s in scored) / max(len(scored), 1),
        "train/world_failure_frac": (len(summaries) - len(scored)) / n if summaries else 0.0,
        "train/masked_truncated_frac": sum(s.masked for s in summaries) / n,
        "train/zero_advantage_frac": sum(s.advantage == 0.0 for s in summaries) / n,
    }
    for name in names:
        values = [v for s in summaries for c, v in s.components if c == name]
        out[f"reward/{name}"] = sum(values) / max(len(values), 1)
    # Groups that give the update nothing: every member's advantage is 0 (e.g. all right or all wrong).
    by_group: dict[tuple[int, int], list[float]] = {}
    for s in summaries:
        by_group.setdefault(s.group, []).append(s.advantage)
    out["rollout/degenerate_group_rate"] = sum(all(a == 0.0 for a in v) for v in by_group.values()) / max(
        len(by_group), 1
    )
    return out


STALENESS_BINS = 16
"""Staleness counted per value 0 .. STALENESS_BINS - 2; the last bin holds everything older."""


def staleness_counts(datums: Sequence[Any], step: int) -> list[float]:
    """How many action tokens of ``datums`` are how stale at the update of optimizer step ``step``: bin ``k`` counts
    the tokens sampled by the weights of step ``step - k`` (``Datum.behaviour_steps``; datums without them are not
    counted), the last bin everything older. Counts add up over ranks."""
    counts = [0.0] * STALENESS_BINS
    for d in datums:
        if d.behaviour_steps is None:
            continue
        for behaviour, m in zip(d.behaviour_steps, d.action_mask):
            if m:
                counts[min(max(step - behaviour, 0), STALENESS_BINS - 1)] += 1.0
    return counts


def staleness_metrics(counts: Sequence[float]) -> dict[str, float]:
    """The staleness distribution of a step's trained tokens from :func:`staleness_counts` (summed over ranks): its
    mean, 90th percentile and maximum in optimizer steps, and the share sampled by the weights being updated."""
    total = sum(counts)
    if not total:
        return {}
    seen = [k for k, c in enumerate(counts) if c]
    running, p90 = 0.0, seen[-1]
    for k, c in enumerate(counts):
        running += c
        if running >= 0.9 * total:
            p90 = k
            break
    return {
        "train/staleness_mean": sum(k * c for k, c in enumerate(counts)) / total,
        "train/staleness_p90": float(p90),
        "train/staleness_max": float(seen[-1]),
        "train/on_policy_token_frac": counts[0] / total,
    }


def engine_metrics(result: RolloutResult) -> dict[str, float]:
    """What this rank's rollout engine did: timings, generate calls, most concurrent tool calls, segments per
    trajectory,
    and how far the rollout's wall time is from its critical path (the longest trajectory's own generation + tool
    chain)."""
    turns = [turn for traj in result.trajectories for turn in traj.turns]
    n = max(len(result.trajectories), 1)
    return {
        # Datums per trajectory: above 1 where an agent behind the endpoint rewrote its history (Turn.segment_start).
        "rollout/segments_per_trajectory": sum(t.num_segments for t in result.trajectories) / n
        if result.trajectories
        else 1.0,
        "rollout/max_concurrent_tool_calls": float(result.max_concurrent_tool_calls),
        "rollout/generate_calls": float(result.rounds),
        "rollout/critical_path_s": result.critical_path_s,
        "rollout/critical_path_ratio": result.total_s / result.critical_path_s if result.critical_path_s > 0 else 1.0,
        "rollout/queue_s_mean": sum(t.queue_s for t in turns) / len(turns) if turns else 0.0,
        "timing/rollout_s": result.total_s,
        "timing/generation_s": result.generation_s,
        "timing/tools_s": result.tools_s,
        **result.counters,
    }


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """Trajectory metrics and engine metrics of one rollout (one process)."""
    return {**trajectory_metrics([summarize(t) for t in result.trajectories]), **engine_metrics(result)}


THROUGHPUT = {
    "rollout/generated_tokens_per_s": ("rollout/action_tokens", "timing/generation_s"),
    "train/forward_tokens_per_s": ("train/forward_tokens", "timing/forward_backward_s"),
}
"""Each rate and the (tokens, seconds) metrics it divides: sampled tokens of every rank over the generation
wall time (the slowest rank's), and tokens the training forward processed (all ranks) over the forward/backward
time."""


def throughput_metrics(values: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The :data:`THROUGHPUT` rates of the steps a logging record covers: total tokens over total seconds,
    from the per-step values of each metric (``values[key]``, one per step); a rate is left out where its
    metrics are absent or the time is 0. Over several steps this is not the mean of the per-step rates, so
    the record's rate equals its (averaged) tokens over its (averaged) seconds."""
    out = {}
    for rate, (tokens, seconds) in THROUGHPUT.items():
        t, s = list(values.get(tokens) or []), list(values.get(seconds) or [])
        if t and len(t) == len(s) and sum(s) > 0:
            out[rate] = sum(t) / sum(s)
    return out


_SUM = ("train/datums", "endpoint/tool_choice_unforced", "endpoint/text_format_unforced")
_MAX = (
    "rollout/generate_calls",
    "rollout/max_concurrent_tool_calls",
    "rollout/critical_path_s",
    "rollout/critical_path_ratio",
    "rollout/queue_s_mean",
)
METRIC_REDUCTIONS = tuple(str(r) for r in Reduction)
"""How a plugin may declare its ``step_metrics()`` combine over ranks (``step_metric_reductions()``)."""
_PER_RANK = {"timing/step_s": "step_s", "timing/rollout_s": "rollout_s", "train/datums": "datums"}


def reduce_rank_metrics(
    per_rank: Sequence[Mapping[str, Any]], reductions: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Combine the per-rank metrics of one step by what each means.

    ``timing/*``, ``memory/*``, generate calls, critical path and concurrency: the maximum over ranks (the step waits
    for the slowest);
    counts such as ``train/datums``: the sum; a key in ``reductions`` (what plugins declare for their
    ``step_metrics()``: ``"sum"``, ``"max"``, ``"min"`` or ``"mean"``) as declared; anything else
    (values already global and identical on every rank): the mean over the ranks that reported it.
    Rank-specific figures are kept as such: ``ranks/<name>/<rank>`` for step time, rollout time and
    datums, and ``ranks/step_s_imbalance`` (slowest over mean step time).
    """
    keys = sorted({k for m in per_rank for k in m})
    out: dict[str, float] = {}
    for key in keys:
        values = [float(m[key]) for m in per_rank if key in m]
        declared = (reductions or {}).get(key)
        if declared is not None:
            if declared not in METRIC_REDUCTIONS:
                raise ValueError(
                    f"metric {key!r} declares the reduction {declared!r}; use one of {list(METRIC_REDUCTIONS)}."
                )
            how = Reduction(declared)
        elif key in _SUM:
            how = Reduction.SUM
        elif key.startswith(("timing/", "memory/")) or key in _MAX:
            how = Reduction.MAX
        else:
            how = Reduction.MEAN
        out[key] = how.combine(values)
    if len(per_rank) > 1:
        for key, short in _PER_RANK.items():
            for rank, m in enumerate(per_rank):
                if key in m:
                    out[f"ranks/{short}/{rank}"] = float(m[key])
        steps = [float(m["timing/step_s"]) for m in per_rank if "timing/step_s" in m]
        if steps and sum(steps) > 0:
            out["ranks/step_s_imbalance"] = max(steps) / (sum(steps) / len(steps))
    return out
