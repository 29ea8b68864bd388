"""MultiTurnGRPOTrainer: TRL's GRPOTrainer with every seam behind a plugin (glue only).

One step is one rollout batch and one optimizer update: roll out each question ``num_generations``
times (rollout plugin, tools), score each trajectory (reward components), compute advantages, build
one datum per trajectory, drop zero-advantage ones, and let :func:`~trl_plugins.trainers.step.policy_update`
run the exactly-normalised micro-batches; the HF Trainer loop then clips, steps the optimizer and the
scheduler, logs and checkpoints as usual. The PPO "old" log-probs are the sampler's behaviour
log-probs stored on the trajectories.

TRL methods overridden: ``training_step``, ``log`` and ``train`` (public) and ``_save_checkpoint``
(private; it only adds a completion marker after TRL's save). ``tests/test_trainer.py`` pins the
signatures this relies on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any, Mapping

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from trl_plugins.datum import build_datum
from trl_plugins.registry import ADVANTAGES, POLICY_LOSSES, REWARDS, ROLLOUTS, TOOLS
from trl_plugins.rollout import ChatFormat, HFGenerationBackend, RolloutRequest, derive_seed, questions_from_rows
from trl_plugins.rollout.metrics import rollout_metrics
from trl_plugins.trainers.multi_turn_config import MultiTurnGRPOConfig
from trl_plugins.trainers.step import UpdateConfig, policy_update
from trl_plugins.types import AdvantageInput, RewardComponent, SamplingSettings, Trajectory, TrajectoryError

__all__ = ["MultiTurnGRPOTrainer", "COMPLETE_MARKER", "latest_complete_checkpoint"]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
"""Written into a checkpoint folder after everything else: a folder without it is a partial save."""


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that has the completion marker."""
    if not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, COMPLETE_MARKER)):
            found.append((int(m.group(1)), name))
    return os.path.join(output_dir, max(found)[1]) if found else None


class _ScoredByPlugins:
    """TRL requires a reward source at construction; this trainer scores with REWARDS plugins."""

    __name__ = "reward_components"

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        raise RuntimeError("MultiTurnGRPOTrainer scores trajectories with its reward components; this is never called.")


class _OptimizerTimer(TrainerCallback):
    """Times the HF loop's optimizer step (``timing/optimizer_s``, this rank's)."""

    def __init__(self, metrics: dict) -> None:
        self.metrics, self.start = metrics, 0.0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start = time.perf_counter()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.metrics["train"]["timing/optimizer_s"].append(time.perf_counter() - self.start)


