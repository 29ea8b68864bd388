"""Warm mode: pre-started runners in server role, each forking one child per call (see docs/sandbox.md)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import threading
import time

from trl_plugins.tools.sandbox.cgroups import CallCgroup
from trl_plugins.tools.sandbox.launcher import (
    OUTPUT_FILE_LIMIT_BYTES,
    Isolation,
    Launcher,
    Limits,
    call_cgroup,
    kill_call,
    wait_readable,
)
from trl_plugins.tools.sandbox.runner import MESSAGE_HEADER, frame_message, read_tail

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 120.0
"""How long a new server may take to import ``warm_imports`` and answer its first probe call."""


class ServerDied(Exception):
    """The server exited or closed its pipe; the message says how (and its last log line)."""


class WarmServer:
    """One pre-started runner in server role; serves one call at a time over length-prefixed JSON."""

    def __init__(self, proc: subprocess.Popen, log_fd: int, private_dir: str | None, cgroup: CallCgroup | None,
                 namespaced: bool):
        self.proc = proc
        self.log_fd = log_fd
        self.private_dir = private_dir
        self.cgroup = cgroup
        """The cgroup each call's processes join (one call at a time), or None."""
        self.namespaced = namespaced
        self.oom_kills = 0
        self.fresh_proc = False
        self.failed_imports: list[str] = []

    def wait_ready(self, timeout_s: float) -> None:
        msg = self._recv(time.monotonic() + timeout_s)
        if not msg.get("ready"):
            raise ServerDied(msg.get("error", "server reported not ready"))
        self.fresh_proc = bool(msg.get("fresh_proc"))
        self.failed_imports = list(msg.get("failed_imports", []))

    def call(self, request: dict, deadline: float) -> dict:
        try:
            self.proc.stdin.write(frame_message(request))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise ServerDied(f"could not send the request ({e})") from None
        result = self._recv(deadline)
        if self.cgroup is not None:  # one read per call (kept off the ~1 ms a warm call may cost here)
            before, self.oom_kills = self.oom_kills, self.cgroup.oom_kills()
            result["oom_killed"] = self.oom_kills > before
            if not self.namespaced:  # what left the call's session; bwrap/unshare: the PID namespace took it
                self.cgroup.kill_all()
        return result

    def _recv(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        head = MESSAGE_HEADER.size
        buf = b""
        need = head
        header_done = False
        while True:
            while len(buf) < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not wait_readable(fd, remaining):
                    raise TimeoutError("no answer from the sandbox server in time")
                chunk = os.read(fd, max(65536, need - len(buf)))
                if not chunk:
                    raise ServerDied(self._death_note())
                buf += chunk
            if header_done:
                return json.loads(buf[head:need])
            need = head + MESSAGE_HEADER.unpack(buf[:head])[0]
            header_done = True

    def _death_note(self) -> str:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        log = read_tail(self.log_fd, 2000, OUTPUT_FILE_LIMIT_BYTES)[0].strip()
        note = f"exit status {code}" if code is not None else "closed its pipe"
        return note + (f"; log: {log.splitlines()[-1]}" if log else "")

    def log(self) -> str:
        return read_tail(self.log_fd, 4000, OUTPUT_FILE_LIMIT_BYTES)[0]

    def kill(self) -> None:
        kill_call(self.proc.pid)
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
        if self.cgroup is not None:
            self.cgroup.kill_all()
            self.cgroup.remove()


class WarmPool:
    """Lazily started servers, at most ``max_size``; a dead or timed-out server is discarded."""

    def __init__(self, launcher: Launcher, limits: Limits, warm_imports: tuple[str, ...], max_size: int):
        self.launcher, self.limits, self.warm_imports, self.max_size = launcher, limits, warm_imports, max_size
        self._idle: list[WarmServer] = []
        self._count = 0
        self._lock = threading.Lock()
        self._closed = False
        # PDEATHSIG follows the spawning thread, so every server is spawned from this one.
        self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawn")
        self._warned_imports = False
        self.fresh_proc: bool | None = None

    def acquire(self) -> WarmServer:
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

    def release(self, server: WarmServer, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed and server.proc.poll() is None:
                self._idle.append(server)
                return
            self._count -= 1
        server.kill()

    def _start(self) -> WarmServer:
        private_dir = self.launcher.make_private_dir()
        scratch = private_dir or self.launcher.scratch
        cgroup = call_cgroup(self.launcher, self.limits)
        cgroup_fds = cgroup.open_tasks() if cgroup is not None else []
        cfg = self.launcher.runner_config("server", self.limits, scratch, warm_imports=list(self.warm_imports),
                                          cgroup_fds=cgroup_fds)
        argv = self.launcher.argv("server", cfg, scratch)
        log_fd = os.memfd_create("sandbox-server-log")

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd,
                                    pass_fds=cgroup_fds, **self.launcher.popen_kwargs(scratch))

        try:
            proc = self._spawner.submit(spawn).result()
        except BaseException:
            os.close(log_fd)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            for fd in cgroup_fds:
                os.close(fd)
        server = WarmServer(proc, log_fd, private_dir, cgroup, self.launcher.isolation != Isolation.NONE)
        try:
            server.wait_ready(SERVER_START_TIMEOUT_S)
        except (ServerDied, TimeoutError) as e:
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
