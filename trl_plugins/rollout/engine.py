"""The multi-turn tool-call rollout engine (registered rollout plugin ``multi_turn``).

For each question the first turn samples the whole group from one shared prompt; then every live
trajectory continues on its own, all live trajectories batched into one ``generate`` call per round,
all tool calls of a round run concurrently. Per turn ``max_new_tokens = min(max_assistant_tokens,
trajectory budget left)``. The next prompt is built token-in, token-out (:mod:`.chat`). Every
trajectory ends with its own :class:`~trl_plugins.types.StopReason`, carries its policy version and
per-turn timings, and passes :func:`~trl_plugins.rollout.validate.validate_trajectory`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

from trl_plugins.registry import ROLLOUTS
from trl_plugins.rollout.backends import GenerationBackend
from trl_plugins.rollout.chat import ChatFormat, TurnKind
from trl_plugins.tools.base import Tool, ToolOutput
from trl_plugins.types import (
    PolicyVersion,
    StopReason,
    TokenSource,
    ToolCall,
    Trajectory,
    Turn,
)
from trl_plugins.rollout.validate import validate_trajectory

__all__ = ["RolloutError", "RolloutCancelled", "RolloutQuestion", "questions_from_rows", "RolloutRequest", "RolloutResult", "MultiTurnRollout", "derive_seed", "run_async"]

logger = logging.getLogger(__name__)
R = TypeVar("R")


class RolloutError(ValueError):
    """A rollout cannot start; the message says what to change."""


class RolloutCancelled(Exception):
    """The rollout stopped because ``RolloutRequest.stop`` was set; ``rollout_result`` holds what was done
    (the unfinished trajectories are ``cancelled``)."""


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from (base seed, step, rank, round, ...): a repeated question never replays a sample."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def run_async(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


@dataclass
class RolloutQuestion:
    """One question to roll out ``group_size`` times."""

    question_id: str
    """Identifier, copied to every trajectory."""
    prompt_ids: list[int]
    """The rendered first prompt (``ChatFormat.initial_prompt_ids``)."""
    group_id: int
    """Group id for group-relative advantages."""


def questions_from_rows(chat: Any, rows: Sequence[Mapping[str, Any]], system_prompt: str | None = None,
                        *, id_offset: int = 0) -> list[RolloutQuestion]:
    """One :class:`RolloutQuestion` per dataset row, its group id the row's place in ``rows``.

    A row's ``prompt`` is a string (one user message) or a list of chat messages; ``system_prompt``
    goes first. The question id is the row's ``id`` (or ``question_id``), else ``id_offset`` + place.
    """
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    out = []
    for k, row in enumerate(rows):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        qid = str(row.get("id", row.get("question_id", id_offset + k)))
        out.append(RolloutQuestion(qid, chat.initial_prompt_ids(system + messages), group_id=k))
    return out


@dataclass
class RolloutRequest:
    """Everything a rollout needs; the rollout plugin itself holds only its budgets."""

    questions: list[RolloutQuestion]
    """Questions to roll out."""
    group_size: int
    """Samples per question."""
    backend: GenerationBackend
    """The sampler."""
    chat: ChatFormat
    """Token-in, token-out turn building and parsing for the tokenizer's chat template."""
    tools: Mapping[str, Tool]
    """Tools by name."""
    policy_step: int = 0
    """Optimizer step of the sampling weights, recorded in each trajectory's policy version."""
    seed: int = 0
    """Base seed of this rollout (derive it from base seed, step and rank)."""
    progress: bool = False
    """Show a progress bar of finished trajectories."""
    stop: threading.Event | None = None
    """When set (a stop was requested, e.g. on SIGTERM), the rollout cancels its tool calls in flight and
    raises :class:`RolloutCancelled` before the next generation round."""


@dataclass
class RolloutResult:
    """Trajectories and what the rollout spent on them."""

    trajectories: list[Trajectory]
    """``len(questions) * group_size`` trajectories, question-major."""
    rounds: int = 0
    """Generation rounds run."""
    generation_s: float = 0.0
    """Wall time in ``generate``."""
    tools_s: float = 0.0
    """Wall time waiting for tool calls."""
    total_s: float = 0.0
    """Wall time of the whole rollout."""
    max_concurrent_tool_calls: int = 0
    """Most tool calls that ran at once."""


@dataclass
class _Live:
    traj: Trajectory
    prompt: list[int]
    sources: list[TokenSource]
    tool_calls: int = 0


