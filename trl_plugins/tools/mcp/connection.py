"""Connections to MCP servers through the official SDK, held on one event loop thread of their own.

The SDK's sessions live inside anyio task groups that must be entered and left by one task; a call comes from
whatever loop the rollout runs on (or from start-up, which has none). So every session lives on this module's
loop thread, each held open by one task, and a call is handed over with ``run_coroutine_threadsafe``."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Awaitable, TypeVar

from trl_plugins.tools.mcp.config import ServerSpec
from trl_plugins.tools.mcp.isolation import SandboxUnavailable

try:
    BaseExceptionGroup  # noqa: B018 - a builtin from Python 3.11
except NameError:  # Python 3.10: the backport anyio (the mcp SDK's) depends on there
    from exceptiongroup import BaseExceptionGroup

__all__ = ["LoopThread", "ServerConnection", "ServerFailed", "InputRequested", "STDERR_TAIL_LINES"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

STDERR_TAIL_LINES = 20
"""Lines of a stdio server's stderr quoted when it fails."""
REAPER = Path(__file__).resolve().parents[2] / "rollout" / "endpoint" / "reaper.py"
"""The agent endpoint's reaper script, run by path (not imported): no stdio server outlives the run."""
_REFUSAL = "trl_plugins: this training run answers no {what} request"


class ServerFailed(RuntimeError):
    """The server could not be started or reached, crashed, hung or broke the protocol (infrastructure)."""


class InputRequested(RuntimeError):
    """The server asked the client for sampling or elicitation during a call (the tool's failure, named)."""


