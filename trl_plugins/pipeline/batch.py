"""Rows -> trajectories -> scores -> left-out reasons -> datums -> advantages: the one path used by training AND
evaluation.

Each stage is a plain function over a :class:`~trl_plugins.run.Run`'s plugins; the trainer's step runs all of them
(:mod:`~trl_plugins.trainers.phases`), an evaluation the first two. Whatever a rollout or advantage plugin returns is
checked here (count, order, tokenizer digest, the trajectory contract, shapes, finiteness) before anything uses it,
and the error names the plugin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from trl_plugins.algos import kl_estimate
from trl_plugins.datum import build_datums
from trl_plugins.pipeline.prescoring import RolloutScorer
from trl_plugins.protocols import AdvantagePlugin, RewardPlugin
from trl_plugins.rewards import reward_value
from trl_plugins.rollout import ChatFormat, RolloutRequest, RolloutResult, questions_from_rows
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.run import KL_PENALTY_COMPONENT, RolloutParts, Run
from trl_plugins.types import (
    AdvantageInput,
    Datum,
    LeftOutReason,
    RewardComponent,
    StopReason,
    Trajectory,
    TrajectoryError,
)

__all__ = [
    "rollout_rows",
    "score_trajectories",
    "VerifierTimeout",
    "left_out_reasons",
    "training_mask",
    "build_datums_for_update",
    "kl_per_token",
    "add_kl_penalty",
    "assign_advantages",
    "KL_PENALTY_COMPONENT",
]

logger = logging.getLogger(__name__)


def _check_result(
    rollout_name: str,
    result: Any,
    questions: Sequence[Any],
    group_size: int,
    digest: str,
    run_digest: str | None = None,
) -> None:
    where = f"rollout plugin {rollout_name!r}"
    if not isinstance(result, RolloutResult):
        raise TrajectoryError(f"{where} returned {type(result).__name__}; a rollout returns a RolloutResult.")
    trajs = result.trajectories
    expected = [q.question_id for q in questions for _ in range(group_size)]
    if [t.question_id for t in trajs] != expected:
        raise TrajectoryError(
            f"{where} returned {len(trajs)} trajectories for {len(questions)} questions x {group_size} samples, or in "
            f"another order; it must return group_size trajectories per question, question-major."
        )
    for traj in trajs:
        version = traj.policy_version
        if version is None or version.tokenizer_digest != digest:
            got = None if version is None else version.tokenizer_digest
            raise TrajectoryError(
                f"trajectory for question {traj.question_id!r} was tokenised with tokenizer/chat-template digest "
                f"{got}, but the trainer's is {digest}: its token ids mean something else here. "
                f"Roll out with the trainer's tokenizer and chat template."
            )
        if run_digest is not None and version.run_digest is not None and version.run_digest != run_digest:
            raise TrajectoryError(
                f"trajectory for question {traj.question_id!r} was sampled under run version {version.run_digest}, but "
                f"the trainer's is {run_digest}: its producer has another adapter set, precision, sampler, package, "
                f"tool schema or plugin version (RunVersion). Roll out with the trainer's run, or compare the two "
                f"records with trl_plugins.run.version.version_differences."
            )
        try:
            validate_trajectory(traj)
        except TrajectoryError as exc:
            raise TrajectoryError(f"{where}: {exc}") from exc


def rollout_rows(
    run: Run | RolloutParts,
    backend: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    group_size: int,
    seed: int,
    policy_step: int = 0,
    id_offset: int = 0,
    progress: bool = False,
    stop: Any = None,
) -> RolloutResult:
    """Roll out every row ``group_size`` times with the run's rollout plugin and tools (``run``: the run, or its
    :class:`~trl_plugins.run.RolloutParts` in a replica), and check the result.

    ``stop`` (a ``threading.Event``) lets a stop request cancel the rollout (:class:`RolloutCancelled`).
    The backend is brought to ``policy_step``'s weights first (``sync_weights``: vLLM pushes them, a sampler
    on the training model has nothing to do): a collective for vLLM, so every rank calls this the same number of
    times. The run's chat format must be bound (:meth:`~trl_plugins.run.Run.bind_tokenizer`).

    A row's ``prompt`` is a string or chat messages; the config's ``system_prompt`` goes first. Trajectory
    ``group_id`` is the row's place in ``rows``.

    Raises:
        TrajectoryError: the rollout plugin returned the wrong trajectories or one that breaks the contract.
    """
    chat: ChatFormat = run.chat
    questions = questions_from_rows(chat, rows, run.config.system_prompt, id_offset=id_offset)
    backend.sync_weights(policy_step)
    scorer = RolloutScorer(run.prescorers, rows, group_size) if run.prescorers else None
    request = RolloutRequest(
        questions,
        group_size,
        backend,
        chat,
        run.tools,
        policy_step=policy_step,
        seed=seed,
        progress=progress,
        stop=stop,
        on_finished=None if scorer is None else scorer.finished,
    )
    try:
        result = run.rollout(request)
    except BaseException:
        if scorer is not None:
            scorer.abandon()
        raise
    if scorer is not None:
        start = time.perf_counter()
        scorer.wait(stop)  # the last trajectories' judges: the scoring that follows reads their cache
        result.counters["timing/judge_tail_s"] = time.perf_counter() - start
    weights = (
        backend.weights_digest()
    )  # after the sync (and, under ZeRO-3, taken in the rollout's gather): what sampled
    run_digest = None if run.version is None else run.version.digest
    _check_result(run.rollout.name, result, questions, group_size, chat.digest, run_digest)
    _stamp_versions(result.trajectories, weights, run_digest, policy_step)
    return result


def _stamp_versions(trajectories: Sequence[Trajectory], weights: str | None, run_digest: str | None, step: int) -> None:
    """Fill what the producer left unset of each trajectory's version: the digest of the weights after the sync
    (only for a trajectory sampled at that step: an async replica's other steps keep theirs) and the run's record."""
    stamped: dict[int, Any] = {}
    for traj in trajectories:
        v = traj.policy_version
        if v is None:
            continue
        new = (
            v.weights_digest if v.weights_digest is not None or v.step != step else weights,
            v.run_digest if v.run_digest is not None else run_digest,
        )
        if new == (v.weights_digest, v.run_digest):
            continue
        if id(v) not in stamped:
            stamped[id(v)] = dataclasses.replace(v, weights_digest=new[0], run_digest=new[1])
        traj.policy_version = stamped[id(v)]


class VerifierTimeout(Exception):
    """A reward component ran past its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`VerifierTimeout` in the body after ``seconds`` (a SIGALRM interval timer; main thread
    only, elsewhere no limit). A component that sets its own SIGALRM (math-verify does) replaces this
    one while it runs; its own timeouts then apply."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise VerifierTimeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score_trajectories(
    rewards: Sequence[RewardPlugin],
    trajectories: Sequence[Trajectory],
    rows: Sequence[Mapping[str, Any]],
    *,
    time_limit_s: float | None = None,
    examples: dict[str, str] | None = None,
) -> dict[str, int]:
    """Store each reward component (name, value, weight) on each trajectory; ``rows[traj.group_id]`` is its example.

    A component that raises, returns anything but one finite number (:func:`~trl_plugins.rewards.reward_value`) or
    runs past ``time_limit_s`` does not stop the run and does not score the trajectory as wrong: the trajectory gets
    ``StopReason.VERIFIER_ERROR``, ``error`` naming the component and the exception, and no reward components.
    Trajectories the environment already failed (``environment_error``) are not scored. Components the rollout
    recorded (an agent's returned reward: :mod:`trl_plugins.rewards.agent`) that no configured component replaces
    stay, with weight 0: the configured components win.

    A component with ``score_batch`` (a judge) is called once for every trajectory the components without one left
    standing (they run first, per trajectory): it bounds its own calls with its deadlines, so ``time_limit_s`` does
    not apply to it.

    Args:
        rewards: The run's reward components (``run.rewards``).
        examples: Filled with one error message per kind of failure (``"<component>: <kind>"``, the kind being the
            exception's ``kind`` or its type), in the order of how often each occurred (the most common first).

    Returns:
        Verifier failures per component name.
    """
    components_of = list(rewards)
    configured = {component.name for component in components_of}
    failures: dict[str, int] = {}
    kinds: dict[str, list[str]] = {}
    values: dict[int, dict[str, float]] = {}

    def fail(i: int, name: str, exc: BaseException) -> None:
        traj = trajectories[i]
        failures[name] = failures.get(name, 0) + 1
        traj.stop_reason = StopReason.VERIFIER_ERROR
        traj.error = f"reward component {name!r}: {type(exc).__name__}: {exc}"
        kinds.setdefault(f"{name}: {getattr(exc, 'kind', type(exc).__name__)}", []).append(traj.error)
        logger.warning("verifier_error on question %r sample %d: %s", traj.question_id, traj.sample_index, traj.error)
        values.pop(i, None)

    for i, traj in enumerate(trajectories):
        if traj.world_failure:
            traj.reward_components = []
            continue
        values[i] = {}
        for component in components_of:
            if component.score_batch_fn is not None:
                continue
            try:
                with _time_limit(time_limit_s):
                    value = reward_value(component(traj, rows[traj.group_id]))  # check_reward_contract's rule
            except (Exception, VerifierTimeout) as exc:
                fail(i, component.name, exc)
                break
            values[i][component.name] = value
    for component in components_of:
        if component.score_batch_fn is None or not values:
            continue
        standing = sorted(values)
        try:
            results = list(
                component.score_batch_fn(
                    [trajectories[i] for i in standing], [rows[trajectories[i].group_id] for i in standing]
                )
            )
            if len(results) != len(standing):
                raise ValueError(f"score_batch returned {len(results)} values for {len(standing)} trajectories")
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every trajectory in it, named
            results = [exc] * len(standing)
        for i, result in zip(standing, results):
            try:
                if isinstance(result, BaseException):
                    raise result
                values[i][component.name] = reward_value(result)
            except Exception as exc:  # noqa: BLE001 - a failed or malformed value: this trajectory's verifier_error
                fail(i, component.name, exc)
    for i, traj in enumerate(trajectories):
        if traj.world_failure:
            continue
        recorded = [RewardComponent(c.name, c.value, 0.0) for c in traj.reward_components if c.name not in configured]
        components = [RewardComponent(c.name, values[i][c.name], c.weight) for c in components_of]
        traj.reward_components = components + recorded if components else []
    if examples is not None:
        for kind, errors in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
            examples[kind] = errors[0]
    return failures


