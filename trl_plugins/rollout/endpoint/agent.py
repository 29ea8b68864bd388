"""Train agents written against the OpenAI API: the rollout plugin ``agent_endpoint``.

For each trajectory it runs the user's agent (``async def agent(client, row)``, a plain function run off the event
loop, or a command) against a local HTTP endpoint that speaks the chat-completions API. Each request is matched
against the trajectory's recorded tokens and served by the run's sampler through the same dispatcher the built-in
rollout uses (:mod:`.session`), so an agent that sends back what it was given trains exactly the tokens the built-in
rollout would. The agent's return value (and a ``reward`` in the row) are recorded as reward components; the run's
configured components score the trajectory (``agent_reward`` reads the agent's). docs/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from trl_plugins.aio import run_async
from trl_plugins.registry import ROLLOUTS
from trl_plugins.rewards.agent import AGENT_REWARD, ROW_REWARD
from trl_plugins.rollout.budgets import TrajectoryBudgets
from trl_plugins.rollout.chat import ChatFormat, TurnKind
from trl_plugins.rollout.dispatch import Dispatcher, concurrency, settle
from trl_plugins.rollout.endpoint.api import check_request, template_messages
from trl_plugins.rollout.endpoint.http import HttpError, HttpRequest, JsonServer
from trl_plugins.rollout.endpoint.messages import AnthropicError, message_body, message_stream
from trl_plugins.rollout.endpoint.messages import chat_body as messages_chat_body
from trl_plugins.rollout.endpoint.responses import chat_body, response_body, response_stream
from trl_plugins.rollout.endpoint.runs import (
    COMMAND_AGENTS_PER_CORE,
    NOTHING_ASKED,
    AgentFailed,
    AgentLoop,
    let_go,
    run_command,
    usable_cores,
)
from trl_plugins.rollout.endpoint.session import Session
from trl_plugins.rollout.endpoint.streams import chat_stream
from trl_plugins.rollout.endpoint.tools import end_tool_episode, serve_tools
from trl_plugins.rollout.engine import critical_path
from trl_plugins.rollout.request import RolloutCancelled, RolloutError, RolloutRequest, RolloutResult
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.tools.sandbox.launcher import CommandNotFound, find_command
from trl_plugins.types import PolicyVersion, RewardComponent, StopReason, TokenSource, Trajectory, Turn

__all__ = ["AgentEndpointRollout", "AGENT_REWARD", "ROW_REWARD", "record_rewards"]

logger = logging.getLogger(__name__)


_LOADING = threading.Lock()


_UNFORCED_LOGGED: set[str] = set()


def count_unforced(result: RolloutResult, kind: str, key: str = "endpoint/tool_choice_unforced") -> None:
    """Count a ``tool_choice`` (or Responses ``text.format``) served unforced under ``key``; log the first of each
    kind."""
    result.counters[key] = result.counters.get(key, 0.0) + 1.0
    if kind not in _UNFORCED_LOGGED:
        _UNFORCED_LOGGED.add(kind)
        logger.warning(
            "an agent sent tool_choice (or text.format) %r; it is served as 'auto' (the model chooses: forcing "
            "it would constrain sampling or render the turn without tools). Counted as %s; set "
            "refuse_unforced_tool_choice: true to refuse it instead.",
            kind,
            key,
        )


def _load(spec: str) -> Callable[..., Any]:
    """The agent ``spec`` names: ``'package.module:function'``, or ``'path/to/file.py:function'`` (relative to the
    working directory)."""
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise RolloutError(f"agent={spec!r}: name it as 'package.module:function' or 'path/to/file.py:function'.")
    try:
        if module.endswith(".py"):
            path = os.path.abspath(module)
            name = "trl_plugins_agent_" + hashlib.sha256(path.encode()).hexdigest()[:12]
            with _LOADING:  # rollouts on several threads (an asynchronous run's replica) must not see it half-run
                obj: Any = sys.modules.get(name)
                if obj is None:
                    if not os.path.isfile(path):
                        raise ImportError(f"no file {path}")
                    loader = importlib.util.spec_from_file_location(name, path)
                    obj = importlib.util.module_from_spec(loader)
                    sys.modules[name] = obj  # while it runs too (a dataclass in it looks its module up)
                    try:
                        loader.loader.exec_module(obj)
                    except BaseException:
                        del sys.modules[name]
                        raise
        else:
            obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RolloutError(
            f"agent={spec!r} cannot be imported: {type(exc).__name__}: {exc}. Name an importable "
            f"'package.module:function' (its folder on PYTHONPATH)."
        ) from exc
    if not callable(obj):
        raise RolloutError(f"agent={spec!r} is a {type(obj).__name__}, not a function agent(client, row).")
    return obj


@ROLLOUTS.register("agent_endpoint")
@dataclass
class AgentEndpointRollout(TrajectoryBudgets):
    """Each trajectory is one run of an agent against an OpenAI-compatible endpoint on ``127.0.0.1``.

    The agent is ``agent`` (``'package.module:function'``: ``async def f(client, row)`` gets an ``openai.AsyncOpenAI``
    client, a plain ``def f(client, row)`` an ``openai.OpenAI`` one and runs on a worker thread) or ``command`` (run
    with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``TRL_PLUGINS_ROW`` set, the row as JSON on stdin; the last line
    of its stdout, JSON, is its return value). Every trajectory has its own session in the endpoint's address and the
    run's token is the API key; a request without it, or for no live trajectory, is refused. The budgets are the
    built-in rollout's, applied to the agent's turns. Stop reasons: as the built-in rollout for what the model did
    (an invalid action, a budget); ``final_answer``/``no_tool_call`` from the last turn when the agent returns;
    ``environment_error`` when the agent raises, exits non-zero, returns something else than None, a number or a
    mapping of numbers, runs past ``agent_time_limit_s``, or a request waits past ``request_time_limit_s``, unless the
    trajectory had already ended because of the model's output (then that stop reason stands).
    """

    agent: str | Callable[..., Any] | None = None
    """``'package.module:function'`` or ``'path/to/file.py:function'`` (or the function itself):
    ``[async] def agent(client, row) -> reward``."""
    command: str | list | None = None
    """A command (a list of arguments, or one string split as a shell would) run per trajectory instead; a bare name
    is looked up on ``PATH``, then in the interpreter's scripts folder, at start-up, and replaced by the path found."""
    agent_time_limit_s: float | None = 600.0
    """Wall time one agent run may take; past it the trajectory ends as ``environment_error``."""
    request_time_limit_s: float | None = 300.0
    """Wall time one request may wait for its reply (queueing and generation)."""
    max_concurrent_agents: int | None = None
    """Agents running at once. None: every trajectory of the rollout for ``agent``; for ``command``,
    :data:`COMMAND_AGENTS_PER_CORE` per usable core (a process per trajectory starts an interpreter and imports its
    framework, seconds of CPU each: 64 started at once on 2 cores ran into their limit). Each agent's time limit counts
    from its own start, not from the rollout's."""
    client: str | None = None
    """The client a function ``agent`` is given: ``'openai'`` (``openai.AsyncOpenAI``, or ``openai.OpenAI`` for a
    plain function; None's meaning) or ``'anthropic'`` (``anthropic.AsyncAnthropic`` / ``anthropic.Anthropic``, whose
    requests go to ``/v1/messages``). A ``command`` is given no client, so setting one beside it is refused: it gets
    both clients' variables (``OPENAI_*`` and ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``)."""
    refuse_unforced_tool_choice: bool = False
    """Refuse (400) a ``tool_choice`` of ``none``, ``required`` or a named function instead of serving it as
    ``auto`` (the model chooses; counted as ``endpoint/tool_choice_unforced``, logged once). docs/agents.md."""
    restore_dropped_reasoning: bool = False
    """An earlier reply sent back without its reasoning, where the chat template would render that reasoning
    (Qwen3-style
    templates keep it after the last user message), continues the segment with the reasoning restored from the record
    (counted ``endpoint/reasoning_restored``), instead of a rewrite (a new segment: what the model sees when the
    framework serves it; counted ``endpoint/reasoning_dropped_rewrites``). Training then sees reasoning the deployed
    framework drops. Where the template drops it anyway, the segment continues either way. docs/agents.md."""
    agent_conversation: ClassVar[bool] = True
    """Capability: the agent writes the conversation (its system prompt and tools), not the run."""
    offers_tools: ClassVar[bool] = True
    """Capability: the run's ``tools`` are offered to the agent (``GET <base_url>/tools``, ``POST
    <base_url>/tools/call``)."""
    _token: str = field(default_factory=lambda: secrets.token_urlsafe(32), init=False, repr=False, compare=False)
    _failures_seen: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.agent is None) == (self.command is None):
            raise RolloutError("agent_endpoint needs exactly one of agent ('package.module:function') and command.")
        if self.command is not None and self.client is not None:
            raise RolloutError(
                f"agent_endpoint: client={self.client!r} is the client a function agent is handed, and this agent is a "
                f"command, which gets both clients' variables (OPENAI_BASE_URL, ANTHROPIC_BASE_URL, ...): drop client."
            )
        if self.agent is not None and self.client is None:
            self.client = "openai"
        if self.client not in (None, "openai", "anthropic"):
            raise RolloutError(f"agent_endpoint: client={self.client!r}; use 'openai' or 'anthropic'.")
        if self.agent is not None and importlib.util.find_spec(self.client) is None:
            raise RolloutError(
                f"agent_endpoint hands function agents an {self.client} SDK client (client={self.client!r}), and "
                f"{self.client} is not installed: pip install 'trl-plugins[agents]' (or run the agent as a command)."
            )
        if isinstance(self.agent, str):
            _load(self.agent)  # now, at start-up: a typo must not wait for the first rollout
        if isinstance(self.command, str):
            self.command = shlex.split(self.command)
        if self.command is not None and (not self.command or not all(isinstance(a, str) for a in self.command)):
            raise RolloutError(f"command={self.command!r}: give a non-empty list of strings (or one string).")
        if self.command is not None:  # found now, at start-up; the path found is what runs and what describe() shows
            try:
                self.command = [find_command(self.command[0]), *self.command[1:]]
            except CommandNotFound as exc:
                raise RolloutError(f"agent_endpoint's {exc}") from None
        for name in ("agent_time_limit_s", "request_time_limit_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise RolloutError(f"{name} must be > 0 seconds (or null for none), got {value}.")
        if self.max_concurrent_agents is not None and self.max_concurrent_agents < 1:
            raise RolloutError(f"max_concurrent_agents must be >= 1 (or null), got {self.max_concurrent_agents}.")

    def concurrency(self, trajectories: int) -> int:
        """Agents running at once in a rollout of ``trajectories``."""
        if self.max_concurrent_agents is not None:
            return self.max_concurrent_agents
        if self.command is not None:
            return max(1, min(trajectories, COMMAND_AGENTS_PER_CORE * usable_cores()))
        return max(1, trajectories)

    def describe(self) -> str:
        """The start-up line: how many agents run at once and how long each may take."""
        kind = f"command {shlex.join(self.command)!r}" if self.command is not None else f"agent {self.agent!r}"
        if self.max_concurrent_agents is not None:
            at_once = f"at most {self.max_concurrent_agents} at once (max_concurrent_agents)"
        elif self.command is not None:
            cores = usable_cores()
            at_once = (
                f"at most {COMMAND_AGENTS_PER_CORE * cores} at once ({COMMAND_AGENTS_PER_CORE} per usable core x "
                f"{cores}; max_concurrent_agents sets it)"
            )
        else:
            at_once = "every trajectory of a rollout at once (max_concurrent_agents limits it)"
        limit = (
            "no time limit" if self.agent_time_limit_s is None else f"agent_time_limit_s={self.agent_time_limit_s:g}"
        )
        return f"{kind}: {at_once}; each within {limit} from its own start"

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        """Run the agent ``group_size`` times per question.

        Raises:
            RolloutError: a bad request, or a backend that generates in lock-step across ranks.
            RolloutCancelled: ``request.stop`` was set; ``rollout_result`` holds what was done.
        """
        if request.group_size < 1:
            raise RolloutError(f"group_size must be >= 1, got {request.group_size}.")
        if request.backend.requires_lockstep:
            raise RolloutError(
                f"{type(request.backend).__name__} generates in lock-step across ranks (a collective per "
                f"call), which agents running on their own cannot follow."
            )
        chat, backend = request.chat, request.backend
        self.check_chat(chat)
        version = PolicyVersion(
            step=request.policy_step,
            tokenizer_digest=chat.digest,
            sampling=backend.sampling,
            logprob_source=backend.logprob_source,
        )
        result = RolloutResult(trajectories=[])
        for q in request.questions:
            for slot in range(request.group_size):
                result.trajectories.append(
                    Trajectory(
                        turns=[],
                        question_id=q.question_id,
                        group_id=q.group_id,
                        sample_index=slot,
                        policy_version=version,
                    )
                )
        start = time.perf_counter()
        try:
            with backend.session():
                run_async(self._run(request, result))
        except BaseException as exc:
            for traj in result.trajectories:
                if traj.stop_reason is None:
                    traj.stop_reason = StopReason.CANCELLED
                    traj.error = f"the rollout was interrupted: {type(exc).__name__}"
            _close_turnless(request, result)
            try:
                exc.rollout_result = result  # type: ignore[attr-defined]
            except AttributeError:
                pass
            raise
        result.total_s = time.perf_counter() - start
        result.critical_path_s = max((critical_path(t) for t in result.trajectories), default=0.0)
        _close_turnless(request, result)
        for traj in result.trajectories:
            validate_trajectory(traj)
        return result

    async def _run(self, request: RolloutRequest, result: RolloutResult) -> None:
        loop = asyncio.get_running_loop()
        sessions: dict[str, Session] = {}
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency(request.backend), thread_name_prefix="generate"
        )
        at_once = self.concurrency(len(result.trajectories))
        agent_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_concurrent_agents or min(64, at_once), thread_name_prefix="agent"
        )
        dispatcher = Dispatcher(request.backend, loop, pool, result)
        server = JsonServer(lambda incoming: self._serve(incoming, sessions, request, result))
        await server.start()
        http = _HttpClients(connections=len(result.trajectories))
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(result.trajectories), desc="agents", unit="traj", disable=not request.progress, leave=False
        )
        limit = asyncio.Semaphore(at_once)

        def chat_for(tools: list[dict]) -> ChatFormat:
            try:
                return request.chat.for_tools(tools)
            except Exception as exc:
                raise HttpError(
                    400, f"the chat template cannot take these tools: {type(exc).__name__}: {exc}", param="tools"
                ) from exc

        fn = _load(self.agent) if isinstance(self.agent, str) else self.agent  # once per rollout (None: a command)
        agent_loop = AgentLoop() if fn is not None and inspect.iscoroutinefunction(fn) else None
        group = request.group_size
        tasks = []
        for index, traj in enumerate(result.trajectories):
            q = request.questions[index // group]
            key = secrets.token_urlsafe(16)
            session = Session(
                key,
                index,
                traj,
                self,
                self.request_time_limit_s,
                chat_for,
                dispatcher.generate,
                request.seed,
                request.policy_step,
                restore_dropped_reasoning=self.restore_dropped_reasoning,
                counters=result.counters,
            )
            sessions[key] = session
            base_url = f"http://127.0.0.1:{server.port}/s/{key}/v1"
            task = asyncio.ensure_future(
                self._one(
                    fn,
                    session,
                    dict(q.row or {}),
                    base_url,
                    sessions,
                    limit,
                    agent_pool,
                    agent_loop,
                    http,
                    request.tools,
                )
            )
            task.add_done_callback(lambda _, traj=session.traj: self._finished(request, traj, bar))
            tasks.append(task)
        stopped = False
        try:
            stopped = await settle(tasks, request.stop)
        finally:
            if agent_loop is not None:
                await agent_loop.close(http.close_async)
            http.close_sync()
            await server.close()
            await dispatcher.drain()
            bar.close()
            pool.shutdown(wait=True)
            agent_pool.shutdown(wait=False, cancel_futures=True)
        if dispatcher.fatal is not None:
            raise dispatcher.fatal
        unfinished = sum(t.stop_reason in (None, StopReason.CANCELLED) for t in result.trajectories)
        if stopped and unfinished:
            raise RolloutCancelled(f"a stop was requested with {unfinished} agent run(s) unfinished")

    async def _serve(
        self, http: HttpRequest, sessions: Mapping[str, Session], request: RolloutRequest, result: RolloutResult
    ) -> tuple[int, Any]:
        parts = http.path.split("?", 1)[0].split("/")
        if "/".join(parts[4:5]) == "messages":  # Anthropic's dialect: its errors in its shape
            try:
                return await self._serve_route(http, parts, sessions, request, result)
            except HttpError as exc:
                raise AnthropicError.of(exc) from None
        return await self._serve_route(http, parts, sessions, request, result)

    async def _serve_route(
        self,
        http: HttpRequest,
        parts: list[str],
        sessions: Mapping[str, Session],
        request: RolloutRequest,
        result: RolloutResult,
    ) -> tuple[int, Any]:
        # The run's token, as OpenAI's clients send it or as Anthropic's do.
        given = http.headers.get("authorization", "") or f"Bearer {http.headers.get('x-api-key', '')}"
        if not hmac.compare_digest(given.encode(), f"Bearer {self._token}".encode()):
            raise HttpError(
                401,
                "missing or wrong API key: use the key this run gave the agent (OPENAI_API_KEY, or ANTHROPIC_API_KEY, "
                "for a command).",
                kind="authentication_error",
                code="invalid_api_key",
            )
        if len(parts) < 4 or parts[1] != "s" or parts[3] != "v1":
            raise HttpError(
                404,
                f"no such endpoint {http.path!r}: use the base URL the run gave the agent "
                f"(http://127.0.0.1:<port>/s/<session>/v1).",
                code="not_found",
            )
        session = sessions.get(parts[2])
        if session is None:
            raise HttpError(
                404,
                "no live trajectory has this session key (it finished, or never existed): each agent "
                "run uses the base URL it was given, while it runs.",
                code="unknown_session",
            )
        route = "/".join(parts[4:])
        if http.method == "GET" and route == "models":
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "trl-plugins"}]}
        if route == "tools" or route.startswith("tools/"):
            return 200, await serve_tools(
                http.method, route, http.json() if http.method == "POST" else None, session, request.tools
            )
        if http.method != "POST" or route not in ("chat/completions", "responses", "messages", "messages/count_tokens"):
            raise HttpError(
                404,
                f"{http.method} /{route} is not served; the endpoint serves POST /chat/completions, "
                f"POST /responses, POST /messages (and /messages/count_tokens), GET /models and the run's tools "
                f"(GET /tools, POST /tools/call).",
                code="not_found",
            )
        if route.startswith("messages"):
            return await self._messages(http, route, session, request, result)
        raw, echo = (http.json(), None) if route == "chat/completions" else chat_body(http.json())
        body = check_request(
            raw,
            sampling=request.backend.sampling,
            max_assistant_tokens=self.max_assistant_tokens,
            calls_per_turn=self.max_tool_calls_per_turn,
            refuse_unforced_tool_choice=self.refuse_unforced_tool_choice,
        )
        if echo is not None:
            self._responses_history(session, body, echo, result)
        if body.tool_choice_unforced is not None:
            count_unforced(result, body.tool_choice_unforced)
        reply = await session.complete(body)
        if echo is None:
            return 200, chat_stream(reply, include_usage=body.include_usage) if body.stream else reply
        response = response_body(
            reply,
            echo,
            response_id=f"resp_{session.index}_{len(session.traj.turns)}",
            model=body.model,
            sampling=request.backend.sampling,
        )
        session.response_id = response["id"]
        return 200, response_stream(response) if body.stream else response

    async def _messages(
        self, http: HttpRequest, route: str, session: Session, request: RolloutRequest, result: RolloutResult
    ) -> tuple[int, Any]:
        """Anthropic's Messages API (:mod:`~trl_plugins.rollout.endpoint.messages`): the same checks and session as
        chat completions, a prompt past the budget answered ``prompt is too long``; ``count_tokens`` renders the
        prompt the policy would be given and samples nothing."""
        counting = route == "messages/count_tokens"
        raw = messages_chat_body(http.json(), max_assistant_tokens=self.max_assistant_tokens, counting=counting)
        body = check_request(
            raw,
            sampling=request.backend.sampling,
            max_assistant_tokens=self.max_assistant_tokens,
            calls_per_turn=self.max_tool_calls_per_turn,
            refuse_unforced_tool_choice=self.refuse_unforced_tool_choice,
        )
        if counting:
            chat = session.chat_for(body.tools)
            prompt = await asyncio.to_thread(chat.initial_prompt_ids, template_messages(body.messages))
            return 200, {"input_tokens": len(prompt)}
        body.prompt_too_long = True
        if body.tool_choice_unforced is not None:
            count_unforced(result, body.tool_choice_unforced)
        reply = await session.complete(body)
        message = message_body(reply, model=body.model, stop_sequence=session.stop_sequence)
        return 200, message_stream(message) if body.stream else message

    def _responses_history(self, session: Session, body: Any, echo: dict, result: RolloutResult) -> None:
        """``previous_response_id``: the conversation is the session's record (its last request and reply), then the
        new input; ``text.format`` other than text: served unforced (or refused, as ``tool_choice``)."""
        if echo["format_unforced"] and self.refuse_unforced_tool_choice:
            raise HttpError(
                400,
                f"text.format {echo['text']['format'].get('type')!r} is not honoured "
                f"(refuse_unforced_tool_choice is set): forcing a JSON output would constrain sampling, "
                f"so the behaviour log-probs would not be the policy's. Omit text.format.",
                param="text",
            )
        if echo["format_unforced"]:
            count_unforced(result, "text.format", key="endpoint/text_format_unforced")
        prev = echo["previous_response_id"]
        if prev is None:
            return
        if prev != session.response_id or session.messages is None or session.reply is None:
            raise HttpError(
                400,
                f"previous_response_id={prev!r} is not this session's last response "
                f"({session.response_id!r}): only the last one is kept. Send the whole conversation as "
                f"input (with store=false) instead.",
                param="previous_response_id",
            )
        prior = [*session.messages, session.reply]
        new = body.messages
        if echo["instructions"]:
            system, new = new[0], new[1:]
            prior = [system, *prior[1:]] if prior[0]["role"] == "system" else [system, *prior]
        body.messages = prior + new

    @staticmethod
    def _finished(request: RolloutRequest, traj: Any, bar: Any) -> None:
        """An agent's run ended (its trajectory's stop reason set): the bar, and the request's ``on_finished`` (the
        run's judges start on it while the other agents still run)."""
        bar.update(1)
        if request.on_finished is not None:
            request.on_finished(traj)

    async def _one(
        self,
        fn: Callable[..., Any] | None,
        session: Session,
        row: dict,
        base_url: str,
        sessions: dict[str, Session],
        limit: asyncio.Semaphore,
        agent_pool: concurrent.futures.Executor,
        agent_loop: AgentLoop | None,
        http: _HttpClients,
        tools: Mapping[str, Any],
    ) -> None:
        async with limit:
            run, cancel = self._invoke(fn, row, base_url, agent_pool, agent_loop, http)
            try:
                try:
                    await asyncio.wait({run}, timeout=self.agent_time_limit_s)
                except asyncio.CancelledError:  # a stop: the agent goes, as at its limit
                    session.end(StopReason.CANCELLED, "the rollout was stopped while the agent ran")
                    sessions.pop(session.key, None)
                    await let_go(run, cancel)
                    raise
                if not run.done():
                    # Its trajectory ends first, so that whatever it asks or returns from now on counts for nothing;
                    # it is not waited for past the grace (an agent may catch its cancellation and run on).
                    session.end(
                        StopReason.ENVIRONMENT_ERROR, f"the agent ran past agent_time_limit_s={self.agent_time_limit_s}"
                    )
                    sessions.pop(session.key, None)
                    await let_go(run, cancel)
                    return
                if run.cancelled():  # by the agent's own code: a failure of its own
                    raise AgentFailed("the agent's run was cancelled by the agent itself")
                value = run.result()
            except Exception as exc:  # noqa: BLE001 - the agent's failure ends its trajectory, not the rollout
                session.end(StopReason.ENVIRONMENT_ERROR, f"the agent failed: {type(exc).__name__}: {exc}"[:2000])
                kind = type(exc).__name__
                if kind not in self._failures_seen:  # the first of each kind with its traceback, the rest counted
                    self._failures_seen.add(kind)
                    logger.warning(
                        "an agent failed (its trajectory ends as environment_error; later %s failures are "
                        "logged at debug level): %s",
                        kind,
                        exc,
                        exc_info=exc,
                    )
                else:
                    logger.debug("an agent failed: %s: %s", kind, exc)
            else:
                problem = record_rewards(session.traj, value, row)
                if problem is not None:
                    session.end(StopReason.ENVIRONMENT_ERROR, problem)
                elif not session.traj.turns:
                    session.end(StopReason.ENVIRONMENT_ERROR, NOTHING_ASKED)
                else:
                    final = session.last_kind == TurnKind.FINAL_ANSWER and not session.traj.turns[-1].tool_calls
                    session.end(StopReason.FINAL_ANSWER if final else StopReason.NO_TOOL_CALL)
            finally:
                sessions.pop(session.key, None)
                if session.traj.stop_reason is None:
                    session.end(StopReason.CANCELLED, "the rollout was stopped while the agent ran")
                await end_tool_episode(session, tools)  # its per-trajectory tool servers stop with it

    def _invoke(
        self,
        fn: Callable[..., Any] | None,
        row: dict,
        base_url: str,
        agent_pool: concurrent.futures.Executor,
        agent_loop: AgentLoop | None,
        http: _HttpClients,
    ) -> tuple[asyncio.Future, Callable[[], None]]:
        """Start the agent: a future (of this loop) that ends when the agent does, and a function that cancels it (a
        command's processes are killed; an ``async def`` agent gets CancelledError; a thread cannot be stopped)."""
        if fn is None:
            # The OpenAI Agents SDK sends traces to its vendor's servers by default: not from a training run's agents
            # (set the variable to 0 in the trainer's environment to keep them).
            env = {
                "OPENAI_AGENTS_DISABLE_TRACING": "1",
                **os.environ,
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": self._token,
                # Anthropic's clients (the SDK, the Claude Agent SDK, Claude Code) post to <base>/v1/messages.
                "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
                "ANTHROPIC_API_KEY": self._token,
                "TRL_PLUGINS_ROW": json.dumps(row, default=str),
            }
            task = asyncio.ensure_future(run_command(self.command, row, env))
            return task, task.cancel
        timeout = None if self.request_time_limit_s is None else self.request_time_limit_s + 30.0
        if self.client == "anthropic":
            import anthropic

            settings = dict(base_url=base_url.removesuffix("/v1"), api_key=self._token, max_retries=0, timeout=timeout)
            if agent_loop is not None:

                async def run_anthropic() -> Any:  # on the agents' loop, where its client's connections live
                    async with anthropic.AsyncAnthropic(**settings) as client:
                        return await fn(client, row)

                return agent_loop.start(run_anthropic())

            def run_blocking() -> Any:
                with anthropic.Anthropic(**settings) as client:
                    return fn(client, row)

            future = asyncio.get_running_loop().run_in_executor(agent_pool, run_blocking)
            return future, future.cancel
        import openai

        settings = dict(base_url=base_url, api_key=self._token, max_retries=0, timeout=timeout)
        if agent_loop is not None:

            async def run() -> Any:  # on the agents' loop, where its client's connections live
                return await fn(openai.AsyncOpenAI(**settings, http_client=http.shared(asynchronous=True)), row)

            return agent_loop.start(run())
        client = openai.OpenAI(**settings, http_client=http.shared(asynchronous=False))
        future = asyncio.get_running_loop().run_in_executor(agent_pool, fn, client, row)
        return future, future.cancel


