"""A stdio MCP server inside the project's sandbox (``sandbox:``; trl_plugins/tools/mcp/isolation.py), against a real
server (tests/mcp_servers/files.py) that reads, writes and connects where the model asks, under every isolation that
works here, with the same server outside the sandbox as the control that shows each check can fail."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from trl_plugins.tools.mcp.plugin import McpTools  # noqa: E402
from trl_plugins.tools.sandbox import launcher, probing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVERS = str(REPO / "tests" / "mcp_servers")
FILES = str(REPO / "tests" / "mcp_servers" / "files.py")
TOY = str(REPO / "tests" / "mcp_servers" / "toy.py")
SECRET = "sk-trl-mcp-" + uuid.uuid4().hex
ISOLATIONS = [
    i.value
    for i in (launcher.Isolation.BWRAP, launcher.Isolation.UNSHARE)
    if probing.probe(i, launcher.resolve_program(i)) is None
]
needs_isolation = pytest.mark.skipif(not ISOLATIONS, reason="no sandbox isolation works here (bwrap or unshare)")


def _files(sandbox: dict | None, **kw) -> dict:
    return {
        "command": sys.executable,
        "args": [FILES],
        "session": "shared",
        "timeout_s": 20,
        **({"sandbox": sandbox} if sandbox is not None else {}),
        **kw,
    }


def _call(tool, args) -> str:
    return asyncio.run(tool(args)).text


def _tree() -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out[int(d.name)] = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _below(root: int) -> set[int]:
    tree, found, todo = _tree(), set(), [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in tree.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def host(tmp_path):
    """A secret file and a listening socket on the host, and a path where nothing may be written."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield secret, tmp_path / "planted.txt", listener.getsockname()[1]


def test_unsandboxed_control_reaches_the_host(host):
    """The control: the same server without ``sandbox`` reads the secret, writes outside and connects."""
    secret, planted, port = host
    tools = McpTools(mcpServers={"files": _files(None)})
    try:
        t = {x.name: x for x in tools.member_tools()}
        assert _call(t["read"], {"path": str(secret)}) == SECRET
        assert _call(t["write"], {"path": str(planted), "text": "x"}) == "ok" and planted.exists()
        assert _call(t["connect"], {"port": port}) == "ok"
        assert "MCPServer" in _call(t["read"], {"path": TOY})
    finally:
        tools.close()


@needs_isolation
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sandboxed_server_cannot_read_write_or_connect_outside_its_directory(host, isolation):
    secret, planted, port = host
    me, before = time.time(), _below(os.getpid())
    tools = McpTools(
        mcpServers={"files": _files({"isolation": isolation, "readable": [SERVERS], "hidden": [TOY], "memory_mb": 512})}
    )
    try:
        t = {x.name: x for x in tools.member_tools()}
        processes = _below(os.getpid()) - before  # the reaper and everything below it
        assert f"stdio, shared, sandboxed ({isolation})" in tools.start_up()
        conn = tools._conns["files"]
        cgroup = conn._sandboxed.cgroup
        assert _call(t["read"], {"path": str(secret)}) == "ERR FileNotFoundError"  # the host's /tmp is not there
        assert _call(t["read"], {"path": str(REPO / "pyproject.toml")}) == "ERR FileNotFoundError"  # nor the checkout
        assert "MCPServer" in _call(t["read"], {"path": FILES})  # what `readable` shows, read-only
        assert "MCPServer" not in _call(t["read"], {"path": TOY})  # but not what `hidden` hides there (/dev/null)
        assert _call(t["alloc"], {"mb": 1024}) == "ERR MemoryError"  # memory_mb: its address space
        assert _call(t["write"], {"path": str(planted), "text": "x"}).startswith("ERR") and not planted.exists()
        beside = Path(SERVERS) / f"planted-{me}.txt"
        assert _call(t["write"], {"path": str(beside), "text": "x"}) == "ERR OSError" and not beside.exists()  # EROFS
        assert _call(t["connect"], {"port": port}).startswith("ERR")  # no network: the host's loopback is not its
        assert _call(t["write"], {"path": "note.txt", "text": "mine"}) == "ok"  # its own directory is writable
        assert _call(t["read"], {"path": "note.txt"}) == "mine"
        assert _call(t["where"], {}) == f"{launcher.SCRATCH}|note.txt"
        if cgroup is not None:  # its own cgroup holds the server
            procs = {int(x) for d in cgroup.dirs for x in Path(d, "cgroup.procs").read_text().split()}
            assert procs and procs <= processes
            dirs = list(cgroup.dirs)
    finally:
        tools.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in processes):
        time.sleep(0.05)
    assert not [p for p in processes if _alive(p)], "a process of the sandboxed server outlived close()"
    if cgroup is not None:
        assert not any(Path(d).exists() for d in dirs), "the server's cgroup was left behind"


