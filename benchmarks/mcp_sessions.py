"""What a process per trajectory costs for an MCP stdio server: start to first answer, and a call on a warm session.

    python benchmarks/mcp_sessions.py [--trajectories 20]

Prints the seconds per trajectory-session (start, one call, stop) against one call on a shared session, with the
test server (tests/mcp_servers/toy.py, an SDK MCPServer) and, when installed, mcp-server-time."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

from trl_plugins.protocols import as_tool, tool_episode
from trl_plugins.tools.mcp.plugin import McpTools

TOY = str(Path(__file__).resolve().parents[1] / "tests" / "mcp_servers" / "toy.py")


def measure(label: str, server: dict, tool: str, args: dict, n: int) -> None:
    shared = McpTools(mcpServers={"s": {**server, "session": "shared"}}, include=[tool])
    (t,) = [as_tool(x) for x in shared.member_tools()]
    calls = []
    for _ in range(n):
        start = time.perf_counter()
        asyncio.run(t(args))
        calls.append(time.perf_counter() - start)
    shared.close()
    per = McpTools(mcpServers={"s": {**server, "session": "per_trajectory"}}, include=[tool])
    (p,) = [as_tool(x) for x in per.member_tools()]
    sessions = []

    async def one() -> None:
        async with tool_episode([p]):
            await p(args)

    for _ in range(n):
        start = time.perf_counter()
        asyncio.run(one())
        sessions.append(time.perf_counter() - start)
    per.close()
    print(f"{label}: shared call {statistics.median(calls) * 1e3:.1f} ms (median of {n}); per-trajectory "
          f"start+call+stop {statistics.median(sessions):.2f} s (median), {max(sessions):.2f} s (max)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=20)
    n = parser.parse_args().trajectories
    measure("toy (MCPServer)", {"command": sys.executable, "args": [TOY]}, "add", {"a": 1, "b": 2}, n)
    if shutil.which("mcp-server-time"):
        measure("mcp-server-time", {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]},
                "get_current_time", {"timezone": "UTC"}, n)


if __name__ == "__main__":
    main()
