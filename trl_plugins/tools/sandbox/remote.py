"""The client side of the sandbox service: :class:`RemoteSandbox` runs code on a server and returns an
:class:`ExecResult`, as :class:`PythonSandbox` does, so the code interpreter maps both the same way.

It speaks our API (``protocol="trl"``, :mod:`.service`) or SandboxFusion's ``run_code`` (``"sandboxfusion"``, for an
existing fleet). Failures of the service, never the model's, come back as ``exit_code=None`` (an infrastructure
error); a call that provably never started (connection refused, 503/429 "busy") is retried with backoff first. A
call that may have started (the server died mid-call, no answer before the deadline, a 5xx) is not retried here;
every request has a deadline, so nothing hangs. docs/sandbox_service.md describes the guarantees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import socket
import time
from typing import Any

import httpx

from trl_plugins.tools.sandbox import CallStats, ExecResult, SandboxStats, wire
from trl_plugins.tools.sandbox.wire import PROTOCOLS, CodeRejected

__all__ = ["RemoteSandbox", "CodeRejected", "PROTOCOLS"]

_RETRYABLE_STATUS = (429, 503)
_MAX_BACKOFF_S = 8.0


class _NotStarted(Exception):
    """The request provably did not start a call: safe to send again (after ``retry_after_s`` when the server said)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RemoteSandbox:
    """Runs code on a sandbox server over HTTP. Thread-safe; ``arun`` works from any event loop.

    Args:
        url: the server's base URL (``http://host:8000``; ``https://`` through a reverse proxy).
        token: the shared secret, sent as ``Authorization: Bearer``; None sends none (a SandboxFusion fleet
            without authentication).
        protocol: ``"trl"`` (our server) or ``"sandboxfusion"`` (``POST /run_code``).
        timeout_s, memory_mb, max_output_chars: the per-call limits asked of the server.
        max_concurrency: requests in flight at once from this process.
        retries: resends of a call that never started, after the first try.
        retry_backoff_s: wait before the first resend; it doubles each time (capped at 8 s, with jitter).
        connect_timeout_s: deadline for opening a connection.
        deadline_slack_s: added to ``timeout_s`` and the server's longest queue wait to make each request's deadline.

    Raises:
        ValueError: ``protocol`` is unknown or ``url`` is not an http(s) URL.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        protocol: str = "trl",
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 8000,
        max_concurrency: int = 8,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        connect_timeout_s: float = 5.0,
        deadline_slack_s: float = 10.0,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL such as 'http://sandbox-host:8000', got {url!r}")
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.timeout_s, self.memory_mb, self.max_output_chars = float(timeout_s), memory_mb, max_output_chars
        self.max_concurrency = max_concurrency
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.connect_timeout_s, self.deadline_slack_s = connect_timeout_s, deadline_slack_s
        self.queue_wait_s = 0.0
        """The server's longest queue wait (from ``/health``), part of every request's deadline."""
        self.max_request_bytes: int | None = None
        """The server's body limit (from ``/health``): longer code is refused here, before it is sent."""
        self.health: dict[str, Any] | None = None

        headers = {wire.CLIENT_HEADER: f"{socket.gethostname()}:{os.getpid()}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # A synchronous client used from worker threads: one connection pool for every event loop (the rollout runs
        # a new loop per batch, and an async client is tied to the loop that made it).
        self._client = httpx.Client(
            headers=headers,
            limits=httpx.Limits(
                max_connections=max_concurrency, max_keepalive_connections=max_concurrency, keepalive_expiry=10.0
            ),
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="remote-sandbox")
        self._stats = CallStats()
        self._closed = False

    # -- start-up --------------------------------------------------------------------------------------------------

    def connect(self) -> str:
        """Check the server before the run spends compute: reachable, the right kind, the token accepted, the limits
        within its caps, and one trivial call answered correctly. Returns the line saying what holds where.

        Raises:
            RuntimeError: any of those fails; the message says which and what to do.
        """
        if self.protocol == "trl":
            self._load_health()
        else:
            pong = self._get_json(wire.SANDBOXFUSION_PING_PATH)
            if pong != "pong":
                raise RuntimeError(
                    f"{self.url}{wire.SANDBOXFUSION_PING_PATH} answered {pong!r:.200}, not 'pong': "
                    f"not a SandboxFusion server"
                )
        probe = self.run("print(6 * 7)")
        if probe.exit_code is None or probe.stdout.strip() != "42":
            raise RuntimeError(
                f"the sandbox server at {self.url} did not run a test call correctly: "
                f"{(probe.stderr or probe.stdout).strip()!r:.400}"
            )
        self.reset_step_stats()
        return self.describe()

    def _load_health(self) -> None:
        health = self._get_json(wire.HEALTH_PATH)
        if not isinstance(health, dict) or health.get("service") != wire.SERVICE_NAME:
            raise RuntimeError(
                f"{self.url}{wire.HEALTH_PATH} did not answer as a trl-plugins sandbox server "
                f"({health!r:.200}); for a SandboxFusion fleet set protocol='sandboxfusion'"
            )
        caps = health.get("caps", {})
        over = [
            f"{name}={mine} > the server's cap {caps[cap]}"
            for name, mine, cap in (
                ("timeout_s", self.timeout_s, "max_timeout_s"),
                ("memory_mb", self.memory_mb, "max_memory_mb"),
                ("max_output_chars", self.max_output_chars, "max_output_chars"),
            )
            if mine > caps.get(cap, mine)
        ]
        if over:
            raise RuntimeError(
                f"the sandbox server at {self.url} refuses these limits: {', '.join(over)}. Lower "
                f"them in tool_kwargs, or restart the server with higher caps"
            )
        self.health = health
        self.queue_wait_s = float(health.get("max_queue_wait_s", 0.0))
        self.max_request_bytes = caps.get("max_request_bytes")

    def _get_json(self, path: str) -> Any:
        try:
            response = self._client.get(
                self.url + path, timeout=httpx.Timeout(self.connect_timeout_s + 5.0, connect=self.connect_timeout_s)
            )
        except httpx.HTTPError as exc:
            raise RuntimeError(
                f"the sandbox server at {self.url} is unreachable ({type(exc).__name__}: {exc}); "
                f"start it (docs/sandbox_service.md) or fix the code interpreter's url"
            ) from None
        if response.status_code != 200:
            raise RuntimeError(f"GET {self.url}{path} answered HTTP {response.status_code}: {response.text[:200]!r}")
        try:
            return response.json()
        except ValueError:
            raise RuntimeError(f"GET {self.url}{path} did not answer JSON: {response.text[:200]!r}") from None

    def describe(self) -> str:
        """One line on where code runs and which guarantees hold there."""
        limits = f"timeout {self.timeout_s:g} s, memory {self.memory_mb} MB, output {self.max_output_chars} chars"
        if self.protocol == "trl":
            h = self.health or {}
            return (
                f"remote sandbox at {self.url} (trl-plugins server {h.get('version', '?')}): "
                f"{h.get('sandbox') or 'isolation=' + str(h.get('isolation', '?'))}; hidden paths "
                f"({h.get('hidden_paths', '?')} extra) and isolation are the server's; limits per call {limits}, "
                f"enforced by the server; {h.get('max_concurrency', '?')} calls at once, queue "
                f"{h.get('queue_size', '?')}"
            )
        return (
            f"remote sandbox at {self.url} (SandboxFusion run_code API): isolation, hidden paths and the memory "
            f"limit are the fleet's and NOT checked by this client (they hold only on a trl-plugins server); "
            f"asks for {limits} (the output is cut here)"
        )

    # -- calls ------------------------------------------------------------------------------------------------------

    def run(self, code: str) -> ExecResult:
        """Run ``code`` on the server and wait for it (bounded by the request deadline).

        Returns:
            An :class:`ExecResult`; a failure of the service gives ``exit_code=None`` with the reason in ``stderr``.

        Raises:
            TypeError: ``code`` is not a string.
            CodeRejected: the code is over the server's request size limit, or the server refused it (400 naming
                ``code``: a lone surrogate); the message is for the model.
            RuntimeError: the sandbox is closed.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if self._closed:
            raise RuntimeError("the remote sandbox is closed; create a new RemoteSandbox")
        if self.protocol == "trl":
            path, body = (
                wire.RUN_PATH,
                {
                    "code": code,
                    "timeout_s": self.timeout_s,
                    "memory_mb": self.memory_mb,
                    "max_output_chars": self.max_output_chars,
                },
            )
        else:
            path, body = wire.SANDBOXFUSION_RUN_PATH, wire.sandboxfusion_request(code, self.timeout_s, self.memory_mb)
        content = json.dumps(body).encode()  # ASCII escapes: a lone surrogate in the code travels as text does
        if self.max_request_bytes is not None and len(content) > self.max_request_bytes:
            raise CodeRejected(
                f"Error: the code is too long for the sandbox ({len(content):,} bytes with its "
                f"wrapping; the server takes at most {self.max_request_bytes:,}). Write shorter code."
            )
        t0 = time.perf_counter()
        result = self._send(path, content, t0)
        self._stats.add(result)
        return result

    async def arun(self, code: str) -> ExecResult:
        """Async :meth:`run`, in one of ``max_concurrency`` worker threads. Cancelling the awaiting task does not stop
        a request already sent; it ends at its deadline."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.run, code)

    def _send(self, path: str, content: bytes, t0: float) -> ExecResult:
        if self.protocol == "trl" and self.health is None:
            try:  # not connected (e.g. restarted after close()): learn the queue wait for the deadline
                self._load_health()
            except RuntimeError:
                pass  # the call itself reports what is wrong
        deadline = self.timeout_s + self.queue_wait_s + self.deadline_slack_s
        timeout = httpx.Timeout(deadline, connect=self.connect_timeout_s)
        delay = self.retry_backoff_s
        for attempt in range(self.retries + 1):
            try:
                return self._attempt(path, content, timeout, t0)
            except _NotStarted as exc:
                if attempt == self.retries:
                    return self._failure(f"{exc}; gave up after {attempt + 1} tries", t0)
                self._stats.add_retry()
                # The server's Retry-After when it gave one (and it is sooner than the cap), else our backoff.
                wait = min(delay, _MAX_BACKOFF_S) * random.uniform(0.8, 1.2)
                if exc.retry_after_s is not None:
                    wait = max(wait, min(exc.retry_after_s, _MAX_BACKOFF_S))
                time.sleep(wait)
                delay *= 2
        raise AssertionError("unreachable")

    def _attempt(self, path: str, content: bytes, timeout: httpx.Timeout, t0: float) -> ExecResult:
        try:
            response = self._client.post(
                self.url + path, content=content, timeout=timeout, headers={"Content-Type": "application/json"}
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _NotStarted(f"could not connect to {self.url} ({type(exc).__name__}: {exc})") from None
        except httpx.TimeoutException as exc:
            return self._failure(
                f"no answer from {self.url} within {timeout.read:g} s ({type(exc).__name__}); the call may have run", t0
            )
        except httpx.HTTPError as exc:  # the connection broke mid-call: the server died or a proxy cut it
            return self._failure(
                f"the connection to {self.url} broke during the call ({type(exc).__name__}: {exc}); "
                f"the call may have run",
                t0,
            )
        status = response.status_code
        if status in _RETRYABLE_STATUS:
            raise _NotStarted(
                f"the server was busy (HTTP {status}: {_message(response)})",
                _retry_after(response.headers.get("Retry-After")),
            )
        if status == 413:
            raise CodeRejected(
                f"Error: the code is too long for the sandbox ({_message(response)}). Write shorter code."
            )
        if status == 400 and _field(response) == "code":  # the model's code (a lone surrogate): its lesson
            raise CodeRejected(_message(response))
        if status in (401, 403):
            return self._failure(f"the server refused the token (HTTP {status}): check TRL_SANDBOX_TOKEN", t0)
        if status != 200:
            return self._failure(f"HTTP {status} from {self.url}{path}: {_message(response)}", t0)
        latency_s = time.perf_counter() - t0
        try:
            body = response.json()
            if self.protocol == "trl":
                return wire.result_from_json(body)
            return wire.result_from_sandboxfusion(body, self.timeout_s, self.max_output_chars, latency_s)
        except (ValueError, wire.WireError) as exc:
            return self._failure(f"malformed answer from {self.url}{path}: {exc}", t0)

    def _failure(self, why: str, t0: float) -> ExecResult:
        return ExecResult(
            ok=False,
            stdout="",
            stderr=f"SandboxServiceError: {why}\n",
            exit_code=None,
            timed_out=False,
            latency_s=time.perf_counter() - t0,
            isolation="remote",
            mode=self.protocol,
        )

    # -- statistics and lifecycle ----------------------------------------------------------------------------------

    def stats(self) -> SandboxStats:
        """Statistics of this client's calls since the last :meth:`reset_step_stats` (service failures are errors)."""
        return self._stats.step()

    def total_stats(self) -> SandboxStats:
        """Statistics of every call since construction."""
        return self._stats.total()

    @property
    def retried(self) -> int:
        """Resends so far (calls that found the server busy or unreachable)."""
        return self._stats.retries

    def step_retries(self) -> int:
        """Resends since the last :meth:`reset_step_stats`."""
        return self._stats.step_retries()

    def reset_step_stats(self) -> None:
        """Start a new step for :meth:`stats` and :meth:`step_retries`."""
        self._stats.reset_step()

    def close(self) -> None:
        """Close the connections and worker threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteSandbox(url={self.url!r}, protocol={self.protocol!r}, timeout_s={self.timeout_s})"


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header given as a number of seconds; None otherwise (an HTTP date, absent)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < float("inf") else None


def _field(response: httpx.Response) -> str | None:
    """The request field a 400 of our server names (``{"error", "field"}``), if any."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("field") if isinstance(body, dict) else None


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])[:300]
    except ValueError:
        pass
    return response.text[:300]
