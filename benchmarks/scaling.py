"""How a step's cost grows with the work: ours vs TRL's GRPOTrainer as the batch and the trajectories grow.

    python benchmarks/scaling.py [--out docs/benchmarks.png] [--steps 3]

Runs ``benchmarks/step_vs_trl.py``'s workload (a scripted tool-calling policy on the tiny local Qwen2, a
0.2 s sleep tool) at several sizes, each trainer in its own process: the batch (questions x group 4) at a
fixed 0-3 tool calls, then the trajectory length (0-N tool calls, each with reasoning text) at a fixed 16
trajectories. With ``--async-rows on`` (default) also ours with ``async_rollouts`` (``max_staleness`` 1 and 2,
streaming; a second process: the generation replica). Prints one row per run (step time, real tokens, tokens the training forward processed) and
draws step time and tokens processed against the real tokens of the step, for ours and TRL. Wall-clock on
a shared machine: read the ratios within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARMUP = 2
TRAINERS = {"ours": ("o-", "C0", "ours"), "ours-async1": ("^-", "C2", "ours, async k=1"),
            "ours-async2": ("v-", "C3", "ours, async k=2"), "trl": ("s--", "C1", "TRL GRPOTrainer")}


def run(which: str, questions: int, calls: int, steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "step_vs_trl.py"), "--which", which, "--questions", str(questions),
           "--calls", str(calls), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{which} q={questions} calls={calls} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])

    def mean(v):  # steady state: the first steps build caches and start the replica
        tail = v[WARMUP:] if len(v) > WARMUP else v
        return sum(tail) / len(tail)

    return {"step_s": mean(r["step_s"]), "train_s": mean(r["train_s"]), "real": mean(r["real_tokens"]),
            "processed": mean(r["padded_tokens"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "benchmarks.png"))
    ap.add_argument("--steps", type=int, default=6, help=f"steps per run (means leave out the first {WARMUP})")
    ap.add_argument("--async-rows", choices=["on", "off"], default="on", help="also ours with async_rollouts (k=1, 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8], help="questions per step (group 4)")
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 3, 6], help="most tool calls per trajectory")
    ap.add_argument("--replot", action="store_true", help="draw the plot again from the .json next to --out")
    args = ap.parse_args()
    sweeps = {"batch": [(q, 3) for q in args.batches], "length": [(4, c) for c in args.calls]}
    if args.replot:
        plot(json.loads(Path(args.out).with_suffix(".json").read_text()), args.out)
        return
    rows = []
    print(f"{'sweep':<7} {'traj':>5} {'calls':>6} {'trainer':<12} {'step s':>7} {'train s':>8} {'real tok':>9} "
          f"{'processed':>10} {'/ real':>7}")
    for sweep, points in sweeps.items():
        for questions, calls in points:
            for which in [w for w in TRAINERS if args.async_rows == "on" or "async" not in w]:
                r = run(which, questions, calls, args.steps)
                rows.append({"sweep": sweep, "trajectories": questions * 4, "calls": calls, "trainer": which, **r})
                print(f"{sweep:<7} {questions * 4:>5} {calls:>6} {which:<12} {r['step_s']:>7.2f} {r['train_s']:>8.2f} "
                      f"{r['real']:>9.0f} {r['processed']:>10.0f} {r['processed'] / max(r['real'], 1):>7.3f}", flush=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out)


def plot(rows: list[dict], out: str) -> None:
    """Step time, and tokens processed beside each trainer's real tokens, against the sweep's own variable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for col, (sweep, key, xlabel) in enumerate([("batch", "trajectories", "trajectories per step (0-3 tool calls each)"),
                                               ("length", "calls", "most tool calls per trajectory (16 trajectories)")]):
        for which, (style, color, label) in TRAINERS.items():
            pts = [r for r in rows if r["sweep"] == sweep and r["trainer"] == which]
            if not pts:
                continue
            x = [r[key] for r in pts]
            axes[0][col].plot(x, [r["step_s"] for r in pts], style, color=color, label=label)
            axes[1][col].plot(x, [r["processed"] for r in pts], style, color=color, label=f"{label}: processed")
            axes[1][col].plot(x, [r["real"] for r in pts], ":", color=color, label=f"{label}: real tokens (floor)")
        axes[0][col].set_ylabel("step time (s)")
        axes[1][col].set_ylabel("tokens per step, training forward")
        for row in (0, 1):
            axes[row][col].set_xlabel(xlabel)
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend(fontsize=8)
    fig.suptitle("Step cost vs work: tiny Qwen2 on a 2-core CPU, scripted tool-calling policy, 0.2 s tool", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
