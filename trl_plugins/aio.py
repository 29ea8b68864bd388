"""Running coroutines from synchronous code: the one bridge the rollout engine, the tools' ``close()`` and the
contract checks share (kept below them all, so none of them imports another for it)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Coroutine, TypeVar

__all__ = ["run_async"]

R = TypeVar("R")


def run_async(coro: Coroutine[Any, Any, R]) -> R:
    """Run a coroutine to completion, also when called from inside a running event loop (then in a worker
    thread with a loop of its own)."""
    try:
        asyncio.get_running_loop()
        inside_a_loop = True
    except RuntimeError:
        inside_a_loop = False
    if not inside_a_loop:
        # Outside the except block: an exception the coroutine raises must not be chained to "no running event loop".
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
