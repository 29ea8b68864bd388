"""The ``mcp`` tool plugin against real MCP servers (tests/mcp_servers/toy.py, the SDK's MCPServer) over stdio and
streamable HTTP: no mock of the protocol."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mcp")

from support.processes import alive, children_of, own_children, parent_pid
from trl_plugins.run.plugins import build_tools  # noqa: E402
from trl_plugins.tools.base import check_arguments  # noqa: E402
from trl_plugins.tools.mcp.plugin import McpTools  # noqa: E402

TOY = str(Path(__file__).parent / "mcp_servers" / "toy.py")


def _stdio(*extra: str, **kw) -> dict:
    return {"command": sys.executable, "args": [TOY, *extra], **kw}


def _call(tool, args):
    return asyncio.run(tool(args))


@pytest.fixture(scope="module")
def toy():
    tools = McpTools(mcpServers={"toy": _stdio(timeout_s=2, session="shared", max_concurrency=2)})
    by_name = {t.name: t for t in tools.member_tools()}
    yield tools, by_name
    tools.close()


@pytest.fixture(scope="module")
def http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, TOY, "http", str(port)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def test_one_run_tool_per_mcp_tool_with_its_schema(toy):
    tools, by_name = toy
    assert list(by_name) == [
        "add",
        "greet",
        "fail",
        "crash",
        "hang",
        "garbage",
        "picture",
        "ask",
        "nap",
        "remember",
        "recall",
    ]
    fn = by_name["add"].schema()["function"]
    assert fn["description"] == "Add two integers."
    assert fn["parameters"]["required"] == ["a", "b"] and fn["parameters"]["properties"]["a"]["type"] == "integer"
    line = tools.start_up()
    assert (
        line.startswith("1 MCP server(s), 11 tool(s): MCP server 'toy' (stdio, shared: ")
        and "protocol 2026-07-28" in line
    )


def test_build_tools_expands_the_set_and_include_exclude():
    config = SimpleNamespace(
        tools=["mcp"],
        tool_kwargs={
            "mcp": {
                "mcpServers": {"toy": _stdio(session="shared")},
                "include": ["add", "greet", "fail"],
                "exclude": ["fail"],
            }
        },
    )
    built = build_tools(config)
    try:
        assert list(built) == ["add", "greet"]
        assert built["add"].schema()["function"]["name"] == "add"
    finally:
        built["add"].close()
    with pytest.raises(ValueError, match=r"include names \['nope'\], which no server lists"):
        McpTools(mcpServers={"toy": _stdio()}, include=["nope"]).member_tools()


def test_observations_text_structured_is_error_and_dropped_image(toy):
    _, t = toy
    out = _call(t["add"], {"a": 2, "b": 3})
    assert (out.text, out.ok, out.infra_error) == ("5", True, None)
    # No text block besides the structured content's own text? MCPServer sends the JSON as text: the text is used.
    assert '"greeting": "hello bo"' in _call(t["greet"], {"name": "bo"}).text
    failed = _call(t["fail"], {"why": "no"})
    assert failed.ok is False and failed.infra_error is None and "fail" in failed.text  # isError: an observation
    assert _call(t["picture"], {}).text == "a red dot\n[an image was dropped: image/png]"
    m = t["add"].step_metrics()
    assert m["mcp/add/calls"] == 1 and m["mcp/add/infra_errors"] == 0 and t["add"].step_metrics() == {}


def test_calls_to_a_server_run_within_its_concurrency_limit(toy):
    _, t = toy

    async def six() -> list:
        return await asyncio.gather(*(t["nap"]({"seconds": 0.2}) for _ in range(6)))

    outs = asyncio.run(six())
    assert max(int(o.text) for o in outs) == 2  # max_concurrency=2: the server never saw a third call at once


def test_hung_and_crashed_server_are_infra_errors_and_the_next_call_works():
    earlier = (
        own_children()
    )  # processes an earlier test in this worker left running (a warm sandbox) are not this test's
    tools = McpTools(mcpServers={"toy": _stdio(timeout_s=1, session="shared", idempotent=["add"])})
    t = {x.name: x for x in tools.member_tools()}
    try:
        hung = _call(t["hang"], {})
        assert hung.infra_error and "did not answer a call of 'hang' within 1 s" in hung.infra_error
        crashed = _call(t["crash"], {})
        assert (
            crashed.infra_error
            and crashed.infra_error.startswith("MCP server 'toy' (stdio, shared: ")
            and "closed the connection (it exited or crashed) during a call of 'crash'" in crashed.infra_error
        )
        assert _call(t["add"], {"a": 1, "b": 1}).text == "2"  # a new process answers
        garbage = _call(t["garbage"], {})  # a line that is not JSON-RPC: the call gets no answer
        assert garbage.infra_error and "did not answer a call of 'garbage'" in garbage.infra_error
        assert t["crash"].idempotent is False and t["add"].idempotent is True  # as declared: only 'add' is retried
    finally:
        before = own_children() - earlier
        tools.close()
    assert not (before & own_children()), "a server process outlived close()"


def test_server_that_cannot_start_is_refused_with_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)could not be started.*cannot open the database: /nonexistent.db"):
        McpTools(mcpServers={"db": _stdio("broken")}, start_timeout_s=10).member_tools()


def test_a_bare_command_is_found_in_the_interpreters_scripts_folder_and_shown_as_found(tmp_path, monkeypatch):
    # The venv's interpreter without its bin folder on PATH (a job script, an IDE): a server installed in the run's
    # own environment is found there; the path found is what runs and what the start-up report shows.
    from trl_plugins.tools.sandbox import launcher

    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    server = scripts / "toy-mcp-server"
    server.write_text(f'#!/bin/sh\nexec {sys.executable} {TOY} "$@"\n')
    server.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(launcher, "interpreter_scripts", lambda: [str(scripts)])
    tools = McpTools(mcpServers={"toy": {"command": "toy-mcp-server", "session": "shared"}})
    try:
        assert tools._servers[0].command == str(server)
        assert f"MCP server 'toy' (stdio, shared: {server}, protocol " in tools.start_up()
        assert _call({t.name: t for t in tools.member_tools()}["add"], {"a": 2, "b": 3}).text == "5"
    finally:
        tools.close()


def test_a_bare_command_found_nowhere_is_refused_at_start_up_naming_both_places(tmp_path, monkeypatch):
    from trl_plugins.tools.sandbox import launcher
    from trl_plugins.tools.sandbox.launcher import sandbox_path

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(launcher, "interpreter_scripts", lambda: [str(tmp_path)])
    with pytest.raises(ValueError) as refused:
        McpTools(mcpServers={"gone": {"command": "no-such-mcp-server"}})  # refused before any server starts
    message = str(refused.value)
    assert message.startswith(
        "mcpServers['gone']: command 'no-such-mcp-server' is found neither on PATH (/usr/bin:/bin)"
    )
    assert f"scripts folder ({tmp_path})" in message and "install it into this environment" in message
    assert "absolute path" in message and "\n" not in message
    # The PATH searched is the one the server gets: its own env's, or the sandbox's for a sandboxed server.
    with pytest.raises(ValueError, match=r"on PATH \(/nowhere\)"):
        McpTools(mcpServers={"gone": {"command": "no-such-mcp-server", "env": {"PATH": "/nowhere"}}})
    with pytest.raises(ValueError) as boxed:
        McpTools(mcpServers={"gone": {"command": "no-such-mcp-server", "sandbox": True}})
    assert f"on PATH ({sandbox_path()})" in str(boxed.value)
    # Negative control: a path with a slash is taken as given (checked when it starts, as before).
    assert McpTools(mcpServers={"x": {"command": "./no-such-mcp-server"}})._servers[0].command == "./no-such-mcp-server"


def test_the_time_server_starts_by_its_bare_name_with_only_the_interpreters_path(tmp_path):
    # The real console script, in a process whose PATH lacks the venv's bin (not activated): found next to the
    # interpreter (not through its symlink's target), and the start-up report names that path.
    pytest.importorskip("mcp_server_time")
    import os

    from trl_plugins.tools.sandbox.launcher import find_command, interpreter_scripts

    assert os.path.dirname(os.path.abspath(sys.executable)) in interpreter_scripts()
    expected = find_command("mcp-server-time", path="")  # in the interpreter's scripts folder, wherever PATH looks
    script = (
        "from trl_plugins.tools.mcp.plugin import McpTools\n"
        "tools = McpTools(mcpServers={'time': {'command': 'mcp-server-time', 'session': 'shared'}})\n"
        "print(tools.start_up())\ntools.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"MCP server 'time' (stdio, shared: {expected}, protocol " in done.stdout and "get_current_time" in done.stdout
    )


def test_name_clash_refused_or_prefixed():
    two = {"a": _stdio(session="shared"), "b": _stdio(session="shared")}
    with pytest.raises(ValueError, match="servers 'a' and 'b' both offer a tool 'add'; set prefix_tools"):
        McpTools(mcpServers=two).member_tools()
    # A name left out clashes with nothing: it was refused although neither server's 'add' would be shown.
    tiny = {
        "command": sys.executable,
        "args": ["-I", "-S", str(Path(__file__).parent / "mcp_servers" / "tiny.py")],
        "env": {"TINY_ALSO_OFFERS": "add"},
        "session": "shared",
    }
    mixed = {"a": _stdio(session="shared"), "t": tiny}
    with pytest.raises(
        ValueError, match="servers 'a' and 't' both offer a tool 'add'.*exclude: \\['add'\\] leaves out both"
    ):
        McpTools(mcpServers=mixed).member_tools()
    left = McpTools(mcpServers=mixed, exclude=["add"])
    try:
        names = {x.name for x in left.member_tools()}
        assert "add" not in names and {"greet", "echo"} <= names
    finally:
        left.close()
    tools = McpTools(mcpServers=two, prefix_tools=True, include=["a__add", "b__add"])
    try:
        t = {x.name: x for x in tools.member_tools()}
        assert list(t) == ["a__add", "b__add"] and _call(t["b__add"], {"a": 4, "b": 4}).text == "8"
    finally:
        tools.close()


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
def test_elicitation_ends_the_call_as_the_tools_failure(protocol):
    tools = McpTools(mcpServers={"toy": _stdio(session="shared", protocol=protocol)}, include=["ask"])
    try:
        (ask,) = tools.member_tools()
        out = _call(ask, {"question": "which?"})
        assert (out.ok, out.infra_error) == (False, None) and "asked for input from the client" in out.text
        assert tools.input_requests() == 1
    finally:
        tools.close()


@pytest.mark.parametrize("protocol,version", [("auto", "2026-07-28"), ("legacy", "2025-11-25")])
def test_streamable_http_both_protocol_revisions(http_server, protocol, version):
    tools = McpTools(mcpServers={"web": {"url": http_server, "protocol": protocol}})
    try:
        t = {x.name: x for x in tools.member_tools()}
        assert tools._conns["web"].protocol_version == version
        assert _call(t["add"], {"a": 20, "b": 22}).text == "42"
    finally:
        tools.close()


def test_arguments_checked_as_json_schema_2020_12():
    schema = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {
                "type": "object",
                "$defs": {"unit": {"enum": ["c", "f"]}},
                "properties": {
                    "where": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                    "unit": {"$ref": "#/$defs/unit"},
                    "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
                "required": ["where"],
            },
        },
    }
    assert check_arguments(schema, {"where": {"city": "Oslo"}, "unit": "c", "n": None}) is None
    assert "at 'where'" in check_arguments(schema, {"where": {}})
    assert "'k' is not one of ['c', 'f']" in check_arguments(schema, {"where": {"city": "x"}, "unit": "k"})
    assert "at 'n'" in check_arguments(schema, {"where": {"city": "x"}, "n": "3"})


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="exactly one of mcpServers"):
        McpTools()
    with pytest.raises(ValueError, match="needs exactly one of 'command'"):
        McpTools(mcpServers={"x": {"args": []}})
    with pytest.raises(ValueError, match=r"unknown keys \['comand'\]"):
        McpTools(mcpServers={"x": {"comand": "y"}})
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"toy": {"command": "python", "args": ["x.py"]}}}')
    assert McpTools(config=str(path))._servers[0].args == ("x.py",)


def test_per_trajectory_sessions_never_share_state_and_leave_nothing(tmp_path, monkeypatch):
    from trl_plugins.protocols import as_tool, tool_episode

    # The working directories go to a temporary folder of this test's own: another test (or run) on the machine may
    # make mcp-toy-* folders in the shared one meanwhile.
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))

    (tmp_path / "repo.txt").write_text("r")
    tools = McpTools(
        mcpServers={
            "toy": {
                "command": sys.executable,
                "args": [TOY, "stdio", "{workdir}"],
                "cwd": "/",
                "copy": str(tmp_path / "repo.txt"),
            }
        },
        include=["remember", "recall"],
    )
    t = {x.name: as_tool(x) for x in tools.member_tools()}
    assert tools.live_sessions() == 0  # listed at start-up, then stopped: each trajectory starts its own
    seen = {}

    async def trajectory(word: str) -> None:
        async with tool_episode(t.values()):
            assert (await t["remember"]({"word": word})).text == "ok"
            await asyncio.sleep(0.2)  # both trajectories' servers are up at once
            seen[word] = (await t["recall"]({})).text
            seen[word + "_pids"] = own_children()
            seen[word + "_dirs"] = set(private.glob("mcp-toy-*"))

    async def both() -> None:
        await asyncio.gather(trajectory("a"), trajectory("b"))

    try:
        before, dirs = own_children(), set(private.glob("mcp-toy-*"))
        asyncio.run(both())
        # Its own process (memory), its own directory (the file; {workdir} in args), each with the copy.
        assert seen["a"] == "a|a|memory.txt,repo.txt" and seen["b"] == "b|b|memory.txt,repo.txt"
        assert len(seen["a_pids"] - before) >= 2 and tools.sessions_started == 2
        assert tools.live_sessions() == 0 and not ((seen["a_pids"] | seen["b_pids"]) - before) & own_children()
        assert dirs == set() and len(seen["a_dirs"]) == 2  # both trajectories' working directories, while they ran
        assert set(private.glob("mcp-toy-*")) == set()  # gone
    finally:
        tools.close()


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_no_server_outlives_a_killed_trainer(tmp_path, sig):
    """A process holding a stdio server dies of SIGKILL or SIGTERM (no handler, no close()): the server (under the
    reaper) dies with it."""
    import os
    import signal

    script = tmp_path / "trainer.py"
    script.write_text(f"""