def left_out_reasons(
    trajectories: Sequence[Trajectory], *, mask_truncated: bool, min_valid_group_fraction: float = 0.0
) -> list[LeftOutReason | None]:
    """Per trajectory, why it carries no training signal (neither scored against its group nor trained on), or None.

    - Every world failure (``environment_error``, ``verifier_error``, ``cancelled``): the infrastructure's fault.
    - With ``mask_truncated`` (``truncated_policy='mask'``), every truncated one.
    - Every member of a group in which the share of members the world did not fail is below
      ``min_valid_group_fraction`` (too few left to compare).
    """
    reasons: list[LeftOutReason | None] = [
        LeftOutReason.WORLD_FAILURE
        if t.world_failure
        else LeftOutReason.TRUNCATED
        if mask_truncated and t.truncated
        else None
        for t in trajectories
    ]
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        by_group.setdefault(t.group_id, []).append(i)
    for members in by_group.values():
        valid = sum(not trajectories[i].world_failure for i in members)
        if valid < min_valid_group_fraction * len(members):
            for i in members:
                if reasons[i] is None:
                    reasons[i] = LeftOutReason.GROUP_TOO_SMALL
    return reasons


def training_mask(
    trajectories: Sequence[Trajectory], *, mask_truncated: bool, min_valid_group_fraction: float = 0.0
) -> list[bool]:
    """Per trajectory, whether the update leaves it out (:func:`left_out_reasons` is not None)."""
    return [
        r is not None
        for r in left_out_reasons(
            trajectories, mask_truncated=mask_truncated, min_valid_group_fraction=min_valid_group_fraction
        )
    ]


