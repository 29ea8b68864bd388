"""The rows of the W&B trajectory tables (pure: trajectories and their dataset rows in, lists out).

:func:`trajectory_rows` gives one row per trajectory: the prompt, the reference answer, the whole
exchange turn by turn (assistant text, tool call with its arguments, tool output), the stop reason,
the reward, one column per reward component and the advantage. :func:`turn_rows` gives one row per
assistant turn, for filtering on tool calls. The trainer wraps them in ``wandb.Table``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from trl_plugins.types import Trajectory

__all__ = ["trajectory_columns", "trajectory_rows", "transcript", "prompt_text", "TURN_COLUMNS", "turn_rows"]

TURN_COLUMNS = [
    "step",
    "question_id",
    "sample",
    "turn",
    "assistant",
    "tool",
    "arguments",
    "tool_output",
    "tool_ok",
    "policy_step",
]
"""``policy_step``: the optimizer step of the weights that sampled the turn."""


def prompt_text(prompt: Any) -> str:
    """A row's ``prompt`` as text: a string as it is, chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m) for m in prompt
        )
    return "" if prompt is None else str(prompt)


def _arguments(arguments: Any) -> str:
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


def _outcome(call: Any) -> str:
    flags = ["ok" if call.ok else "error"]
    if call.timed_out:
        flags.append("timed out")
    if call.output_truncated:
        flags.append("output truncated")
    if call.infra_error:
        flags.append(f"environment error: {call.infra_error}")
    return ", ".join(flags)


def transcript(trajectory: Trajectory) -> str:
    """Every turn in order: ``[assistant i]`` text, ``[tool call i] name {arguments}``, ``[tool output i] (ok|error,
    ...)`` output."""
    parts = []
    for i, turn in enumerate(trajectory.turns, start=1):
        parts.append(f"[assistant {i}]\n{turn.text}")
        for k, call in enumerate(turn.tool_calls):  # parallel calls are numbered within the turn: 2.1, 2.2
            which = f"{i}" if len(turn.tool_calls) == 1 else f"{i}.{k + 1}"
            parts.append(f"[tool call {which}] {call.name} {_arguments(call.arguments)}")
            parts.append(f"[tool output {which}] ({_outcome(call)})\n{call.output}")
    return "\n".join(parts)


def trajectory_columns(reward_names: Sequence[str]) -> list[str]:
    """The columns of :func:`trajectory_rows`: one ``reward/<name>`` per component, in the order given."""
    return [
        "step",
        "question_id",
        "sample",
        "prompt",
        "answer",
        "transcript",
        "turns",
        "tool_calls",
        "stop_reason",
        "error",
        "reward",
        *[f"reward/{name}" for name in reward_names],
        "advantage",
    ]


def trajectory_rows(
    trajectories: Sequence[Trajectory],
    rows: Sequence[Mapping[str, Any]],
    *,
    step: int,
    reward_names: Sequence[str],
    max_rows: int | None = None,
) -> list[list[Any]]:
    """One row per trajectory (the first ``max_rows``), in :func:`trajectory_columns` order.

    ``rows[trajectory.group_id]`` is the trajectory's dataset row (its ``prompt`` and ``answer``, "" when it has
    none). A component a trajectory lacks (its world failed, or the verifier did) is ``None``.
    """
    out = []
    for t in list(trajectories)[:max_rows]:
        row = rows[t.group_id] if 0 <= t.group_id < len(rows) else {}
        values = {c.name: float(c.value) for c in t.reward_components}
        answer = row.get("answer", "")
        out.append(
            [
                step,
                t.question_id,
                t.sample_index,
                prompt_text(row.get("prompt")),
                "" if answer is None else str(answer),
                transcript(t),
                len(t.turns),
                t.num_tool_calls,
                "" if t.stop_reason is None else str(t.stop_reason.value),
                t.error or "",
                t.reward,
                *[values.get(name) for name in reward_names],
                None if t.advantage is None else float(t.advantage),
            ]
        )
    return out


def turn_rows(trajectories: Sequence[Trajectory], *, step: int, max_rows: int | None = None) -> list[list[Any]]:
    """One row per assistant turn of the first ``max_rows`` trajectories, in :data:`TURN_COLUMNS` order (the tool
    columns empty, ``tool_ok`` None, for a turn without a tool call; a turn with parallel calls lists their names,
    arguments and outputs one per line, and ``tool_ok`` is whether every one succeeded)."""
    out = []
    for t in list(trajectories)[:max_rows]:
        for i, (turn, sampled_by) in enumerate(zip(t.turns, t.turn_policy_steps()), start=1):
            calls = turn.tool_calls
            out.append(
                [
                    step,
                    t.question_id,
                    t.sample_index,
                    i,
                    turn.text,
                    ", ".join(c.name for c in calls),
                    "\n".join(_arguments(c.arguments) for c in calls),
                    "\n".join(c.output for c in calls),
                    all(c.ok for c in calls) if calls else None,
                    sampled_by,
                ]
            )
    return out
