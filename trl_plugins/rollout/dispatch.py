"""How the rollout engine feeds its sampler and counts its tools: one dispatcher per rollout sends each ready
turn to the backend as soon as it can take it (batched, or one call per turn up to the backend's concurrency),
from worker threads, so tool calls and other trajectories go on meanwhile."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, Iterator

from trl_plugins.rollout.request import RolloutError, RolloutResult

__all__ = ["Dispatcher", "ToolCounter", "ToolFailures", "concurrency", "settle", "watch"]

logger = logging.getLogger("trl_plugins.rollout.engine")  # the engine's: where tool failures were always logged


def concurrency(backend: Any) -> int:
    """The backend's declared ``max_concurrency``, checked."""
    n = backend.max_concurrency
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RolloutError(f"{type(backend).__name__}.max_concurrency must be >= 1, got {n}.")
    return n


async def watch(stop: threading.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.05)


async def settle(tasks: list[asyncio.Future], stop: threading.Event | None) -> bool:
    """Wait until every task is done, one raises, or ``stop`` is set; then cancel the tasks left and wait for them.
    Returns whether the stop ended the wait (the rollouts' one loop over their trajectories' coroutines)."""
    watcher = asyncio.ensure_future(watch(stop)) if stop is not None else None
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending | ({watcher} if watcher else set()), return_when=asyncio.FIRST_COMPLETED
            )
            if watcher in done:
                return True
            pending.discard(watcher)
            if any(t.exception() is not None for t in done if not t.cancelled()):
                return False
        return False
    finally:
        for task in tasks:
            task.cancel()
        if watcher is not None:
            watcher.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Abort(Exception):
    """A generate call raised a BaseException (e.g. KeyboardInterrupt); the rollout re-raises it at the end."""


class ToolFailures:
    """Tool failures, logged once per kind: the first failure of each ``(tool, kind)`` of a run at warning level with
    its traceback, later ones at debug level; :meth:`flush` logs how many of each kind a rollout had, in one line.
    (A tool that raises on every call would otherwise print a traceback per call.)"""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def record(self, tool: str, error: str, *, attempt: int, attempts: int, exc: BaseException | None = None) -> None:
        """One failed call: ``error`` is the tool's infrastructure error (``"ValueError: ..."`` when it raised)."""
        kind = type(exc).__name__ if exc is not None else error.split(":", 1)[0][:80]
        key = (tool, kind)
        self.counts[key] += 1
        first = key not in self.seen
        self.seen.add(key)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "tool %r failed (attempt %d of %d): %s%s",
            tool,
            attempt,
            attempts,
            error,
            "; the first of its kind: later ones are logged at debug level and counted once per rollout"
            if first
            else "",
            exc_info=exc,
        )

    def flush(self) -> None:
        """Log this rollout's failures per kind (nothing when there were none) and start counting afresh."""
        if self.counts:
            logger.warning(
                "tool failures in this rollout: %s",
                "; ".join(f"{tool!r} {kind} x {n}" for (tool, kind), n in sorted(self.counts.items())),
            )
        self.counts.clear()

    def __getstate__(self) -> dict:
        return {"seen": set(), "counts": collections.Counter()}  # a copy (another process) logs its own first ones


class ToolCounter:
    """Counts tool calls in flight and the wall time with at least one running."""

    def __init__(self, result: RolloutResult) -> None:
        self.result, self.running_now, self.since = result, 0, 0.0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        if self.running_now == 0:
            self.since = time.perf_counter()
        self.running_now += 1
        self.result.max_concurrent_tool_calls = max(self.result.max_concurrent_tool_calls, self.running_now)
        try:
            yield
        finally:
            self.running_now -= 1
            if self.running_now == 0:
                self.result.tools_s += time.perf_counter() - self.since


