"""How a step's cost grows with the work: ours vs TRL's GRPOTrainer as the batch and the trajectories grow.

    python benchmarks/scaling.py [--out docs/benchmarks.png] [--steps 3]

Runs ``benchmarks/step_vs_trl.py``'s workload (a scripted tool-calling policy on the tiny local Qwen2, a
0.2 s sleep tool) at several sizes, each trainer in its own process: the batch (questions x group 4) at a
fixed 0-3 tool calls, then the trajectory length (0-N tool calls, each with reasoning text) at a fixed 16
trajectories, then (``--groups``) the group size (4, 8, 16 at 16 trajectories) with a short and a long prompt
(``--prompt-words`` 0 and 150 words of context), ours in the shared-prefix layout (the default) beside ``ours
unshared`` (``shared_prefix=False``). With ``--async-rows on`` (default) also ours with ``async_rollouts``
(``max_staleness`` 1 and 2, streaming; a second process: the generation replica) in the first two sweeps. Prints one row per run (step time, real tokens, tokens the training forward processed) and
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
TRAINERS = {
    "ours": ("o-", "C0", "ours"),
    "ours-unshared": ("x--", "C4", "ours, shared_prefix off"),
    "ours-async1": ("^-", "C2", "ours, async k=1"),
    "ours-async2": ("v-", "C3", "ours, async k=2"),
    "trl": ("s--", "C1", "TRL GRPOTrainer"),
}
GROUP_SWEEP = ("ours", "ours-unshared")
"""The trainers of the group-size sweep (the layouts; TRL and async are measured by the first two sweeps)."""


def run(which: str, questions: int, calls: int, steps: int, group: int = 4, prompt_words: int = 0) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "step_vs_trl.py"),
        "--which",
        which,
        "--questions",
        str(questions),
        "--calls",
        str(calls),
        "--steps",
        str(steps),
        "--group",
        str(group),
        "--prompt-words",
        str(prompt_words),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{which} q={questions} calls={calls} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT ") :])

    def mean(v):  # steady state: the first steps build caches and start the replica
        tail = v[WARMUP:] if len(v) > WARMUP else v
        return sum(tail) / len(tail)

    return {
        "step_s": mean(r["step_s"]),
        "train_s": mean(r["train_s"]),
        "real": mean(r["real_tokens"]),
        "processed": mean(r["padded_tokens"]),
        "computed": mean(r["computed_tokens"]),
        "peak_rss_mb": max(r["peak_rss_mb"][1:] or r["peak_rss_mb"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "benchmarks.png"))
    ap.add_argument("--steps", type=int, default=6, help=f"steps per run (means leave out the first {WARMUP})")
    ap.add_argument("--async-rows", choices=["on", "off"], default="on", help="also ours with async_rollouts (k=1, 2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8], help="questions per step (group 4)")
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 3, 6], help="most tool calls per trajectory")
    ap.add_argument(
        "--groups", type=int, nargs="*", default=[4, 8, 16], help="group sizes at 16 trajectories (none: skip)"
    )
    ap.add_argument("--prompt-words", type=int, nargs="+", default=[0, 150], help="words of context per question")
    ap.add_argument(
        "--sweeps",
        nargs="+",
        choices=["batch", "length", "group"],
        default=["batch", "length", "group"],
        help="the sweeps to run; the rows of the others are kept from the .json next to --out",
    )
    ap.add_argument("--replot", action="store_true", help="draw the plot again from the .json next to --out")
    args = ap.parse_args()
    sweeps = {
        name: points
        for name, points in {"batch": [(q, 3) for q in args.batches], "length": [(4, c) for c in args.calls]}.items()
        if name in args.sweeps
    }
    if args.replot:
        plot(json.loads(Path(args.out).with_suffix(".json").read_text()), args.out)
        return
    rows = []
    print(
        f"{'sweep':<7} {'traj':>5} {'calls':>6} {'group':>5} {'words':>5} {'trainer':<14} {'step s':>7} {'train s':>8} "
        f"{'real tok':>9} {'computed':>9} {'/ real':>7} {'processed':>10} {'/ real':>7} {'peak RSS MB':>12}"
    )

    def show(sweep: str, questions: int, calls: int, group: int, words: int, which: str) -> None:
        r = run(which, questions, calls, args.steps, group, words)
        rows.append(
            {
                "sweep": sweep,
                "trajectories": questions * group,
                "calls": calls,
                "group": group,
                "prompt_words": words,
                "trainer": which,
                **r,
            }
        )
        real = max(r["real"], 1)
        print(
            f"{sweep:<7} {questions * group:>5} {calls:>6} {group:>5} {words:>5} {which:<14} {r['step_s']:>7.2f} "
            f"{r['train_s']:>8.2f} {r['real']:>9.0f} {r['computed']:>9.0f} {r['computed'] / real:>7.3f} "
            f"{r['processed']:>10.0f} {r['processed'] / real:>7.3f} {r['peak_rss_mb']:>12.0f}",
            flush=True,
        )

    for sweep, points in sweeps.items():
        for questions, calls in points:
            for which in [
                w for w in TRAINERS if w != "ours-unshared" and (args.async_rows == "on" or "async" not in w)
            ]:
                show(sweep, questions, calls, 4, 0, which)
    for words in args.prompt_words if args.groups and "group" in args.sweeps else []:
        for group in args.groups:
            for which in GROUP_SWEEP:
                show("group", 16 // group, 3, group, words, which)
    saved = Path(args.out).with_suffix(".json")
    kept = [r for r in json.loads(saved.read_text()) if r["sweep"] not in args.sweeps] if saved.exists() else []
    rows = kept + rows
    saved.write_text(json.dumps(rows, indent=1))
    plot(rows, args.out)


def plot(rows: list[dict], out: str) -> None:
    """Step time, and tokens processed beside each trainer's real tokens, against the sweep's own variable; the group
    sweep: the update's time and the tokens it computed per real token, per layout and prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [r for r in rows if r["sweep"] == "group"]
    fig, axes = plt.subplots(2, 3 if groups else 2, figsize=(15 if groups else 10, 7.5))
    for col, (sweep, key, xlabel) in enumerate(
        [
            ("batch", "trajectories", "trajectories per step (0-3 tool calls each)"),
            ("length", "calls", "most tool calls per trajectory (16 trajectories)"),
        ]
    ):
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
    if groups:
        for which in GROUP_SWEEP:
            style, color, label = TRAINERS[which]
            for words, dash in zip(sorted({r["prompt_words"] for r in groups}), ("-", "--", ":")):
                pts = [r for r in groups if r["trainer"] == which and r["prompt_words"] == words]
                x = [r["group"] for r in pts]
                name = f"{label}, prompt +{words} words"
                axes[0][2].plot(x, [r["train_s"] for r in pts], style[0] + dash, color=color, label=name)
                axes[1][2].plot(
                    x, [r["computed"] / max(r["real"], 1) for r in pts], style[0] + dash, color=color, label=name
                )
        axes[0][2].set_ylabel("update time per step (s)")
        axes[1][2].set_ylabel("tokens computed / real tokens")
        for row in (0, 1):
            axes[row][2].set_xlabel("group size (16 trajectories, 0-3 tool calls)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Step cost vs work: tiny Qwen2 on a 2-core CPU, scripted tool-calling policy, 0.2 s tool", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
