"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) mapped onto the
chat-completions session: its system prompt and content blocks become chat messages, its tools chat tools, and the
request goes through the same checks (:func:`~trl_plugins.rollout.endpoint.api.check_request`) and the same
token-exact session and segment rules; the finished turn comes back as content blocks (``thinking``, ``text``,
``tool_use``), or as the event stream the Anthropic SDK parses. Errors take Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``).

What each parameter does: ``system`` (a string, or text blocks joined by a blank line) is the first system message;
``messages`` with ``text``, ``tool_use`` (assistant; several per turn), ``tool_result`` (user; its text, string or
blocks) and ``thinking`` blocks (assistant; the reasoning the chat dialect keeps or drops by the same segment rules);
``tools`` (client tools: ``name``, ``description``, ``input_schema``); ``tool_choice`` ``auto``, and ``any``, ``tool``
and ``none`` served as the chat dialect serves its forcing values (the model chooses, counted; refused under
``refuse_unforced_tool_choice``); ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``; ``stop_sequences``
(at most four); ``max_tokens`` an upper bound (the run's ``max_assistant_tokens`` when lower: the turn then ends there,
``stop_reason: max_tokens``); ``temperature``, ``top_p``, ``top_k`` checked against the run's sampling; ``stream``.
``metadata``, ``service_tier``, ``thinking`` and ``output_config`` (``effort``) are accepted and do nothing (whether
and how long the policy reasons is its chat template's and its own); ``context_management`` is accepted and not
applied (nothing is cleared server-side: a history that outgrows the trajectory's budget gets ``prompt is too long``,
on which a harness compacts). Refused, naming them: images and documents, server tools (``web_search``, ``bash``,
``text_editor``, ...), ``redacted_thinking`` (no text to render), ``container``, ``mcp_servers``, and any other field.
Headers such as ``anthropic-version`` and ``anthropic-beta`` are not read, nor the ``?beta=true`` query (a beta
feature shows in the body, where it is refused by name).

Claude Code's quirks, handled as a gateway must: its attribution line (``x-anthropic-billing-header: ...``, a hash
that changes between requests) is removed from the system prompt (:data:`BILLING_LINE`), and a ``system`` message
inside ``messages`` (its reminders) is folded into the next user turn as ``<system-reminder>`` text (chat templates
refuse a system message after the first), or made a user turn of its own where no user turn follows before the next
assistant turn (the Claude Agent SDK sends its environment reminder between the question and the first reply: folded
later, it would move in the next request and rewrite the history).

Stop reasons returned: ``end_turn``, ``tool_use``, ``max_tokens``, ``stop_sequence`` (with the sequence); never
``pause_turn`` or ``refusal``. A thinking block's ``signature`` is ``trl-plugins:`` and 16 hex digits of its text's
SHA-256; any signature sent back is accepted unchecked (the history is matched on the text).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from trl_plugins.rollout.endpoint.http import EventStream, HttpError

__all__ = ["AnthropicError", "chat_body", "message_body", "message_stream", "thinking_signature"]