class Dispatcher:
    """Sends each ready turn to the backend as soon as it can take it.

    A backend with ``max_concurrency == 1`` (HF ``generate``, vLLM colocate) gets one call at a time
    holding every turn that became ready while the previous call ran; one with ``max_concurrency > 1``
    (a vLLM server, continuous batching) gets each turn as its own call, up to that many in flight.
    Calls run in worker threads, so tool calls and other trajectories proceed meanwhile.
    """

    def __init__(
        self, backend: Any, loop: asyncio.AbstractEventLoop, pool: concurrent.futures.Executor, result: RolloutResult
    ) -> None:
        self.backend, self.loop, self.pool, self.result = backend, loop, pool, result
        self.limit = concurrency(backend)
        self.ready: list[tuple[list[int], int, int, asyncio.Future, float, Any]] = []
        self.in_flight: set[asyncio.Future] = set()
        self.kick_scheduled = False
        self.busy_since = 0.0
        self.fatal: BaseException | None = None

    def generate(self, prompt: list[int], budget: int, seed: int, stop: Any = None) -> asyncio.Future:
        """A future of ``(sample, generation_s, queue_s)``. ``stop`` (a :class:`~trl_plugins.rollout.backends.
        StopStrings`) goes to a backend that declares ``stop_strings = True``, which may end the turn there; the
        caller cuts the sample at the stop either way."""
        fut = self.loop.create_future()
        self.ready.append((prompt, budget, seed, fut, time.perf_counter(), stop))
        if not self.kick_scheduled:  # after the other coroutines that are ready in this loop pass have queued too
            self.kick_scheduled = True
            self.loop.call_soon(self._kick)
        return fut

    def _kick(self) -> None:
        self.kick_scheduled = False
        self.ready = [r for r in self.ready if not r[3].cancelled()]
        while self.ready and len(self.in_flight) < self.limit and self.fatal is None:
            if self.limit == 1:
                batch, self.ready = self.ready, []
            else:
                batch, self.ready = [self.ready[0]], self.ready[1:]
            if not self.in_flight:
                self.busy_since = time.perf_counter()
            t0 = time.perf_counter()
            call = self.loop.run_in_executor(
                self.pool,
                _generate_call,
                self.backend,
                [r[0] for r in batch],
                [r[1] for r in batch],
                [r[2] for r in batch],
                [r[5] for r in batch],
            )
            self.in_flight.add(call)
            self.result.rounds += 1
            call.add_done_callback(lambda f, batch=batch, t0=t0: self._done(f, batch, t0))

    def _done(self, call: asyncio.Future, batch: list, t0: float) -> None:
        now = time.perf_counter()
        self.in_flight.discard(call)
        if not self.in_flight:
            self.result.generation_s += now - self.busy_since
        outcome = call.result() if not call.cancelled() else _Abort("cancelled")
        for k, (_, _, _, fut, queued, _) in enumerate(batch):
            if fut.done():
                continue
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception) and self.fatal is None:
                    self.fatal = outcome
                fut.set_exception(outcome if isinstance(outcome, Exception) else _Abort(type(outcome).__name__))
            else:
                fut.set_result((outcome[k], now - t0, t0 - queued))
        self._kick()

    async def drain(self) -> None:
        while self.in_flight:
            await asyncio.wait(set(self.in_flight))


def _generate_call(
    backend: Any, prompts: list[list[int]], budgets: list[int], seeds: list[int], stops: list[Any] | None = None
) -> Any:
    """One backend call in a worker thread; any exception comes back as the value (checked by ``_done``)."""
    try:
        if stops and any(stops) and getattr(backend, "stop_strings", False):
            samples = backend.generate(prompts, budgets, seeds=seeds, stop=stops)
        else:
            samples = backend.generate(prompts, budgets, seeds=seeds)
        if len(samples) != len(prompts):
            raise RolloutError(
                f"{type(backend).__name__}.generate returned {len(samples)} samples for "
                f"{len(prompts)} prompts; it must return one per prompt, in order."
            )
        return samples
    except BaseException as exc:  # noqa: BLE001 - handed to the event loop, which re-raises it
        return exc
