"""Stopping a run on SIGINT / SIGTERM at a safe point.

While :meth:`MultiTurnGRPOTrainer.train` runs, the first SIGINT or SIGTERM only *asks* for a stop:
the handler sets a flag and returns, so nothing (a collective, an optimizer step, a checkpoint being
written) is cut in half. The rollout engine sees the flag between generation rounds and while tool
calls are in flight, cancels what is running and returns; the ranks then agree (one all-reduce) to
stop, and the trainer writes a complete checkpoint of the last finished step, closes the tools and
raises :class:`TrainingInterrupted`. A flag raised during the update lets the step finish; the
agreement at the step's end stops the run after it. A second signal (more than a second after the
first: Ctrl-C reaches the launcher and every process, and a launcher's death arrives too) stops at
once, without a checkpoint (a checkpoint being written then has no completion marker, so resuming
never takes it): a second SIGINT raises ``KeyboardInterrupt`` as Python's own Ctrl-C does, a second
SIGTERM exits with status 143.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

__all__ = ["TrainingInterrupted", "StopSignals", "active_stop_event", "die_with_launcher"]

logger = logging.getLogger(__name__)

_ACTIVE: threading.Event | None = None


def active_stop_event() -> threading.Event | None:
    """The event a stop request sets while a trainer's :class:`StopSignals` is installed, else None."""
    return _ACTIVE


class TrainingInterrupted(RuntimeError):
    """Training stopped on a signal; ``checkpoint`` is where to resume from (None when none was written)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        name = signal.Signals(signum).name
        where = (
            f"resume with --resume_from_checkpoint {checkpoint}"
            if checkpoint
            else "no checkpoint was written (nothing was trained yet); start again"
        )
        super().__init__(f"training stopped on {name} after step {step}; {where}.")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        """The conventional exit status for the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


class StopSignals:
    """Catch SIGINT and SIGTERM while training: the first asks for a stop, the second stops at once.

    Args:
        on_hard_stop: Called before exiting on a second signal (e.g. to kill the sandboxes).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0
    """A signal within this many seconds of the first is the same request arriving twice, not a second one."""

    def __init__(self, on_hard_stop: Callable[[], None] | None = None) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._on_hard_stop = on_hard_stop
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0

    def __enter__(self) -> StopSignals:
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _ACTIVE = self.event
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if _ACTIVE is self.event:
            _ACTIVE = None

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set() and time.monotonic() - self._first_at < self.REPEAT_S:
            return  # the same request delivered twice (Ctrl-C reaches the launcher and its children; parent death)
        if self.event.is_set():
            logger.error("second %s: stopping now, without a checkpoint", signal.Signals(signum).name)
            try:
                if self._on_hard_stop is not None:
                    self._on_hard_stop()
            finally:
                if signum == signal.SIGINT:  # as Python's own Ctrl-C (a notebook's kernel survives it)
                    raise KeyboardInterrupt
                os._exit(128 + signum)
        self.signum = signum
        self._first_at = time.monotonic()
        self.event.set()
        logger.warning(
            "%s received: stopping at the next safe point and writing a checkpoint (send it again to stop "
            "at once, without one)",
            signal.Signals(signum).name,
        )


def die_with_launcher() -> bool:
    """Ask the kernel to send SIGTERM to this process when its parent dies, if the parent is ``accelerate
    launch`` running one process (it does not forward signals: a SIGTERM to it would leave the training
    process running on its own). Linux only; returns whether it was set."""
    try:
        parent = os.getppid()
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        if "accelerate" not in cmdline or "launch" not in cmdline:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
            return False
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return True
    except (OSError, AttributeError):
        return False
