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
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trl_plugins.aio import run_async
from trl_plugins.protocols import ToolPlugin, tool_episode
from trl_plugins.registry import ROLLOUTS
from trl_plugins.rollout.budgets import TrajectoryBudgets
from trl_plugins.rollout.chat import ParsedCall, TurnKind
from trl_plugins.rollout.dispatch import Dispatcher, ToolCounter, ToolFailures, concurrency, settle
from trl_plugins.rollout.request import (
    RolloutCancelled,
    RolloutError,
    RolloutQuestion,
    RolloutRequest,
    RolloutResult,
    derive_seed,
    questions_from_rows,
)
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.tools.base import ToolOutput, valid_text
from trl_plugins.types import (
    PolicyVersion,
    StopReason,
    TokenSource,
    ToolCall,
    Trajectory,
    Turn,
)

__all__ = [
    "RolloutError",
    "RolloutCancelled",
    "RolloutQuestion",
    "questions_from_rows",
    "RolloutRequest",
    "RolloutResult",
    "MultiTurnRollout",
    "derive_seed",
    "critical_path",
]

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    traj: Trajectory
    prompt: list[int]
    sources: list[TokenSource]
    tool_calls: int = 0


async def call_tool(
    tool: ToolPlugin, arguments: dict, *, retries: int = 0, failures: ToolFailures | None = None
) -> ToolOutput:
    """One tool call. A tool that raises has failed (an infrastructure error, not the model's); a call
    that failed so is retried up to ``retries`` times when the tool declares itself ``idempotent``. Failures are
    logged through ``failures`` (once per kind with a traceback, then counted)."""
    start = time.perf_counter()
    attempts = 1 + (retries if tool.idempotent else 0)
    failures = failures if failures is not None else ToolFailures()
    for attempt in range(attempts):
        raised = None
        try:
            out = _checked_output(await tool(arguments))
        except Exception as exc:  # a tool bug must not take the whole rollout down, nor be the policy's fault
            raised = exc
            out = ToolOutput(text="", ok=False, infra_error=f"{type(exc).__name__}: {exc}")
        if out.infra_error is None:
            break
        failures.record(tool.name, out.infra_error, attempt=attempt + 1, attempts=attempts, exc=raised)
    if not out.latency_s:
        out.latency_s = time.perf_counter() - start
    return out


def _checked_output(out: Any) -> ToolOutput:
    """What a tool returned, checked at the seam: a :class:`ToolOutput` whose ``text`` is a ``str`` (else the tool
    broke its contract: an infrastructure error saying so), with code points no tokenizer can encode replaced."""
    if not isinstance(out, ToolOutput):
        return ToolOutput(
            text="", ok=False, infra_error=f"the tool returned {type(out).__name__} {out!r:.60}, not a ToolOutput"
        )
    if not isinstance(out.text, str):
        return ToolOutput(
            text="",
            ok=False,
            latency_s=out.latency_s,
            infra_error=(
                f"the tool returned ToolOutput.text of type {type(out.text).__name__} ({out.text!r:.60}); it must be "
                "a str"
            ),
        )
    out.text = valid_text(out.text)
    return out


