"""Running one agent of the agent endpoint within its time limit, and letting go of one that outlives it.

An ``async def`` agent runs on an event loop of its own (:class:`AgentLoop`, one per rollout, in a thread of its own),
so that what it does never holds up the endpoint's loop; a ``command`` runs under :mod:`.reaper`, a subreaper that
takes every process the command started with it (:func:`run_command`). At its limit (or a stop) an agent is cancelled
and given :data:`AGENT_GRACE_S` to end (:func:`let_go`); the rollout then goes on without it. docs/agents.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, Awaitable, Callable

__all__ = [
    "AGENT_GRACE_S",
    "COMMAND_AGENTS_PER_CORE",
    "NOTHING_ASKED",
    "AgentFailed",
    "AgentLoop",
    "let_go",
    "run_command",
    "usable_cores",
]

logger = logging.getLogger(__name__)

AGENT_GRACE_S = 1.0
"""How long an agent cancelled at its time limit (or by a stop) has to finish, and a command's processes to be killed,
before the rollout goes on without it: a rollout returns within ``agent_time_limit_s`` plus this, whatever its agents
do (plus as much again at its end when an ``async def`` agent blocks its event loop in code of its own)."""

COMMAND_AGENTS_PER_CORE = 2
"""``command`` agents running at once per usable core, where ``max_concurrent_agents`` is not set."""

NOTHING_ASKED = (
    "the agent returned without asking the model anything (did a response cache answer it? DSPy's keys "
    "leave out api_base, so it replays completions of earlier runs, steps and samples, of any model: build "
    "the program's LM with dspy.LM(..., cache=False))"
)
"""An agent's trajectory that never reached the endpoint (docs/agents.md, DSPy's traps)."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")


class AgentFailed(Exception):
    """The agent broke its contract (a command's exit status or output, a return value of the wrong kind)."""


