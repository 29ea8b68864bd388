"""The sandbox service's wire format, shared by the server (:mod:`.service`) and the client (:mod:`.remote`).

Two APIs, both JSON over HTTP with ``Authorization: Bearer <token>``:

- ours, ``POST /v1/run``: ``{"code", "timeout_s"?, "memory_mb"?, "max_output_chars"?}`` in, the fields of
  :class:`~trl_plugins.tools.sandbox.ExecResult` out (plus ``queue_s``);
- SandboxFusion's ``POST /run_code`` (what verl's ``sandbox_fusion`` tool and reward call): ``{"code",
  "language": "python", "run_timeout", "memory_limit_MB", ...}`` in, ``{"status", "message", "run_result":
  {"status", "return_code", "stdout", "stderr", "execution_time"}, ...}`` out.

This module converts between those JSON bodies and :class:`ExecResult`; it imports only the standard library and
the sandbox package, so the client needs no server dependency. docs/sandbox_service.md describes the API.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trl_plugins.tools.sandbox import ExecResult

__all__ = [
    "SERVICE_NAME",
    "RUN_PATH",
    "HEALTH_PATH",
    "STATS_PATH",
    "SANDBOXFUSION_RUN_PATH",
    "SANDBOXFUSION_PING_PATH",
    "CLIENT_HEADER",
    "PROTOCOLS",
    "CodeRejected",
    "WireError",
    "code_problem",
    "result_to_json",
    "result_from_json",
    "result_to_sandboxfusion",
    "result_from_sandboxfusion",
    "sandboxfusion_request",
]

SERVICE_NAME = "trl-plugins-sandbox"
"""What ``GET /health`` answers in its ``service`` field: how a client tells our server from another HTTP server."""
RUN_PATH = "/v1/run"
HEALTH_PATH = "/health"
STATS_PATH = "/v1/stats"
SANDBOXFUSION_RUN_PATH = "/run_code"
SANDBOXFUSION_PING_PATH = "/v1/ping"
CLIENT_HEADER = "X-Sandbox-Client"
"""Optional request header naming the calling process (``host:pid``); the server counts calls per client."""

_RESULT_FIELDS = {f.name: f for f in dataclasses.fields(ExecResult)}
_TIMEOUT_LINE = "TimeoutError: execution exceeded {} s wall-clock limit and was killed"


PROTOCOLS = ("trl", "sandboxfusion")
"""What a client may speak: our API, or SandboxFusion's ``run_code``."""


class CodeRejected(ValueError):
    """The server cannot take this code at all (its body is over the server's request limit, or the server refused
    the ``code`` field: a lone surrogate): the model's input, reported to the model, not an infrastructure failure."""


def code_problem(code: str) -> str | None:
    """Why ``code`` cannot run as Python source, or None. A lone surrogate (``"\\ud800"`` in JSON) is not UTF-8:
    the local sandbox answers it with this very line as the cell's error, so the server refuses it (400 naming
    ``code``) with the same words, and the model reads the same text on either backend."""
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"UnicodeEncodeError: {exc}"
    return None


class WireError(ValueError):
    """A response body that does not follow the API: the server (or something in front of it) is broken."""


def result_to_json(result: ExecResult, queue_s: float = 0.0) -> dict[str, Any]:
    """Our ``/v1/run`` response body for ``result``; ``queue_s`` is how long the call waited for a slot."""
    return {**dataclasses.asdict(result), "queue_s": queue_s}


def result_from_json(body: Any) -> ExecResult:
    """The :class:`ExecResult` in a ``/v1/run`` response body.

    Raises:
        WireError: a field is missing or of the wrong type.
    """
    if not isinstance(body, dict):
        raise WireError(f"expected a JSON object, got {type(body).__name__}")
    kinds = {
        "ok": bool,
        "stdout": str,
        "stderr": str,
        "timed_out": bool,
        "latency_s": (int, float),
        "output_truncated": bool,
        "isolation": str,
        "mode": str,
    }
    for name, kind in kinds.items():
        if not isinstance(body.get(name), kind):
            raise WireError(f"field {name!r} is {body.get(name)!r:.80}, expected {kind}")
    exit_code = body.get("exit_code")
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise WireError(f"field 'exit_code' is {exit_code!r:.80}, expected an integer or null")
    return ExecResult(**{name: body[name] for name in _RESULT_FIELDS if name in body})