import sys, time
from trl_plugins.tools.mcp.plugin import McpTools
tools = McpTools(mcpServers={{"toy": {{"command": sys.executable, "args": [{TOY!r}], "session": "shared"}}}})
tools.member_tools()
print("ready", flush=True)
time.sleep(60)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        below = [
            int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and parent_pid(int(d.name)) == proc.pid
        ]
        assert below, "the server process was not found"
        server_pids = below + [p for b in below for p in children_of(b)]
        os.kill(proc.pid, getattr(signal, sig))
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in server_pids):
            time.sleep(0.05)
        assert not [p for p in server_pids if alive(p)]
    finally:
        proc.kill()


def test_rollout_prompt_observation_tokens_invalid_action_and_environment_error():
    """The real engine with a scripted policy: the template shows the MCP tools, an observation's tokens are the
    tool's text, arguments breaking the schema are invalid_action, a server dying mid-call ends only its trajectory
    (environment_error: per-trajectory processes), and every trajectory's server is stopped at its end."""
    from trl_plugins.protocols import as_tool
    from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest, ScriptedBackend
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.types import StopReason, TokenSource

    tools = McpTools(mcpServers={"toy": _stdio()}, include=["add", "crash"])
    members = {t.name: as_tool(t) for t in tools.member_tools()}
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [t.schema() for t in members.values()])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + [im_end]

    calls = {
        "add": '{"name": "add", "arguments": {"a": 2, "b": 3}}',
        "bad": '{"name": "add", "arguments": {"a": [2], "b": 3}}',
        "crash": '{"name": "crash", "arguments": {}}',
    }
    firsts = {
        k: chat.initial_prompt_ids([{"role": "user", "content": " ".join([k] * (i + 1))}]) for i, k in enumerate(calls)
    }
    assert all(f'"name": "{n}"' in tok.decode(firsts["add"]) for n in ("add", "crash"))  # the model is shown them
    by_len = {len(v): k for k, v in firsts.items()}
    assert len(by_len) == 3

    def policy(prompt: list[int]) -> list[int]:
        if len(prompt) in by_len:
            return ids(f"<tool_call>\n{calls[by_len[len(prompt)]]}\n</tool_call>")
        return ids("The answer is \\boxed{5}.")

    backend = ScriptedBackend(policy, stop_token_ids=chat.stop_token_ids)
    questions = [RolloutQuestion(k, firsts[k], group_id=i) for i, k in enumerate(calls)]
    try:
        before = own_children()
        result = MultiTurnRollout(max_turns=3, max_trajectory_tokens=2048)(
            RolloutRequest(questions, 1, backend, chat, members)
        )
        add, bad, crash = result.trajectories
        assert add.stop_reason == StopReason.FINAL_ANSWER
        observation = [
            t
            for t, s in zip(add.turns[1].prompt_ids[-len(add.turns[1].prompt_sources) :], add.turns[1].prompt_sources)
            if s == TokenSource.OBSERVATION
        ]
        assert tok.decode(observation) == "5"
        assert bad.stop_reason == StopReason.INVALID_ACTION and "argument 'a' must be of type integer" in bad.error
        assert crash.stop_reason == StopReason.ENVIRONMENT_ERROR and "exited or crashed" in crash.error
        assert tools.live_sessions() == 0 and not (own_children() - before)
    finally:
        tools.close()


