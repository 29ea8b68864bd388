"""Warm mode: pre-started runners in server role, each forking one child per call (see docs/sandbox.md)."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

from trl_plugins.tools.sandbox.cgroups import CallCgroup
from trl_plugins.tools.sandbox.launcher import (
    KILL_GRACE_S,
    OUTPUT_FILE_LIMIT_BYTES,
    SETUP_GRACE_S,
    Isolation,
    Launcher,
    Limits,
    call_cgroup,
    kill_call,
    memfd_with,
    wait_readable,
)
from trl_plugins.tools.sandbox.runner import read_tail

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 120.0
"""How long a new server may take to import ``warm_imports`` and answer its first probe call."""

MAX_ANSWER_BYTES = 1 << 16
"""Largest message a server sends (an exit status, or why set-up failed)."""


class ServerDied(Exception):
    """The server exited or closed its pipe; the message says how (and its last log line)."""


class WarmServer:
    """One pre-started runner in server role (a zygote): serves one call at a time over a socket.

    A call sends a small JSON message (the time limit) with three descriptors made here: a memfd holding the
    code, and the memfds the code's stdout and stderr go to. The server forks the call with them, says when the
    code starts (``{"started": true}``) and answers with the exit status only; this process reads the output
    itself. The server never holds call data.
    """

    def __init__(
        self,
        proc: subprocess.Popen,
        sock: socket.socket,
        log_fd: int,
        private_dir: str | None,
        cgroup: CallCgroup | None,
        namespaced: bool,
        max_output_chars: int,
    ):
        self.proc = proc
        self.sock = sock
        self.log_fd = log_fd
        self.private_dir = private_dir
        self.cgroup = cgroup
        """The cgroup each call's processes join (one call at a time), or None."""
        self.namespaced = namespaced
        self.max_output_chars = max_output_chars
        self.oom_kills = 0
        self.fresh_proc = False
        self.forked_init: str | None = None
        """Why warm calls get a forked init instead of the exec-only ``sleep`` (None: they do not)."""
        self.failed_imports: list[str] = []
        self.lost = False
        """The server was killed (it did not answer in time, or said its call's processes were stuck)."""
        self._killed = False

    def wait_ready(self, timeout_s: float) -> None:
        msg = self._recv(time.monotonic() + timeout_s)
        if not msg.get("ready"):
            raise ServerDied(msg.get("error", "server reported not ready"))
        self.fresh_proc = bool(msg.get("fresh_proc"))
        self.forked_init = msg.get("forked_init")
        self.failed_imports = list(msg.get("failed_imports", []))

    def call(self, code: str, timeout_s: float) -> dict:
        """Run ``code``; the raw result fields (stdout and stderr read here, from this process's memfds).

        Returns by ``timeout_s + KILL_GRACE_S`` after the code started (set-up: ``SETUP_GRACE_S``): a server that
        has not answered by then is killed with everything it runs (:attr:`lost`), and the call is reported as
        timed out with the output it wrote until then.

        Raises:
            ServerDied: the server exited or closed its socket.
        """
        fds = [
            memfd_with("sandbox-code", code.encode("utf-8", "surrogatepass")),
            os.memfd_create("sandbox-stdout"),
            os.memfd_create("sandbox-stderr"),
        ]
        try:
            try:
                socket.send_fds(self.sock, [json.dumps({"timeout_s": timeout_s}).encode()], fds)
            except OSError as e:
                raise ServerDied(f"could not send the request ({e})") from None
            try:
                result = self._recv(time.monotonic() + SETUP_GRACE_S)
                if result.get("started"):
                    result = self._recv(time.monotonic() + timeout_s + KILL_GRACE_S)
            except TimeoutError:
                self.lost = True
                self.kill()  # its PID namespace, the call's nested in it, dies with it; its cgroup is emptied
                result = {"exit_code": -signal.SIGKILL, "timed_out": True}
            if result.get("stuck"):  # processes of the call it could not reap in time: nothing it runs may stay
                self.lost = True
                self.kill()
            if self.cgroup is not None and not self._killed:  # one read per call (off the ~1 ms a warm call costs)
                before, self.oom_kills = self.oom_kills, self.cgroup.oom_kills()
                result["oom_killed"] = self.oom_kills > before
                if not self.namespaced:  # what left the call's session; bwrap/unshare: the PID namespace took it
                    self.cgroup.kill_all()
            if not result.get("error"):
                (result["stdout"], t1), (result["stderr"], t2) = (
                    read_tail(fds[1], self.max_output_chars, OUTPUT_FILE_LIMIT_BYTES),
                    read_tail(fds[2], self.max_output_chars, OUTPUT_FILE_LIMIT_BYTES),
                )
                result["truncated"] = t1 or t2
            return result
        finally:
            for fd in fds:
                os.close(fd)

    def _recv(self, deadline: float) -> dict:
        fd = self.sock.fileno()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not wait_readable(fd, remaining):
            raise TimeoutError("no answer from the sandbox server in time")
        try:
            data = self.sock.recv(MAX_ANSWER_BYTES)
        except OSError as e:
            raise ServerDied(f"{e}; {self._death_note()}") from None
        if not data:
            raise ServerDied(self._death_note())
        return json.loads(data)

    def _death_note(self) -> str:
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        log = read_tail(self.log_fd, 2000, OUTPUT_FILE_LIMIT_BYTES)[0].strip()
        note = f"exit status {code}" if code is not None else "closed its socket"
        return note + (f"; log: {log.splitlines()[-1]}" if log else "")

    def log(self) -> str:
        return read_tail(self.log_fd, 4000, OUTPUT_FILE_LIMIT_BYTES)[0]

    def kill(self) -> None:
        """Kill the server and everything it runs, and free what it holds; idempotent."""
        if self._killed:
            return  # its pid may be another process's by now
        self._killed = True
        kill_call(self.proc.pid)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.sock.close()
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
            if healthy and not server.lost and not self._closed and server.proc.poll() is None:
                self._idle.append(server)
                return
            self._count -= 1
        server.kill()

    def _start(self) -> WarmServer:
        private_dir = self.launcher.make_private_dir()
        scratch = private_dir or self.launcher.scratch
        cgroup = call_cgroup(self.launcher, self.limits)
        cgroup_fds = cgroup.open_tasks() if cgroup is not None else []
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = self.launcher.runner_config(
            "server",
            self.limits,
            scratch,
            warm_imports=list(self.warm_imports),
            cgroup_fds=cgroup_fds,
            proto_fd=server_end.fileno(),
        )
        argv, launch_fds = self.launcher.command("server", cfg, scratch)
        log_fd = os.memfd_create("sandbox-server-log")

        def spawn() -> subprocess.Popen:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log_fd,
                pass_fds=(*cgroup_fds, *launch_fds, server_end.fileno()),
                **self.launcher.popen_kwargs(scratch),
            )

        try:
            proc = self._spawner.submit(spawn).result()
        except BaseException:
            os.close(log_fd)
            host_end.close()
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            for fd in (*cgroup_fds, *launch_fds):
                os.close(fd)
            server_end.close()
        server = WarmServer(
            proc,
            host_end,
            log_fd,
            private_dir,
            cgroup,
            self.launcher.isolation != Isolation.NONE,
            self.limits.max_output_chars,
        )
        try:
            server.wait_ready(SERVER_START_TIMEOUT_S)
        except (ServerDied, TimeoutError) as e:
            log = server.log().strip()
            server.kill()
            raise RuntimeError(
                f"could not start a warm sandbox server under {self.launcher.isolation}: {e}"
                + (f"\nserver log:\n{log}" if log else "")
            ) from None
        if self.fresh_proc is None:
            self.fresh_proc = server.fresh_proc
            if not server.fresh_proc and self.launcher.isolation != Isolation.NONE:
                logger.info("sandbox: warm calls keep the server's /proc view (no fresh /proc per call here)")
            if server.forked_init and self.launcher.isolation != Isolation.NONE:
                logger.info("sandbox: warm calls get a forked init (a few ms more per call): %s", server.forked_init)
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