_ACCEPTED = (
    "model",
    "messages",
    "system",
    "max_tokens",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
    "service_tier",
    "thinking",
    "output_config",
    "context_management",
)
_NOT_SERVED = {
    "container": "code-execution containers are Anthropic's",
    "mcp_servers": "the run's tools are the agent's (GET /tools), not remote MCP servers",
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class AnthropicError(HttpError):
    """An :class:`HttpError` answered in Anthropic's error shape."""

    def body(self) -> dict[str, Any]:
        error = {"type": _ERROR_TYPES.get(self.status, "api_error"), "message": self.message}
        if self.code:  # ours (``trajectory_ended``: a budget ended it), beside Anthropic's fields
            error["code"] = self.code
        return {"type": "error", "error": error}

    @classmethod
    def of(cls, error: HttpError) -> AnthropicError:
        return cls(error.status, error.message, code=error.code, param=error.param, kind=error.kind)


def thinking_signature(text: str) -> str:
    """The signature of a thinking block this endpoint emits: ``trl-plugins:`` and 16 hex digits of its SHA-256."""
    return "trl-plugins:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def chat_body(body: Any, *, max_assistant_tokens: int, counting: bool = False) -> dict[str, Any]:
    """The chat-completions body for a Messages request (``counting``: a ``count_tokens`` one, without
    ``max_tokens``).

    Raises:
        HttpError: 400 naming what is not served and what to send instead.
    """
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}.")
    for key in body:
        if key in _NOT_SERVED:
            raise HttpError(400, f"{key} is not served: {_NOT_SERVED[key]}. Omit it.", param=key)
        if key not in _ACCEPTED:
            raise HttpError(
                400, f"the endpoint does not honour {key!r} on /v1/messages; it accepts {sorted(_ACCEPTED)}. Omit it."
            )
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "top_k", "stream") if k in body}
    if not counting:
        limit = body.get("max_tokens")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise HttpError(400, f"max_tokens: a positive integer is required, got {limit!r}.", param="max_tokens")
        chat["max_tokens"] = min(limit, max_assistant_tokens)
    system = _system(body.get("system"))
    chat["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + _messages(
        body.get("messages")
    )
    chat["tools"] = [_tool(t, k) for k, t in enumerate(body.get("tools") or [])]
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise HttpError(
                400, f"tool_choice={choice!r}: send a type of auto, any, tool or none.", param="tool_choice"
            )
        kind = choice["type"]
        chat["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.get("name")}},
        }[kind]
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise HttpError(400, f"stop_sequences must be a list of strings, got {stops!r}.", param="stop_sequences")
        if stops:
            chat["stop"] = stops
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in _THINKING):
        raise HttpError(400, f"thinking={thinking!r}: send a type of {', '.join(_THINKING)}.", param="thinking")
    return chat


_THINKING = ("enabled", "disabled", "adaptive")


BILLING_LINE = re.compile(r"^x-anthropic-billing-header:.*(?:\n|$)", re.MULTILINE)
"""Claude Code's attribution line in the system prompt (``x-anthropic-billing-header: cc_version=...; cch=...;``): a
hash that changes between requests, which would shift every prompt's tokens; removed wherever it stands."""


def _system(system: Any) -> str | None:
    if isinstance(system, str):
        blocks = [system]
    elif system is None:
        return None
    elif isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        blocks = [str(b.get("text", "")) for b in system]
    else:
        raise HttpError(400, "system must be a string or a list of text blocks.", param="system")
    kept = [text for text in (BILLING_LINE.sub("", b) for b in blocks) if text.strip()]
    return "\n\n".join(kept) if kept else None


def _reminder(text: str) -> str:
    """A system message sent inside ``messages`` (Claude Code's reminders), as text of the next user turn: chat
    templates refuse a system message after the first."""
    return f"<system-reminder>\n{text}\n</system-reminder>\n"


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (a tool result's content)."""
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    if isinstance(blocks, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        return "".join(str(b.get("text", "")) for b in blocks)
    kinds = sorted({b.get("type") for b in blocks if isinstance(b, dict)}) if isinstance(blocks, list) else []
    raise HttpError(400, f"{where}: only text content is served, got {kinds or type(blocks).__name__}.")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as chat messages: an assistant message's thinking, text and tool_use blocks one assistant turn; a user
    message's tool_result blocks one tool message each (in order), its text blocks one user message after them."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages: a non-empty list is required.", param="messages")
    out: list[dict[str, Any]] = []
    reminders: list[str] = []  # system messages inside the list, folded into the next user turn
    for k, message in enumerate(messages):
        where = f"messages[{k}]"
        if isinstance(message, dict) and message.get("role") == "system":
            reminders.append(_reminder(_text_of(message.get("content"), where)))
            continue
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            role = message.get("role") if isinstance(message, dict) else None
            raise HttpError(400, f"{where}: role {role!r}; send user or assistant.", param="messages")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise HttpError(400, f"{where}: content must be a string or a list of blocks.", param="messages")
        if message["role"] == "assistant":
            if reminders:  # never moved past an assistant turn: a user turn of their own, where they stand
                out.append({"role": "user", "content": "".join(reminders)})
                reminders = []
            out.append(_assistant(blocks, where))
            continue
        text = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                if not isinstance(block.get("tool_use_id"), str):
                    raise HttpError(400, f"{where}.content[{j}]: a tool_result needs its tool_use_id.")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block["tool_use_id"],
                        "content": _text_of(block.get("content"), f"{where}.content[{j}]"),
                    }
                )
            elif kind == "text":
                text.append(str(block.get("text", "")))
            else:
                raise HttpError(
                    400,
                    f"{where}.content[{j}] is of type {kind!r}; a user message may hold text and tool_result blocks "
                    f"(images and documents are not served).",
                    param="messages",
                )
        if reminders:
            text, reminders = [*reminders, *text], []
        if text or not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(text)})
    if reminders:  # none followed: a user turn of their own
        out.append({"role": "user", "content": "".join(reminders)})
    return out


