"""Weights from the trainer to a vLLM server on the same host, through a file: the weight-transfer engine ``file``.

TRL 1.16 pushes weights to a vLLM server over vLLM's NCCL weight-transfer engine, which needs a CUDA device on both
sides. On a CPU host (or any trainer and server sharing one filesystem) the ``file`` engine does it with one file: the
trainer's rank 0 writes the full state dict as one safetensors file (under ``/dev/shm`` when the host has it, so it
stays in memory), names it in ``/update_weights``, and removes it when the server answered. Every HTTP request is
synchronous: no rendezvous, no port, no thread.

Two sides, one name (:data:`ENGINE_NAME`):

* Worker side, in each vLLM engine process: :func:`register` (the ``vllm.general_plugins`` entry point in
  pyproject.toml, which vLLM runs in every process it starts) registers :class:`FileWeightTransferEngine` with vLLM's
  ``WeightTransferEngineFactory``. The engine loads the file with ``model.load_weights`` inside vLLM's layerwise reload
  (start: ``initialize_layerwise_reload``, finish: ``finalize_layerwise_reload``, as vLLM's NCCL engine does), which
  re-runs the CPU backend's weight packing; a tied output head is re-shared with the new embedding and re-packed (the
  reload gives ``embed_tokens`` a new parameter and the head would keep the old packed copy: |log-prob error| 1.7
  without, 5e-7 with).
* Trainer side: :class:`FileVLLMClient`, TRL's ``VLLMClient`` with the transport replaced and nothing else.
  ``init_communicator`` reads the server's configuration (``/server_info``, which TRL reads too): when its
  ``weight_transfer_config.backend`` is ``file`` the client pushes through a file, otherwise it is TRL's client
  unchanged (NCCL). So it can stand wherever TRL builds its client: :func:`install` makes TRL's ``VLLMGeneration``
  build it (``trl_plugins.run.sampler.check_sampler_available`` calls it in server mode); nothing is configured, the
  server's ``--weight-transfer-config '{"backend": "file"}'`` is the switch.

Serve for it with::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port 8000 \\
        --dtype float32 --max-logprobs 5 --logprobs-mode processed_logprobs \\
        --weight-transfer-config '{"backend": "file"}'

(``trl_plugins.rollout.vllm_server.serve_command`` with ``extra=[...]``.) The server reads a path the trainer names, so
both must see the same filesystem (and the same ``/dev/shm``: one host, or one container).

vLLM is imported inside the functions: this module imports where vLLM is not installed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from trl.generation.vllm_client import VLLMClient

from trl_plugins.rollout.vllm_server import VLLMServerError

if TYPE_CHECKING:
    import torch

__all__ = ["ENGINE_NAME", "register", "FileVLLMClient", "install", "weights_directory"]

ENGINE_NAME = "file"
"""The weight-transfer backend's name, in ``--weight-transfer-config '{"backend": "file"}'``."""

PAUSE_MODE = "wait"
"""How ``/pause`` treats requests in flight: let them finish under the old weights. Every sequence is then sampled
by one set of weights and its behaviour log-probs belong to one policy. ``keep`` would freeze them and continue them
under the new weights against a KV cache the old ones computed (one sequence, two policies, stamped with the old
step); ``abort`` would throw their work away. The trainer pushes between rollouts, so there is usually nothing to
wait for."""