def test_docs_example_parses_and_its_key_table_is_the_configs(tmp_path, monkeypatch):
    import re

    import yaml

    from trl_plugins.tools.mcp.config import OUR_KEYS, load_servers

    text = (Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    raw = example["tool_kwargs"]["mcp"]["mcpServers"]
    raw["notes"]["copy"] = __file__  # the example's seed_notes/ is not here
    stubs = tmp_path / "bin"  # its commands are looked up at start-up: stand-ins, wherever the real ones are
    stubs.mkdir()
    for name in ("mcp-server-time", "python"):
        (stubs / name).write_text("#!/bin/sh\n")
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(stubs))
    servers = {s.name: s for s in load_servers(raw, None)}
    assert servers["time"].session == "shared" and servers["notes"].session == "per_trajectory"
    assert servers["time"].command == str(stubs / "mcp-server-time")  # a bare name, as found on PATH
    assert servers["docs"].transport == "http" and servers["docs"].headers == {"Authorization": "Bearer ..."}
    table = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert table == OUR_KEYS - {"type"}


def _marked(mark: str) -> set[int]:
    """Processes whose environment holds ``TOY_MARK=mark`` (a test's servers, wherever they were started)."""
    import os

    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"TOY_MARK={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    found.add(int(d.name))
            except OSError:
                pass
    found.discard(os.getpid())
    return found


