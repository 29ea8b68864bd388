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

Runs under uvicorn (``pip install 'trl-plugins[server]'``); imports no torch. docs/sandbox_service.md has the
operator's guide (TLS through a reverse proxy, several runs on one server, the benchmark figures).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import trl_plugins
from trl_plugins.tools.sandbox import PythonSandbox, detect_isolation
from trl_plugins.tools.sandbox import wire
from trl_plugins.tools.sandbox.admission import Admission, Busy

__all__ = ["ServiceConfig", "build_app", "main", "TOKEN_ENV", "MIN_TOKEN_CHARS"]

logger = logging.getLogger("trl_plugins.tools.sandbox.service")  # also under `python -m`

TOKEN_ENV = "TRL_SANDBOX_TOKEN"
"""Environment variable holding the shared secret (server and client alike), unless ``--token-file`` is given."""
MIN_TOKEN_CHARS = 16
"""Shorter tokens are refused: they can be guessed."""


@dataclass
class ServiceConfig:
    """What the server enforces. Defaults are the code interpreter's local defaults, so a tool left at its
    defaults fits the caps."""

    token: str = field(repr=False)
    """The shared secret every run request must present (``Authorization: Bearer <token>``)."""
    mode: str = "warm"
    """``"warm"`` (pre-started interpreters that fork per call) or ``"cold"`` (a new interpreter per call)."""
    isolation: str = "auto"
    """As :class:`PythonSandbox`'s: ``"auto"`` (bwrap, else unshare) or one that must work here."""
    hidden_paths: tuple[str, ...] = ()
    """More absolute paths on the server that the code must not read."""
    max_concurrency: int = 8
    """Calls running at once, over all clients."""
    queue_size: int = 64
    """Calls waiting for a slot beyond those running; more get 503 at once."""
    max_queue_wait_s: float = 30.0
    """Longest a call waits in the queue before it gets 503 (never started). Clients add it to their deadline."""
    max_timeout_s: float = 30.0
    """Largest per-call wall-clock limit a client may ask for."""
    max_memory_mb: int = 4096
    """Largest per-call memory limit a client may ask for."""
    max_output_chars: int = 20000
    """Largest number of stdout/stderr characters (each) a client may ask to get back."""
    default_timeout_s: float = 5.0
    """Limit of a call that names none (SandboxFusion's ``memory_limit_MB: -1`` takes ``default_memory_mb``)."""
    default_memory_mb: int = 1024
    """Memory limit of a call that names none."""
    default_output_chars: int = 8000
    """Output kept for a call that names no limit."""
    max_request_bytes: int = 1 << 20
    """Largest request body (the code and its JSON wrapping); larger ones get 413."""
    max_limit_sets: int = 4
    """Distinct ``(timeout_s, memory_mb, max_output_chars)`` combinations served at once, each by its own
    :class:`PythonSandbox` (and, in warm mode, its own pool). An idle one is closed to make room for a new one;
    when all are busy the call gets 503."""

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the token must be at least {MIN_TOKEN_CHARS} characters; make one with "
                             f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        for name in ("max_concurrency", "max_limit_sets", "max_memory_mb", "max_output_chars", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.queue_size < 0 or self.max_queue_wait_s <= 0 or self.max_timeout_s <= 0:
            raise ValueError("queue_size must be >= 0, max_queue_wait_s and max_timeout_s > 0")
        defaults = {"default_timeout_s": (self.default_timeout_s, self.max_timeout_s),
                    "default_memory_mb": (self.default_memory_mb, self.max_memory_mb),
                    "default_output_chars": (self.default_output_chars, self.max_output_chars)}
        for name, (value, cap) in defaults.items():
            if value > cap:
                raise ValueError(f"{name}={value} is above its cap {cap}; raise the cap or lower the default")

    def caps(self) -> dict[str, Any]:
        """The per-call caps and defaults, as ``/health`` reports them."""
        return {"max_timeout_s": self.max_timeout_s, "max_memory_mb": self.max_memory_mb,
                "max_output_chars": self.max_output_chars, "max_request_bytes": self.max_request_bytes,
                "default_timeout_s": self.default_timeout_s, "default_memory_mb": self.default_memory_mb,
                "default_output_chars": self.default_output_chars}


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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

    def default_limits(self) -> tuple[float, int, int]:
        c = self.config
        return (float(c.default_timeout_s), int(c.default_memory_mb), int(c.default_output_chars))

    def _new_sandbox(self, limits: tuple[float, int, int]) -> PythonSandbox:
        timeout_s, memory_mb, max_output_chars = limits
        return PythonSandbox(timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                             max_concurrency=self.config.max_concurrency, mode=self.config.mode,
                             isolation=self.isolation, extra_hidden_paths=self.config.hidden_paths)

    def start(self) -> None:
        """Build the sandbox for the default limits (failing here if isolation does not work) and warm it."""
        sandbox = self._new_sandbox(self.default_limits())
        sandbox.warm_up()
        self.sandboxes[self.default_limits()] = sandbox
        self.describe = sandbox.describe()
        logger.info("sandbox service: %s; %d calls at once, queue %d", self.describe, self.config.max_concurrency,
                    self.config.queue_size)

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
        }

    # -- requests --------------------------------------------------------------------------------------------------

    def check_token(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        # compare_digest on equal-length inputs does not leak where they differ; a wrong length leaks only that.
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self.token):
            self.counters.refused_auth += 1
            raise _Refused(401, "missing or wrong token: send 'Authorization: Bearer <token>' with the server's "
                                "token (TRL_SANDBOX_TOKEN)")

    async def read_json(self, request: Request) -> dict[str, Any]:
        cap = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > cap):
            self.counters.refused_too_large += 1
            raise _Refused(413, f"request body of {declared} bytes is over this server's limit of {cap} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():  # also when Content-Length is absent or lies
            size += len(chunk)
            if size > cap:
                self.counters.refused_too_large += 1
                raise _Refused(413, f"request body is over this server's limit of {cap} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.bad_request(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise self.bad_request("the body must be a JSON object")
        return body

    def bad_request(self, message: str) -> _Refused:
        self.counters.refused_bad_request += 1
        return _Refused(400, message)

    def limits_from(self, timeout_s: Any, memory_mb: Any, output_chars: Any) -> tuple[float, int, int]:
        """The call's limits: defaults where None, refused (400) when malformed or above a cap."""
        c = self.config
        checks = (("timeout_s", timeout_s, c.default_timeout_s, c.max_timeout_s, "--max-timeout-s", 0.01, False),
                  ("memory_mb", memory_mb, c.default_memory_mb, c.max_memory_mb, "--max-memory-mb", 32, True),
                  ("max_output_chars", output_chars, c.default_output_chars, c.max_output_chars,
                   "--max-output-chars", 256, True))
        out = []
        for name, value, default, cap, flag, minimum, integer in checks:
            if value is None:
                value = default
            kind = int if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
                raise self.bad_request(f"{name} must be {'an integer' if integer else 'a number'} >= {minimum}, "
                                       f"got {value!r:.50}")
            if value > cap:
                raise self.bad_request(f"{name}={value} is above this server's cap of {cap}: ask for at most {cap}, "
                                       f"or start the server with a higher {flag}")
            out.append(value)
        return (float(out[0]), int(out[1]), int(out[2]))

    async def execute(self, request: Request, code: str, limits: tuple[float, int, int]):
        """Run ``code`` under ``limits`` once admitted; returns the result and the seconds spent queued."""
        t0 = time.perf_counter()
        try:
            await self.admission.acquire()
        except Busy:
            self.counters.refused_busy += 1
            raise
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


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _guarded(handler):
    """Turn the service's refusals into HTTP answers: 401/413/400 with a message, 503 + Retry-After when busy."""

    async def endpoint(request: Request) -> JSONResponse:
        try:
            return await handler(request.app.state.service, request)
        except _Refused as exc:
            if exc.status != 400:
                logger.warning("sandbox service: refused %s %s from %s: %s", request.method, request.url.path,
                               request.client.host if request.client else "?", exc)
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            return _error(exc.status, str(exc), **headers)
        except Busy as exc:
            return _error(503, f"busy, the call was not started: {exc}; retry later", **{"Retry-After": "1"})

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
        raise service.bad_request(f"unknown fields {unknown}; /v1/run takes code, timeout_s, memory_mb, "
                                  f"max_output_chars")
    if not isinstance(body.get("code"), str):
        raise service.bad_request("'code' must be a string of Python code")
    limits = service.limits_from(body.get("timeout_s"), body.get("memory_mb"), body.get("max_output_chars"))
    result, queue_s = await service.execute(request, body["code"], limits)
    return JSONResponse(wire.result_to_json(result, queue_s))


async def _run_code(service: _Service, request: Request) -> JSONResponse:
    service.check_token(request)
    body = await service.read_json(request)
    if body.get("language") != "python":
        raise service.bad_request(f"this server runs only language 'python', got {body.get('language')!r:.40}")
    if not isinstance(body.get("code"), str):
        raise service.bad_request("'code' must be a string of Python code")
    for name in ("files", "fetch_files", "args"):
        if body.get(name):
            raise service.bad_request(f"'{name}' is not supported by this server; send the code alone")
    if body.get("stdin"):
        raise service.bad_request("'stdin' is not supported by this server: the code runs with an empty stdin")
    memory = body.get("memory_limit_MB")
    memory = None if memory is None or memory == -1 else memory
    limits = service.limits_from(body.get("run_timeout"), memory, None)
    result, _ = await service.execute(request, body["code"], limits)
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
            raise SystemExit(f"no token: set {TOKEN_ENV} or pass --token-file PATH (make one with "
                             f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
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
    p = argparse.ArgumentParser(prog="python -m trl_plugins.tools.sandbox.service",
                                description="Serve the Python sandbox over HTTP (docs/sandbox_service.md).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", default=None, help=f"file holding the token (default: ${TOKEN_ENV})")
    p.add_argument("--mode", choices=["warm", "cold"], default=d["mode"].default)
    p.add_argument("--isolation", choices=["auto", "bwrap", "unshare", "none"], default=d["isolation"].default)
    p.add_argument("--hidden-path", action="append", default=[], dest="hidden_paths",
                   help="absolute path the code must not read (repeatable)")
    for name in ("max_concurrency", "queue_size", "max_memory_mb", "max_output_chars", "default_memory_mb",
                 "default_output_chars", "max_request_bytes", "max_limit_sets"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name].default)
    for name in ("max_queue_wait_s", "max_timeout_s", "default_timeout_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=d[name].default)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, check the settings, and serve until interrupted."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = set(ServiceConfig.__dataclass_fields__) - {"token"}
    settings = {k: v for k, v in vars(args).items() if k in names}
    settings["hidden_paths"] = tuple(settings["hidden_paths"])
    try:
        config = ServiceConfig(token=_read_token(args.token_file), **settings)
    except ValueError as exc:
        raise SystemExit(f"sandbox service: {exc}") from None
    # The keep-alive outlives the client's (10 s) so that the server never closes a connection a client is about
    # to reuse: such a request would fail without a way to know whether it started.
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
                server_header=False)


if __name__ == "__main__":
    sys.exit(main())
