"""The main task's rollout on a real vLLM server on CPU, beside HF generate and continuous batching, and the
sampler/trainer log-prob gap on the same weights.

    python benchmarks/vllm_cpu.py [--model DIR] [--questions 16] [--group 4] [--samplers hf,cb,server]
                                  [--vllm-python .venv-vllm/bin/python]

Each sampler runs in a process of its own (HF generate and continuous batching in this interpreter; the server's
rollout in vLLM's, ``.venv-vllm``, against a server started on loopback the way the project starts one,
:mod:`trl_plugins.rollout.vllm_server`): ``--questions x --group`` trajectories of the arithmetic task with the recipe's
system prompt, the sandboxed code interpreter and the recipe's budgets (4 turns, 128 tokens a turn). Printed per
sampler: trajectories and sampled tokens per second, tool calls, the engine's start-up time (the server's, to
``/health``); for the server, the gap between its behaviour log-probs (``processed_logprobs``) and the trainer's
``log_softmax(logits / T)`` of the same tokens on the same weights: mean and max |log p_vllm - log p_trainer| per
action token, and the mean KL estimate (k3) of the trainer's policy from the sampler's on the sampled tokens.

``--model``: a model folder (tokenizer inside) whose attention vLLM's CPU backend runs (head size 32 or more): the
embedded default's vLLM variant (``--embedded '{"num_heads": 2, "num_kv_heads": 1}'``, cached under
``~/.cache/trl-plugins/embedded/``); without it, a random model of that shape (its completions make no tool calls).

No speed goal on CPU (vLLM's scheduler is built for GPUs): the point is that the real engine runs the path and that
the gap is known. One shared 2-core machine: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt (recipes/retool/coldstart.py), stated here so the child needs no recipe import."""


def random_variant(out: Path) -> Path:
    """A random Qwen2 of the vLLM variant's shape (2 heads of 32), weights scaled so its distributions are peaked."""
    import torch

    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(tok, num_heads=2, num_kv_heads=1, sliding_window=48)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def questions(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [f"What is {rng.randint(100, 999)} * {rng.randint(10, 99)} + {rng.randint(100, 999)}?" for _ in range(n)]


def child(args: argparse.Namespace) -> dict:
    """One sampler's rollout (run in its own process)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest
    from trl_plugins.tools.code_interpreter import CodeInterpreter
    from trl_plugins.types import SamplingSettings

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tool = CodeInterpreter()
    chat = ChatFormat(tok, [tool.schema()])
    sampling = SamplingSettings(temperature=1.0)
    start = time.perf_counter()
    if args.child == "hf":
        from trl_plugins.rollout import HFGenerationBackend

        backend = HFGenerationBackend(
            model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling
        )
    elif args.child == "cb":
        from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend

        backend = ContinuousBatchingBackend(model, stop_token_ids=chat.stop_token_ids, sampling=sampling)
    else:
        from trl.generation.vllm_client import VLLMClient

        from trl_plugins.rollout.backends import VLLMBackend

        server = type("Server", (), {"mode": "server", "vllm_client": None})()
        client = VLLMClient(base_url=args.url, connection_timeout=60)
        backend = VLLMBackend(
            server, stop_token_ids=chat.stop_token_ids, sampling=sampling, client=client, max_concurrency=64
        )
    backend_s = time.perf_counter() - start
    qs = [
        RolloutQuestion(
            f"q{i}",
            chat.initial_prompt_ids([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]),
            i,
        )
        for i, q in enumerate(questions(args.questions))
    ]
    rollout = MultiTurnRollout(max_turns=4, max_assistant_tokens=128, max_trajectory_tokens=1024)
    start = time.perf_counter()
    result = rollout(RolloutRequest(qs, args.group, backend, chat, {"code_interpreter": tool}, seed=0))
    wall = time.perf_counter() - start
    trajs = result.trajectories
    sampled = sum(len(t.completion_ids) for traj in trajs for t in traj.turns)
    out = {
        "sampler": args.child,
        "trajectories": len(trajs),
        "wall_s": wall,
        "trajectories_per_s": len(trajs) / wall,
        "tokens_per_s": sampled / wall,
        "sampled_tokens": sampled,
        "tool_calls": sum(t.num_tool_calls for t in trajs),
        "backend_s": backend_s,
    }
    if args.child == "server":
        out.update(gap(model, trajs, temperature=sampling.temperature))
    tool.close()
    return out


def gap(model, trajectories, *, temperature: float) -> dict:
    """|log p_vllm - log p_trainer| per action token (mean, max) and the mean k3 KL estimate, on the same weights."""
    import torch

    from trl_plugins.datum import build_datums

    diffs, k3 = [], []
    for traj in trajectories:
        for d in build_datums(traj, advantage=0.0):
            with torch.no_grad():
                logits = model(torch.tensor([d.input_ids])).logits[0].float() / temperature
            trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_ids)[:, None])[:, 0]
            mask = torch.tensor(d.action_mask, dtype=torch.bool)
            behaviour = torch.tensor(d.behaviour_logprobs)[mask]
            mine = trainer[mask]
            diffs += (behaviour - mine).abs().tolist()
            log_ratio = (mine - behaviour).double()  # log pi_trainer / pi_sampler on tokens the sampler drew
            k3 += (torch.exp(log_ratio) - 1 - log_ratio).tolist()
    return {
        "gap_mean": sum(diffs) / len(diffs),
        "gap_max": max(diffs),
        "kl_k3_mean": sum(k3) / len(k3),
        "action_tokens": len(diffs),
    }


def run_child(python: str, args: argparse.Namespace, sampler: str, url: str | None = None) -> dict:
    cmd = [python, __file__, "--child", sampler, "--model", str(args.model), "--questions", str(args.questions)]
    cmd += ["--group", str(args.group)] + (["--url", url] if url else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"{sampler} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--samplers", default="hf,cb,server")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--child", choices=["hf", "cb", "server"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.model is None:
        args.model = random_variant(Path(tempfile.mkdtemp(prefix="vllm-variant-")))
        print(f"model: a random model of the vLLM variant's shape at {args.model} (pass --model for the trained one)")
    rows = []
    for sampler in args.samplers.split(","):
        if sampler != "server":
            rows.append(run_child(sys.executable, args, sampler))
            continue
        from trl_plugins.rollout.vllm_server import local_server

        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        }
        start = time.perf_counter()
        with local_server(
            args.model, python=args.vllm_python, environ=env, extra=["--max-model-len", "2048"]
        ) as server:
            startup = time.perf_counter() - start
            row = run_child(args.vllm_python, args, "server", server.url)
        rows.append({**row, "startup_s": startup})
    print(
        f"{'sampler':<8} {'traj':>5} {'wall s':>7} {'traj/s':>7} {'tok/s':>7} {'calls':>6} {'start s':>8}  gap mean / max, KL k3"
    )
    for r in rows:
        start = r.get("startup_s", r["backend_s"])
        extra = (
            f"  {r['gap_mean']:.2e} / {r['gap_max']:.2e}, {r['kl_k3_mean']:.2e} ({r['action_tokens']} tokens)"
            if "gap_mean" in r
            else ""
        )
        print(
            f"{r['sampler']:<8} {r['trajectories']:>5} {r['wall_s']:>7.1f} {r['trajectories_per_s']:>7.2f} "
            f"{r['tokens_per_s']:>7.1f} {r['tool_calls']:>6} {start:>8.1f}{extra}"
        )


if __name__ == "__main__":
    main()