def _below_a_spawned_process(pid: int) -> bool:
    """Whether an ancestor of ``pid`` is a process multiprocessing spawned (the generation replica)."""
    import os

    while (pid := parent_pid(pid)) > 1 and pid != os.getpid():
        try:
            if b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            return False
    return False


@pytest.mark.slow
def test_mcp_tools_start_in_the_asynchronous_replica_and_leave_nothing(tmp_path):
    # Asynchronous rollouts sample in a spawned replica process that gets the run's tools pickled: the MCP tool set
    # must be started there (its shared server running while steps train) and leave no server when training ends.
    import uuid

    from transformers import TrainerCallback

    from support.trainer import TokenReward, tiny_config, tiny_dataset
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    mark = uuid.uuid4().hex
    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append({pid: _below_a_spawned_process(pid) for pid in _marked(mark)})

    tok = build_tokenizer("qwen2_5")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=2,
        async_rollouts=True,
        tools=["mcp"],
        tool_kwargs={
            "mcp": {"mcpServers": {"toy": _stdio(session="shared", env={"TOY_MARK": mark})}, "include": ["add"]}
        },
    )
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        config,
        train_dataset=tiny_dataset(8),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.add_callback(Look())
    trainer.train()
    assert len(seen) == 2 and all(seen), seen  # a server of the run's running at each step
    # ... the replica's own: a server below the spawned replica process, not below the trainer's process alone.
    assert any(spawned for pids in seen for spawned in pids.values()), seen
    deadline = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(mark)


