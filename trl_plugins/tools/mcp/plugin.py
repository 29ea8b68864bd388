"""The ``mcp`` tool plugin: one tool per tool of the configured MCP servers (docs/tools.md)."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from trl_plugins.registry import TOOLS
from trl_plugins.tools.base import ClosingTool, ToolOutput, check_arguments
from trl_plugins.tools.mcp.config import ServerSpec, load_servers

__all__ = ["McpTools", "McpTool", "observation_text"]

logger = logging.getLogger(__name__)

_DROPPED = {
    "image": "an image",
    "audio": "audio",
    "resource_link": "a resource link",
    "resource": "an embedded resource",
}


def _placeholder(block: Any) -> str:
    """``[an image was dropped: image/png]``, ``[a resource link was dropped: file:///x.pdf (application/pdf)]``."""
    kind = getattr(block, "type", None)
    inner = getattr(block, "resource", None)  # an embedded resource: its contents carry the uri and type
    uri = getattr(block, "uri", None) or getattr(inner, "uri", None)
    mime = getattr(block, "mime_type", None) or getattr(inner, "mime_type", None)
    detail = f"{uri} ({mime})" if uri and mime else str(uri or mime or "")
    return f"[{_DROPPED.get(kind, f'a {kind} block')} was dropped{': ' + detail if detail else ''}]"


def observation_text(result: Any) -> str:
    """What the model sees of a ``CallToolResult``: its text blocks joined by newlines when it has any, else its
    ``structuredContent`` as JSON; an image, audio or resource block becomes a placeholder naming what was dropped."""
    parts = []
    for block in result.content or []:
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(block.text)
        else:
            parts.append(_placeholder(block))
    has_text = any(getattr(b, "type", None) == "text" for b in result.content or [])
    if not has_text and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


def _identity(info: Any) -> str:
    """A server's ``Implementation`` (``serverInfo``) as ``"name version"``."""
    if info is None:
        return "anonymous"
    return f"{info.name} {info.version}" if info.version else f"{info.name} (no version)"


def _workdir(spec: ServerSpec) -> str:
    """A new private working directory for one session of ``spec``, holding a copy of ``spec.copy``."""
    import os
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix=f"mcp-{spec.name}-")
    if spec.copy is not None:
        if os.path.isdir(spec.copy):
            shutil.copytree(spec.copy, workdir, dirs_exist_ok=True, symlinks=True)
        else:
            shutil.copy2(spec.copy, workdir)
    return workdir


def _remove(workdirs: Any) -> None:
    import shutil

    for workdir in workdirs:
        shutil.rmtree(workdir, ignore_errors=True)


def _check_input_schema(server: str, tool: Any) -> dict[str, Any]:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    schema = tool.input_schema
    where = f"MCP server {server!r}'s tool {tool.name!r}"
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(
            f"{where} has input schema {schema!r:.200}; MCP requires an object schema. Exclude the tool "
            f"(exclude: [{tool.name!r}]) or fix the server"
        )
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ValueError(
            f"{where}'s input schema is not valid JSON Schema 2020-12: {exc.message}. Exclude the tool "
            f"(exclude: [{tool.name!r}]) or fix the server"
        ) from exc
    return schema