def build_datums_for_update(
    trajectories: Sequence[Trajectory],
    left_out: Sequence[Any],
    *,
    max_context_tokens: int | None,
    bootstrap_truncated: bool = False,
) -> list[Datum]:
    """One datum per segment of each trajectory the update trains on (those ``left_out`` marks are skipped; a
    trajectory is one segment unless an agent rewrote its history: :attr:`~trl_plugins.types.Trajectory.num_segments`),
    advantages still 0.

    Zero-advantage datums are kept: they count in the loss denominators, and the update decides whether
    their forward can be skipped (:func:`~trl_plugins.trainers.update.datums_to_forward`). A truncated
    trajectory's last datum bootstraps (``bootstrap_mask`` 1) only with ``bootstrap_truncated``
    (``truncated_policy='bootstrap'``); otherwise its truncation is an outcome, scored by the rewards, and
    nothing is bootstrapped (counting both would score hitting the budget above a wrong answer). Every segment but
    the last bootstraps: the episode goes on after it.
    """
    datums = []
    for i, traj in enumerate(trajectories):
        if left_out[i]:
            continue
        own = build_datums(traj, advantage=0.0, max_context_tokens=max_context_tokens, trajectory_index=i)
        if not bootstrap_truncated:
            own[-1].bootstrap_mask = 0
        datums += own
    return datums


