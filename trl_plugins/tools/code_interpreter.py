"""The built-in ``code_interpreter`` tool: run model-written Python in the sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Any

from trl_plugins.registry import TOOLS
from trl_plugins.tools.base import ClosingTool, ToolOutput
from trl_plugins.tools.sandbox import PythonSandbox

__all__ = ["CodeInterpreter"]


@TOOLS.register("code_interpreter")
@dataclass
class CodeInterpreter(ClosingTool):
    """Runs Python in a fresh, isolated interpreter per call (see :class:`PythonSandbox`).

    The value of a trailing expression is printed, as in a notebook. The model gets stdout on success,
    stdout followed by the traceback on error, and a plain timeout message when the time limit is hit.
    """

    timeout_s: float = 5.0
    """Wall-clock limit per call."""
    memory_mb: int = 1024
    """Address-space limit per call."""
    max_output_chars: int = 8000
    """Characters of stdout/stderr kept (the tail)."""
    max_concurrency: int = 8
    """Calls that may run at once."""
    mode: str = "warm"
    """``"warm"`` (pre-started interpreters, fast) or ``"cold"`` (a new interpreter per call)."""
    isolation: str = "auto"
    """``"auto"`` picks the strongest available isolation (bwrap, else unshare) and refuses to run
    without one; ``"none"`` (rlimits, cgroups and seccomp only) must be asked for explicitly."""
    name: str = "code_interpreter"
    """Name the model calls the tool by."""
    idempotent: ClassVar[bool] = True
    """Each call runs in a fresh sandbox: a call that failed for infrastructure reasons may be retried."""
    hidden_paths: tuple[str, ...] = ()
    """More absolute host paths the code must not read (e.g. where the dataset with the reference
    answers is cached). The sandbox shows only the interpreter, its site-packages and ``/usr`` anyway;
    this hides paths inside those."""
    _sandbox: PythonSandbox | None = field(default=None, init=False, repr=False, compare=False)

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
    def sandbox(self) -> PythonSandbox:
        """The sandbox, started on first use."""
        if self._sandbox is None:
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
        """Start the sandbox now and say how it runs code (isolation, mode, memory bound).

        Raises:
            RuntimeError: no isolation works here and ``isolation="none"`` was not asked for.
        """
        return self.sandbox.describe()

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput(text="Error: the 'code' argument must be a string of Python code.", ok=False)
        result = await self.sandbox.arun(code)
        if result.exit_code is None and not result.timed_out:
            # The sandbox failed (could not start, crashed): not the model's code.
            return ToolOutput(text=result.stderr, ok=False, latency_s=result.latency_s,
                              infra_error=result.stderr.strip() or "the sandbox failed")
        text = result.stdout
        if not result.ok:
            text = (text + ("\n" if text and not text.endswith("\n") else "") + result.stderr).strip("\n")
        return ToolOutput(text=text, ok=result.ok, timed_out=result.timed_out, latency_s=result.latency_s)

    def step_metrics(self) -> dict[str, float]:
        """The sandbox's statistics since the last call (``sandbox/*``); empty before the first call."""
        if self._sandbox is None:
            return {}
        metrics = self._sandbox.stats().to_metrics("sandbox/")
        self._sandbox.reset_step_stats()
        return metrics

    def step_metric_reductions(self) -> dict[str, str]:
        """How :meth:`step_metrics` combine over ranks: counts add up, the largest latency is the largest;
        the latency percentiles are each rank's, averaged (``rollout/tool_latency_*`` are exact)."""
        return {"sandbox/calls": "sum", "sandbox/successes": "sum", "sandbox/errors": "sum", "sandbox/timeouts": "sum",
                "sandbox/latency_max_s": "max"}

    def close(self) -> None:
        """Stop the sandbox's interpreters."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def __getstate__(self) -> dict[str, Any]:
        # Picklable: the running sandbox stays behind and is restarted lazily.
        state = dict(self.__dict__)
        state["_sandbox"] = None
        return state