class _HttpClients:
    """One HTTP connection pool per rollout that every agent's client shares (a client of its own costs ~27 ms of
    CPU, mostly its TLS context, per trajectory), made when the first agent needs it."""

    def __init__(self, connections: int) -> None:
        self.connections = max(connections, 1)
        self.clients: dict[bool, Any] = {}

    def shared(self, *, asynchronous: bool) -> Any:
        if asynchronous not in self.clients:
            import openai

            limits = openai.DEFAULT_CONNECTION_LIMITS.__class__(
                max_connections=self.connections + 8, max_keepalive_connections=self.connections + 8
            )
            kind = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
            self.clients[asynchronous] = kind(limits=limits)
        return self.clients[asynchronous]

    def close_sync(self) -> None:
        """Close the blocking pool (the plain agents'); the async one is closed on the agents' loop."""
        client = self.clients.pop(False, None)
        if client is not None:
            client.close()

    async def close_async(self) -> None:
        client = self.clients.pop(True, None)
        if client is not None:
            await client.aclose()


def record_rewards(traj: Trajectory, value: Any, row: Mapping[str, Any]) -> str | None:
    """The agent's return value and the row's ``reward`` as reward components of weight 0 (``agent_return``,
    ``agent_return/<key>`` for the other keys of a returned mapping, ``row_reward``): recorded, counted only when a
    configured component reads them (``agent_reward``). Returns what is wrong with ``value`` (None: nothing)."""
    components = []
    items = {"reward": value} if not isinstance(value, Mapping) else dict(value)
    for key, number in items.items():
        if number is None and not isinstance(value, Mapping):
            continue
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            return (
                f"the agent returned {value!r:.200}; an agent returns None, a finite number (its reward) or a mapping "
                f"of names to finite numbers ('reward', and other components to record)"
            )
        components.append(
            RewardComponent(AGENT_REWARD if key == "reward" else f"{AGENT_REWARD}/{key}", float(number), 0.0)
        )
    reward = row.get("reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward):
        components.append(RewardComponent(ROW_REWARD, float(reward), 0.0))
    traj.reward_components = components
    return None


def _close_turnless(request: RolloutRequest, result: RolloutResult) -> None:
    """A trajectory whose agent failed before its first request still records its question: one turn holding the
    question's prompt and nothing sampled (the contract needs a turn; a world failure trains nothing)."""
    group = request.group_size
    for index, traj in enumerate(result.trajectories):
        if not traj.turns:
            prompt = list(request.questions[index // group].prompt_ids)
            traj.turns.append(
                Turn(
                    prompt_ids=prompt,
                    completion_ids=[],
                    completion_logprobs=[],
                    prompt_sources=[TokenSource.PROMPT] * len(prompt),
                )
            )
            if traj.stop_reason is None or not traj.stop_reason.is_world_failure:
                traj.stop_reason, traj.error = (
                    StopReason.ENVIRONMENT_ERROR,
                    traj.error or "the agent asked the model nothing",
                )
