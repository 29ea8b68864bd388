"""The Responses API (``POST /responses``) mapped onto the chat-completions session: its input items become chat
messages, its flat function tools chat tools, and the request goes through the same checks
(:func:`~trl_plugins.rollout.endpoint.api.check_request`) and the same token-exact session and segment rules; the
finished turn comes back as output items (``reasoning``, ``message``, ``function_call``), or as its stream of events.

What each parameter does: ``input`` (a string or items: messages with text parts, ``function_call``,
``function_call_output``, ``reasoning``), ``instructions`` (a system message first), ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream`` as in chat completions;
``previous_response_id`` continues from the session's own record (only its last response); ``store`` accepted (the
session keeps its record either way); ``include``, ``reasoning``, ``metadata``, ``user``, ``prompt_cache_key``,
``safety_identifier``, ``service_tier`` and ``text.verbosity`` accepted as no-ops; ``text.format`` ``json_schema``
served unforced as ``tool_choice`` is (the model chooses; counted); ``truncation`` only ``disabled``; anything else
refused, naming it."""

from __future__ import annotations

from typing import Any

from trl_plugins.rollout.endpoint.http import EventStream, HttpError

__all__ = ["chat_body", "response_body", "response_stream"]

_PASSED = ("tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "stream", "model", "user", "metadata")
_NO_OPS = (
    "include",
    "reasoning",
    "store",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "top_logprobs",
    "background",
)
_ACCEPTED = (
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "text",
    "truncation",
    *_PASSED,
    *_NO_OPS,
)


def chat_body(body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(chat-completions body, what the response echoes)`` for a Responses request.

    Raises:
        HttpError: 400 naming what is not served and what to send instead.
    """
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    for key in body:
        if key not in _ACCEPTED:
            raise HttpError(
                400,
                f"the endpoint does not honour {key!r} on /responses; it accepts {sorted(_ACCEPTED)}. Omit it.",
                param=key,
                code="unsupported_parameter",
            )
    if body.get("background") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        key = "background" if body.get("background") not in (None, False) else "top_logprobs"
        raise HttpError(400, f"{key}={body[key]!r} is not served: omit it.", param=key, code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise HttpError(
            400,
            "truncation='auto' is not served (the trajectory's token budget ends it instead of dropping "
            "input): omit truncation or send 'disabled'.",
            param="truncation",
            code="unsupported_parameter",
        )
    text = body.get("text") or {}
    fmt = (text.get("format") or {"type": "text"}) if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
        raise HttpError(400, f"text={text!r}: send text.format of type 'text' or 'json_schema'.", param="text")
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["tools"] = [_chat_tool(t) for t in body.get("tools") or []]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat["messages"] = messages + input_messages(body.get("input"))
    echo = {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True),
        "text": {"format": fmt},
        "format_unforced": fmt["type"] != "text",
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
    }
    return chat, echo


def _chat_tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise HttpError(
            400,
            f"tools: only function tools ({{'type': 'function', 'name': ..., 'parameters': {{...}}}}) are "
            f"served, got {kind!r}.",
            param="tools",
        )
    fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _parts(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise HttpError(400, f"{where}: content must be a string or text parts.", param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text") or not isinstance(
            part.get("text"), str
        ):
            raise HttpError(
                400,
                f"{where}: content part of type {kind!r} is not served; send text parts (input_text / output_text).",
                param="input",
            )
        out.append(part["text"])
    return "".join(out)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Responses input as chat messages: a reasoning item, an assistant message and the function calls after it are
    one assistant turn; a ``function_call_output`` a tool message; ``developer`` a system message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise HttpError(400, "input must be a string or a non-empty list of items.", param="input")
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise HttpError(400, f"{where} is not an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _parts(item.get("content"), where)
            if role == "assistant":
                current = assistant()
                if current.get("tool_calls") or current["content"]:
                    turn = None
                    current = assistant()
                current["content"] = text
                continue
            turn = None
            if role not in ("user", "system", "developer"):
                raise HttpError(
                    400, f"{where} has role {role!r}; send user, system, developer or assistant.", param="input"
                )
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                turn = None
            text = _parts(item.get("content"), where) or _parts(item.get("summary"), where)
            if text:
                assistant()["reasoning_content"] = text
            else:
                assistant()
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise HttpError(400, f"{where} is a function_call without a name and call_id.", param="input")
            assistant().setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise HttpError(400, f"{where} is a function_call_output without a call_id.", param="input")
            turn = None
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _parts(output, where),
                }
            )
        else:
            raise HttpError(
                400,
                f"{where} is of type {kind!r}; the endpoint serves message, reasoning, function_call "
                f"and function_call_output items.",
                param="input",
            )
    return out


def response_body(
    chat: dict[str, Any], echo: dict[str, Any], *, response_id: str, model: str, sampling: Any
) -> dict[str, Any]:
    """A chat completion (:func:`~trl_plugins.rollout.endpoint.api.completion_body`) as a ``response`` object."""
    (choice,) = chat["choices"]
    message, n = choice["message"], chat["id"].rsplit("-", 2)
    tag = "_".join(n[-2:])
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{tag}",
                "summary": [],
                "status": "completed",
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
            }
        )
    if message.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{tag}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call['id']}",
                "call_id": call["id"],
                "status": "completed",
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
        )
    truncated = choice["finish_reason"] == "length"
    usage = chat["usage"]
    return {
        "id": response_id,
        "object": "response",
        "created_at": float(chat["created"]),
        "model": model,
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None,
        "output": output,
        "instructions": echo["instructions"],
        "metadata": echo["metadata"],
        "previous_response_id": echo["previous_response_id"],
        "store": echo["store"],
        "text": echo["text"],
        "tools": echo["tools"],
        "tool_choice": echo["tool_choice"],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def response_stream(response: dict[str, Any]) -> EventStream:
    """A finished ``response`` replayed as the Responses stream: ``response.created``, ``response.in_progress``, per
    output item its ``added`` / delta / ``done`` events, then ``response.completed`` (``response.incomplete``)."""
    events: list[tuple[str | None, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    start = {**response, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for i, item in enumerate(response["output"]):
        ids = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            emit("response.content_part.added", **ids, content_index=0, part={**part, "text": ""})
            emit("response.output_text.delta", **ids, content_index=0, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **ids, content_index=0, part=part)
        elif item["type"] == "function_call":
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            emit("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        else:  # reasoning
            emit("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            text = item["content"][0]["text"]
            emit("response.reasoning_text.delta", **ids, content_index=0, delta=text)
            emit("response.reasoning_text.done", **ids, content_index=0, text=text)
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return EventStream(events)
