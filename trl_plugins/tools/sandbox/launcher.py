"""How a sandboxed interpreter is launched: limits, bubblewrap/unshare/none command lines and
environments, cold runs and killing a call (which isolation works here: :mod:`.probing`; docs/sandbox.md); and where
a command a user names is found (:func:`find_command`: an MCP server's, a ``command:`` agent's)."""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trl_plugins.tools.sandbox.cgroups import (
    CGROUP_HEADROOM_MB,
    CallCgroup,
    CgroupRoots,
    cgroup_roots,
)
from trl_plugins.tools.sandbox.layout import init_program, layout_for
from trl_plugins.tools.sandbox.runner import (
    PRIVATE_TMPFS,
    exit_status,
    read_status,
    read_tail,
    status_lines,
    under,
)

logger = logging.getLogger(__name__)

SANDBOX_UID = 65534
"""uid/gid the model's code runs as (``nobody``) when the caller is root."""

OUTPUT_FILE_LIMIT_BYTES = 8 << 20
"""``RLIMIT_FSIZE``: largest file the code may write, the captured stdout/stderr included."""

MAX_PROCESSES = 64
"""``RLIMIT_NPROC`` of the code (per call in bwrap/unshare modes)."""

MAX_OPEN_FILES = 256
"""``RLIMIT_NOFILE`` of the code."""

SETUP_GRACE_S = 30.0
"""Interpreter start plus namespace set-up; a safety net, not the code's budget."""

KILL_GRACE_S = 3.0
"""How long past its limit a call may take to be stopped: every call returns by ``timeout_s + KILL_GRACE_S`` after
its code started, whatever its processes do (the output written until then kept). A warm server gives its
call's processes a third of it to be reaped (``REAP_GRACE_S``); one that has not answered by the end is killed,
with everything it runs."""

REAP_GRACE_S = KILL_GRACE_S / 3
"""How long a warm server waits for a stopped call's processes to be reaped before it reports itself stuck."""

RUNNER_PATH = Path(__file__).with_name("runner.py")
"""The runner, whose text every sandboxed interpreter runs."""

PROGRAM_ENV = {"bwrap": "TRL_SANDBOX_BWRAP", "unshare": "TRL_SANDBOX_UNSHARE"}
"""Environment variables that override where ``bwrap``/``unshare`` are (an absolute path), or hide them (empty)."""

SCRATCH = "/home/sandbox"
"""The code's working directory and ``$HOME`` in bwrap/unshare modes (a private tmpfs)."""


class Isolation(enum.StrEnum):
    """How strongly a call is isolated from the host; docs/sandbox.md has the details."""

    BWRAP = "bwrap"
    """bubblewrap: namespaces for PID/net/IPC/UTS/mount; only the interpreter and system libraries shown, read-only."""
    UNSHARE = "unshare"
    """util-linux ``unshare`` plus the same file tree built by the runner (private ``/dev`` included)."""
    NONE = "none"
    """rlimits, cgroups and seccomp only: no filesystem/network/PID isolation; only when asked for explicitly."""


@dataclass(frozen=True)
class Limits:
    """The per-call limits of one sandbox (see :class:`~trl_plugins.tools.sandbox.PythonSandbox`)."""

    timeout_s: float
    memory_mb: int
    max_output_chars: int
    disk_mb: int


@functools.cache
def runner_source() -> str:
    # Shipped as text, not as a path: the package may live where the sandbox hides it (a checkout
    # under $HOME or /root, installed editable), and as root in none mode uid 65534 must read it.
    return RUNNER_PATH.read_text()


def resolve_program(isolation: Isolation) -> str | None:
    """Absolute path of the program that ``isolation`` launches through (``bwrap``/``unshare``), or None.

    Looked up on the host's ``PATH`` (the sandbox's own ``PATH`` never matters: the launch uses this
    path), unless ``TRL_SANDBOX_BWRAP``/``TRL_SANDBOX_UNSHARE`` names one (empty: treat it as missing).
    """
    if isolation == Isolation.NONE:
        return None
    override = os.environ.get(PROGRAM_ENV[isolation.value])
    found = (override or None) if override is not None else shutil.which(isolation.value)
    if found is None or not os.path.isabs(found) and override is not None:
        return None
    found = os.path.abspath(found)
    return found if os.path.isfile(found) and os.access(found, os.X_OK) else None


class CommandNotFound(LookupError):
    """A command named by a bare name is neither on the ``PATH`` searched nor in the interpreter's scripts folder."""


