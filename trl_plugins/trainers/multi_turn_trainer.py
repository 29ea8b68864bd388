"""MultiTurnGRPOTrainer: TRL's GRPOTrainer with every seam behind a plugin (glue only).

One step is one rollout batch and one optimizer update: roll out each question ``num_generations``
times (rollout plugin, tools), score each trajectory (reward components), compute advantages, build
one datum per trajectory, drop zero-advantage ones (all in :mod:`~trl_plugins.trainers.batch`, shared
with the evaluation), and let :func:`~trl_plugins.trainers.step.policy_update` run the
exactly-normalised micro-batches; the HF Trainer loop then clips, steps the optimizer and the
scheduler, logs and checkpoints as usual. The PPO "old" log-probs are the sampler's behaviour
log-probs stored on the trajectories, or, when the sampler/trainer mismatch correction applies
(vLLM), the policy's own no-grad forward of the datums before the update, the sampler-to-trainer gap
going into truncated/masked importance weights (docs/training.md). With ``beta > 0`` TRL's reference model scores the datums once
per rollout; with a critic-based estimator (``needs_values``) the critic (:mod:`~trl_plugins.trainers.critic`)
gives values before the advantages and takes its own exact update after the policy's.

TRL methods overridden: ``training_step``, ``log``, ``train`` and ``create_model_card`` (public) and ``_save_checkpoint``
(private; it only adds a completion marker after TRL's save). ``tests/test_trainer.py`` pins the
signatures this relies on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Mapping

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from trl_plugins.rollout import RolloutCancelled, derive_seed
from trl_plugins.rollout.metrics import (
    METRIC_REDUCTIONS,
    engine_metrics,
    reduce_rank_metrics,
    reward_metrics,
    summarize,
    throughput_metrics,
    trajectory_metrics,
)
from trl_plugins.trainers.batch import (
    KL_PENALTY_COMPONENT,
    add_kl_penalty,
    build_datums_for_update,
    chat_format,
    compute_advantages,
    compute_token_advantages,
    hf_backend,
    sampling_settings,
    vllm_backend,
    cb_backend,
    check_vllm,
    kl_per_token,
    rollout_rows,
    score_trajectories,
    set_datum_advantages,
    training_mask,
)
from trl_plugins.trainers.critic import build_critic, load_critic, prepare_critic, rollout_values, save_critic, value_update
from trl_plugins.trainers.checkpoints import (
    COMPLETE_MARKER,
    ResumePoint,
    latest_complete_checkpoint,
    mark_complete,
    resolve_resume,
    set_aside_damaged,
    trim_metrics_log,
)
from trl_plugins.trainers.console import use_compact_console
from trl_plugins.trainers.interrupts import StopSignals, TrainingInterrupted, die_with_launcher
from trl_plugins.trainers.lora import check_peft
from trl_plugins.trainers.memory import peak_memory_mb, reset_peak_memory
from trl_plugins.trainers.multi_turn_config import MultiTurnGRPOConfig
from trl_plugins.trainers.plugins import build_plugins, log_tool_start_up
from trl_plugins.trainers.model_card import name_local_base_model
from trl_plugins.trainers.viewer_pages import ViewerPages
from trl_plugins.trainers.step import (
    datums_to_forward,
    mismatch_correction_applies,
    old_logprobs,
    policy_update,
    reduce_over_ranks,
    reference_logprobs,
)
from trl_plugins.trainers.trajectory_table import TURN_COLUMNS, trajectory_columns, trajectory_rows, turn_rows
from trl_plugins.types import StopReason, Trajectory

__all__ = ["MultiTurnGRPOTrainer", "COMPLETE_MARKER", "latest_complete_checkpoint"]

logger = logging.getLogger(__name__)

class _ScoredByPlugins:
    """TRL requires a reward source at construction; this trainer scores with REWARDS plugins."""

    __name__ = "reward_components"

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        raise RuntimeError("MultiTurnGRPOTrainer scores trajectories with its reward components; this is never called.")


class _StopAgreed(Exception):
    """Every rank agreed to stop mid-step (raised inside the HF loop, turned into TrainingInterrupted)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopAtStepEnd(TrainerCallback):
    """At every step's end the ranks agree whether a stop was requested; if so the step is saved and the
    loop ends (``MultiTurnGRPOTrainer.train`` then raises :class:`TrainingInterrupted`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        signum = self.trainer._stop_agreed()
        if signum:
            self.trainer._stop_signum = signum
            control.should_save = True
            control.should_training_stop = True


class _OptimizerTimer(TrainerCallback):
    """Times the HF loop's optimizer step (``timing/optimizer_s``, this rank's)."""

    def __init__(self, metrics: dict) -> None:
        self.metrics, self.start = metrics, 0.0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start = time.perf_counter()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.metrics["train"]["timing/optimizer_s"].append(time.perf_counter() - self.start)


class _PeakMemory(TrainerCallback):
    """At each step's end, the step's peak memory (reset when the step started: ``training_step``), so that the
    HF loop's optimizer step after ``training_step`` counts too; the maximum over ranks (one all-reduce)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        peaks = peak_memory_mb()
        keys = sorted(peaks)
        for key, value in zip(keys, reduce_over_ranks(self.trainer.accelerator, [peaks[k] for k in keys], "max")):
            self.trainer._metrics["train"][key].append(value)


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
        callbacks, optimizers: As for GRPOTrainer.
        peft_config: A ``peft.LoraConfig`` (as for GRPOTrainer: TRL wraps the policy, only the adapter trains,
            and with ``beta > 0`` the reference is the policy with its adapter disabled); checked by
            :func:`~trl_plugins.trainers.lora.check_peft`.

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
        # Every plugin is built (and checked) before TRL loads anything.
        self._plugins = build_plugins(args, tools=tools, reward_components=reward_components)
        log_tool_start_up(self._plugins.tools)  # e.g. the sandbox isolation in force
        check_vllm(args)
        # An adapter (TRL wraps the policy with peft_config) is checked before TRL wraps anything.
        check_peft(peft_config, args, model=model, needs_values=self._plugins.advantage.needs_values)
        # A critic-based estimator brings its critic, initialised from the policy before TRL wraps it.
        critic = build_critic(model) if self._plugins.advantage.needs_values else None
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
        self._chat = chat_format(self.processing_class, self._plugins, args)
        args.resolve_padding_free(self.accelerator.unwrap_model(self.model))  # auto: by the attention implementation
        # use_vllm: TRL's __init__ built self.vllm_generation (colocate or server); turns go through it.
        self._vllm_backend = vllm_backend(self.vllm_generation, self._chat, args, self.accelerator) if args.use_vllm else None
        # use_transformers_continuous_batching: one backend for the run, so its manager (and cache) can be reused.
        self._cb_backend = (cb_backend(self.model_wrapped, self._chat, args, self.accelerator)
                            if args.use_transformers_continuous_batching else None)
        self.add_callback(_OptimizerTimer(self._metrics))
        self.add_callback(_PeakMemory(self))
        if args.console_metrics == "compact":
            use_compact_console(self)
        self.add_callback(_StopAtStepEnd(self))
        self.add_callback(ViewerPages(self))  # trajectory pages every viewer_steps (docs/viewer.md)
        self._stop: StopSignals | None = None
        self._stop_signum = 0
        self._step_summaries: list | None = None
        # How the tools' step_metrics() combine over ranks (what they declare; the tools do not change).
        self._metric_reductions: dict[str, str] = {}
        for name, tool in self._plugins.tools.items():
            declared = getattr(tool, "step_metric_reductions", None)
            if declared is not None:
                reductions = declared()
                bad = {k: v for k, v in reductions.items() if v not in METRIC_REDUCTIONS}
                if bad:  # validated at the seam: an unknown one would silently become a mean over ranks
                    raise ValueError(f"tool {name!r}: step_metric_reductions() returned {bad}; each value must be one of "
                                     f"{list(METRIC_REDUCTIONS)}.")
                self._metric_reductions.update(reductions)
        self._buffered_datums: list | None = None
        self._rollout_step = 0
        self._last_trajectories: list[Trajectory] = []
        self._last_datums: list = []  # the last rollout's datums, rows and training mask: for the viewer pages
        self._last_rows: list[dict] = []  # the dataset rows of _last_trajectories (rows[t.group_id])
        self._last_masked: list[bool] = []
        self._update_skipped: str | None = None  # why the last step made no policy update (None: it made one)
        self._last_table_step = -1
        self._metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
        self._critic = self._critic_optimizer = None
        if critic is not None:
            if not self.is_deepspeed_enabled:  # DeepSpeed places (and under ZeRO-3 shards) it itself
                critic.to(device=self.accelerator.device, dtype=next(self.model.parameters()).dtype)
            self._critic, self._critic_optimizer = prepare_critic(
                self.accelerator, critic, learning_rate=args.critic_learning_rate or args.learning_rate,
                weight_decay=args.weight_decay, optimizer_cls=torch.optim.SGD if args.critic_optim == "sgd" else torch.optim.AdamW,
            )

    def generation_backend(self, *, temperature: float | None = None) -> Any:
        """The sampler rollouts use: vLLM when ``use_vllm``, transformers' continuous batching when
        ``use_transformers_continuous_batching``, else HF generate on the training model. ``temperature``
        overrides the config's (e.g. 0 for greedy evaluation)."""
        if self._vllm_backend is not None:
            return self._vllm_backend.with_sampling(sampling_settings(self.args, temperature=temperature))
        if self._cb_backend is not None:
            self._cb_backend.model = self.model_wrapped  # Accelerate/DeepSpeed wrap it when training starts
            return self._cb_backend.with_sampling(sampling_settings(self.args, temperature=temperature))
        return hf_backend(self.model_wrapped, self.processing_class, self._chat, self.args, temperature=temperature,
                          accelerator=self.accelerator)

    # -- one step --------------------------------------------------------------------------------

    def _rollout_and_score(self, rows: list[dict]) -> tuple[list, dict[str, float]]:
        args, plugins = self.args, self._plugins
        backend = self.generation_backend()
        try:
            result = rollout_rows(
                plugins, args, self._chat, backend, rows, group_size=self.num_generations,
                seed=derive_seed(args.seed, self.state.global_step, self.accelerator.process_index),
                policy_step=self.state.global_step,
                progress=args.progress_rollout and not args.disable_tqdm and self.accelerator.is_local_main_process,
                stop=self._stop.event if self._stop is not None else None,
            )
        except RolloutCancelled:
            result = None
        # Every rank agrees here, before the step's first collective, whether a stop was requested.
        self._raise_if_stop_agreed()
        assert result is not None  # a cancelled rollout means this rank asked for the stop
        trajs: list[Trajectory] = result.trajectories
        t0 = time.perf_counter()
        failures = score_trajectories(plugins, trajs, rows, time_limit_s=args.reward_time_limit_s)
        scoring_s = time.perf_counter() - t0
        example = next((t.error for t in trajs if t.stop_reason == StopReason.VERIFIER_ERROR), None)
        failure_metrics = self._check_verifier_failures(failures, len(trajs), example=example)
        masked = training_mask(trajs, mask_truncated=args.truncated_policy == "mask",
                               min_valid_group_fraction=args.min_valid_group_fraction)
        datums = build_datums_for_update(plugins, trajs, masked)
        metrics: dict[str, float] = {}
        if args.beta > 0:
            t_ref = time.perf_counter()
            self._reference_logprobs(datums)
            metrics["timing/reference_s"] = time.perf_counter() - t_ref
            if args.kl_penalty == "reward" and self._critic is None:
                add_kl_penalty(trajs, datums, beta=args.beta, estimator=args.kl_estimator)
        if self._critic is None:
            compute_advantages(plugins, trajs, masked)
            set_datum_advantages(datums, trajs)
        else:
            t_values = time.perf_counter()
            after = rollout_values(self.accelerator, self._critic, datums, args, pad_token_id=self.processing_class.pad_token_id)
            metrics["timing/critic_values_s"] = time.perf_counter() - t_values
            token_rewards = None
            if args.beta > 0 and args.kl_penalty == "reward":
                # Per token, as in classic PPO; the kl_penalty component is kept for the record with weight 0.
                token_rewards = [-args.beta * kl_per_token(d, args.kl_estimator) for d in datums]
                add_kl_penalty(trajs, datums, beta=0.0, estimator=args.kl_estimator)
            compute_token_advantages(plugins, trajs, datums, after, token_rewards=token_rewards,
                                     all_reduce=self._all_reduce_sum if self.accelerator.num_processes > 1 else None)
        if mismatch_correction_applies(self.accelerator, trajs, plugins.policy_loss, args):
            # pi_old: this rollout's weights, before any update on it (reused rollouts keep it).
            t_old = time.perf_counter()
            forwarded = [datums[i] for i in datums_to_forward(datums, plugins.policy_loss, args)]
            old_logprobs(self.accelerator, self.model_wrapped, forwarded, args, pad_token_id=self.processing_class.pad_token_id)
            metrics["timing/old_logprobs_s"] = time.perf_counter() - t_old
        metrics.update({**engine_metrics(result), **failure_metrics, "timing/scoring_s": scoring_s})
        self._last_trajectories = trajs
        self._last_datums, self._last_rows, self._last_masked = datums, list(rows), masked
        metrics["train/datums"] = float(len(datums))
        # Trajectory metrics are computed over every rank's trajectories at once (training_step).
        rank = self.accelerator.process_index
        self._step_summaries = [summarize(t, rank=rank, masked=m) for t, m in zip(trajs, masked)]
        for tool in plugins.tools.values():
            step_metrics = getattr(tool, "step_metrics", None)
            if step_metrics is not None:
                metrics.update(step_metrics())
        return datums, metrics

    def reward_names(self) -> list[str]:
        """The reward components the run logs as ``reward/<name>``: the configured ones, plus ``kl_penalty`` when
        the reference KL is a reward (``beta > 0``, ``kl_penalty="reward"``)."""
        names = [name for name, _, _ in self._plugins.reward_components]
        if self.args.beta > 0 and self.args.kl_penalty == "reward":
            names.append(KL_PENALTY_COMPONENT)
        return names

    def _check_verifier_failures(self, failures: Mapping[str, int], num_trajectories: int, *,
                                 example: str | None = None) -> dict[str, float]:
        """Verifier error rates of the step over all ranks; stops the run (on every rank alike) above
        ``max_verifier_error_rate``."""
        names = [name for name, _, _ in self._plugins.reward_components]
        counts = [float(failures.get(name, 0)) for name in names] + [float(num_trajectories)]
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(torch.tensor(counts, dtype=torch.float64, device=self.accelerator.device),
                                             reduction="sum").tolist()
        total = max(counts[-1], 1.0)
        rates = {f"reward/verifier_error_rate/{name}": c / total for name, c in zip(names, counts)}
        rate = sum(counts[:-1]) / total
        if rate > self.args.max_verifier_error_rate:
            worst = max(zip(names, counts), key=lambda item: item[1])[0]
            raise RuntimeError(
                f"{rate:.0%} of this step's trajectories failed a reward component (most: {worst!r}), over "
                f"max_verifier_error_rate={self.args.max_verifier_error_rate}: the verifier looks broken, so the run "
                f"stops instead of training on noise (e.g. {example or 'see the other ranks'}; every failure is logged "
                f"as a 'verifier_error' warning). Fix the component or raise max_verifier_error_rate."
            )
        return {"reward/verifier_error_rate": rate, **rates}

    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum").to(tensor.device)

    def _reference_logprobs(self, datums: list) -> None:
        """Reference log-probs on ``datums``: TRL's frozen reference model (prepared like the policy, so
        sharded under ZeRO-3), or with PEFT the policy itself with its adapter disabled (no second copy)."""
        from accelerate.utils import is_peft_model
        from trl.trainer.utils import use_adapter

        if self.ref_model is not None:
            model, context = self.ref_model, None
        else:
            unwrapped = self.accelerator.unwrap_model(self.model)
            if not is_peft_model(unwrapped):
                raise RuntimeError("beta > 0 but TRL built no reference model and the policy has no adapter to disable.")
            name = "ref" if "ref" in unwrapped.peft_config else None
            model, context = self.model_wrapped, (lambda: use_adapter(unwrapped, adapter_name=name))
        reference_logprobs(self.accelerator, model, datums, self.args,
                           pad_token_id=self.processing_class.pad_token_id, context=context)

    def training_step(self, model: torch.nn.Module, inputs: list[dict], num_items_in_batch: Any = None) -> torch.Tensor:
        """Roll out, score and update once (the HF Trainer loop clips and steps the optimizer after)."""
        args = self.args
        start = time.perf_counter()
        reset_peak_memory()
        # As Trainer.training_step: a model loaded with from_pretrained starts in eval mode, and
        # GRPOTrainer.log files metrics under "eval" while it is.
        model.train()
        rows = list(inputs)[:: self.num_generations]  # TRL's sampler repeats each question G times
        self._step_summaries = None
        if self._step % self.num_iterations == 0 or self._buffered_datums is None:
            datums, metrics = self._rollout_and_score(rows)
            self._buffered_datums = datums
            self._rollout_step = self.state.global_step
        else:
            self._raise_if_stop_agreed()
            datums, metrics = self._buffered_datums, {"train/reused_rollout": 1.0}
        # How stale the data is: optimizer steps between the sampling weights and these.
        lags = [self.state.global_step - self._rollout_step] if datums else []
        metrics["train/policy_version_lag"] = float(lags[0]) if lags else 0.0
        self._step += 1
        trainable = float(len(datums_to_forward(datums, self._plugins.policy_loss, args)))
        (total,) = self.accelerator.reduce(torch.tensor([trainable], device=self.accelerator.device), "sum").tolist()
        warmup = self._critic is not None and self.state.global_step < args.critic_warmup_steps
        if self._critic is not None:
            metrics["critic/warmup"] = float(warmup)
        self._update_skipped = ("the critic's warm-up, critic_warmup_steps" if warmup else
                                "no trajectory to train on" if total == 0 else None)
        if self._update_skipped:
            metrics["train/update_skipped"] = 1.0
            loss = torch.zeros((), device=self.args.device)
        else:
            t0 = time.perf_counter()
            result = policy_update(self.accelerator, model, self.optimizer, datums, self._plugins.policy_loss, args,
                                   pad_token_id=self.processing_class.pad_token_id, step_optimizer=False)
            metrics["timing/forward_backward_s"] = time.perf_counter() - t0
            metrics.update({
                "train/update_skipped": 0.0,
                "train/micro_batches": float(result.num_micro_batches),
                "train/dummy_micro_batches": float(result.num_dummies),
                "train/input_tokens": float(result.num_input_tokens),
                "train/loss_tokens": float(result.num_loss_tokens),
                "train/forward_tokens": float(result.num_padded_tokens),
                "train/padding_efficiency": result.num_input_tokens / max(result.num_padded_tokens, 1),
                "train/policy_loss": result.loss,
                "train/forwarded_datums": float(result.num_forwarded),
            })
            if result.reference is not None:
                metrics.update({f"train/{k}": v for k, v in result.reference.items()})
            if result.entropy is not None:
                metrics["train/entropy"] = result.entropy
            metrics["timing/packing_s"] = result.packing_s
            if result.stats is not None:
                metrics.update({f"train/{k}": v for k, v in result.stats.summary().items()})
            if result.ratio_quantiles:
                metrics.update({f"train/{k}": v for k, v in result.ratio_quantiles.items()})
            if result.mismatch is not None:
                metrics.update({f"train/{k}": v for k, v in result.mismatch.items()})
            loss = torch.tensor(result.loss, device=self.args.device)
        if self._critic is not None:
            t0 = time.perf_counter()
            vr = value_update(self.accelerator, self._critic, self._critic_optimizer, datums, args, vf_clip=args.vf_clip,
                              vf_coef=args.vf_coef, max_grad_norm=args.max_grad_norm,
                              pad_token_id=self.processing_class.pad_token_id)
            metrics.update({
                "critic/value_loss": vr.loss, "critic/clip_frac": vr.clip_frac,
                "critic/explained_variance": vr.explained_variance, "critic/returns_mean": vr.returns_mean,
                "critic/returns_std": vr.returns_std, "critic/values_mean": vr.values_mean,
                "timing/critic_update_s": time.perf_counter() - t0,
            })
        metrics["timing/step_s"] = time.perf_counter() - start  # memory/*: _PeakMemory, after the optimizer step
        for key, value in self._reduce_over_ranks(metrics, self._step_summaries).items():
            self._metrics["train"][key].append(value)
        return loss

    def record_metrics(self, metrics: Mapping[str, float]) -> None:
        """Add values to the current step's record (e.g. from a callback's periodic evaluation); they are
        logged with the step's other metrics at the next logging step, to the loggers and ``metrics.jsonl``."""
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))

    def _reduce_over_ranks(self, metrics: dict[str, float], summaries: list | None) -> dict[str, float]:
        """One gather per step: every rank's metrics and trajectory summaries. Trajectory metrics are
        computed over the union of all ranks' trajectories; the rest is reduced by its meaning
        (:func:`~trl_plugins.rollout.metrics.reduce_rank_metrics`). Every rank gets the same numbers."""
        if self.accelerator.num_processes == 1:
            per_rank, union = [metrics], summaries
        else:
            from accelerate.utils import gather_object

            gathered = gather_object([(metrics, summaries)])
            per_rank = [m for m, _ in gathered]
            union = None if summaries is None else [s for _, ss in gathered for s in (ss or [])]
        out = reduce_rank_metrics(per_rank, self._metric_reductions)
        if union is not None:
            out.update(trajectory_metrics(union))
            out.update(reward_metrics(union, self.reward_names()))
        return out

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's card (``output_dir/README.md``), naming the base model also when it was loaded from a local
        folder: TRL names only Hub ids, which left "fine-tuned version of [None]"."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            name_local_base_model(os.path.join(self.args.output_dir, "README.md"),
                                  getattr(self.model.config, "_name_or_path", None))

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
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if self._critic is not None:
            save_critic(self.accelerator, self._critic, self._critic_optimizer, folder)
            self.accelerator.wait_for_everyone()  # the marker lists every rank's files
        if self.args.should_save:
            mark_complete(folder, global_step=self.state.global_step, tokenizer_digest=self._chat.digest)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """As ``Trainer.train``; ``resume_from_checkpoint`` ``True``, ``"true"`` or ``"latest"`` (any case) takes the
        newest *complete* checkpoint of ``output_dir``.

        The checkpoint is checked before anything loads it (:func:`~trl_plugins.trainers.checkpoints.resolve_resume`):
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
        tools and plugins are closed however training ends.
        """
        point = resolve_resume(resume_from_checkpoint, self.args.output_dir, fallback=self.args.resume_fallback,
                               needs_optimizer=not self.args.save_only_model, max_steps=self.args.max_steps)
        resume_from_checkpoint = None if point is None else point.folder
        if point is not None:
            self._prepare_resume(point)
        if resume_from_checkpoint and self._critic is not None:
            load_critic(self.accelerator, self._critic, self._critic_optimizer, str(resume_from_checkpoint))
        die_with_launcher()
        self._stop = StopSignals(on_hard_stop=self._plugins.close)
        try:
            with self._stop:
                output = super().train(resume_from_checkpoint, *args, **kwargs)
            if self._stop_signum:  # stopped after a finished step (agreed in _StopAtStepEnd)
                raise self._interrupted(self._stop_signum)
            return output
        except _StopAgreed as stop:  # stopped mid-step, before the update changed anything
            raise self._interrupted(stop.signum) from None
        except TrainingInterrupted:
            raise
        except Exception:
            self._emergency_checkpoint()
            raise
        finally:
            self._stop = None
            self._plugins.close()

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
                say(f"resume_fallback: {exc.file} is damaged ({exc.reason}); falling back to {point.folder}", logging.WARNING)
            if main:
                set_aside_damaged(point, log=lambda m: say(m, logging.WARNING))
        of = f" of {self.args.max_steps}" if self.args.max_steps and self.args.max_steps > 0 else ""
        say(f"resuming from step {point.step}{of}: {point.folder}")
        if main:
            moved, aside = trim_metrics_log(self._metrics_path, point.step)
            if moved:
                say(f"metrics.jsonl: {moved} record(s) the interrupted run wrote after step {point.step} moved to "
                    f"{aside}; the file continues from step {point.step}")

    def _stop_agreed(self) -> int:
        """The signal of a stop any rank was asked for (0: none). A collective: every rank calls it at the
        same point of the step."""
        local = float(self._stop.signum or 0) if self._stop is not None and self._stop.requested else 0.0
        (agreed,) = reduce_over_ranks(self.accelerator, [local], "max")
        return int(agreed)

    def _raise_if_stop_agreed(self) -> None:
        signum = self._stop_agreed()
        if signum:
            raise _StopAgreed(signum)

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
            logger.warning("no emergency checkpoint with %d processes (saving is a collective)",
                           self.accelerator.num_processes)
            return
        try:
            folder = self._checkpoint_this_step()
            if folder:
                logger.warning("emergency checkpoint: %s", folder)
        except Exception:  # the original exception matters more than this one
            logger.exception("the emergency checkpoint failed")

    # -- logging -------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log through the Trainer (W&B, ...) and append the same record to ``output_dir/metrics.jsonl``."""
        # GRPOTrainer.log averages this step's metrics into `logs` in place before handing it on; the rates are
        # computed here from the summed tokens and seconds of the steps the record covers, not averaged.
        for values in self._metrics.values():
            for key, rate in throughput_metrics(values).items():
                values[key] = [rate]
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
        names, limit = self.reward_names(), self.args.trajectory_table_rows
        rows = trajectory_rows(self._last_trajectories, self._last_rows, step=step, reward_names=names, max_rows=limit)
        turns = turn_rows(self._last_trajectories, step=step, max_rows=limit)
        wandb.log({"trajectories": wandb.Table(columns=trajectory_columns(names), data=rows),
                   "trajectory_turns": wandb.Table(columns=TURN_COLUMNS, data=turns)}, commit=False)
