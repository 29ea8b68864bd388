"""Anthropic's Messages API on the agent endpoint (``POST /v1/messages``): the real ``anthropic`` SDK (async, sync,
streamed) against the real server, driven by the endpoint tests' scripted policy, compared token for token with the
built-in rollout; stop sequences, count_tokens, tool_choice, the error shape, and the 'prompt is too long' answer a
harness compacts on (the compacted history a new segment of the same trajectory)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from support.endpoint import SCHEMA, endpoint_chat, request, run_code
from trl_plugins.datum import build_datums
from trl_plugins.rollout import MultiTurnRollout
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.rollout.endpoint.messages import thinking_signature
from trl_plugins.types import StopReason

anthropic = pytest.importorskip("anthropic")

TOOL = {
    "name": SCHEMA["function"]["name"],
    "description": SCHEMA["function"].get("description", ""),
    "input_schema": SCHEMA["function"]["parameters"],
}
"""The code tool as an Anthropic client tool."""


@pytest.fixture(scope="module")
def chat():
    return endpoint_chat()


def _sent_back(reply) -> dict:
    """The assistant message an Anthropic-SDK agent sends back: the reply's content blocks, as the SDK dumps them."""
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}


def _results(reply) -> dict:
    calls = [b for b in reply.content if b.type == "tool_use"]
    return {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": c.id, "content": run_code(c.input)} for c in calls],
    }


def _answer(reply) -> float:
    text = "".join(b.text for b in reply.content if b.type == "text")
    return 1.0 if "\\boxed{7}" in text else 0.0


async def async_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = await client.messages.create(model="policy", max_tokens=4096, messages=messages, tools=[TOOL])
        messages.append(_sent_back(reply))
        if reply.stop_reason != "tool_use":
            return _answer(reply)
        messages.append(_results(reply))


async def streamed_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        async with client.messages.stream(model="policy", max_tokens=4096, messages=messages, tools=[TOOL]) as stream:
            reply = await stream.get_final_message()
        messages.append(_sent_back(reply))
        if reply.stop_reason != "tool_use":
            return _answer(reply)
        messages.append(_results(reply))


def sync_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = client.messages.create(model="policy", max_tokens=4096, messages=messages, tools=[TOOL])
        messages.append(_sent_back(reply))
        if reply.stop_reason != "tool_use":
            return _answer(reply)
        messages.append(_results(reply))


COMMAND_AGENT = textwrap.dedent("""
    import json, sys
    import anthropic
    row = json.load(sys.stdin)
    client = anthropic.Anthropic()  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY come from the environment
    tool = json.loads(sys.argv[1])
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        reply = client.messages.create(model="policy", max_tokens=4096, messages=messages, tools=[tool])
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            text = "".join(b.text for b in reply.content if b.type == "text")
            print(json.dumps({"reward": 1.0 if "\\\\boxed{7}" in text else 0.0}))
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": "ran " + c.input["code"]} for c in calls]})
""")


@pytest.mark.parametrize("kind", ["async", "streamed", "sync", "command"])
def test_an_anthropic_sdk_agent_trains_exactly_the_tokens_of_the_built_in_rollout(chat, kind, tmp_path):
    prompts = ["calls=2", "calls=0", "par=2 calls=1", "think calls=1"]
    built_in = MultiTurnRollout(max_tool_calls_per_turn=2)(request(chat, prompts))
    if kind == "command":
        script = tmp_path / "agent.py"
        script.write_text(COMMAND_AGENT)
        endpoint = AgentEndpointRollout(
            command=[sys.executable, str(script), json.dumps(TOOL)], max_tool_calls_per_turn=2
        )
    else:
        agent = {"async": async_agent, "streamed": streamed_agent, "sync": sync_agent}[kind]
        endpoint = AgentEndpointRollout(agent=agent, client="anthropic", max_tool_calls_per_turn=2)
    served = endpoint(request(chat, prompts))
    for a, b in zip(built_in.trajectories, served.trajectories, strict=True):
        assert b.stop_reason == a.stop_reason == StopReason.FINAL_ANSWER, b.error
        assert len(b.turns) == len(a.turns) and b.num_segments == 1
        for ta, tb in zip(a.turns, b.turns):
            assert tb.prompt_ids == ta.prompt_ids and tb.prompt_sources == ta.prompt_sources
            assert tb.completion_ids == ta.completion_ids and tb.completion_logprobs == ta.completion_logprobs
            assert [(c.name, c.arguments, c.output) for c in tb.tool_calls] == [
                (c.name, c.arguments, c.output) for c in ta.tool_calls
            ]
        assert build_datums(b, advantage=1.0) == build_datums(a, advantage=1.0)
        assert b.reward_components[0].value == 1.0
    assert any(len(t.turns[0].tool_calls) == 2 for t in served.trajectories)  # two tool_use blocks in one turn


