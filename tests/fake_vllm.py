"""A CPU stand-in for vLLM, for testing the vLLM wiring where vLLM cannot be installed.

It implements what TRL 1.16's ``VLLMGeneration`` and ``VLLMClient`` and our ``VLLMBackend`` use, and nothing
more: token-id prompts with per-request ``SamplingParams`` (seed, stop tokens, budgets), sampled ids with their
log-probs, weight loading by parameter name, sleep/wake, prefix-cache reset, and a server reached over HTTP
that receives weight updates. Generation runs on a copy of the model loaded from ``model.name_or_path`` with
HF generate, so its weights are exactly what the trainer pushed: a missed weight sync shows as stale (or,
after a level-2 sleep, NaN) weights. ``logprob_shift`` adds a known offset to every returned log-prob (a
synthetic sampler/trainer mismatch).

:func:`install` patches TRL's own names (``trl.trainer.grpo_trainer.VLLMGeneration``,
``trl.generation.vllm_generation.SamplingParams``, ``trl.generation.vllm_client.VLLMClient``), so the trainer
builds and syncs vLLM through TRL's real code paths (argument mapping, ZeRO-3 gathering, PEFT merging), with
only the engine and the transport faked.
"""

from __future__ import annotations

import io
import json
import math
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch

__all__ = ["SamplingParams", "FakeLLM", "FakeVLLMServer", "FakeVLLMClient", "install", "generation_class"]