class MultiTurnGRPOTrainer(GRPOTrainer):
    """Multi-turn, tool-calling GRPO/PPO with plugins at every seam.

    Args:
        model: A model or its name/path (as for GRPOTrainer).
        args: A :class:`MultiTurnGRPOConfig`.
        train_dataset: Rows with a ``prompt`` (a string or a list of chat messages) and whatever the
            reward components read (e.g. ``answer``).
        processing_class: The tokenizer (its chat template must support tool turns).
        tools: Tool instances by name; default: built from ``args.tools`` and ``args.tool_kwargs``.
        reward_components: Reward callables by name; default: built from ``args.reward_components``.
        callbacks, optimizers, peft_config: As for GRPOTrainer.

    Raises:
        ValueError: an invalid combination (see the message for what to set instead).
        trl_plugins.rollout.ChatTemplateError: a chat template that cannot do token-in, token-out tool turns.
    """

    def __init__(
        self,
        model: Any,
        args: MultiTurnGRPOConfig,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        tools: Mapping[str, Any] | None = None,
        reward_components: Mapping[str, Any] | None = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        peft_config: Any = None,
    ) -> None:
        if not isinstance(args, MultiTurnGRPOConfig):
            raise TypeError(f"args must be a MultiTurnGRPOConfig, got {type(args).__name__}.")
        if args.log_completions:
            raise ValueError("log_completions is TRL's single-turn table; trajectory tables come from this trainer's own logging.")
        super().__init__(
            model=model,
            reward_funcs=[_ScoredByPlugins()],
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        if tools is not None:
            self._tools = dict(tools)
            missing = set(args.tools) - set(self._tools)
            if missing:
                raise ValueError(f"tools {sorted(missing)} are configured but not provided.")
        else:
            # Keyed by the name the model calls (the tool's own ``name``), which may differ from the
            # configured plugin name (e.g. "pkg.module:Tool").
            built = [TOOLS.get(name)(**args.tool_kwargs.get(name, {})) for name in args.tools]
            self._tools = {getattr(tool, "name", name): tool for name, tool in zip(args.tools, built)}
            if len(self._tools) != len(built):
                raise ValueError(f"two configured tools share a name: {[getattr(t, 'name', None) for t in built]}.")
        provided = dict(reward_components or {})
        self._reward_components = [
            (name, float(weight), provided.get(name) or REWARDS.get(name)(**args.reward_component_kwargs.get(name, {})))
            for name, weight in zip(args.reward_components, args.reward_component_weights)
        ]
        self._rollout_plugin = ROLLOUTS.get(args.rollout)(**args.rollout_kwargs)
        self._advantage = ADVANTAGES.get(args.advantage)(**args.advantage_kwargs)
        self._policy_loss = POLICY_LOSSES.get(args.policy_loss)(**args.policy_loss_kwargs)
        tokenizer = self.processing_class
        self._chat = ChatFormat(tokenizer, [t.schema() for t in self._tools.values()])
        self._validate(args)
        self.add_callback(_OptimizerTimer(self._metrics))
        self._buffered_datums: list | None = None
        self._rollout_step = 0
        self._last_trajectories: list[Trajectory] = []
        self._last_table_step = -1
        self._metrics_path = os.path.join(args.output_dir, "metrics.jsonl")

    # -- start-up validation -------------------------------------------------------------------

    def _validate(self, args: MultiTurnGRPOConfig) -> None:
        if args.advantage == "gae":
            raise ValueError("the 'gae' estimator needs a critic, which this trainer does not run yet; use 'group', 'dr_grpo' or 'rloo'.")
        if args.advantage in ("group", "dr_grpo", "rloo") and self.num_generations < 2:
            raise ValueError(f"group-relative advantages need num_generations >= 2, got {self.num_generations}.")
        budget = getattr(self._rollout_plugin, "max_trajectory_tokens", None)
        context = args.max_context_tokens if args.max_context_tokens is not None else (budget - 1 if budget else None)
        if budget is not None and context is not None and budget - 1 > context:
            raise ValueError(
                f"the rollout budget max_trajectory_tokens={budget} makes datums of up to {budget - 1} tokens, over "
                f"max_context_tokens={context}; lower max_trajectory_tokens to {context + 1} or raise max_context_tokens."
            )
        if context is not None and context > args.max_padded_tokens_per_micro_batch:
            raise ValueError(
                f"a datum can have {context} tokens but max_padded_tokens_per_micro_batch is "
                f"{args.max_padded_tokens_per_micro_batch}: the longest datum would fit in no micro-batch. Raise "
                f"max_padded_tokens_per_micro_batch to at least {context} or lower the rollout budget."
            )
        self._max_context_tokens = context

    # -- one step --------------------------------------------------------------------------------

    def _rollout_and_score(self, rows: list[dict]) -> tuple[list, dict[str, float]]:
        args = self.args
        timings: dict[str, float] = {}
        backend = HFGenerationBackend(
            self.model_wrapped,
            pad_token_id=self.processing_class.pad_token_id,
            stop_token_ids=self._chat.stop_token_ids,
            sampling=SamplingSettings(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
                min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
            ),
            accelerator=self.accelerator,
        )
        seed = derive_seed(args.seed, self.state.global_step, self.accelerator.process_index)
        request = RolloutRequest(
            questions_from_rows(self._chat, rows, args.system_prompt), self.num_generations, backend, self._chat, self._tools,
            policy_step=self.state.global_step, seed=seed,
            progress=args.progress_rollout and not args.disable_tqdm and self.accelerator.is_local_main_process,
        )
        result = self._rollout_plugin(request)
        trajs: list[Trajectory] = result.trajectories
        for traj in trajs:
            version = traj.policy_version
            if version is None or version.tokenizer_digest != self._chat.digest:
                got = None if version is None else version.tokenizer_digest
                raise TrajectoryError(
                    f"trajectory for question {traj.question_id!r} was tokenised with tokenizer/chat-template digest "
                    f"{got}, but the trainer's is {self._chat.digest}: its token ids mean something else here. "
                    f"Roll out with the trainer's tokenizer and chat template."
                )
        t0 = time.perf_counter()
        for traj in trajs:
            row = rows[traj.group_id]
            traj.reward_components = [
                RewardComponent(name, float(fn(traj, row)), weight) for name, weight, fn in self._reward_components
            ]
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        group_ids = torch.tensor([t.group_id for t in trajs])
        # truncated_policy="mask": a truncated trajectory is neither scored against its group nor trained on.
        masked = [args.truncated_policy == "mask" and t.truncated for t in trajs]
        keep = torch.tensor([not m for m in masked], dtype=torch.bool)
        advantages = torch.zeros(len(trajs), dtype=torch.float32)
        if bool(keep.any()):
            advantages[keep] = self._advantage(AdvantageInput(rewards=rewards[keep], group_ids=group_ids[keep])).advantages.float()
        timings["timing/scoring_s"] = time.perf_counter() - t0
        datums = []
        for i, (traj, adv) in enumerate(zip(trajs, advantages.tolist())):
            traj.advantage = adv
            if masked[i] or (args.drop_zero_advantage and adv == 0.0):
                continue
            datums.append(build_datum(traj, max_context_tokens=self._max_context_tokens, trajectory_index=i))
        metrics = {**rollout_metrics(result), **timings}
        n = max(len(trajs), 1)
        metrics["reward/total"] = float(rewards.mean()) if trajs else 0.0
        for name, _, _ in self._reward_components:
            metrics[f"reward/{name}"] = sum(t.reward_component(name).value for t in trajs) / n
        self._last_trajectories = trajs
        metrics["train/datums"] = float(len(datums))
        metrics["train/masked_truncated_frac"] = sum(masked) / n
        metrics["train/zero_advantage_frac"] = sum(a == 0.0 for a in advantages.tolist()) / n
        # Groups that give the update nothing: every member's advantage is 0 (e.g. all right or all wrong).
        by_group: dict[int, list[float]] = {}
        for traj in trajs:
            by_group.setdefault(traj.group_id, []).append(traj.advantage)
        metrics["rollout/degenerate_group_rate"] = sum(all(a == 0.0 for a in v) for v in by_group.values()) / max(len(by_group), 1)
        for tool in self._tools.values():
            sandbox = getattr(tool, "_sandbox", None)
            if sandbox is not None:
                metrics.update(sandbox.stats().to_metrics("sandbox/"))
                sandbox.reset_step_stats()
        return datums, metrics

    def training_step(self, model: torch.nn.Module, inputs: list[dict], num_items_in_batch: Any = None) -> torch.Tensor:
        """Roll out, score and update once (the HF Trainer loop clips and steps the optimizer after)."""
        args = self.args
        start = time.perf_counter()
        # As Trainer.training_step: a model loaded with from_pretrained starts in eval mode, and
        # GRPOTrainer.log files metrics under "eval" while it is.
        model.train()
        rows = list(inputs)[:: self.num_generations]  # TRL's sampler repeats each question G times
        if self._step % self.num_iterations == 0 or self._buffered_datums is None:
            datums, metrics = self._rollout_and_score(rows)
            self._buffered_datums = datums
            self._rollout_step = self.state.global_step
        else:
            datums, metrics = self._buffered_datums, {"train/reused_rollout": 1.0}
        # How stale the data is: optimizer steps between the sampling weights and these.
        lags = [self.state.global_step - self._rollout_step] if datums else []
        metrics["train/policy_version_lag"] = float(lags[0]) if lags else 0.0
        self._step += 1
        (total,) = self.accelerator.reduce(torch.tensor([float(len(datums))], device=self.accelerator.device), "sum").tolist()
        if total == 0:
            metrics["train/update_skipped"] = 1.0
            loss = torch.zeros((), device=self.args.device)
        else:
            t0 = time.perf_counter()
            config = UpdateConfig(
                aggregation=args.aggregation, packer=args.packer, max_items=args.max_items_per_micro_batch,
                max_padded_tokens=args.max_padded_tokens_per_micro_batch, rebalance=args.rebalance_ranks,
                norm_length=args.norm_length, pad_token_id=self.processing_class.pad_token_id,
                # Greedy sampling (temperature 0) keeps log-probs of the unscaled logits, like the backend.
                temperature=args.temperature or 1.0,
            )
            result = policy_update(self.accelerator, model, self.optimizer, datums, self._policy_loss, config, step_optimizer=False)
            metrics["timing/forward_backward_s"] = time.perf_counter() - t0
            metrics.update({
                "train/update_skipped": 0.0,
                "train/micro_batches": float(result.num_micro_batches),
                "train/dummy_micro_batches": float(result.num_dummies),
                "train/input_tokens": float(result.num_input_tokens),
                "train/loss_tokens": float(result.num_loss_tokens),
                "train/padded_tokens": float(result.num_padded_tokens),
                "train/padding_efficiency": result.num_input_tokens / max(result.num_padded_tokens, 1),
                "train/policy_loss": result.loss,
            })
            metrics["timing/packing_s"] = result.packing_s
            if result.stats is not None:
                metrics.update({f"train/{k}": v for k, v in result.stats.summary().items()})
            if result.ratio_quantiles:
                metrics.update({f"train/{k}": v for k, v in result.ratio_quantiles.items()})
            loss = torch.tensor(result.loss, device=self.args.device)
        metrics["timing/step_s"] = time.perf_counter() - start
        for key, value in self._mean_over_ranks(metrics).items():
            self._metrics["train"][key].append(value)
        return loss

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        # One gather per step on every rank (key sets may differ: a rank whose sandbox never started
        # has no sandbox/* keys), then the mean over the ranks that reported each key. train/* values
        # from policy_update are already global and identical on every rank.
        if self.accelerator.num_processes == 1:
            return {k: float(v) for k, v in metrics.items()}
        from accelerate.utils import gather_object

        per_rank = gather_object([metrics])
        keys = sorted({k for m in per_rank for k in m})
        return {k: sum(float(m[k]) for m in per_rank if k in m) / sum(k in m for m in per_rank) for k in keys}

    # -- checkpoints ---------------------------------------------------------------------------------

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
        if self.args.should_save:
            run_dir = self._get_output_dir(trial=trial)
            folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
            tmp = os.path.join(folder, COMPLETE_MARKER + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"global_step": self.state.global_step, "tokenizer_digest": self._chat.digest}, f)
            os.replace(tmp, os.path.join(folder, COMPLETE_MARKER))
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As ``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint.

        On an exception in a single-process run, an emergency checkpoint is saved to
        ``output_dir/checkpoint-<step>`` (when no checkpoint of that step exists) and the exception is
        re-raised. With several processes it is not attempted: saving is a collective, and the other
        ranks may be stuck in a different one.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True but {self.args.output_dir} has no complete checkpoint "
                    f"(a folder checkpoint-N with {COMPLETE_MARKER}); pass a path or start without resuming."
                )
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except Exception:
            self._emergency_checkpoint()
            raise

    def _emergency_checkpoint(self) -> None:
        step = self.state.global_step
        folder = os.path.join(self.args.output_dir, f"checkpoint-{step}")
        if self.accelerator.num_processes > 1 or step == 0 or os.path.isdir(folder):
            logger.warning("no emergency checkpoint (processes=%d, step=%d)", self.accelerator.num_processes, step)
            return
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)
            logger.warning("saved an emergency checkpoint to %s", folder)
        except Exception:  # the original exception matters more than this one
            logger.exception("the emergency checkpoint failed")

    # -- logging -------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log through the Trainer (W&B, ...) and append the same record to ``output_dir/metrics.jsonl``."""
        # GRPOTrainer.log averages this step's metrics into `logs` in place before handing it on.
        super().log(logs, start_time)
        if self.accelerator.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(self._metrics_path, "a") as f:
                f.write(json.dumps({"step": self.state.global_step, **logs}) + "\n")
            self._maybe_log_trajectory_table()

    def _maybe_log_trajectory_table(self) -> None:
        every = self.args.trajectory_table_steps
        step = self.state.global_step
        if not every or step % every or not self._last_trajectories or step == self._last_table_step:
            return
        self._last_table_step = step
        if "wandb" not in (self.args.report_to or []):
            return
        import wandb

        if wandb.run is None:
            return
        columns = ["step", "question_id", "sample", "turns", "tool_calls", "stop_reason", "reward", "advantage", "transcript"]
        rows = []
        for t in self._last_trajectories[: self.args.trajectory_table_rows]:
            transcript = "\n".join(
                turn.text + (f"\n[tool] {turn.tool_call.output}" if turn.tool_call else "") for turn in t.turns
            )
            rows.append([self.state.global_step, t.question_id, t.sample_index, len(t.turns), t.num_tool_calls,
                         str(t.stop_reason), t.reward, t.advantage, transcript])
        wandb.log({"trajectories": wandb.Table(columns=columns, data=rows)}, commit=False)
