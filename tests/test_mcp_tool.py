"""The ``mcp`` tool plugin against real MCP servers (tests/mcp_servers/toy.py, the SDK's MCPServer) over stdio and
streamable HTTP: no mock of the protocol."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mcp")

from trl_plugins.run.plugins import build_tools  # noqa: E402
from trl_plugins.tools.base import check_arguments  # noqa: E402
from trl_plugins.tools.mcp.plugin import McpTools  # noqa: E402

TOY = str(Path(__file__).parent / "mcp_servers" / "toy.py")


def _stdio(*extra: str, **kw) -> dict:
    return {"command": sys.executable, "args": [TOY, *extra], **kw}


def _children() -> set[int]:
    import os

    me = str(os.getpid())
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "stat").read_text().split(") ", 1)[1].split()[1] == me:
                    out.add(int(d.name))
            except (OSError, IndexError):
                pass
    return out


def _call(tool, args):
    return asyncio.run(tool(args))


@pytest.fixture(scope="module")
def toy():
    tools = McpTools(mcpServers={"toy": _stdio(timeout_s=2)})
    by_name = {t.name: t for t in tools.member_tools()}
    yield tools, by_name
    tools.close()


@pytest.fixture(scope="module")
def http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, TOY, "http", str(port)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
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
    assert list(by_name) == ["add", "greet", "fail", "crash", "hang", "garbage", "picture", "ask", "remember", "recall"]
    fn = by_name["add"].schema()["function"]
    assert fn["description"] == "Add two integers."
    assert fn["parameters"]["required"] == ["a", "b"] and fn["parameters"]["properties"]["a"]["type"] == "integer"
    line = tools.start_up()
    assert line.startswith("1 MCP server(s), 10 tool(s): toy (stdio: ") and "protocol 2026-07-28" in line


def test_build_tools_expands_the_set_and_include_exclude():
    config = SimpleNamespace(tools=["mcp"], tool_kwargs={"mcp": {"mcpServers": {"toy": _stdio()},
                                                                 "include": ["add", "greet", "fail"], "exclude": ["fail"]}})
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


def test_hung_and_crashed_server_are_infra_errors_and_the_next_call_works():
    tools = McpTools(mcpServers={"toy": _stdio(timeout_s=1)})
    t = {x.name: x for x in tools.member_tools()}
    try:
        hung = _call(t["hang"], {})
        assert hung.infra_error and "did not answer a call of 'hang' within 1 s" in hung.infra_error
        crashed = _call(t["crash"], {})
        assert crashed.infra_error and crashed.infra_error.startswith("MCP server 'toy' (stdio: ")
        assert _call(t["add"], {"a": 1, "b": 1}).text == "2"  # a new process answers
        assert t["crash"].idempotent is False  # not declared: never retried
    finally:
        before = _children()
        tools.close()
    assert not (before & _children()), "a server process outlived close()"


def test_server_that_cannot_start_is_refused_with_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)could not be started.*cannot open the database: /nonexistent.db"):
        McpTools(mcpServers={"db": _stdio("broken")}, start_timeout_s=10).member_tools()


def test_name_clash_refused_or_prefixed():
    two = {"a": _stdio(), "b": _stdio()}
    with pytest.raises(ValueError, match="servers 'a' and 'b' both offer a tool 'add'; set prefix_tools"):
        McpTools(mcpServers=two).member_tools()
    tools = McpTools(mcpServers=two, prefix_tools=True, include=["a__add", "b__add"])
    try:
        t = {x.name: x for x in tools.member_tools()}
        assert list(t) == ["a__add", "b__add"] and _call(t["b__add"], {"a": 4, "b": 4}).text == "8"
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
    schema = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "$defs": {"unit": {"enum": ["c", "f"]}},
        "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                       "unit": {"$ref": "#/$defs/unit"}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["where"]}}}
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
