"""The trainer's trajectory viewer pages: every ``viewer_steps`` steps, the main process saves its batch and the page
(:func:`trl_plugins.viewer.write_step_pages`) under ``output_dir/trajectories/``, and logs it to W&B when W&B is on."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from trl_plugins.trainers.step import datums_to_forward
from trl_plugins.viewer import write_step_pages

__all__ = ["ViewerPages"]

logger = logging.getLogger(__name__)


class ViewerPages(TrainerCallback):
    """At the end of every ``args.viewer_steps``-th step, draw the trainer's last rollout batch.

    It reads what :class:`~trl_plugins.trainers.multi_turn_trainer.MultiTurnGRPOTrainer` keeps of its last
    rollout (trajectories, datums, dataset rows, training mask); file I/O on the main process only, no
    collective. The W&B page is logged uncommitted, so it goes out with the step's metrics. A page that
    cannot be written (a full disk, say) is logged as an error with its traceback; training goes on.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        every, step, trainer = args.viewer_steps, state.global_step, self.trainer
        if not every or step % every or not trainer.accelerator.is_main_process or not trainer._last_trajectories:
            return
        datums = trainer._last_datums
        forwarded = {datums[i].trajectory_index for i in datums_to_forward(datums, trainer._plugins.policy_loss, args)}
        try:
            json_path, html_path = write_step_pages(
                args.output_dir, step, trainer._last_trajectories, datums, trainer.processing_class,
                log_to_wandb="wandb" in (args.report_to or []), rows=trainer._last_rows, masked=trainer._last_masked,
                forwarded=forwarded, mask_truncated=args.truncated_policy == "mask", update_skipped=trainer._update_skipped,
                max_trajectories=args.viewer_trajectories,
            )
        except Exception:  # a diagnostic page must not end a run that has trained fine: said loudly, training goes on
            logger.exception("trajectory viewer: the page of step %d could not be written (training continues)", step)
            return
        logger.info("trajectory viewer: %s (batch: %s)", html_path, json_path)
