"""A stdio MCP server inside the project's sandbox (``sandbox:`` of a server; docs/tools.md, "Isolation").

The server runs as the code interpreter's cold cell does (:mod:`trl_plugins.tools.sandbox`: the same bubblewrap or
``unshare`` command line, file tree, hidden paths, rlimits, seccomp filter and a cgroup of its own), but the cell's
code replaces itself with the server (``execve``), which keeps the cell's stdin and stdout, the MCP stdio transport,
and lives until its session is closed. Its one writable directory is a private tmpfs at its working directory (a
per-trajectory server's ``{workdir}``, seeded with ``copy``; a shared server's own), gone with the process.

The SDK starts the process without passing descriptors, so the launch the sandbox builds (whose configuration and
bubblewrap arguments travel in descriptors) is handed to :data:`EXEC_SCRIPT`, a standard-library script run by path
under the reaper, in an environment variable it removes before it puts the descriptors in place and executes it."""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SandboxSpec",
    "SandboxedLaunch",
    "SandboxUnavailable",
    "parse_sandbox",
    "SANDBOX_KEYS",
    "LAUNCH_ENV",
    "EXEC_SCRIPT",
]

logger = logging.getLogger(__name__)
_announced: set[tuple[str, str]] = set()

SANDBOX_KEYS = frozenset({"isolation", "readable", "hidden", "memory_mb", "disk_mb", "network"})
"""The keys of a server's ``sandbox`` object."""
LAUNCH_ENV = "TRL_MCP_SANDBOX_LAUNCH"
"""The environment variable that carries the launch to :data:`EXEC_SCRIPT` (removed there before the launch)."""
EXEC_SCRIPT = Path(__file__).with_name("sandbox_exec.py")
"""Puts the launch's descriptors in place and executes it (standard library only, run by path)."""
_ENV_LIMIT = 120_000
"""Bytes one environment variable may hold, less a margin (Linux: ``MAX_ARG_STRLEN``, 128 KiB)."""


class SandboxUnavailable(RuntimeError):
    """The isolation a sandboxed server asks for does not work on this machine (the message says why and what to do)."""


@dataclass(frozen=True)
class SandboxSpec:
    """How one stdio server is sandboxed (the ``sandbox`` object of its entry; ``true`` gives these defaults)."""

    isolation: str = "auto"
    """``"auto"`` (bubblewrap, else the ``unshare`` fallback: the code interpreter's choice) or ``"bwrap"`` /
    ``"unshare"``, which must work here. ``"none"`` isolates nothing and is refused."""
    readable: tuple[str, ...] = ()
    """Host paths shown read-only besides the system's and the interpreter's (its virtual environment included):
    e.g. the server's own script or package. Everything else of the host is invisible."""
    hidden: tuple[str, ...] = ()
    """Paths inside the shown ones hidden all the same (as the code interpreter's ``hidden_paths``)."""
    memory_mb: int = 1024
    """Address space of each of the server's processes (``RLIMIT_AS``) and, where cgroups work, of all of them."""
    disk_mb: int = 256
    """Size of each private tmpfs: its writable directory, ``/tmp`` and ``/dev/shm``; also the largest file."""
    network: bool = False
    """Keep the host's network (its loopback included: the trainer's own services). Off: a network namespace of its
    own, with no interface up."""


