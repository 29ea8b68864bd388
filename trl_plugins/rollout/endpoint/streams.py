"""``stream: true`` answered by replaying the finished turn as server-sent events, in the wire format the official
``openai`` SDK parses. The record needs the whole turn before it can be matched and parsed (its tool calls, a stop
string), so the first event leaves when the turn is done: a streaming agent's first-token latency is the whole turn's
generation; its total time is the same as without streaming."""

from __future__ import annotations

from typing import Any

from trl_plugins.rollout.endpoint.http import EventStream

__all__ = ["chat_stream"]


def chat_stream(body: dict[str, Any], *, include_usage: bool) -> EventStream:
    """A ``chat.completion`` body (:func:`~trl_plugins.rollout.endpoint.api.completion_body`) as
    ``chat.completion.chunk`` events: the role, the reasoning, the content, each tool call (index, id, name and its
    arguments in one delta), the ``finish_reason``; a last chunk with ``usage`` and no choices when
    ``include_usage``; ``data: [DONE]``."""
    (choice,) = body["choices"]
    message = choice["message"]
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}
    if include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> tuple[None, dict[str, Any]]:
        return None, {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    events = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        events.append(chunk({"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        events.append(chunk({"content": message["content"]}))
    for k, call in enumerate(message.get("tool_calls") or []):
        events.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                        }
                    ]
                }
            )
        )
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append((None, {**head, "choices": [], "usage": body["usage"]}))
    return EventStream(events, done=True)
