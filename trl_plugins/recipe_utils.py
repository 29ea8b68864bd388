"""Shared pieces of the recipes: task loading, CPU defaults, W&B set-up, the plot and the summary."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "load_task_rows",
    "answer_paths",
    "cpu_defaults",
    "configure_wandb",
    "read_metrics",
    "train_accuracy",
    "plot_run",
    "format_summary",
    "run_eval_subprocess",
]


def load_task_rows(
    dataset_name: str | None,
    split: str,
    *,
    size: int | None,
    seed: int = 0,
    dataset_config: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
) -> list[dict]:
    """Rows ``{"id", "prompt", "answer"}`` of a split: the bundled arithmetic task when ``dataset_name``
    is None, else a Hub dataset or a local path/file loaded with ``datasets.load_dataset``. A dotted
    column name reads a nested field (e.g. ``reward_model.ground_truth`` in DAPO-style sets).

    Raises:
        ValueError: a missing column or split, named with what exists.
    """
    if dataset_name is None:
        from trl_plugins.embedded import arithmetic_problems

        return arithmetic_problems(size or 1000, seed=seed, split=split)
    import datasets

    path = Path(dataset_name)
    if path.is_file():
        fmt = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if fmt is None:
            raise ValueError(f"cannot read {path}: use a .jsonl, .json, .csv or .parquet file, or a dataset directory.")
        ds = datasets.load_dataset(fmt, data_files={split: str(path)}, split=split)
    else:
        try:
            ds = datasets.load_dataset(dataset_name, dataset_config, split=split)
        except ValueError as exc:
            raise ValueError(f"could not load split {split!r} of {dataset_name!r}: {exc}") from exc
    missing = [c for c in (prompt_column, answer_column) if c.split(".")[0] not in ds.column_names]
    if missing:
        raise ValueError(
            f"dataset {dataset_name!r} ({split}) has no column(s) {missing}; it has {ds.column_names}. "
            f"Set --prompt_column/--answer_column."
        )
    if size is not None and size < len(ds):
        ds = ds.shuffle(seed=seed).select(range(size))
    return [
        {"id": str(row.get("id", f"{split}-{i}")), "prompt": _field(row, prompt_column), "answer": str(_field(row, answer_column))}
        for i, row in enumerate(ds)
    ]


def _field(row: dict, column: str) -> Any:
    """``row[column]``; a dotted name reads a nested field (``reward_model.ground_truth``)."""
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"row has no field {column!r} (stopped at {part!r}); set --prompt_column/--answer_column.")
        value = value[part]
    return value


def answer_paths(dataset_name: str | None) -> list[str]:
    """Host paths where a dataset's reference answers may lie, to hide from model-written code.

    The Hugging Face datasets and hub caches, and ``dataset_name`` itself when it is a local path.
    The bundled task (``None``) is generated in memory: nothing to hide.
    """
    if dataset_name is None:
        return []
    import datasets.config
    import huggingface_hub.constants

    candidates = [datasets.config.HF_DATASETS_CACHE, huggingface_hub.constants.HF_HUB_CACHE]
    if Path(dataset_name).exists():
        candidates.append(dataset_name)
    out: list[str] = []
    for p in candidates:
        resolved = str(Path(p).expanduser().resolve())
        if Path(resolved).exists() and resolved not in out:
            out.append(resolved)
    return out


def _flag_given(argv: Sequence[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def cpu_defaults(argv: list[str], config_values: dict | None = None) -> list[str]:
    """Arguments to add on a machine without CUDA so that the trainer runs on the CPU correctly.

    Adds ``--bf16 false`` (bf16 autocast on CPU shifts log-probs by ~1e-3) and, for a distributed
    launch, what makes its process group work on CPU: ``--ddp_backend gloo`` under DeepSpeed, else
    ``--use_cpu true`` (without it a 2-process CPU launch trains two independent models). Anything
    the user set on the command line or in the YAML wins.
    """
    import torch

    if torch.cuda.is_available():
        return []
    given = set(config_values or {})
    extra: list[str] = []
    if not _flag_given(argv, "bf16") and "bf16" not in given:
        extra += ["--bf16", "false"]
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:
        if not _flag_given(argv, "ddp_backend") and "ddp_backend" not in given:
            extra += ["--ddp_backend", "gloo"]
    elif not _flag_given(argv, "use_cpu") and "use_cpu" not in given:
        extra += ["--use_cpu", "true"]
    return extra


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def configure_wandb(report_to: Sequence[str], output_dir: str, project: str | None) -> str | None:
    """Set W&B's environment for the run; returns the mode in force (None when W&B is not used).

    Offline when no API key is configured and ``WANDB_MODE`` is unset; run files go under
    ``<output_dir>/wandb`` unless ``WANDB_DIR`` is set.
    """
    if "wandb" not in (report_to or []):
        return None
    if "WANDB_MODE" not in os.environ and not _has_wandb_key():
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_DIR", os.path.abspath(output_dir))
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    if project:
        os.environ.setdefault("WANDB_PROJECT", project)
    return os.environ.get("WANDB_MODE", "online")


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
    """Share of the step's trajectories answered right, from its ``reward/correct`` (None without it)."""
    value = record.get("reward/correct")
    return None if value is None else (value + 1.0) / 2.0  # correct is +1 / -1 per trajectory


