"""Python code interpreter for tool-calling RL: runs model-written code isolated, limited and stateless.

The code comes from a policy optimised for reward, so it is treated as hostile: it may loop, sleep,
allocate without bound, fork-bomb, flood its output, read secrets, open sockets, write outside its
directory, leave daemons behind or try to kill its supervisor. Every call runs like a notebook cell in
a fresh process that nothing from another call can reach, under the strongest :class:`Isolation`
that works here (bubblewrap, else ``unshare`` namespaces; rlimits only when asked for explicitly; see
:func:`detect_isolation`), with a per-call memory and process budget (a cgroup where the machine
allows one), CPU, file-size and open-file limits, a seccomp filter, captured output (the tail is
kept) and a kill of everything the call started.

    with PythonSandbox(timeout_s=5.0, mode="warm") as sandbox:
        result = sandbox.run("import sympy\\nsympy.factorint(2**32 + 1)")
        result.stdout  # "{641: 1, 6700417: 1}\\n"

docs/sandbox.md describes the design: the threat model (what each isolation mode does and does not
contain), cold and warm modes, the runner, the limits, and why it is built this way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import signal
import threading
import time
import weakref
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from trl_plugins.tools.sandbox import launcher, probing
from trl_plugins.tools.sandbox.launcher import (
    MAX_OPEN_FILES,
    MAX_PROCESSES,
    OUTPUT_FILE_LIMIT_BYTES,
    SANDBOX_UID,
    Isolation,
    Launcher,
    Limits,
    run_cold,
)
from trl_plugins.tools.sandbox.pool import ServerDied, WarmPool, WarmServer
from trl_plugins.tools.sandbox.probing import detect_isolation

__all__ = [
    "ExecResult",
    "Isolation",
    "MAX_OPEN_FILES",
    "MAX_PROCESSES",
    "OUTPUT_FILE_LIMIT_BYTES",
    "PythonSandbox",
    "SANDBOX_UID",
    "SandboxStats",
    "detect_isolation",
]

logger = logging.getLogger(__name__)


@dataclass
class ExecResult:
    """Outcome of one sandboxed call."""

    ok: bool
    """The code exited with status 0 within the time limit."""
    stdout: str
    """Captured stdout (the tail, at most ``max_output_chars``; undecodable bytes replaced)."""
    stderr: str
    """Captured stderr: the traceback on an error, plus a final line on a timeout or a signal death."""
    exit_code: int | None
    """Exit status; negative = killed by that signal (as in ``subprocess``); None = sandbox failure."""
    timed_out: bool
    """The wall-clock limit was hit and the process tree was killed."""
    latency_s: float
    """Wall time of the call, from the start of the sandbox's work to the result (queueing excluded)."""
    output_truncated: bool = False
    """stdout or stderr was longer than ``max_output_chars`` and only its tail is kept."""
    isolation: str = ""
    """The :class:`Isolation` the call ran under."""
    mode: str = ""
    """``"cold"`` or ``"warm"``."""


