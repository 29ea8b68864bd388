"""Run the main command for several seeds and print the results table of docs/results.md.

    python recipes/retool_seeds.py --seeds 0 1 2 --out outputs/retool_seeds [-- extra recipe args]

Each seed runs ``accelerate launch recipes/retool_ppo.py --task_seed S --seed S`` (its own embedded
build, task split and sampling), then the table (held-out accuracy and tool-call rate before and after
RL) is printed as Markdown and a figure with every seed's curves is written to ``<out>/seeds.png``.
Seeds already finished (a ``summary.json`` in their folder) are not run again. ``--dry_run``: a dry run of each
run it would launch (``retool_ppo.py --dry_run true``), nothing trained or written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    from transformers.hf_argparser import string_to_bool  # how the recipe reads a bool: --dry_run [true|false]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/retool_seeds")
    parser.add_argument("--config_file", default=str(ROOT / "accelerate_configs" / "cpu.yaml"))
    parser.add_argument("extra", nargs="*", help="Arguments passed on to the recipe (after --).")
    parser.add_argument(
        "--dry_run",
        type=string_to_bool,
        nargs="?",
        const=True,
        default=False,
        help="A dry run of each seed's run not finished yet (the recipe's --dry_run: its start-up "
        "checks, nothing trained or written), then exit: 0 when every one passed.",
    )
    args = parser.parse_args()
    out = Path(args.out)
    rows = []
    failed = []
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        if not (run_dir / "summary.json").is_file():
            cmd = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                args.config_file,
                str(ROOT / "recipes" / "retool_ppo.py"),
                "--task_seed",
                str(seed),
                "--seed",
                str(seed),
                "--output_dir",
                str(run_dir),
                "--run_name",
                f"retool-seed{seed}",
                *args.extra,
                *(["--dry_run", "true"] if args.dry_run else []),
            ]
            print("$", " ".join(cmd), flush=True)
            if subprocess.run(cmd, cwd=ROOT).returncode != 0:
                print(f"seed {seed} failed; see its output above.", file=sys.stderr)
                if not args.dry_run:
                    return 1
                failed.append(seed)
            if args.dry_run:
                continue
        elif args.dry_run:
            print(f"dry run: seed {seed} finished ({run_dir / 'summary.json'}); it would not run again.")
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        rows.append((seed, summary, run_dir))
    if args.dry_run:
        print(
            f"dry run: the runs of seed(s) {failed} refused"
            if failed
            else "dry run: every run passed its start-up checks; nothing was trained or written.",
            flush=True,
        )
        return 1 if failed else 0

    from retool.report import accuracy_gain, with_se

    print(
        "\n| seed | accuracy before | accuracy after | gain | tool-call rate before | after | pass@k before | after "
        "| steps | wall (min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    gains = []
    for seed, s, _ in rows:
        b, a = s["before"], s["after"]
        k = max(a["pass_at_k"], key=int)
        gain = accuracy_gain(b, a)
        gains.append(gain["accuracy"])
        ses = [r.get("pass_at_k_se", {}).get(k) for r in (b, a)]
        print(
            f"| {seed} | {with_se(b['accuracy'], b.get('accuracy_se'))} | "
            f"{with_se(a['accuracy'], a.get('accuracy_se'))} | "
            f"{with_se(gain['accuracy'], gain['se'], '+.3f')} | {b['tool_call_rate']:.3f} | "
            f"{a['tool_call_rate']:.3f} | {with_se(b['pass_at_k'][k], ses[0])} | "
            f"{with_se(a['pass_at_k'][k], ses[1])} (k={k}) | {s['steps']} | "
            f"{s['wall_s'] / 60:.1f} |"
        )
    print(f"\nmean gain {sum(gains) / len(gains):+.3f} over {len(gains)} seeds; smallest {min(gains):+.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from retool.report import read_metrics, train_accuracy

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for seed, s, run_dir in rows:
        metrics = read_metrics(run_dir / "metrics.jsonl")
        steps = [r["step"] for r in metrics]
        axes[0].plot(steps, [r["reward/total"] for r in metrics], label=f"seed {seed}")
        (line,) = axes[1].plot(steps, [train_accuracy(r) for r in metrics], label=f"seed {seed} (train batch)")
        axes[1].scatter(
            [0, steps[-1]],
            [s["before"]["accuracy"], s["after"]["accuracy"]],
            color=line.get_color(),
            marker="o",
            zorder=3,
        )
        axes[2].plot(steps, [r["rollout/tool_calls_mean"] for r in metrics], label=f"seed {seed}")
    for ax, title in zip(
        axes, ("reward (train batch)", "accuracy (dots: held-out before/after)", "tool calls per trajectory")
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "seeds.png", dpi=110)
    print(f"figure: {out / 'seeds.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