@dataclass(eq=False)
class McpTool:
    """One MCP tool as the model calls it; the calls go to its server through :class:`McpTools`."""

    name: str
    """The name the model calls (the server's own name, or ``<server>__<tool>`` with ``prefix_tools``)."""
    server: str
    remote_name: str
    """The tool's name on its server."""
    description: str
    parameters: dict[str, Any]
    idempotent: bool
    """As the config declares (``idempotent`` of the server): the rollout then retries an infrastructure failure."""
    owner: "McpTools" = field(repr=False)
    _stats: dict[str, float] = field(default_factory=dict, repr=False)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def version(self) -> str:
        """Its server's name and version as the server announced them, with the protocol revision spoken, e.g.
        ``"tinyserve 1.2.3 (MCP server 'tiny', protocol 2025-11-25)"``: the run version records it per tool
        (``plugin_versions["tool/<name>"]``), so a server upgraded between runs is named when they are compared."""
        return self.owner.server_versions()[self.server]

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutput:
        # The rollout refuses such a call before (invalid_action); a caller that did not check gets the model's error.
        problem = check_arguments(self.schema(), arguments)
        out = ToolOutput(text=f"Error: {problem}.", ok=False) if problem else await self.owner.call(self, arguments)
        s = self._stats
        s["calls"] = s.get("calls", 0) + 1
        s["errors"] = s.get("errors", 0) + (not out.ok and out.infra_error is None)
        s["infra_errors"] = s.get("infra_errors", 0) + (out.infra_error is not None)
        s["latency_max_s"] = max(s.get("latency_max_s", 0.0), out.latency_s)
        s["latency_sum_s"] = s.get("latency_sum_s", 0.0) + out.latency_s
        return out

    def step_metrics(self) -> dict[str, float]:
        """``mcp/<tool>/calls``, ``errors`` (``isError`` results and refused input requests), ``infra_errors`` and
        ``latency_max_s`` since the last call; empty before the first call."""
        stats, self._stats = self._stats, {}
        if not stats:
            return {}
        out = {f"mcp/{self.name}/{k}": float(v) for k, v in stats.items() if k != "latency_sum_s"}
        out[f"mcp/{self.name}/latency_mean_s"] = stats["latency_sum_s"] / stats["calls"]
        return out

    def step_metric_reductions(self) -> dict[str, str]:
        return {
            f"mcp/{self.name}/{k}": r
            for k, r in (("calls", "sum"), ("errors", "sum"), ("infra_errors", "sum"), ("latency_max_s", "max"))
        }

    def start_up(self) -> str:
        """Its server, how it is reached and the protocol revision spoken (the servers connect if not yet)."""
        return self.owner.server_line(self.server)

    async def end_episode(self, key: Any) -> None:
        await self.owner.end_episode(key)

    def close(self) -> None:
        self.owner.close()


