"""How the trainer survives what stops a run: checkpoints marked complete only when every rank is done, resuming from
the newest complete one (checked before anything loads it), a safe stop on SIGINT/SIGTERM agreed by every rank, and
an emergency checkpoint when a single-process run fails. A mixin of
:class:`~trl_plugins.trainers.multi_turn_trainer.MultiTurnGRPOTrainer` (it overrides ``train`` and TRL's private
``_save_checkpoint``, both pinned by ``tests/test_trainer.py``)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from trl_plugins.trainers.checkpoints import (
    COMPLETE_MARKER,
    ResumePoint,
    mark_complete,
    resolve_resume,
    set_aside_damaged,
    trim_metrics_log,
)
from trl_plugins.trainers.critic import load_critic, save_critic
from trl_plugins.trainers.interrupts import StopSignals, TrainingInterrupted, die_with_launcher
from trl_plugins.trainers.ranks import reduce_over_ranks

__all__ = ["NoPolicyUpdate", "Resilient", "StopAgreed"]

logger = logging.getLogger(__name__)


class StopAgreed(Exception):
    """Every rank agreed to stop mid-step (raised inside the HF loop, turned into :class:`TrainingInterrupted`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class NoPolicyUpdate(RuntimeError):
    """A run trained nothing: it finished without one policy update (a configured warm-up aside), or made none in
    ``max_steps_without_update`` steps in a row. Raised by ``train`` after the run's end (its checkpoints are written),
    or at the step that reached the limit; the message says why the steps were skipped."""

    def __init__(self, message: str, *, finished: bool) -> None:
        super().__init__(message)
        self.finished = finished
        """The run went to its end (its last checkpoint written as configured); else it stopped at the limit."""


class Resilient:
    """Checkpoints, resume, safe stops and emergency checkpoints for the trainer it is mixed into."""

    _stop: StopSignals | None = None
    _stop_signum: int = 0
    policy_updates: int = 0
    """Steps of this ``train`` call that updated the policy."""
    _skips_in_a_row: int = 0
    _steps_for_update: int = 0  # steps of this train call that could have updated the policy (not a warm-up)
    _last_skip: str | None = None

    def _count_update(self, skipped: str | None, *, warmup: bool, limit: int) -> None:
        """Account one step's update (every rank alike: the skip is decided over the ranks); raises
        :class:`NoPolicyUpdate` at ``limit`` skipped steps in a row (0: never)."""
        if warmup:
            return
        self._steps_for_update += 1
        if skipped is None:
            self.policy_updates += 1
            self._skips_in_a_row = 0
            return
        self._skips_in_a_row += 1
        self._last_skip = skipped
        if limit and self._skips_in_a_row >= limit:
            raise NoPolicyUpdate(
                f"{self._skips_in_a_row} steps in a row made no policy update (max_steps_without_update={limit}); the "
                f"last one: {skipped}. Nothing is being trained: check the rewards vary within a group (the reward "
                "components, the task's difficulty), what the left-out reasons say, or set "
                "max_steps_without_update=0.",
                finished=False,
            )

    _critic: Any = None
    _critic_optimizer: Any = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's save, then a completion marker once every rank is done, then rotation.

        Older checkpoints are rotated out only after the new one is marked complete (the HF loop
        rotates inside its save): a crash mid-save always leaves the previous checkpoint intact.
        """
        from transformers.trainer_utils import rotate_checkpoints

        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if self._critic is not None:
            save_critic(self.accelerator, self._critic, self._critic_optimizer, folder)
            self.accelerator.wait_for_everyone()  # the marker lists every rank's files
        if self.args.should_save:
            mark_complete(
                folder,
                global_step=self.state.global_step,
                tokenizer_digest=self.run.chat.digest,
                version=self.run.version,
            )
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )

    def train(self, resume_from_checkpoint: str | bool | ResumePoint | None = None, *args: Any, **kwargs: Any) -> Any:
        """As ``Trainer.train``; ``resume_from_checkpoint`` ``True``, ``"true"`` or ``"latest"`` (any case) takes the
        newest *complete* checkpoint of ``output_dir``; a :class:`~trl_plugins.trainers.checkpoints.ResumePoint`
        (what a recipe resolved before the model loaded) is taken as it is.

        A checkpoint named here is checked before anything loads it
        (:func:`~trl_plugins.trainers.checkpoints.resolve_resume`):
        a damaged one is refused naming the file (:class:`~trl_plugins.trainers.checkpoints.CheckpointDamaged`),
        or with ``resume_fallback`` the previous complete one is taken (the damaged one moved aside). The step
        and folder resumed from are logged and printed; the interrupted run's records after that step are moved
        out of ``metrics.jsonl`` (:func:`~trl_plugins.trainers.checkpoints.trim_metrics_log`), so the file has
        each step once.

        On an exception in a single-process run, an emergency checkpoint is saved to
        ``output_dir/checkpoint-<step>`` (unless that step has a complete one) and the exception is
        re-raised. With several processes it is not attempted: saving is a collective, and the other
        ranks may be stuck in a different one. On SIGINT/SIGTERM every rank stops at a safe point,
        saves the step together and :class:`TrainingInterrupted` is raised (see ``interrupts``); the
        run's plugins are closed however training ends.

        Raises:
            NoPolicyUpdate: the run trained nothing. ``finished=True``: it went to its end (every step, logging and
                checkpoint as configured) without one policy update, a configured warm-up aside; the caller may still
                save the model (unchanged) before it fails. ``finished=False``: ``max_steps_without_update`` steps in a
                row made none, so it stopped there. ``policy_updates`` counts this call's updates either way.
            RuntimeError: a step's trajectories failed the world (``max_environment_error_rate``) or the verifier
                (``max_verifier_error_rate``) beyond their limits; the message names the most common error.
        """
        if isinstance(resume_from_checkpoint, ResumePoint):
            point: ResumePoint | None = resume_from_checkpoint
        else:
            point = resolve_resume(
                resume_from_checkpoint,
                self.args.output_dir,
                fallback=self.args.resume_fallback,
                needs_optimizer=not self.args.save_only_model,
                max_steps=self.args.max_steps,
            )
        folder = None if point is None else point.folder
        if point is not None:
            self._prepare_resume(point)
            if self._critic is not None:
                load_critic(self.accelerator, self._critic, self._critic_optimizer, str(folder))
        self.policy_updates = self._skips_in_a_row = self._steps_for_update = 0
        die_with_launcher()
        self._stop = StopSignals(on_hard_stop=self._hard_stop)
        try:
            with self._stop:
                output = super().train(folder, *args, **kwargs)
            if self._stop_signum:  # stopped after a finished step (agreed at its end)
                raise self._interrupted(self._stop_signum)
            if self._steps_for_update and not self.policy_updates:
                raise NoPolicyUpdate(
                    f"the run finished without one policy update: all {self._steps_for_update} of its steps skipped it "
                    f"(the last: {self._last_skip}); its weights are the starting ones. Check the rewards vary "
                    "within a "
                    f"group (the reward components, the task's difficulty) and what the left-out reasons say.",
                    finished=True,
                )
            return output
        except StopAgreed as stop:  # stopped mid-step, before the update changed anything
            raise self._interrupted(stop.signum) from None
        except (TrainingInterrupted, NoPolicyUpdate):
            raise
        except Exception:
            self._emergency_checkpoint()
            raise
        finally:
            self._stop = None
            self._release_step_resources()
            self.run.close()

    def _release_step_resources(self) -> None:
        """Release what a step holds beyond the run's plugins (a generation replica); however training ends."""

    def _hard_stop(self) -> None:
        self._release_step_resources()
        self.run.close()

    def _prepare_resume(self, point: ResumePoint) -> None:
        """Say where the run resumes (log and stdout, main process); there, set damaged checkpoints aside and trim
        ``metrics.jsonl``."""
        main = self.accelerator.is_main_process

        def say(message: str, level: int = logging.INFO) -> None:
            if main:
                logger.log(level, "%s", message)
                print(message, flush=True)

        if point.skipped:
            self.accelerator.wait_for_everyone()  # every rank has checked them before they move
            for exc in point.skipped:
                say(
                    f"resume_fallback: {exc.file} is damaged ({exc.reason}); falling back to {point.folder}",
                    logging.WARNING,
                )
            if main:
                set_aside_damaged(point, log=lambda m: say(m, logging.WARNING))
        of = f" of {self.args.max_steps}" if self.args.max_steps and self.args.max_steps > 0 else ""
        say(f"resuming from step {point.step}{of}: {point.folder}")
        if main:
            moved, aside = trim_metrics_log(self.metrics_path, point.step)
            if moved:
                say(
                    f"metrics.jsonl: {moved} record(s) the interrupted run wrote after step {point.step} moved to "
                    f"{aside}; the file continues from step {point.step}"
                )

    def stop_agreed(self) -> int:
        """The signal of a stop any rank was asked for (0: none). A collective: every rank calls it at the
        same point of the step."""
        local = float(self._stop.signum or 0) if self._stop is not None and self._stop.requested else 0.0
        (agreed,) = reduce_over_ranks(self.accelerator, [local], "max")
        return int(agreed)

    def _raise_if_stop_agreed(self) -> None:
        signum = self.stop_agreed()
        if signum:
            raise StopAgreed(signum)

    @property
    def stop_event(self) -> Any:
        """The event a stop request sets while training runs (None outside ``train``): a rollout watches it."""
        return self._stop.event if self._stop is not None else None

    def _checkpoint_this_step(self) -> str | None:
        """A complete checkpoint of the current step (every rank takes part): the one saved already, or a
        new one replacing a save that was cut short (never resumed from). None at step 0."""
        step = self.state.global_step
        if step == 0:
            return None
        folder = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        if not os.path.isfile(os.path.join(folder, COMPLETE_MARKER)):
            if self.accelerator.is_main_process and os.path.isdir(folder):
                shutil.rmtree(folder)
            self.accelerator.wait_for_everyone()
            self._save_checkpoint(self.model_wrapped, trial=None)
        return folder

    def _interrupted(self, signum: int) -> TrainingInterrupted:
        """Checkpoint the last finished step and say where to resume from."""
        error = TrainingInterrupted(signum, self.state.global_step, self._checkpoint_this_step())
        logger.error("%s", error)
        return error

    def _emergency_checkpoint(self) -> None:
        if self.accelerator.num_processes > 1:
            logger.warning(
                "no emergency checkpoint with %d processes (saving is a collective)", self.accelerator.num_processes
            )
            return
        try:
            folder = self._checkpoint_this_step()
            if folder:
                logger.warning("emergency checkpoint: %s", folder)
        except Exception:  # the original exception matters more than this one
            logger.exception("the emergency checkpoint failed")