@dataclass(frozen=True)
class SandboxStats:
    """Counts and latency percentiles over a set of calls (``calls == successes + errors + timeouts``)."""

    calls: int
    """Number of calls."""
    successes: int
    """Calls with ``ok=True``."""
    errors: int
    """Calls that failed without timing out (exceptions, non-zero exits, signals, sandbox failures)."""
    timeouts: int
    """Calls killed by the wall-clock limit."""
    latency_p50_s: float
    """Median latency in seconds (0.0 when there were no calls)."""
    latency_p90_s: float
    """90th percentile latency in seconds."""
    latency_p99_s: float
    """99th percentile latency in seconds."""
    latency_max_s: float
    """Largest latency in seconds."""

    def to_metrics(self, prefix: str = "sandbox/") -> dict[str, float]:
        """The stats as a flat ``{prefix + field: value}`` dict for a metrics logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _StatsAccumulator:
    def __init__(self) -> None:
        self.calls = self.successes = self.timeouts = 0
        self.latencies = array("d")

    def add(self, result: ExecResult) -> None:
        self.calls += 1
        self.successes += result.ok
        self.timeouts += result.timed_out
        self.latencies.append(result.latency_s)

    def snapshot(self) -> SandboxStats:
        lat = sorted(self.latencies)
        return SandboxStats(
            calls=self.calls,
            successes=self.successes,
            errors=self.calls - self.successes - self.timeouts,
            timeouts=self.timeouts,
            latency_p50_s=_percentile(lat, 0.50),
            latency_p90_s=_percentile(lat, 0.90),
            latency_p99_s=_percentile(lat, 0.99),
            latency_max_s=lat[-1] if lat else 0.0,
        )


class CallStats:
    """Thread-safe counts of a sandbox's calls: since the last :meth:`reset_step` and since construction, plus the
    resends of calls that never started (a remote sandbox's). What :class:`PythonSandbox` and the remote client
    report through ``stats()``, ``total_stats()`` and ``reset_step_stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step, self._total = _StatsAccumulator(), _StatsAccumulator()
        self.retries = self._step_retries = 0

    def add(self, result: ExecResult) -> None:
        with self._lock:
            self._step.add(result)
            self._total.add(result)

    def add_retry(self) -> None:
        with self._lock:
            self.retries += 1
            self._step_retries += 1

    def step(self) -> SandboxStats:
        with self._lock:
            return self._step.snapshot()

    def total(self) -> SandboxStats:
        with self._lock:
            return self._total.snapshot()

    def step_retries(self) -> int:
        with self._lock:
            return self._step_retries

    def reset_step(self) -> None:
        with self._lock:
            self._step = _StatsAccumulator()
            self._step_retries = 0


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _status_line(timeout_s: float, exit_code: int | None, timed_out: bool, memory_mb: int, oom_killed: bool) -> str:
    if timed_out:
        return f"TimeoutError: execution exceeded {timeout_s} s wall-clock limit and was killed"
    if oom_killed and exit_code is not None and exit_code != 0:
        return (
            f"MemoryError: the call's processes together exceeded the memory limit of {memory_mb} MB "
            f"(shared memory and files in /tmp included) and were killed"
        )
    if exit_code is not None and exit_code < 0:
        sig = -exit_code
        hint = {
            signal.SIGXCPU: "CPU time limit exceeded",
            signal.SIGSEGV: f"crashed; often an allocation failure under the {memory_mb} MB memory limit",
            signal.SIGABRT: f"aborted; often an allocation failure under the {memory_mb} MB memory limit",
            signal.SIGKILL: "killed",
            signal.SIGXFSZ: f"file size limit of {OUTPUT_FILE_LIMIT_BYTES >> 20} MB exceeded",
        }.get(sig, "killed")
        return f"ProcessKilled: the process was terminated by {_signal_name(sig)} ({hint})"
    return ""


def _with_status(stderr: str, line: str) -> str:
    if not line:
        return stderr
    return stderr + ("" if not stderr or stderr.endswith("\n") else "\n") + line + "\n"


def _check_number(name: str, value, minimum: float, integer: bool, hint: str) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} >= {minimum:g}, got {value!r}; {hint}")