@TOOLS.register("mcp")
@dataclass(eq=False)
class McpTools(ClosingTool):
    """Every tool of the configured MCP servers, each one tool of the run (:meth:`member_tools`): a
    :class:`~trl_plugins.protocols.ToolSet`, which has no schema of its own and is never called.

    Configured with the ``mcpServers`` object MCP clients use (``tool_kwargs: {mcp: {mcpServers: {...}}}``) or a
    file holding one (``config: path/to/mcp.json``). At start-up (the run's build, before any model loads) each
    server is started or reached, its tools listed and their input schemas checked; the list is then frozen.

    Raises:
        ValueError: a malformed server entry, ``include``/``exclude`` naming no listed tool, two servers' tools
            with one name (set ``prefix_tools``), a tool whose input schema is not JSON Schema 2020-12.
        RuntimeError: a server that cannot be started or reached (with its stderr's last lines).
    """

    mcpServers: Mapping[str, Any] | None = None  # noqa: N815 - the key MCP clients' config files use
    """The servers by name: ``{command, args, env, cwd}`` (stdio) or ``{url, headers}`` (streamable HTTP), plus
    ``idempotent``, ``max_concurrency``, ``timeout_s`` and ``protocol`` (docs/tools.md)."""
    config: str | None = None
    """Instead of ``mcpServers``: a JSON file holding ``{"mcpServers": {...}}``."""
    include: list[str] | None = None
    """Only these tools (the names the model sees); None: every tool."""
    exclude: list[str] = field(default_factory=list)
    """Tools left out (the names the model sees)."""
    prefix_tools: bool = False
    """Name every tool ``<server>__<tool>``. Without it, two servers offering one name are refused at start-up."""
    start_timeout_s: float = 30.0
    """How long a server has to start (stdio) or answer (HTTP) at start-up."""
    name: str = "mcp"
    _servers: list[ServerSpec] = field(default_factory=list, init=False, repr=False)
    _tools: list[McpTool] | None = field(default=None, init=False, repr=False)
    _loop: Any = field(default=None, init=False, repr=False)
    _conns: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _episodes: dict[Any, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)
    _scratch: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _protocols: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)
    """Per-trajectory sessions: by episode key, by server, (connection, working directory); loop thread only."""
    _identities: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    """What each server announced (``serverInfo``) at start-up, as ``"name version"``: see :meth:`server_versions`."""
    sessions_started: int = field(default=0, init=False, repr=False)
    """Per-trajectory server processes started so far."""

    def __post_init__(self) -> None:
        self._servers = load_servers(self.mcpServers, self.config)
        for key, value in (("include", self.include), ("exclude", self.exclude)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise ValueError(f"the mcp tool's {key} must be a list of tool names, got {value!r}")

    # -- start-up ---------------------------------------------------------------------------------------------

    def _ensure_loop(self) -> Any:
        from trl_plugins.tools.mcp.connection import LoopThread

        with self._lock:
            if self._loop is None:
                self._loop = LoopThread()
            return self._loop

    async def _open_all(self) -> None:
        import asyncio

        from trl_plugins.tools.mcp.connection import ServerConnection

        scratch = {s.name: _workdir(s) for s in self._servers if s.session == "per_trajectory"}
        conns = {
            s.name: ServerConnection(s.in_workdir(scratch[s.name]) if s.name in scratch else s) for s in self._servers
        }
        results = await asyncio.gather(*(c.open(self.start_timeout_s) for c in conns.values()), return_exceptions=True)
        failed = [str(r) for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(c.close() for c in conns.values()))
            _remove(scratch.values())
            raise RuntimeError("\n".join(failed))
        self._conns = conns
        self._scratch = scratch

    def member_tools(self) -> list[McpTool]:
        """One tool per MCP tool of the servers, in server then listing order; the first call connects.

        Raises:
            RuntimeError: a server cannot be started or reached.
            ValueError: see the class."""
        if self._tools is not None:
            return list(self._tools)
        loop = self._ensure_loop()
        try:
            loop.run(self._open_all())
            listed = {name: loop.run(conn.list_tools()) for name, conn in self._conns.items()}
            self._tools = self._make_tools(listed)
            self._protocols = {name: conn.protocol_version for name, conn in self._conns.items()}
            self._identities = {name: _identity(conn.client.server_info) for name, conn in self._conns.items()}
            loop.run(self._close_probes())
        except BaseException:
            self.close()
            raise
        return list(self._tools)

    def _make_tools(self, listed: dict[str, list[Any]]) -> list[McpTool]:
        tools: list[McpTool] = []
        seen: dict[str, str] = {}
        for spec in self._servers:
            for t in listed[spec.name]:
                name = f"{spec.name}__{t.name}" if self.prefix_tools else t.name
                first = seen.setdefault(name, spec.name)
                if (self.include is not None and name not in self.include) or name in self.exclude:
                    continue  # left out: a name two servers offer clashes only where it is kept
                if first != spec.name:
                    raise ValueError(
                        f"MCP servers {first!r} and {spec.name!r} both offer a tool {name!r}; set "
                        f"prefix_tools: true (tools named <server>__<tool>, each kept or left out by that "
                        f"name) or leave the name out (exclude: [{name!r}] leaves out both)"
                    )
                description = (t.description or "").strip() or (
                    f"The tool {t.name!r} of the MCP server {spec.name!r} (it gives no description)."
                )
                tools.append(
                    McpTool(
                        name,
                        spec.name,
                        t.name,
                        description,
                        _check_input_schema(spec.name, t),
                        spec.is_idempotent(t.name),
                        self,
                    )
                )
        for key, names in (("include", self.include or []), ("exclude", self.exclude)):
            unknown = [n for n in names if n not in seen]
            if unknown:
                raise ValueError(
                    f"the mcp tool's {key} names {unknown}, which no server lists; the servers list {sorted(seen)}"
                )
        if not tools:
            raise ValueError(f"the mcp tool's servers offer no tool after include/exclude (they list {sorted(seen)})")
        return tools

    def server_versions(self) -> dict[str, str]:
        """Each server (its key under ``mcpServers``) -> its announced name and version and the protocol revision,
        ``"<name> <version> (MCP server '<key>', protocol <revision>)"``; ``"<name> (no version)"`` for an empty
        version, ``"anonymous"`` for a server that sent no ``serverInfo`` (optional under the 2026-07-28 revision,
        a ``_meta`` stamp of ``server/discover``; required by the ``initialize`` handshake). Connects if never yet
        (a closed set keeps what its servers announced)."""
        if not self._identities:
            self.member_tools()
        return {
            s.name: f"{self._identities[s.name]} (MCP server {s.name!r}, protocol {self._protocols[s.name]})"
            for s in self._servers
        }

    def server_line(self, server: str) -> str:
        """``server``, how it is reached and the protocol revision it speaks (connecting first if not yet)."""
        self.member_tools()
        spec = next(s for s in self._servers if s.name == server)
        return f"MCP server {spec.name!r} ({spec.describe()}, protocol {self._protocols.get(spec.name)})"

    def start_up(self) -> str:
        """Connect (if not yet) and say which servers serve which tools, over which protocol revision."""
        tools = self.member_tools()
        lines = []
        for spec in self._servers:
            names = [t.name for t in tools if t.server == spec.name]
            lines.append(f"{self.server_line(spec.name)}: {', '.join(names) or 'no tool used'}")
        return f"{len(self._servers)} MCP server(s), {len(tools)} tool(s): " + "; ".join(lines)

    # -- calls ------------------------------------------------------------------------------------------------

    async def _close_probes(self) -> None:
        """The per-trajectory servers were started once to list their tools; each trajectory starts its own."""
        for name in list(self._scratch):
            await self._conns.pop(name).close()
        _remove(self._scratch.values())
        self._scratch = {}

    async def _episode_connection(self, spec: ServerSpec, key: Any) -> Any:
        import asyncio

        from trl_plugins.tools.mcp.connection import ServerConnection

        sessions = self._episodes.setdefault(key, {})
        entry = sessions.get(spec.name)
        if entry is None:  # the episode's first call of this server: its own process in its own directory
            workdir = _workdir(spec)
            conn = ServerConnection(spec.in_workdir(workdir))
            entry = sessions[spec.name] = (conn, workdir, asyncio.ensure_future(conn.open(self.start_timeout_s)))
            self.sessions_started += 1
        conn, _, opened = entry
        await asyncio.shield(opened)  # parallel calls of one turn wait for the one start
        return conn

    async def _end_episode_on_loop(self, key: Any) -> None:
        for conn, workdir, opened in self._episodes.pop(key, {}).values():
            if not opened.done():
                opened.cancel()
            await conn.close()
            _remove([workdir])

    async def end_episode(self, key: Any) -> None:
        """Stop the per-trajectory servers of the trajectory ``key`` and delete their working directories."""
        loop = self._loop
        if loop is not None and key in self._episodes:
            await loop.arun(self._end_episode_on_loop(key))

    def live_sessions(self) -> int:
        """Per-trajectory server processes running now."""
        return sum(len(v) for v in self._episodes.values())

    async def _connection(self, server: str) -> Any:
        spec = next(s for s in self._servers if s.name == server)
        if spec.session == "per_trajectory":
            from trl_plugins.protocols import current_episode

            return await self._episode_connection(spec, current_episode.get())
        conn = self._conns.get(server)
        if conn is None:
            raise RuntimeError("the mcp tool is closed")
        if conn.client is None:  # the server died or the link broke: a new session for the next calls
            from trl_plugins.tools.mcp.connection import ServerConnection

            await conn.close()
            conn = self._conns[server] = ServerConnection(conn.spec)
            await conn.open(self.start_timeout_s)
        return conn

    async def _call_on_loop(self, tool: McpTool, arguments: dict[str, Any]) -> Any:
        conn = await self._connection(tool.server)
        return await conn.call(tool.remote_name, arguments)

    async def call(self, tool: McpTool, arguments: dict[str, Any]) -> ToolOutput:
        """Call ``tool`` on its server. ``isError``: an observation with ``ok=False``; a sampling or elicitation
        request: the tool's failure (``ok=False``); a dead, hung or broken server: ``infra_error``."""
        from trl_plugins.tools.mcp.connection import InputRequested, ServerFailed

        if self._tools is None:  # a closed (or unpickled) set reconnects; the tool list is the one built
            self.member_tools()
        start = time.perf_counter()
        try:
            result = await self._ensure_loop().arun(self._call_on_loop(tool, arguments))
        except InputRequested as exc:
            return ToolOutput(
                text=f"Error: the tool {tool.name!r} asked for input from the client ({exc}), which "
                f"this run cannot give.",
                ok=False,
                latency_s=time.perf_counter() - start,
            )
        except (ServerFailed, RuntimeError) as exc:
            return ToolOutput(text="", ok=False, latency_s=time.perf_counter() - start, infra_error=str(exc))
        text = observation_text(result)
        return ToolOutput(text=text, ok=not result.is_error, latency_s=time.perf_counter() - start)

    def input_requests(self) -> int:
        """Sampling and elicitation requests the servers made (and were refused) so far."""
        return sum(c.input_requests for c in self._conns.values())

    def close(self) -> None:
        """End every session (stdio servers stopped) and the loop thread; idempotent. A later call reconnects."""
        with self._lock:
            loop, self._loop = self._loop, None
            conns, self._conns = self._conns, {}
        if loop is None:
            return
        import asyncio

        async def close_all() -> None:
            await asyncio.gather(*(c.close() for c in conns.values()), return_exceptions=True)
            for key in list(self._episodes):
                await self._end_episode_on_loop(key)
            _remove(self._scratch.values())  # a start-up that failed after the probes started
            self._scratch = {}

        try:
            loop.run(close_all(), timeout=30)
        finally:
            loop.stop()
        self._tools = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_tools=None, _loop=None, _conns={}, _lock=None, _episodes={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
