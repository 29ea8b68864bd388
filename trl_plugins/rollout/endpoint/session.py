"""One trajectory behind the agent endpoint: each chat-completions request of its session is matched against the
tokens recorded so far, served by the rollout's dispatcher, and recorded as a turn.

Matching is by our own replies, not by re-tokenised text. A request whose messages are the previous request's
messages, then the reply we gave (its tool-call ids, names and arguments as values, its content), then new messages
(tool results, user or system messages) *extends* the trajectory: the new turn's prompt is the previous prompt, the
sampled completion, and the template's rendering of the new messages (:meth:`~trl_plugins.rollout.chat.ChatFormat.
messages_turn`): exactly what the built-in rollout appends. Anything else (an edited, dropped or reordered message,
a stripped thinking block, other tools) is a *rewrite*: the conversation is rendered afresh, as context, and the turn
starts a new segment (``Turn.segment_start``), trained as a datum of its own. Tokens the policy did not sample are
never trained: a re-rendered earlier reply is context.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from trl_plugins.rollout.budgets import TrajectoryBudgets
from trl_plugins.rollout.chat import ChatFormat, TurnKind
from trl_plugins.rollout.endpoint.api import ChatRequest, completion_body, template_messages
from trl_plugins.rollout.endpoint.http import HttpError
from trl_plugins.rollout.backends import Sample
from trl_plugins.rollout.request import derive_seed
from trl_plugins.rollout.stops import StopStrings
from trl_plugins.types import StopReason, TokenSource, ToolCall, Trajectory, Turn

__all__ = ["Session"]

logger = logging.getLogger(__name__)


@dataclass
class Session:
    """The state of one trajectory's conversation."""

    key: str
    index: int
    """The trajectory's place in the rollout (its sampling seeds derive from it, as in the built-in rollout)."""
    traj: Trajectory
    budgets: TrajectoryBudgets
    """The rollout's budgets, applied as the built-in rollout applies them."""
    request_time_limit_s: float | None
    chat_for: Callable[[list[dict]], ChatFormat]
    """The chat format for a request's tools."""
    generate: Callable[..., Any]
    """The dispatcher's ``generate(prompt, budget, seed, stop)``."""
    seed: int
    policy_step: int
    messages: list[dict] | None = None
    """The last request's messages (normalised)."""
    tools: list[dict] | None = None
    reply: dict | None = None
    """Our last reply, normalised as the agent sends it back."""
    tokens: list[int] = field(default_factory=list)
    """The last turn's prompt and completion."""
    tool_calls: int = 0
    last_kind: TurnKind | None = None
    replied_at: float = 0.0
    response_id: str | None = None
    """The id of the last Responses-API reply (what ``previous_response_id`` may name)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    episode: object = field(default_factory=object)
    """The trajectory's episode key for the run's tools it calls (``tools/call``; ``current_episode``)."""
    episode_used: bool = False
    """Whether it called one (its tools' ``end_episode`` runs when the agent's run ends)."""
    tool_ok: dict[str, bool] = field(default_factory=dict)
    """``ok`` of the run's tools' answers by the ``tool_call_id`` the agent named, recorded with the outputs."""

    @property
    def ended(self) -> bool:
        return self.traj.stop_reason is not None

    def end(self, reason: StopReason, error: str | None = None) -> None:
        if self.traj.stop_reason is None:
            self.traj.stop_reason = reason
            if error is not None:
                self.traj.error = error

    async def complete(self, request: ChatRequest) -> dict[str, Any]:
        """Serve one request: the response body, or :class:`HttpError` (the trajectory ended, budgets, a timeout)."""
        if self.lock.locked():
            raise HttpError(400, "another request of this session is still being served: a trajectory is one "
                                 "conversation, one request at a time (start parallel conversations as separate "
                                 "trajectories).", code="concurrent_request")
        async with self.lock:
            return await self._complete(request)

    def _refuse_ended(self) -> HttpError:
        reason = self.traj.stop_reason
        why = f": {self.traj.error}" if self.traj.error else ""
        return HttpError(400, f"this trajectory has ended ({reason.value if reason else 'unknown'}{why}); the "
                              f"conversation cannot go on. Return from the agent.", code="trajectory_ended")

    async def _complete(self, request: ChatRequest) -> dict[str, Any]:
        self._record_tool_outputs(request.messages)  # also when it ended at that turn: what the tools returned
        if self.ended:
            raise self._refuse_ended()
        chat = self.chat_for(request.tools)
        turns, b = self.traj.turns, self.budgets
        new = self._extension(request)
        if new is not None:
            last = turns[-1]
            called = [c["name"] for c in (self.reply or {}).get("tool_calls", [])]
            try:  # off the loop, which every agent shares: cutting a long output takes a while
                cont = await asyncio.to_thread(chat.messages_turn, last.completion_ids, called, template_messages(
                    self.messages + [self.reply] + new)[-len(new):], max_tokens=b.max_tool_response_tokens)
            except Exception as exc:  # output the template or tokenizer cannot take: the world's failure
                self.end(StopReason.ENVIRONMENT_ERROR, f"the messages after turn {len(turns) - 1} could not be rendered "
                                                       f"and tokenised: {type(exc).__name__}: {exc}")
                raise HttpError(400, str(self.traj.error), code="unrenderable_messages") from exc
            for call, cut in zip(last.tool_calls, cont.truncated_outputs):
                call.output_truncated = cut
            prompt, sources, segment_start = self.tokens + cont.ids, list(cont.sources), False
        else:
            try:
                prompt = await asyncio.to_thread(chat.initial_prompt_ids, template_messages(request.messages))
            except Exception as exc:
                raise HttpError(400, f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
                                param="messages") from exc
            sources, segment_start = [TokenSource.PROMPT] * len(prompt), bool(turns)
        if self.ended:  # ended while its tokens were built (the agent's time limit, a stop request)
            raise self._refuse_ended()
        if len(turns) >= b.max_turns:
            self.end(StopReason.MAX_TURNS)
            raise self._refuse_ended()
        if len(prompt) >= b.max_trajectory_tokens:
            if not turns:
                self.end(StopReason.ENVIRONMENT_ERROR, f"the agent's first request renders {len(prompt)} tokens, which "
                                                       f"leaves no room in max_trajectory_tokens={b.max_trajectory_tokens}")
            self.end(StopReason.TOKEN_BUDGET)
            raise self._refuse_ended()
        room = b.max_trajectory_tokens - len(prompt)
        cap = min(b.max_assistant_tokens, request.max_tokens or b.max_assistant_tokens)
        budget = min(cap, room)
        seed = derive_seed(self.seed, self.index, len(turns))
        tok = chat.tokenizer
        decode = functools.partial(tok.decode, skip_special_tokens=True)
        stops = StopStrings(request.stop, decode) if request.stop else None
        try:
            sample, gen_s, queue_s = await asyncio.wait_for(self.generate(prompt, budget, seed, stops),
                                                            self.request_time_limit_s)
        except asyncio.TimeoutError:
            self.end(StopReason.ENVIRONMENT_ERROR, f"the model did not answer within request_time_limit_s="
                                                   f"{self.request_time_limit_s}")
            raise HttpError(504, str(self.traj.error), code="timeout", kind="server_error") from None
        if self.ended:  # ended while it waited (the agent's time limit, a stop request)
            raise self._refuse_ended()
        plain = decode(sample.token_ids)
        stopped = stops.cut(sample.token_ids, plain) if stops else None
        if stopped is not None:  # what the backend sampled past the stop is not the turn's (none, where it ended there)
            k, at = stopped
            sample = Sample(sample.token_ids[:k + 1], sample.logprobs[:k + 1], finished=True, policy_step=sample.policy_step)
            plain = decode(sample.token_ids)[:at]
        turn = Turn(prompt_ids=prompt, completion_ids=sample.token_ids, completion_logprobs=sample.logprobs,
                    text=tok.decode(sample.token_ids, skip_special_tokens=False), prompt_sources=sources,
                    truncated=not sample.finished, generation_s=gen_s, queue_s=queue_s,
                    policy_step=self.policy_step if sample.policy_step is None else sample.policy_step,
                    segment_start=segment_start)
        turns.append(turn)
        self.messages, self.tools, self.tokens = request.messages, request.tools, prompt + sample.token_ids
        calls: list[dict] = []
        reasoning = ""
        if not sample.finished:
            self.end(StopReason.TURN_LENGTH if budget == cap else StopReason.TOKEN_BUDGET)
            content, finish = plain, "length"
        else:
            content, finish, calls, reasoning = self._read_turn(chat, turn, plain)
            if stopped is not None and not calls:  # the text before the stop, as the OpenAI API returns it
                at = stops.first(content)
                content = content[:at] if at >= 0 else content
        self.reply = {"role": "assistant", "content": content or "", **({"tool_calls": calls} if calls else {}),
                      **({"reasoning_content": reasoning} if reasoning else {})}
        self.replied_at = time.perf_counter()
        return completion_body(completion_id=f"chatcmpl-{self.index}-{len(turns)}", model=request.model,
                               content=content if content or not calls else None, calls=calls, finish_reason=finish,
                               prompt_tokens=len(prompt), completion_tokens=len(sample.token_ids), reasoning=reasoning)

    def _read_turn(self, chat: ChatFormat, turn: Turn, plain: str) -> tuple[str, str, list[dict], str]:
        """Parse a finished turn as the built-in rollout does: ``(content, finish_reason, calls, reasoning)``; an invalid action
        or a budget spent ends the trajectory (the reply still goes back to the agent)."""
        b = self.budgets
        try:
            parsed = chat.parse(turn.prompt_ids, turn.completion_ids)
        except Exception as exc:  # a parser bug on odd model output must not take the rollout down
            logger.exception("parsing a sampled turn raised; the trajectory ends as invalid_action")
            self.end(StopReason.INVALID_ACTION, f"the turn could not be parsed: {type(exc).__name__}: {exc}")
            return plain, "stop", [], ""
        self.last_kind = parsed.kind
        if parsed.kind in (TurnKind.FINAL_ANSWER, TurnKind.NO_TOOL_CALL):
            return parsed.content, "stop", [], parsed.reasoning
        if parsed.kind != TurnKind.TOOL_CALL:
            self.end(StopReason.INVALID_ACTION, parsed.error or "the turn is neither a tool call nor an answer")
            return plain, "stop", [], ""
        if len(parsed.calls) > b.max_tool_calls_per_turn:
            self.end(StopReason.INVALID_ACTION, f"the turn makes {len(parsed.calls)} tool calls, over "
                                                f"max_tool_calls_per_turn={b.max_tool_calls_per_turn}")
            return plain, "stop", [], ""
        k = len(self.traj.turns) - 1
        calls = [{"id": f"call_{k}_{j}", "name": c.name, "arguments": c.arguments}
                 for j, c in enumerate(parsed.calls)]
        turn.tool_calls = [ToolCall(name=c.name, arguments=c.arguments) for c in parsed.calls]
        if self.tool_calls + len(calls) > b.max_tool_calls:
            self.end(StopReason.MAX_TOOL_CALLS)
        else:
            self.tool_calls += len(calls)
            if len(self.traj.turns) >= b.max_turns:
                self.end(StopReason.MAX_TURNS)
        return parsed.content, "tool_calls", calls, parsed.reasoning

    def _extension(self, request: ChatRequest) -> list[dict] | None:
        """The new messages when ``request`` extends the conversation so far, else None (a first request, or a
        rewrite)."""
        if self.messages is None or self.reply is None or request.tools != self.tools:
            return None
        n = len(self.messages)
        msgs = request.messages
        if len(msgs) <= n + 1 or msgs[:n] != self.messages or not _same_reply(msgs[n], self.reply):
            return None
        new = msgs[n + 1:]
        if any(m["role"] == "assistant" for m in new):
            return None  # the agent wrote an assistant turn itself: context, not the policy's
        return new

    def _record_tool_outputs(self, messages: list[dict]) -> None:
        """What the agent's tools returned for the last turn's calls (matched by call id), and how long it took."""
        if not self.traj.turns or not self.reply or not self.reply.get("tool_calls"):
            return
        last = self.traj.turns[-1]
        by_id = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        if last.tool_s or not any(issued["id"] in by_id for issued in self.reply["tool_calls"]):
            return  # recorded already, or not answered here
        for call, issued in zip(last.tool_calls, self.reply["tool_calls"]):
            if issued["id"] in by_id:
                call.output, call.ok = by_id[issued["id"]], self.tool_ok.pop(issued["id"], True)
        last.tool_s = time.perf_counter() - self.replied_at


def _same_reply(sent: dict, ours: dict) -> bool:
    """Whether ``sent`` is our reply ``ours`` as the agent sends it back: content, and each call's id, name and
    arguments as values (the SDK may re-serialise them)."""
    if sent["role"] != "assistant" or sent["content"] != ours["content"] or sent.get("reasoning_content") != ours.get("reasoning_content"):
        return False
    a, b = sent.get("tool_calls") or [], ours.get("tool_calls") or []
    return a == b  # normalised: ids, names and arguments as values (normalise_messages parsed them)
