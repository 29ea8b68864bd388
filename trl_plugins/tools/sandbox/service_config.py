"""The sandbox service's settings (:class:`ServiceConfig`): what the server enforces, defined and checked once here;
``python -m trl_plugins.tools.sandbox.service`` makes its command-line options from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ServiceConfig", "TOKEN_ENV", "MIN_TOKEN_CHARS"]

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
    max_connections: int = 1024
    """Open connections at most, idle ones included. Start-up raises the open-files limit to its hard limit and lowers
    this cap to fit under it next to the sandboxes' descriptors. At the cap a new connection closes the one idle
    longest; when every open one carries a call it gets 503."""
    idle_timeout_s: float = 30.0
    """A connection without a request (before its first, or between two) is closed after this long. Above the
    remote client's keep-alive (10 s), so that the server never closes a connection the client is about to reuse:
    such a request would fail without a way to know whether it started."""
    read_timeout_s: float = 15.0
    """A request must arrive whole (head and body) within this long of its first byte; a slower one's connection is
    closed unanswered."""

    def __post_init__(self) -> None:
        if not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"the token must be at least {MIN_TOKEN_CHARS} characters; make one with "
                f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        for name in (
            "max_concurrency",
            "max_limit_sets",
            "max_memory_mb",
            "max_output_chars",
            "max_request_bytes",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            self.queue_size < 0
            or min(self.max_queue_wait_s, self.max_timeout_s, self.idle_timeout_s, self.read_timeout_s) <= 0
        ):
            raise ValueError(
                "queue_size must be >= 0; max_queue_wait_s, max_timeout_s, idle_timeout_s and read_timeout_s > 0"
            )
        defaults = {
            "default_timeout_s": (self.default_timeout_s, self.max_timeout_s),
            "default_memory_mb": (self.default_memory_mb, self.max_memory_mb),
            "default_output_chars": (self.default_output_chars, self.max_output_chars),
        }
        for name, (value, cap) in defaults.items():
            if value > cap:
                raise ValueError(f"{name}={value} is above its cap {cap}; raise the cap or lower the default")

    def caps(self) -> dict[str, Any]:
        """The per-call caps and defaults, as ``/health`` reports them."""
        return {
            "max_timeout_s": self.max_timeout_s,
            "max_memory_mb": self.max_memory_mb,
            "max_output_chars": self.max_output_chars,
            "max_request_bytes": self.max_request_bytes,
            "default_timeout_s": self.default_timeout_s,
            "default_memory_mb": self.default_memory_mb,
            "default_output_chars": self.default_output_chars,
        }
