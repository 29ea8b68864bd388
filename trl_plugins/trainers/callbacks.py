"""What the trainer does at the edges of each step, as HF ``TrainerCallback`` s on its public API: the ranks' agreement
to stop, the optimizer's time, the step's peak memory, the run's saved config, the trajectory viewer's pages and the W&B
trajectory tables.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import TrainerCallback

from trl_plugins.run.saved import save_run_config
from trl_plugins.trainers.memory import peak_memory_mb
from trl_plugins.trainers.ranks import reduce_over_ranks
from trl_plugins.trainers.trajectory_table import TURN_COLUMNS, trajectory_columns, trajectory_rows, turn_rows
from trl_plugins.viewer import write_step_pages

__all__ = ["StopAtStepEnd", "OptimizerTimer", "PeakMemory", "SaveRunConfig", "ViewerPages", "log_trajectory_tables"]

logger = logging.getLogger(__name__)


class StopAtStepEnd(TrainerCallback):
    """At every step's end the ranks agree whether a stop was requested; if so the step is saved and the
    loop ends (``MultiTurnGRPOTrainer.train`` then raises :class:`TrainingInterrupted`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        signum = self.trainer.stop_agreed()
        if signum:
            self.trainer.stop_after_this_step(signum)
            control.should_save = True
            control.should_training_stop = True


class OptimizerTimer(TrainerCallback):
    """Times the HF loop's optimizer step (``timing/optimizer_s``, this rank's)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.start = trainer, 0.0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start = time.perf_counter()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.record_metrics({"timing/optimizer_s": time.perf_counter() - self.start})


class PeakMemory(TrainerCallback):
    """At each step's end, the step's peak memory (reset when the step started: ``training_step``), so that the
    HF loop's optimizer step after ``training_step`` counts too; the maximum over ranks (one all-reduce)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        peaks = peak_memory_mb()
        keys = sorted(peaks)
        values = reduce_over_ranks(self.trainer.accelerator, [peaks[k] for k in keys], "max")
        self.trainer.record_metrics(dict(zip(keys, values)))


class SaveRunConfig(TrainerCallback):
    """When training starts, the run's config and tokenizer go to ``output_dir/run_config/``
    (:func:`trl_plugins.run.saved.save_run_config`), beside the batches the viewer saves, so that a saved batch can be
    re-scored without a checkpoint of its step (docs/replay.md). Main process only, no collective; a failure to
    write is raised, before any step has run (a checkpoint would fail the same way later)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.accelerator.is_main_process:
            save_run_config(args.output_dir, args, self.trainer.processing_class)


class ViewerPages(TrainerCallback):
    """At the end of every ``args.viewer_steps``-th step, draw the trainer's last rollout batch
    (:func:`trl_plugins.viewer.write_step_pages` under ``output_dir/trajectories/``; logged to W&B when W&B is on).

    It reads ``trainer.last_batch``: the trajectories, their datums and dataset rows, and why the update left each
    out, as the batch builder recorded it. File I/O on the main process only, no collective. The W&B page is logged
    uncommitted, so it goes out with the step's metrics. A page that cannot be written (a full disk, say) is logged
    as an error with its traceback; training goes on.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        every, step, trainer = args.viewer_steps, state.global_step, self.trainer
        batch = trainer.last_batch
        if (
            not every
            or step % every
            or not trainer.accelerator.is_main_process
            or batch is None
            or not batch.trajectories
        ):
            return
        try:
            json_path, html_path = write_step_pages(
                args.output_dir,
                step,
                batch.trajectories,
                batch.datums,
                trainer.processing_class,
                log_to_wandb="wandb" in (args.report_to or []),
                rows=batch.rows,
                left_out=batch.left_out,
                forwarded=batch.forwarded,
                update_skipped=batch.update_skipped,
                max_trajectories=args.viewer_trajectories,
                version=trainer.run.version,
                tool_schemas=trainer.run.chat.tools,
                chat_settings=chat_settings(trainer.run),
            )
        except Exception:  # a diagnostic page must not end a run that has trained fine: said loudly, training goes on
            logger.exception("trajectory viewer: the page of step %d could not be written (training continues)", step)
            return
        logger.info("trajectory viewer: %s (batch: %s)", html_path, json_path)


def chat_settings(run: Any) -> dict[str, Any]:
    """What a replay needs to rebuild ``run``'s chat format and each turn's prompt (a saved batch's ``chat``)."""
    c, chat = run.config, run.chat
    return {
        "system_prompt": c.system_prompt,
        "final_answer_pattern": c.final_answer_pattern,
        "stop_tokens": list(chat.stop_tokens),
        "calls_per_turn": chat.calls_per_turn,
        "chat_template_kwargs": dict(chat.template_kwargs),
        "max_tool_response_tokens": getattr(run.rollout.impl, "max_tool_response_tokens", None),
    }


def log_trajectory_tables(trainer: Any, step: int) -> bool:
    """Log the W&B trajectory tables of ``trainer.last_batch`` (every ``trajectory_table_steps`` steps, once per step,
    main process); True when this step is one to log (whether or not W&B is on)."""
    every, batch = trainer.args.trajectory_table_steps, trainer.last_batch
    if not every or step % every or batch is None or not batch.trajectories:
        return False
    if "wandb" not in (trainer.args.report_to or []):
        return True
    import wandb

    if wandb.run is None:
        return True
    names, limit = trainer.run.reward_names(), trainer.args.trajectory_table_rows
    rows = trajectory_rows(batch.trajectories, batch.rows, step=step, reward_names=names, max_rows=limit)
    turns = turn_rows(batch.trajectories, step=step, max_rows=limit)
    wandb.log(
        {
            "trajectories": wandb.Table(columns=trajectory_columns(names), data=rows),
            "trajectory_turns": wandb.Table(columns=TURN_COLUMNS, data=turns),
        },
        commit=False,
    )
    return True