class LoopThread:
    """A daemon thread running one asyncio loop; :meth:`run` executes a coroutine there from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it here (a plain thread: start-up, close)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def arun(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the loop and await it from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


class ServerConnection:
    """One open session with one server, started by :meth:`open` and held by a task until :meth:`close`.

    Runs on the :class:`LoopThread`'s loop only."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.client: Any = None
        self.protocol_version: str | None = None
        self.input_requests = 0
        """Sampling and elicitation requests refused so far."""
        self.list_changed = 0
        """``tools/list_changed`` notifications seen (logged; the model's tool list stays as it was)."""
        self._stop: asyncio.Event | None = None
        self._holder: asyncio.Task | None = None
        self._errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") if spec.command else None
        self._tail = ""
        """The stderr tail kept when the session closed (its file is closed then: no descriptor per ended session)."""
        self._semaphore = asyncio.Semaphore(spec.max_concurrency)
        self._sandboxed: Any = None
        """The sandboxed start of this session's server (``sandbox:``), released when the session ends."""

    def stderr_tail(self) -> str:
        """The last :data:`STDERR_TAIL_LINES` lines the server wrote to stderr ('' for HTTP)."""
        if self._errlog is None:
            return self._tail
        try:
            self._errlog.flush()
            self._errlog.seek(0)
            lines = self._errlog.read().splitlines()
        except (OSError, ValueError):
            return ""
        return "\n".join(lines[-STDERR_TAIL_LINES:])

    def _transport(self) -> Any:
        if self.spec.command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            command, env, cwd = [self.spec.command, *self.spec.args], dict(self.spec.env) or None, self.spec.cwd
            if self.spec.sandbox is not None:  # inside the project's sandbox (isolation.py)
                from trl_plugins.tools.mcp.isolation import SandboxedLaunch

                self._sandboxed = SandboxedLaunch.of(self.spec)
                command, env, cwd = self._sandboxed.argv(), self._sandboxed.env, None
            # Under the reaper (standard library only): the server and what it starts die with this process, a kill -9
            # included (PR_SET_PDEATHSIG follows the spawning thread: the loop thread, alive as long as the process).
            params = StdioServerParameters(
                command=sys.executable,
                args=["-I", "-S", str(REAPER), str(os.getpid()), "--", *command],
                env=env,
                cwd=cwd,
            )
            return stdio_client(params, errlog=self._errlog)
        if not self.spec.headers:
            return self.spec.url
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(self.spec.url, http_client=httpx2.AsyncClient(headers=dict(self.spec.headers)))

    async def _refuse(self, what: str) -> Any:
        import mcp_types

        self.input_requests += 1
        return mcp_types.ErrorData(code=mcp_types.INVALID_REQUEST, message=_REFUSAL.format(what=what))

    async def _sampling(self, *_: Any) -> Any:
        return await self._refuse("sampling")

    async def _elicitation(self, *_: Any) -> Any:
        return await self._refuse("elicitation")

    async def _messages(self, message: Any) -> None:
        method = getattr(getattr(message, "root", message), "method", None)
        if method == "notifications/tools/list_changed":
            self.list_changed += 1
            logger.warning(
                "MCP server %r says its tool list changed; the run keeps the list it started with (the "
                "prompt would change mid-run)",
                self.spec.name,
            )

    async def _hold(self, ready: asyncio.Future) -> None:
        from mcp.client import Client

        try:
            async with Client(
                self._transport(),
                mode=self.spec.protocol,
                sampling_callback=self._sampling,
                elicitation_callback=self._elicitation,
                message_handler=self._messages,
                cache=None,
            ) as client:
                self.client, self.protocol_version = client, client.protocol_version
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to open() or to the next call
            if not ready.done():
                ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                logger.warning("MCP server %r's session ended: %s", self.spec.name, exc)
        finally:
            self.client = None
            if self._sandboxed is not None:  # the process is stopped: nothing may be left in its cgroup
                self._sandboxed.release()

    async def open(self, timeout_s: float) -> None:
        """Start (stdio) or reach (HTTP) the server and negotiate the protocol.

        Raises:
            ServerFailed: it did not answer within ``timeout_s`` or failed (with its stderr's last lines)."""
        self._stop = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._holder = asyncio.ensure_future(self._hold(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except BaseException as exc:
            await self.close()
            if isinstance(exc, SandboxUnavailable):  # the machine's, not the server's: said as it is
                raise ServerFailed(str(exc)) from exc
            raise ServerFailed(self.failure(f"could not be started or answer within {timeout_s:g} s", exc)) from exc

    def failure(self, what: str, exc: BaseException | None = None) -> str:
        why = "" if exc is None else f": {type(exc).__name__}: {_unwrap(exc)}"
        tail = self.stderr_tail()
        check = (
            "check that the command runs by itself and speaks MCP on stdout"
            if self.spec.command
            else "check that the server is running and serves MCP (streamable HTTP) at that URL"
        )
        return f"MCP server {self.spec.name!r} ({self.spec.describe()}) {what}{why}; {check}" + (
            f". Its stderr ends:\n{tail}" if tail else " (it wrote nothing to stderr)"
        )

    async def list_tools(self) -> list[Any]:
        tools, cursor = [], None
        for _ in range(100):
            page = await asyncio.wait_for(self.client.list_tools(cursor=cursor), self.spec.timeout_s)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools
        raise ServerFailed(f"MCP server {self.spec.name!r} paginated its tool list past 100 pages")

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """The server's ``CallToolResult`` for one call, within the server's concurrency and time limits.

        Raises:
            ServerFailed: no session (the server died), a time-out, a transport or protocol failure.
            InputRequested: the server asked for sampling or elicitation."""
        from mcp.shared.exceptions import MCPError

        async with self._semaphore:
            if self.client is None:
                raise ServerFailed(self.failure("has no open session (it exited or its connection broke)"))
            try:
                return await asyncio.wait_for(self.client.call_tool(name, arguments), self.spec.timeout_s)
            except asyncio.TimeoutError as exc:
                raise ServerFailed(
                    self.failure(f"did not answer a call of {name!r} within {self.spec.timeout_s:g} s (timeout_s)")
                ) from exc
            except MCPError as exc:
                if "trl_plugins: this training run answers no" in str(exc):
                    raise InputRequested(str(exc)) from exc
                if any(m in str(exc) for m in ("'elicitation/create'", "'sampling/createMessage'")):
                    # 2026-07-28 over stdio: the server's request never reached us (no back-channel); still its ask
                    self.input_requests += 1
                    raise InputRequested(str(exc)) from exc
                self.client = None  # the next call opens a new session (a crashed stdio server is restarted)
                what = (
                    "closed the connection (it exited or crashed)"
                    if "Connection closed" in str(exc)
                    else "answered with a protocol error"
                )
                raise ServerFailed(self.failure(f"{what} during a call of {name!r}", exc)) from exc
            except Exception as exc:  # noqa: BLE001 - transport, crash, a result that breaks the schema
                self.client = None
                raise ServerFailed(self.failure(f"failed during a call of {name!r}", exc)) from exc

    async def close(self) -> None:
        """End the session (a stdio server: stdin closed, then terminated, then killed, by the SDK)."""
        if self._stop is not None:
            self._stop.set()
        if self._holder is not None:
            try:
                await asyncio.wait_for(self._holder, 15)
            except BaseException:  # noqa: BLE001 - closing: the session is gone either way
                self._holder.cancel()
            self._holder = None
        self.client = None
        if self._errlog is not None:  # a failure message may still quote it; the descriptor goes now
            self._tail, errlog, self._errlog = self.stderr_tail(), self._errlog, None
            errlog.close()


def _unwrap(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{exc}" if not isinstance(exc, BaseExceptionGroup) else str(exc)
