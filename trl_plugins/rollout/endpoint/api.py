"""The OpenAI chat-completions request as the agent endpoint honours it: every parameter either honoured or refused
with an error that says what to send instead, messages normalised for matching, and the response body."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from trl_plugins.rollout.endpoint.http import HttpError
from trl_plugins.types import SamplingSettings

__all__ = [
    "ChatRequest",
    "check_request",
    "check_stop",
    "check_tool_choice",
    "normalise_messages",
    "template_messages",
    "completion_body",
]

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Parameters that change nothing when absent or at their neutral value: (name, accepted values, what to do instead).
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "one choice per request: send n=1 (or omit it) and call again for more samples"),
    "logprobs": ((False,), "the endpoint records the behaviour log-probs itself and returns none: omit logprobs"),
    "top_logprobs": ((), "no log-probs are returned: omit top_logprobs"),
    "seed": ((), "sampling seeds are the run's (one per trajectory and turn): omit seed"),
    "presence_penalty": ((0, 0.0), "the run samples without penalties: omit presence_penalty"),
    "frequency_penalty": ((0, 0.0), "the run samples without penalties: omit frequency_penalty"),
    "logit_bias": (({},), "the run samples from the policy unchanged: omit logit_bias"),
    "response_format": (({"type": "text"},), "plain text only: omit response_format"),
    "store": ((False,), "nothing is stored: omit store"),
}
_RECORDED = ("model", "user", "metadata")
_ACCEPTED = (
    "messages",
    "tools",
    "tool_choice",
    "stop",
    "stream",
    "stream_options",
    "parallel_tool_calls",
    "max_tokens",
    "max_completion_tokens",
    *_SAMPLING,
    *_NEUTRAL,
    *_RECORDED,
)


@dataclass
class ChatRequest:
    """A checked request."""

    messages: list[dict]
    """Normalised (:func:`normalise_messages`)."""
    tools: list[dict]
    """Function tools in OpenAI's format, as sent."""
    max_tokens: int | None
    """The agent's cap on the reply's tokens (None: the rollout's ``max_assistant_tokens``)."""
    model: str
    """The model name the agent asked for (echoed back)."""
    stop: tuple[str, ...] = ()
    """Stop strings: the turn ends at the first token whose text completes one (:mod:`trl_plugins.rollout.stops`)."""
    tool_choice_unforced: str | None = None
    """A ``tool_choice`` other than ``auto`` that was accepted without being forced (its value, for the count)."""
    stream: bool = False
    """Answer with server-sent events (a replay of the finished turn)."""
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with the usage."""
    prompt_too_long: bool = False
    """A prompt past the trajectory's token budget is answered with Anthropic's ``prompt is too long`` 400 and the
    trajectory goes on (a harness compacts its history on it: the next request starts a segment); else the trajectory
    ends (``token_budget``). The Messages dialect's; a first request past the budget ends it either way."""


MAX_STOP = 4
"""Stop strings per request (the OpenAI API's limit)."""


