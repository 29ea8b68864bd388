"""The Responses API (``POST /responses``) through the agent endpoint, driven by the official ``openai`` SDK's
``responses.create`` and ``responses.stream``: the same turns, tokens and segments as a chat-completions agent."""

from __future__ import annotations

import json

import pytest

from support.endpoint import SCHEMA, endpoint_chat, request, run_code
from trl_plugins.rollout.endpoint import AgentEndpointRollout


@pytest.fixture(scope="module")
def chat():
    return endpoint_chat()


TOOL = {
    "type": "function",
    "name": SCHEMA["function"]["name"],
    "description": SCHEMA["function"].get("description", ""),
    "parameters": SCHEMA["function"]["parameters"],
}
SEEN: list = []


async def _turn(client, mode, **kwargs):
    if mode == "stream":
        async with client.responses.stream(model="policy", tools=[TOOL], **kwargs) as stream:
            events = [event async for event in stream]
        kinds = [event.type for event in events]
        # the terminal event's response: get_final_response() raises on response.incomplete (a truncated turn)
        response = events[-1].response
        SEEN.append((kinds, response))
        return response
    response = await client.responses.create(model="policy", tools=[TOOL], **kwargs)
    SEEN.append(([], response))
    return response


def agent_for(mode):
    async def agent(client, row):
        """As the Agents SDK drives it: the output items go back as input, each call's output after them (or, with
        ``previous``, only the new items and the last response's id)."""
        items = [{"role": "user", "content": row["prompt"]}]
        previous = None
        while True:
            extra = {"previous_response_id": previous} if previous else {}
            response = await _turn(
                client,
                "stream" if mode == "stream" else "create",
                input=items,
                **extra,
                instructions="Use the tool when it helps.",
            )
            calls = [item for item in response.output if item.type == "function_call"]
            outputs = [
                {"type": "function_call_output", "call_id": c.call_id, "output": run_code(json.loads(c.arguments))}
                for c in calls
            ]
            if mode == "previous":
                items, previous = outputs, response.id
            else:
                items = items + [item.model_dump(exclude_none=True) for item in response.output] + outputs
            if not calls:
                return 1.0 if "\\boxed{7}" in response.output_text else 0.0

    return agent


async def chat_agent(client, row):
    """The chat-completions agent with the same system prompt (the Responses agents' instructions)."""
    messages = [
        {"role": "system", "content": "Use the tool when it helps."},
        {"role": "user", "content": row["prompt"]},
    ]
    while True:
        message = (
            (await client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA])).choices[0].message
        )
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0 if "\\boxed{7}" in (message.content or "") else 0.0
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_code(json.loads(call.function.arguments))}
            )


@pytest.mark.parametrize("mode", ["create", "stream", "previous"])
def test_a_responses_agent_trains_the_tokens_a_chat_completions_agent_does(chat, mode):
    prompts = ["calls=2 think", "calls=0", "ramble"]
    SEEN.clear()
    got = AgentEndpointRollout(agent=agent_for(mode))(request(chat, prompts)).trajectories
    ref = AgentEndpointRollout(agent=chat_agent)(request(chat, prompts)).trajectories
    assert [t.stop_reason for t in got] == [t.stop_reason for t in ref]
    for a, b in zip(got, ref):
        assert [(t.prompt_ids, t.completion_ids, t.segment_start) for t in a.turns] == [
            (t.prompt_ids, t.completion_ids, t.segment_start) for t in b.turns
        ]
        assert a.num_segments == 1 and a.reward_components == b.reward_components
    kinds, first = next((k, r) for k, r in SEEN if r.id == "resp_0_1")  # trajectory 0's first turn (agents interleave)
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    assert first.status == "completed" and first.usage.output_tokens == len(got[0].turns[0].completion_ids)
    assert first.usage.input_tokens == len(got[0].turns[0].prompt_ids)
    rambled = [r for _, r in SEEN if r.status == "incomplete"]
    assert len(rambled) == 1 and rambled[0].incomplete_details.reason == "max_output_tokens"
    if mode == "stream":
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert SEEN[-1][0][-1] in ("response.completed", "response.incomplete")


def test_responses_parameters_are_honoured_or_refused(chat):
    outcomes = {}

    async def agent(client, row):
        import openai

        for name, extra in {
            "truncation": {"truncation": "auto"},
            "tool": {"tools": [{"type": "web_search"}]},
            "previous": {"previous_response_id": "resp_nope"},
            "unknown": {"extra_body": {"x": 1}},
            "temperature": {"temperature": 0.2},
        }.items():
            try:
                await client.responses.create(model="policy", input=row["prompt"], **extra)
            except openai.BadRequestError as exc:
                outcomes[name] = exc.body["param"]
        ok = await client.responses.create(
            model="policy",
            input=row["prompt"],
            store=False,
            include=[],
            reasoning={"effort": "low"},
            metadata={"k": "v"},
            truncation="disabled",
            text={"format": {"type": "json_schema", "name": "a", "schema": {}}},
        )
        outcomes["ok"] = ok.status
        return 1.0

    result = AgentEndpointRollout(agent=agent)(request(chat, ["calls=0"]))
    assert outcomes == {
        "truncation": "truncation",
        "tool": "tools",
        "previous": "previous_response_id",
        "unknown": "x",
        "temperature": "temperature",
        "ok": "completed",
    }
    assert result.counters == {"endpoint/text_format_unforced": 1.0}
