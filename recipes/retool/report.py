"""The recipe's report: metrics read back, the run's plot and the closing summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

__all__ = [
    "read_metrics",
    "train_accuracy",
    "reward_component_keys",
    "plot_run",
    "with_se",
    "accuracy_gain",
    "format_summary",
]


def read_metrics(path: str | Path) -> list[dict]:
    """The per-step records of a run's ``metrics.jsonl`` (those with ``reward/total``), in step order."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "reward/total" in record:
                records.append(record)
    return sorted(records, key=lambda r: r["step"])


def train_accuracy(record: dict) -> float | None:
    """Share of the step's trajectories answered right: from its ``reward/correct`` (+1 / -1 per trajectory), else its
    ``reward/reasoning_gym`` (a ``--task reasoning_gym`` run: the mean of the datasets' own scores, the share right
    where they give no partial credit, as chain_sum's 0 / 1); None without either."""
    value = record.get("reward/correct")
    if value is not None:
        return (value + 1.0) / 2.0
    return record.get("reward/reasoning_gym")


NOT_COMPONENTS = ("reward/total", "reward/verifier_error_rate")
"""``reward/*`` metrics that are not a reward component's mean."""


def reward_component_keys(metrics: Sequence[dict], components: Sequence[str] | None = None) -> list[str]:
    """The ``reward/<component>`` keys to plot: those of ``components`` found in ``metrics`` (in that order), or,
    without ``components``, every ``reward/*`` key but :data:`NOT_COMPONENTS`, in first-seen order."""
    seen = list(dict.fromkeys(k for r in metrics for k in r if k.startswith("reward/") and k not in NOT_COMPONENTS))
    if components is None:
        return seen
    return [f"reward/{c}" for c in components if f"reward/{c}" in seen]


