"""The sandbox service's connections: what uvicorn's h11 protocol is given on top of HTTP parsing.

- Framing: every request head is checked raw (:mod:`trl_plugins.http_framing`) before h11 frames its body; an
  ambiguous one (``Content-Length`` with ``Transfer-Encoding``, obs-fold) gets 400 and the connection is closed.
- A cap on open connections, below the open-files limit: at the cap a new connection closes the one idle longest
  (no request running: before its first, between two, or still sending its head), or gets 503 if none is idle.
- Timeouts: a connection idle for ``idle_timeout_s`` (before its first request too) is closed, and so is one whose
  request has not arrived whole within ``read_timeout_s`` of its first byte.
- A failed ``accept()`` (out of descriptors all the same) is logged once a minute, with a count, not once per try.

Used by :func:`trl_plugins.tools.sandbox.service.main`; tested in tests/test_sandbox_service.py.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trl_plugins.http_framing import framing_problem, request_head

__all__ = [
    "ConnectionStats",
    "guarded_protocol",
    "raise_open_files_limit",
    "connection_cap",
    "quiet_accept_errors",
    "serve",
]

logger = logging.getLogger("trl_plugins.tools.sandbox.service")

_SLACK_FDS = 192  # connections accepted before the protocol sees them (asyncio accepts a burst at a time), logs
_FDS_PER_SLOT = 8  # a running call's pipes and memfds plus its warm worker's, measured ~6


@dataclass
class ConnectionStats:
    """What ``/health`` reports under ``connections``."""

    max: int = 0
    """The cap in force (``--max-connections``, lowered to fit the open-files limit)."""
    open_files_limit: int = 0
    """The process's soft ``RLIMIT_NOFILE`` after start-up raised it."""
    open: int = 0
    evicted: int = 0
    """Idle connections closed to make room for a new one."""
    refused_full: int = 0
    """New connections answered 503 because every open one carried a request."""
    closed_idle: int = 0
    """Connections closed after ``idle_timeout_s`` without a request (before their first, or between two)."""
    timed_out_reading: int = 0
    """Connections closed because their request had not arrived whole within ``read_timeout_s``."""
    refused_framing: int = 0


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (where the kernel allows); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # an unlimited hard limit the kernel caps lower (fs.nr_open): keep the soft one
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(asked: int, open_files: int, *, max_concurrency: int, max_limit_sets: int) -> int:
    """The most connections that fit under ``open_files`` next to the sandboxes' descriptors, at most ``asked``."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    reserve = in_use + _FDS_PER_SLOT * max_concurrency * max_limit_sets + _SLACK_FDS
    return min(asked, open_files - reserve)


class _AcceptErrors(logging.Filter):
    """Lets one ``socket.accept() out of system resource`` record through per ``every_s``, without its traceback and
    saying how many it held back. Also drops asyncio's retry of such an accept firing after the server has closed
    (``_start_serving`` on a closed socket, one traceback per failed burst at shutdown)."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s, self.last, self.held = every_s, float("-inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Exception in callback BaseSelectorEventLoop._start_serving"):
            return False
        if not message.startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.held += 1
            return False
        held = f"{self.held} more held back since the last such line" if self.held else "more are held back"
        record.msg = (
            f"socket.accept() out of system resource: out of file descriptors ({held}; one line per "
            f"{self.every_s:g} s; see --max-connections)"
        )
        record.args, record.exc_info, record.exc_text = (), None, None
        self.last, self.held = now, 0
        return True


def quiet_accept_errors(every_s: float = 60.0) -> logging.Filter:
    """Install :class:`_AcceptErrors` on asyncio's logger; returns it."""
    f = _AcceptErrors(every_s)
    logging.getLogger("asyncio").addFilter(f)
    return f


_FULL_BODY = b'{"error": "busy: every open connection carries a call; retry later"}'
_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_FULL_BODY), _FULL_BODY)
)