def interpreter_scripts() -> list[str]:
    """The running interpreter's own scripts folders: ``sysconfig``'s ``scripts`` path, and the folder of
    ``sys.executable`` where that differs (the link's folder, not its target's: a virtual environment's ``bin``)."""
    folders = [
        sysconfig.get_path("scripts"),
        os.path.dirname(os.path.abspath(sys.executable)) if sys.executable else "",
    ]
    return list(dict.fromkeys(f for f in folders if f))


def find_command(command: str, path: str | None = None) -> str:
    """Where a user-named command runs from: a name with a slash as given; a bare name looked up on ``path`` (None:
    this process's ``PATH``), then in :func:`interpreter_scripts`, so that a console script installed in the run's
    own environment is found whether or not that environment is activated (a job script, an IDE). Returns the
    absolute path found, which is what gets executed.

    Raises:
        CommandNotFound: a bare name found in neither place (the message names both and what to do)."""
    if "/" in command:
        return command
    searched = os.environ.get("PATH", os.defpath) if path is None else path
    scripts = interpreter_scripts()
    for where in (searched, os.pathsep.join(scripts)):
        found = shutil.which(command, path=where) if where else None
        if found is not None:
            return os.path.abspath(found)
    raise CommandNotFound(
        f"command {command!r} is found neither on PATH ({searched or 'empty'}) nor in this "
        f"interpreter's scripts folder ({os.pathsep.join(scripts)}): install it into this environment "
        f"({sys.executable} -m pip install ...) or give its absolute path"
    )


