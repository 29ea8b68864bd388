"""Run by tests/test_vllm_real.py in vLLM's interpreter: push weights to a real vLLM server (weight-transfer backend
``file``) through :class:`~trl_plugins.rollout.vllm_weights.FileVLLMClient` and measure what the engine computes.

    python tests/vllm_push.py BASE_URL MODEL_DIR SERVER_PID OUT_JSON

Writes one JSON object: the log-prob gaps between the server and the trainer's model before and after the push, and
the time and message of two pushes that fail (a stopped server, a file the server cannot read).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import requests
import torch
from transformers import AutoModelForCausalLM

from trl_plugins.rollout.vllm_server import VLLMServerError
from trl_plugins.rollout.vllm_weights import FileVLLMClient

TEMPERATURE = 0.8
PROMPT = [5, 17, 42, 99, 130, 7]
CONTINUATION = [200, 173, 106, 427, 350, 140]
"""Fixed tokens, scored by the server's prompt log-probs. vLLM computes those from the raw logits whatever the
request's temperature (gpu_model_runner._get_prompt_logprobs_dict: "prompt tokens skip sampling processors"), so they
are compared with log_softmax(logits), and the sampled tokens' processed log-probs with log_softmax(logits / T)."""


def sample(url: str, model: str) -> tuple[list[int], list[float]]:
    """8 tokens sampled at TEMPERATURE with the sampled token's processed log-prob."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": TEMPERATURE,
        "logprobs": 0,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def prompt_logprobs(url: str, model: str) -> list[float]:
    """The server's log-probs of CONTINUATION after PROMPT (prompt log-probs; asked at TEMPERATURE, which they
    ignore)."""
    body = {
        "model": model,
        "prompt": PROMPT + CONTINUATION,
        "max_tokens": 1,
        "temperature": TEMPERATURE,
        "prompt_logprobs": 0,
    }
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    rows = choice["prompt_logprobs"][len(PROMPT) :]
    return [row[str(token)]["logprob"] for row, token in zip(rows, CONTINUATION, strict=True)]


def reference(model: torch.nn.Module, tokens: list[int], temperature: float = TEMPERATURE) -> torch.Tensor:
    """The trainer's log_softmax(logits / T) of ``tokens`` after PROMPT."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def gap(server: list[float], ref: torch.Tensor) -> float:
    return float((torch.tensor(server) - ref).abs().max())


def failing_push(client: FileVLLMClient, model: torch.nn.Module) -> dict:
    start = time.monotonic()
    try:
        client.update_model_params(model)
    except VLLMServerError as err:
        return {"error": str(err), "type": type(err).__name__, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main(url: str, model_dir: str, server_pid: int, out: str) -> None:
    client = FileVLLMClient(base_url=url, connection_timeout=0, request_timeout_s=60)
    client.init_communicator(device="cpu")
    result: dict = {"backend": client.weight_transfer_backend, "weights_dir": str(client.weights_dir)}
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # the trainer's next weights: every matrix halved, the tied embedding and head included
        for p in new.parameters():
            if p.dim() > 1:
                p.mul_(0.5)

    tokens, lps = sample(url, client.model)
    fixed = prompt_logprobs(url, client.model)
    result["before"] = {
        "sampled_vs_old": gap(lps, reference(old, tokens)),
        "sampled_vs_new": gap(lps, reference(new, tokens)),
        "fixed_vs_old": gap(fixed, reference(old, CONTINUATION, 1.0)),
        "fixed_vs_new": gap(fixed, reference(new, CONTINUATION, 1.0)),
        "fixed_vs_old_at_t": gap(fixed, reference(old, CONTINUATION)),
    }

    start = time.monotonic()
    client.update_model_params(new)
    result["push_seconds"] = time.monotonic() - start
    result["files_left"] = sorted(os.listdir(client.weights_dir))
    result["paused_after"] = requests.get(f"{url}/is_paused", timeout=10).json()["is_paused"]

    tokens, lps = sample(url, client.model)
    fixed = prompt_logprobs(url, client.model)
    result["after"] = {
        "sampled_vs_new": gap(lps, reference(new, tokens)),
        "sampled_vs_old": gap(lps, reference(old, tokens)),
        "fixed_vs_new": gap(fixed, reference(new, CONTINUATION, 1.0)),
        "fixed_vs_old": gap(fixed, reference(old, CONTINUATION, 1.0)),
    }

    # a stopped server: the push's first request has no answer; it ends after request_timeout_s with one line
    client.request_timeout_s = 3.0
    os.kill(server_pid, signal.SIGSTOP)
    try:
        result["stopped"] = failing_push(client, new)
    finally:
        os.kill(server_pid, signal.SIGCONT)
    time.sleep(1.0)  # the /pause it sent meanwhile now runs

    # a file the server cannot read: /update_weights fails, the push ends with one line naming it
    client.request_timeout_s = 30.0
    client._write_weights = lambda named_params: Path(client.weights_dir) / "missing.safetensors"
    result["missing_file"] = failing_push(client, new)

    client.close_communicator()
    result["dir_removed"] = not Path(result["weights_dir"]).exists()
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