async def run_command(command: list[str], row: dict, env: dict[str, str]) -> Any:
    """Run an agent command (``row`` as JSON on its stdin, in environment ``env``) under :mod:`.reaper`, which takes
    every process it started with it when the command's own process exits (what it printed until then is its output,
    whatever a process it left does with its stdout) or when this is cancelled (its time limit, a stop: then within
    :data:`AGENT_GRACE_S`). Returns the last line of its stdout, parsed as JSON (None when it printed nothing).

    Raises:
        AgentFailed: it exited non-zero (its stderr's tail is in the message), or its last line is not JSON.
    """
    encoded = json.dumps(row, default=str)
    loop = asyncio.get_running_loop()
    output = _CommandOutput(loop)
    try:
        transport, _ = await loop.subprocess_exec(
            lambda: output,
            sys.executable,
            "-I",
            "-S",
            _REAPER,
            str(os.getpid()),
            "--",
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=output.writers[1],
            stderr=output.writers[2],
            env=env,
            start_new_session=True,
        )
    except BaseException:
        output.close()
        raise
    try:
        output.started()
        stdin = transport.get_pipe_transport(0)
        stdin.write(encoded.encode())
        stdin.close()  # buffered by the loop: a command that never reads its stdin does not hold this up
        try:
            await output.exited.wait()
        except BaseException:  # its time limit or a stop: the command and everything it started go
            try:
                transport.send_signal(signal.SIGTERM)  # the reaper kills them all, then exits
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(output.exited.wait(), AGENT_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning(
                    "an agent command's reaper did not exit within %s s of SIGTERM; it is killed, and what "
                    "it had not killed yet may run on",
                    AGENT_GRACE_S,
                )
            raise
        out, err = output.drain()
        returncode = transport.get_returncode()
    finally:
        output.close()
        transport.close()  # kills the reaper if it still runs (it had its grace)
    if returncode != 0:
        tail = err.decode(errors="replace").strip()[-1500:]
        raise AgentFailed(f"the agent command exited with status {returncode}: {tail or '(no stderr)'}")
    lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise AgentFailed(
            f"the agent command's last line of stdout is not JSON: {lines[-1][:200]!r}; print its "
            f"result (a number, a mapping of numbers, or null) as JSON on the last line."
        ) from None


class _CommandOutput(asyncio.SubprocessProtocol):
    """A command's stdout and stderr, read from pipes of our own as data arrives, and the moment its process exits
    (not the end of its pipes: a process it left may hold them)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.exited = asyncio.Event()
        self.chunks: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self.readers: dict[int, int] = {}
        self.writers: dict[int, int] = {}
        for fd in (1, 2):
            self.readers[fd], self.writers[fd] = os.pipe()
            os.set_blocking(self.readers[fd], False)

    def started(self) -> None:
        """The command has its ends of the pipes: ours go, and reading begins."""
        for fd in (1, 2):
            os.close(self.writers.pop(fd))
            self.loop.add_reader(self.readers[fd], self._read, fd)

    def _read(self, fd: int) -> bool:
        """Read what ``fd``'s pipe holds now; returns whether it is at its end."""
        try:
            data = os.read(self.readers[fd], 1 << 16)
        except (BlockingIOError, InterruptedError):
            return False
        if data:
            self.chunks[fd] += data
            return False
        self.loop.remove_reader(self.readers[fd])
        return True

    def process_exited(self) -> None:
        self.exited.set()

    def drain(self) -> tuple[bytes, bytes]:
        """``(stdout, stderr)``: what arrived, and what the pipes hold now, without waiting for their end."""
        for fd in (1, 2):
            while True:
                size = len(self.chunks[fd])
                if self._read(fd) or len(self.chunks[fd]) == size:
                    break
        return bytes(self.chunks[1]), bytes(self.chunks[2])

    def close(self) -> None:
        for fd, reader in self.readers.items():
            self.loop.remove_reader(reader)
            os.close(reader)
        for writer in self.writers.values():
            os.close(writer)
        self.readers.clear()
        self.writers.clear()


class AgentLoop:
    """The event loop the rollout's ``async def`` agents run on, in a thread of its own, so that the endpoint's loop
    (its server, the dispatcher, the time limits) never waits on an agent: one that blocks in code of its own, or
    catches its cancellation and runs on, holds up this loop only, and the rollout leaves it behind."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="agents", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            for task in asyncio.all_tasks(self.loop):
                task._log_destroy_pending = False  # left behind on purpose, and said so (let_go)
            self.loop.close()

    def start(self, coro: Any) -> tuple[asyncio.Future, Callable[[], None]]:
        """Run ``coro`` there: a future of the calling loop that ends as it ends, and a function that cancels it."""
        home = asyncio.get_running_loop()
        outer = home.create_future()
        outer.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, also when nobody waits any more
        tasks: list[asyncio.Task] = []

        def copy(task: asyncio.Task) -> None:
            if outer.done():
                return
            if task.cancelled():
                outer.cancel()
            elif task.exception() is not None:
                outer.set_exception(task.exception())
            else:
                outer.set_result(task.result())

        def report(task: asyncio.Task) -> None:
            try:
                home.call_soon_threadsafe(copy, task)
            except RuntimeError:  # the rollout's loop is closed: nobody waits for this agent any more
                pass

        def begin() -> None:
            task = self.loop.create_task(coro)
            task.add_done_callback(report)
            tasks.append(task)

        def cancel() -> None:
            try:
                self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks])  # after begin: callbacks keep order
            except RuntimeError:
                pass

        self.loop.call_soon_threadsafe(begin)
        return outer, cancel

    async def close(self, last: Callable[[], Awaitable[None]]) -> None:
        """Cancel what still runs there (agents already let go), run ``last()`` there (closing the agents' connection
        pool), stop the loop. Waits :data:`AGENT_GRACE_S` at most: a loop blocked by an agent's own code is left to
        its thread."""

        async def shutdown() -> None:
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()
            try:
                await last()
            finally:
                self.loop.call_soon(self.loop.stop)

        done = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(shutdown(), self.loop))
        try:
            await asyncio.wait_for(done, AGENT_GRACE_S)
        except asyncio.TimeoutError:
            logger.warning(
                "an async agent blocks its event loop in code of its own; the rollout goes on without it "
                "(its thread runs until that code returns)"
            )
            self.loop.call_soon_threadsafe(self.loop.stop)
        except Exception:  # noqa: BLE001 - closing the agents' pool failed; it goes with the loop
            logger.debug("closing the agents' connection pool failed", exc_info=True)


async def let_go(run: asyncio.Future, cancel: Callable[[], None]) -> None:
    """Cancel an agent's run and wait :data:`AGENT_GRACE_S` at most for it to end; one that does not is left
    behind (its trajectory has ended, its session is closed)."""
    cancel()
    await asyncio.wait({run}, timeout=AGENT_GRACE_S)
    if not run.done():
        logger.warning(
            "an agent still ran %s s after it was cancelled at its time limit or a stop; the rollout goes on "
            "without it (its trajectory has ended and its requests are refused)",
            AGENT_GRACE_S,
        )
    elif not run.cancelled():
        run.exception()  # read: what it raised or returned after its end counts for nothing