def test_thinking_stop_sequences_count_tokens_and_tool_choice(chat):
    seen: dict = {}

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        counted = await client.messages.count_tokens(model="policy", messages=messages, tools=[TOOL])
        first = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL])
        seen["counted"], seen["first"] = counted.input_tokens, first
        messages += [_sent_back(first), _results(first)]
        # The stream names every frame; the message it builds is the one the plain call returns.
        async with client.messages.stream(model="policy", max_tokens=64, messages=messages, tools=[TOOL]) as stream:
            seen["events"] = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        seen["streamed"] = streamed
        messages.append(_sent_back(streamed))
        messages.append({"role": "user", "content": "Are you sure?"})
        stopped = await client.messages.create(
            model="policy", max_tokens=64, messages=messages, tools=[TOOL], stop_sequences=["is \\boxed"]
        )
        seen["stopped"] = stopped
        return 1.0

    endpoint = AgentEndpointRollout(agent=agent, client="anthropic")
    (traj,) = endpoint(request(chat, ["think calls=1"])).trajectories
    first, streamed, stopped = seen["first"], seen["streamed"], seen["stopped"]
    assert seen["counted"] == len(traj.turns[0].prompt_ids)  # the prompt the policy was given
    thinking, text, call = first.content
    assert (thinking.type, text.type, call.type) == ("thinking", "text", "tool_use")
    assert thinking.thinking == "I should compute." and thinking.signature == thinking_signature("I should compute.")
    assert call.input == {"code": "print(0)"} and first.stop_reason == "tool_use"
    assert first.usage.input_tokens == len(traj.turns[0].prompt_ids)
    assert first.usage.output_tokens == len(traj.turns[0].completion_ids)
    assert seen["events"][:2] == ["message_start", "content_block_start"] and seen["events"][-1] == "message_stop"
    assert "message_delta" in seen["events"] and streamed.stop_reason == "end_turn"
    assert [b.type for b in streamed.content] == ["thinking", "text"] and "\\boxed{7}" in streamed.content[1].text
    # A stop sequence: the text before it, the stop reason and the sequence; the turn ends on the token completing it.
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "is \\boxed"
    assert stopped.content[-1].text == "The answer "
    assert len(traj.turns) == 3 and traj.num_segments == 1  # thinking sent back: the conversation went on


