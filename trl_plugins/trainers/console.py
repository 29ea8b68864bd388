"""What a training run prints per logging step: one compact line instead of the HF Trainer's dict.

The HF Trainer prints every logged metric (some 70 keys here) through ``ProgressCallback`` (under tqdm's
bar) or ``PrinterCallback`` (``disable_tqdm``). With ``console_metrics="compact"`` the trainer swaps them
for the subclasses below, which print :func:`compact_line` instead (tqdm's bar unchanged); every metric
still goes to ``metrics.jsonl`` and the loggers (W&B, ...). ``console_metrics="full"`` keeps HF's own.
"""

from __future__ import annotations

from typing import Any, Mapping

from transformers import PrinterCallback, ProgressCallback

__all__ = ["compact_line", "CompactProgressCallback", "CompactPrinterCallback", "use_compact_console"]

_NOT_COMPONENTS = ("total", "verifier_error_rate", "kl_penalty")


def _num(x: float) -> str:
    """3 significant digits, k/M for thousands/millions (``4.1k``, ``0.0123``, ``-1.2``)."""
    a = abs(x)
    if a >= 1e6:
        return f"{x / 1e6:.3g}M"
    if a >= 999.5:  # what .3g would print as 1e+03 and up
        return f"{x / 1e3:.3g}k"
    return f"{x:.3g}"


def compact_line(logs: Mapping[str, Any], *, step: int, max_steps: int | None = None) -> str:
    """One line for a logged record: ``step 3/40 | reward 0.41 | correct 0.55 | tools 1.2 | loss 0.012 | kl 0.003 |
    gen 850 tok/s | train 4.1k tok/s | 12.3 s | rss 1.9 GB`` (each part only when its metric is in ``logs``).

    Parts: ``reward/total`` and each reward component (``reward/<name>``), ``rollout/tool_calls_mean``,
    ``train/policy_loss`` (else ``loss``), the reference KL ``train/kl_k3`` (``beta > 0``),
    ``rollout/generated_tokens_per_s``, ``train/forward_tokens_per_s``, ``timing/step_s``, ``memory/peak_rss_mb``
    and ``memory/cuda_max_allocated_mb``, ``heldout/accuracy``; a record with none of them (the end-of-training
    summary, an evaluation) is printed as ``key value`` pairs.
    """

    def has(key: str) -> bool:
        return isinstance(logs.get(key), (int, float)) and not isinstance(logs.get(key), bool)

    head = f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"
    parts = []
    if has("reward/total"):
        parts.append(f"reward {_num(logs['reward/total'])}")
    for key in logs:
        name = key[len("reward/") :] if key.startswith("reward/") else None
        if name and "/" not in name and name not in _NOT_COMPONENTS and has(key):
            parts.append(f"{name} {_num(logs[key])}")
    loss = "train/policy_loss" if has("train/policy_loss") else "loss"
    # (metric, "<label> {value}<unit>", scale): each part only when its metric is in the record.
    for key, label, scale, fmt in (
        ("rollout/tool_calls_mean", "tools {}", 1, _num),
        (loss, "loss {}", 1, _num),
        ("train/kl_k3", "kl {}", 1, _num),
        ("heldout/accuracy", "heldout {}", 1, _num),
        ("rollout/generated_tokens_per_s", "gen {} tok/s", 1, _num),
        ("train/forward_tokens_per_s", "train {} tok/s", 1, _num),
        ("timing/step_s", "{} s", 1, _num),
        ("timing/trainer_idle_s", "idle {} s", 1, _num),  # async: the trainer's wait for its sampler
        ("memory/peak_rss_mb", "rss {} GB", 1024, lambda v: f"{v:.2g}"),
        ("memory/cuda_max_allocated_mb", "gpu {} GB", 1024, lambda v: f"{v:.3g}"),
    ):
        if has(key):
            parts.append(label.format(fmt(logs[key] / scale)))
    if not parts:  # not a training step's record: show what it holds, briefly
        parts = [f"{k} {_num(v) if isinstance(v, float) else v}" for k, v in logs.items() if k != "total_flos"]
    return " | ".join([head, *parts])


class CompactProgressCallback(ProgressCallback):
    """HF's progress bar, writing :func:`compact_line` above it instead of the whole dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs:
            self.training_bar.write(compact_line(logs, step=state.global_step, max_steps=state.max_steps))


class CompactPrinterCallback(PrinterCallback):
    """HF's printer (``disable_tqdm``), printing :func:`compact_line` instead of the whole dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_local_process_zero and logs:
            print(compact_line(logs, step=state.global_step, max_steps=state.max_steps), flush=True)


def use_compact_console(trainer: Any) -> None:
    """Replace the trainer's HF ``ProgressCallback``/``PrinterCallback`` by the compact ones (other progress
    callbacks, e.g. the notebook's table, are left alone)."""
    for old, new in ((ProgressCallback, CompactProgressCallback), (PrinterCallback, CompactPrinterCallback)):
        if any(type(cb) is old for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(old)
            trainer.add_callback(new)