def _assistant(blocks: list, where: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            turn["content"] += str(block.get("text", ""))
        elif kind == "thinking":
            turn["reasoning_content"] = turn.get("reasoning_content", "") + str(block.get("thinking", ""))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise HttpError(400, f"{where}.content[{j}]: a tool_use needs its id and name.", param="messages")
            turn.setdefault("tool_calls", []).append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind == "redacted_thinking":
            raise HttpError(
                400,
                f"{where}.content[{j}] is redacted_thinking, which this endpoint never emits and cannot render "
                f"(it holds no text): drop it.",
                param="messages",
            )
        else:
            raise HttpError(
                400,
                f"{where}.content[{j}] is of type {kind!r}; an assistant message may hold text, thinking and "
                f"tool_use blocks.",
                param="messages",
            )
    return turn


def _tool(tool: Any, k: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise HttpError(
            400,
            f"tools[{k}] is of type {kind!r}: only client tools ({{'name', 'description', 'input_schema'}}) are "
            f"served; Anthropic's server tools (web search, bash, text editor, ...) are not.",
            param="tools",
        )
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def message_body(chat: dict[str, Any], *, model: str, stop_sequence: str | None) -> dict[str, Any]:
    """A chat completion (:func:`~trl_plugins.rollout.endpoint.api.completion_body`) as a Messages ``message``."""
    (choice,) = chat["choices"]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        content.append({"type": "thinking", "thinking": text, "signature": thinking_signature(text)})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(arguments) if isinstance(arguments, str) else arguments,
            }
        )
    finish = choice["finish_reason"]
    if finish == "tool_calls":
        stop_reason = "tool_use"
    elif finish == "length":
        stop_reason = "max_tokens"
    else:
        stop_reason = "stop_sequence" if stop_sequence is not None else "end_turn"
    usage = chat["usage"]
    return {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-").replace("-", "_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence if stop_reason == "stop_sequence" else None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def message_stream(message: dict[str, Any]) -> EventStream:
    """A finished ``message`` replayed as the Messages stream: ``message_start``, ``ping``, per content block its
    ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``, ``thinking_delta`` then
    ``signature_delta``) / ``content_block_stop``, then ``message_delta`` (the stop reason, the output tokens) and
    ``message_stop``; every frame named by an ``event:`` line."""
    events: list[tuple[str | None, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, **fields}))

    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    emit("message_start", message=start)
    emit("ping")
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            emit("content_block_start", index=i, content_block={"type": "text", "text": ""})
            emit("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        elif block["type"] == "tool_use":
            emit("content_block_start", index=i, content_block={**block, "input": {}})
            emit(
                "content_block_delta",
                index=i,
                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
        else:  # thinking
            emit("content_block_start", index=i, content_block={"type": "thinking", "thinking": "", "signature": ""})
            emit("content_block_delta", index=i, delta={"type": "thinking_delta", "thinking": block["thinking"]})
            emit("content_block_delta", index=i, delta={"type": "signature_delta", "signature": block["signature"]})
        emit("content_block_stop", index=i)
    emit(
        "message_delta",
        delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
        usage={"output_tokens": usage["output_tokens"]},
    )
    emit("message_stop")
    return EventStream(events)
