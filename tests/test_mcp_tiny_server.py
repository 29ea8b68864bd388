"""The ``mcp`` tool plugin against tests/mcp_servers/tiny.py, a real stdio MCP server written with the standard
library only (it starts in ~70 ms, so a hundred per-trajectory sessions are cheap), and against the SDK's server
(tests/mcp_servers/toy.py) where the 2026-07-28 revision is needed: dropped media, the servers' versions in the
run version, no leftovers after many trajectories."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from trl_plugins.protocols import as_tool, tool_episode  # noqa: E402
from trl_plugins.tools.mcp.plugin import McpTools  # noqa: E402

HERE = Path(__file__).parent / "mcp_servers"
TINY, TOY = str(HERE / "tiny.py"), str(HERE / "toy.py")


def _tiny(*extra: str, **kw) -> dict:
    return {"command": sys.executable, "args": ["-I", "-S", TINY, *extra], **kw}


def _children() -> set[int]:
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


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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

    tools = McpTools(mcpServers={"tiny": _tiny("tinyserve", "1.2.3", session="shared"),
                                 "toy": {"command": sys.executable, "args": [TOY], "session": "shared"}},
                     include=["echo", "add"])
    try:
        members = {t.name: as_tool(t) for t in tools.member_tools()}
        expected = {"tiny": "tinyserve 1.2.3 (MCP server 'tiny', protocol 2025-11-25)",
                    "toy": "toy (no version) (MCP server 'toy', protocol 2026-07-28)"}
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
        earlier, fds = _children(), _fds()
        dirs = set(Path(tempfile.gettempdir()).glob("mcp-tiny-*"))
        servers = [p for _ in range(10) for p in asyncio.run(batch(10))]
        assert len(set(servers)) == 100 and tools.sessions_started == 102 and tools.live_sessions() == 0
        assert not (_children() - earlier), "a reaper outlived its trajectory"
        assert not [p for p in servers if _alive(p)], "a server outlived its trajectory"
        assert _fds() == fds, "descriptors leaked"
        assert set(Path(tempfile.gettempdir()).glob("mcp-tiny-*")) == dirs
    finally:
        tools.close()