def kl_per_token(datum: Datum, estimator: str) -> torch.Tensor:
    """``(T,)`` estimate of KL(behaviour || reference) at each action position of ``datum`` (0 elsewhere),
    from the sampler's behaviour log-probs and the datum's reference log-probs, in float64."""
    if datum.ref_logprobs is None:
        raise ValueError(
            "the KL to the reference needs datums with reference log-probs; call reference_logprobs() first."
        )
    mask = torch.tensor(datum.action_mask, dtype=torch.float64)
    behaviour = torch.tensor(datum.behaviour_logprobs, dtype=torch.float64)
    ref = torch.where(mask.bool(), torch.tensor(datum.ref_logprobs, dtype=torch.float64), behaviour)
    return kl_estimate(behaviour, ref, estimator) * mask


def add_kl_penalty(trajectories: Sequence[Trajectory], datums: Sequence[Datum], *, beta: float, estimator: str) -> None:
    """Classic-PPO reference KL in the reward: a ``kl_penalty`` component ``-sum_t KL_t`` with weight ``beta``.

    ``KL_t`` estimates KL(behaviour || reference) on each sampled token (:func:`kl_per_token`); the sum
    runs over the trajectory's action tokens. The component is stored like any other, so
    ``reward/kl_penalty`` is logged and the reward the advantage estimator sees includes
    ``-beta * sum_t KL_t``. (With a critic the penalty goes in per token instead, and the component is
    stored with weight 0 for the record.)
    """
    totals: dict[int, float] = {}
    for d in datums:  # a trajectory of several segments sums over all of them
        totals[d.trajectory_index] = totals.get(d.trajectory_index, 0.0) + float(kl_per_token(d, estimator).sum())
    for index, total in totals.items():
        traj = trajectories[index]
        traj.reward_components = [c for c in traj.reward_components if c.name != KL_PENALTY_COMPONENT]
        traj.reward_components.append(RewardComponent(KL_PENALTY_COMPONENT, -total, beta))


