"""The ``mcp`` tool plugin against tests/mcp_servers/tiny.py, a real stdio MCP server written with the standard
library only (it starts in ~70 ms, so a hundred per-trajectory sessions are cheap), and against the SDK's server
(tests/mcp_servers/toy.py) where the 2026-07-28 revision is needed: dropped media, the servers' versions in the
run version, no leftovers after many trajectories."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from support.processes import alive, own_children  # noqa: E402 - the same process helpers
from trl_plugins.protocols import as_tool, tool_episode  # noqa: E402
from trl_plugins.tools.mcp.plugin import McpTools  # noqa: E402

HERE = Path(__file__).parent / "mcp_servers"
TINY, TOY = str(HERE / "tiny.py"), str(HERE / "toy.py")


def _tiny(*extra: str, **kw) -> dict:
    return {"command": sys.executable, "args": ["-I", "-S", TINY, *extra], **kw}


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def test_a_result_of_only_media_is_a_placeholder_naming_what_was_dropped():
    """MCP gives a tool no way to declare that its output is only images, audio or resources (docs/tools.md), so
    nothing is refused at start-up: each such result is shown to the model as a placeholder (token-exact text)."""
    tools = McpTools(mcpServers={"tiny": _tiny(session="shared")}, include=["media"])
    try:
        (media,) = tools.member_tools()
        seen = {kind: asyncio.run(media({"kind": kind})) for kind in ("image", "audio", "resource_link", "resource")}
    finally:
        tools.close()
    assert {k: (o.text, o.ok, o.infra_error) for k, o in seen.items()} == {
        "image": ("[an image was dropped: image/png]", True, None),
        "audio": ("[audio was dropped: audio/wav]", True, None),
        "resource_link": ("[a resource link was dropped: file:///srv/report.pdf (application/pdf)]", True, None),
        "resource": ("[an embedded resource was dropped: file:///srv/notes.txt (text/plain)]", True, None),
    }


def test_each_servers_name_and_version_is_its_tools_declared_version():
    """The handshake's serverInfo (tiny) and the 2026-07-28 discover stamp (toy, whose MCPServer has an empty
    version), with the revision spoken: what the run version records per tool (``plugin_version``)."""
    from trl_plugins.run.version import plugin_version

    tools = McpTools(
        mcpServers={
            "tiny": _tiny("tinyserve", "1.2.3", session="shared"),
            "toy": {"command": sys.executable, "args": [TOY], "session": "shared"},
        },
        include=["echo", "add"],
    )
    try:
        members = {t.name: as_tool(t) for t in tools.member_tools()}
        expected = {
            "tiny": "tinyserve 1.2.3 (MCP server 'tiny', protocol 2025-11-25)",
            "toy": "toy (no version) (MCP server 'toy', protocol 2026-07-28)",
        }
        assert tools.server_versions() == expected
        assert {n: plugin_version(t) for n, t in members.items()} == {"echo": expected["tiny"], "add": expected["toy"]}
    finally:
        tools.close()
    assert tools.server_versions() == expected  # kept after close: recording it does not restart the servers
    assert tools._loop is None


@pytest.mark.slow
def test_a_hundred_trajectories_leave_no_process_no_descriptor_no_directory():
    """100 trajectories, 10 at a time, each with its own server process (per_trajectory) ended with the
    trajectory: afterwards no server or reaper process runs, this process holds the descriptors it held before,
    and no working directory is left."""
    tools = McpTools(mcpServers={"tiny": _tiny()}, include=["pid"])
    (pid,) = [as_tool(t) for t in tools.member_tools()]

    async def trajectory() -> int:
        async with tool_episode([pid]):
            out = await pid({})
            assert out.ok, out.infra_error
            return int(out.text)

    async def batch(n: int) -> list[int]:
        return await asyncio.gather(*(trajectory() for _ in range(n)))

    try:
        asyncio.run(batch(2))  # the client's loop thread and its first session's one-off state exist from here on
        # Garbage of earlier tests in this worker (a pipe, a socket) is closed now, not when a collection happens to
        # run mid-test (CI once saw 10 descriptors fewer after than before).
        gc.collect()
        earlier, fds = own_children(), _fds()
        dirs = set(Path(tempfile.gettempdir()).glob("mcp-tiny-*"))
        servers = [p for _ in range(10) for p in asyncio.run(batch(10))]
        assert len(set(servers)) == 100 and tools.sessions_started == 102 and tools.live_sessions() == 0
        assert not (own_children() - earlier), "a reaper outlived its trajectory"
        assert not [p for p in servers if alive(p)], "a server outlived its trajectory"
        gc.collect()
        assert _fds() == fds, "descriptors leaked"
        assert set(Path(tempfile.gettempdir()).glob("mcp-tiny-*")) == dirs
    finally:
        tools.close()


def _echo_policy(chat):
    """Scripted samples: ``calls=N``: N turns each calling echo (``par``: two calls in the first turn; ``oops``: the
    tool oops instead), then an answer."""
    import re

    from trl_plugins.rollout import ScriptedBackend

    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        done = text.count("<tool_response>")
        question = re.findall(r"user\n(.*?)<\|im_end\|>", text, re.DOTALL)[0]
        wanted = int(re.search(r"calls=(\d+)", question).group(1))
        if done < wanted:
            n = 2 if "par" in question and done == 0 else 1
            calls = (
                ['{"name": "oops", "arguments": {"why": "no"}}']
                if "oops" in question
                else [f'{{"name": "echo", "arguments": {{"text": "said {done + j}"}}}}' for j in range(n)]
            )
            body = "".join(f"\n<tool_call>\n{c}\n</tool_call>" for c in calls)
        else:
            body = "The answer is \\boxed{7}."
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


async def _mcp_agent(client, row):
    """An OpenAI-SDK agent that asks the run for its tools (GET tools), sends them with its requests and has the run
    execute the model's calls (POST tools/call), in parallel within a turn."""
    tools = (await client.get("tools", cast_to=object))["data"]
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        message = (
            (await client.chat.completions.create(model="policy", messages=messages, tools=tools)).choices[0].message
        )
        messages.append(message)
        if not message.tool_calls:
            return 1.0
        outs = await asyncio.gather(
            *(
                client.post(
                    "tools/call",
                    cast_to=object,
                    body={"name": c.function.name, "arguments": c.function.arguments, "tool_call_id": c.id},
                )
                for c in message.tool_calls
            )
        )
        messages.extend(
            {"role": "tool", "tool_call_id": c.id, "content": o["content"]} for c, o in zip(message.tool_calls, outs)
        )