async def _call_tool(tool: Tool, arguments: dict, *, retries: int = 0) -> ToolOutput:
    """One tool call. A tool that raises has failed (an infrastructure error, not the model's); a call
    that failed so is retried up to ``retries`` times when the tool declares itself ``idempotent``."""
    start = time.perf_counter()
    attempts = 1 + (retries if getattr(tool, "idempotent", False) else 0)
    for attempt in range(attempts):
        try:
            out = await tool(arguments)
        except Exception as exc:  # a tool bug must not take the whole rollout down, nor be the policy's fault
            logger.exception("tool %r raised", getattr(tool, "name", tool))
            out = ToolOutput(text="", ok=False, infra_error=f"{type(exc).__name__}: {exc}")
        if out.infra_error is None:
            break
        logger.warning("tool %r failed (attempt %d of %d): %s", getattr(tool, "name", tool), attempt + 1, attempts,
                       out.infra_error)
    if not out.latency_s:
        out.latency_s = time.perf_counter() - start
    return out


@ROLLOUTS.register("multi_turn")
@dataclass
class MultiTurnRollout:
    """Multi-turn tool-calling rollout with per-turn and per-trajectory budgets.

    Stop reasons: a final answer, a turn without a tool call, or an invalid action terminate; a turn
    cut at its ``max_new_tokens`` (``turn_length``, or ``token_budget`` when the trajectory budget was
    the binding limit), a prompt that already fills ``max_trajectory_tokens`` (``token_budget``), the
    ``max_turns``-th turn making a tool call (``max_turns``), or a tool call beyond
    ``max_tool_calls`` (``max_tool_calls``) truncate. A tool response over
    ``max_tool_response_tokens`` keeps its tail and the trajectory goes on.
    """

    max_turns: int = 8
    """Assistant turns per trajectory."""
    max_tool_calls: int = 8
    """Tool calls per trajectory."""
    max_assistant_tokens: int = 512
    """Tokens per assistant turn."""
    max_trajectory_tokens: int = 4096
    """Tokens per trajectory: first prompt, all completions, all tool messages."""
    max_tool_response_tokens: int = 512
    """Tokens per tool response (the tail is kept)."""
    tool_retries: int = 1
    """Retries of a call that failed for infrastructure reasons, for tools that declare ``idempotent``
    (the code interpreter does); when they are used up the trajectory ends with ``environment_error``."""

    @property
    def token_budget(self) -> int:
        """Capability: the most tokens one trajectory can hold (first prompt, completions, tool messages)."""
        return self.max_trajectory_tokens

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tool_calls", "max_assistant_tokens", "max_trajectory_tokens", "max_tool_response_tokens"):
            if getattr(self, name) < 1:
                raise RolloutError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.tool_retries < 0:
            raise RolloutError(f"tool_retries must be >= 0, got {self.tool_retries}.")

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        """Roll out every question ``group_size`` times.

        Raises:
            RolloutError: a first prompt that leaves no room in ``max_trajectory_tokens``, or a bad request.
        """
        if request.group_size < 1:
            raise RolloutError(f"group_size must be >= 1, got {request.group_size}.")
        for q in request.questions:
            if len(q.prompt_ids) >= self.max_trajectory_tokens:
                raise RolloutError(
                    f"question {q.question_id!r}: its prompt has {len(q.prompt_ids)} tokens, which leaves no room "
                    f"in max_trajectory_tokens={self.max_trajectory_tokens}. Raise max_trajectory_tokens or drop "
                    f"prompts longer than {self.max_trajectory_tokens - 1} tokens from the dataset."
                )
        chat, backend = request.chat, request.backend
        if getattr(backend, "requires_lockstep", False):
            raise RolloutError(
                f"{type(backend).__name__} generates in lock-step across ranks (a collective per call), which the "
                f"multi_turn rollout does not drive: it generates each rank's live trajectories on their own."
            )
        version = PolicyVersion(
            step=request.policy_step,
            tokenizer_digest=chat.digest,
            sampling=backend.sampling,
            logprob_source=backend.logprob_source,
        )
        result = RolloutResult(trajectories=[])
        live: list[_Live] = []
        for q in request.questions:
            for slot in range(request.group_size):
                traj = Trajectory(turns=[], question_id=q.question_id, group_id=q.group_id, sample_index=slot, policy_version=version)
                result.trajectories.append(traj)
                live.append(_Live(traj, list(q.prompt_ids), [TokenSource.PROMPT] * len(q.prompt_ids)))

        from tqdm.auto import tqdm

        bar = tqdm(total=len(live), desc="rollout", unit="traj", disable=not request.progress, leave=False)
        start = time.perf_counter()

        def finish(st: _Live, reason: StopReason) -> None:
            st.traj.stop_reason = reason
            bar.update(1)

        try:
            self._loop(request, chat, backend, result, live, finish)
        except BaseException as exc:  # interrupted: the unfinished trajectories are the world's failure
            for traj in result.trajectories:
                if traj.stop_reason is None:
                    traj.stop_reason = StopReason.CANCELLED
                    traj.error = f"the rollout was interrupted: {type(exc).__name__}"
            try:
                exc.rollout_result = result  # type: ignore[attr-defined]  # what was done, for whoever handles it
            except AttributeError:
                pass
            bar.close()
            raise
        bar.close()
        result.total_s = time.perf_counter() - start
        for traj in result.trajectories:
            validate_trajectory(traj)
        return result

    def _loop(self, request: RolloutRequest, chat: Any, backend: Any, result: RolloutResult, live: list,
              finish: Any) -> None:
        """Generation rounds until every trajectory has stopped (``__call__`` handles interruptions)."""
        with backend.session():
            while True:
                if request.stop is not None and request.stop.is_set():
                    raise RolloutCancelled("a stop was requested")
                still = []
                for st in live:
                    if len(st.prompt) >= self.max_trajectory_tokens:
                        finish(st, StopReason.TOKEN_BUDGET)
                    else:
                        still.append(st)
                live = still
                if not live:
                    break
                budgets = [min(self.max_assistant_tokens, self.max_trajectory_tokens - len(st.prompt)) for st in live]
                t0 = time.perf_counter()
                samples = backend.generate([st.prompt for st in live], budgets, seed=derive_seed(request.seed, result.rounds))
                gen_s = time.perf_counter() - t0
                result.generation_s += gen_s
                result.rounds += 1
                pending: list[tuple[_Live, Turn, Any]] = []
                for st, sample, budget in zip(live, samples, budgets):
                    turn = Turn(
                        prompt_ids=st.prompt,
                        completion_ids=sample.token_ids,
                        completion_logprobs=sample.logprobs,
                        text=chat.tokenizer.decode(sample.token_ids, skip_special_tokens=False),
                        prompt_sources=st.sources,
                        truncated=not sample.finished,
                        generation_s=gen_s,
                    )
                    st.traj.turns.append(turn)
                    if not sample.finished:
                        finish(st, StopReason.TURN_LENGTH if budget == self.max_assistant_tokens else StopReason.TOKEN_BUDGET)
                        continue
                    parsed = chat.parse(st.prompt, sample.token_ids)
                    if parsed.kind == TurnKind.TOOL_CALL:
                        if st.tool_calls >= self.max_tool_calls:
                            turn.tool_call = ToolCall(name=parsed.tool_name or "", arguments=parsed.arguments)
                            finish(st, StopReason.MAX_TOOL_CALLS)
                        else:
                            pending.append((st, turn, parsed))
                    elif parsed.kind == TurnKind.FINAL_ANSWER:
                        finish(st, StopReason.FINAL_ANSWER)
                    elif parsed.kind == TurnKind.NO_TOOL_CALL:
                        finish(st, StopReason.NO_TOOL_CALL)
                    else:
                        finish(st, StopReason.INVALID_ACTION)
                next_live = []
                if pending:
                    result.max_concurrent_tool_calls = max(result.max_concurrent_tool_calls, len(pending))
                    t0 = time.perf_counter()
                    outputs = run_async(self._run_tools(request.tools, [(p.tool_name, p.arguments) for _, _, p in pending],
                                                         self.tool_retries, request.stop))
                    result.tools_s += time.perf_counter() - t0
                    for (st, turn, parsed), out in zip(pending, outputs):
                        if out.infra_error is not None:
                            # The tool failed, not the model: end here, without showing the model anything.
                            turn.tool_call = ToolCall(name=parsed.tool_name, arguments=parsed.arguments, output="",
                                                      ok=False, latency_s=out.latency_s, infra_error=out.infra_error)
                            turn.tool_s = out.latency_s
                            st.traj.error = f"tool {parsed.tool_name!r}: {out.infra_error}"
                            finish(st, StopReason.ENVIRONMENT_ERROR)
                            continue
                        tool_turn = chat.tool_turn(turn.completion_ids, out.text, tool_name=parsed.tool_name,
                                                   arguments=parsed.arguments, max_tokens=self.max_tool_response_tokens)
                        turn.tool_call = ToolCall(
                            name=parsed.tool_name,
                            arguments=parsed.arguments,
                            output=out.text,
                            ok=out.ok,
                            timed_out=out.timed_out,
                            output_truncated=tool_turn.truncated,
                            latency_s=out.latency_s,
                        )
                        turn.tool_s = out.latency_s
                        st.tool_calls += 1
                        st.prompt = st.prompt + turn.completion_ids + tool_turn.ids
                        st.sources = tool_turn.sources
                        if len(st.traj.turns) >= self.max_turns:
                            finish(st, StopReason.MAX_TURNS)
                        else:
                            next_live.append(st)
                live = next_live

    @staticmethod
    async def _run_tools(tools: Mapping[str, Tool], calls: Sequence[tuple[str, dict]], retries: int = 0,
                         stop: threading.Event | None = None) -> list[ToolOutput]:
        tasks = [asyncio.ensure_future(_call_tool(tools[name], args, retries=retries)) for name, args in calls]
        pending: set = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=None if stop is None else 0.05)
            if pending and stop is not None and stop.is_set():
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise RolloutCancelled(f"a stop was requested with {len(pending)} tool call(s) in flight")
        return [task.result() for task in tasks]