def check_request(
    body: Any,
    *,
    sampling: SamplingSettings,
    max_assistant_tokens: int,
    calls_per_turn: int,
    refuse_unforced_tool_choice: bool = False,
) -> ChatRequest:
    """``body`` checked against what the endpoint honours.

    ``tool_choice`` ``auto`` is honoured; ``none``, ``required`` and a named function are accepted without being
    forced (the model chooses, as with ``auto``: forcing would either constrain sampling, so the behaviour log-probs
    would not be the policy's, or render the turn without tools, a new segment), unless
    ``refuse_unforced_tool_choice``.

    Raises:
        HttpError: 400 naming the parameter, what the run does and what to send instead.
    """
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    for key in body:
        if key not in _ACCEPTED:
            raise HttpError(
                400,
                f"the endpoint does not honour {key!r}; it accepts {sorted(_ACCEPTED)}. Omit it.",
                param=key,
                code="unsupported_parameter",
            )
    for key, (accepted, instead) in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and not any(
            value == a and type(value) is type(a) or isinstance(a, float) and value == a for a in accepted
        ):
            raise HttpError(
                400, f"{key}={_shown(value)} is not honoured: {instead}.", param=key, code="unsupported_parameter"
            )
    for key in _SAMPLING:
        value, run = body.get(key), getattr(sampling, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _close(value, run):
            raise HttpError(
                400,
                f"{key}={_shown(value)}, but this run samples with {key}={run} (its sampling settings are "
                f"recorded with every trajectory and its log-probs): omit {key} or send {run}.",
                param=key,
                code="unsupported_parameter",
            )
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise HttpError(
            400,
            "tools must be a list of function tools, each {'type': 'function', 'function': {'name': "
            "..., 'parameters': {...}}}.",
            param="tools",
        )
    unforced = check_tool_choice(
        body.get("tool_choice"), [t["function"]["name"] for t in tools], refuse=refuse_unforced_tool_choice
    )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise HttpError(400, f"parallel_tool_calls must be a bool, got {parallel!r}.", param="parallel_tool_calls")
    if parallel is False and calls_per_turn > 1:
        raise HttpError(
            400,
            f"parallel_tool_calls=false is not honoured: this run lets a turn make up to "
            f"{calls_per_turn} calls (the rollout's max_tool_calls_per_turn) and cannot keep the model "
            f"to one. Omit it, or set max_tool_calls_per_turn: 1 in rollout_kwargs.",
            param="parallel_tool_calls",
            code="unsupported_parameter",
        )
    limits = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(set(limits.values())) > 1:
        raise HttpError(400, f"max_tokens and max_completion_tokens disagree ({limits}): send one.", param="max_tokens")
    max_tokens = next(iter(limits.values()), None)
    if max_tokens is not None:
        key = next(iter(limits))
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= max_assistant_tokens
        ):
            raise HttpError(
                400,
                f"{key}={_shown(max_tokens)}: this run's turns take at most {max_assistant_tokens} tokens "
                f"(rollout_kwargs max_assistant_tokens); send an integer from 1 to "
                f"{max_assistant_tokens}, or omit it.",
                param=key,
                code="unsupported_parameter",
            )
    model = body.get("model")
    stream, usage = check_stream(body)
    return ChatRequest(
        normalise_messages(body.get("messages")),
        tools,
        max_tokens,
        model if isinstance(model, str) else "",
        stop=check_stop(body.get("stop")),
        tool_choice_unforced=unforced,
        stream=stream,
        include_usage=usage,
    )


def check_stream(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)`` from ``stream`` and ``stream_options``."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise HttpError(400, f"stream must be a bool, got {_shown(stream)}.", param="stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise HttpError(
            400, "stream_options is only for stream=true: omit it or send stream=true.", param="stream_options"
        )
    if (
        not isinstance(options, dict)
        or not all(isinstance(v, bool) for v in options.values())
        or not set(options) <= {"include_usage", "include_obfuscation"}
    ):
        raise HttpError(
            400,
            f"stream_options={_shown(options)}: send {{'include_usage': bool}} (include_obfuscation is "
            f"accepted and ignored: the stream is local).",
            param="stream_options",
        )
    return True, options.get("include_usage", False)


def check_stop(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list of up to :data:`MAX_STOP` non-empty strings) as a tuple."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(x, str) and x for x in stops):
        raise HttpError(
            400,
            f"stop={_shown(stop)}: send a non-empty string or a list of at most {MAX_STOP} non-empty "
            f"strings (or omit it).",
            param="stop",
        )
    return tuple(dict.fromkeys(stops))


def check_tool_choice(choice: Any, names: Sequence[str], *, refuse: bool) -> str | None:
    """None for ``auto`` (or absent); the value's name (``none``, ``required``, ``function``) when it is accepted
    without being forced.

    Raises:
        HttpError: a malformed value, a named function that is not among the tools, or any value but ``auto`` with
            ``refuse``.
    """
    if choice is None or choice == "auto":
        return None
    if isinstance(choice, dict):  # chat: {"type": "function", "function": {"name": ...}}; Responses: flat "name"
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise HttpError(
                400,
                f"tool_choice={_shown(choice)} is not a function choice: send 'auto', 'none', "
                f"'required' or {{'type': 'function', 'function': {{'name': ...}}}}.",
                param="tool_choice",
            )
        if name not in names:
            raise HttpError(
                400, f"tool_choice names {name!r}, which is not among the tools {list(names)}.", param="tool_choice"
            )
        kind = "function"
    elif choice in ("none", "required"):
        kind = choice
    else:
        raise HttpError(
            400,
            f"tool_choice={_shown(choice)}: send 'auto', 'none', 'required' or a named function.",
            param="tool_choice",
        )
    if refuse:
        raise HttpError(
            400,
            f"tool_choice={_shown(choice)} is not honoured (refuse_unforced_tool_choice is set): the "
            f"model chooses (tool_choice 'auto'; forcing would constrain sampling, so the behaviour "
            f"log-probs would not be the policy's, or render the turn without tools). Omit tool_choice "
            f"or send 'auto'; to forbid calls, send no tools.",
            param="tool_choice",
            code="unsupported_parameter",
        )
    return kind