def test_an_endpoint_agent_gets_the_mcp_tools_and_trains_the_built_in_rollouts_tokens():
    """The agent endpoint offers the run's MCP tools as OpenAI function tools and runs their calls in the
    trajectory's own per-trajectory server: token for token the built-in rollout's trajectories (the observation is
    the tool's text), and no server left afterwards."""
    pytest.importorskip("openai")
    from trl_plugins.datum import build_datums
    from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest
    from trl_plugins.rollout.endpoint import AgentEndpointRollout
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.types import StopReason, TokenSource

    tools = McpTools(mcpServers={"tiny": _tiny()}, include=["echo", "oops"])
    members = {t.name: t for t in tools.member_tools()}
    chat = ChatFormat(
        build_tokenizer("qwen2_5"),
        [t.schema() for t in members.values()],
        final_answer_pattern=r"\\boxed\{",
        calls_per_turn=2,
    )
    prompts = ["calls=1", "par calls=2", "calls=0", "oops calls=1"]

    def request():
        qs = [
            RolloutQuestion(f"q{i}", chat.initial_prompt_ids([{"role": "user", "content": p}]), i, row={"prompt": p})
            for i, p in enumerate(prompts)
        ]
        return RolloutRequest(qs, 1, _echo_policy(chat), chat, members, policy_step=1, seed=3)

    try:
        earlier = own_children()
        built_in = MultiTurnRollout(max_tool_calls_per_turn=2)(request())
        started = tools.sessions_started
        served = AgentEndpointRollout(agent=_mcp_agent, max_tool_calls_per_turn=2)(request())
        assert tools.sessions_started - started == 3  # the three trajectories that called: a server each
        assert tools.live_sessions() == 0 and not (own_children() - earlier)
        for a, b in zip(built_in.trajectories, served.trajectories, strict=True):
            assert b.stop_reason == a.stop_reason == StopReason.FINAL_ANSWER, b.error
            assert [t.prompt_ids for t in b.turns] == [t.prompt_ids for t in a.turns]
            assert [t.prompt_sources for t in b.turns] == [t.prompt_sources for t in a.turns]
            assert [t.completion_ids for t in b.turns] == [t.completion_ids for t in a.turns]
            assert [[(c.name, c.arguments, c.output, c.ok) for c in t.tool_calls] for t in b.turns] == [
                [(c.name, c.arguments, c.output, c.ok) for c in t.tool_calls] for t in a.turns
            ]
            assert build_datums(b, advantage=1.0) == build_datums(a, advantage=1.0)
        par = served.trajectories[1].turns[1]
        observed = [
            t
            for t, s in zip(par.prompt_ids[-len(par.prompt_sources) :], par.prompt_sources)
            if s == TokenSource.OBSERVATION
        ]
        assert chat.tokenizer.decode(observed) == "said 0said 1"  # both parallel calls' outputs, nothing else
        failed = served.trajectories[3].turns[0].tool_calls[0]
        assert (failed.output, failed.ok) == ("failed: no", False)  # isError: an observation, recorded not ok
    finally:
        tools.close()


