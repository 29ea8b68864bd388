"""What a process per trajectory costs for an MCP stdio server: start to first answer, and a call on a warm session.

    python benchmarks/mcp_sessions.py [--trajectories 20]

Prints the seconds per trajectory-session (start, one call, stop) against one call on a shared session, with the
test server (tests/mcp_servers/toy.py, an SDK MCPServer) and, when installed, mcp-server-time; then the same for the
test server inside the sandbox (``sandbox:``), under each isolation that works here."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trl_plugins.protocols import as_tool, tool_episode
from trl_plugins.tools.mcp.plugin import McpTools
from trl_plugins.tools.sandbox import launcher, probing

SERVERS = Path(__file__).resolve().parents[1] / "tests" / "mcp_servers"
TOY = str(SERVERS / "toy.py")


def _below_me() -> tuple[int, float]:
    """Processes below this one and their resident memory (MB), from /proc."""
    parents, rss = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(") ", 1)[1].split()[1])
                rss[int(d.name)] = int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                pass
    found, todo = set(), [os.getpid()]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in found]
        found.update(kids)
        todo.extend(kids)
    return len(found), sum(rss.get(p, 0) for p in found) / 2**20


def measure(label: str, server: dict, tool: str, args: dict, n: int) -> None:
    start = time.perf_counter()
    shared = McpTools(mcpServers={"s": {**server, "session": "shared"}}, include=[tool])
    (t,) = [as_tool(x) for x in shared.member_tools()]
    started = time.perf_counter() - start
    processes, rss_mb = _below_me()
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
    print(
        f"{label}: shared start {started:.2f} s, {processes} processes, {rss_mb:.0f} MB resident; shared call "
        f"{statistics.median(calls) * 1e3:.1f} ms (median of {n}); per-trajectory start+call+stop "
        f"{statistics.median(sessions):.2f} s (median), {max(sessions):.2f} s (max)"
    )


def launch_overhead(isolation: str, n: int) -> None:
    """What the sandbox adds to a process's start and stop: ``python -c pass`` under the reaper, inside and outside."""
    from trl_plugins.tools.mcp.connection import REAPER
    from trl_plugins.tools.mcp.isolation import SandboxedLaunch, SandboxSpec

    command = [sys.executable, "-I", "-S", "-c", "pass"]

    def run(argv: list[str], env: dict | None = None) -> None:
        subprocess.run(
            [sys.executable, "-I", "-S", str(REAPER), str(os.getpid()), "--", *argv],
            env=env,
            check=True,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    plain, boxed = [], []
    for _ in range(n):
        start = time.perf_counter()
        run(command)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        launch = SandboxedLaunch(command[0], command[1:], {}, None, None, SandboxSpec(isolation=isolation), "bench")
        run(launch.argv(), {**os.environ, **launch.env})
        launch.release()
        boxed.append(time.perf_counter() - start)
    print(
        f"launch of `python -c pass`, {isolation}: {statistics.median(boxed) * 1e3:.0f} ms sandboxed (cgroup made "
        f"and removed) vs {statistics.median(plain) * 1e3:.0f} ms (medians of {n})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=20)
    n = parser.parse_args().trajectories
    warm = McpTools(mcpServers={"s": {"command": sys.executable, "args": [TOY], "session": "shared"}}, include=["add"])
    warm.member_tools()  # imports (the SDK, jsonschema) are not the first measurement's start
    warm.close()
    measure("toy (MCPServer)", {"command": sys.executable, "args": [TOY]}, "add", {"a": 1, "b": 2}, n)
    if shutil.which("mcp-server-time"):
        measure(
            "mcp-server-time",
            {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]},
            "get_current_time",
            {"timezone": "UTC"},
            n,
        )
    for isolation in (launcher.Isolation.BWRAP, launcher.Isolation.UNSHARE):
        if probing.probe(isolation, launcher.resolve_program(isolation)) is None:
            sandbox = {"isolation": isolation.value, "readable": [str(SERVERS)]}
            measure(
                f"toy (MCPServer), sandboxed ({isolation.value})",
                {"command": sys.executable, "args": [TOY], "sandbox": sandbox},
                "add",
                {"a": 1, "b": 2},
                n,
            )
            launch_overhead(isolation.value, n)


if __name__ == "__main__":
    main()