def test_errors_come_back_in_anthropics_shape_and_forcing_tool_choice_is_counted_or_refused(chat):
    seen: dict = {}

    async def agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for name, kwargs in (
            ("image", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            ("server_tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            ("temperature", {"extra_body": {"temperature": 0.3}}),
            ("forced", {"tool_choice": {"type": "any"}}),
        ):
            try:
                await client.messages.create(
                    model="policy", max_tokens=64, **{"messages": messages, "tools": [TOOL], **kwargs}
                )
                seen[name] = "served"
            except anthropic.BadRequestError as exc:
                seen[name] = exc.body
        async with anthropic.AsyncAnthropic(base_url=str(client.base_url), api_key="wrong", max_retries=0) as wrong:
            try:
                await wrong.messages.create(model="policy", max_tokens=64, messages=messages)
            except anthropic.AuthenticationError as exc:
                seen["auth"] = exc.body
        return 1.0

    endpoint = AgentEndpointRollout(agent=agent, client="anthropic", refuse_unforced_tool_choice=True)
    endpoint(request(chat, ["calls=0"]))
    for name in ("image", "server_tool", "temperature", "forced"):
        assert seen[name]["type"] == "error" and seen[name]["error"]["type"] == "invalid_request_error", seen[name]
    assert "images and documents are not served" in seen["image"]["error"]["message"]
    assert "server tools" in seen["server_tool"]["error"]["message"]
    assert "this run samples with temperature" in seen["temperature"]["error"]["message"]
    assert "tool_choice" in seen["forced"]["error"]["message"]
    assert seen["auth"]["error"]["type"] == "authentication_error"
    # Without refuse_unforced_tool_choice, 'any' is served as auto and counted.
    seen.clear()

    async def forcing(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = await client.messages.create(
            model="policy", max_tokens=64, messages=messages, tools=[TOOL], tool_choice={"type": "any"}
        )
        return _answer(reply)

    result = AgentEndpointRollout(agent=forcing, client="anthropic")(request(chat, ["calls=0"]))
    assert result.trajectories[0].stop_reason == StopReason.FINAL_ANSWER
    assert result.counters["endpoint/tool_choice_unforced"] == 1


def test_a_prompt_too_long_is_answered_as_anthropic_does_and_the_compacted_history_is_a_new_segment(chat):
    seen: dict = {}

    async def compacting_agent(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        first = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL])
        call = next(b for b in first.content if b.type == "tool_use")
        long = {"type": "tool_result", "tool_use_id": call.id, "content": "x " * 400}
        messages += [_sent_back(first), {"role": "user", "content": [long]}]
        try:
            await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[TOOL])
        except anthropic.BadRequestError as exc:
            seen["overflow"] = exc.body
        # What a harness does on that answer: it replaces the history with a summary and goes on.
        summary = [{"role": "user", "content": row["prompt"] + "\nSummary: print(0) ran; its output was long."}]
        reply = await client.messages.create(model="policy", max_tokens=64, messages=summary, tools=[TOOL])
        seen["after"] = reply
        return 1.0

    endpoint = AgentEndpointRollout(agent=compacting_agent, client="anthropic", max_trajectory_tokens=400)
    (traj,) = endpoint(request(chat, ["calls=1"])).trajectories
    error = seen["overflow"]
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert (
        error["error"]["message"].startswith("prompt is too long: ")
        and "tokens > 399 maximum" in error["error"]["message"]
    )
    # The trajectory went on: the compacted history is a new segment of it, each sampled token trained once.
    assert [t.segment_start for t in traj.turns] == [False, True] and traj.num_segments == 2
    assert traj.stop_reason != StopReason.TOKEN_BUDGET
    first, second = build_datums(traj, advantage=1.0)
    assert [t for t, m in zip(second.target_ids, second.action_mask) if m] == traj.turns[1].completion_ids


def test_claude_codes_attribution_line_is_removed_and_its_system_reminders_folded_where_the_prefix_holds():
    from trl_plugins.rollout.endpoint.http import HttpError
    from trl_plugins.rollout.endpoint.messages import chat_body

    def body(system, messages):
        return chat_body(
            {"model": "m", "max_tokens": 8, "system": system, "messages": messages}, max_assistant_tokens=64
        )["messages"]

    # The attribution line carries a per-request hash: removed, so two requests' prompts are the same tokens.
    for cch in ("abc12", "ffe90"):
        system = [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.90; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ]
        assert body(system, [{"role": "user", "content": "hi"}])[0] == {
            "role": "system",
            "content": "You are Claude Code.",
        }
    assert body("x-anthropic-billing-header: cc_version=1;", [{"role": "user", "content": "hi"}]) == [
        {"role": "user", "content": "hi"}
    ]
    # A system message inside the list: text of the next user turn (after its tool results), or a user turn of its own.
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "code_interpreter", "input": {}}]},
        {"role": "system", "content": "Remember the todo list."},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}, {"type": "text", "text": "go"}],
        },
        {"role": "system", "content": [{"type": "text", "text": "Last."}]},
    ]
    out = body(None, messages)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "user", "user"]
    assert out[3]["content"] == "<system-reminder>\nRemember the todo list.\n</system-reminder>\ngo"
    assert out[4]["content"] == "<system-reminder>\nLast.\n</system-reminder>\n"
    # ... and never past an assistant turn (the Claude Agent SDK's reminder after the question): where it stands, so
    # the next request, with the reply after it, renders the same prefix.
    question = [{"role": "user", "content": "a"}, {"role": "system", "content": "Env."}]
    first = body(None, question)
    later = body(None, [*question, *messages[1:2]])
    assert [m["role"] for m in later] == ["user", "user", "assistant"] and later[:2] == first
    with pytest.raises(HttpError, match="mcp_servers is not served"):
        chat_body({"model": "m", "max_tokens": 8, "messages": messages, "mcp_servers": []}, max_assistant_tokens=8)
    with pytest.raises(HttpError, match="does not honour 'speed'"):
        chat_body({"model": "m", "max_tokens": 8, "messages": messages, "speed": "fast"}, max_assistant_tokens=8)
    with pytest.raises(HttpError, match="redacted_thinking, which this endpoint never emits"):
        body(None, [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}])