def sandbox_path() -> str:
    """``PATH`` inside a sandbox: the interpreter's folder first, then the system's."""
    return f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Launcher:
    """Everything needed to start a runner under one isolation (built once per sandbox)."""

    isolation: Isolation
    program: str | None
    """Absolute path of ``bwrap``/``unshare`` (None in ``none`` mode)."""
    layout: tuple[tuple[str, ...], ...]
    late: tuple[str, ...]
    scratch: str
    as_root: bool
    cgroups: CgroupRoots | None
    """Where per-call cgroups are made; None: rlimits plus the seccomp fallback (docs/sandbox.md)."""
    network: bool = False
    """Keep the host's network namespace in a launch (a sandboxed MCP server that asks for it); warm calls make a
    network namespace of their own all the same."""

    @staticmethod
    def create(
        isolation: Isolation,
        extra_hidden: Sequence[str] = (),
        program: str | None = None,
        cgroups: bool = True,
        extra_shown: Sequence[str] = (),
        network: bool = False,
    ) -> Launcher:
        as_root = os.geteuid() == 0
        layout, late = layout_for(extra_hidden, extra_shown) if isolation != Isolation.NONE else ((), ())
        program = program or resolve_program(isolation)
        roots = cgroup_roots() if cgroups else None
        return Launcher(isolation, program, layout, late, SCRATCH, as_root, roots, network)

    def env(self, scratch: str) -> dict[str, str]:
        return {
            "PATH": sandbox_path(),
            "HOME": scratch,
            "TMPDIR": "/tmp" if self.isolation != Isolation.NONE else scratch,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "NUMEXPR_NUM_THREADS": "1",
            # glibc gives each new thread a malloc arena of its own (up to 8 per core), each reserving 64 MB of
            # address space that RLIMIT_AS counts: ~15 threads started at 1 GB. One arena serves every thread.
            "MALLOC_ARENA_MAX": "1",
        }

    def runner_config(self, role: str, limits: Limits, scratch: str, **extra) -> dict:
        namespaced = self.isolation != Isolation.NONE
        cfg = {
            "role": role,
            "fs": {Isolation.BWRAP: "bwrap", Isolation.UNSHARE: "unshare", Isolation.NONE: "none"}[self.isolation],
            "scratch": scratch,
            "layout": [list(op) for op in self.layout],
            "late": list(self.late),
            "drop_uid": SANDBOX_UID if (self.as_root and namespaced) else None,
            # Always a user namespace of our own, entered while the runner still has its caps: per-call
            # NPROC budget, and never uid 0 inside (a nested map onto uid 0 needs CAP_SETFCAP).
            "userns": namespaced,
            "per_call_ns": namespaced,
            "init_program": init_program() if namespaced else None,
            "lift_proc_covers": [],
            "memory_bytes": limits.memory_mb << 20,
            "cpu_s": math.ceil(limits.timeout_s) + 1,
            "fsize_bytes": OUTPUT_FILE_LIMIT_BYTES,
            "nofile": MAX_OPEN_FILES,
            "nproc": MAX_PROCESSES,
            "disk_bytes": limits.disk_mb << 20,
            "max_chars": limits.max_output_chars,
            "setup_grace_s": SETUP_GRACE_S,
            "reap_grace_s": REAP_GRACE_S,
        }
        if role == "server":
            if self.isolation == Isolation.BWRAP and self.as_root:
                cfg["lift_proc_covers"] = ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"]
        cfg.update(extra)
        return cfg

    def command(self, role: str, cfg: dict, scratch: str) -> tuple[list[str], list[int]]:
        """The command line that starts a runner with ``cfg``, and the descriptors it reads (pass them to the
        launch, close them after it). The configuration, and bwrap's arguments (which name every path shown and
        hidden), travel in memfds: a command line is readable by any process that can see the pid, the code's
        own included."""
        cfg_fd = memfd_with("sandbox-config", json.dumps(cfg).encode())
        interp = [sys.executable, "-I", "-u", "-c", runner_source(), str(cfg_fd)]
        if self.isolation == Isolation.NONE:
            return interp, [cfg_fd]
        if self.isolation == Isolation.UNSHARE:
            flags = [
                "--ipc",
                "--uts",
                *([] if self.network else ["--net"]),
                "--pid",
                "--fork",
                "--kill-child",
                "--mount-proc",
            ]
            return [self.program, *flags, *([] if self.as_root else ["--map-root-user"]), "--", *interp], [cfg_fd]
        args = self._bwrap_args(role, cfg, scratch)
        args_fd = memfd_with("sandbox-bwrap-args", b"".join(a.encode() + b"\0" for a in args))
        return [self.program, "--args", str(args_fd), "--", *interp], [cfg_fd, args_fd]

    def _bwrap_args(self, role: str, cfg: dict, scratch: str) -> list[str]:
        disk = str(cfg["disk_bytes"])
        args = [
            "--unshare-ipc",
            "--unshare-pid",
            *([] if self.network else ["--unshare-net"]),
            "--unshare-uts",
            "--unshare-cgroup-try",
        ]
        if not self.as_root:
            args.append("--unshare-user")
        args += ["--hostname", "sandbox", "--die-with-parent", "--new-session"]
        made: set[str] = set()

        def parents(path: str, below: str = "/") -> list[str]:
            # The missing folders between `below` and `path`, made 0755 (bwrap would make them 0700).
            parts, out = Path(path).parts, []
            for i in range(len(Path(below).parts) + 1, len(parts)):
                d = str(Path(*parts[:i]))
                if d not in made:
                    made.add(d)
                    out += ["--perms", "0755", "--dir", d]
            return out

        def cover(path: str) -> list[str]:
            if os.path.isdir(path):
                return ["--size", "65536", "--tmpfs", path, "--remount-ro", path]
            return ["--ro-bind", "/dev/null", path]

        late_covers = [op[1] for op in self.layout if op[0] == "cover" and any(under(op[1], p) for p in self.late)]
        for op in self.layout:  # the root is an empty tmpfs: only what is bound here is visible
            if op[0] == "cover" and op[1] in late_covers:
                continue
            args += parents(op[-1])
            if op[0] == "symlink":
                args += ["--symlink", op[1], op[2]]
            elif op[0] == "ro-bind":
                args += ["--ro-bind", op[1], op[1]]
            else:
                args += cover(op[1])
        args += ["--proc", "/proc", "--dev", "/dev"]
        for private in PRIVATE_TMPFS:
            args += ["--perms", "1777", "--size", disk, "--tmpfs", private]
            for p in self.late:
                if under(p, private):
                    args += parents(p, below=private) + ["--ro-bind", p, p]
            for p in late_covers:  # hidden paths inside those: mounted over them, not underneath
                if under(p, private):
                    args += cover(p)
        args += ["--dir", scratch, "--size", disk, "--tmpfs", scratch, "--remount-ro", "/", "--chdir", scratch]
        if self.as_root:
            caps = ["CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"] + (["CAP_SYS_ADMIN"] if role == "server" else [])
            args += ["--cap-drop", "ALL"]
            for cap in caps:
                args += ["--cap-add", cap]
        args.append("--clearenv")
        for key, value in self.env(scratch).items():
            args += ["--setenv", key, value]
        return args

    def popen_kwargs(self, scratch: str) -> dict:
        kwargs: dict = {"start_new_session": True, "close_fds": True, "cwd": "/", "env": self.env(scratch)}
        if self.isolation == Isolation.NONE:
            kwargs["cwd"] = scratch
            if self.as_root:
                kwargs.update(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])
        return kwargs

    def make_private_dir(self) -> str | None:
        """NONE mode only: a host directory owned by the sandbox user, removed after use."""
        if self.isolation != Isolation.NONE:
            return None
        path = tempfile.mkdtemp(prefix="trl-sandbox-")
        if self.as_root:
            os.chown(path, SANDBOX_UID, SANDBOX_UID)
        return path


