"""The multi-turn tool-call rollout engine (registered rollout plugin ``multi_turn``).

For each question the whole group starts from one shared prompt. Every trajectory then runs on its own
coroutine: its next turn goes to the sampler as soon as its tool result is in, while other trajectories
generate or wait for their tools (no lock-step rounds across the batch). Turns reach the backend through
one dispatcher: a batching backend (HF ``generate``, vLLM colocate) gets every turn that became ready
while its previous call ran, a per-request backend (a vLLM server) gets each turn as its own call.
Sampling seeds are per trajectory and turn, so what a turn samples does not depend on which other turns
shared its batch. Per turn ``max_new_tokens = min(max_assistant_tokens,
trajectory budget left)``. The next prompt is built token-in, token-out (:mod:`.chat`). Every
trajectory ends with its own :class:`~trl_plugins.types.StopReason`, carries its policy version and
per-turn timings, and passes :func:`~trl_plugins.rollout.validate.validate_trajectory`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Coroutine, Iterator, Mapping, Sequence, TypeVar

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

__all__ = ["RolloutError", "RolloutCancelled", "RolloutQuestion", "questions_from_rows", "RolloutRequest", "RolloutResult", "MultiTurnRollout", "derive_seed", "run_async", "critical_path"]

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
    """Calls to the backend's ``generate``."""
    generation_s: float = 0.0
    """Wall time with at least one ``generate`` call in flight."""
    tools_s: float = 0.0
    """Wall time with at least one tool call in flight (it overlaps ``generation_s``)."""
    total_s: float = 0.0
    """Wall time of the whole rollout."""
    critical_path_s: float = 0.0
    """The longest trajectory's own chain of generation and tool calls (:func:`critical_path`): the floor
    ``total_s`` cannot go below however turns are scheduled."""
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
            RolloutCancelled: ``request.stop`` was set; ``rollout_result`` holds what was done.
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
        try:
            with backend.session():
                run_async(self._run(request, result, live, bar))
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
        result.critical_path_s = max((critical_path(t) for t in result.trajectories), default=0.0)
        for traj in result.trajectories:
            validate_trajectory(traj)
        return result

    async def _run(self, request: RolloutRequest, result: RolloutResult, live: list[_Live], bar: Any) -> None:
        """Every trajectory on its own coroutine; generation through one :class:`_Dispatcher`."""
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(max_workers=_concurrency(request.backend),
                                                   thread_name_prefix="generate") as pool:
            dispatcher = _Dispatcher(request.backend, loop, pool, result)
            tools = _ToolCounter(result)
            tasks = [asyncio.ensure_future(self._trajectory(request, dispatcher, tools, st, index, bar))
                     for index, st in enumerate(live)]
            watcher = asyncio.ensure_future(_watch(request.stop)) if request.stop is not None else None
            try:
                pending: set = set(tasks) | ({watcher} if watcher else set())
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if watcher in done or any(t.done() and t.exception() is not None for t in done if t is not watcher):
                        break
                    if not (pending - {watcher}):
                        break
            finally:
                for task in tasks:
                    task.cancel()
                if watcher is not None:
                    watcher.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await dispatcher.drain()  # a generate call cannot be interrupted: let it finish first
            if dispatcher.fatal is not None:
                raise dispatcher.fatal
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            unfinished = sum(st.traj.stop_reason is None for st in live)
            if unfinished:
                raise RolloutCancelled(f"a stop was requested with {unfinished} trajectory(ies) unfinished")

    async def _trajectory(self, request: RolloutRequest, dispatcher: "_Dispatcher", tools: "_ToolCounter", st: _Live,
                          index: int, bar: Any) -> None:
        """One trajectory's turns: generate, parse, call the tool, build the next prompt, until it stops."""
        chat = request.chat

        def finish(reason: StopReason) -> None:
            st.traj.stop_reason = reason
            bar.update(1)

        while True:
            if len(st.prompt) >= self.max_trajectory_tokens:
                return finish(StopReason.TOKEN_BUDGET)
            budget = min(self.max_assistant_tokens, self.max_trajectory_tokens - len(st.prompt))
            seed = derive_seed(request.seed, index, len(st.traj.turns))
            sample, gen_s, queue_s = await dispatcher.generate(st.prompt, budget, seed)
            turn = Turn(
                prompt_ids=st.prompt,
                completion_ids=sample.token_ids,
                completion_logprobs=sample.logprobs,
                text=chat.tokenizer.decode(sample.token_ids, skip_special_tokens=False),
                prompt_sources=st.sources,
                truncated=not sample.finished,
                generation_s=gen_s,
                queue_s=queue_s,
            )
            st.traj.turns.append(turn)
            if not sample.finished:
                return finish(StopReason.TURN_LENGTH if budget == self.max_assistant_tokens else StopReason.TOKEN_BUDGET)
            try:
                parsed = chat.parse(st.prompt, sample.token_ids)
            except Exception as exc:  # a parser bug on odd model output must not end the whole rollout
                logger.exception("parsing a sampled turn raised; the trajectory ends as invalid_action")
                st.traj.error = f"the turn could not be parsed: {type(exc).__name__}: {exc}"
                return finish(StopReason.INVALID_ACTION)
            if parsed.kind == TurnKind.FINAL_ANSWER:
                return finish(StopReason.FINAL_ANSWER)
            if parsed.kind == TurnKind.NO_TOOL_CALL:
                return finish(StopReason.NO_TOOL_CALL)
            if parsed.kind != TurnKind.TOOL_CALL:
                return finish(StopReason.INVALID_ACTION)
            if st.tool_calls >= self.max_tool_calls:
                turn.tool_call = ToolCall(name=parsed.tool_name or "", arguments=parsed.arguments)
                return finish(StopReason.MAX_TOOL_CALLS)
            with tools.running():
                out = await _call_tool(request.tools[parsed.tool_name], parsed.arguments, retries=self.tool_retries)
            if out.infra_error is not None:
                # The tool failed, not the model: end here, without showing the model anything.
                turn.tool_call = ToolCall(name=parsed.tool_name, arguments=parsed.arguments, output="", ok=False,
                                          latency_s=out.latency_s, infra_error=out.infra_error)
                turn.tool_s = out.latency_s
                st.traj.error = f"tool {parsed.tool_name!r}: {out.infra_error}"
                return finish(StopReason.ENVIRONMENT_ERROR)
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
                return finish(StopReason.MAX_TURNS)


