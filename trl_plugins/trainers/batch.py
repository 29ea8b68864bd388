"""Rows -> trajectories -> scores -> advantages -> datums: the one path used by training AND evaluation.

Each step is a plain function over the run's :class:`~trl_plugins.trainers.plugins.RunPlugins`; the
trainer calls all of them, the evaluation the first two. Whatever a rollout plugin returns is checked
here (count, order, tokenizer digest, the trajectory contract) before anything uses it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator, Mapping, Sequence

import torch

from trl_plugins.datum import build_datum
from trl_plugins.rollout import ChatFormat, HFGenerationBackend, RolloutRequest, RolloutResult, VLLMBackend, questions_from_rows
from trl_plugins.rewards import reward_value
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.trainers.plugins import RunPlugins
from trl_plugins.algos import kl_estimate
from trl_plugins.types import AdvantageInput, Datum, RewardComponent, SamplingSettings, StopReason, Trajectory, TrajectoryError

__all__ = [
    "hf_backend",
    "sampling_settings",
    "vllm_backend",
    "cb_backend",
    "check_vllm",
    "rollout_rows",
    "score_trajectories",
    "training_mask",
    "VerifierTimeout",
    "build_datums_for_update",
    "add_kl_penalty",
    "compute_advantages",
    "set_datum_advantages",
    "kl_per_token",
    "compute_token_advantages",
]

logger = logging.getLogger(__name__)

KL_PENALTY_COMPONENT = "kl_penalty"
"""Name of the reward component that carries ``-sum_t KL_t`` when the reference KL is in the reward."""


def chat_format(tokenizer: Any, plugins: Any, args: Any) -> ChatFormat:
    """The run's :class:`ChatFormat`: its tools' schemas, ``chat_template_kwargs`` and ``stop_tokens``.

    Raises:
        ChatTemplateError: the chat template cannot be followed token for token (says why and what to use).
    """
    return ChatFormat(tokenizer, [t.schema() for t in plugins.tools.values()],
                      final_answer_pattern=getattr(args, "final_answer_pattern", None),
                      stop_tokens=getattr(args, "stop_tokens", None),
                      **(getattr(args, "chat_template_kwargs", None) or {}))


def sampling_settings(args: Any, *, temperature: float | None = None) -> SamplingSettings:
    """The config's sampling settings (``temperature`` overrides the config's)."""
    return SamplingSettings(
        temperature=args.temperature if temperature is None else temperature, top_p=args.top_p,
        top_k=args.top_k or 0, min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
    )


def hf_backend(model: Any, tokenizer: Any, chat: ChatFormat, args: Any, *, temperature: float | None = None,
               accelerator: Any = None) -> HFGenerationBackend:
    """The HF ``generate`` backend with the config's sampling settings (``temperature`` overrides the config's)."""
    return HFGenerationBackend(
        model,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=sampling_settings(args, temperature=temperature),
        accelerator=accelerator,
    )


def cb_backend(model: Any, chat: ChatFormat, args: Any, accelerator: Any) -> Any:
    """The continuous-batching backend (``use_transformers_continuous_batching``) on the training model, with
    TRL's ``transformers_continuous_batching_config``."""
    from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend, continuous_batching_config

    return ContinuousBatchingBackend(
        model, stop_token_ids=chat.stop_token_ids, sampling=sampling_settings(args),
        config=continuous_batching_config(args.transformers_continuous_batching_config), accelerator=accelerator,
        keep_cache=args.continuous_batching_keep_cache,
    )


def check_vllm(args: Any) -> None:
    """Refuse ``use_vllm`` before any model loads when vLLM cannot be imported (and no stand-in for TRL's
    ``VLLMGeneration`` was installed, as the tests' fake_vllm.py does)."""
    if not getattr(args, "use_vllm", False):
        return
    import trl.trainer.grpo_trainer as trl_grpo
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.import_utils import is_vllm_available

    if trl_grpo.VLLMGeneration is VLLMGeneration and not is_vllm_available():
        raise ValueError(
            "use_vllm=True, but vLLM is not installed here. Install a version TRL 1.16 supports "
            "(pip install 'vllm>=0.22,<=0.31') on the machine that generates (every training process in colocate "
            "mode; in server mode the trainer needs it too, for TRL's client), or drop --use_vllm to generate with "
            "HF generate."
        )


def vllm_backend(vllm_generation: Any, chat: ChatFormat, args: Any, accelerator: Any) -> VLLMBackend:
    """The vLLM backend over TRL's ``VLLMGeneration``. In server mode every rank sends its own turns, so the
    ranks TRL built no client on (all but the main process) get one here."""
    client = None
    if vllm_generation.mode == "server":
        client = getattr(vllm_generation, "vllm_client", None)
        if client is None:
            from trl.generation import vllm_client as trl_client

            base = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            client = trl_client.VLLMClient(base_url=base, group_port=args.vllm_group_port,
                                           connection_timeout=args.vllm_server_timeout)
    return VLLMBackend(vllm_generation, stop_token_ids=chat.stop_token_ids, sampling=sampling_settings(args),
                       client=client, max_concurrency=args.vllm_max_concurrent_requests)


