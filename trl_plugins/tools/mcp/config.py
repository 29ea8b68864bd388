"""The ``mcpServers`` configuration, the shape MCP clients' config files use, parsed and checked (no SDK needed)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from trl_plugins.tools.mcp.isolation import SandboxSpec, parse_sandbox
from trl_plugins.tools.sandbox.launcher import CommandNotFound, find_command, sandbox_path

__all__ = ["ServerSpec", "load_servers", "STDIO_KEYS", "HTTP_KEYS", "OUR_KEYS"]

STDIO_KEYS = frozenset({"command", "args", "env", "cwd"})
"""A stdio server's keys, as MCP clients write them."""
HTTP_KEYS = frozenset({"url", "headers"})
"""A streamable HTTP server's keys."""
OUR_KEYS = frozenset({"idempotent", "max_concurrency", "timeout_s", "protocol", "type", "session", "copy", "sandbox"})
"""Keys this client adds (``type`` is accepted as clients write it: ``"stdio"``, ``"http"``/``"streamable-http"``)."""


@dataclass(frozen=True)
class ServerSpec:
    """One MCP server: how to start or reach it and how its calls run."""

    name: str
    """The key under ``mcpServers``."""
    command: str | None = None
    """Stdio: the executable started as the server; a bare name is stored as the absolute path it was found at
    (:func:`~trl_plugins.tools.sandbox.launcher.find_command`), which is what runs and what :meth:`describe` shows."""
    args: tuple[str, ...] = ()
    """Stdio: its arguments."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Stdio: environment variables set over the SDK's safe default environment."""
    cwd: str | None = None
    """Stdio: the server's working directory."""
    url: str | None = None
    """Streamable HTTP: the endpoint, e.g. ``http://127.0.0.1:8765/mcp``."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Streamable HTTP: headers sent with every request."""
    idempotent: bool | tuple[str, ...] = False
    """Calls that may be retried after an infrastructure failure: True (every tool of the server) or the tool names.
    A server's own ``idempotentHint`` is not trusted."""
    max_concurrency: int = 8
    """Calls to this server that may run at once."""
    timeout_s: float = 30.0
    """Wall-clock limit of one call; a call past it is an infrastructure failure (a hung server)."""
    session: str = "shared"
    """``"per_trajectory"`` (stdio only; the default there): each trajectory gets its own process, started at its
    first call in a private working directory and stopped when the trajectory ends, so no trajectory sees another's
    state. ``"shared"`` (HTTP's only choice): one session for every trajectory, for a stateless server."""
    copy: str | None = None
    """``per_trajectory``: a file or directory copied into each trajectory's working directory (a directory's
    contents), e.g. the repository a git server works on; ``{workdir}`` in ``args``, ``env`` or ``cwd`` is that
    directory, which is also the default ``cwd``."""
    protocol: str = "auto"
    """``"auto"`` (ask ``server/discover`` for the stateless 2026-07-28 revision, fall back to the ``initialize``
    handshake), ``"legacy"`` (the handshake only) or a modern revision such as ``"2026-07-28"`` (no probe)."""
    sandbox: SandboxSpec | None = None
    """Stdio: run the server inside the project's sandbox (:mod:`trl_plugins.tools.mcp.isolation`); None: as the
    trainer's user, with its files and network."""

    @property
    def transport(self) -> str:
        """``"stdio"`` or ``"http"``."""
        return "stdio" if self.command is not None else "http"

    def is_idempotent(self, tool: str) -> bool:
        return self.idempotent is True or (isinstance(self.idempotent, tuple) and tool in self.idempotent)

    def in_workdir(self, workdir: str) -> "ServerSpec":
        """This server with ``{workdir}`` replaced in its args, env and cwd (default cwd: ``workdir``)."""
        import dataclasses

        def sub(text: str) -> str:
            return text.replace("{workdir}", workdir)

        return dataclasses.replace(
            self,
            args=tuple(sub(a) for a in self.args),
            env={k: sub(v) for k, v in self.env.items()},
            cwd=sub(self.cwd) if self.cwd is not None else workdir,
        )

    def describe(self) -> str:
        if self.command is not None:
            boxed = f", sandboxed ({self.sandbox.isolation})" if self.sandbox is not None else ""
            return f"stdio, {self.session}{boxed}: {' '.join([self.command, *self.args])}"
        return f"streamable HTTP: {self.url}"


