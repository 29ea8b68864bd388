"""The sandbox as a service: :class:`PythonSandbox` served over HTTP, for runs that outgrow one machine.

    export TRL_SANDBOX_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    python -m trl_plugins.tools.sandbox.service --host 0.0.0.0 --port 8000 --mode warm

Every run endpoint needs ``Authorization: Bearer <token>`` (compared in constant time). The server runs at most
``--max-concurrency`` calls at once and queues ``--queue-size`` more (each for at most ``--max-queue-wait-s``);
a request beyond that, or one that waited too long, gets 503 with ``Retry-After`` and was never started. Per-call
limits are honoured up to the server's caps and refused above them (400); request bodies over
``--max-request-bytes`` get 413. Isolation, mode and hidden paths are the server's alone. Endpoints:

- ``GET /health``: no token, no secrets: isolation, mode, capacity, calls running and queued, counters, caps.
- ``GET /v1/stats``: token: the counters plus calls per client (``X-Sandbox-Client`` header).
- ``POST /v1/run``: token: our API (:mod:`.wire`).
- ``POST /run_code``: token: SandboxFusion's API, Python only; ``GET /v1/ping`` answers ``"pong"`` as theirs does.

Runs under uvicorn's h11 protocol with the checks of :mod:`.connections` (framing, a connection cap under the
open-files limit, idle and read timeouts; ``pip install 'trl-plugins[server]'``); imports no torch.
docs/sandbox_service.md has the
operator's guide (TLS through a reverse proxy, several runs on one server, the benchmark figures).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import json
import logging
import math
import os
import platform
import stat
import sys
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import trl_plugins
from trl_plugins.http_framing import framed_two_ways
from trl_plugins.tools.sandbox import PythonSandbox, detect_isolation, wire
from trl_plugins.tools.sandbox.admission import Admission, Busy
from trl_plugins.tools.sandbox.connections import ConnectionStats, serve
from trl_plugins.tools.sandbox.service_config import MIN_TOKEN_CHARS, TOKEN_ENV, ServiceConfig

__all__ = ["ServiceConfig", "build_app", "main", "TOKEN_ENV", "MIN_TOKEN_CHARS"]

logger = logging.getLogger("trl_plugins.tools.sandbox.service")  # also under `python -m`


class _Refused(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


class _ClientGone(Exception):
    """The client closed its connection before its call started: nothing to run, nobody to answer."""


@dataclass
class _Counters:
    calls: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    sandbox_failures: int = 0
    refused_auth: int = 0
    refused_too_large: int = 0
    refused_bad_request: int = 0
    refused_busy: int = 0
    refused_framing: int = 0
    dropped_client_gone: int = 0
    """Requests whose client left before they started (queued, or still sending the body): never run."""


class _Service:
    """The server's state: the sandboxes (one per limits tuple), admission, counters."""

    MAX_CLIENTS = 1024

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.token = config.token.encode()
        self.admission = Admission(config.max_concurrency, config.queue_size, config.max_queue_wait_s)
        self.counters = _Counters()
        self.per_client: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.sandboxes: collections.OrderedDict[tuple, PythonSandbox] = collections.OrderedDict()
        self.in_use: collections.Counter[tuple] = collections.Counter()
        self.build_lock = asyncio.Lock()
        self.isolation = config.isolation if config.isolation != "auto" else detect_isolation().value
        self.started = time.time()
        self.describe = ""
        self.connections = ConnectionStats(max=config.max_connections)
        """Filled by the connection layer (:mod:`.connections`) when the server runs under :func:`main`."""

    def default_limits(self) -> tuple[float, int, int]:
        c = self.config
        return (float(c.default_timeout_s), int(c.default_memory_mb), int(c.default_output_chars))

    def _new_sandbox(self, limits: tuple[float, int, int]) -> PythonSandbox:
        timeout_s, memory_mb, max_output_chars = limits
        return PythonSandbox(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
            max_concurrency=self.config.max_concurrency,
            mode=self.config.mode,
            isolation=self.isolation,
            extra_hidden_paths=self.config.hidden_paths,
        )

    def start(self) -> None:
        """Build the sandbox for the default limits (failing here if isolation does not work) and warm it."""
        sandbox = self._new_sandbox(self.default_limits())
        sandbox.warm_up()
        self.sandboxes[self.default_limits()] = sandbox
        self.describe = sandbox.describe()
        logger.info(
            "sandbox service: %s; %d calls at once, queue %d",
            self.describe,
            self.config.max_concurrency,
            self.config.queue_size,
        )

    async def sandbox_for(self, limits: tuple[float, int, int]) -> PythonSandbox:
        if limits in self.sandboxes:
            self.sandboxes.move_to_end(limits)
            return self.sandboxes[limits]
        async with self.build_lock:
            if limits in self.sandboxes:
                self.sandboxes.move_to_end(limits)
                return self.sandboxes[limits]
            loop = asyncio.get_running_loop()
            if len(self.sandboxes) >= self.config.max_limit_sets:
                idle = next((k for k in self.sandboxes if not self.in_use[k]), None)
                if idle is None:
                    raise Busy(f"all {self.config.max_limit_sets} limit sets are in use by running calls")
                old = self.sandboxes.pop(idle)
                await loop.run_in_executor(None, old.close)
            sandbox = await loop.run_in_executor(None, self._new_sandbox, limits)
            self.sandboxes[limits] = sandbox
            return sandbox

    def close(self) -> None:
        for sandbox in self.sandboxes.values():
            sandbox.close()
        self.sandboxes.clear()

    def count_client(self, client: str | None) -> None:
        if not client:
            return
        client = client[:200]
        self.per_client[client] = self.per_client.pop(client, 0) + 1
        while len(self.per_client) > self.MAX_CLIENTS:
            self.per_client.popitem(last=False)

    def health(self) -> dict[str, Any]:
        return {
            "service": wire.SERVICE_NAME,
            "status": "ok",
            "version": trl_plugins.__version__,
            "python": platform.python_version(),
            "isolation": self.isolation,
            "mode": self.config.mode,
            "sandbox": self.describe,
            "hidden_paths": len(self.config.hidden_paths),
            "max_concurrency": self.config.max_concurrency,
            "queue_size": self.config.queue_size,
            "max_queue_wait_s": self.config.max_queue_wait_s,
            "running": self.admission.running,
            "queued": self.admission.queued,
            "limit_sets": len(self.sandboxes),
            "uptime_s": round(time.time() - self.started, 1),
            "caps": self.config.caps(),
            "counters": vars(self.counters).copy(),
            "connections": vars(self.connections).copy(),
        }

    # -- requests --------------------------------------------------------------------------------------------------

    def check_token(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        # compare_digest on equal-length inputs does not leak where they differ; a wrong length leaks only that.
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self.token):
            self.counters.refused_auth += 1
            raise _Refused(
                401,
                "missing or wrong token: send 'Authorization: Bearer <token>' with the server's "
                "token (TRL_SANDBOX_TOKEN)",
            )

    async def read_json(self, request: Request) -> dict[str, Any]:
        cap = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            self.counters.refused_too_large += 1
            raise _Refused(413, f"request body of {declared} bytes is over this server's limit of {cap} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # also when Content-Length is absent or lies
                size += len(chunk)
                if size > cap:
                    self.counters.refused_too_large += 1
                    raise _Refused(413, f"request body is over this server's limit of {cap} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            self.counters.dropped_client_gone += 1
            raise _ClientGone() from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.bad_request(f"the body is not JSON: {exc}", "body") from None
        except RecursionError:
            raise self.bad_request(
                "the body nests too deeply to parse; the API's fields are flat (a string and numbers)", "body"
            ) from None
        if not isinstance(body, dict):
            raise self.bad_request("the body must be a JSON object")
        return body

    def bad_request(self, message: str, field: str | None = None) -> _Refused:
        self.counters.refused_bad_request += 1
        return _Refused(400, message, field)

    def code_from(self, body: dict[str, Any]) -> str:
        """The call's code, refused (400 naming ``code``) when it is not a string or cannot be run as Python source."""
        code = body.get("code")
        if not isinstance(code, str):
            raise self.bad_request("'code' must be a string of Python code", "code")
        problem = wire.code_problem(code)
        if problem:
            raise self.bad_request(problem, "code")
        return code

    def limits_from(
        self,
        timeout_s: Any,
        memory_mb: Any,
        output_chars: Any,
        names: Sequence[str] = ("timeout_s", "memory_mb", "max_output_chars"),
    ) -> tuple[float, int, int]:
        """The call's limits: defaults where None, refused (400 naming the field, as ``names`` call them) when
        malformed or above a cap."""
        c = self.config
        checks = (
            (names[0], timeout_s, c.default_timeout_s, c.max_timeout_s, "--max-timeout-s", 0.01, False),
            (names[1], memory_mb, c.default_memory_mb, c.max_memory_mb, "--max-memory-mb", 32, True),
            (names[2], output_chars, c.default_output_chars, c.max_output_chars, "--max-output-chars", 256, True),
        )
        out = []
        for name, value, default, cap, flag, minimum, integer in checks:
            if value is None:
                value = default
            kind = int if integer else (int, float)
            # An int is compared as it is: JSON integers have no bound, and math.isfinite(10**400) overflows.
            if (
                isinstance(value, bool)
                or not isinstance(value, kind)
                or isinstance(value, float)
                and not math.isfinite(value)
                or value < minimum
            ):
                raise self.bad_request(
                    f"{name} must be {'an integer' if integer else 'a number'} >= {minimum}, got {_shown(value)}", name
                )
            if value > cap:
                raise self.bad_request(
                    f"{name}={_shown(value)} is above this server's cap of {cap}: ask for at most "
                    f"{cap}, or start the server with a higher {flag}",
                    name,
                )
            out.append(value)
        return (float(out[0]), int(out[1]), int(out[2]))

    async def admit(self, request: Request) -> None:
        """Wait for a slot, or give up when the client closes its connection first (a rollout's stop leaves its
        queued calls behind): such a call is never run."""
        slot = asyncio.ensure_future(self.admission.acquire())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((slot, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this request is cancelled
            gone.cancel()
            if not slot.done():
                slot.cancel()  # the admission drops the waiter, or hands back a slot it gave meanwhile
            with contextlib.suppress(asyncio.CancelledError, Busy):
                await slot
        if not slot.cancelled() and isinstance(slot.exception(), Busy):
            self.counters.refused_busy += 1
            raise slot.exception()
        if slot.cancelled() or gone.done() and not gone.cancelled():
            if not slot.cancelled():
                self.admission.release()  # the slot came as the client left
            self.counters.dropped_client_gone += 1
            raise _ClientGone()

    async def execute(self, request: Request, code: str, limits: tuple[float, int, int]):
        """Run ``code`` under ``limits`` once admitted; returns the result and the seconds spent queued."""
        t0 = time.perf_counter()
        await self.admit(request)
        queue_s = time.perf_counter() - t0
        self.count_client(request.headers.get(wire.CLIENT_HEADER))  # calls admitted, not requests refused
        try:
            try:
                sandbox = await self.sandbox_for(limits)
            except Busy:
                self.counters.refused_busy += 1
                raise
            self.in_use[limits] += 1
            try:
                result = await sandbox.arun(code)
            finally:
                self.in_use[limits] -= 1
        finally:
            self.admission.release()
        self.counters.calls += 1
        self.counters.ok += result.ok
        self.counters.timeouts += result.timed_out
        failed = result.exit_code is None and not result.timed_out
        self.counters.sandbox_failures += failed
        self.counters.errors += not result.ok and not result.timed_out and not failed
        return result, queue_s


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (called after the body is read)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a server that cannot be asked twice: never take the client for gone
        await asyncio.get_running_loop().create_future()


def _shown(value: Any) -> str:
    """``value`` for a message: a long number (JSON integers are unbounded) by its first digits and its length."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _error(status: int, message: str, field: str | None = None, **headers: str) -> JSONResponse:
    body = {"error": message} if field is None else {"error": message, "field": field}
    return JSONResponse(body, status_code=status, headers=headers)


def _framing_problem(request: Request) -> str | None:
    """A request framed two ways (RFC 9112 6.1), as the ASGI server passed it on: the connection layer refuses it
    raw under :func:`main`; this holds under any other ASGI server too."""
    return framed_two_ways({name.lower() for name, _ in request.scope["headers"]})


def _guarded(handler):
    """Turn the service's refusals into HTTP answers: 401/413/400 with a message, 503 + Retry-After when busy."""

    async def endpoint(request: Request) -> Response:
        service = request.app.state.service
        problem = _framing_problem(request)
        if problem:
            service.counters.refused_framing += 1
            return _error(400, problem, Connection="close")
        try:
            return await handler(service, request)
        except _Refused as exc:
            if exc.status != 400:
                logger.warning(
                    "sandbox service: refused %s %s from %s: %s",
                    request.method,
                    request.url.path,
                    request.client.host if request.client else "?",
                    exc,
                )
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            return _error(exc.status, str(exc), exc.field, **headers)
        except Busy as exc:
            return _error(503, f"busy, the call was not started: {exc}; retry later", **{"Retry-After": "1"})
        except _ClientGone:
            return Response(status_code=400)  # nobody reads it

    return endpoint


async def _health(service: _Service, request: Request) -> JSONResponse:
    return JSONResponse(service.health())


async def _stats(service: _Service, request: Request) -> JSONResponse:
    service.check_token(request)
    return JSONResponse({**service.health(), "clients": dict(service.per_client)})


async def _run(service: _Service, request: Request) -> JSONResponse:
    service.check_token(request)
    body = await service.read_json(request)
    unknown = sorted(set(body) - {"code", "timeout_s", "memory_mb", "max_output_chars"})
    if unknown:
        raise service.bad_request(
            f"unknown fields {unknown}; /v1/run takes code, timeout_s, memory_mb, max_output_chars", unknown[0]
        )
    code = service.code_from(body)
    limits = service.limits_from(body.get("timeout_s"), body.get("memory_mb"), body.get("max_output_chars"))
    result, queue_s = await service.execute(request, code, limits)
    return JSONResponse(wire.result_to_json(result, queue_s))


async def _run_code(service: _Service, request: Request) -> JSONResponse:
    service.check_token(request)
    body = await service.read_json(request)
    if body.get("language") != "python":
        raise service.bad_request(
            f"this server runs only language 'python', got {body.get('language')!r:.40}", "language"
        )
    code = service.code_from(body)
    for name in ("files", "fetch_files", "args"):
        if body.get(name):
            raise service.bad_request(f"'{name}' is not supported by this server; send the code alone", name)
    if body.get("stdin"):
        raise service.bad_request("'stdin' is not supported by this server: the code runs with an empty stdin", "stdin")
    memory = body.get("memory_limit_MB")
    memory = None if memory is None or memory == -1 else memory
    limits = service.limits_from(body.get("run_timeout"), memory, None, ("run_timeout", "memory_limit_MB", "-"))
    result, _ = await service.execute(request, code, limits)
    return JSONResponse(wire.result_to_sandboxfusion(result))


async def _ping(service: _Service, request: Request) -> JSONResponse:
    return JSONResponse("pong")


def build_app(config: ServiceConfig) -> Starlette:
    """The ASGI app serving ``config``; its sandboxes start with the app (lifespan) and close with it.

    Raises (at start-up): RuntimeError when the asked-for isolation does not work on this machine."""
    service = _Service(config)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await asyncio.get_running_loop().run_in_executor(None, service.start)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, service.close)

    routes = [
        Route(wire.HEALTH_PATH, _guarded(_health), methods=["GET"]),
        Route(wire.STATS_PATH, _guarded(_stats), methods=["GET"]),
        Route(wire.RUN_PATH, _guarded(_run), methods=["POST"]),
        Route(wire.SANDBOXFUSION_RUN_PATH, _guarded(_run_code), methods=["POST"]),
        Route(wire.SANDBOXFUSION_PING_PATH, _guarded(_ping), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    return app


def _read_token(token_file: str | None) -> str:
    if token_file is None:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise SystemExit(
                f"no token: set {TOKEN_ENV} or pass --token-file PATH (make one with "
                f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return token
    try:
        mode = os.stat(token_file).st_mode
        with open(token_file) as f:
            token = f.read().strip()
    except OSError as exc:
        raise SystemExit(f"cannot read the token file: {exc}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("sandbox service: the token file %s is readable by other users; chmod 600 it", token_file)
    return token


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = ServiceConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="python -m trl_plugins.tools.sandbox.service",
        description="Serve the Python sandbox over HTTP (docs/sandbox_service.md).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", default=None, help=f"file holding the token (default: ${TOKEN_ENV})")
    p.add_argument("--mode", choices=["warm", "cold"], default=d["mode"].default)
    p.add_argument("--isolation", choices=["auto", "bwrap", "unshare", "none"], default=d["isolation"].default)
    p.add_argument(
        "--hidden-path",
        action="append",
        default=[],
        dest="hidden_paths",
        help="absolute path the code must not read (repeatable)",
    )
    for name in (
        "max_concurrency",
        "queue_size",
        "max_memory_mb",
        "max_output_chars",
        "default_memory_mb",
        "default_output_chars",
        "max_request_bytes",
        "max_limit_sets",
        "max_connections",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name].default)
    for name in ("max_queue_wait_s", "max_timeout_s", "default_timeout_s", "idle_timeout_s", "read_timeout_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=d[name].default)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, check the settings, and serve until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = set(ServiceConfig.__dataclass_fields__) - {"token"}
    settings = {k: v for k, v in vars(args).items() if k in names}
    settings["hidden_paths"] = tuple(settings["hidden_paths"])
    try:
        config = ServiceConfig(token=_read_token(args.token_file), **settings)
    except ValueError as exc:
        raise SystemExit(f"sandbox service: {exc}") from None
    serve(build_app(config), config, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
