"""The trajectory contract as a check: :func:`validate_trajectory` (``types.py`` holds the vocabulary).

Every trajectory, from the built-in rollout or a plugin, passes this check before it becomes a datum.
"""

from __future__ import annotations

import math

from trl_plugins.types import StopReason, TokenSource, Trajectory, TrajectoryError, TrajectoryReport

__all__ = ["validate_trajectory"]


def validate_trajectory(traj: Trajectory) -> TrajectoryReport:
    """Check a finished trajectory against the contract.

    Raises:
        TrajectoryError: naming the turn (0-based) and token when: the trajectory has no stop reason
            or no turns; completion ids and log-probs differ in length; provenance lists have the
            wrong length; an ACTION token's behaviour log-prob is not finite; a non-ACTION token
            carries a log-prob; the trajectory is both terminated (stop reason) and truncated (its
            last turn hit ``max_new_tokens``); the stop reason says turn-length truncation but the
            last turn was not cut; a turn sampled by older weights than the trajectory's or an earlier turn's
            (``Turn.policy_step``).

    Returns:
        A :class:`TrajectoryReport` with the bootstrap mask (0 terminated, 1 truncated).
    """
    where = f"trajectory (question {traj.question_id!r}, group {traj.group_id}, sample {traj.sample_index})"
    if traj.stop_reason is None:
        raise TrajectoryError(f"{where} has no stop_reason: it is unfinished or was not recorded.")
    if not traj.turns:
        raise TrajectoryError(f"{where} has no turns.")
    for i, turn in enumerate(traj.turns):
        n = len(turn.completion_ids)
        if len(turn.completion_logprobs) != n:
            raise TrajectoryError(
                f"{where}, turn {i}: {n} completion tokens but {len(turn.completion_logprobs)} "
                f"behaviour log-probs; every sampled token needs exactly one."
            )
        if turn.completion_sources is not None and len(turn.completion_sources) != n:
            raise TrajectoryError(
                f"{where}, turn {i}: {n} completion tokens but {len(turn.completion_sources)} completion_sources."
            )
        if turn.segment_start and i == 0:
            raise TrajectoryError(
                f"{where}, turn 0: marked segment_start; a first turn starts the trajectory's first "
                f"segment by itself (segment_start marks a later turn whose prompt starts afresh)."
            )
        if turn.prompt_sources is not None:
            prev = (
                0
                if i == 0 or turn.segment_start
                else len(traj.turns[i - 1].prompt_ids) + len(traj.turns[i - 1].completion_ids)
            )
            expected = len(turn.prompt_ids) - prev
            if len(turn.prompt_sources) != expected:
                raise TrajectoryError(
                    f"{where}, turn {i}: prompt_sources has {len(turn.prompt_sources)} entries but "
                    f"the prompt adds {expected} tokens to what came before."
                )
            if any(s == TokenSource.ACTION for s in turn.prompt_sources):
                j = next(k for k, s in enumerate(turn.prompt_sources) if s == TokenSource.ACTION)
                raise TrajectoryError(
                    f"{where}, turn {i}, new prompt token {j}: marked ACTION, but prompt tokens were "
                    f"not sampled in this turn and have no behaviour log-prob."
                )
        for j, (tok, lp, src) in enumerate(zip(turn.completion_ids, turn.completion_logprobs, turn.sources())):
            if src == TokenSource.ACTION and not math.isfinite(lp):
                raise TrajectoryError(
                    f"{where}, turn {i}, completion token {j} (id {tok}): behaviour log-prob is {lp}; "
                    f"sampled tokens need a finite log-prob (check the sampler's log-prob output)."
                )
            if src != TokenSource.ACTION and not math.isnan(lp):
                raise TrajectoryError(
                    f"{where}, turn {i}, completion token {j} (id {tok}): a {src.name} token carries "
                    f"log-prob {lp}; only sampled tokens have one (store nan), otherwise provenance "
                    f"and log-probs are misaligned."
                )
    floor, of = (traj.policy_version.step if traj.policy_version is not None else None), "the trajectory"
    for i, step in enumerate(traj.turn_policy_steps()):
        if step is None:
            continue
        if floor is not None and step < floor:
            raise TrajectoryError(
                f"{where}, turn {i}: sampled by the weights of step {step}, older than {of} ({floor}): weights only "
                f"move forward within an episode. Record each turn's Turn.policy_step as the step of the weights that "
                f"sampled it, and the trajectory's policy_version.step as its first turn's."
            )
        floor, of = step, "an earlier turn"
    last = traj.turns[-1]
    if last.truncated and traj.stop_reason.is_terminated:
        raise TrajectoryError(
            f"{where}: both terminated and truncated: stop reason {traj.stop_reason.value!r} is a "
            f"termination, but the last turn ({len(traj.turns) - 1}) was cut at max_new_tokens. Use "
            f"StopReason.TURN_LENGTH for a cut turn."
        )
    if traj.stop_reason.is_world_failure and not traj.error:
        raise TrajectoryError(
            f"{where}: stop reason {traj.stop_reason.value!r} (the world failed, not the policy) without an error: "
            f"set Trajectory.error to what failed (the tool or reward component and the exception)."
        )
    if traj.stop_reason == StopReason.TURN_LENGTH and not last.truncated:
        raise TrajectoryError(
            f"{where}: stop reason 'turn_length' but the last turn ({len(traj.turns) - 1}) is not marked truncated."
        )
    return TrajectoryReport(
        bootstrap_mask=int(traj.stop_reason.is_truncated),
        num_turns=len(traj.turns),
        num_action_tokens=traj.num_action_tokens,
    )
