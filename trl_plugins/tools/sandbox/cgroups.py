"""Per-call memory and process budgets: a cgroup for each call, where this machine lets us make one.

``RLIMIT_AS`` bounds each process, not a call: 60 processes of ``memory_mb`` each, or memory that is
not mapped at all (memfd and tmpfs pages, System V segments), escape it. A memory cgroup counts every
page the call's processes charge, shared memory included, and a pids cgroup counts its processes and
threads. The host makes the cgroups and hands the runner descriptors of their ``tasks`` files; the
runner joins before any model code runs (see ``runner.join_cgroups``).

Supported: the cgroup v1 ``memory`` and ``pids`` controllers, below the cgroup this process is in.
cgroup v2 (``memory.max``, ``pids.max``) is not implemented: where it is the only hierarchy with
those controllers, or nothing is writable, :func:`cgroup_roots` returns None and the sandbox falls
back to rlimits plus a seccomp filter that refuses memfd and System V shared memory
(docs/sandbox.md, "Memory").
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CGROUP_HEADROOM_MB = 64
"""The call's memory cgroup allows ``memory_mb`` plus this much: the interpreter's own pages charged
after the runner joined (the runner, the code's parse tree, modules the code imports)."""

_counter = itertools.count()


@dataclass(frozen=True)
class CgroupRoots:
    """Directories under which per-call cgroups are made (one per controller)."""

    memory: str
    pids: str


def _v1_mounts() -> dict[str, str]:
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] != "cgroup":
                continue
            for option in fields[sep + 3].split(","):
                if option in ("memory", "pids"):
                    mounts[option] = fields[4]
    return mounts


def _own_path(controller: str) -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return path
    return None


@functools.cache
def cgroup_roots() -> CgroupRoots | None:
    """Where per-call cgroups can be made here, or None (the reason is logged once at INFO)."""
    try:
        mounts = _v1_mounts()
        roots = {}
        for controller in ("memory", "pids"):
            own = _own_path(controller)
            if controller not in mounts or own is None:
                raise OSError(f"no cgroup v1 {controller} controller is mounted")
            roots[controller] = os.path.join(mounts[controller], own.lstrip("/"))
        probe = CallCgroup(CgroupRoots(**roots), 64 << 20, 8)
        probe.remove()
        for root in roots.values():
            _remove_stale(root)
        return CgroupRoots(**roots)
    except (OSError, ValueError) as e:
        logger.info("sandbox: no per-call cgroup here (%s); memory is bounded per process", e)
        return None


def _remove_stale(root: str) -> None:
    # Left by a process that died without cleaning up (its pid is in the name); only empty cgroups
    # can be removed, so a live one is never touched.
    for name in os.listdir(root):
        parts = name.split("-")
        if name.startswith("trl-sandbox-") and len(parts) == 4 and parts[2].isdigit():
            if not os.path.exists(f"/proc/{parts[2]}"):
                try:
                    os.rmdir(os.path.join(root, name))
                except OSError:
                    pass


class CallCgroup:
    """A memory and a pids cgroup for one call (cold) or for the calls of one warm server, one at a time."""

    def __init__(self, roots: CgroupRoots, memory_bytes: int, max_pids: int) -> None:
        name = f"trl-sandbox-{os.getpid()}-{next(_counter)}"
        self.memory_dir = os.path.join(roots.memory, name)
        self.pids_dir = os.path.join(roots.pids, name)
        self.dirs: list[str] = []
        try:
            for d in (self.memory_dir, self.pids_dir):
                os.mkdir(d)
                self.dirs.append(d)
            self._write("memory.limit_in_bytes", memory_bytes)
            if os.path.exists(os.path.join(self.memory_dir, "memory.memsw.limit_in_bytes")):
                self._write("memory.memsw.limit_in_bytes", memory_bytes)  # no swapping past the limit
            with open(os.path.join(self.pids_dir, "pids.max"), "w") as f:
                f.write(str(max_pids))
        except OSError:
            self.remove()
            raise

    def _write(self, name: str, value: int) -> None:
        with open(os.path.join(self.memory_dir, name), "w") as f:
            f.write(str(value))

    def open_tasks(self) -> list[int]:
        """Descriptors of each ``tasks`` file, for the runner to join through (close them after the launch).

        ``tasks``, not ``cgroup.procs``: moving the calling thread alone skips the kernel's global
        thread-group lock (an RCU grace period per move, which cost warm calls ~10 ms on a loaded
        machine); the runner is single-threaded when it joins, and what it forks later follows it.
        """
        return [os.open(os.path.join(d, "tasks"), os.O_WRONLY | os.O_CLOEXEC) for d in self.dirs]

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed so far."""
        try:
            with open(os.path.join(self.memory_dir, "memory.oom_control")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill_all(self) -> None:
        """SIGKILL whatever is still in the cgroups (nothing, when the PID namespace is gone)."""
        for _ in range(50):
            pids = set()
            for d in self.dirs:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids.update(int(x) for x in f.read().split())
                except OSError:
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        """Remove the cgroups (after :meth:`kill_all`); one still busy after a second is left and logged."""
        for d in reversed(self.dirs):
            for attempt in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 99:
                        logger.warning("sandbox: could not remove cgroup %s", d)
                    time.sleep(0.01)
        self.dirs = []