def _strings(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{what} must map names to strings, got {value!r:.200}")
    return dict(value)


def _server(name: str, raw: Any) -> ServerSpec:
    where = f"mcpServers[{name!r}]"
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where} must be an object with 'command' (stdio) or 'url' (streamable HTTP), got {raw!r:.200}"
        )
    unknown = set(raw) - STDIO_KEYS - HTTP_KEYS - OUR_KEYS
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {sorted(unknown)}; a stdio server takes {sorted(STDIO_KEYS)}, an "
            f"HTTP server {sorted(HTTP_KEYS)}, and both {sorted(OUR_KEYS)}"
        )
    kind = raw.get("type")
    if kind not in (None, "stdio", "http", "streamable-http", "streamableHttp"):
        raise ValueError(
            f"{where}['type'] is {kind!r}; this client speaks 'stdio' and 'http' (streamable HTTP). An "
            f"SSE-only server is not supported: put it behind its streamable HTTP endpoint"
        )
    has_cmd, has_url = "command" in raw, "url" in raw
    if has_cmd == has_url:
        raise ValueError(f"{where} needs exactly one of 'command' (a stdio server) and 'url' (streamable HTTP)")
    if has_cmd and set(raw) & HTTP_KEYS or has_url and set(raw) & STDIO_KEYS:
        raise ValueError(f"{where} mixes stdio keys {sorted(STDIO_KEYS)} with HTTP keys {sorted(HTTP_KEYS)}")
    common: dict[str, Any] = {}
    idem = raw.get("idempotent", False)
    if isinstance(idem, list) and all(isinstance(t, str) for t in idem):
        idem = tuple(idem)
    elif not isinstance(idem, bool):
        raise ValueError(f"{where}['idempotent'] must be true/false or a list of tool names, got {idem!r}")
    common["idempotent"] = idem
    conc = raw.get("max_concurrency", 8)
    if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
        raise ValueError(f"{where}['max_concurrency'] must be an integer >= 1, got {conc!r}")
    common["max_concurrency"] = conc
    timeout = raw.get("timeout_s", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"{where}['timeout_s'] must be a number of seconds > 0, got {timeout!r}")
    common["timeout_s"] = float(timeout)
    from_protocol = raw.get("protocol", "auto")
    if not isinstance(from_protocol, str):
        raise ValueError(f"{where}['protocol'] must be 'auto', 'legacy' or a revision such as '2026-07-28'")
    common["protocol"] = from_protocol
    session = raw.get("session", "per_trajectory" if has_cmd else "shared")
    if session not in ("per_trajectory", "shared"):
        raise ValueError(f"{where}['session'] must be 'per_trajectory' or 'shared', got {session!r}")
    if has_url and session != "shared":
        raise ValueError(
            f"{where} is an HTTP server, shared by every trajectory (its state is the server's to keep "
            f"apart); remove session, or run it as a stdio server for a process per trajectory"
        )
    copy = raw.get("copy")
    if copy is not None and (session != "per_trajectory" or not isinstance(copy, str) or not os.path.exists(copy)):
        raise ValueError(
            f"{where}['copy'] is {copy!r}: it must name an existing file or directory, and only a "
            f"per_trajectory server has a working directory to copy it into"
        )
    common.update(session=session, copy=copy)
    if has_url:
        if raw.get("sandbox"):
            raise ValueError(
                f"{where} is an HTTP server: the sandbox runs stdio servers (the process it starts); "
                f"isolate an HTTP server where it runs, or start it as a stdio server"
            )
        url = raw["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}['url'] must be an http(s) URL, got {url!r}")
        return ServerSpec(name, url=url, headers=_strings(raw.get("headers", {}), f"{where}['headers']"), **common)
    command, args = raw["command"], raw.get("args", [])
    if not isinstance(command, str) or not command:
        raise ValueError(f"{where}['command'] must be a non-empty string, got {command!r}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{where}['args'] must be a list of strings, got {args!r:.200}")
    cwd = raw.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or ("{workdir}" not in cwd and not os.path.isdir(cwd))):
        raise ValueError(f"{where}['cwd'] is {cwd!r}, not a directory here")
    sandbox = parse_sandbox(raw.get("sandbox"), where)
    if sandbox is not None and cwd not in (None, "{workdir}"):
        raise ValueError(
            f"{where}['cwd'] is {cwd!r}, but a sandboxed server works in its own writable directory "
            f"({{workdir}}); show it host files read-only with sandbox: {{readable: [...]}}"
        )
    env = _strings(raw.get("env", {}), f"{where}['env']")
    try:  # the PATH the server is started with: its own env's, else the sandbox's or this process's
        command = find_command(command, env.get("PATH", sandbox_path() if sandbox is not None else None))
    except CommandNotFound as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ServerSpec(name, command=command, args=tuple(args), env=env, cwd=cwd, sandbox=sandbox, **common)


def load_servers(mcp_servers: Mapping[str, Any] | None, config: str | None) -> list[ServerSpec]:
    """The servers of ``mcp_servers`` (the ``mcpServers`` object) or of the JSON file ``config`` (which holds one
    under the key ``mcpServers``), in order.

    Raises:
        ValueError: neither or both given, an unreadable file, or a server entry that is malformed (says which key)."""
    if (mcp_servers is None) == (config is None):
        raise ValueError(
            "the mcp tool needs exactly one of mcpServers (the servers, as in an MCP client's config) "
            "and config (the path of a JSON file holding {'mcpServers': {...}})"
        )
    if config is not None:
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the mcp tool's config {config!r} cannot be read as JSON: {exc}") from exc
        if not isinstance(data, Mapping) or "mcpServers" not in data:
            raise ValueError(f"{config!r} has no 'mcpServers' object (the shape MCP clients' config files use)")
        mcp_servers = data["mcpServers"]
    if not isinstance(mcp_servers, Mapping) or not mcp_servers:
        raise ValueError(f"mcpServers must be a non-empty object of servers by name, got {mcp_servers!r:.200}")
    return [_server(str(name), raw) for name, raw in mcp_servers.items()]