def _close(value: int | float, run: float) -> bool:
    try:
        return math.isclose(value, run, abs_tol=1e-9)
    except OverflowError:  # an integer beyond any float (JSON integers are unbounded: 10**400)
        return False


def _shown(value: Any) -> str:
    """``value`` for a message: a long number by its first digits and its length."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _is_function_tool(tool: Any) -> bool:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(fn, dict)
        and tool.get("type") == "function"
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("parameters", {}), dict)
    )


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HttpError(
                    400,
                    f"{where}: content part of type {kind!r} is not supported; send text (a string, "
                    f"or parts of type 'text').",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise HttpError(
        400,
        f"{where}: content must be a string or a list of text parts, got {type(content).__name__}.",
        param="messages",
    )


def _arguments(raw: Any) -> Any:
    """Arguments as a value (a JSON string parsed), so that re-serialised arguments compare equal."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse: kept as the text it is
            return raw
    return raw


def normalise_messages(messages: Any) -> list[dict]:
    """Chat messages in one canonical form for matching: ``role``, ``content`` (a string), and ``tool_calls``
    (``id``, ``name``, parsed ``arguments``), ``tool_call_id`` or ``name`` where given. Keys the SDK sends empty
    (``refusal: null``, ``annotations: []``) are dropped.

    Raises:
        HttpError: not a non-empty list of chat messages, an unknown role or key, or non-text content.
    """
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list of chat messages.", param="messages")
    out = []
    for k, raw in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(raw, dict):
            raise HttpError(400, f"{where} is not an object.", param="messages")
        role = raw.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            hint = " (send its text as a system message)" if role == "developer" else ""
            raise HttpError(
                400,
                f"{where} has role {role!r}; the chat template takes system, user, assistant and tool messages{hint}.",
                param="messages",
            )
        message: dict[str, Any] = {"role": role, "content": _text(raw.get("content"), where)}
        known = {
            "role",
            "content",
            "tool_calls",
            "tool_call_id",
            "name",
            "refusal",
            "annotations",
            "audio",
            "function_call",
            "reasoning_content",
        }
        extra = [key for key, value in raw.items() if key not in known and value not in (None, [], {}, "")]
        if extra or any(raw.get(key) not in (None, [], {}, "") for key in ("refusal", "audio", "function_call")):
            keys = extra or [key for key in ("refusal", "audio", "function_call") if raw.get(key)]
            raise HttpError(
                400, f"{where} carries {keys}, which the endpoint does not render; drop them.", param="messages"
            )
        if isinstance(raw.get("name"), str) and raw["name"]:
            message["name"] = raw["name"]
        if role == "assistant" and raw.get("reasoning_content"):
            message["reasoning_content"] = _text(raw["reasoning_content"], f"{where}.reasoning_content")
        if role == "assistant" and raw.get("tool_calls"):
            calls = raw["tool_calls"]
            if not isinstance(calls, list):
                raise HttpError(400, f"{where}.tool_calls must be a list.", param="messages")
            message["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise HttpError(
                        400, f"{where}.tool_calls[{j}] is not a function call with a name.", param="messages"
                    )
                message["tool_calls"].append(
                    {"id": str(call.get("id") or ""), "name": fn["name"], "arguments": _arguments(fn.get("arguments"))}
                )
        if role == "tool":
            if not isinstance(raw.get("tool_call_id"), str):
                raise HttpError(400, f"{where} is a tool message without a tool_call_id.", param="messages")
            message["tool_call_id"] = raw["tool_call_id"]
        out.append(message)
    return out


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Normalised messages as the chat template takes them: calls with their arguments as objects, and each tool
    message named after the call it answers (found by ``tool_call_id``)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        rendered: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content"):
            rendered["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            rendered["tool_calls"] = [
                {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in m["tool_calls"]
            ]
            names.update({c["id"]: c["name"] for c in m["tool_calls"]})
        if m["role"] == "tool":
            rendered["tool_call_id"] = m["tool_call_id"]
            rendered["name"] = m.get("name") or names.get(m["tool_call_id"], "")
        elif m.get("name"):
            rendered["name"] = m["name"]
        out.append(rendered)
    return out


def completion_body(
    *,
    completion_id: str,
    model: str,
    content: str | None,
    calls: Sequence[dict],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    reasoning: str = "",
) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice; ``calls`` are ``{"id", "name", "arguments"}`` (arguments an object,
    sent as its JSON); ``reasoning`` goes in ``reasoning_content`` (as vLLM's servers send it) when there is one."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in calls
        ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
