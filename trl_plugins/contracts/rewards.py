"""The contract check of reward components, called as the trainer calls them."""

from __future__ import annotations

import pickle
import random
from typing import Any, Mapping, Sequence

from trl_plugins.contracts._base import ContractError, check, check_pickles, read_declarations, resolve_plugin
from trl_plugins.contracts.fakes import make_trajectory
from trl_plugins.protocols import as_reward
from trl_plugins.types import StopReason, Trajectory

__all__ = ["check_reward_contract"]


def _reward_cases() -> list[tuple[str, Trajectory]]:
    """``(description, trajectory)``: what a reward component meets in training. Every stop reason the
    trainer scores (world failures are not scored), right, wrong and missing answers, a tool call that
    failed, an empty last turn, one turn or two."""
    from trl_plugins.types import ToolCall

    cases = []
    for reason in StopReason:
        if reason.is_world_failure:
            continue
        traj = make_trajectory(random.Random(3), num_turns=2, stop_reason=reason)
        traj.turns[
            0
        ].text = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
        traj.turns[0].tool_calls = [ToolCall("code_interpreter", {"code": "print(6 * 7)"}, output="42\n", ok=True)]
        traj.turns[-1].text = "The answer is \\boxed{42}."
        traj.turns[-1].truncated = reason == StopReason.TURN_LENGTH
        cases.append((f"stopped by {reason.value}", traj))
    wrong = make_trajectory(random.Random(4), num_turns=1)
    wrong.turns[-1].text = "The answer is \\boxed{7}."
    cases.append(("with a wrong answer", wrong))
    missing = make_trajectory(random.Random(5), num_turns=1, stop_reason=StopReason.NO_TOOL_CALL)
    missing.turns[-1].text = "I do not know."
    cases.append(("without an answer", missing))
    empty = make_trajectory(random.Random(6), num_turns=1, stop_reason=StopReason.NO_TOOL_CALL)
    empty.turns[-1].completion_ids, empty.turns[-1].completion_logprobs, empty.turns[-1].text = [], [], ""
    cases.append(("with an empty last turn", empty))
    failed = make_trajectory(random.Random(7), num_turns=2, stop_reason=StopReason.INVALID_ACTION)
    failed.turns[0].tool_calls = [
        ToolCall("code_interpreter", {"code": "1 / 0"}, output="ZeroDivisionError: division by zero")
    ]
    failed.turns[-1].text = "<tool_call>\n{not json"
    cases.append(("after a failed tool call, ending in a malformed one", failed))
    return cases


def check_reward_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    example: Mapping[str, Any] | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    deterministic: bool = True,
) -> None:
    """A reward component, called as the trainer calls it: ``component(trajectory, example)`` on every
    trajectory the trainer would score returns one finite number (the trainer's own rule,
    :func:`trl_plugins.rewards.reward_value`) without raising, leaves the trajectory and the example
    unchanged, returns the same value again for the same input (``deterministic``; pass ``False`` for a
    sampled judge), has an ``is_success(value)`` that returns a bool if it has one, a ``close()`` that
    can be called twice if it has one, and pickles.

    A component that raises is not scoring the trajectory as wrong: the trainer ends that trajectory as
    ``verifier_error`` and does not train on it. So a wrong, missing or truncated answer must get a
    value; raise only when the component cannot score at all (its verifier is down, the example lacks a
    column it needs).

    Args:
        plugin: A registry name, ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance.
        example: The dataset row (default ``{"answer": "42", "prompt": "What is 6 * 7?"}``).
        trajectories: Replace the built-in ones (one per stop reason the trainer scores, with the answer
            ``\\boxed{42}``, plus a wrong answer, no answer, an empty last turn and a failed tool call).
            Each must pass :func:`~trl_plugins.rollout.validate.validate_trajectory`.

    Raises:
        ContractError: naming the plugin, the trajectory and what is wrong.
        TrajectoryError: a trajectory given in ``trajectories`` breaks the trajectory contract.
    """
    import copy

    from trl_plugins.registry import REWARDS
    from trl_plugins.rewards import reward_value
    from trl_plugins.rollout.validate import validate_trajectory
    from trl_plugins.tools.base import close_plugin

    label, reward = resolve_plugin(REWARDS, plugin, kwargs)
    check(callable(reward), label, f"{type(reward).__name__} is not callable as component(trajectory, example)")
    example = dict(example if example is not None else {"answer": "42", "prompt": "What is 6 * 7?"})
    if trajectories is None:
        cases = _reward_cases()
    else:
        cases = [(f"number {i} (stopped by {t.stop_reason})", t) for i, t in enumerate(trajectories)]
    is_success = read_declarations(as_reward, reward, label).is_success_fn
    for what, traj in cases:
        validate_trajectory(traj)  # the trainer scores only trajectories that pass it
        where = f"{label} on the trajectory {what}"
        values = []
        for _ in range(2 if deterministic else 1):
            before, row = pickle.dumps(traj), copy.deepcopy(example)
            try:
                returned = reward(traj, row)
            except Exception as exc:
                raise ContractError(
                    f"{where}: raised {type(exc).__name__}: {exc}. The trainer would end the trajectory as "
                    f"verifier_error and not train on it; return a value for a wrong, missing or truncated answer "
                    f"and raise only when the component cannot score at all."
                ) from exc
            try:
                values.append(reward_value(returned))
            except (TypeError, ValueError) as exc:
                raise ContractError(f"{where}: {exc}") from None
            check(pickle.dumps(traj) == before, where, "changed the trajectory it scored")
            check(row == example, where, "changed the example (the dataset row every sample of the group shares)")
        check(
            len(set(values)) == 1,
            where,
            f"returned {values[0]} and then {values[-1]} for the same trajectory and example; a reward must depend "
            f"on them only (seed any randomness), or pass deterministic=False",
        )
        if is_success is not None:
            verdict = is_success(values[0])
            check(
                isinstance(verdict, bool) or type(verdict).__name__ == "bool_",
                label,
                f"is_success({values[0]}) returned {verdict!r}, not a bool",
            )
    check_pickles(reward, label, equal=False)
    try:
        close_plugin(reward)
        close_plugin(reward)
    except Exception as exc:
        raise ContractError(f"{label}: close() raised {type(exc).__name__}: {exc} (it must be idempotent)") from exc