def turn_tensors(
    datums: Sequence[Datum], width: int, *, label: str = "the estimator"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(turn_ids, turn_state_ids)`` of ``datums``, each ``(N, width)`` long and -1 off the action positions: each
    action position's turn (``Datum.turn_ids``) and an id of the state its turn was taken from, the datum's tokens up
    to the turn's first sampled token, interned over ``datums`` (equal ids exactly for equal prefixes).

    Raises:
        ValueError: a datum without turn ids (built by hand), naming ``label``.
    """
    n = len(datums)
    turn_ids = torch.full((n, width), -1, dtype=torch.long)
    state_ids = torch.full((n, width), -1, dtype=torch.long)
    states: dict[tuple[int, ...], int] = {}
    for row, d in enumerate(datums):
        if d.turn_ids is None:
            raise ValueError(
                f"{label} needs turn ids (needs_turn_ids), but datum {row} carries none: build datums with "
                f"trl_plugins.datum.build_datums."
            )
        turn_ids[row, : d.num_tokens] = torch.tensor(d.turn_ids, dtype=torch.long)
        first: dict[int, int] = {}
        for pos, k in enumerate(d.turn_ids):
            if k >= 0 and k not in first:
                first[k] = pos
        for k, pos in first.items():
            state = states.setdefault(tuple(d.input_ids[: pos + 1]), len(states))  # what the turn's first token saw
            state_ids[row, : d.num_tokens][turn_ids[row, : d.num_tokens] == k] = state
    return turn_ids, state_ids


def _padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float64)
    return out


def _checked(plugin: AdvantagePlugin, what: str, tensor: Any, shapes: list[tuple[int, ...]]) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) not in shapes:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"{plugin.label} returned {what} of shape {got} for {shapes[0][0]} trajectories; an estimator returns one "
            f"advantage per trajectory, shape {shapes[0]}, or one per datum position, shape (N, T)"
            + (f" = {shapes[1]}" if len(shapes) > 1 else "")
            + "."
        )
    if not bool(torch.isfinite(tensor).all()):
        flat = tensor.reshape(-1)
        bad = int((~torch.isfinite(flat)).nonzero()[0])
        row = bad // tensor.shape[1] if tensor.dim() > 1 and tensor.shape[1] else bad
        raise ValueError(
            f"{plugin.label} returned a non-finite {what.removesuffix('s')} ({float(flat[bad])}) for "
            f"trajectory {row} of the batch."
        )
    return tensor


def _assign_to_segments(
    advantage: AdvantagePlugin, trajectories: Sequence[Trajectory], datums: Sequence[Datum]
) -> None:
    """Outcome advantages where a trajectory has several datums (segments): the estimator sees one row per trajectory
    (its last segment), so its group statistics count every trajectory once, and each segment gets its trajectory's
    advantage on every action position."""
    if getattr(advantage, "needs_teacher_logprobs", False):
        raise ValueError(
            f"{advantage.label} reads the teacher's log-prob of each token, but this batch has trajectories of several "
            f"segments (an agent rewrote its history); distillation over segments is not supported yet: keep the "
            f"agent from rewriting its history."
        )
    if getattr(advantage, "needs_turn_ids", False):
        raise ValueError(
            f"{advantage.label} credits turns by their place in a datum, but this batch has trajectories of several "
            f"segments (an agent rewrote its history, so their turns are spread over datums); use an outcome "
            f"estimator (group, rloo, dr_grpo) or gae, or keep the agent from rewriting its history."
        )
    last = {d.trajectory_index: d for d in datums}
    rows = list(last.values())
    assign_advantages(advantage, trajectories, rows)
    for d in rows:
        on = [a for a, m in zip(d.advantages, d.action_mask) if m]
        if any(a != on[0] for a in on):
            raise ValueError(
                f"{advantage.label} returned per-position advantages, which cannot be spread over a trajectory of "
                f"several segments (an agent rewrote its history); use an estimator with one advantage per "
                f"trajectory, or gae."
            )
    for d in datums:
        a = trajectories[d.trajectory_index].advantage
        d.advantages = [a if m else 0.0 for m in d.action_mask]


def assign_advantages(
    advantage: AdvantagePlugin,
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    *,
    bootstrap_values: Sequence[float] | None = None,
    token_rewards: Sequence[torch.Tensor] | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Advantages from the run's estimator onto the datums and their trajectories: one call contract for every
    estimator.

    The estimator sees the datums' trajectories only (left-out ones are not in its statistics): their total
    rewards (float64; 0 for a datum that bootstraps when the estimator ``needs_values``: the value after its last
    token stands for the rest of the episode, its outcome reward is not counted on top) and group ids, and, when it
    ``needs_values``, the datums' action masks, rollout-time values
    (``old_values``), bootstrap mask and values (truncated trajectories bootstrap from the value after their last
    token), optional per-token rewards and ``all_reduce`` for global statistics. It returns per trajectory ``(N,)``
    (put on every action position of the datum) or per datum position ``(N, T)`` (with ``returns``, the value
    targets, when it ``needs_values``). ``traj.advantage`` is the trajectory's advantage, or the mean over its action
    tokens (for the logs); left-out trajectories get 0. A trajectory of several segments (datums): an outcome
    estimator sees it once (its last segment) and every segment gets its advantage; an estimator that
    ``needs_values`` sees each segment, every one but the last bootstrapping from the value where it ends. Every rank
    must call it when the estimator
    ``needs_values`` (``all_reduce`` may be collective).

    Raises:
        ValueError: the plugin returned the wrong shapes, no returns where needed, or non-finite numbers (names it).
    """
    if not advantage.needs_values and len({d.trajectory_index for d in datums}) < len(datums):
        _assign_to_segments(advantage, trajectories, datums)
        return
    for traj in trajectories:
        traj.advantage = 0.0
    if not datums and not advantage.needs_values:
        return
    n = len(datums)
    width = max((d.num_tokens for d in datums), default=0)
    inp = AdvantageInput(
        rewards=torch.tensor(
            [
                0.0 if advantage.needs_values and d.bootstrap_mask else trajectories[d.trajectory_index].reward
                for d in datums
            ],
            dtype=torch.float64,
        ),
        group_ids=torch.tensor([trajectories[d.trajectory_index].group_id for d in datums], dtype=torch.long),
    )
    mask = _padded([d.action_mask for d in datums], width)
    if getattr(advantage, "needs_turn_ids", False):
        inp.action_mask = mask
        inp.turn_ids, inp.turn_state_ids = turn_tensors(datums, width, label=advantage.label)
    if getattr(advantage, "needs_teacher_logprobs", False):
        missing = [d.trajectory_index for d in datums if d.teacher_logprobs is None]
        if missing:
            raise ValueError(
                f"{advantage.label} reads the teacher's log-probs, but the datums of trajectories {missing[:5]} have "
                f"none: the run has no teacher (set teacher_model_name_or_path)."
            )
        inp.action_mask = mask
        on = mask > 0  # off the mask the behaviour log-probs are placeholders (NaN included)
        inp.behaviour_logprobs = torch.where(on, _padded([d.behaviour_logprobs for d in datums], width), 0.0)
        inp.teacher_logprobs = torch.where(on, _padded([d.teacher_logprobs for d in datums], width), 0.0)
    if advantage.needs_values:
        inp.action_mask = mask
        inp.values = _padded([d.old_values for d in datums], width)
        inp.bootstrap_mask = torch.tensor([float(d.bootstrap_mask) for d in datums], dtype=torch.float64)
        inp.bootstrap_values = torch.tensor(list(bootstrap_values or [0.0] * n), dtype=torch.float64)
        inp.token_rewards = None if token_rewards is None else _padded([t.tolist() for t in token_rewards], width)
        inp.all_reduce = all_reduce
    out = advantage(inp)
    adv = _checked(advantage, "advantages", out.advantages, [(n,), (n, width)])
    if advantage.needs_values:
        returns = _checked(advantage, "returns", out.returns, [(n, width)])
    if adv.dim() == 1:
        per_trajectory = adv.to(torch.float64).tolist()
        for d, a in zip(datums, per_trajectory):
            trajectories[d.trajectory_index].advantage = a
            d.advantages = [a if m else 0.0 for m in d.action_mask]
    else:
        for i, d in enumerate(datums):
            k, m = d.num_tokens, mask[i, : d.num_tokens]
            d.advantages = (adv[i, :k] * m).tolist()
            trajectories[d.trajectory_index].advantage = float((adv[i, :k] * m).sum() / m.sum().clamp(min=1))
    if advantage.needs_values:
        for i, d in enumerate(datums):
            d.returns = (returns[i, : d.num_tokens] * mask[i, : d.num_tokens]).tolist()
