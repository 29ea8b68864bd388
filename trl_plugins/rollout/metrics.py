"""Per-step rollout metrics, namespaced ``rollout/*`` and ``timing/*`` (floats, ready to log)."""

from __future__ import annotations

from collections import Counter

from trl_plugins.rollout.engine import RolloutResult
from trl_plugins.types import StopReason

__all__ = ["rollout_metrics"]


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """Turns, tool calls, valid-call rate, tokens, stop-reason fractions, timings."""
    trajs = result.trajectories
    n = max(len(trajs), 1)
    turns = sum(len(t.turns) for t in trajs)
    calls = sum(t.num_tool_calls for t in trajs)
    invalid = sum(t.stop_reason == StopReason.INVALID_ACTION for t in trajs)
    reasons = Counter(t.stop_reason for t in trajs)
    out = {
        "rollout/trajectories": float(len(trajs)),
        "rollout/turns_mean": turns / n,
        "rollout/tool_calls_mean": calls / n,
        # Of the turns that tried to call a tool, the share that were well formed.
        "rollout/valid_tool_call_rate": calls / max(calls + invalid, 1),
        "rollout/tool_errors_mean": sum(1 for t in trajs for u in t.turns if u.tool_call and u.tool_call.output and not u.tool_call.ok) / n,
        "rollout/tool_output_truncated_mean": sum(1 for t in trajs for u in t.turns if u.tool_call and u.tool_call.output_truncated) / n,
        "rollout/trajectory_tokens_mean": sum(t.num_tokens for t in trajs) / n,
        "rollout/action_tokens_mean": sum(t.num_action_tokens for t in trajs) / n,
        "rollout/max_concurrent_tool_calls": float(result.max_concurrent_tool_calls),
        "rollout/rounds": float(result.rounds),
        "timing/rollout_s": result.total_s,
        "timing/generation_s": result.generation_s,
        "timing/tools_s": result.tools_s,
    }
    for reason in StopReason:
        out[f"rollout/stop/{reason.value}"] = reasons.get(reason, 0) / n
    out["rollout/terminated_frac"] = sum(t.terminated for t in trajs) / n
    out["rollout/truncated_frac"] = sum(t.truncated for t in trajs) / n
    # Tool calls that failed for infrastructure reasons, per tool (of that tool's calls).
    per_tool: dict[str, list[int]] = {}
    for t in trajs:
        for u in t.turns:
            if u.tool_call is not None and u.tool_call.output is not None:
                counts = per_tool.setdefault(u.tool_call.name, [0, 0])
                counts[0] += 1
                counts[1] += u.tool_call.infra_error is not None
    for name, (calls_, failed) in per_tool.items():
        out[f"rollout/environment_error_rate/{name}"] = failed / max(calls_, 1)
    return out
