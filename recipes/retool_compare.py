"""Compare algorithm variants of the main command over seeds; prints the tables of docs/results.md.

    python recipes/retool_compare.py --seeds 0 1 2 --out outputs/cmp [--variants grpo kl gae]
    # on the lookup task: arguments after -- go to every run
    python recipes/retool_compare.py --seeds 0 1 2 --out outputs/cmp_lookup --variants grpo -- --config
    recipes/retool_lookup.yaml

Each (variant, seed) runs ``accelerate launch recipes/retool_ppo.py --seed S <variant args> --report_to
none`` on the same embedded default (``--task_seed`` stays 0: one cold start, one task split; the seed
sets RL sampling, data order and the evaluation draws). Variants:

- ``grpo``: the recipe as configured (group advantages, PPO clip);
- ``kl``: plus a k3 reference KL to the cold-start policy in the loss (``--beta 0.05``);
- ``gae``: PPO with a critic (``--advantage gae``: the critic, GAE over action tokens, whitened);
- ``gspo``: one length-normalised ratio per sequence (``--policy_loss gspo``, with ``seq_mean_token_sum``);
- ``turn_ppo``: one ratio per assistant turn, its summed log-ratio (``--policy_loss turn_ppo``);
- ``turn_group``: turn-level credit, step groups of identical states (``--advantage turn_group``);
- ``dapo``: GRPO with DAPO's dynamic sampling on the ``correct`` component (``--dynamic_sampling true``);
- ``async1``, ``async2``: GRPO with asynchronous rollouts, ``max_staleness`` 1 and 2 (the decoupled objective,
  streaming; ``--async_rollouts true --max_staleness K``);
- ``opd``: on-policy distillation from the task's embedded default after its RL recipe (``--advantage opd
  --teacher_model_name_or_path embedded-rl``, built once and cached: recipes/retool/teacher.py), ``reward_weight`` 0:
  the teacher's per-token signal alone;
- ``opd_reward``: the same with the group outcome advantage beside it (``reward_weight`` 1).

Runs already finished (a ``summary.json`` in their folder) are not run again. Besides the tables of every comparison
(the held-out accuracy at each evaluation against steps and training wall time among them), runs with a teacher get
one of their own: the gap to the teacher's held-out accuracy, tool-call rates, the teacher KL and the teacher
forward's share of the step time. Writes ``<out>/compare.png``.
``--dry_run``: a dry run of each run it would launch (``retool_ppo.py --dry_run true``), nothing compared or written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_OPD = ["--advantage", "opd", "--teacher_model_name_or_path", "embedded-rl"]
VARIANTS = {
    "grpo": [],
    "kl": ["--beta", "0.05"],
    "gae": ["--advantage", "gae"],
    # The paper's mean over sequences (token_mean would divide each sequence's objective by the batch's tokens).
    "gspo": ["--policy_loss", "gspo", "--aggregation", "seq_mean_token_sum"],
    "turn_ppo": ["--policy_loss", "turn_ppo"],
    "turn_group": ["--advantage", "turn_group"],
    # DAPO compares accuracy: groups all right or all wrong are dropped, whatever their format rewards.
    "dapo": ["--dynamic_sampling", "true", "--dynamic_sampling_metric", "correct"],
    "async1": ["--async_rollouts", "true", "--max_staleness", "1"],
    "async2": ["--async_rollouts", "true", "--max_staleness", "2"],
    "opd": _OPD + ["--advantage_kwargs", '{"reward_weight": 0.0}'],
    "opd_reward": _OPD + ["--advantage_kwargs", '{"reward_weight": 1.0}'],
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _heldout_points(metrics: list[dict], summary: dict) -> list[tuple[int, float, float, float | None]]:
    """``(step, training wall s, accuracy, with-tool accuracy)`` of each held-out evaluation of a run: before (step 0),
    every ``eval_every_steps`` (64 problems) and after (128); the wall time sums ``timing/step_s`` up to the step,
    so the evaluations' own time is left out."""
    points = [(0, 0.0, summary["before"]["accuracy"], summary["before"]["accuracy_with_tool"])]
    wall = 0.0
    for r in metrics:
        wall += r.get("timing/step_s", 0.0)
        if "heldout/accuracy" in r and r["step"] < summary["steps"]:
            points.append((r["step"], wall, r["heldout/accuracy"], r.get("heldout/accuracy_with_tool")))
    after = summary["after"]
    return points + [(summary["steps"], wall, after["accuracy"], after["accuracy_with_tool"])]


