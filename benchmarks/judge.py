"""What a judge costs a step: the scripted judge (examples/judges/scripted_judge.py, loopback) answering after a fixed
latency, on a batch of 64 trajectories.

    python benchmarks/judge.py [--latency-s 0.2] [--steps 10] [--part scoring|steps|both]

Part 1, the scoring alone (``score_trajectories`` after the rollout, nothing overlapping it): wall time and calls per
batch at concurrency 1, 8 and 32, pointwise and group ranking (16 groups of 4), with an empty cache and again with the
cache the first pass filled.

Part 2, in the step (the scripted multi-turn policy of benchmarks/step_vs_trl.py, 16 questions x group 4, tool calls
sleeping 0.2 s): the synchronous step and ``async_rollouts`` at staleness 1, each without and with the judge
(pointwise, concurrency 32, a fresh cache per arm). The judge scores each trajectory as it ends, during the rollout
(``scores_during_rollout``), so what a step waits for is the tail: ``judge tail`` is the rollout's wait after its last
trajectory for the judge calls still in flight, ``scoring`` the scoring after the rollout (cache reads), both per step;
``judge CPU`` the scripted judge server's own CPU per step (it shares this machine's 2 cores, which a real judge would
not), ``step +`` the step time with the judge minus without (this machine is shared and noisy: read it beside the two
waits).
Means leave out the first 2 steps.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "judges"))

WARMUP = 2


def _trajectories(n_groups: int = 16, group: int = 4):
    from trl_plugins.types import StopReason, Trajectory, Turn

    trajs, rows = [], []
    for g in range(n_groups):
        rows.append({"prompt": f"Question {g}: what is 123 * 456 + 789?", "answer": "56877"})
        for k in range(group):
            answer = "56877" if (g + k) % 2 == 0 else str(56000 + g * 10 + k)
            text = f"Sample {g}-{k}: I computed it step by step.\n\\boxed{{{answer}}}"
            trajs.append(
                Trajectory(
                    [Turn([1, 2], [3], [-0.1], text=text)],
                    question_id=f"q{g}",
                    group_id=g,
                    sample_index=k,
                    stop_reason=StopReason.FINAL_ANSWER,
                )
            )
    return trajs, rows


def part_scoring(url: str, latency_s: float) -> None:
    import scripted_judge

    from trl_plugins.pipeline.batch import score_trajectories
    from trl_plugins.protocols import as_reward
    from trl_plugins.rewards.judge import JudgeReward
    from trl_plugins.rewards.judge_client import _LIMITS
    from trl_plugins.types import StopReason

    trajs, rows = _trajectories()
    print(f"Part 1: scoring {len(trajs)} trajectories (16 groups of 4) after the rollout, judge latency {latency_s} s")
    header = (
        f"{'mode':<10} {'concurrency':>11} {'cache':>6} {'wall s':>7} {'calls':>6} {'retries':>8} {'cache hits':>11}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("pointwise", "group"):
            for concurrency in (1, 8, 32):
                _LIMITS.clear()  # each row its own limit (one per endpoint and process otherwise)
                cache = str(Path(tmp) / f"{mode}-{concurrency}.sqlite")
                for state in ("empty", "filled"):
                    judge = JudgeReward(base_url=url, model="scripted-judge", mode=mode, concurrency=concurrency,
                                        cache_path=cache, timeout_s=60)  # fmt: skip
                    reward = as_reward(judge, "judge")
                    for t in trajs:
                        t.stop_reason, t.reward_components = StopReason.FINAL_ANSWER, []
                    before = scripted_judge._state["requests"]
                    start = time.perf_counter()
                    failures = score_trajectories([reward], trajs, rows)
                    wall = time.perf_counter() - start
                    assert not failures, failures
                    figures = judge.step_metrics()
                    assert scripted_judge._state["requests"] - before == figures["judge/calls"]
                    print(
                        f"{mode:<10} {concurrency:>11} {state:>6} {wall:>7.2f} {figures['judge/calls']:>6.0f} "
                        f"{figures['judge/retries']:>8.0f} {figures['judge/cache_hits']:>11.0f}"
                    )


def child(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from rollout import SleepTool, scripted_model
    from step_vs_trl import CyclingReward, _dataset

    from trl_plugins.rewards.judge import JudgeReward
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = scripted_model(build_tiny_model(tok), 3, vary=True)
    components = {"r": CyclingReward()}
    if args.judge:
        components["judge"] = JudgeReward(
            base_url=args.url, model="scripted-judge", concurrency=32, cache_path=args.cache, timeout_s=30
        )
    extra = dict(async_rollouts=True, max_staleness=1) if args.which == "async1" else {}
    with tempfile.TemporaryDirectory() as out:
        config = MultiTurnGRPOConfig(
            **extra,
            output_dir=out,
            per_device_train_batch_size=64,
            num_generations=4,
            max_steps=args.steps,
            use_cpu=True,
            bf16=False,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
            reward_components=list(components),
            reward_component_weights=[1.0] * len(components),
            skip_startup_checks=["all"],
            max_items_per_micro_batch=8,
            max_padded_tokens_per_micro_batch=64_000,
            rollout_kwargs={"max_turns": 5, "max_tool_calls": 4, "max_assistant_tokens": 128,
                            "max_trajectory_tokens": 4096},
        )  # fmt: skip
        trainer = MultiTurnGRPOTrainer(
            model,
            config,
            train_dataset=_dataset(16),
            processing_class=tok,
            tools={"code_interpreter": SleepTool(0.2)},
            reward_components=components,
        )
        trainer.train()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing/step_s" in r]
    keys = ("timing/step_s", "timing/judge_tail_s", "timing/scoring_s", "judge/calls", "judge/cache_hits",
            "timing/trainer_idle_s", "reward/verifier_error_rate")  # fmt: skip
    print("RESULT " + json.dumps({k: [s.get(k, 0.0) for s in steps] for k in keys}))


def part_steps(url: str, steps: int) -> None:
    print(f"\nPart 2: in the step, 64 trajectories/step, judge pointwise at concurrency 32, {steps} steps per arm")
    header = (
        f"{'loop':<6} {'judge':>5} {'step s':>7} {'judge tail s':>13} {'scoring s':>10} {'calls/step':>11} "
        f"{'trainer idle s':>15} {'judge CPU s':>12} {'step +':>7}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("sync", "async1"):
            base = None
            for judge in (False, True):
                cmd = [sys.executable, __file__, "--child", which, "--url", url, "--steps", str(steps),
                       "--cache", str(Path(tmp) / f"{which}.sqlite")] + (["--judge"] if judge else [])  # fmt: skip
                cpu = time.process_time()  # this process serves the scripted judge: its CPU, off the 2 cores
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                judge_cpu = (time.process_time() - cpu) / steps
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{which} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                r = {k: v[WARMUP:] or v for k, v in json.loads(line[len("RESULT ") :]).items()}

                def m(key: str, r=r) -> float:
                    return sum(r[key]) / max(len(r[key]), 1)

                step = m("timing/step_s")
                base = step if base is None else base
                assert m("reward/verifier_error_rate") == 0.0
                print(
                    f"{which:<6} {'yes' if judge else 'no':>5} {step:>7.2f} {m('timing/judge_tail_s'):>13.3f} "
                    f"{m('timing/scoring_s'):>10.3f} {m('judge/calls'):>11.1f} {m('timing/trainer_idle_s'):>15.2f} "
                    f"{judge_cpu:>12.3f} {step - base:>+7.2f}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-s", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--part", choices=["scoring", "steps", "both"], default="both")
    ap.add_argument("--child", choices=["sync", "async1"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--judge", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.which = args.child
        child(args)
        return
    import scripted_judge

    server, _ = scripted_judge.serve(0, latency_s=args.latency_s)
    url = f"http://127.0.0.1:{server.server_port}/v1"
    if args.part in ("scoring", "both"):
        part_scoring(url, args.latency_s)
    if args.part in ("steps", "both"):
        part_steps(url, args.steps)
    server.shutdown()


if __name__ == "__main__":
    main()