def parse_sandbox(raw: Any, where: str) -> SandboxSpec | None:
    """The ``sandbox`` value of the server entry ``where`` (``true``, ``false`` or an object of
    :data:`SANDBOX_KEYS`), checked; no isolation is probed here (that is at the server's start).

    Raises:
        ValueError: a wrong type, an unknown key, a relative or missing path, a limit out of range."""
    if raw is None or raw is False:
        return None
    if raw is True:
        return SandboxSpec()
    what = f"{where}['sandbox']"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{what} must be true, false or an object with keys {sorted(SANDBOX_KEYS)}, got {raw!r:.200}")
    unknown = set(raw) - SANDBOX_KEYS
    if unknown:
        raise ValueError(f"{what} has unknown keys {sorted(unknown)}; it takes {sorted(SANDBOX_KEYS)}")
    isolation = raw.get("isolation", "auto")
    if isolation not in ("auto", "bwrap", "unshare"):
        raise ValueError(
            f"{what}['isolation'] must be 'auto', 'bwrap' or 'unshare', got {isolation!r}"
            + ("; 'none' isolates nothing: leave sandbox out instead" if isolation == "none" else "")
        )
    paths = {}
    for key in ("readable", "hidden"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(p, str) and os.path.isabs(p) for p in value):
            raise ValueError(f"{what}[{key!r}] must be a list of absolute paths, got {value!r:.200}")
        paths[key] = tuple(value)
    missing = [p for p in paths["readable"] if not os.path.exists(p)]
    if missing:
        raise ValueError(f"{what}['readable'] names paths that do not exist here: {missing}")
    if any(os.path.realpath(p) == "/" for p in paths["readable"]):
        raise ValueError(f"{what}['readable'] shows '/', the whole host: name the server's own files instead")
    limits = {}
    for key, minimum in (("memory_mb", 64), ("disk_mb", 1)):
        value = raw.get(key, getattr(SandboxSpec, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{what}[{key!r}] must be an integer >= {minimum} (MB), got {value!r}")
        limits[key] = value
    network = raw.get("network", False)
    if not isinstance(network, bool):
        raise ValueError(f"{what}['network'] must be true or false, got {network!r}")
    return SandboxSpec(isolation, paths["readable"], paths["hidden"], **limits, network=network)


def resolve_isolation(name: str, server: str) -> tuple[Any, str | None]:
    """The sandbox's :class:`~trl_plugins.tools.sandbox.launcher.Isolation` for ``name`` and the program it
    launches through, as the code interpreter resolves them (probed once per process).

    Raises:
        SandboxUnavailable: no isolation works here, or the one named does not (with the sandbox's probe reason)."""
    from trl_plugins.tools.sandbox.launcher import Isolation, resolve_program
    from trl_plugins.tools.sandbox.probing import detect_isolation, probe

    try:
        isolation = detect_isolation() if name == "auto" else Isolation(name)
    except RuntimeError as exc:
        raise SandboxUnavailable(
            f"MCP server {server!r} is to run sandboxed, but {exc}. Without a sandbox it would "
            f"run with the trainer's user, files and network: remove 'sandbox' only if that is "
            f"acceptable"
        ) from exc
    program = resolve_program(isolation)
    reason = probe(isolation, program) if name != "auto" else None
    if reason is not None:
        raise SandboxUnavailable(
            f"MCP server {server!r} asks for sandbox isolation {name!r}, which does not work on "
            f"this machine: {reason}. Use isolation: auto for the strongest that does"
        )
    return isolation, program


def _cell_code(command: str, args: Sequence[str], env: Mapping[str, str], workdir: str, copy: str | None) -> str:
    # Runs as the sandbox's cell (limits and seccomp in force): seed the writable directory, become the server.
    return (
        f"import os, shutil\n"
        f"copy, workdir = {copy!r}, {workdir!r}\n"
        f"if copy is not None and os.path.isdir(copy):\n"
        f"    shutil.copytree(copy, workdir, dirs_exist_ok=True, symlinks=True)\n"
        f"elif copy is not None:\n"
        f"    shutil.copy2(copy, workdir)\n"
        f"os.chdir(workdir)\n"
        f"os.execvpe({command!r}, {[command, *args]!r}, {dict(env)!r})\n"
    )


class SandboxedLaunch:
    """One sandboxed start of a stdio server: the command the SDK runs and the cgroup it runs in.

    Args:
        command, args, env: the server's (``{workdir}`` already replaced where it has one).
        cwd: its per-trajectory working directory, or None (a shared server: a directory of its own).
        copy: what is copied into that directory (read-only to the server where it is).
        sandbox: how it is sandboxed.
        name: the server's name, for messages.

    Raises:
        SandboxUnavailable: no isolation works here (the probe's reason).
        RuntimeError: the cgroup cannot be made, or the launch is too large."""

    def __init__(
        self,
        command: str,
        args: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        copy: str | None,
        sandbox: SandboxSpec,
        name: str,
    ) -> None:
        from trl_plugins.tools.sandbox.launcher import SCRATCH, Launcher, Limits, call_cgroup

        isolation, program = resolve_isolation(sandbox.isolation, name)
        self.isolation = isolation
        if (name, isolation.value) not in _announced:  # once per server: a per-trajectory one starts many times
            _announced.add((name, isolation.value))
            logger.info(
                "MCP server %r runs sandboxed: isolation=%s, network %s, memory %d MB, disk %d MB",
                name,
                isolation.value,
                "on" if sandbox.network else "off",
                sandbox.memory_mb,
                sandbox.disk_mb,
            )
        self.workdir = cwd or SCRATCH
        shown = [*sandbox.readable, *([copy] if copy is not None else [])]
        launcher = Launcher.create(isolation, sandbox.hidden, program, extra_shown=shown, network=sandbox.network)
        limits = Limits(timeout_s=1.0, memory_mb=sandbox.memory_mb, max_output_chars=256, disk_mb=sandbox.disk_mb)
        self.cgroup = call_cgroup(launcher, limits)
        # Descriptor numbers for the runner's configuration, reserved here so that none is one the launch's memfds
        # get below; the exec script puts each in place at its number.
        tasks = [os.path.join(d, "tasks") for d in self.cgroup.dirs] if self.cgroup is not None else []
        reserved = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(2 + len(tasks))]
        fds: list[dict[str, Any]] = []
        try:
            code_fd, status_fd, *cgroup_fds = reserved
            env_inside = {**launcher.env(self.workdir), **env}
            code = _cell_code(command, args, env_inside, self.workdir, copy)
            # A persistent process: no CPU-time limit of a call (each call has the server's timeout_s); the file
            # size limit is the disk's.
            cfg = launcher.runner_config(
                "cell",
                limits,
                self.workdir,
                code_fd=code_fd,
                status_fd=status_fd,
                cgroup_fds=cgroup_fds,
                cpu_s=1 << 30,
                fsize_bytes=sandbox.disk_mb << 20,
            )
            argv, launch_fds = launcher.command("cell", cfg, self.workdir)
            try:
                for fd in launch_fds:
                    fds.append({"fd": fd, "data": _b64(os.pread(fd, os.fstat(fd).st_size, 0))})
            finally:
                for fd in launch_fds:
                    os.close(fd)
            fds.append({"fd": code_fd, "data": _b64(code.encode("utf-8", "surrogatepass"))})
            fds.append({"fd": status_fd, "dup": 2})  # the runner's status lines (R, X<status>, E<why>) join stderr
            fds += [{"fd": fd, "path": path} for fd, path in zip(cgroup_fds, tasks)]
        except BaseException:
            self.release()
            raise
        finally:
            for fd in reserved:
                os.close(fd)
        popen = launcher.popen_kwargs(self.workdir)
        launch = json.dumps({"argv": argv, "fds": fds, "env": popen["env"], "cwd": popen["cwd"]})
        if len(launch) > _ENV_LIMIT:
            self.release()
            raise RuntimeError(
                f"MCP server {name!r}: its sandbox launch ({len(launch)} bytes: the paths shown and "
                f"hidden) does not fit in one environment variable; name fewer paths"
            )
        self.env = {LAUNCH_ENV: launch}

    @classmethod
    def of(cls, spec: Any) -> "SandboxedLaunch":
        """The sandboxed start of the stdio :class:`~trl_plugins.tools.mcp.config.ServerSpec` ``spec`` (with
        ``spec.sandbox``): a per-trajectory server's ``{workdir}`` is already its working directory; a shared
        server's is a directory of its own, :data:`~trl_plugins.tools.sandbox.launcher.SCRATCH`."""
        from trl_plugins.tools.sandbox.launcher import SCRATCH

        if spec.session != "per_trajectory":
            spec = spec.in_workdir(SCRATCH)
        return cls(spec.command, spec.args, spec.env, spec.cwd, spec.copy, spec.sandbox, spec.name)

    def argv(self) -> list[str]:
        """What the reaper runs: the exec script (the launch is in :attr:`env`)."""
        return [sys.executable, "-I", "-S", str(EXEC_SCRIPT)]

    def release(self) -> None:
        """Kill whatever is left in the server's cgroup and remove it (after the process was stopped); idempotent."""
        cgroup, self.cgroup = getattr(self, "cgroup", None), None
        if cgroup is not None:
            cgroup.kill_all()
            cgroup.remove()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