def plot_run(metrics: Sequence[dict], path: str | Path, *, before: dict | None = None, after: dict | None = None,
             title: str = "ReTool PPO") -> Path:
    """PNG of reward, accuracy and tool calls per step; held-out accuracy before/after as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["reward/total"] for r in metrics], marker=".")
    axes[0].set_title("reward (train batch)")
    acc = [train_accuracy(r) for r in metrics]
    axes[1].plot(steps, acc, marker=".", label="train batch")
    last = steps[-1] if steps else 0
    if before is not None:
        axes[1].scatter([0], [before["accuracy"]], color="tab:red", zorder=3, label="held-out, before RL")
    if after is not None:
        axes[1].scatter([last], [after["accuracy"]], color="tab:green", zorder=3, label="held-out, after RL")
    axes[1].set_title("accuracy")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize=7, loc="lower right")
    axes[2].plot(steps, [r.get("rollout/tool_calls_mean", 0.0) for r in metrics], marker=".")
    axes[2].set_title("tool calls per trajectory")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(value: float | None) -> str:
    return "  n/a" if value is None else f"{100 * value:5.1f}%"


def format_summary(before: dict | None, after: dict | None, *, steps: int, wall_s: float,
                   paths: dict[str, str | None]) -> str:
    """The recipe's closing summary as text."""
    lines = ["", "=" * 72, "ReTool PPO summary", "-" * 72]
    if before and after:
        lines.append(f"held-out problems: {after['problems']} x {after['samples']} samples")
        lines.append(f"{'':28}{'before RL':>12}{'after RL':>12}")
        for label, key in (("accuracy (pass@1)", "accuracy"), ("tool-call rate", "tool_call_rate"),
                           ("accuracy with the tool", "accuracy_with_tool"),
                           ("accuracy without the tool", "accuracy_without_tool"), ("truncated", "truncated_frac")):
            lines.append(f"{label:28}{_pct(before.get(key)):>12}{_pct(after.get(key)):>12}")
        for k in sorted(after.get("pass_at_k", {}), key=int):
            if int(k) > 1:
                lines.append(f"{f'pass@{k}':28}{_pct(before['pass_at_k'].get(k)):>12}{_pct(after['pass_at_k'][k]):>12}")
        gain = after["accuracy"] - before["accuracy"]
        lines.append(f"held-out accuracy gain: {100 * gain:+.1f} points")
    lines.append(f"steps: {steps}   wall time: {wall_s / 60:.1f} min")
    for name, value in paths.items():
        if value:
            lines.append(f"{name + ':':12} {value}")
    lines.append("=" * 72)
    return "\n".join(lines)


def run_eval_subprocess(args: list[str], output_json: str) -> dict:
    """Run the evaluation CLI (``recipes/retool_eval.py``) in a clean child process and return its JSON result."""
    import subprocess

    from trl_plugins.embedded.default import child_env

    cmd = [sys.executable, "-m", "trl_plugins.eval_cli", *args, "--output_json", output_json]
    proc = subprocess.run(cmd, env=child_env(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the held-out evaluation failed (exit {proc.returncode}); its output is above. Command: {' '.join(cmd)}. "
            f"A dataset without a held-out split needs --dataset_test_split <split>, or --eval_problems 0 to skip it."
        )
    return json.loads(Path(output_json).read_text())