@dataclass
class SamplingParams:
    """The fields of ``vllm.SamplingParams`` the rollout uses."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


class _Engine:
    """HF generate on a float32 copy of the model; one request at a time."""

    def __init__(self, model_path: str, *, logprob_shift: float = 0.0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.integrations import deepspeed as hf_deepspeed

        # vLLM holds a whole copy: load it unpartitioned even inside a ZeRO-3 run.
        zero3, hf_deepspeed._hf_deepspeed_config_weak_ref = hf_deepspeed._hf_deepspeed_config_weak_ref, None
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        finally:
            hf_deepspeed._hf_deepspeed_config_weak_ref = zero3
        self.pad_token_id = AutoTokenizer.from_pretrained(model_path).pad_token_id or 0
        self.logprob_shift = logprob_shift
        self.lock = threading.Lock()
        self.weight_loads = 0
        self.requests = 0

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad(), self.lock:
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"fake vLLM: no parameter {name!r} to load (names: {sorted(params)[:4]}...)")
                params[name].copy_(tensor.detach().to(params[name].dtype))
        self.weight_loads += 1

    def discard_weights(self) -> None:
        with torch.no_grad(), self.lock:
            for p in self.model.parameters():
                p.fill_(math.nan)

    def sample(self, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], list[float]]:
        from trl_plugins.rollout.backends import HFGenerationBackend
        from trl_plugins.types import SamplingSettings

        if params.n != 1 or not params.ignore_eos or not params.stop_token_ids or params.logprobs != 0:
            raise ValueError(f"fake vLLM: unexpected sampling params {params}")
        backend = HFGenerationBackend(
            self.model,
            pad_token_id=self.pad_token_id,
            stop_token_ids=params.stop_token_ids,
            sampling=SamplingSettings(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty,
            ),
        )
        with self.lock:
            self.requests += 1
            out = backend.generate([list(prompt)], [params.max_tokens], seeds=[params.seed or 0])[0]
        return out.token_ids, [lp + self.logprob_shift for lp in out.logprobs]


class FakeLLM:
    """``vllm.LLM`` as TRL uses it in colocate mode."""

    def __init__(self, model_path: str, *, logprob_shift: float = 0.0) -> None:
        self.engine = _Engine(model_path, logprob_shift=logprob_shift)
        runner = SimpleNamespace(
            model=self.engine
        )  # TRL: llm.llm_engine.model_executor.driver_worker.model_runner.model
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        )
        self.asleep: set[str] = set()
        self.log: list[str] = []

    def generate(self, prompts: list[dict], sampling_params: Any, use_tqdm: bool = False) -> list[Any]:
        if self.asleep:
            raise RuntimeError(f"fake vLLM: generate while asleep ({sorted(self.asleep)})")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.log.append(f"generate:{len(prompts)}")
        outs = []
        for prompt, sp in zip(prompts, params):
            ids, lps = self.engine.sample(prompt["prompt_token_ids"], sp)
            logprobs = [{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, lps)]
            outs.append(
                SimpleNamespace(
                    prompt_token_ids=prompt["prompt_token_ids"],
                    outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)],
                )
            )
        return outs

    def sleep(self, level: int = 1) -> None:
        self.log.append(f"sleep:{level}")
        self.asleep = {"weights", "kv_cache"}
        if level == 2:
            self.engine.discard_weights()  # level 2 throws the weights away: they must be pushed again

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.log.append(f"wake:{','.join(tags or ['all'])}")
        self.asleep -= set(tags or ["weights", "kv_cache"])

    def reset_prefix_cache(self) -> None:
        self.log.append("reset_prefix_cache")


class FakeVLLMServer:
    """A vLLM server stand-in over HTTP on 127.0.0.1: ``/health``, ``/v1/models``, ``/server_info``,
    ``/v1/completions`` (token ids), ``/update_weights`` (a ``torch.save``'d dict) and ``/reset_prefix_cache``."""

    def __init__(
        self, model_path: str, *, port: int = 0, logprob_shift: float = 0.0, logprobs_mode: str = "processed_logprobs"
    ) -> None:
        self.engine = _Engine(model_path, logprob_shift=logprob_shift)
        self.model_path, self.logprobs_mode = model_path, logprobs_mode
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, payload: Any) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    return self._reply({})
                if self.path == "/v1/models":
                    return self._reply({"data": [{"id": server.model_path}]})
                if self.path.startswith("/server_info"):
                    return self._reply(
                        {
                            "vllm_config": {
                                "model_config": {
                                    "model": server.model_path,
                                    "logprobs_mode": server.logprobs_mode,
                                    "max_logprobs": 5,
                                },
                                "weight_transfer_config": {"backend": "fake"},
                            }
                        }
                    )
                if self.path == "/stats":
                    return self._reply({"weight_loads": server.engine.weight_loads, "requests": server.engine.requests})
                self.send_error(404)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/completions":
                    req = json.loads(body)
                    params = SamplingParams(
                        **{k: v for k, v in req.items() if k in SamplingParams.__dataclass_fields__}
                    )
                    choices = []
                    for prompt in req["prompt"]:
                        ids, lps = server.engine.sample(prompt, params)
                        choices.append({"prompt_token_ids": prompt, "token_ids": ids, "logprobs": lps})
                    return self._reply({"choices": choices})
                if self.path == "/update_weights":
                    server.engine.load_weights(torch.load(io.BytesIO(body), weights_only=True).items())
                    return self._reply({})
                if self.path == "/reset_prefix_cache":
                    return self._reply({})
                self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeVLLMServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeVLLMClient:
    """``trl.generation.vllm_client.VLLMClient`` as the trainer uses it, against :class:`FakeVLLMServer`."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
    ) -> None:
        import requests

        self.base_url = base_url or f"http://{host}:{server_port}"
        self.session = requests.Session()
        self.communicator = None
        self.session.get(f"{self.base_url}/health", timeout=max(connection_timeout, 5.0)).raise_for_status()
        self.model = self.session.get(f"{self.base_url}/v1/models").json()["data"][0]["id"]

    def get_server_info(self) -> dict:
        return self.session.get(f"{self.base_url}/server_info").json()["vllm_config"]

    def init_communicator(self, device: Any = 0) -> None:
        self.communicator = "fake"

    def generate(
        self,
        prompts: list[list[int]],
        features: Any = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
    ) -> dict:
        payload = {
            "prompt": prompts,
            "n": n,
            "repetition_penalty": repetition_penalty,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            **(generation_kwargs or {}),
        }
        response = self.session.post(f"{self.base_url}/v1/completions", json=payload)
        response.raise_for_status()
        choices = response.json()["choices"]
        return {
            "prompt_ids": [c["prompt_token_ids"] for c in choices],
            "completion_ids": [c["token_ids"] for c in choices],
            "logprobs": [[[lp] for lp in c["logprobs"]] for c in choices],
            "logprob_token_ids": None,
        }

    def update_named_params(self, metadata: list, named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.communicator is None:
            raise RuntimeError("fake vLLM client: update_named_params before init_communicator")
        buf = io.BytesIO()
        torch.save({name: t.detach().cpu().clone() for name, t in named_params}, buf)
        self.session.post(f"{self.base_url}/update_weights", data=buf.getvalue()).raise_for_status()

    def reset_prefix_cache(self) -> None:
        self.session.post(f"{self.base_url}/reset_prefix_cache").raise_for_status()

    def stats(self) -> dict:
        return self.session.get(f"{self.base_url}/stats").json()


def generation_class(*, logprob_shift: float = 0.0) -> type:
    """TRL's ``VLLMGeneration`` with only ``_init_vllm`` replaced: a :class:`FakeLLM` (colocate) or a
    :class:`FakeVLLMClient` (server, main process), as TRL builds the real ones."""
    from trl.generation.vllm_generation import VLLMGeneration

    class FakeVLLMGeneration(VLLMGeneration):
        def _init_vllm(self) -> None:
            if self.mode == "server":
                if self.accelerator.is_main_process:
                    base = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = FakeVLLMClient(
                        base_url=base, group_port=self.group_port, connection_timeout=self.server_timeout
                    )
                    self.vllm_client.init_communicator(device=self.accelerator.device)
            elif self.mode == "colocate":
                self.llm = FakeLLM(self.model.name_or_path, logprob_shift=logprob_shift)
                if self.enable_sleep_mode:
                    self.llm.sleep(level=2)
                self._llm_weights_sleeping = self.enable_sleep_mode
            else:
                raise ValueError(f"vllm_mode must be either 'server' or 'colocate', got '{self.mode}'.")
            self.accelerator.wait_for_everyone()

    return FakeVLLMGeneration


def install(*, logprob_shift: float = 0.0) -> None:
    """Patch TRL's vLLM names with the fakes (for this process; tests run it in their subprocesses)."""
    import trl.generation.vllm_client as trl_client
    import trl.generation.vllm_generation as trl_generation
    import trl.trainer.grpo_trainer as trl_grpo

    trl_grpo.VLLMGeneration = generation_class(logprob_shift=logprob_shift)
    trl_generation.SamplingParams = SamplingParams
    trl_client.VLLMClient = FakeVLLMClient