def _check_result(rollout_name: str, result: Any, questions: Sequence[Any], group_size: int, digest: str) -> None:
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
        try:
            validate_trajectory(traj)
        except TrajectoryError as exc:
            raise TrajectoryError(f"{where}: {exc}") from exc


def rollout_rows(
    plugins: RunPlugins,
    args: Any,
    chat: ChatFormat,
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
    """Roll out every row ``group_size`` times with the run's rollout plugin and tools, and check the result.

    ``stop`` (a ``threading.Event``) lets a stop request cancel the rollout (:class:`RolloutCancelled`).
    A backend with weights of its own (``sync_weights``, vLLM) is brought to ``policy_step``'s weights first:
    a collective, so every rank calls this the same number of times.

    A row's ``prompt`` is a string or chat messages; ``args.system_prompt`` goes first. Trajectory
    ``group_id`` is the row's place in ``rows``.

    Raises:
        TrajectoryError: the rollout plugin returned the wrong trajectories or one that breaks the contract.
    """
    questions = questions_from_rows(chat, rows, args.system_prompt, id_offset=id_offset)
    sync = getattr(backend, "sync_weights", None)  # a sampler with weights of its own (vLLM) gets policy_step's
    if sync is not None:
        sync(policy_step)
    request = RolloutRequest(questions, group_size, backend, chat, plugins.tools, policy_step=policy_step, seed=seed,
                             progress=progress, stop=stop)
    result = plugins.rollout(request)
    _check_result(args.rollout, result, questions, group_size, chat.digest)
    return result


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


def score_trajectories(plugins: RunPlugins, trajectories: Sequence[Trajectory], rows: Sequence[Mapping[str, Any]], *,
                       time_limit_s: float | None = None) -> dict[str, int]:
    """Store each reward component (name, value, weight) on each trajectory; ``rows[traj.group_id]`` is its example.

    A component that raises, returns anything but one finite number (:func:`~trl_plugins.rewards.reward_value`) or runs past ``time_limit_s`` does not stop the
    run and does not score the trajectory as wrong: the trajectory gets ``StopReason.VERIFIER_ERROR``,
    ``error`` naming the component and the exception, and no reward components. Trajectories the
    environment already failed (``environment_error``) are not scored.

    Returns:
        Verifier failures per component name.
    """
    failures: dict[str, int] = {}
    for traj in trajectories:
        if traj.world_failure:
            traj.reward_components = []
            continue
        row = rows[traj.group_id]
        components = []
        for name, weight, fn in plugins.reward_components:
            try:
                with _time_limit(time_limit_s):
                    value = reward_value(fn(traj, row))  # the same rule check_reward_contract applies
            except (Exception, VerifierTimeout) as exc:
                failures[name] = failures.get(name, 0) + 1
                traj.stop_reason = StopReason.VERIFIER_ERROR
                traj.error = f"reward component {name!r}: {type(exc).__name__}: {exc}"
                logger.warning("verifier_error on question %r sample %d: %s", traj.question_id, traj.sample_index, traj.error)
                components = []
                break
            components.append(RewardComponent(name, value, weight))
        traj.reward_components = components
    return failures


def training_mask(trajectories: Sequence[Trajectory], *, mask_truncated: bool, min_valid_group_fraction: float = 0.0
                  ) -> list[bool]:
    """Which trajectories carry no training signal: neither scored against their group nor trained on.

    - Every world failure (``environment_error``, ``verifier_error``): the infrastructure's fault, not the policy's.
    - With ``mask_truncated`` (``truncated_policy='mask'``), every truncated one.
    - Every member of a group in which the share of members the world did not fail is below
      ``min_valid_group_fraction`` (too few left to compare).
    """
    masked = [t.world_failure or (mask_truncated and t.truncated) for t in trajectories]
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        by_group.setdefault(t.group_id, []).append(i)
    for members in by_group.values():
        valid = sum(not trajectories[i].world_failure for i in members)
        if valid < min_valid_group_fraction * len(members):
            for i in members:
                masked[i] = True
    return masked


def build_datums_for_update(plugins: RunPlugins, trajectories: Sequence[Trajectory], masked: Sequence[bool]) -> list[Datum]:
    """One datum per trajectory the update trains on (masked ones left out), advantages still 0.

    Zero-advantage datums are kept: they count in the loss denominators, and the update decides whether
    their forward can be skipped (:func:`~trl_plugins.trainers.step.datums_to_forward`).
    """
    return [
        build_datum(traj, advantage=0.0, max_context_tokens=plugins.max_context_tokens, trajectory_index=i)
        for i, traj in enumerate(trajectories)
        if not masked[i]
    ]


def kl_per_token(datum: Datum, estimator: str) -> torch.Tensor:
    """``(T,)`` estimate of KL(behaviour || reference) at each action position of ``datum`` (0 elsewhere),
    from the sampler's behaviour log-probs and the datum's reference log-probs, in float64."""
    if datum.ref_logprobs is None:
        raise ValueError("the KL to the reference needs datums with reference log-probs; call reference_logprobs() first.")
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
    for d in datums:
        total = float(kl_per_token(d, estimator).sum())
        traj = trajectories[d.trajectory_index]
        traj.reward_components = [c for c in traj.reward_components if c.name != KL_PENALTY_COMPONENT]
        traj.reward_components.append(RewardComponent(KL_PENALTY_COMPONENT, -total, beta))


def compute_advantages(plugins: RunPlugins, trajectories: Sequence[Trajectory], masked: Sequence[bool]) -> None:
    """Set ``traj.advantage`` from the advantage plugin; masked trajectories get 0 and are left out of its input.

    Rewards go to the estimator in float64 (the sum of weighted components in Python floats).

    Raises:
        ValueError: the plugin returned the wrong shape or a non-finite advantage (names the plugin).
    """
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    group_ids = torch.tensor([t.group_id for t in trajectories])
    keep = torch.tensor([not m for m in masked], dtype=torch.bool)
    advantages = torch.zeros(len(trajectories), dtype=torch.float64)
    if bool(keep.any()):
        out = plugins.advantage(AdvantageInput(rewards=rewards[keep], group_ids=group_ids[keep])).advantages
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (int(keep.sum()),):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"advantage plugin {type(plugins.advantage).__name__} returned {got} for {int(keep.sum())} "
                f"trajectories; an outcome estimator returns one advantage per trajectory, shape (N,)."
            )
        if not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).nonzero()[0])
            raise ValueError(
                f"advantage plugin {type(plugins.advantage).__name__} returned a non-finite advantage "
                f"({float(out[bad])}) for trajectory {bad} of the batch."
            )
        advantages[keep] = out.to(torch.float64)
    for traj, adv in zip(trajectories, advantages.tolist()):
        traj.advantage = adv