def plot_run(
    metrics: Sequence[dict],
    path: str | Path,
    *,
    before: dict | None = None,
    after: dict | None = None,
    title: str = "ReTool PPO",
    reward_components: Sequence[str] | None = None,
) -> Path:
    """PNG of the total reward, each reward component (``reward/<component>``, unweighted means), accuracy and
    tool calls per step, on whole-step axes; the periodic held-out evaluation (``heldout/*``) as curves,
    held-out accuracy before/after as markers. ``reward_components``: the run's components (default: every
    ``reward/*`` key of ``metrics`` but the total and the verifier error rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in metrics]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    axes[0].plot(steps, [r["reward/total"] for r in metrics], marker=".")
    axes[0].set_title("reward (train batch, weighted total)")
    for key in reward_component_keys(metrics, reward_components):
        with_key = [r for r in metrics if key in r]
        axes[1].plot([r["step"] for r in with_key], [r[key] for r in with_key], marker=".", label=key.split("/", 1)[1])
    axes[1].set_title("reward components (train batch)")
    if axes[1].lines:
        axes[1].legend(fontsize=7, loc="best")
    acc_ax, tool_ax = axes[2], axes[3]
    acc = [train_accuracy(r) for r in metrics]
    acc_ax.plot(steps, acc, marker=".", label="train batch")
    last = steps[-1] if steps else 0
    periodic = [r for r in metrics if "heldout/accuracy" in r]
    if periodic:
        acc_ax.plot(
            [r["step"] for r in periodic],
            [r["heldout/accuracy"] for r in periodic],
            marker="o",
            label="held-out (periodic)",
        )
        with_tool = [r for r in periodic if "heldout/accuracy_with_tool" in r]
        acc_ax.plot(
            [r["step"] for r in with_tool],
            [r["heldout/accuracy_with_tool"] for r in with_tool],
            marker="o",
            linestyle="--",
            label="held-out, when the tool is called",
        )
    if before is not None:
        acc_ax.scatter([0], [before["accuracy"]], color="tab:red", zorder=3, label="held-out, before RL")
    if after is not None:
        acc_ax.scatter([last], [after["accuracy"]], color="tab:green", zorder=3, label="held-out, after RL")
    acc_ax.set_title("accuracy")
    acc_ax.set_ylim(-0.02, 1.02)
    acc_ax.legend(fontsize=7, loc="lower right")
    tool_ax.plot(steps, [r.get("rollout/tool_calls_mean", 0.0) for r in metrics], marker=".")
    tool_ax.set_title("tool calls per trajectory")
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 1.25, 1.5, ... ticks
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(value: float | None, se: float | None = None) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f}%" + ("" if se is None else f" ± {100 * se:.1f}")


def with_se(value: float, se: float | None, fmt: str = ".3f") -> str:
    """``value`` and, when known, ``± se`` in the same format (tables of results from older runs have no se)."""
    return f"{value:{fmt}}" + ("" if se is None else f" ± {se:{fmt.lstrip('+')}}")


def accuracy_gain(before: dict, after: dict) -> dict:
    """``after["accuracy"] - before["accuracy"]`` with its standard error: paired by problem when both
    evaluated the same problems (:func:`trl_plugins.evaluation.paired_difference_se`), else from the two
    standard errors as if independent; ``se`` None when neither is known."""
    from trl_plugins.evaluation import paired_difference_se

    gain = after["accuracy"] - before["accuracy"]
    se = paired_difference_se(before.get("correct_by_problem") or {}, after.get("correct_by_problem") or {})
    if se is not None:
        return {"accuracy": gain, "se": se, "paired": True}
    ses = (before.get("accuracy_se"), after.get("accuracy_se"))
    return {"accuracy": gain, "se": None if None in ses else (ses[0] ** 2 + ses[1] ** 2) ** 0.5, "paired": False}


def format_summary(
    before: dict | None, after: dict | None, *, steps: int, wall_s: float, paths: dict[str, str | None]
) -> str:
    """The recipe's closing summary as text: each held-out accuracy and pass@k with ± one standard error
    (clustered by problem), and the gain with its paired standard error and 95% interval."""
    lines = ["", "=" * 72, "ReTool PPO summary", "-" * 72]
    if before and after:
        lines.append(
            f"held-out problems: {after['problems']} x {after['samples']} samples (± one standard error, "
            f"clustered by problem)"
        )
        lines.append(f"{'':28}{'before RL':>16}{'after RL':>16}")
        for label, key, se in (
            ("accuracy (pass@1)", "accuracy", True),
            ("tool-call rate", "tool_call_rate", False),
            ("accuracy with the tool", "accuracy_with_tool", True),
            ("accuracy without the tool", "accuracy_without_tool", True),
            ("truncated", "truncated_frac", False),
        ):
            cells = [_pct(r.get(key), r.get(f"{key}_se") if se else None) for r in (before, after)]
            lines.append(f"{label:28}{cells[0]:>16}{cells[1]:>16}")
        if any(r.get("tool_calls_per_solved") is not None for r in (before, after)):
            cells = [
                "n/a" if r.get("tool_calls_per_solved") is None else f"{r['tool_calls_per_solved']:.2f}"
                for r in (before, after)
            ]
            lines.append(f"{'tool calls per solved':28}{cells[0]:>16}{cells[1]:>16}")
        if any(r.get("failed_call_frac") for r in (before, after)):
            lines.append(
                f"{'samples with a failed call':28}{_pct(before.get('failed_call_frac')):>16}"
                f"{_pct(after.get('failed_call_frac')):>16}"
            )
            lines.append(
                f"{'  ... that still solved it':28}{_pct(before.get('recovery_rate')):>16}"
                f"{_pct(after.get('recovery_rate')):>16}"
            )
        for k in sorted(after.get("pass_at_k", {}), key=int):
            if int(k) > 1:
                cells = [_pct(r["pass_at_k"].get(k), (r.get("pass_at_k_se") or {}).get(k)) for r in (before, after)]
                lines.append(f"{f'pass@{k}':28}{cells[0]:>16}{cells[1]:>16}")
        gain = accuracy_gain(before, after)
        line = f"held-out accuracy gain: {100 * gain['accuracy']:+.1f} points"
        if gain["se"] is not None:
            low, high = (100 * (gain["accuracy"] + z * gain["se"]) for z in (-1.96, 1.96))
            line += (
                f" ± {100 * gain['se']:.1f} ({'paired by problem' if gain['paired'] else 'unpaired'}; "
                f"95% interval {low:+.1f} to {high:+.1f})"
            )
        lines.append(line)
    lines.append(f"steps: {steps}   wall time: {wall_s / 60:.1f} min")
    for name, value in paths.items():
        if value:
            lines.append(f"{name + ':':12} {value}")
    lines.append("=" * 72)
    return "\n".join(lines)