@needs_isolation
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_network_only_where_configured(host, isolation):
    """``network: true`` keeps the host's network: the connection the default refuses (the test above) goes through."""
    _, _, port = host
    tools = McpTools(
        mcpServers={"files": _files({"isolation": isolation, "readable": [SERVERS], "network": True})},
        include=["connect", "read"],
    )
    try:
        t = {x.name: x for x in tools.member_tools()}
        assert _call(t["connect"], {"port": port}) == "ok"
        assert _call(t["read"], {"path": str(REPO / "pyproject.toml")}) == "ERR FileNotFoundError"  # files: as before
    finally:
        tools.close()


@needs_isolation
def test_sandboxed_per_trajectory_server_works_in_its_seeded_directory(tmp_path):
    from trl_plugins.protocols import as_tool, tool_episode

    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "repo.txt").write_text("r")
    tools = McpTools(
        mcpServers={
            "files": {
                "command": sys.executable,
                "args": [FILES, "{workdir}"],
                "copy": str(seed),
                "sandbox": {"isolation": ISOLATIONS[0], "readable": [SERVERS]},
            }
        },
        include=["where", "write", "read"],
    )
    t = {x.name: as_tool(x) for x in tools.member_tools()}
    seen = {}

    async def trajectory() -> None:
        async with tool_episode(t.values()):
            assert (await t["write"]({"path": "note.txt", "text": "n"})).text == "ok"
            seen["where"] = (await t["where"]({})).text
            seen["seed"] = (await t["write"]({"path": str(seed / "repo.txt"), "text": "changed"})).text

    try:
        asyncio.run(trajectory())
        workdir, files = seen["where"].split("|")
        # {workdir} (the host's path, a private tmpfs inside), seeded with copy
        assert workdir.startswith(os.path.join(tempfile.gettempdir(), "mcp-files-")) and files == "note.txt,repo.txt"
        assert seen["seed"].startswith("ERR") and (seed / "repo.txt").read_text() == "r"  # the seed is read-only
        assert tools.live_sessions() == 0 and not Path(workdir).exists()
    finally:
        tools.close()


@pytest.mark.parametrize(
    "sandbox,extra,error",
    [
        ({"isolation": "none"}, {}, "'none' isolates nothing: leave sandbox out"),
        ({"net": True}, {}, r"unknown keys \['net'\]; it takes"),
        ({"network": "yes"}, {}, r"\['network'\] must be true or false"),
        ({"readable": ["relative/dir"]}, {}, "must be a list of absolute paths"),
        ({"readable": ["/"]}, {}, "shows '/', the whole host"),
        ({"memory_mb": 8}, {}, r"\['memory_mb'\] must be an integer >= 64"),
        (True, {"cwd": "/"}, "a sandboxed server works in its own writable directory"),
        ("yes", {}, "must be true, false or an object"),
    ],
)
def test_sandbox_config_errors_are_clear(sandbox, extra, error):
    with pytest.raises(ValueError, match=error):
        McpTools(mcpServers={"files": _files(sandbox, **extra)})
    with pytest.raises(ValueError, match="is an HTTP server: the sandbox runs stdio servers"):
        McpTools(mcpServers={"web": {"url": "http://127.0.0.1:1/mcp", "sandbox": True}})


def test_refused_at_start_up_where_no_isolation_works(monkeypatch):
    monkeypatch.setattr(probing, "probe", lambda iso, program=None: "bwrap not found on PATH (install bubblewrap: ...)")
    with pytest.raises(
        RuntimeError,
        match="asks for sandbox isolation 'bwrap', which does not work on this machine: bwrap not found on PATH",
    ) as refused:
        McpTools(mcpServers={"files": _files({"isolation": "bwrap"})}).member_tools()
    assert "check that the command runs" not in str(refused.value)  # the machine's failure, not the server's

    def nothing_works():
        raise RuntimeError("no sandbox isolation works here: bwrap: not found; unshare: EPERM")

    monkeypatch.setattr(probing, "detect_isolation", nothing_works)
    with pytest.raises(RuntimeError, match="is to run sandboxed, but no sandbox isolation works here: bwrap: not fo"):
        McpTools(mcpServers={"files": _files(True)}).member_tools()


@needs_isolation
def test_no_sandboxed_process_outlives_a_killed_trainer(tmp_path):
    """A process holding a sandboxed server dies of SIGKILL (no close()): the reaper takes the sandbox with it."""
    import signal
    import subprocess

    script = tmp_path / "trainer.py"
    server = _files({"isolation": ISOLATIONS[0], "readable": [SERVERS]})
    script.write_text(f"""
import time
from trl_plugins.tools.mcp.plugin import McpTools
tools = McpTools(mcpServers={{"files": {server!r}}})
tools.member_tools()
print("ready", flush=True)
time.sleep(60)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        processes = _below(proc.pid)
        assert len(processes) >= 3  # the reaper, the launch (bwrap or unshare), the runner, the server
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in processes):
            time.sleep(0.05)
        assert not [p for p in processes if _alive(p)]
    finally:
        proc.kill()