def set_datum_advantages(datums: Sequence[Datum], trajectories: Sequence[Trajectory]) -> None:
    """Put each trajectory's advantage on every action position of its datum (0 elsewhere)."""
    for d in datums:
        adv = trajectories[d.trajectory_index].advantage
        d.advantages = [adv if m else 0.0 for m in d.action_mask]


def _padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float64)
    return out


def compute_token_advantages(
    plugins: RunPlugins,
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    bootstrap_values: Sequence[float],
    *,
    token_rewards: Sequence[torch.Tensor] | None = None,
    all_reduce: Any = None,
) -> None:
    """Per-position advantages and value targets from a critic-based estimator (``needs_values``, e.g. ``gae``).

    The estimator gets the datums' action masks, rollout-time values (``old_values``), each trajectory's
    reward (on its last action token), the bootstrap mask and values (truncated trajectories bootstrap
    from the value after their last token) and optional per-token rewards; its advantages go on the
    datums, its returns become ``datum.returns``, and ``traj.advantage`` is the mean over the
    trajectory's action tokens (for the logs). Every rank must call it (``all_reduce`` may be collective).

    Raises:
        ValueError: the plugin returned the wrong shapes, no returns, or non-finite numbers (names the plugin).
    """
    width = max((d.num_tokens for d in datums), default=0)
    mask = _padded([d.action_mask for d in datums], width)
    values = _padded([d.old_values for d in datums], width)
    inp = AdvantageInput(
        rewards=torch.tensor([trajectories[d.trajectory_index].reward for d in datums], dtype=torch.float64),
        group_ids=torch.tensor([d.group_id for d in datums], dtype=torch.long),
        action_mask=mask,
        values=values,
        bootstrap_mask=torch.tensor([float(d.bootstrap_mask) for d in datums], dtype=torch.float64),
        bootstrap_values=torch.tensor(list(bootstrap_values), dtype=torch.float64),
        token_rewards=None if token_rewards is None else _padded([t.tolist() for t in token_rewards], width),
        all_reduce=all_reduce,
    )
    out = plugins.advantage(inp)
    name = type(plugins.advantage).__name__
    for what, tensor in (("advantages", out.advantages), ("returns", out.returns)):
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (len(datums), width):
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
            raise ValueError(
                f"advantage plugin {name} returned {what} {got} for {len(datums)} datums of width {width}; a critic-based "
                f"estimator returns per-position advantages and returns, shape (N, T)."
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"advantage plugin {name} returned non-finite {what}.")
    for traj in trajectories:
        traj.advantage = 0.0
    for i, d in enumerate(datums):
        n, m = d.num_tokens, mask[i, : d.num_tokens]
        adv = (out.advantages[i, :n] * m).tolist()
        d.advantages = adv
        d.returns = (out.returns[i, :n] * m).tolist()
        trajectories[d.trajectory_index].advantage = float((out.advantages[i, :n] * m).sum() / m.sum().clamp(min=1))
