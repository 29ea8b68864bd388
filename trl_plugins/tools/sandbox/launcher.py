"""How a sandboxed interpreter is launched: limits, bubblewrap/unshare/none command lines and
environments, cold runs, and probing which isolation works here (see docs/sandbox.md)."""

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
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trl_plugins.tools.sandbox.runner import PRIVATE_TMPFS, read_tail

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

RUNNER_PATH = Path(__file__).with_name("runner.py")
"""The runner, whose text every sandboxed interpreter runs."""

_HIDDEN_DIRS = ("/root", "/home", "/run")


class Isolation(enum.StrEnum):
    """How strongly a call is isolated from the host; docs/sandbox.md has the details."""

    BWRAP = "bwrap"
    """bubblewrap: namespaces for PID/net/IPC/UTS/mount, read-only host, hidden homes, private tmpfs."""
    UNSHARE = "unshare"
    """util-linux ``unshare`` plus our own mount set-up: the same namespaces, host ``/dev`` visible."""
    NONE = "none"
    """rlimits, an empty environment and a process-group kill only: no filesystem/network isolation."""


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


def _interpreter_paths() -> list[str]:
    # What the sandboxed interpreter must still see when its ancestors are hidden.
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.realpath(sys.executable)}
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            paths.add(sysconfig.get_path(key, vars=scheme_vars or None))
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    out: list[str] = []
    for p in real:  # drop paths inside an already kept one
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class Launcher:
    """Everything needed to start a runner under one isolation (built once per sandbox)."""

    isolation: Isolation
    hidden: tuple[str, ...]
    keep: tuple[str, ...]
    scratch: str
    as_root: bool

    @staticmethod
    def create(isolation: Isolation, extra_hidden: Sequence[str] = ()) -> Launcher:
        as_root = os.geteuid() == 0
        home = os.path.realpath(os.path.expanduser("~"))
        candidates = [*_HIDDEN_DIRS, home, *extra_hidden]
        keep_all = _interpreter_paths()
        hidden: list[str] = []
        for h in dict.fromkeys(os.path.realpath(p) for p in candidates):
            if h in ("/", "/usr", "/etc", "/tmp", "/proc", "/dev") or not os.path.lexists(h):
                continue
            if any(_under(h, k) for k in keep_all):
                logger.warning("sandbox: not hiding %s because the interpreter lives there", h)
                continue
            if not any(_under(h, x) for x in hidden):
                hidden.append(h)
        # The private /tmp and /dev/shm cover the interpreter too when it lives there (a clone or
        # virtualenv under /tmp): those paths are bound back read-only like the hidden ones.
        covered = [*hidden, *(p for p in PRIVATE_TMPFS if os.path.isdir(p))]
        keep = tuple(k for k in keep_all if any(_under(k, h) for h in covered))
        scratch = "/home/sandbox" if "/home" in hidden else "/tmp/sandbox"
        return Launcher(isolation, tuple(hidden), keep, scratch, as_root)

    def env(self, scratch: str) -> dict[str, str]:
        bin_dir = os.path.dirname(sys.executable)
        return {
            "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": scratch,
            "TMPDIR": "/tmp" if self.isolation != Isolation.NONE else scratch,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "NUMEXPR_NUM_THREADS": "1",
        }

    def runner_config(self, role: str, limits: Limits, scratch: str, **extra) -> dict:
        namespaced = self.isolation != Isolation.NONE
        cfg = {
            "role": role,
            "fs": {Isolation.BWRAP: "bwrap", Isolation.UNSHARE: "unshare", Isolation.NONE: "none"}[self.isolation],
            "scratch": scratch,
            "hide": list(self.hidden),
            "keep": list(self.keep),
            "drop_uid": SANDBOX_UID if (self.as_root and namespaced) else None,
            # Always a user namespace of our own, entered while the runner still has its caps: per-call
            # NPROC budget, and never uid 0 inside (a nested map onto uid 0 needs CAP_SETFCAP).
            "userns": namespaced,
            "per_call_ns": namespaced,
            "lift_proc_covers": [],
            "memory_bytes": limits.memory_mb << 20,
            "cpu_s": math.ceil(limits.timeout_s) + 1,
            "fsize_bytes": OUTPUT_FILE_LIMIT_BYTES,
            "nofile": MAX_OPEN_FILES,
            "nproc": MAX_PROCESSES,
            "disk_bytes": limits.disk_mb << 20,
            "max_chars": limits.max_output_chars,
            "setup_grace_s": SETUP_GRACE_S,
        }
        if role == "server":
            if self.isolation == Isolation.BWRAP and self.as_root:
                cfg["lift_proc_covers"] = ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"]
        cfg.update(extra)
        return cfg

    def argv(self, role: str, cfg: dict, scratch: str) -> list[str]:
        interp = [sys.executable, "-I", "-u", "-c", runner_source(), json.dumps(cfg)]
        if self.isolation == Isolation.NONE:
            return interp
        if self.isolation == Isolation.UNSHARE:
            flags = ["--ipc", "--uts", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
            return ["unshare", *flags, *([] if self.as_root else ["--map-root-user"]), "--", *interp]
        disk = str(cfg["disk_bytes"])
        args = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.as_root:
            args.append("--unshare-user")
        args += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
        made: set[str] = set()

        def keep_under(h: str) -> list[str]:
            out: list[str] = []
            for k in self.keep:
                if not _under(k, h):
                    continue
                parts = Path(k).relative_to(h).parts[:-1]
                for i in range(1, len(parts) + 1):
                    d = os.path.join(h, *parts[:i])
                    if d not in made:
                        made.add(d)
                        out += ["--perms", "0755", "--dir", d]
                out += ["--ro-bind", k, k]
            return out

        for h in self.hidden:
            if not os.path.isdir(h):
                args += ["--ro-bind", "/dev/null", h]
                continue
            args += ["--tmpfs", h, *keep_under(h)]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--size", disk, "--tmpfs", "/tmp", *keep_under("/tmp")]
        args += ["--perms", "1777", "--size", disk, "--tmpfs", "/dev/shm", *keep_under("/dev/shm")]
        args += ["--dir", scratch, "--size", disk, "--tmpfs", scratch]
        for h in self.hidden:
            if os.path.isdir(h):
                args += ["--remount-ro", h]
        args += ["--chdir", scratch]
        if self.as_root:
            caps = ["CAP_SETUID", "CAP_SETGID", "CAP_CHOWN"] + (["CAP_SYS_ADMIN"] if role == "server" else [])
            args += ["--cap-drop", "ALL"]
            for cap in caps:
                args += ["--cap-add", cap]
        args.append("--clearenv")
        for key, value in self.env(scratch).items():
            args += ["--setenv", key, value]
        return [*args, "--", *interp]

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


def run_cold(launcher: Launcher, limits: Limits, code: str) -> dict:
    """One fresh sandboxed interpreter for ``code``; returns the raw result fields."""
    private_dir = launcher.make_private_dir()
    scratch = private_dir or launcher.scratch
    code_fd = os.memfd_create("sandbox-code")
    out_fd, err_fd = os.memfd_create("sandbox-stdout"), os.memfd_create("sandbox-stderr")
    status_r, status_w = os.pipe()
    try:
        os.write(code_fd, code.encode("utf-8", "surrogatepass"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        cfg = launcher.runner_config("cell", limits, scratch, code_fd=code_fd, status_fd=status_w)
        proc = subprocess.Popen(
            launcher.argv("cell", cfg, scratch),
            stdin=subprocess.DEVNULL,
            stdout=out_fd,
            stderr=err_fd,
            pass_fds=(code_fd, status_w),
            **launcher.popen_kwargs(scratch),
        )
        os.close(status_w)
        status_w = -1
        started = wait_readable(status_r, SETUP_GRACE_S) and os.read(status_r, 16) == b"R"
        pidfd = os.pidfd_open(proc.pid)
        try:
            timed_out = started and not wait_readable(pidfd, limits.timeout_s)
            # Kill before reaping: while the leader is a zombie its pid (= the group id) cannot be
            # reused, so this never hits an unrelated process. In bwrap/unshare modes this also tears
            # down the PID namespace; in none mode it ends what the code left in its session.
            kill_group(proc.pid)
        finally:
            os.close(pidfd)
        proc.wait()
        mc = limits.max_output_chars
        (stdout, t1), (stderr, t2) = (read_tail(out_fd, mc, OUTPUT_FILE_LIMIT_BYTES),
                                      read_tail(err_fd, mc, OUTPUT_FILE_LIMIT_BYTES))
        if not started:
            detail = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {proc.returncode}"
            return {"error": f"the sandbox did not start ({detail})", "setup_log": stderr}
        return {"stdout": stdout, "stderr": stderr, "exit_code": proc.returncode, "timed_out": timed_out,
                "truncated": t1 or t2}
    finally:
        for fd in (code_fd, out_fd, err_fd, status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def wait_readable(fd: int, timeout_s: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


def kill_group(pgid: int) -> None:
    # bwrap/unshare sit at the head of their own session; killing them takes down the PID namespace.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_PROBE_LIMITS = Limits(timeout_s=20.0, memory_mb=512, max_output_chars=4000, disk_mb=16)


@functools.cache
def probe(isolation: Isolation) -> str | None:
    """None if ``isolation`` works on this machine, else why not (with what to do about it)."""
    if isolation == Isolation.BWRAP and shutil.which("bwrap") is None:
        return "bwrap not found on PATH (install bubblewrap: apt-get install -y bubblewrap)"
    if isolation == Isolation.UNSHARE and shutil.which("unshare") is None:
        return "unshare not found on PATH (install util-linux)"
    try:
        raw = run_cold(Launcher.create(isolation), _PROBE_LIMITS, "print(6 * 7)")
    except OSError as e:
        raw = {"error": f"{type(e).__name__}: {e}"}
    if raw.get("error"):
        reason = raw["error"]
    elif raw["exit_code"] == 0 and raw["stdout"] == "42\n":
        return None
    else:
        tail = raw["stderr"].strip().splitlines()
        reason = f"probe exited with {raw['exit_code']}: {tail[-1] if tail else 'no output'}"
    if isolation == Isolation.NONE and os.geteuid() == 0:
        reason += (f" (as root, 'none' runs the code as uid {SANDBOX_UID}, which must be able to read "
                   f"the interpreter {os.path.realpath(sys.executable)}; use bwrap/unshare instead)")
    if isolation == Isolation.BWRAP:
        reason += " (bwrap needs user namespaces or root; check `bwrap --ro-bind / / true`)"
    return reason


def detect_isolation() -> Isolation:
    """The strongest :class:`Isolation` that works on this machine (probed once per process).

    Each candidate is probed by actually running ``print(6 * 7)`` under it.

    Returns:
        ``BWRAP`` if bubblewrap works, else ``UNSHARE``, else ``NONE``.

    Raises:
        RuntimeError: not even ``NONE`` works (e.g. root with an interpreter uid 65534 cannot read).
    """
    reasons = {}
    for isolation in Isolation:
        reason = probe(isolation)
        if reason is None:
            return isolation
        reasons[isolation] = reason
    raise RuntimeError("no sandbox isolation works here: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))


_logged_isolations: set[tuple[Isolation, str]] = set()
_log_lock = threading.Lock()


def log_isolation_once(isolation: Isolation, mode: str) -> None:
    """Log the isolation in force once per (isolation, mode); warn once what ``none`` lacks."""
    with _log_lock:
        if (isolation, mode) in _logged_isolations:
            return
        _logged_isolations.add((isolation, mode))
        warn = isolation == Isolation.NONE and (Isolation.NONE, "") not in _logged_isolations
        _logged_isolations.add((isolation, ""))
    logger.info("sandbox: running model code under isolation=%s, mode=%s", isolation.value, mode)
    if warn:
        missing = "; ".join(f"{i.value}: {r}" for i in (Isolation.BWRAP, Isolation.UNSHARE) if (r := probe(i)))
        logger.warning(
            "sandbox: isolation=none gives NO filesystem, network or process isolation (only rlimits): "
            "model code can read files, open sockets and leave processes behind. %s. "
            "Install bubblewrap (apt-get install -y bubblewrap) and make sure user namespaces or root are available.",
            f"Missing: {missing}" if missing else "bwrap/unshare work here but isolation='none' was requested",
        )