def critical_path(trajectory: Trajectory) -> float:
    """The trajectory's own chain: its turns' generation plus its tool calls, seconds (queueing excluded).

    A rollout cannot finish before its longest chain; ``RolloutResult.total_s / critical_path_s`` is how far
    scheduling is from that floor.
    """
    return sum(t.generation_s + t.tool_s for t in trajectory.turns)


def _concurrency(backend: Any) -> int:
    n = int(getattr(backend, "max_concurrency", 1) or 1)
    if n < 1:
        raise RolloutError(f"{type(backend).__name__}.max_concurrency must be >= 1, got {n}.")
    return n


async def _watch(stop: threading.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.05)


class _Abort(Exception):
    """A generate call raised a BaseException (e.g. KeyboardInterrupt); the rollout re-raises it at the end."""


class _ToolCounter:
    """Counts tool calls in flight and the wall time with at least one running."""

    def __init__(self, result: RolloutResult) -> None:
        self.result, self.running_now, self.since = result, 0, 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self.running_now == 0:
            self.since = time.perf_counter()
        self.running_now += 1
        self.result.max_concurrent_tool_calls = max(self.result.max_concurrent_tool_calls, self.running_now)
        try:
            yield
        finally:
            self.running_now -= 1
            if self.running_now == 0:
                self.result.tools_s += time.perf_counter() - self.since


class _Dispatcher:
    """Sends each ready turn to the backend as soon as it can take it.

    A backend with ``max_concurrency == 1`` (HF ``generate``, vLLM colocate) gets one call at a time
    holding every turn that became ready while the previous call ran; one with ``max_concurrency > 1``
    (a vLLM server, continuous batching) gets each turn as its own call, up to that many in flight.
    Calls run in worker threads, so tool calls and other trajectories proceed meanwhile.
    """

    def __init__(self, backend: Any, loop: asyncio.AbstractEventLoop, pool: concurrent.futures.Executor,
                 result: RolloutResult) -> None:
        self.backend, self.loop, self.pool, self.result = backend, loop, pool, result
        self.limit = _concurrency(backend)
        self.ready: list[tuple[list[int], int, int, asyncio.Future, float]] = []
        self.in_flight: set[asyncio.Future] = set()
        self.kick_scheduled = False
        self.busy_since = 0.0
        self.fatal: BaseException | None = None

    def generate(self, prompt: list[int], budget: int, seed: int) -> asyncio.Future:
        """A future of ``(sample, generation_s, queue_s)``."""
        fut = self.loop.create_future()
        self.ready.append((prompt, budget, seed, fut, time.perf_counter()))
        if not self.kick_scheduled:  # after the other coroutines that are ready in this loop pass have queued too
            self.kick_scheduled = True
            self.loop.call_soon(self._kick)
        return fut

    def _kick(self) -> None:
        self.kick_scheduled = False
        self.ready = [r for r in self.ready if not r[3].cancelled()]
        while self.ready and len(self.in_flight) < self.limit and self.fatal is None:
            if self.limit == 1:
                batch, self.ready = self.ready, []
            else:
                batch, self.ready = [self.ready[0]], self.ready[1:]
            if not self.in_flight:
                self.busy_since = time.perf_counter()
            t0 = time.perf_counter()
            call = self.loop.run_in_executor(self.pool, _generate_call, self.backend, [r[0] for r in batch],
                                             [r[1] for r in batch], [r[2] for r in batch])
            self.in_flight.add(call)
            self.result.rounds += 1
            call.add_done_callback(lambda f, batch=batch, t0=t0: self._done(f, batch, t0))

    def _done(self, call: asyncio.Future, batch: list, t0: float) -> None:
        now = time.perf_counter()
        self.in_flight.discard(call)
        if not self.in_flight:
            self.result.generation_s += now - self.busy_since
        outcome = call.result() if not call.cancelled() else _Abort("cancelled")
        for k, (_, _, _, fut, queued) in enumerate(batch):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception) and self.fatal is None:
                    self.fatal = outcome
                fut.set_exception(outcome if isinstance(outcome, Exception) else _Abort(type(outcome).__name__))
            else:
                fut.set_result((outcome[k], now - t0, t0 - queued))
        self._kick()

    async def drain(self) -> None:
        while self.in_flight:
            await asyncio.wait(set(self.in_flight))


def _generate_call(backend: Any, prompts: list[list[int]], budgets: list[int], seeds: list[int]) -> Any:
    """One backend call in a worker thread; any exception comes back as the value (checked by ``_done``)."""
    try:
        samples = backend.generate(prompts, budgets, seeds=seeds)
        if len(samples) != len(prompts):
            raise RolloutError(f"{type(backend).__name__}.generate returned {len(samples)} samples for "
                               f"{len(prompts)} prompts; it must return one per prompt, in order.")
        return samples
    except BaseException as exc:  # noqa: BLE001 - handed to the event loop, which re-raises it
        return exc
