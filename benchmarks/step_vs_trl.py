"""One training step, ours vs TRL's GRPOTrainer, on the same multi-turn tool-calling workload.

    python benchmarks/step_vs_trl.py [--steps 3] [--questions 4] [--group 4] [--calls 2] [--tool-s 0.2] [--prompt-words 0]

Both trainers get the same tiny local Qwen2 model, the same questions, the same group size and the
same tool (sleeps ``--tool-s`` per call). The policy is *scripted*: a logits processor forces each
trajectory to follow a plan of 0..``--calls`` tool calls with a varying amount of reasoning text, then
a ``\\boxed{}`` answer (see benchmarks/rollout.py), so both sides do the same long-tailed multi-turn
work with real forward passes. Each trainer runs in its own process. Printed per step (mean over steps
after the first): wall time, rollout and training time where known, the real tokens of the step's training
data (the floor: any padding is waste), the tokens the training forward passes processed and their ratio
to the floor, our rollout's wall time over its critical path (the longest trajectory's own chain of
generation and tool calls), and the peak RSS of a step (the high-water mark is reset at each step).

TRL pads every micro-batch to the longest prompt and the longest completion of the whole batch; we
pack one prefix-merged datum per trajectory into micro-batches: ``ours`` is the default config
(``padding_free`` and ``shared_prefix`` auto: with this sdpa model on CPU, right-padded micro-batches in the
shared-prefix layout, each group's prompt forwarded once per micro-batch), ``ours unshared`` the same with
``shared_prefix=False`` (every datum forwarded whole), ``ours pf`` forces padding-free micro-batches
(``--padding-free on`` runs only that row, ``off`` only the first two, ``both`` the three). ``computed`` counts the
real tokens the training forwards computed (each shared prefix once): below the real tokens when prefixes are
shared. ``--prompt-words N`` lengthens every question by N words of context (a long prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _dataset(n: int, words: int = 0):
    from datasets import Dataset

    context = " ".join(f"fact{k % 97} holds;" for k in range(words))
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{context} Question {i}: what is 123 * 456 + 789?".strip()}],
                "answer": "56877",
            }
            for i in range(n * 50)
        ]
    )


class CyclingReward:
    """0, 1, 2, 0, ... in the order it is called: every group gets an advantage, so every step updates."""

    def __init__(self):
        self.k = 0

    def __call__(self, trajectory, example):
        self.k += 1
        return float(self.k % 3)


def _reward(completions=None, **kwargs):
    return [float(i % 3) for i in range(len(completions))]


ASYNC_ROWS = {  # which -> (max_staleness, streaming)
    "ours-async1-overlap": (1, False),
    "ours-async1": (1, True),
    "ours-async2": (2, True),
}


def run_ours(
    args, padding_free: bool | None, async_row: tuple[int, bool] | None = None, shared_prefix: bool | None = None
) -> dict:
    from rollout import SleepTool, scripted_model

    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    scripted_model(model, args.calls, vary=True)  # in its class: the async replica plays the same script
    extra = (
        {} if async_row is None else dict(async_rollouts=True, max_staleness=async_row[0], async_streaming=async_row[1])
    )
    with tempfile.TemporaryDirectory() as out:
        config = MultiTurnGRPOConfig(
            **extra,
            output_dir=out,
            per_device_train_batch_size=args.questions * args.group,
            num_generations=args.group,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
            reward_components=["r"],
            max_items_per_micro_batch=args.micro_batch,
            max_padded_tokens_per_micro_batch=64_000,
            padding_free=padding_free,
            shared_prefix=shared_prefix,
            rollout_kwargs={
                "max_turns": args.calls + 2,
                "max_tool_calls": args.calls + 1,
                "max_assistant_tokens": 128,
                "max_trajectory_tokens": 4096,
            },
        )
        trainer = MultiTurnGRPOTrainer(
            model,
            config,
            train_dataset=_dataset(args.questions, args.prompt_words),
            processing_class=tok,
            tools={"code_interpreter": SleepTool(args.tool_s)},
            reward_components={"r": CyclingReward()},
        )
        step_times = []
        original = trainer.training_step

        def timed(*a, **k):
            t0 = time.perf_counter()
            loss = original(*a, **k)
            step_times.append(time.perf_counter() - t0)
            return loss

        trainer.training_step = timed
        trainer.train()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/rollout_s" in r]
    return {
        "step_s": step_times,
        "rollout_s": [r["timing/rollout_s"] for r in steps],
        "train_s": [r.get("timing/forward_backward_s", 0.0) for r in steps],
        "padded_tokens": [r.get("train/forward_tokens", 0.0) for r in steps],
        "real_tokens": [r.get("train/input_tokens", 0.0) for r in steps],
        "computed_tokens": [r.get("train/computed_tokens", 0.0) for r in steps],
        "crit_ratio": [r["rollout/critical_path_ratio"] for r in steps],
        "peak_rss_mb": [r["memory/peak_rss_mb"] for r in steps],
        "tool_calls": [r["rollout/tool_calls_mean"] for r in steps],
        "staleness": [r.get("train/staleness_mean", 0.0) for r in steps],
        "wait_s": [r.get("timing/trainer_idle_s", float("nan")) for r in steps],
        "sampler_busy_s": [r.get("timing/sampler_busy_s", float("nan")) for r in steps],
        "metric_step_s": [r["timing/step_s"] for r in steps],
    }


def run_trl(args) -> dict:
    from rollout import patch_generate
    from trl import GRPOConfig, GRPOTrainer

    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers.memory import peak_memory_mb, reset_peak_memory

    def code_interpreter(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: The Python code to run.
        """
        time.sleep(args.tool_s)
        return "56877"

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    patch_generate(model, tok, args.calls, vary=True)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.micro_batch,
            num_generations=args.group,
            gradient_accumulation_steps=args.questions * args.group // args.micro_batch,
            max_completion_length=1024,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
            max_tool_calling_iterations=args.calls + 1,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[_reward],
            args=config,
            train_dataset=_dataset(args.questions, args.prompt_words),
            processing_class=tok,
            tools=[code_interpreter],
        )
        gen_times, padded, real, step_times, peaks = [], [], [], [], []
        original_gen = trainer._generate_and_score_completions
        original_step = trainer.training_step

        def gen(inputs):
            reset_peak_memory()  # a step starts with its generation
            peaks.append(0.0)
            t0 = time.perf_counter()
            result = original_gen(inputs)
            gen_times.append(time.perf_counter() - t0)
            rows, width = (
                result["prompt_ids"].shape[0],
                result["prompt_ids"].shape[1] + result["completion_ids"].shape[1],
            )
            # Each training micro-batch is a slice of this batch, padded to its full width.
            padded.append(rows * width)
            real.append(int(result["prompt_mask"].sum()) + int(result["completion_mask"].sum()))
            return result

        def step(*a, **k):
            t0 = time.perf_counter()
            loss = original_step(*a, **k)
            step_times.append(time.perf_counter() - t0)
            peaks[-1] = max(peaks[-1], peak_memory_mb()["memory/peak_rss_mb"])
            return loss

        trainer._generate_and_score_completions = gen
        trainer.training_step = step
        trainer.train()
    accum = args.questions * args.group // args.micro_batch
    per_step = [sum(step_times[i : i + accum]) for i in range(0, len(step_times), accum)]
    return {
        "step_s": per_step,
        "rollout_s": gen_times,
        "train_s": [s - g for s, g in zip(per_step, gen_times)],
        "padded_tokens": padded,
        "real_tokens": real,
        "computed_tokens": padded,  # every row forwarded to the batch's width
        "crit_ratio": [float("nan")] * len(per_step),
        "peak_rss_mb": peaks,
        "tool_calls": [float("nan")] * len(per_step),
    }


