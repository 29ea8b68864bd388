"""Admission for the sandbox service: how many calls run at once, how many wait, and for how long.

Pure asyncio, one event loop; no I/O. Used by :mod:`.service`; tested by hand in tests/test_sandbox_service.py.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["Admission", "Busy"]


class Busy(Exception):
    """The call was refused before it started (queue full, waited too long, no room for its limits)."""


class Admission:
    """At most ``running`` calls at once, at most ``queued`` waiting (FIFO), each waiting at most ``max_wait_s``.

    A released slot is handed to the first waiter directly, so a waiter that times out can tell whether it got the
    slot in the meantime (its future is done) and nothing is lost or taken twice."""

    def __init__(self, running: int, queued: int, max_wait_s: float) -> None:
        self.limit, self.queue_limit, self.max_wait_s = running, queued, max_wait_s
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.queue_limit:
            raise Busy(f"{self.running} calls running and {len(self._waiters)} queued, the most this server takes")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_wait_s)
        except asyncio.TimeoutError:
            if waiter.done():
                return  # the slot came just as the wait ended: it is ours
            self._waiters.remove(waiter)
            raise Busy(f"waited {self.max_wait_s:g} s in the queue without a free slot") from None
        except asyncio.CancelledError:
            if waiter.done():
                self.release()
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; ``running`` stays
                return
        self.running -= 1
