"""A small HTTP/1.1 JSON server on the rollout's own event loop (h11 parses the protocol): what the agent endpoint
speaks. Bound to the loopback interface only; keep-alive connections, one request at a time per connection."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import h11

from trl_plugins.http_framing import framing_problem, request_head

__all__ = ["EventStream", "HttpError", "HttpRequest", "JsonServer"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (a conversation of many long tool outputs stays far below it)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of a request body's JSON (chat requests nest a few levels; Python's parser and the template
renderer recurse, so a deeper value would fail inside them)."""


class HttpError(Exception):
    """An error response: its status and an OpenAI-style error body (``message``, ``type``, ``code``, ``param``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class HttpRequest:
    """One request as the handler sees it."""

    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes

    def json(self) -> Any:
        """The body as a JSON value.

        Raises:
            HttpError: 400 when it is not JSON or nests deeper than :data:`MAX_JSON_DEPTH`."""
        try:
            value, deep = json.loads(self.body or b"null"), False
        except ValueError as exc:
            raise HttpError(400, f"the request body is not JSON: {exc}") from None
        except RecursionError:  # deeper than Python's parser goes
            value, deep = None, True
        if deep or json_depth(value) > MAX_JSON_DEPTH:
            raise HttpError(
                400,
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels; chat requests nest a few.",
                code="nested_too_deeply",
            )
        return value


@dataclass
class EventStream:
    """A server-sent-events body, written whole (a replay of a finished turn): each event an optional ``event:`` line
    and its JSON as one ``data:`` line; ``data: [DONE]`` last where ``done`` (chat completions end so)."""

    events: list[tuple[str | None, Any]]
    done: bool = False

    def encode(self) -> bytes:
        parts = [
            (f"event: {name}\n" if name else "") + f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
            for name, data in self.events
        ]
        if self.done:
            parts.append("data: [DONE]\n\n")
        return "".join(parts).encode()


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar 0, ``[]`` 1); walks iteratively, stopping past :data:`MAX_JSON_DEPTH`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


Handler = Callable[[HttpRequest], Awaitable[tuple[int, Any]]]


class _AmbiguousFraming(Exception):
    """A request head that could be framed two ways (:func:`trl_plugins.http_framing.framing_problem`)."""


class JsonServer:
    """Serves ``handler(request) -> (status, JSON-able body or EventStream)`` on ``127.0.0.1``; a raised
    :class:`HttpError` becomes its
    error response, any other exception a 500 saying what it was (and is logged)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, host="127.0.0.1", port=0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self.server.wait_closed()
            self.server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY_BYTES)
        try:
            while True:
                try:
                    request = await self._read(conn, reader)
                except _AmbiguousFraming as exc:  # answered, then closed: what follows cannot be told apart
                    data = json.dumps(HttpError(400, str(exc)).body()).encode()
                    headers = [
                        ("content-type", "application/json"),
                        ("content-length", str(len(data))),
                        ("connection", "close"),
                    ]
                    writer.write(conn.send(h11.Response(status_code=400, headers=headers)))
                    writer.write(conn.send(h11.Data(data=data)))
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    return
                if request is None:
                    return
                try:
                    status, body = await self.handler(request)
                except HttpError as exc:
                    status, body = exc.status, exc.body()
                except Exception as exc:  # noqa: BLE001 - the endpoint's own bug: say it, keep serving
                    logger.exception("the agent endpoint failed to serve %s %s", request.method, request.path)
                    status, body = (
                        500,
                        HttpError(500, f"the endpoint failed: {type(exc).__name__}: {exc}", kind="server_error").body(),
                    )
                if isinstance(body, EventStream):
                    data, kind = body.encode(), "text/event-stream; charset=utf-8"
                else:
                    data, kind = json.dumps(body).encode(), "application/json"
                headers = [("content-type", kind), ("content-length", str(len(data)))]
                writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
                writer.write(conn.send(h11.Data(data=data)))
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (h11.RemoteProtocolError, ConnectionError, h11.LocalProtocolError):
            return
        except asyncio.CancelledError:  # the server is closing (asyncio's own callback must not see a cancelled task)
            return
        finally:
            self._connections.discard(task)
            writer.close()

    @staticmethod
    async def _read(conn: h11.Connection, reader: asyncio.StreamReader) -> HttpRequest | None:
        head: h11.Request | None = None
        chunks: list[bytes] = []
        size = 0
        checked = False
        while True:
            if not checked and conn.their_state is h11.IDLE:  # the raw head, before h11 frames its body
                raw = request_head(conn.trailing_data[0])
                if raw is not None:
                    checked = True
                    problem = framing_problem(raw)
                    if problem:
                        raise _AmbiguousFraming(problem)
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_BODY_BYTES:
                    raise h11.RemoteProtocolError("request body too large")
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                headers = {k.decode().lower(): v.decode("latin-1") for k, v in head.headers}
                return HttpRequest(head.method.decode(), head.target.decode("latin-1"), headers, b"".join(chunks))
