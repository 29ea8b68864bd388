"""Python code interpreter for tool-calling RL: runs model-written code isolated, limited and stateless.

A policy that is optimised for reward writes the code, so the code is treated as hostile: it may
loop, sleep, allocate without bound, fork-bomb, flood its output, read secrets, open sockets, write
outside its directory, leave daemons behind or try to kill its supervisor. Every call runs like a
notebook cell in a fresh process that nothing from another call can reach.

    with PythonSandbox(timeout_s=5.0, mode="warm") as sandbox:
        result = sandbox.run("import sympy\\nsympy.factorint(2**32 + 1)")
        result.stdout  # "{641: 1, 6700417: 1}\\n"

Isolation (strongest available is picked by :func:`detect_isolation`):

``bwrap`` (bubblewrap, ``apt-get install -y bubblewrap``)
    Own PID, network, IPC, UTS and mount namespaces; the host tree read-only; ``/root``, ``/home``,
    ``/run`` and the caller's ``$HOME`` hidden behind empty tmpfs (the interpreter's own directories
    are bound back read-only); private size-limited tmpfs for the scratch directory (cwd and
    ``$HOME``), ``/tmp`` and ``/dev/shm``; a fresh ``/proc`` and minimal ``/dev``; empty environment
    plus a minimal one; the code runs in a user namespace of its own, as uid/gid 65534 when the
    caller is root (otherwise as the caller's uid), without capabilities and with ``no_new_privs``.
    When the call ends (or is killed) the PID namespace dies and takes every descendant with it.
    Network: none (loopback only reaches the sandbox itself).
``unshare`` (util-linux)
    The same namespaces, with the mount set-up done by our runner: the host tree is made read-only
    with ``mount_setattr``, the same directories hidden, private tmpfs for scratch, ``/tmp`` and
    ``/dev/shm``, a fresh ``/proc``; same uid and capability rules as bwrap. Not covered compared
    with bwrap: ``/dev`` is the host's (read-only; device permissions still apply).
``none`` (rlimits only)
    Resource limits, an empty environment, a per-call scratch directory and a process-group kill.
    No filesystem, network or PID isolation: the code can read whatever uid 65534 (or the calling
    user, when not root) can read, write world-writable places such as ``/tmp``, open sockets, and a
    daemon that leaves its session survives the call. Only for trusted code or development.

In every mode the code runs with ``RLIMIT_AS`` (``memory_mb`` on top of what is already mapped when
it starts), ``RLIMIT_CPU`` (``ceil(timeout_s) + 1`` s), ``RLIMIT_FSIZE`` (8 MB per file, the captured
output included), ``RLIMIT_NPROC`` (64), ``RLIMIT_NOFILE`` (256) and ``RLIMIT_CORE`` (0); stdin is
``/dev/null``; stdout and stderr go to memfds that are read back after the call (the last
``max_output_chars`` characters of each are kept, because tracebacks and results come last); a
wall-clock timeout SIGKILLs the whole process tree even if the code ignores SIGTERM.

Modes: ``cold`` starts one fresh interpreter per call (~50 ms, plus any import the code does:
``import sympy`` costs ~0.6 s). ``warm`` keeps a pool of pre-started servers (at most
``max_concurrency``) inside the same isolation with ``warm_imports`` already imported; per call the
server forks a child which enters fresh user, PID, mount, network, IPC and UTS namespaces, mounts
fresh tmpfs for scratch, ``/tmp`` and ``/dev/shm`` and (when the kernel allows) a fresh ``/proc``,
drops every capability and runs the code as PID 1 of its namespace. Calls are as isolated from
each other as in cold mode (``random`` and ``numpy.random`` are reseeded per call); ~10 ms each.

Design notes (what differs from the first plan, and why):

* The uid drop happens inside the sandbox, not before ``bwrap``: the project interpreter lives
  under ``/root`` (mode 0700), which uid 65534 cannot traverse, and unprivileged bwrap resolves
  every bind source as the calling user (``realpath``), so even ``--ro-bind-fd`` fails. When the
  caller is root, bwrap therefore runs privileged (no user namespace), mounts as root, keeps only
  ``CAP_SETUID``/``CAP_SETGID``/``CAP_CHOWN`` (plus ``CAP_SYS_ADMIN`` for warm servers, used once
  to lift bwrap's read-only covers from ``/proc`` so that per-call children can mount a fresh one),
  and our runner switches to uid/gid 65534, enters a new user namespace (so ``RLIMIT_NPROC`` is a
  per-call budget rather than one shared by every uid-65534 process), clears the capability sets
  and the bounding set and sets ``no_new_privs`` before reading a byte of model code.
* bwrap drops all capabilities of its child, so a warm server cannot ``unshare`` PID/mount/network
  namespaces in its own user namespace. The per-call child creates a nested user namespace first;
  that needs no privilege and gives it exactly the capabilities it needs, which it drops before
  the code runs. Warm servers are non-dumpable, so even where a fresh ``/proc`` cannot be mounted
  (non-root callers) the code cannot read or write the server's memory through ``/proc``.
* Servers are spawned from one long-lived thread because ``--die-with-parent`` (``PDEATHSIG``)
  fires when the spawning *thread* exits, which would kill a server started from a short-lived
  caller thread.
* The wall-clock limit counts from the moment the model's code starts (interpreter start-up and
  sandbox set-up are excluded), so cold and warm calls get the same budget.

Not covered in any mode: CPU/memory cgroups (memory is bounded per process by ``RLIMIT_AS``, not per
process tree: 64 processes of up to ``memory_mb`` each are possible), seccomp syscall filtering,
and side channels. Paths outside the hidden directories stay readable (read-only), and a unix socket
there that uid 65534 may write to can still be connected to (``connect`` ignores read-only mounts);
``/run``, ``/tmp`` and the homes, where such sockets usually live, are hidden.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import functools
import inspect
import json
import logging
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SANDBOX_UID = 65534
"""uid/gid the model's code runs as (``nobody``) when the caller is root."""