def test_a_tool_set_is_a_declared_seam_and_summary_json_records_each_plugin_by_name(tmp_path):
    # Before: record.py paired config.tools with the built tools by position, so with tools [mcp, code_interpreter]
    # summary.json gave 'mcp' the settings of the toy server's first tool and 'code_interpreter' its second's.
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from retool.config import parse_args
    from retool.record import run_record
    from trl_plugins.protocols import ToolSet, is_tool_set, tools_of
    from trl_plugins.run import resolve_run

    assert isinstance(McpTools(mcpServers={"toy": _stdio()}), ToolSet) and is_tool_set(
        McpTools(mcpServers={"toy": _stdio()})
    )
    servers = {"mcpServers": {"toy": _stdio(session="shared")}}
    import json

    script_args, args = parse_args(
        [
            "--tools",
            "mcp",
            "code_interpreter",
            "--tool_kwargs",
            json.dumps({"mcp": servers, "code_interpreter": {"timeout_s": 7.0}}),
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    run = resolve_run(args)
    try:
        members = [t.name for t in run.tools.values() if t.configured == "mcp"]
        assert len(members) > 1 and all(run.tools[m].tool_set is not None for m in members)
        assert run.tools["code_interpreter"].configured == "code_interpreter"
        assert run.tools["code_interpreter"].tool_set is None
        record = run_record(script_args, args, run)["plugins"]["tools"]
        by_name = {entry["name"]: entry for entry in record}
        assert by_name["mcp"]["object"] == "trl_plugins.tools.mcp.plugin:McpTools"
        assert by_name["mcp"]["members"] == members
        assert by_name["code_interpreter"]["object"].endswith(":CodeInterpreter")
        assert (
            by_name["code_interpreter"]["kwargs"]["timeout_s"] == 7.0 and "members" not in by_name["code_interpreter"]
        )
    finally:
        run.close()
    # A set that lists no tool is refused, naming it; a single tool is its own one member.
    from trl_plugins.protocols import PluginDeclarationError

    class Empty:
        def member_tools(self):
            return []

    with pytest.raises(PluginDeclarationError, match="member_tools\\(\\) listed no tool"):
        tools_of(Empty(), "empty")
    (one,) = tools_of(run.tools["code_interpreter"].impl, "code_interpreter")
    assert one.configured == "code_interpreter" and one.tool_set is None