def test_the_tool_routes_answer_a_tools_error_refuse_an_unknown_tool_and_end_on_a_failed_tool():
    openai = pytest.importorskip("openai")
    from trl_plugins.rollout import ChatFormat, RolloutQuestion, RolloutRequest
    from trl_plugins.rollout.endpoint import AgentEndpointRollout
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.types import StopReason

    class Broken:
        name = "broken"

        def schema(self) -> dict:
            return {
                "type": "function",
                "function": {
                    "name": "broken",
                    "description": "Fails.",
                    "parameters": {"type": "object", "properties": {}},
                },
            }

        async def __call__(self, arguments: dict):
            raise OSError("the disk is gone")

    class Sulky(Broken):
        name = "sulky"

        def schema(self) -> dict:
            return {"type": "function", "function": {**super().schema()["function"], "name": "sulky"}}

        async def __call__(self, arguments: dict):
            from trl_plugins.tools.base import ToolOutput

            return ToolOutput(text="Error: not today.", ok=False)  # the tool's own error (an MCP isError)

    seen = {}

    async def agent(client, row):
        tools = (await client.get("tools", cast_to=object))["data"]
        seen["sulky"] = await client.post("tools/call", cast_to=object, body={"name": "sulky", "arguments": {}})
        seen["tools"] = tools
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}], tools=tools
        )
        for name, body in (
            ("unknown", {"name": "nope"}),
            ("bad", {"name": "broken", "arguments": "{"}),
            ("broken", {"name": "broken", "arguments": "{}"}),
        ):
            try:
                await client.post("tools/call", cast_to=object, body=body)
            except openai.APIStatusError as exc:
                seen[name] = (
                    exc.status_code,
                    exc.body["code"] if isinstance(exc.body, dict) else exc.body,
                    exc.message,
                )
        return 1.0

    chat = ChatFormat(
        build_tokenizer("qwen2_5"), [Broken().schema(), Sulky().schema()], final_answer_pattern=r"\\boxed\{"
    )
    q = RolloutQuestion(
        "q", chat.initial_prompt_ids([{"role": "user", "content": "calls=0"}]), 0, row={"prompt": "calls=0"}
    )
    (traj,) = AgentEndpointRollout(agent=agent)(
        RolloutRequest([q], 1, _echo_policy(chat), chat, {"broken": Broken(), "sulky": Sulky()})
    ).trajectories
    assert seen["tools"] == [Broken().schema(), Sulky().schema()]
    assert seen["sulky"] == {"content": "Error: not today.", "ok": False}
    assert seen["unknown"][:2] == (404, "unknown_tool") and "GET tools lists ['broken', 'sulky']" in seen["unknown"][2]
    assert seen["bad"][0] == 400 and "arguments is not JSON" in seen["bad"][2]
    assert seen["broken"][:2] == (502, "tool_failed")
    assert traj.stop_reason == StopReason.ENVIRONMENT_ERROR and traj.error == "tool 'broken': OSError: the disk is gone"
