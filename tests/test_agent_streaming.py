"""``stream: true`` through the agent endpoint, read by the official ``openai`` SDK's own stream readers
(``chat.completions.stream`` and the raw chunk iterator): the same turns, tokens and segments as without streaming."""

from __future__ import annotations

import json

import pytest

from support.endpoint import SCHEMA, endpoint_chat, request, run_code, tool_agent
from trl_plugins.rollout.endpoint import AgentEndpointRollout


@pytest.fixture(scope="module")
def chat():
    return endpoint_chat()


SEEN: list = []


async def sdk_stream_agent(client, row):
    """:func:`tool_agent` with the SDK's streaming helper: its accumulated final completion is the message."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        async with client.chat.completions.stream(
            model="policy", messages=messages, tools=[SCHEMA], stream_options={"include_usage": True}
        ) as stream:
            kinds = [event.type async for event in stream]
            completion = await stream.get_final_completion()
        SEEN.append((kinds, completion))
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"parsed"}))
        if not message.tool_calls:
            return 1.0 if "\\boxed{7}" in (message.content or "") else 0.0
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_code(json.loads(call.function.arguments))}
            )


async def chunk_agent(client, row):
    """A hand-written chunk accumulator (as LangChain's and AutoGen's are) over the SDK's raw stream."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="policy", messages=messages, tools=[SCHEMA], stream=True
            )
        ]
        SEEN.append(chunks)
        content, reasoning, calls = "", "", {}
        for c in chunks:
            for choice in c.choices:
                content += choice.delta.content or ""
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""  # vLLM's field, kept as extra
                for d in choice.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += d.id or ""
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
        tool_calls = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
        messages.append(
            {
                "role": "assistant",
                "content": content or None,
                **({"tool_calls": tool_calls} if calls else {}),
                **({"reasoning_content": reasoning} if reasoning else {}),
            }
        )
        if not calls:
            return 1.0 if "\\boxed{7}" in content else 0.0
        for call in tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": run_code(json.loads(call["function"]["arguments"])),
                }
            )


@pytest.mark.parametrize("streaming", [sdk_stream_agent, chunk_agent])
def test_a_streaming_agent_trains_the_tokens_a_non_streaming_one_does(chat, streaming):
    prompts = ["calls=2 think", "calls=0", "par=2"]
    SEEN.clear()
    streamed = AgentEndpointRollout(agent=streaming)(request(chat, prompts)).trajectories
    plain = AgentEndpointRollout(agent=tool_agent)(request(chat, prompts)).trajectories
    assert [t.stop_reason for t in streamed] == [t.stop_reason for t in plain]
    for a, b in zip(streamed, plain):
        assert [(t.prompt_ids, t.completion_ids, t.segment_start) for t in a.turns] == [
            (t.prompt_ids, t.completion_ids, t.segment_start) for t in b.turns
        ]
        assert a.num_segments == 1 and len(a.turns) == len(b.turns) > 0
        assert a.reward_components == b.reward_components
    assert len(SEEN) == sum(len(t.turns) for t in plain)
    if streaming is sdk_stream_agent:
        kinds, completion = next((k, c) for k, c in SEEN if c.id == "chatcmpl-0-1")  # trajectory 0's first turn
        assert "chunk" in kinds and "tool_calls.function.arguments.done" in kinds
        assert completion.usage.completion_tokens == len(streamed[0].turns[0].completion_ids)
        assert completion.choices[0].finish_reason == "tool_calls"
    else:
        chunks = next(c for c in SEEN if c[0].id == "chatcmpl-0-1")
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stream_options_need_stream(chat):
    errors = []

    async def agent(client, row):
        import openai

        for extra in ({"stream_options": {"include_usage": True}}, {"stream": "yes"}):
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], **extra
                )
            except openai.BadRequestError as exc:
                errors.append(exc.body["param"])
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    AgentEndpointRollout(agent=agent)(request(chat, ["calls=0"]))
    assert errors == ["stream_options", "stream"]