def main() -> int:
    from transformers.hf_argparser import string_to_bool  # how the recipe reads a bool: --dry_run [true|false]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=["grpo", "kl", "gae"], choices=list(VARIANTS))
    parser.add_argument("--out", default="outputs/compare")
    parser.add_argument("--config_file", default=str(ROOT / "accelerate_configs" / "cpu.yaml"))
    parser.add_argument("extra", nargs="*", help="Arguments passed on to every run of the recipe (after --).")
    parser.add_argument(
        "--dry_run",
        type=string_to_bool,
        nargs="?",
        const=True,
        default=False,
        help="A dry run of each run not finished yet (the recipe's --dry_run: its start-up checks, "
        "nothing trained or written), then exit: 0 when every one passed. Nothing is compared.",
    )
    args = parser.parse_args()
    out = Path(args.out)
    runs: dict[str, list[tuple[int, dict, Path]]] = {}
    failed = []
    for variant in args.variants:
        for seed in args.seeds:
            run_dir = out / f"{variant}_s{seed}"
            if not (run_dir / "summary.json").is_file():
                cmd = [
                    sys.executable,
                    "-m",
                    "accelerate.commands.launch",
                    "--config_file",
                    args.config_file,
                    str(ROOT / "recipes" / "retool_ppo.py"),
                    "--seed",
                    str(seed),
                    "--output_dir",
                    str(run_dir),
                    "--report_to",
                    "none",
                    *VARIANTS[variant],
                    *args.extra,
                    *(["--dry_run", "true"] if args.dry_run else []),
                ]
                print("$", " ".join(cmd), flush=True)
                if subprocess.run(cmd, cwd=ROOT).returncode != 0:
                    print(f"{variant} seed {seed} failed; see its output above.", file=sys.stderr)
                    if not args.dry_run:
                        return 1
                    failed.append(f"{variant} seed {seed}")
                if args.dry_run:
                    continue
            elif args.dry_run:
                print(f"dry run: {variant} seed {seed} finished ({run_dir / 'summary.json'}); it would not run again.")
                continue
            runs.setdefault(variant, []).append((seed, json.loads((run_dir / "summary.json").read_text()), run_dir))
    if args.dry_run:
        print(
            f"dry run: {len(failed)} run(s) refused: {', '.join(failed)}"
            if failed
            else "dry run: every run passed its start-up checks; nothing was trained or compared.",
            flush=True,
        )
        return 1 if failed else 0

    from retool.report import accuracy_gain, read_metrics, train_accuracy, with_se
    from trl_plugins.evaluation import clustered_se  # with one "cluster" per seed: the standard error of the mean

    print(
        "\n| variant | seed | held-out accuracy before -> after | gain | with-tool accuracy before -> after | "
        "tool-call rate after | pass@4 after | lowest train-batch accuracy, steps 10-40 | wall (min) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    curves: dict[str, list[list[dict]]] = {}
    for variant, rows in runs.items():
        for seed, s, run_dir in rows:
            b, a = s["before"], s["after"]
            metrics = read_metrics(run_dir / "metrics.jsonl")
            curves.setdefault(variant, []).append(metrics)
            late = [v for r in metrics if r["step"] >= 10 and (v := train_accuracy(r)) is not None] or [float("nan")]
            gain = accuracy_gain(b, a)
            print(
                f"| {variant} | {seed} | {with_se(b['accuracy'], b.get('accuracy_se'))} -> "
                f"{with_se(a['accuracy'], a.get('accuracy_se'))} | {with_se(gain['accuracy'], gain['se'], '+.3f')} | "
                f"{with_se(b['accuracy_with_tool'], b.get('accuracy_with_tool_se'))} -> "
                f"{with_se(a['accuracy_with_tool'], a.get('accuracy_with_tool_se'))} | {a['tool_call_rate']:.3f} | "
                f"{with_se(a['pass_at_k']['4'], a.get('pass_at_k_se', {}).get('4'))} | {min(late):.3f} | "
                f"{s['wall_s'] / 60:.1f} |"
            )
    print(
        "\n| variant | mean gain ± se over seeds | smallest gain | mean with-tool change | seeds where with-tool "
        "accuracy fell |"
    )
    print("|---|---|---|---|---|")
    for variant, rows in runs.items():
        gains = [s["after"]["accuracy"] - s["before"]["accuracy"] for _, s, _ in rows]
        tool = [s["after"]["accuracy_with_tool"] - s["before"]["accuracy_with_tool"] for _, s, _ in rows]
        print(
            f"| {variant} | {with_se(_mean(gains), clustered_se(gains, [1] * len(gains)), '+.3f')} | "
            f"{min(gains):+.3f} | {_mean(tool):+.3f} | "
            f"{sum(t < 0 for t in tool)} of {len(tool)} |"
        )
    from retool.teacher import teacher_results

    se_over_seeds = lambda xs: with_se(_mean(xs), clustered_se(xs, [1] * len(xs)))  # noqa: E731
    points = {
        v: [_heldout_points(metrics, s) for metrics, (_, s, _) in zip(curves[v], rows)] for v, rows in runs.items()
    }
    steps = sorted({step for per_seed in points.values() for run in per_seed for step, *_ in run})
    print(
        "\nHeld-out accuracy, mean ± se over seeds: at step 0 and the last step the evaluations before and after, "
        "between them the periodic ones (the first eval_every_problems of those problems)."
    )
    print(
        "| variant | "
        + " | ".join(f"held-out at step {step}" for step in steps)
        + " | training wall to the last step (min) |"
    )
    print("|---|" + "---|" * (len(steps) + 1))
    for variant, per_seed in points.items():
        at_step = [[acc for run in per_seed for step, _, acc, _ in run if step == at] for at in steps]
        print(
            f"| {variant} | "
            + " | ".join(se_over_seeds(accs) if accs else "n/a" for accs in at_step)
            + f" | {_mean([run[-1][1] for run in per_seed]) / 60:.1f} |"
        )
    known = [  # the embedded-rl teachers of the runs (a teacher of the user's records no results)
        t
        for rows in runs.values()
        for _, s, _ in rows
        if (t := teacher_results(s.get("config", {}).get("training", {}).get("teacher_model_name_or_path")))
    ]
    if known:
        teacher = known[0]
        print(
            f"\nteacher: {teacher['model']}: held-out accuracy {with_se(teacher['accuracy'], teacher['accuracy_se'])}, "
            f"tool-call rate {teacher['tool_call_rate']:.3f} after {teacher['steps']} steps of its RL recipe"
        )
        print(
            "\n| variant | held-out after, mean ± se over seeds | gap to the teacher (points) | tool-call rate after "
            "(x the teacher's) | teacher KL, first 5 steps -> last 5 | teacher forward's share of the step time | "
            "step wall (s, mean) |"
        )
        print("|---|---|---|---|---|---|---|")
        for variant, rows in runs.items():
            after = [s["after"]["accuracy"] for _, s, _ in rows]
            gaps = [100 * (a - teacher["accuracy"]) for a in after]
            calls = _mean([s["after"]["tool_call_rate"] for _, s, _ in rows])
            records = [r for metrics in curves[variant] for r in metrics]
            kl = [
                [r["advantage/teacher_kl"] for r in metrics if "advantage/teacher_kl" in r]
                for metrics in curves[variant]
            ]
            step_s = sum(r.get("timing/step_s", 0.0) for r in records)
            forward_s = sum(r.get("timing/teacher_forward_s", 0.0) for r in records)
            gap = with_se(_mean(gaps), clustered_se(gaps, [1] * len(gaps)), "+.1f")
            print(
                f"| {variant} | {se_over_seeds(after)} | {gap} | "
                f"{calls:.3f} ({calls / teacher['tool_call_rate']:.2f}x) | "
                + (
                    f"{_mean([_mean(k[:5]) for k in kl]):.3f} -> {_mean([_mean(k[-5:]) for k in kl]):.3f}"
                    if all(kl)
                    else "n/a"
                )
                + (f" | {forward_s / step_s:.1%} | " if forward_s and step_s else " | n/a | ")
                + f"{step_s / len(records) if records else float('nan'):.2f} |"
            )
    if any(s["after"].get("recovery_rate") is not None for rows in runs.values() for _, s, _ in rows):
        print(
            "\n| variant | seed | tool calls per solved before -> after | samples with a failed call before -> after | "
            "solved after a failed call before -> after |"
        )
        print("|---|---|---|---|---|")
        for variant, rows in runs.items():
            for seed, s, _ in rows:
                b, a = s["before"], s["after"]
                cell = lambda key, fmt: " -> ".join("n/a" if r.get(key) is None else f"{r[key]:{fmt}}" for r in (b, a))  # noqa: E731
                print(
                    f"| {variant} | {seed} | {cell('tool_calls_per_solved', '.2f')} | "
                    f"{cell('failed_call_frac', '.3f')} | "
                    f"{cell('recovery_rate', '.3f')} |"
                )
    stale = {
        v: per_seed
        for v, per_seed in curves.items()
        if any(r.get("train/staleness_mean", 0) > 0 for metrics in per_seed for r in metrics)
    }
    if stale:
        print(
            "\n| variant | mean staleness of trained tokens (steps) | on-policy token share | mean gain ± se over "
            "seeds | "
            "step wall (s, mean) |"
        )
        print("|---|---|---|---|---|")
        for variant, per_seed in curves.items():
            records = [r for metrics in per_seed for r in metrics if "train/staleness_mean" in r]
            gains = [s["after"]["accuracy"] - s["before"]["accuracy"] for _, s, _ in runs[variant]]
            steps = [r["timing/step_s"] for metrics in per_seed for r in metrics if "timing/step_s" in r]
            print(
                f"| {variant} | {_mean([r['train/staleness_mean'] for r in records]) if records else 0:.2f} | "
                f"{_mean([r['train/on_policy_token_frac'] for r in records]) if records else 1:.2f} | "
                f"{with_se(_mean(gains), clustered_se(gains, [1] * len(gains)), '+.3f')} | "
                f"{_mean(steps) if steps else float('nan'):.2f} |"
            )
    sampled = {
        v: list(zip([seed for seed, *_ in runs[v]], per_seed))
        for v, per_seed in curves.items()
        if any("dynamic_sampling/draw_factor" in r for metrics in per_seed for r in metrics)
    }
    if sampled:
        print(
            "\n| variant | seed | groups rolled out per step's groups (mean, max) | steps short of groups | "
            "informative share of groups drawn, first 5 steps -> last 5 |"
        )
        print("|---|---|---|---|---|")
        for variant, rows in sampled.items():
            for seed, metrics in rows:
                factors = [r["dynamic_sampling/draw_factor"] for r in metrics]
                share = [r["dynamic_sampling/informative_frac"] for r in metrics]
                print(
                    f"| {variant} | {seed} | {_mean(factors):.2f}, {max(factors):.2f} | "
                    f"{sum(r['dynamic_sampling/short_groups'] > 0 for r in metrics)} of {len(metrics)} | "
                    f"{_mean(share[:5]):.2f} -> {_mean(share[-5:]):.2f} |"
                )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    colours = {variant: f"C{k}" for k, variant in enumerate(curves)}  # matplotlib's 10-colour cycle, one per variant
    for variant, per_seed in curves.items():
        for k, metrics in enumerate(per_seed):
            label = variant if k == 0 else None
            run = points[variant][k]
            style = {"color": colours[variant], "marker": "o", "alpha": 0.7, "label": label}
            axes[0].plot([p[0] for p in run], [p[2] for p in run], **style)
            axes[1].plot([p[0] for p in run], [float("nan") if p[3] is None else p[3] for p in run], **style)
            axes[2].plot([p[1] / 60 for p in run], [p[2] for p in run], **style)
            axes[3].plot(
                [r["step"] for r in metrics],
                [train_accuracy(r) for r in metrics],
                color=colours[variant],
                alpha=0.5,
                label=label,
            )
    if known:
        for ax in (axes[0], axes[2]):
            ax.axhline(teacher["accuracy"], color="k", linestyle="--", linewidth=1, label="teacher")
    titles = (
        "held-out accuracy (start and end: 128 problems x 4; between: 64 x 4)",
        "held-out accuracy when the tool is called",
        "held-out accuracy against training wall time",
        "train-batch accuracy",
    )
    for ax, title, xlabel in zip(axes, titles, ("step", "step", "minutes (sum of step times)", "step")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    print(f"figure: {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