@ROLLOUTS.register("multi_turn")
@dataclass
class MultiTurnRollout(TrajectoryBudgets):
    """Multi-turn tool-calling rollout with per-turn and per-trajectory budgets.

    Stop reasons: a final answer, a turn without a tool call, or an invalid action (a turn with more than
    ``max_tool_calls_per_turn`` calls among them) terminate; a turn cut at its ``max_new_tokens``
    (``turn_length``, or ``token_budget`` when the trajectory budget was the binding limit), a prompt that
    already fills ``max_trajectory_tokens`` (``token_budget``), the ``max_turns``-th turn making a tool call
    (``max_turns``), or a turn whose calls would take the trajectory past ``max_tool_calls``
    (``max_tool_calls``) truncate. A tool response over ``max_tool_response_tokens`` keeps its tail and the
    trajectory goes on. The calls of one turn (parallel calls) run concurrently, each tool's own concurrency
    limit permitting, and their tool messages follow in the order the calls were written.
    """

    tool_retries: int = 1
    """Retries of a call that failed for infrastructure reasons, for tools that declare ``idempotent``
    (the code interpreter does); when they are used up the trajectory ends with ``environment_error``."""
    _failures: ToolFailures = field(default_factory=ToolFailures, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
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
        self.check_chat(chat)
        if backend.requires_lockstep:
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
                traj = Trajectory(
                    turns=[], question_id=q.question_id, group_id=q.group_id, sample_index=slot, policy_version=version
                )
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
        finally:
            self._failures.flush()
        bar.close()
        result.total_s = time.perf_counter() - start
        result.critical_path_s = max((critical_path(t) for t in result.trajectories), default=0.0)
        for traj in result.trajectories:
            validate_trajectory(traj)
        return result

    def rederive_stop(self, trajectory: Trajectory, chat: Any) -> tuple[int, StopReason | None]:
        """Replay capability: where and why these rules end ``trajectory``, from its saved turns (tokens, truncation,
        tool calls with their saved outputs) alone: ``(t, reason)``, the last turn they keep and the stop after it,
        or ``(last turn, None)`` when they would sample another turn. The stops the world decides around the
        rollout (``cancelled``, ``verifier_error``) are not derived here. ``chat`` is the run's chat format (its
        parser decides what a turn did)."""
        calls_so_far, turns = 0, trajectory.turns
        for t, turn in enumerate(turns):
            if len(turn.prompt_ids) >= self.max_trajectory_tokens:
                return t - 1, StopReason.TOKEN_BUDGET
            budget = min(self.max_assistant_tokens, self.max_trajectory_tokens - len(turn.prompt_ids))
            if turn.truncated:
                return t, StopReason.TURN_LENGTH if budget == self.max_assistant_tokens else StopReason.TOKEN_BUDGET
            try:
                parsed = chat.parse(turn.prompt_ids, turn.completion_ids)
            except Exception:  # noqa: BLE001 - what the rollout does with a parser that raises
                return t, StopReason.INVALID_ACTION
            if parsed.kind in (TurnKind.FINAL_ANSWER, TurnKind.NO_TOOL_CALL):
                return t, StopReason(str(parsed.kind))
            if parsed.kind != TurnKind.TOOL_CALL or len(parsed.calls) > self.max_tool_calls_per_turn:
                return t, StopReason.INVALID_ACTION
            if calls_so_far + len(parsed.calls) > self.max_tool_calls:
                return t, StopReason.MAX_TOOL_CALLS
            if any(c.infra_error is not None for c in turn.tool_calls):
                return t, StopReason.ENVIRONMENT_ERROR
            calls_so_far += len(parsed.calls)
            if t + 1 >= self.max_turns:
                return t, StopReason.MAX_TURNS
            if t + 1 == len(turns):  # the prompt the next turn would have had: over the budget is a stop
                results = [(c.name, c.output) for c in turn.tool_calls]
                glue = chat.tool_results_turn(turn.completion_ids, results, max_tokens=self.max_tool_response_tokens)
                if len(turn.prompt_ids) + len(turn.completion_ids) + len(glue.ids) >= self.max_trajectory_tokens:
                    return t, StopReason.TOKEN_BUDGET
        return len(turns) - 1, None

    async def _run(self, request: RolloutRequest, result: RolloutResult, live: list[_Live], bar: Any) -> None:
        """Every trajectory on its own coroutine; generation through one
        :class:`~trl_plugins.rollout.dispatch.Dispatcher`."""
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency(request.backend), thread_name_prefix="generate"
        ) as pool:
            dispatcher = Dispatcher(request.backend, loop, pool, result)
            tools = ToolCounter(result)
            tasks = [
                asyncio.ensure_future(self._trajectory(request, dispatcher, tools, st, index, bar))
                for index, st in enumerate(live)
            ]
            try:
                await settle(tasks, request.stop)
            finally:
                await dispatcher.drain()  # a generate call cannot be interrupted: let it finish first
            if dispatcher.fatal is not None:
                raise dispatcher.fatal
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            unfinished = sum(st.traj.stop_reason is None for st in live)
            if unfinished:
                raise RolloutCancelled(f"a stop was requested with {unfinished} trajectory(ies) unfinished")

    async def _run_calls(
        self, request: RolloutRequest, tools: ToolCounter, calls: list[ParsedCall]
    ) -> list[ToolOutput]:
        """Every call of one turn, concurrently (a tool's own concurrency limit may queue them), results in call
        order."""

        async def one(call: ParsedCall) -> ToolOutput:
            with tools.running():
                return await call_tool(
                    request.tools[call.name], call.arguments, retries=self.tool_retries, failures=self._failures
                )

        return list(await asyncio.gather(*(one(call) for call in calls)))

    async def _trajectory(
        self, request: RolloutRequest, dispatcher: Dispatcher, tools: ToolCounter, st: _Live, index: int, bar: Any
    ) -> None:
        """One trajectory, one episode of the tools (a tool's per-trajectory state is freed when it ends)."""
        async with tool_episode(request.tools.values()):
            await self._turns(request, dispatcher, tools, st, index, bar)

    async def _turns(
        self, request: RolloutRequest, dispatcher: Dispatcher, tools: ToolCounter, st: _Live, index: int, bar: Any
    ) -> None:
        """One trajectory's turns: generate, parse, call the tool, build the next prompt, until it stops."""
        chat = request.chat

        def finish(reason: StopReason) -> None:
            st.traj.stop_reason = reason
            bar.update(1)
            if request.on_finished is not None:
                request.on_finished(st.traj)

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
                # The weights the backend sampled with: synced for this rollout, or stamped per call by a backend whose
                # weights change during it (an asynchronous replica).
                policy_step=request.policy_step if sample.policy_step is None else sample.policy_step,
                seed=seed,
            )
            st.traj.turns.append(turn)
            if not sample.finished:
                return finish(
                    StopReason.TURN_LENGTH if budget == self.max_assistant_tokens else StopReason.TOKEN_BUDGET
                )
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
                st.traj.error = parsed.error or "the turn is neither a tool call nor an answer the parser could read"
                return finish(StopReason.INVALID_ACTION)
            calls = parsed.calls
            if len(calls) > self.max_tool_calls_per_turn:
                # Over the cap: the action as written cannot be carried out, so none of it is (see docs/rollout.md).
                st.traj.error = (
                    f"the turn makes {len(calls)} tool calls, over max_tool_calls_per_turn="
                    f"{self.max_tool_calls_per_turn}: none of them ran"
                )
                return finish(StopReason.INVALID_ACTION)
            if st.tool_calls + len(calls) > self.max_tool_calls:
                turn.tool_calls = [ToolCall(name=c.name, arguments=c.arguments) for c in calls]
                return finish(StopReason.MAX_TOOL_CALLS)
            outs = await self._run_calls(request, tools, calls)
            turn.tool_s = max(out.latency_s for out in outs)
            turn.tool_calls = [
                ToolCall(
                    name=c.name,
                    arguments=c.arguments,
                    output=out.text,
                    ok=out.ok,
                    timed_out=out.timed_out,
                    latency_s=out.latency_s,
                    infra_error=out.infra_error,
                )
                for c, out in zip(calls, outs)
            ]
            failed = [call for call in turn.tool_calls if call.infra_error is not None]
            if failed:
                # A tool failed, not the model: end here, without showing the model anything.
                for call in failed:
                    call.output = ""
                st.traj.error = "; ".join(f"tool {call.name!r}: {call.infra_error}" for call in failed)
                return finish(StopReason.ENVIRONMENT_ERROR)
            try:
                tool_turn = chat.tool_results_turn(
                    turn.completion_ids,
                    [(c.name, out.text) for c, out in zip(calls, outs)],
                    max_tokens=self.max_tool_response_tokens,
                )
            except Exception as exc:  # output the template or tokenizer cannot take: this trajectory's world failed
                logger.exception(
                    "building the tool turn from a tool's output raised; the trajectory ends as environment_error"
                )
                error = f"its output could not be rendered and tokenised: {type(exc).__name__}: {exc}"
                for call in turn.tool_calls:
                    call.output, call.ok, call.infra_error = "", False, error
                st.traj.error = f"tool {turn.tool_calls[0].name!r}: {error}"
                return finish(StopReason.ENVIRONMENT_ERROR)
            for call, cut in zip(turn.tool_calls, tool_turn.truncated_outputs):
                call.output_truncated = cut
            st.tool_calls += len(calls)
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