def test_the_anthropic_sdk_example_streams_and_trains_what_a_plain_messages_agent_sends(chat, monkeypatch):
    from pathlib import Path

    from trl_plugins.rollout.endpoint.agent import _load

    root = Path(__file__).resolve().parent.parent
    solve = _load(f"{root}/examples/agents/anthropic_sdk/agent.py:solve")

    async def scripted_tool(code: str) -> str:  # its sandbox replaced by the endpoint tests' echo tool
        return run_code({"code": code})

    monkeypatch.setitem(solve.__globals__, "run_python", scripted_tool)
    system, tool = solve.__globals__["SYSTEM"], solve.__globals__["TOOL"]

    async def plain(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            reply = await client.messages.create(
                model="policy", max_tokens=64, system=system, messages=messages, tools=[tool]
            )
            messages.append(_sent_back(reply))
            if reply.stop_reason != "tool_use":
                return 1.0
            messages.append(_results(reply))

    prompts = ["calls=2", "calls=0", "par=2 calls=1"]
    got = AgentEndpointRollout(agent=solve, client="anthropic", max_tool_calls_per_turn=2)(request(chat, prompts))
    want = AgentEndpointRollout(agent=plain, client="anthropic", max_tool_calls_per_turn=2)(request(chat, prompts))
    for a, b in zip(want.trajectories, got.trajectories, strict=True):
        assert b.stop_reason == a.stop_reason == StopReason.FINAL_ANSWER and b.num_segments == 1, b.error
        assert [(t.prompt_ids, t.completion_ids) for t in b.turns] == [
            (t.prompt_ids, t.completion_ids) for t in a.turns
        ]
        assert "You solve maths problems." in chat.tokenizer.decode(b.turns[0].prompt_ids)
    # Its recipe layer resolves before any model loads, the rollout handing the agent an Anthropic client.
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root / "recipes"))
    from retool.config import parse_args
    from trl_plugins.run import resolve_run

    _, training_args = parse_args(["--config", "examples/agents/anthropic_sdk/retool_agent.yaml"])
    run = resolve_run(training_args)
    assert (
        run.rollout.impl.agent == "examples/agents/anthropic_sdk/agent.py:solve"
        and run.rollout.impl.client == "anthropic"
    )


def test_a_request_recorded_from_stock_claude_code_is_served(chat):
    # The first request the real Claude Code 2.1.337 CLI (`claude -p ... --output-format stream-json --verbose`) sent
    # to this endpoint, recorded on 2026-12-07 (its long texts and tool descriptions cut, its identifiers zeroed):
    # `?beta=true`, anthropic-beta headers, an attribution line, a system message inside the list, adaptive thinking,
    # output_config, context_management, twelve client tools, stream.
    from pathlib import Path

    recorded = json.loads((Path(__file__).parent / "support" / "claude_code_2.1.337_messages_request.json").read_text())
    assert recorded["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert any(m["role"] == "system" for m in recorded["messages"]) and len(recorded["tools"]) == 12
    seen: dict = {}

    async def claude_code_like(client, row):
        stream = await client.post(
            "/v1/messages?beta=true",
            body=recorded,
            cast_to=anthropic.types.Message,
            stream=True,
            stream_cls=anthropic.AsyncStream[anthropic.types.RawMessageStreamEvent],
            options={"headers": {"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}},
        )
        seen["events"] = [event.type async for event in stream]
        return 1.0

    endpoint = AgentEndpointRollout(agent=claude_code_like, client="anthropic", max_trajectory_tokens=100_000)
    (traj,) = endpoint(request(chat, ["calls=0"])).trajectories
    assert traj.stop_reason == StopReason.FINAL_ANSWER, traj.error
    assert seen["events"][0] == "message_start" and seen["events"][-1] == "message_stop"
    prompt = chat.tokenizer.decode(traj.turns[0].prompt_ids)
    assert "x-anthropic-billing-header" not in prompt and prompt.count("<|im_start|>system") == 1
    assert "<system-reminder>\n# Environment" in prompt  # the list's system message, in the user turn after it


def test_a_client_beside_a_command_agent_is_refused_naming_what_a_command_gets():
    from trl_plugins.rollout.endpoint.agent import RolloutError

    with pytest.raises(RolloutError, match="this agent is a command, which gets both clients' variables.*drop client"):
        AgentEndpointRollout(command=[sys.executable, "-c", "pass"], client="anthropic")
    assert AgentEndpointRollout(command=[sys.executable, "-c", "pass"]).client is None
    assert AgentEndpointRollout(agent=async_agent).client == "openai"  # None's meaning for a function agent