def memfd_with(name: str, data: bytes) -> int:
    """A memfd holding ``data``, read from its start (close-on-exec: a launch inherits it through ``pass_fds``, a
    warm server through the socket)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def call_cgroup(launcher: Launcher, limits: Limits) -> CallCgroup | None:
    """A fresh per-call (cold) or per-server (warm) cgroup, or None where cgroups are not available."""
    if launcher.cgroups is None:
        return None
    try:
        return CallCgroup(launcher.cgroups, (limits.memory_mb + CGROUP_HEADROOM_MB) << 20, MAX_PROCESSES + 4)
    except OSError as e:
        raise RuntimeError(f"could not make the call's cgroup under {launcher.cgroups}: {e}") from e


def run_cold(launcher: Launcher, limits: Limits, code: str) -> dict:
    """One fresh sandboxed interpreter for ``code``; returns the raw result fields."""
    private_dir = launcher.make_private_dir()
    scratch = private_dir or launcher.scratch
    cgroup = call_cgroup(launcher, limits)
    cgroup_fds = cgroup.open_tasks() if cgroup is not None else []
    code_fd = memfd_with("sandbox-code", code.encode("utf-8", "surrogatepass"))
    out_fd, err_fd = os.memfd_create("sandbox-stdout"), os.memfd_create("sandbox-stderr")
    status_r, status_w = os.pipe()
    try:
        cfg = launcher.runner_config(
            "cell", limits, scratch, code_fd=code_fd, status_fd=status_w, cgroup_fds=cgroup_fds
        )
        argv, launch_fds = launcher.command("cell", cfg, scratch)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=err_fd,
                pass_fds=(code_fd, status_w, *cgroup_fds, *launch_fds),
                **launcher.popen_kwargs(scratch),
            )
        finally:
            for fd in launch_fds:
                os.close(fd)
        os.close(status_w)
        status_w = -1
        for fd in cgroup_fds:
            os.close(fd)
        cgroup_fds = []
        status = read_status(status_r, bool, SETUP_GRACE_S)  # until a first line
        started = status.startswith(b"R\n")
        pidfd = os.pidfd_open(proc.pid)
        try:
            timed_out = started and not wait_readable(pidfd, limits.timeout_s)
            # Kill before reaping: while the leader is a zombie its pid (= the group id) cannot be
            # reused, so this never hits an unrelated process.
            kill_call(proc.pid)
        finally:
            os.close(pidfd)
        proc.wait()
        status += read_status(status_r, lambda lines: False, 1.0)  # the rest: every writer is gone now
        oom_kills = 0
        if cgroup is not None:
            cgroup.kill_all()
            oom_kills = cgroup.oom_kills()
        mc = limits.max_output_chars
        (stdout, t1), (stderr, t2) = (
            read_tail(out_fd, mc, OUTPUT_FILE_LIMIT_BYTES),
            read_tail(err_fd, mc, OUTPUT_FILE_LIMIT_BYTES),
        )
        if not started:
            reported = status.decode(errors="replace")
            detail = (
                reported[1:].strip()
                if reported.startswith("E")
                else stderr.strip().splitlines()[-1]
                if stderr.strip()
                else f"exit status {proc.returncode}"
            )
            return {"error": f"the sandbox did not start ({detail})", "setup_log": stderr}
        # The code's exit code is what its parent in the sandbox saw (a signal death reads -N in every mode; bwrap
        # itself would report 128 + N). A call that ran out of time was killed by us.
        wait_status = exit_status(status_lines(status))
        exit_code = (
            -signal.SIGKILL
            if timed_out
            else os.waitstatus_to_exitcode(wait_status)
            if wait_status is not None
            else proc.returncode
        )
        return {
            "stdout": stdout,
            "stderr": stderr,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "truncated": t1 or t2,
            "oom_killed": oom_kills > 0,
        }
    finally:
        for fd in (code_fd, out_fd, err_fd, status_r, status_w, *cgroup_fds):
            if fd >= 0:
                os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def wait_readable(fd: int, timeout_s: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def kill_call(pid: int) -> None:
    """SIGKILL what ``pid`` (the launched bwrap/unshare/runner, leader of its own session) started.

    Its direct children first: in bwrap/unshare modes the one child is the init of the call's PID
    namespace, and the kernel kills everything in a PID namespace when its init dies. Killing only the
    launcher is not enough: the runner's parent-death signal is cleared when it switches uid, and the
    code may leave the launcher's process group (``setsid``). Then the process group.
    """
    for child in _children(pid):
        try:
            pidfd = os.pidfd_open(child)
        except OSError:
            continue
        try:
            if child in _children(pid):  # still ours: the pidfd refers to that process, not a reused pid
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