OUTPUT_FILE_LIMIT_BYTES = 8 << 20
"""``RLIMIT_FSIZE``: largest file the code may write, the captured stdout/stderr included."""

MAX_PROCESSES = 64
"""``RLIMIT_NPROC`` of the code (per call in bwrap/unshare modes)."""

MAX_OPEN_FILES = 256
"""``RLIMIT_NOFILE`` of the code."""

_HIDDEN_DIRS = ("/root", "/home", "/run")
_PRIVATE_TMPFS = ("/tmp", "/dev/shm")  # replaced by a fresh tmpfs in every sandbox (and every warm call)
_SETUP_GRACE_S = 30.0  # interpreter start + namespace set-up; a safety net, not the code's budget
_SERVER_START_TIMEOUT_S = 120.0


class Isolation(enum.StrEnum):
    """How strongly a call is isolated from the host; see the module docstring for the details."""

    BWRAP = "bwrap"
    """bubblewrap: namespaces for PID/net/IPC/UTS/mount, read-only host, hidden homes, private tmpfs."""
    UNSHARE = "unshare"
    """util-linux ``unshare`` plus our own mount set-up: the same namespaces, host ``/dev`` visible."""
    NONE = "none"
    """rlimits, an empty environment and a process-group kill only: no filesystem/network isolation."""


@dataclass
class ExecResult:
    """Outcome of one sandboxed call."""

    ok: bool
    """The code exited with status 0 within the time limit."""
    stdout: str
    """Captured stdout (the tail, at most ``max_output_chars``; undecodable bytes replaced)."""
    stderr: str
    """Captured stderr: the traceback on an error, plus a final line on a timeout or a signal death."""
    exit_code: int | None
    """Exit status; negative = killed by that signal (as in ``subprocess``); None = sandbox failure."""
    timed_out: bool
    """The wall-clock limit was hit and the process tree was killed."""
    latency_s: float
    """Wall time of the call, from the start of the sandbox's work to the result (queueing excluded)."""
    output_truncated: bool = False
    """stdout or stderr was longer than ``max_output_chars`` and only its tail is kept."""
    isolation: str = ""
    """The :class:`Isolation` the call ran under."""
    mode: str = ""
    """``"cold"`` or ``"warm"``."""