def child(args) -> None:
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(2 if args.which == "ours-2threads" else 1)
    if args.which == "trl":
        result = run_trl(args)
    else:
        result = run_ours(
            args,
            padding_free=True if args.which == "ours-pf" else None,
            async_row=ASYNC_ROWS.get(args.which),
            shared_prefix=False if args.which in ("ours-pf", "ours-unshared") else None,
        )
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # The async rows' generation replica is a child process, reaped when training ends: its peak RSS.
    result["replica_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


WARMUP = 2
"""Steps left out of the means: the first steps build caches and, with async_rollouts, start the replica."""


def mean_after_first(values):
    tail = values[WARMUP:] if len(values) > WARMUP else values
    return sum(tail) / max(len(tail), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="steps per row (means leave out the first 2: steady state)")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--calls", type=int, default=3, help="most tool calls per trajectory (each picks 0..calls)")
    ap.add_argument("--tool-s", type=float, default=0.2)
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch (TRL per_device_train_batch_size)")
    ap.add_argument(
        "--prompt-words", type=int, default=0, help="words of context added to every question (long prompts)"
    )
    ap.add_argument(
        "--padding-free",
        choices=["on", "off", "both"],
        default="both",
        help="our rows: forced padding-free (on), the default config (off), or both",
    )
    ap.add_argument(
        "--async-rows",
        choices=["on", "off"],
        default="on",
        help="also run async_rollouts rows: k=1 overlap only (one batch at a time), k=1 and k=2 with "
        "streaming, and the synchronous default with 2 threads (the replica is a second process: "
        "a second core)",
    )
    ap.add_argument(
        "--which",
        choices=["ours", "ours-unshared", "ours-pf", "ours-2threads", "trl", *ASYNC_ROWS],
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.which:
        child(args)
        return
    results = {}
    ours = {"on": ["ours-pf"], "off": ["ours", "ours-unshared"], "both": ["ours", "ours-unshared", "ours-pf"]}[
        args.padding_free
    ]
    if args.async_rows == "on":
        ours = [*ours, "ours-2threads", *ASYNC_ROWS]
    for which in (*ours, "trl"):
        cmd = [sys.executable, __file__, "--which", which, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{which} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        results[which] = json.loads(line[len("RESULT ") :])
    n = args.questions * args.group
    print(
        f"{args.questions} questions x group {args.group} = {n} trajectories/step, 0-{args.calls} tool calls each, "
        f"tool {args.tool_s} s/call, {args.steps} steps (means exclude the first {WARMUP}), tiny Qwen2 on CPU, 1 thread "
        f"per process (ours 2threads: 2; async rows: trainer + replica process, 1 thread each)"
    )
    header = (
        f"{'trainer':<14} {'step s':>7} {'rollout s':>10} {'train s':>8} {'real tok':>9} {'computed':>9} {'/ real':>7} "
        f"{'processed':>10} {'/ real':>7} {'wall/crit':>10} {'peak RSS MB':>12}"
    )
    print(header)
    print("-" * len(header))
    m = mean_after_first
    for which, r in results.items():
        name = which.replace("-", " ")
        real = max(m(r["real_tokens"]), 1)
        print(
            f"{name:<14} {m(r['step_s']):>7.2f} {m(r['rollout_s']):>10.2f} {m(r['train_s']):>8.2f} "
            f"{m(r['real_tokens']):>9.0f} {m(r['computed_tokens']):>9.0f} {m(r['computed_tokens']) / real:>7.3f} "
            f"{m(r['padded_tokens']):>10.0f} {m(r['padded_tokens']) / real:>7.3f} "
            f"{m(r['crit_ratio']):>10.2f} {max(r['peak_rss_mb'][1:] or r['peak_rss_mb']):>12.0f}"
        )
    trl = results["trl"]
    for which in ours:
        r = results[which]
        print(
            f"{which}: speed-up per step (TRL / {which}) {m(trl['step_s']) / m(r['step_s']):.2f}x; tokens processed "
            f"(TRL / {which}) {m(trl['padded_tokens']) / max(m(r['padded_tokens']), 1):.2f}x"
        )
    if "ours" in results and "ours-unshared" in results:
        a, b = results["ours-unshared"], results["ours"]
        print(
            f"ours (shared prefix) / ours unshared: computed per real token "
            f"{(m(b['computed_tokens']) / m(b['real_tokens'])) / (m(a['computed_tokens']) / m(a['real_tokens'])):.2f}x, "
            f"train time per real token {(m(b['train_s']) / m(b['real_tokens'])) / (m(a['train_s']) / m(a['real_tokens'])):.2f}x, "
            f"peak RSS {max(b['peak_rss_mb'][1:] or b['peak_rss_mb']) / max(a['peak_rss_mb'][1:] or a['peak_rss_mb']):.2f}x"
        )
    if "ours" in results:
        base = results["ours"]
        for which in [w for w in ours if w.startswith("ours-async") or w == "ours-2threads"]:
            r = results[which]
            replica = f"; replica peak RSS {r['replica_rss_mb']:.0f} MB" if which.startswith("ours-async") else ""
            print(
                f"{which}: speed-up per step over ours (synchronous) {m(base['step_s']) / m(r['step_s']):.2f}x{replica}; "
                f"tool calls/trajectory {m(r['tool_calls']):.2f} (ours {m(base['tool_calls']):.2f}); staleness "
                f"{m(r['staleness']):.2f} steps; trainer waited {m(r['wait_s']) if which != 'ours-2threads' else 0:.2f} s/step"
            )
            if which.startswith("ours-async"):
                # from the run's own metrics (timing/*): a step cannot be shorter than its busier side
                step, idle = m(r["metric_step_s"]), m(r["wait_s"])
                busy_sampler = m([v for v in r["sampler_busy_s"] if v == v])  # the first step has no interval: nan
                busy_trainer = step - idle
                print(
                    f"{which}: trainer busy {busy_trainer:.2f} s, sampler busy {busy_sampler:.2f} s, "
                    f"trainer idle {idle:.2f} s per step"
                )
                print(f"{which}: step / max(trainer busy, sampler busy) = {step / max(busy_trainer, busy_sampler):.2f}")


if __name__ == "__main__":
    main()