def register() -> None:
    """Register :class:`FileWeightTransferEngine` under :data:`ENGINE_NAME` with vLLM (the ``vllm.general_plugins``
    entry point). vLLM may run it several times in one process: a repeat is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME in WeightTransferEngineFactory._registry:
        return
    # by module path: the class (and vLLM's base classes) load when an engine is created, not at every plugin load
    WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__, "FileWeightTransferEngine")


_ENGINE_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # FileWeightTransferEngine subclasses vLLM's base class: built on first access, so that this module imports
    # without vLLM
    if name == "FileWeightTransferEngine":
        global _ENGINE_CLASS
        if _ENGINE_CLASS is None:
            _ENGINE_CLASS = _build_engine_class()
        return _ENGINE_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_engine_class() -> type:
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        """``/init_weight_transfer_engine``'s ``init_info``."""

        directory: str | None = None
        """Where the trainer writes its files (recorded for the messages; any readable path is accepted)."""

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        """``/update_weights``'s ``update_info``."""

        path: str
        """The safetensors file holding the new weights under vLLM's (HF checkpoint) names."""

    class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Loads the weights from a safetensors file the trainer wrote on this host (see the module's docstring)."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo
        supports_draft_weight_update = False
        directory: str | None = None

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            self.directory = init_info.directory

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            from safetensors.torch import load_file

            if not os.path.isfile(update_info.path):
                raise FileNotFoundError(
                    f"weight-transfer engine '{ENGINE_NAME}': no file {update_info.path} on the server's host (the "
                    f"trainer's directory: {self.directory}); trainer and server must share a filesystem"
                )
            self.model.load_weights(load_file(update_info.path, device="cpu").items())

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            _retie_output_head(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    FileWeightTransferEngine.__module__ = __name__
    FileWeightTransferEngine.__qualname__ = "FileWeightTransferEngine"
    return FileWeightTransferEngine


def _retie_output_head(model: Any, model_config: Any) -> None:
    """After a layerwise reload: share the new embedding with a tied output head and redo the head's post-load
    processing (on CPU, the packed copy its matmul reads)."""
    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return
    head.weight = embed.weight
    quant_method = getattr(head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(head)


def weights_directory() -> Path:
    """A new private directory for the trainer's weight files: under ``/dev/shm`` when this host has it (the file
    then never touches a disk), else the system's temporary directory."""
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="trl-plugins-weights-", dir=parent))


class FileVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` whose weight push goes through a file when the server's weight-transfer backend is
    :data:`ENGINE_NAME`, and is TRL's (NCCL) otherwise. Generation and every other request are TRL's, unchanged.

    Args:
        request_timeout_s: The most each request of a push may take (``/pause`` waits for the requests in flight;
            None: :attr:`answer_timeout_s`, the run's ``vllm_server_timeout``).
        *args, **kwargs: TRL's (``base_url``, ``connection_timeout``, ...).

    A push (``update_named_params``, ``update_model_params``): rank 0 writes one safetensors file of the state dict
    (without a tied output head: it is the embedding), then ``/pause`` (:data:`PAUSE_MODE`), ``/start_weight_update``,
    ``/update_weights`` with the file's path, ``/finish_weight_update``, ``/reset_prefix_cache``, ``/resume``, and
    removes the file. Each request is made once, with ``request_timeout_s``; a failure raises
    :class:`~trl_plugins.rollout.vllm_server.VLLMServerError` with one line: the server, the phase, what happened and
    what to do.
    """

    def __init__(self, *args: Any, request_timeout_s: float | None = None, **kwargs: Any) -> None:
        import requests
        import trl.generation.vllm_client as trl_client
        from requests.adapters import HTTPAdapter

        self.connection_timeout = float(kwargs.get("connection_timeout") or 0.0)  # TRL's uses it in check_server only
        # TRL's session retries refused connections and 5xx with backoff (2 s, 4 s, 8 s, ...: a killed server held a
        # turn ~60 s): every request here is made once, so that a failure ends within its deadline. Made before TRL's
        # __init__, which already asks the server for its models.
        self._once = requests.Session()
        pool = getattr(trl_client, "_DEFAULT_GENERATION_CONCURRENCY", 64)
        self._once.mount("http://", HTTPAdapter(max_retries=0, pool_maxsize=pool))
        self._once.mount("https://", HTTPAdapter(max_retries=0, pool_maxsize=pool))
        super().__init__(*args, **kwargs)
        self.request_timeout_s = self.answer_timeout_s if request_timeout_s is None else request_timeout_s
        self.weight_transfer_backend: str | None = None
        self.weights_dir: Path | None = None
        self._pushes = 0

    @property
    def uses_file_transport(self) -> bool:
        """Whether pushes go through a file (the server's backend is :data:`ENGINE_NAME`; known after
        ``init_communicator``)."""
        return self.weight_transfer_backend == ENGINE_NAME

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Read the server's weight-transfer backend; ``file``: initialise its engine (no rendezvous, any device),
        otherwise TRL's NCCL group."""
        config = self.get_server_info().get("weight_transfer_config") or {}
        self.weight_transfer_backend = config.get("backend")
        if not self.uses_file_transport:
            return super().init_communicator(device)
        self.weights_dir = weights_directory()
        self._call("/init_weight_transfer_engine", json={"init_info": {"directory": str(self.weights_dir)}})
        atexit.register(self.close_communicator)

    def _start_weight_update(self) -> None:
        if not self.uses_file_transport:
            return super()._start_weight_update()
        self._call("/pause", params={"mode": PAUSE_MODE})
        self._call("/start_weight_update", json={})

    def _finish_weight_update(self) -> None:
        if not self.uses_file_transport:
            return super()._finish_weight_update()
        self._call("/finish_weight_update", json={})
        self._call("/reset_prefix_cache")
        self._call("/resume")

    def update_named_params(
        self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """Push ``named_params`` (TRL's signature; ``metadata`` is not needed by a file)."""
        if not self.uses_file_transport:
            return super().update_named_params(metadata, named_params)
        if self.weights_dir is None:
            raise RuntimeError("FileVLLMClient: update_named_params before init_communicator")
        path = self._write_weights(named_params)
        try:
            if not self._updating_weights:  # inside weight_update(), its entry and exit pause and resume
                self._start_weight_update()
            self._call("/update_weights", json={"update_info": {"path": str(path)}})
            if not self._updating_weights:
                self._finish_weight_update()
        finally:
            path.unlink(missing_ok=True)

    def reset_prefix_cache(self) -> None:
        if not self.uses_file_transport:
            return super().reset_prefix_cache()
        self._call("/reset_prefix_cache")

    def close_communicator(self) -> None:
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.weights_dir = None
        super().close_communicator()

    def _write_weights(self, named_params: Iterator[tuple[str, torch.Tensor]]) -> Path:
        """One safetensors file of ``named_params`` (copied to the CPU, as they come: a ZeRO-3 gather frees each after
        its turn), without ``lm_head.weight`` when it equals the embedding (a tied head arrives with it)."""
        import torch
        from safetensors.torch import save_file

        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_params}
        embed = tensors.get("model.embed_tokens.weight")
        head = tensors.get("lm_head.weight")
        if head is not None and embed is not None and torch.equal(head, embed):
            del tensors["lm_head.weight"]
        self._pushes += 1
        path = self.weights_dir / f"weights-{self._pushes}.safetensors"
        save_file(tensors, str(path))
        return path

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """TRL's (``/health`` until ``total_timeout``: the run's ``vllm_server_timeout``), with a deadline on each
        request (TRL's has none: a stopped server held the run forever) and a one-line :class:`VLLMServerError` that
        names the command that starts a server."""
        import requests

        deadline = time.monotonic() + total_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self._once.get(f"{self.base_url}/health", timeout=max(1.0, min(10.0, remaining)))
                if response.status_code == 200:
                    if "X-Forwarded-For" in response.headers:
                        self.host = response.headers["X-Forwarded-For"]
                    return
                seen = f"HTTP {response.status_code}"
            except requests.Timeout:
                seen = "no answer (stopped or overloaded?)"
            except requests.ConnectionError as err:
                seen = "connection refused" if "refused" in str(err) else f"cannot connect ({_one_line(err, 120)})"
            if time.monotonic() + retry_interval > deadline:
                raise VLLMServerError(
                    f"the vLLM server at {self.base_url}, start-up: not up within {total_timeout:g} s "
                    f"(vllm_server_timeout; last: {seen}); start it first, with vLLM's interpreter: python -m "
                    "trl_plugins.rollout.vllm_server MODEL --port PORT, or point vllm_server_base_url at a running one"
                )
            time.sleep(retry_interval)

    @property
    def answer_timeout_s(self) -> float:
        """The most any other request (a turn's completion) waits for its answer: ``connection_timeout`` (TRL's
        VLLMGeneration and the project pass ``vllm_server_timeout``, 240 s by default), or 240 s where it is 0."""
        return self.connection_timeout or 240.0

    def get_server_info(self) -> dict:
        """TRL's, with a deadline (:attr:`answer_timeout_s`) and a one-line error."""
        return self._request("get", f"{self.base_url}/server_info", params={"config_format": "json"})["vllm_config"]

    def _get(self, url: str, **kwargs: Any) -> dict:
        """TRL's, with a deadline (:attr:`answer_timeout_s`) and a one-line error."""
        return self._request("get", url, **kwargs)

    def _post(self, url: str, **kwargs: Any) -> dict:
        """TRL's, with a deadline: a request TRL sends without a timeout (a turn's completion) waits
        :attr:`answer_timeout_s` at most, so that a server that stops answering ends the rollout instead of holding
        it forever; a failure is one line (:class:`VLLMServerError`)."""
        return self._request("post", url, **kwargs)

    def _request(self, method: str, url: str, **kwargs: Any) -> dict:
        import requests

        kwargs.setdefault("timeout", self.answer_timeout_s)
        endpoint = url.removeprefix(self.base_url)
        phase = "rollout" if endpoint.startswith(("/v1/completions", "/inference")) else "request"
        where = f"the vLLM server at {self.base_url}, {phase}, {endpoint}"
        try:
            response = getattr(self._once, method)(url, **kwargs)
        except requests.Timeout:
            raise VLLMServerError(
                f"{where}: no answer within {kwargs['timeout']:g} s; is the server stopped or overloaded? Restart it "
                "and resume the run from its last checkpoint, or raise vllm_server_timeout if its turns take longer"
            ) from None
        except requests.ConnectionError as err:
            raise VLLMServerError(
                f"{where}: cannot connect ({_one_line(err)}); start the server again and resume the run from its last "
                "checkpoint"
            ) from None
        if response.status_code == 404 and endpoint.startswith("/server_info"):
            raise VLLMServerError(
                f"{where}: HTTP 404, the server does not expose its development endpoints (the weight push uses "
                "them); restart it with VLLM_SERVER_DEV_MODE=1 in its environment"
            )
        if response.status_code != 200:
            raise VLLMServerError(f"{where}: HTTP {response.status_code} {_one_line(response.text)}")
        return response.json()

    def _call(self, endpoint: str, **kwargs: Any) -> None:
        """POST ``endpoint`` once with ``request_timeout_s``; any failure is one line (:class:`VLLMServerError`)."""
        import requests

        where = f"the vLLM server at {self.base_url}, weight push, phase {endpoint}"
        try:
            response = self._once.post(f"{self.base_url}{endpoint}", timeout=self.request_timeout_s, **kwargs)
        except requests.Timeout:
            raise VLLMServerError(
                f"{where}: no answer within {self.request_timeout_s:g} s; is the server stopped or overloaded? "
                "(/pause waits for the requests in flight: raise vllm_server_timeout if they are long)"
            ) from None
        except requests.ConnectionError as err:
            raise VLLMServerError(
                f"{where}: cannot connect ({_one_line(err)}); start the server again and restart the run"
            ) from None
        if response.status_code != 200:
            raise VLLMServerError(
                f"{where}: HTTP {response.status_code} {_one_line(response.text)}; the server is left paused with "
                "its weights part-updated: read its log, check that it shares this host's filesystem "
                f"({self.weights_dir}), and restart it"
            )


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def install() -> None:
    """Make TRL's ``VLLMGeneration`` build :class:`FileVLLMClient` for its server-mode client, and the project's other
    ranks theirs (its NCCL behaviour is TRL's when the server's backend is not ``file``; every request has a
    deadline). Leaves a stand-in that someone else installed in place (the
    tests' fake client). Idempotent."""
    import trl.generation.vllm_client as trl_client
    import trl.generation.vllm_generation as trl_generation

    if trl_generation.VLLMClient is VLLMClient:
        trl_generation.VLLMClient = FileVLLMClient
    if trl_client.VLLMClient is VLLMClient:  # the clients of the other ranks (run/sampler.py's make_backend)
        trl_client.VLLMClient = FileVLLMClient
