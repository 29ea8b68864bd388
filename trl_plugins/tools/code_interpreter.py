"""The built-in ``code_interpreter`` tool: run model-written Python in the sandbox."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from trl_plugins.registry import TOOLS
from trl_plugins.tools.base import ClosingTool, ToolOutput
from trl_plugins.tools.sandbox import PythonSandbox
from trl_plugins.tools.sandbox.wire import PROTOCOLS, CodeRejected

if TYPE_CHECKING:
    from trl_plugins.tools.sandbox.remote import RemoteSandbox

__all__ = ["CodeInterpreter"]


@TOOLS.register("code_interpreter")
@dataclass
class CodeInterpreter(ClosingTool):
    """Runs Python in a fresh, isolated interpreter per call (see :class:`PythonSandbox`).

    The value of a trailing expression is printed, as in a notebook. The model gets stdout on success,
    stdout followed by the traceback on error, and a plain timeout message when the time limit is hit.

    ``backend="remote"`` sends the code to a sandbox server instead (docs/sandbox_service.md): ours, or a
    SandboxFusion fleet (``protocol="sandboxfusion"``). The model sees the same outputs; a failure of the service
    (unreachable after retries, died mid-call, refused the token, answered nonsense) is an infrastructure error.

    Raises:
        ValueError: an unknown ``backend`` or ``protocol``; ``backend="remote"`` without ``url``, or with ``mode``,
            ``isolation`` or ``hidden_paths`` (the server's settings, not the client's).
    """

    timeout_s: float = 5.0
    """Wall-clock limit per call."""
    memory_mb: int = 1024
    """Address-space limit per call."""
    max_output_chars: int = 8000
    """Characters of stdout/stderr kept (the tail)."""
    max_concurrency: int = 8
    """Calls that may run at once."""
    mode: str | None = None
    """``"warm"`` (pre-started interpreters, fast; the default) or ``"cold"`` (a new interpreter per call).
    Local backend only: a server has its own."""
    isolation: str | None = None
    """``"auto"`` (the default) picks the strongest available isolation (bwrap, else unshare) and refuses to run
    without one; ``"none"`` (rlimits, cgroups and seccomp only) must be asked for explicitly. Local backend only."""
    name: str = "code_interpreter"
    """Name the model calls the tool by."""
    idempotent: ClassVar[bool] = True
    """Each call runs in a fresh sandbox: a call that failed for infrastructure reasons may be retried."""
    hidden_paths: tuple[str, ...] = ()
    """More absolute host paths the code must not read (e.g. where the dataset with the reference
    answers is cached). The sandbox shows only the interpreter, its site-packages and ``/usr`` anyway;
    this hides paths inside those. Local backend only (a server is started with its own ``--hidden-path``)."""
    backend: str = "local"
    """``"local"`` (a sandbox in this process's machine) or ``"remote"`` (a sandbox server at ``url``)."""
    url: str | None = None
    """The sandbox server's base URL, e.g. ``"http://sandbox-host:8000"`` (remote backend)."""
    protocol: str = "trl"
    """``"trl"`` (our server: token, caps and isolation checked at start-up) or ``"sandboxfusion"`` (a
    SandboxFusion ``run_code`` fleet: its isolation, hidden paths and memory limit are not checked)."""
    token_env: str = "TRL_SANDBOX_TOKEN"
    """Name of the environment variable holding the server's token (the token itself never goes in a config,
    which is logged). Required for ``protocol="trl"``; for a SandboxFusion fleet it is sent when set."""
    retries: int = 3
    """Resends of a remote call that provably never started (connection refused, server busy), with backoff."""
    retry_backoff_s: float = 0.5
    """Wait before the first resend; doubles each time."""
    _sandbox: PythonSandbox | RemoteSandbox | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "remote"):
            raise ValueError(
                f"backend must be 'local' (a sandbox on this machine) or 'remote' (a sandbox server), "
                f"got {self.backend!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.retries < 0 or self.retry_backoff_s < 0:
            raise ValueError(f"retries and retry_backoff_s must be >= 0, got {self.retries}, {self.retry_backoff_s}")
        if self.backend == "local":
            if self.url is not None:
                raise ValueError(f"url={self.url!r} is set but backend is 'local'; set backend='remote' to use it")
            # Resolved here, so that what the run records (and repr shows) is what runs; None stays for remote,
            # where these are the server's.
            self.mode = self.mode or "warm"
            self.isolation = self.isolation or "auto"
            return
        server_side = {
            k: v
            for k, v in (
                ("mode", self.mode),
                ("isolation", self.isolation),
                ("hidden_paths", tuple(self.hidden_paths) or None),
            )
            if v is not None
        }
        if server_side:
            raise ValueError(
                f"{sorted(server_side)} are the sandbox server's settings, not the client's: with "
                f"backend='remote' remove them from tool_kwargs and start the server with them "
                f"(--mode, --isolation, --hidden-path; docs/sandbox_service.md)"
            )
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"backend='remote' needs url, the server's base URL such as 'http://sandbox-host:8000'; "
                f"got {self.url!r}"
            )

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; "
                    "the value of the last expression is printed. numpy and sympy are available."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                    "required": ["code"],
                },
            },
        }

    @property
    def sandbox(self) -> PythonSandbox | RemoteSandbox:
        """The sandbox (local) or the client of the sandbox server (remote), started on first use.

        Raises:
            RuntimeError: remote with ``protocol="trl"`` and no token in ``token_env``."""
        if self._sandbox is None:
            if self.backend == "remote":
                token = os.environ.get(self.token_env, "").strip() or None
                if token is None and self.protocol == "trl":
                    raise RuntimeError(
                        f"the code interpreter's sandbox server needs its token in the environment "
                        f"variable {self.token_env} (the one the server was started with)"
                    )
                from trl_plugins.tools.sandbox.remote import RemoteSandbox  # httpx: only when used

                self._sandbox = RemoteSandbox(
                    self.url,
                    token,
                    protocol=self.protocol,
                    timeout_s=self.timeout_s,
                    memory_mb=self.memory_mb,
                    max_output_chars=self.max_output_chars,
                    max_concurrency=self.max_concurrency,
                    retries=self.retries,
                    retry_backoff_s=self.retry_backoff_s,
                )
            else:
                self._sandbox = PythonSandbox(
                    timeout_s=self.timeout_s,
                    memory_mb=self.memory_mb,
                    max_output_chars=self.max_output_chars,
                    max_concurrency=self.max_concurrency,
                    mode=self.mode,
                    isolation=self.isolation,
                    extra_hidden_paths=tuple(self.hidden_paths),
                )
        return self._sandbox

    def start_up(self) -> str:
        """Start the sandbox now and say how it runs code (isolation, mode, memory bound); remote: check the
        server (reachable, token accepted, limits within its caps, a test call answered) and say which guarantees
        hold there.

        Raises:
            RuntimeError: no isolation works here and ``isolation="none"`` was not asked for; remote: the server
                cannot be used (the message says why).
        """
        if self.backend == "remote":
            return self.sandbox.connect()
        return self.sandbox.describe()

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput(text="Error: the 'code' argument must be a string of Python code.", ok=False)
        try:
            result = await self.sandbox.arun(code)
        except CodeRejected as exc:  # the model's code is over the server's size limit: its input, its lesson
            return ToolOutput(text=str(exc), ok=False)
        if result.exit_code is None and not result.timed_out:
            # The sandbox failed (could not start, crashed): not the model's code.
            return ToolOutput(
                text=result.stderr,
                ok=False,
                latency_s=result.latency_s,
                infra_error=result.stderr.strip() or "the sandbox failed",
            )
        text = result.stdout
        if not result.ok:
            text = (text + ("\n" if text and not text.endswith("\n") else "") + result.stderr).strip("\n")
        return ToolOutput(text=text, ok=result.ok, timed_out=result.timed_out, latency_s=result.latency_s)

    def step_metrics(self) -> dict[str, float]:
        """The sandbox's statistics since the last call (``sandbox/*``; remote: ``sandbox/retries`` too, the resends
        of calls that found the server busy or unreachable); empty before the first call."""
        if self._sandbox is None:
            return {}
        metrics = self._sandbox.stats().to_metrics("sandbox/")
        if self.backend == "remote":  # resends of calls that found the server busy or unreachable
            metrics["sandbox/retries"] = float(self._sandbox.step_retries())
        self._sandbox.reset_step_stats()
        return metrics

    def step_metric_reductions(self) -> dict[str, str]:
        """How :meth:`step_metrics` combine over ranks: counts add up, the largest latency is the largest;
        the latency percentiles are each rank's, averaged (``rollout/tool_latency_*`` are exact)."""
        return {
            "sandbox/calls": "sum",
            "sandbox/successes": "sum",
            "sandbox/errors": "sum",
            "sandbox/timeouts": "sum",
            "sandbox/retries": "sum",
            "sandbox/latency_max_s": "max",
        }

    def close(self) -> None:
        """Stop the sandbox's interpreters (remote: close the connections)."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def __getstate__(self) -> dict[str, Any]:
        # Picklable: the running sandbox stays behind and is restarted lazily.
        state = dict(self.__dict__)
        state["_sandbox"] = None
        return state