@dataclass(frozen=True)
class SandboxStats:
    """Counts and latency percentiles over a set of calls (``calls == successes + errors + timeouts``)."""

    calls: int
    """Number of calls."""
    successes: int
    """Calls with ``ok=True``."""
    errors: int
    """Calls that failed without timing out (exceptions, non-zero exits, signals, sandbox failures)."""
    timeouts: int
    """Calls killed by the wall-clock limit."""
    latency_p50_s: float
    """Median latency in seconds (0.0 when there were no calls)."""
    latency_p90_s: float
    """90th percentile latency in seconds."""
    latency_p99_s: float
    """99th percentile latency in seconds."""
    latency_max_s: float
    """Largest latency in seconds."""

    def to_metrics(self, prefix: str = "sandbox/") -> dict[str, float]:
        """The stats as a flat ``{prefix + field: value}`` dict for a metrics logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


# ---------------------------------------------------------------------------------------------------
# Runner: the functions below are shipped as source (``python -I -c``) and run INSIDE the sandbox.
# They may use only the standard library (imported locally) and each other; no annotations, no
# module globals. The host imports a few of them too (tail reading, message framing).
# ---------------------------------------------------------------------------------------------------


def _rn_libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    libc.prctl.argtypes = [ctypes.c_int, ul, ul, ul, ul]
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ul, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _rn_check(ret, what):
    import ctypes
    import os

    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _rn_prctl(libc, option, arg):
    return libc.prctl(option, arg, 0, 0, 0)


def _rn_mount(libc, source, target, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _rn_check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _rn_set_readonly(libc, path, recursive):
    import ctypes

    # mount_setattr(2) (Linux >= 5.12, syscall 442 on every architecture): flips the read-only flag
    # of a whole mount tree at once, in our mount namespace only.
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(1, 0, 0, 0)  # MOUNT_ATTR_RDONLY
    flags = 0x8000 if recursive else 0  # AT_RECURSIVE
    ret = libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), path.encode(), ctypes.c_uint(flags),
                       ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _rn_check(0 if ret == 0 else -1, f"mount_setattr {path}")


def _rn_write_id_maps(uid, gid):
    # Map our own uid/gid (from the parent namespace) and nothing else: allowed without privilege.
    # Inside, 0 becomes 65534: mapping root needs CAP_SETFCAP in the parent (Linux >= 5.12).
    inside_uid, inside_gid = uid or 65534, gid or 65534
    for name, text in (("uid_map", f"{inside_uid} {uid} 1\n"), ("setgroups", "deny\n"),
                       ("gid_map", f"{inside_gid} {gid} 1\n")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _rn_drop_caps(libc):
    import ctypes

    for cap in range(64):  # bounding set: nothing can be regained through exec of a file with caps
        if _rn_prctl(libc, 24, cap) != 0 and ctypes.get_errno() == 22:  # PR_CAPBSET_DROP; EINVAL = past last
            break

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    _rn_check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    _rn_check(_rn_prctl(libc, 38, 1), "PR_SET_NO_NEW_PRIVS")


def _rn_bind_back(libc, keep):
    import os

    # Bind each kept path back, read-only, from an O_PATH handle taken before it was covered.
    MS_BIND, MS_REC = 4096, 16384
    for k, fd in keep:
        if not os.path.lexists(k):
            os.makedirs(os.path.dirname(k), exist_ok=True)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(k)
            else:
                open(k, "w").close()
        _rn_mount(libc, f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC, None)
        _rn_set_readonly(libc, k, True)
        os.close(fd)


def _rn_setup_unshare_fs(cfg, libc):
    import os

    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
    disk = cfg["disk_bytes"]
    _rn_mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    # O_PATH handles opened before hiding: binding /proc/self/fd/N back needs no path traversal.
    keep = [(k, os.open(k, os.O_PATH | os.O_CLOEXEC)) for k in cfg["keep"]]
    _rn_set_readonly(libc, "/", True)
    # A fresh /proc: the read-only flag above would block writing our uid_map.
    _rn_mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    for h in cfg["hide"]:
        if os.path.isdir(h):
            _rn_mount(libc, "tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        elif os.path.lexists(h):
            _rn_mount(libc, "/dev/null", h, None, MS_BIND, None)
    for p in ("/tmp", "/dev/shm"):
        if os.path.isdir(p):
            _rn_mount(libc, "tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk}")
    os.umask(0o022)
    _rn_bind_back(libc, keep)
    os.makedirs(cfg["scratch"], exist_ok=True)
    _rn_mount(libc, "tmpfs", cfg["scratch"], "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={disk}")
    for h in cfg["hide"]:
        if os.path.isdir(h):
            _rn_set_readonly(libc, h, False)


def _rn_setup_process(cfg, libc):
    import os
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg["fs"] == "unshare":
        _rn_setup_unshare_fs(cfg, libc)
    for p in cfg["lift_proc_covers"]:
        libc.umount2(p.encode(), 2)  # MNT_DETACH; best effort
    if cfg["fs"] != "none":
        os.chdir(cfg["scratch"])
    uid = cfg["drop_uid"]
    if cfg["userns"]:
        try:  # the user namespace's own NPROC budget is what counts; raising needs root, so now
            resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass
    if uid is not None:
        os.chown(cfg["scratch"], uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears the capability sets
    if cfg["userns"]:
        uid, gid = os.getuid(), os.getgid()  # after unshare these read as the overflow id
        _rn_prctl(libc, 4, 1)  # PR_SET_DUMPABLE: /proc/self/uid_map belongs to root otherwise
        _rn_check(libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")
        _rn_write_id_maps(uid, gid)
    _rn_drop_caps(libc)
    # A server must not be readable/writable through /proc by the code it runs (same uid).
    _rn_prctl(libc, 4, 0 if cfg["role"] == "server" else 1)


def _rn_apply_limits(cfg):
    import os
    import resource

    try:
        with open("/proc/self/statm") as f:
            baseline = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        baseline = 0
    mem = cfg["memory_bytes"] + baseline
    cpu = int(cfg["cpu_s"])
    for res, soft, hard in (
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, cfg["fsize_bytes"], cfg["fsize_bytes"]),
        (resource.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"]),
        (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))


def _rn_exec_cell(code):
    import ast
    import builtins
    import linecache
    import sys
    import traceback
    import types

    name = "<cell>"
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [""]
    sys.path.insert(0, "")  # like `python -c`: the code may import modules it wrote to its cwd
    sys.dont_write_bytecode = True
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    try:
        tree = ast.parse(code, name)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), main.__dict__)
        if last is not None:
            value = eval(compile(last, name, "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return (e.code or 0) & 0xFF
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != name:
            tb = tb.tb_next  # hide the runner's frames: the model sees only its own code
        try:
            traceback.print_exception(type(e), e, tb)
        except BaseException:
            pass
        return 1


def _rn_exit(status):
    import atexit
    import os
    import sys

    try:
        import threading

        threading._shutdown()  # like interpreter exit: wait for the code's non-daemon threads
    except BaseException:
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)


def _rn_tail(fd, max_chars, limit_bytes):
    import os

    size = os.fstat(fd).st_size
    budget = max_chars * 4 + 4
    start = max(0, size - budget)
    text = os.pread(fd, size - start, start).decode("utf-8", "replace")
    if start == 0 and len(text) <= max_chars:
        return text, False
    note = f"; the {limit_bytes >> 20} MB output limit was hit and later writes failed" if size >= limit_bytes else ""
    marker = "[sandbox: output truncated, about {:,} bytes cut{}; the last {:,} characters follow]\n"
    keep = max(0, max_chars - len(marker.format(size, note, max_chars)))
    tail = text[-keep:] if keep else ""
    cut = max(0, size - len(tail.encode("utf-8", "replace")))
    return marker.format(cut, note, len(tail)) + tail, True


def _rn_send(fd, obj):
    import json
    import os
    import struct

    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _rn_recv(fd):
    import json
    import os
    import struct

    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exact(4)
    if head is None:
        return None
    body = exact(struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def _rn_prepare_child_io(out_fd, err_fd, status_fd):
    import io
    import os
    import sys

    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.dup2(status_fd, 3)
    os.closerange(4, 1 << 20)  # the server's protocol pipes and everything else
    streams = []
    for fd in (1, 2):
        raw = io.FileIO(fd, "w", closefd=False)
        streams.append(io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True))
    sys.stdout = sys.__stdout__ = streams[0]
    sys.stderr = sys.__stderr__ = streams[1]
    sys.stdin = sys.__stdin__ = open(0, closefd=False)


def _rn_mount_call_fs(cfg, libc, scratch):
    import os

    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
    disk = cfg["disk_bytes"]
    _rn_mount(libc, None, "/", None, MS_REC | MS_PRIVATE, None)
    covers = [p for p in ("/tmp", "/dev/shm") if os.path.isdir(p)]
    # Interpreter paths under a fresh tmpfs (a virtualenv in /tmp): O_PATH handles taken before the
    # tmpfs covers them, bound back read-only through /proc/self/fd afterwards.
    keep = [(k, os.open(k, os.O_PATH | os.O_CLOEXEC)) for k in cfg["keep"]
            if any(k == p or k.startswith(p + "/") for p in covers)]
    for p in covers:
        _rn_mount(libc, "tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={disk}")
    _rn_bind_back(libc, keep)
    os.makedirs(scratch, exist_ok=True)
    _rn_mount(libc, "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={disk}")
    try:  # fresh /proc: the code sees only its own PID namespace
        _rn_mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        return True
    except OSError:
        return False


def _rn_call_child(req, cfg, libc, out_fd, err_fd, status_fd, scratch):
    import os

    report_fd = [status_fd]
    try:
        fresh_proc = _rn_setup_call_child(cfg, libc, out_fd, err_fd, status_fd, scratch, report_fd)
    except BaseException as e:
        try:
            os.write(report_fd[0], ("E" + f"{type(e).__name__}: {e}".replace("\n", " ") + "\n").encode())
        except BaseException:
            pass
        os._exit(125)
    # One line per write: pipe writes this small are atomic, whichever process writes first.
    os.write(3, b"p\n" if fresh_proc else b"")
    os.write(3, b"R\n")
    os.close(3)
    _rn_exit(_rn_exec_cell(req["code"]))


def _rn_setup_call_child(cfg, libc, out_fd, err_fd, status_fd, scratch, report_fd):
    import atexit
    import os
    import random
    import sys

    fresh_proc = False
    if cfg["per_call_ns"]:
        # CLONE_NEWUSER|NEWNS|NEWPID|NEWNET|NEWIPC|NEWUTS: a nested user namespace grants the caps
        # for the others without any privilege; the caller stays outside the new PID namespace.
        uid, gid = os.getuid(), os.getgid()
        _rn_prctl(libc, 4, 1)
        _rn_check(libc.unshare(0x10000000 | 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000),
                  "unshare per-call namespaces")
        _rn_write_id_maps(uid, gid)
        pid = os.fork()
        if pid:
            os.write(status_fd, f"P{pid}\n".encode())
            os._exit(0)
        fresh_proc = _rn_mount_call_fs(cfg, libc, scratch)  # now PID 1 of the new namespace
    os.setsid()  # own session/group: kill(0, ...) from the code cannot reach the server
    os.chdir(scratch)
    _rn_prepare_child_io(out_fd, err_fd, status_fd)
    report_fd[0] = 3
    _rn_drop_caps(libc)
    _rn_prctl(libc, 4, 1)
    atexit._clear()
    random.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()  # the server's state would otherwise repeat in every call
    _rn_apply_limits(cfg)
    return fresh_proc


def _rn_serve_one(req, cfg, libc):
    import os
    import select
    import shutil
    import signal
    import sys
    import tempfile
    import time

    out_fd, err_fd = os.memfd_create("stdout"), os.memfd_create("stderr")
    r, w = os.pipe()
    scratch, private_dir = cfg["scratch"], None
    if not cfg["per_call_ns"]:
        private_dir = scratch = tempfile.mkdtemp(dir=cfg["scratch"])
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            _rn_call_child(req, cfg, libc, out_fd, err_fd, w, scratch)
        finally:
            os._exit(125)
    os.close(w)
    status, deadline = b"", time.monotonic() + cfg["setup_grace_s"]
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(r, 4096) if ready else b""
        if not chunk:
            break
        status += chunk
    os.close(r)
    lines = status.decode(errors="replace").splitlines()
    target = child
    if cfg["per_call_ns"]:
        os.waitpid(child, 0)  # the intermediate process; the code's process is now ours (subreaper)
        target = next((int(x[1:]) for x in lines if x.startswith("P")), child)
    result = {"fresh_proc": "p" in lines}
    if "R" not in lines:
        st = None
        if target != child or not cfg["per_call_ns"]:
            try:
                os.kill(target, signal.SIGKILL)
                st = os.waitpid(target, 0)[1]
            except (ProcessLookupError, ChildProcessError):
                pass
        errors = [x[1:] for x in lines if x.startswith("E")]
        result["error"] = errors[0] if errors else f"sandbox set-up did not complete ({lines!r}, wait status {st})"
    else:
        pidfd = os.pidfd_open(target)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        timed_out = not poller.poll(max(0, int(req["timeout_s"] * 1000)))
        if timed_out:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        if not cfg["per_call_ns"]:
            try:
                os.killpg(target, signal.SIGKILL)  # leftovers of the code's session
            except (ProcessLookupError, PermissionError):
                pass
        _, st = os.waitpid(target, 0)
        os.close(pidfd)
        result.update(exit_code=os.waitstatus_to_exitcode(st), timed_out=timed_out)
        mc, lim = cfg["max_chars"], cfg["fsize_bytes"]
        (result["stdout"], t1), (result["stderr"], t2) = _rn_tail(out_fd, mc, lim), _rn_tail(err_fd, mc, lim)
        result["truncated"] = t1 or t2
    os.close(out_fd)
    os.close(err_fd)
    if private_dir is not None:
        shutil.rmtree(private_dir, ignore_errors=True)
    while True:  # orphans re-parented to us (we are a child subreaper)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return result


def _rn_serve(cfg, libc):
    import gc
    import os

    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # stray prints of imported modules must not corrupt the protocol
    _rn_prctl(libc, 36, 1)  # PR_SET_CHILD_SUBREAPER: the code's process is re-parented to us
    failed = []
    # What every call's child needs anyway, imported once here instead of once per call.
    for name in ("ast", "atexit", "builtins", "io", "linecache", "random", "shutil", "tempfile", "threading",
                 "traceback", "types"):
        __import__(name)
    for name in cfg["warm_imports"]:
        try:
            __import__(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    gc.collect()
    gc.freeze()  # fewer copy-on-write page faults in the forked children
    probe = _rn_serve_one({"code": "pass", "timeout_s": 30.0}, cfg, libc)
    if probe.get("error") or probe.get("exit_code") != 0:
        _rn_send(proto_out, {"ready": False, "error": probe.get("error") or probe.get("stderr", "")})
        return
    _rn_send(proto_out, {"ready": True, "failed_imports": failed, "fresh_proc": probe["fresh_proc"]})
    while True:
        req = _rn_recv(proto_in)
        if req is None:
            return
        _rn_send(proto_out, _rn_serve_one(req, cfg, libc))


def _rn_cold_cell(cfg, libc):
    import os

    with os.fdopen(cfg["code_fd"], "rb") as f:
        code = f.read().decode("utf-8", "surrogatepass")
    _rn_apply_limits(cfg)
    os.write(cfg["status_fd"], b"R")
    os.close(cfg["status_fd"])
    _rn_exit(_rn_exec_cell(code))


def _rn_main():
    import json
    import sys

    cfg = json.loads(sys.argv[1])
    libc = _rn_libc()
    _rn_setup_process(cfg, libc)
    if cfg["role"] == "server":
        _rn_serve(cfg, libc)
    else:
        _rn_cold_cell(cfg, libc)


@functools.cache
def _runner_source() -> str:
    functions = [fn for name, fn in globals().items() if name.startswith("_rn_") and inspect.isfunction(fn)]
    return "\n\n".join(inspect.getsource(fn) for fn in functions) + "\n\n_rn_main()\n"


# ---------------------------------------------------------------------------------------------------
# Host side: how a sandboxed interpreter is launched.
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_output_chars: int
    disk_mb: int


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
class _Launcher:
    """Everything needed to start a runner under one isolation (built once per sandbox)."""

    isolation: Isolation
    hidden: tuple[str, ...]
    keep: tuple[str, ...]
    scratch: str
    as_root: bool

    @staticmethod
    def create(isolation: Isolation, extra_hidden: Sequence[str] = ()) -> _Launcher:
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
        covered = [*hidden, *(p for p in _PRIVATE_TMPFS if os.path.isdir(p))]
        keep = tuple(k for k in keep_all if any(_under(k, h) for h in covered))
        scratch = "/home/sandbox" if "/home" in hidden else "/tmp/sandbox"
        return _Launcher(isolation, tuple(hidden), keep, scratch, as_root)

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

    def runner_config(self, role: str, limits: _Limits, scratch: str, **extra) -> dict:
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
            "setup_grace_s": _SETUP_GRACE_S,
        }
        if role == "server":
            if self.isolation == Isolation.BWRAP and self.as_root:
                cfg["lift_proc_covers"] = ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"]
        cfg.update(extra)
        return cfg

    def argv(self, role: str, cfg: dict, scratch: str) -> list[str]:
        interp = [sys.executable, "-I", "-u", "-c", _runner_source(), json.dumps(cfg)]
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


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _status_line(timeout_s: float, exit_code: int | None, timed_out: bool, memory_mb: int) -> str:
    if timed_out:
        return f"TimeoutError: execution exceeded {timeout_s} s wall-clock limit and was killed"
    if exit_code is not None and exit_code < 0:
        sig = -exit_code
        hint = {
            signal.SIGXCPU: "CPU time limit exceeded",
            signal.SIGSEGV: f"crashed; often an allocation failure under the {memory_mb} MB memory limit",
            signal.SIGABRT: f"aborted; often an allocation failure under the {memory_mb} MB memory limit",
            signal.SIGKILL: "killed",
            signal.SIGXFSZ: f"file size limit of {OUTPUT_FILE_LIMIT_BYTES >> 20} MB exceeded",
        }.get(sig, "killed")
        return f"ProcessKilled: the process was terminated by {_signal_name(sig)} ({hint})"
    return ""


def _with_status(stderr: str, line: str) -> str:
    if not line:
        return stderr
    return stderr + ("" if not stderr or stderr.endswith("\n") else "\n") + line + "\n"


def _run_cold(launcher: _Launcher, limits: _Limits, code: str) -> dict:
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
        started = _wait_readable(status_r, _SETUP_GRACE_S) and os.read(status_r, 16) == b"R"
        pidfd = os.pidfd_open(proc.pid)
        try:
            timed_out = started and not _wait_readable(pidfd, limits.timeout_s)
            # Kill before reaping: while the leader is a zombie its pid (= the group id) cannot be
            # reused, so this never hits an unrelated process. In bwrap/unshare modes this also tears
            # down the PID namespace; in none mode it ends what the code left in its session.
            _kill_group(proc.pid)
        finally:
            os.close(pidfd)
        proc.wait()
        mc = limits.max_output_chars
        (stdout, t1), (stderr, t2) = _rn_tail(out_fd, mc, OUTPUT_FILE_LIMIT_BYTES), _rn_tail(err_fd, mc, OUTPUT_FILE_LIMIT_BYTES)
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


def _wait_readable(fd: int, timeout_s: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


def _kill_group(pgid: int) -> None:
    # bwrap/unshare sit at the head of their own session; killing them takes down the PID namespace.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_PROBE_LIMITS = _Limits(timeout_s=20.0, memory_mb=512, max_output_chars=4000, disk_mb=16)


@functools.cache
def _probe(isolation: Isolation) -> str | None:
    """None if ``isolation`` works on this machine, else why not (with what to do about it)."""
    if isolation == Isolation.BWRAP and shutil.which("bwrap") is None:
        return "bwrap not found on PATH (install bubblewrap: apt-get install -y bubblewrap)"
    if isolation == Isolation.UNSHARE and shutil.which("unshare") is None:
        return "unshare not found on PATH (install util-linux)"
    try:
        raw = _run_cold(_Launcher.create(isolation), _PROBE_LIMITS, "print(6 * 7)")
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
        reason = _probe(isolation)
        if reason is None:
            return isolation
        reasons[isolation] = reason
    raise RuntimeError("no sandbox isolation works here: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))


_logged_isolations: set[tuple[Isolation, str]] = set()
_log_lock = threading.Lock()


def _log_isolation_once(isolation: Isolation, mode: str) -> None:
    with _log_lock:
        if (isolation, mode) in _logged_isolations:
            return
        _logged_isolations.add((isolation, mode))
        warn = isolation == Isolation.NONE and (Isolation.NONE, "") not in _logged_isolations
        _logged_isolations.add((isolation, ""))
    logger.info("sandbox: running model code under isolation=%s, mode=%s", isolation.value, mode)
    if warn:
        missing = "; ".join(f"{i.value}: {r}" for i in (Isolation.BWRAP, Isolation.UNSHARE) if (r := _probe(i)))
        logger.warning(
            "sandbox: isolation=none gives NO filesystem, network or process isolation (only rlimits): "
            "model code can read files, open sockets and leave processes behind. %s. "
            "Install bubblewrap (apt-get install -y bubblewrap) and make sure user namespaces or root are available.",
            f"Missing: {missing}" if missing else "bwrap/unshare work here but isolation='none' was requested",
        )


# ---------------------------------------------------------------------------------------------------
# Warm servers.
# ---------------------------------------------------------------------------------------------------


class _ServerDied(Exception):
    pass


class _WarmServer:
    """One pre-started runner in server role; serves one call at a time over length-prefixed JSON."""

    def __init__(self, proc: subprocess.Popen, log_fd: int, private_dir: str | None):
        self.proc = proc
        self.log_fd = log_fd
        self.private_dir = private_dir
        self.fresh_proc = False
        self.failed_imports: list[str] = []

    def wait_ready(self, timeout_s: float) -> None:
        msg = self._recv(time.monotonic() + timeout_s)
        if not msg.get("ready"):
            raise _ServerDied(msg.get("error", "server reported not ready"))
        self.fresh_proc = bool(msg.get("fresh_proc"))
        self.failed_imports = list(msg.get("failed_imports", []))

    def call(self, request: dict, deadline: float) -> dict:
        data = json.dumps(request).encode()
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise _ServerDied(f"could not send the request ({e})") from None
        return self._recv(deadline)

    def _recv(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        buf = b""
        need = 4
        header_done = False
        while True:
            while len(buf) < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not _wait_readable(fd, remaining):
                    raise TimeoutError("no answer from the sandbox server in time")
                chunk = os.read(fd, max(65536, need - len(buf)))
                if not chunk:
                    raise _ServerDied(self._death_note())
                buf += chunk
            if header_done:
                return json.loads(buf[4:need])
            need = 4 + struct.unpack(">I", buf[:4])[0]
            header_done = True

    def _death_note(self) -> str:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        log = _rn_tail(self.log_fd, 2000, OUTPUT_FILE_LIMIT_BYTES)[0].strip()
        note = f"exit status {code}" if code is not None else "closed its pipe"
        return note + (f"; log: {log.splitlines()[-1]}" if log else "")

    def log(self) -> str:
        return _rn_tail(self.log_fd, 4000, OUTPUT_FILE_LIMIT_BYTES)[0]

    def kill(self) -> None:
        _kill_group(self.proc.pid)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            os.close(self.log_fd)
        except OSError:
            pass
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


class _WarmPool:
    """Lazily started servers, at most ``max_size``; a dead or timed-out server is discarded."""

    def __init__(self, launcher: _Launcher, limits: _Limits, warm_imports: tuple[str, ...], max_size: int):
        self.launcher, self.limits, self.warm_imports, self.max_size = launcher, limits, warm_imports, max_size
        self._idle: list[_WarmServer] = []
        self._count = 0
        self._lock = threading.Lock()
        self._closed = False
        # PDEATHSIG follows the spawning thread, so every server is spawned from this one.
        self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")
        self._warned_imports = False
        self.fresh_proc: bool | None = None

    def acquire(self) -> _WarmServer:
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed")
            if self._idle:
                return self._idle.pop()
            if self._count >= self.max_size:
                raise RuntimeError("warm pool exhausted (more concurrent callers than max_concurrency)")
            self._count += 1
        try:
            return self._start()
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def release(self, server: _WarmServer, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed and server.proc.poll() is None:
                self._idle.append(server)
                return
            self._count -= 1
        server.kill()

    def _start(self) -> _WarmServer:
        private_dir = self.launcher.make_private_dir()
        scratch = private_dir or self.launcher.scratch
        cfg = self.launcher.runner_config("server", self.limits, scratch, warm_imports=list(self.warm_imports))
        argv = self.launcher.argv("server", cfg, scratch)
        log_fd = os.memfd_create("sandbox-server-log")

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd,
                                    **self.launcher.popen_kwargs(scratch))

        proc = self._spawner.submit(spawn).result()
        server = _WarmServer(proc, log_fd, private_dir)
        try:
            server.wait_ready(_SERVER_START_TIMEOUT_S)
        except (_ServerDied, TimeoutError) as e:
            log = server.log().strip()
            server.kill()
            raise RuntimeError(f"could not start a warm sandbox server under {self.launcher.isolation}: {e}"
                               + (f"\nserver log:\n{log}" if log else "")) from None
        if self.fresh_proc is None:
            self.fresh_proc = server.fresh_proc
            if not server.fresh_proc and self.launcher.isolation != Isolation.NONE:
                logger.info("sandbox: warm calls keep the server's /proc view (no fresh /proc per call here)")
        if server.failed_imports and not self._warned_imports:
            self._warned_imports = True
            logger.warning("sandbox: warm_imports that failed to import: %s", "; ".join(server.failed_imports))
        return server

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for server in idle:
            server.kill()
        self._spawner.shutdown(wait=False)


# ---------------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------------


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _StatsAccumulator:
    def __init__(self) -> None:
        self.calls = self.successes = self.timeouts = 0
        self.latencies = array("d")

    def add(self, result: ExecResult) -> None:
        self.calls += 1
        self.successes += result.ok
        self.timeouts += result.timed_out
        self.latencies.append(result.latency_s)

    def snapshot(self) -> SandboxStats:
        lat = sorted(self.latencies)
        return SandboxStats(
            calls=self.calls,
            successes=self.successes,
            errors=self.calls - self.successes - self.timeouts,
            timeouts=self.timeouts,
            latency_p50_s=_percentile(lat, 0.50),
            latency_p90_s=_percentile(lat, 0.90),
            latency_p99_s=_percentile(lat, 0.99),
            latency_max_s=lat[-1] if lat else 0.0,
        )


def _check_number(name: str, value, minimum: float, integer: bool, hint: str) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} >= {minimum:g}, got {value!r}; {hint}")


class PythonSandbox:
    """Runs model-written Python like a notebook cell, isolated from the host and from other calls.

    Args:
        timeout_s: wall-clock limit per call in seconds (counted from when the code starts); the
            process tree is SIGKILLed at the limit. ``RLIMIT_CPU`` is set to ``ceil(timeout_s) + 1``.
        memory_mb: address space the code may map on top of what is loaded when it starts (the bare
            interpreter in cold mode; interpreter plus ``warm_imports`` in warm mode).
        max_output_chars: how many characters of stdout and of stderr (each) are kept; longer
            output keeps its tail after a marker line.
        max_concurrency: most calls running at once (and most warm servers).
        mode: ``"cold"`` (a fresh interpreter per call) or ``"warm"`` (pre-started servers that fork
            per call).
        isolation: ``"auto"`` (the strongest that works, see :func:`detect_isolation`) or an
            :class:`Isolation` / its string value, which must work here.
        warm_imports: modules each warm server imports before forking (ignored in cold mode).
        disk_mb: size of each private tmpfs (scratch directory, ``/tmp``, ``/dev/shm``).
        extra_hidden_paths: more host paths to hide from the code (e.g. data directories with
            credentials) in bwrap/unshare modes.

    Raises:
        ValueError: an argument is out of range or of the wrong type.
        RuntimeError: the requested isolation does not work on this machine (the message says why
            and how to get it).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 8000,
        max_concurrency: int = 8,
        mode: str = "cold",
        isolation: str | Isolation = "auto",
        warm_imports: Iterable[str] = ("math", "fractions", "itertools", "numpy", "sympy"),
        disk_mb: int = 64,
        extra_hidden_paths: Sequence[str] = (),
    ) -> None:
        _check_number("timeout_s", timeout_s, 0.01, False, "it is the wall-clock limit of one call in seconds")
        _check_number("memory_mb", memory_mb, 32, True, "it is the address space (MB) the code may use")
        _check_number("max_output_chars", max_output_chars, 256, True,
                      "it bounds how much of stdout/stderr is returned (the tail is kept)")
        _check_number("max_concurrency", max_concurrency, 1, True, "it is how many calls may run at once")
        _check_number("disk_mb", disk_mb, 1, True, "it is the size of the private scratch tmpfs in MB")
        if mode not in ("cold", "warm"):
            raise ValueError(f"mode must be 'cold' (fresh interpreter per call) or 'warm' (pre-started "
                             f"servers that fork per call), got {mode!r}")
        if isinstance(warm_imports, str) or not isinstance(warm_imports, Iterable):
            raise ValueError(f"warm_imports must be a sequence of module names such as ('numpy', 'sympy'), "
                             f"got {warm_imports!r}")
        warm_imports = tuple(warm_imports)
        bad = [m for m in warm_imports if not isinstance(m, str) or not all(p.isidentifier() for p in m.split("."))]
        if bad:
            raise ValueError(f"warm_imports contains invalid module names {bad}; use dotted names like 'numpy.linalg'")
        if isinstance(extra_hidden_paths, str) or not all(isinstance(p, str) and p.startswith("/") for p in extra_hidden_paths):
            raise ValueError(f"extra_hidden_paths must be a sequence of absolute paths, got {extra_hidden_paths!r}")
        self.isolation = self._resolve_isolation(isolation)
        self.mode = mode
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.max_concurrency = max_concurrency
        self.warm_imports = warm_imports
        self._limits = _Limits(self.timeout_s, memory_mb, max_output_chars, disk_mb)
        self._launcher = _Launcher.create(self.isolation, tuple(extra_hidden_paths))
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._step = _StatsAccumulator()
        self._total = _StatsAccumulator()
        self._closed = False
        self._pool = _WarmPool(self._launcher, self._limits, warm_imports, max_concurrency) if mode == "warm" else None
        self._finalizer = weakref.finalize(self, self._pool.close) if self._pool is not None else None
        _log_isolation_once(self.isolation, mode)

    @staticmethod
    def _resolve_isolation(isolation: str | Isolation) -> Isolation:
        if isolation == "auto":
            return detect_isolation()
        try:
            resolved = Isolation(isolation)
        except ValueError:
            choices = ", ".join(repr(i.value) for i in Isolation)
            raise ValueError(f"isolation must be 'auto' or one of {choices}, got {isolation!r}") from None
        reason = _probe(resolved)
        if reason is not None:
            raise RuntimeError(f"isolation {resolved.value!r} does not work on this machine: {reason}. "
                               f"Use isolation='auto' to take the strongest that does.")
        return resolved

    def run(self, code: str) -> ExecResult:
        """Run ``code`` in a fresh sandboxed process and wait for it.

        The value of a trailing expression is printed (its ``repr``) unless it is None. Nothing the
        code does survives the call. Blocks while ``max_concurrency`` calls are already running.

        Returns:
            An :class:`ExecResult`; model errors, timeouts and signal deaths are reported in it,
            never raised. A warm server that dies mid-call gives ``exit_code=None`` and is replaced.

        Raises:
            TypeError: ``code`` is not a string.
            RuntimeError: the sandbox is closed, or a warm server cannot be started at all.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if self._closed:
            raise RuntimeError("the sandbox is closed; create a new PythonSandbox")
        with self._slots:
            t0 = time.perf_counter()
            raw = self._run_warm(code) if self._pool is not None else _run_cold(self._launcher, self._limits, code)
            result = self._to_result(raw, time.perf_counter() - t0)
        with self._stats_lock:
            self._step.add(result)
            self._total.add(result)
        return result

    async def arun(self, code: str) -> ExecResult:
        """Async :meth:`run`: runs in one of ``max_concurrency`` worker threads, so calls overlap.

        Cancelling the awaiting task does not stop a call already running; it ends at its timeout.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._get_executor(), self.run, code)

    def warm_up(self, n: int | None = None) -> None:
        """Start up to ``n`` (default ``max_concurrency``) warm servers now instead of on first use.

        No-op in cold mode.

        Raises:
            RuntimeError: a server cannot be started.
        """
        if self._pool is None:
            return
        n = self.max_concurrency if n is None else max(0, min(n, self.max_concurrency))
        held = 0
        servers: list[_WarmServer] = []
        try:
            for _ in range(n):  # hold the slots, so that no call can need a server meanwhile
                self._slots.acquire()
                held += 1
            # A private executor: the shared one may be busy with calls that wait for our slots.
            with concurrent.futures.ThreadPoolExecutor(max(1, n), thread_name_prefix="sandbox-warmup") as pool:
                futures = [pool.submit(self._pool.acquire) for _ in range(n)]
                for future in concurrent.futures.as_completed(futures):
                    try:
                        servers.append(future.result())
                    except BaseException:
                        pass
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                raise errors[0]
        finally:
            for server in servers:
                self._pool.release(server, healthy=True)
            for _ in range(held):
                self._slots.release()

    def stats(self) -> SandboxStats:
        """Statistics of the calls since the last :meth:`reset_step_stats` (or construction)."""
        with self._stats_lock:
            return self._step.snapshot()

    def total_stats(self) -> SandboxStats:
        """Statistics of every call since construction (not affected by :meth:`reset_step_stats`)."""
        with self._stats_lock:
            return self._total.snapshot()

    def reset_step_stats(self) -> None:
        """Start a new step: :meth:`stats` counts from here on; totals keep accumulating."""
        with self._stats_lock:
            self._step = _StatsAccumulator()

    def close(self) -> None:
        """Stop the warm servers and worker threads. Further calls raise RuntimeError. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PythonSandbox(mode={self.mode!r}, isolation={self.isolation.value!r}, timeout_s={self.timeout_s}, "
                f"memory_mb={self.memory_mb}, max_concurrency={self.max_concurrency})")

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed; create a new PythonSandbox")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="sandbox")
            return self._executor

    def _run_warm(self, code: str) -> dict:
        server = self._pool.acquire()
        deadline = time.monotonic() + self.timeout_s + 2 * _SETUP_GRACE_S
        try:
            raw = server.call({"code": code, "timeout_s": self.timeout_s}, deadline)
        except _ServerDied as e:
            self._pool.release(server, healthy=False)
            return {"error": f"the sandbox server died during this call ({e}); a fresh one will serve the next call"}
        except TimeoutError:
            self._pool.release(server, healthy=False)
            return {"stdout": "", "stderr": "", "exit_code": -signal.SIGKILL, "timed_out": True, "truncated": False}
        self._pool.release(server, healthy=True)
        return raw

    def _to_result(self, raw: dict, latency_s: float) -> ExecResult:
        common = {"latency_s": latency_s, "isolation": self.isolation.value, "mode": self.mode}
        if raw.get("error"):
            logger.error("sandbox: call failed inside the sandbox machinery: %s", raw["error"])
            return ExecResult(ok=False, stdout="", stderr=f"SandboxError: {raw['error']}\n", exit_code=None,
                              timed_out=False, **common)
        exit_code, timed_out = raw["exit_code"], raw["timed_out"]
        line = _status_line(self.timeout_s, exit_code, timed_out, self.memory_mb)
        return ExecResult(
            ok=exit_code == 0 and not timed_out,
            stdout=raw["stdout"],
            stderr=_with_status(raw["stderr"], line),
            exit_code=exit_code,
            timed_out=timed_out,
            output_truncated=raw["truncated"],
            **common,
        )
