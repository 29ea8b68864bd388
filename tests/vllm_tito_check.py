"""What the fake vLLM cannot hide, checked against a real vLLM server (run in vLLM's interpreter, .venv-vllm, by
tests/test_vllm_real.py): the project's server backend (TRL's real ``VLLMClient``, one request per turn) is token in,
token out, and the behaviour log-probs it records are the trainer's own ``log_softmax(logits / T)`` at the tokens it
trains, on the same weights.

For each case the trainer's forward (HF, float32) runs over the whole token sequence the rollout would train: a
wrong id anywhere (a re-tokenised prompt, a dropped stop token, a shifted tool message) moves every log-prob after it.
Cases: two turns around a tool message (tokens the engine never sampled), at temperature 1 and 0.7; a stop token
(half the vocabulary made stop tokens, so one is sampled within a few tokens: kept as the last id, its log-prob
recorded); a cut at ``max_tokens`` (no stop token: exactly the budget, unfinished).

Prints one JSON object: per case the largest and mean |log p_vllm - log p_trainer| per action token, and the facts.
"""

from __future__ import annotations

import argparse
import json

import torch

from trl_plugins.rollout import ChatFormat
from trl_plugins.rollout.backends import VLLMBackend
from trl_plugins.types import SamplingSettings


def trainer_logprobs(model, ids: list[int], temperature: float) -> list[float]:
    """``log_softmax(logits / T)`` of each token of ``ids`` after the first, by the trainer's forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def gap(model, prompt: list[int], turns: list[tuple[int, list[int], list[float]]], temperature: float) -> dict:
    """``turns``: (start position, sampled ids, their vLLM log-probs) in the full sequence ``prompt``."""
    want = trainer_logprobs(model, prompt, temperature)
    diffs = []
    for start, ids, lps in turns:
        assert prompt[start : start + len(ids)] == ids, "the sampled ids are not where the rollout put them"
        diffs += [abs(lp - want[start + i - 1]) for i, lp in enumerate(lps)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "tokens": len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.generation.vllm_client import VLLMClient

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    chat = ChatFormat(tok, [CodeInterpreter().schema()])
    client = VLLMClient(base_url=args.url, connection_timeout=60)
    server = type("Gen", (), {"mode": "server", "vllm_client": None})()

    def backend(temperature: float, stop_ids: list[int]) -> VLLMBackend:
        return VLLMBackend(
            server, stop_token_ids=stop_ids, sampling=SamplingSettings(temperature=temperature), client=client
        )

    prompt = chat.initial_prompt_ids([{"role": "user", "content": "What is 17 * 3? Use the tool."}])
    report: dict = {}
    for temperature in (1.0, 0.7):
        be = backend(temperature, chat.stop_token_ids)
        first = be.generate([prompt], [12], seeds=[1])[0]
        tool = chat.tool_turn(first.token_ids, "51\n")
        second_prompt = prompt + first.token_ids + tool.ids
        second = be.generate([second_prompt], [12], seeds=[2])[0]
        full = second_prompt + second.token_ids
        turns = [
            (len(prompt), first.token_ids, first.logprobs),
            (len(second_prompt), second.token_ids, second.logprobs),
        ]
        report[f"two_turns_T{temperature:g}"] = {**gap(model, full, turns, temperature), "tool_tokens": len(tool.ids)}
        if temperature != 1.0:  # the negative control: the same log-probs against the untempered distribution
            report[f"two_turns_T{temperature:g}_against_T1"] = gap(model, full, turns, 1.0)
    half = list(range(0, len(tok), 2))
    stopped = backend(1.0, half).generate([prompt], [40], seeds=[3])[0]
    report["stop_token"] = {
        **gap(model, prompt + stopped.token_ids, [(len(prompt), stopped.token_ids, stopped.logprobs)], 1.0),
        "finished": stopped.finished,
        "last_is_stop": stopped.token_ids[-1] in set(half),
        "only_last_is_stop": all(t not in set(half) for t in stopped.token_ids[:-1]),
        "length": len(stopped.token_ids),
    }
    cut = backend(1.0, []).generate([prompt], [5], seeds=[4])[0]
    report["max_tokens_cut"] = {
        **gap(model, prompt + cut.token_ids, [(len(prompt), cut.token_ids, cut.logprobs)], 1.0),
        "finished": cut.finished,
        "length": len(cut.token_ids),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