def result_to_sandboxfusion(result: ExecResult) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeResponse`` for ``result``.

    ``status`` is ``"Success"`` (exit 0), ``"Failed"`` (non-zero exit, signal or timeout) or ``"SandboxError"``
    (the sandbox failed: ``exit_code`` None without a timeout), as SandboxFusion's own server sets it.
    """
    if result.exit_code is None and not result.timed_out:
        return {
            "status": "SandboxError",
            "message": result.stderr,
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    run_status = "TimeLimitExceeded" if result.timed_out else "Finished"
    return {
        "status": "Success" if result.ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": {
            "status": run_status,
            "execution_time": result.latency_s,
            "return_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr,
        },
        "executor_pod_name": None,
        "files": {},
    }


def sandboxfusion_request(code: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeRequest`` for one Python call."""
    return {
        "code": code,
        "language": "python",
        "run_timeout": timeout_s,
        "compile_timeout": timeout_s,
        "memory_limit_MB": memory_mb,
        "stdin": None,
        "files": {},
        "fetch_files": [],
    }


def _tail(text: str, max_chars: int) -> tuple[str, bool]:
    if len(text) <= max_chars:
        return text, False
    marker = (
        f"[sandbox: output truncated, {len(text) - max_chars:,} characters cut; "
        f"the last {max_chars:,} characters follow]"
    )
    return marker + "\n" + text[-max_chars:], True


def result_from_sandboxfusion(body: Any, timeout_s: float, max_output_chars: int, latency_s: float) -> ExecResult:
    """The :class:`ExecResult` in a SandboxFusion ``RunCodeResponse``.

    A fleet that is not ours neither cuts the output nor writes our timeout line, so both are done here: stdout and
    stderr keep their last ``max_output_chars`` characters, and a timed-out call's stderr ends with the same
    ``TimeoutError`` line a local call's does. ``"SandboxError"`` (the fleet failed) gives ``exit_code=None``, which
    the code interpreter reports as an infrastructure error.

    Raises:
        WireError: the body is not a ``RunCodeResponse``.
    """
    if not isinstance(body, dict) or body.get("status") not in ("Success", "Failed", "SandboxError"):
        raise WireError(f"not a SandboxFusion RunCodeResponse: {body!r:.200}")
    run = body.get("run_result")
    if body["status"] == "SandboxError" or (isinstance(run, dict) and run.get("status") == "Error"):
        message = str(body.get("message") or (run or {}).get("stderr") or "the fleet reported a SandboxError")
        return ExecResult(
            ok=False,
            stdout="",
            stderr=f"SandboxError: {message}\n",
            exit_code=None,
            timed_out=False,
            latency_s=latency_s,
            isolation="fleet",
            mode="sandboxfusion",
        )
    if not isinstance(run, dict) or run.get("status") not in ("Finished", "TimeLimitExceeded"):
        raise WireError(f"RunCodeResponse with status {body['status']!r} has no usable run_result: {run!r:.200}")
    code = run.get("return_code")
    if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
        raise WireError(f"run_result.return_code is {code!r:.80}, expected an integer or null")
    timed_out = run["status"] == "TimeLimitExceeded"
    stdout, cut_out = _tail(str(run.get("stdout") or ""), max_output_chars)
    stderr, cut_err = _tail(str(run.get("stderr") or ""), max_output_chars)
    if timed_out and "TimeoutError" not in stderr:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + _TIMEOUT_LINE.format(timeout_s) + "\n"
    if timed_out and code is None:
        code = -9  # killed, as a local timeout reports it
    execution_time = run.get("execution_time")
    if isinstance(execution_time, (int, float)) and math.isfinite(execution_time):
        latency_s = float(execution_time)
    return ExecResult(
        ok=code == 0 and not timed_out,
        stdout=stdout,
        stderr=stderr,
        exit_code=code,
        timed_out=timed_out,
        latency_s=latency_s,
        output_truncated=cut_out or cut_err,
        isolation="fleet",
        mode="sandboxfusion",
    )