class _CheckedConnection(h11.Connection):
    """h11 with each request head checked raw before h11 parses it (and so frames its body)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_checked = False
        self.refusal: str | None = None

    def next_event(self):
        if self.their_state is h11.IDLE and not self.head_checked:
            head = request_head(self.trailing_data[0])
            if head is not None:
                self.head_checked = True
                self.refusal = framing_problem(head)
                if self.refusal:
                    raise h11.RemoteProtocolError(self.refusal, 400)
        return super().next_event()

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self.head_checked = False


def guarded_protocol(stats: ConnectionStats, *, read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the checks above; ``stats.max`` is the cap, the rest it counts. The idle timeout is
    uvicorn's ``timeout_keep_alive`` (the service passes ``idle_timeout_s``)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            size = self.config.h11_max_incomplete_event_size
            self.conn = _CheckedConnection(h11.SERVER, *([size] if size is not None else []))
            self.idle_since = time.monotonic()
            self.read_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            open_now = sum(not c.transport.is_closing() for c in self.connections)
            if open_now > stats.max and not self._make_room():
                stats.refused_full += 1
                transport.write(_FULL)
                transport.close()
                return
            stats.open = open_now
            # uvicorn arms its keep-alive wait only after an answer: a connection that never sends a request is
            # closed by the same timer.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def _make_room(self) -> bool:
            idle = [
                c
                for c in self.connections
                if c is not self and (c.cycle is None or c.cycle.response_complete) and not c.transport.is_closing()
            ]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c.idle_since)
            stats.evicted += 1
            oldest.transport.close()
            return True

        def connection_lost(self, exc) -> None:
            self._stop_read_timer()
            super().connection_lost(exc)
            stats.open = len(self.connections)

        def timeout_keep_alive_handler(self) -> None:
            self.timeout_keep_alive_task = None
            stats.closed_idle += 1
            super().timeout_keep_alive_handler()

        def data_received(self, data: bytes) -> None:
            if self.read_timer is None and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
                self.read_timer = self.loop.call_later(read_timeout_s, self._read_timeout)
            super().data_received(data)
            self._watch_request()

        def _watch_request(self) -> None:
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._stop_read_timer()  # the request is whole (or the connection done)

        def _stop_read_timer(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _read_timeout(self) -> None:
            self.read_timer = None
            if not self.transport.is_closing():
                stats.timed_out_reading += 1
                self.transport.close()

        def on_response_complete(self) -> None:
            self.idle_since = time.monotonic()
            super().on_response_complete()
            self._watch_request()

        def send_400_response(self, msg: str) -> None:
            if self.conn.refusal:
                stats.refused_framing += 1
                msg = self.conn.refusal
            super().send_400_response(msg)

    return GuardedH11Protocol


def serve(app, config, *, host: str, port: int, log_level: str) -> None:
    """Serve the service's ``app`` under uvicorn with the checks above, until interrupted: the open-files limit
    raised, the connection cap fitted under it (``app.state.service.connections``), failed accepts quietened.

    Raises:
        SystemExit: the open-files limit leaves no room for connections."""
    stats = app.state.service.connections
    stats.open_files_limit = raise_open_files_limit()
    stats.max = connection_cap(
        config.max_connections,
        stats.open_files_limit,
        max_concurrency=config.max_concurrency,
        max_limit_sets=config.max_limit_sets,
    )
    if stats.max < 1:
        raise SystemExit(
            f"sandbox service: the open-files limit ({stats.open_files_limit}) leaves no room for "
            f"connections next to the sandboxes; raise it (ulimit -n) or lower --max-concurrency"
        )
    if stats.max < config.max_connections:
        logger.warning(
            "sandbox service: at most %d connections (not --max-connections %d): the open-files limit is "
            "%d; raise it (ulimit -n) to serve more",
            stats.max,
            config.max_connections,
            stats.open_files_limit,
        )
    quiet_accept_errors()
    # The pinned h11 protocol is the one whose framing is checked here (uvicorn's "auto" takes httptools where it is
    # installed). The keep-alive wait is the idle timeout.
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        server_header=False,
        http=guarded_protocol(stats, read_timeout_s=config.read_timeout_s),
        timeout_keep_alive=config.idle_timeout_s,
    )