class PythonSandbox:
    """Runs model-written Python like a notebook cell, isolated from the host and from other calls.

    Args:
        timeout_s: wall-clock limit per call in seconds (counted from when the code starts); the
            process tree is SIGKILLed at the limit, and the call returns by ``timeout_s + KILL_GRACE_S``
            (3 s) whatever its processes do. ``RLIMIT_CPU`` is set to ``ceil(timeout_s) + 1``.
        memory_mb: address space the code may map on top of what is loaded when it starts (the bare
            interpreter in cold mode; interpreter plus ``warm_imports`` in warm mode).
        max_output_chars: how many characters of stdout and of stderr (each) are kept; longer
            output keeps its tail after a marker line.
        max_concurrency: most calls running at once (and most warm servers).
        mode: ``"cold"`` (a fresh interpreter per call) or ``"warm"`` (pre-started servers that fork
            per call).
        isolation: ``"auto"`` (the strongest namespaced isolation that works, see
            :func:`detect_isolation`; it never picks ``"none"``) or an :class:`Isolation` / its string
            value, which must work here. ``"none"`` runs code without isolation and must be asked for.
        warm_imports: modules each warm server imports before forking (ignored in cold mode).
        disk_mb: size of each private tmpfs (scratch directory, ``/tmp``, ``/dev/shm``).
        extra_hidden_paths: more host paths to hide from the code (e.g. data directories with
            credentials) in bwrap/unshare modes.

    Raises:
        ValueError: an argument is out of range or of the wrong type.
        RuntimeError: the requested isolation does not work on this machine, or ``"auto"`` finds
            neither bwrap nor unshare working (the message says why and how to get it).
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 8000,
        max_concurrency: int = 8,
        mode: str = "cold",
        isolation: str | Isolation = "auto",
        warm_imports: Iterable[str] = ("math", "fractions", "itertools", "numpy", "sympy"),
        disk_mb: int = 64,
        extra_hidden_paths: Sequence[str] = (),
    ) -> None:
        _check_number("timeout_s", timeout_s, 0.01, False, "it is the wall-clock limit of one call in seconds")
        _check_number("memory_mb", memory_mb, 32, True, "it is the address space (MB) the code may use")
        _check_number(
            "max_output_chars",
            max_output_chars,
            256,
            True,
            "it bounds how much of stdout/stderr is returned (the tail is kept)",
        )
        _check_number("max_concurrency", max_concurrency, 1, True, "it is how many calls may run at once")
        _check_number("disk_mb", disk_mb, 1, True, "it is the size of the private scratch tmpfs in MB")
        if mode not in ("cold", "warm"):
            raise ValueError(
                f"mode must be 'cold' (fresh interpreter per call) or 'warm' (pre-started "
                f"servers that fork per call), got {mode!r}"
            )
        if isinstance(warm_imports, str) or not isinstance(warm_imports, Iterable):
            raise ValueError(
                f"warm_imports must be a sequence of module names such as ('numpy', 'sympy'), got {warm_imports!r}"
            )
        warm_imports = tuple(warm_imports)
        bad = [m for m in warm_imports if not isinstance(m, str) or not all(p.isidentifier() for p in m.split("."))]
        if bad:
            raise ValueError(f"warm_imports contains invalid module names {bad}; use dotted names like 'numpy.linalg'")
        if isinstance(extra_hidden_paths, str) or not all(
            isinstance(p, str) and p.startswith("/") for p in extra_hidden_paths
        ):
            raise ValueError(f"extra_hidden_paths must be a sequence of absolute paths, got {extra_hidden_paths!r}")
        self.isolation, program = self._resolve_isolation(isolation)
        self.mode = mode
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.max_concurrency = max_concurrency
        self.warm_imports = warm_imports
        self._limits = Limits(self.timeout_s, memory_mb, max_output_chars, disk_mb)
        self._launcher = Launcher.create(self.isolation, tuple(extra_hidden_paths), program)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._stats = CallStats()
        self._closed = False
        self._pool = WarmPool(self._launcher, self._limits, warm_imports, max_concurrency) if mode == "warm" else None
        self._finalizer = weakref.finalize(self, self._pool.close) if self._pool is not None else None
        probing.log_isolation_once(self.isolation, mode)

    @staticmethod
    def _resolve_isolation(isolation: str | Isolation) -> tuple[Isolation, str | None]:
        # The program (bwrap/unshare) is resolved once, to an absolute path, and that path is both
        # probed and launched.
        if isolation == "auto":
            resolved = detect_isolation()
            return resolved, launcher.resolve_program(resolved)
        try:
            resolved = Isolation(isolation)
        except ValueError:
            choices = ", ".join(repr(i.value) for i in Isolation)
            raise ValueError(f"isolation must be 'auto' or one of {choices}, got {isolation!r}") from None
        program = launcher.resolve_program(resolved)
        reason = probing.probe(resolved, program)
        if reason is not None:
            raise RuntimeError(
                f"isolation {resolved.value!r} does not work on this machine: {reason}. "
                f"Use isolation='auto' to take the strongest that does."
            )
        return resolved, program

    def run(self, code: str) -> ExecResult:
        """Run ``code`` in a fresh sandboxed process and wait for it.

        The value of a trailing expression is printed (its ``repr``) unless it is None. Nothing the
        code does survives the call. Blocks while ``max_concurrency`` calls are already running.

        Returns:
            An :class:`ExecResult`; model errors, timeouts and signal deaths are reported in it,
            never raised. A warm server that dies mid-call gives ``exit_code=None`` and is replaced.

        Raises:
            TypeError: ``code`` is not a string.
            RuntimeError: the sandbox is closed, or a warm server cannot be started at all.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if self._closed:
            raise RuntimeError("the sandbox is closed; create a new PythonSandbox")
        with self._slots:
            t0 = time.perf_counter()
            raw = self._run_warm(code) if self._pool is not None else run_cold(self._launcher, self._limits, code)
            result = self._to_result(raw, time.perf_counter() - t0)
        self._stats.add(result)
        return result

    async def arun(self, code: str) -> ExecResult:
        """Async :meth:`run`: runs in one of ``max_concurrency`` worker threads, so calls overlap.

        Cancelling the awaiting task does not stop a call already running; it ends at its timeout.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._get_executor(), self.run, code)

    def warm_up(self, n: int | None = None) -> None:
        """Start up to ``n`` (default ``max_concurrency``) warm servers now instead of on first use.

        No-op in cold mode.

        Raises:
            RuntimeError: a server cannot be started.
        """
        if self._pool is None:
            return
        n = self.max_concurrency if n is None else max(0, min(n, self.max_concurrency))
        held = 0
        servers: list[WarmServer] = []
        try:
            for _ in range(n):  # hold the slots, so that no call can need a server meanwhile
                self._slots.acquire()
                held += 1
            # A private executor: the shared one may be busy with calls that wait for our slots.
            with concurrent.futures.ThreadPoolExecutor(max(1, n), thread_name_prefix="sandbox-warmup") as starter:
                futures = [starter.submit(self._pool.acquire) for _ in range(n)]
                for future in concurrent.futures.as_completed(futures):
                    try:
                        servers.append(future.result())
                    except BaseException:
                        pass
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                raise errors[0]
        finally:
            for server in servers:
                self._pool.release(server, healthy=True)
            for _ in range(held):
                self._slots.release()

    def stats(self) -> SandboxStats:
        """Statistics of the calls since the last :meth:`reset_step_stats` (or construction)."""
        return self._stats.step()

    def total_stats(self) -> SandboxStats:
        """Statistics of every call since construction (not affected by :meth:`reset_step_stats`)."""
        return self._stats.total()

    def reset_step_stats(self) -> None:
        """Start a new step: :meth:`stats` counts from here on; totals keep accumulating."""
        self._stats.reset_step()

    def close(self) -> None:
        """Stop the warm servers and worker threads. Further calls raise RuntimeError. Idempotent."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line on how calls run: isolation, mode and what bounds their memory."""
        if self._launcher.cgroups is not None:
            memory = f"{self.memory_mb} MB per call, all its processes and shared memory (cgroup)"
        else:
            memory = (
                f"{self.memory_mb} MB per process (RLIMIT_AS; no cgroup here: memfd and System V shared memory refused)"
            )
        return f"sandbox isolation={self.isolation.value}, mode={self.mode}, memory {memory}"

    def __repr__(self) -> str:
        return (
            f"PythonSandbox(mode={self.mode!r}, isolation={self.isolation.value!r}, timeout_s={self.timeout_s}, "
            f"memory_mb={self.memory_mb}, max_concurrency={self.max_concurrency})"
        )

    def _get_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._closed:
                raise RuntimeError("the sandbox is closed; create a new PythonSandbox")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.max_concurrency, thread_name_prefix="sandbox"
                )
            return self._executor

    def _run_warm(self, code: str) -> dict:
        server = self._pool.acquire()
        try:
            raw = server.call(code, self.timeout_s)  # a server that overran its call is killed there (server.lost)
        except ServerDied as e:
            self._pool.release(server, healthy=False)
            return {"error": f"the sandbox server died during this call ({e}); a fresh one will serve the next call"}
        self._pool.release(server, healthy=True)
        return raw

    def _to_result(self, raw: dict, latency_s: float) -> ExecResult:
        common = {"latency_s": latency_s, "isolation": self.isolation.value, "mode": self.mode}
        if raw.get("error"):
            logger.error("sandbox: call failed inside the sandbox machinery: %s", raw["error"])
            return ExecResult(
                ok=False, stdout="", stderr=f"SandboxError: {raw['error']}\n", exit_code=None, timed_out=False, **common
            )
        exit_code, timed_out = raw["exit_code"], raw["timed_out"]
        line = _status_line(self.timeout_s, exit_code, timed_out, self.memory_mb, raw.get("oom_killed", False))
        return ExecResult(
            ok=exit_code == 0 and not timed_out,
            stdout=raw["stdout"],
            stderr=_with_status(raw["stderr"], line),
            exit_code=exit_code,
            timed_out=timed_out,
            output_truncated=raw["truncated"],
            **common,
        )
