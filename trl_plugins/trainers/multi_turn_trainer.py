"""MultiTurnGRPOTrainer: TRL's GRPOTrainer with every seam behind a plugin (glue only).

The trainer receives a resolved :class:`~trl_plugins.run.Run` (or resolves one from its config): the plugins, the
sampler and the chat format are built once, before TRL loads anything, and nothing here builds or checks them again.
One step is one rollout batch and one optimizer update, as the phases of :mod:`~trl_plugins.trainers.phases`: roll
out each question ``num_generations`` times, score, with ``dynamic_sampling`` drop the groups whose rewards are all
equal and refill from the training set, decide what is left out and build the datums, reference and
old log-probs, values and advantages, then the exact multi-rank update (the HF Trainer loop clips, steps the
optimizer and the scheduler, logs and checkpoints as usual), the critic's, and the step's metrics. The PPO "old"
log-probs are the sampler's behaviour log-probs stored on the trajectories, or, when the sampler/trainer mismatch
correction applies (vLLM), the policy's own no-grad forward of the datums before the update, the
sampler-to-trainer gap going into truncated/masked importance weights (docs/training.md). With ``beta > 0`` TRL's
reference model scores the datums once per rollout; with a critic-based estimator (``needs_values``) the critic
(:mod:`~trl_plugins.trainers.critic`) gives values before the advantages and takes its own exact update after the
policy's. Checkpoints, resume and safe stops are :mod:`~trl_plugins.trainers.resilience`'s.

TRL methods overridden: ``training_step``, ``log``, ``train`` and ``create_model_card`` (public) and
``_save_checkpoint`` (private; it only adds a completion marker after TRL's save). ``tests/test_trainer.py`` pins the
signatures this relies on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Mapping

import torch
from trl import GRPOTrainer

from trl_plugins.modeling import disable_dropout
from trl_plugins.rollout import derive_seed
from trl_plugins.rollout.backends import unwrapped_for_generation
from trl_plugins.rollout.metrics import throughput_metrics
from trl_plugins.run import Run, resolve_run
from trl_plugins.run.config import MultiTurnGRPOConfig
from trl_plugins.run.lora import check_model_dropout, check_peft_model
from trl_plugins.run.sampler import make_backend, sampling_settings
from trl_plugins.trainers.async_rollouts import AsyncRollouts
from trl_plugins.trainers.callbacks import (
    OptimizerTimer,
    PeakMemory,
    SaveRunConfig,
    StopAtStepEnd,
    ViewerPages,
    log_trajectory_tables,
)
from trl_plugins.trainers.checkpoints import COMPLETE_MARKER, latest_complete_checkpoint
from trl_plugins.trainers.console import use_compact_console
from trl_plugins.trainers.critic import build_critic, prepare_critic
from trl_plugins.trainers.memory import reset_peak_memory
from trl_plugins.trainers.model_card import name_local_base_model, name_quick_start_model
from trl_plugins.trainers.phases import StepBatch, StepRunner
from trl_plugins.trainers.resilience import Resilient
from trl_plugins.trainers.sequence_parallel import setup_sequence_parallel
from trl_plugins.trainers.teacher import check_divergence_models, check_teacher_rows, load_teacher, teacher_version

__all__ = ["MultiTurnGRPOTrainer", "COMPLETE_MARKER", "latest_complete_checkpoint"]

logger = logging.getLogger(__name__)


class _ScoredByPlugins:
    """TRL requires a reward source at construction; this trainer scores with the run's reward components."""

    __name__ = "reward_components"

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        raise RuntimeError("MultiTurnGRPOTrainer scores trajectories with its reward components; this is never called.")


class MultiTurnGRPOTrainer(Resilient, GRPOTrainer):
    """Multi-turn, tool-calling GRPO/PPO with plugins at every seam.

    Args:
        model: A model or its name/path (as for GRPOTrainer).
        args: A :class:`MultiTurnGRPOConfig` (with ``run``: its config, or None).
        train_dataset: Rows with a ``prompt`` (a string or a list of chat messages) and whatever the
            reward components read (e.g. ``answer``).
        processing_class: The tokenizer (its chat template must support tool turns).
        run: The resolved run (:func:`trl_plugins.run.resolve_run`); default: resolved here from ``args``, with
            ``tools``, ``reward_components`` and ``peft_config``.
        tools: Tool instances by name, instead of building ``args.tools`` (without ``run`` only).
        reward_components: Reward callables by name, instead of building those names (without ``run`` only).
        callbacks, optimizers: As for GRPOTrainer.
        peft_config: A ``peft.LoraConfig`` (as for GRPOTrainer: TRL wraps the policy, only the adapter trains,
            and with ``beta > 0`` the reference is the policy with its adapter disabled); with ``run``, the run's.

    Raises:
        ValueError: an invalid combination (see the message for what to set instead).
        trl_plugins.rollout.ChatTemplateError: a chat template that cannot do token-in, token-out tool turns.
    """

    def __init__(
        self,
        model: Any,
        args: MultiTurnGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        *,
        run: Run | None = None,
        tools: Mapping[str, Any] | None = None,
        reward_components: Mapping[str, Any] | None = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        peft_config: Any = None,
    ) -> None:
        if run is None:
            if not isinstance(args, MultiTurnGRPOConfig):
                raise TypeError(f"args must be a MultiTurnGRPOConfig, got {type(args).__name__}.")
            run = resolve_run(args, tools=tools, reward_components=reward_components, peft_config=peft_config)
        else:
            if tools is not None or reward_components is not None:
                raise ValueError("tools and reward_components are built into the run: pass them to resolve_run().")
            if args is not None and args is not run.config:
                raise ValueError("args differs from the run's config: pass the run alone (its config is run.config).")
            if peft_config is not None and peft_config is not run.spec.peft_config:
                raise ValueError("peft_config differs from the run's: pass it to resolve_run().")
            args, peft_config = run.config, run.spec.peft_config
        if (
            args.features.dynamic_sampling is not None
            and train_dataset is not None
            and not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__"))
        ):
            raise ValueError(
                f"dynamic_sampling refills a step with rows drawn by index from the training set, but "
                f"train_dataset is a {type(train_dataset).__name__} (no length or indexing, e.g. streamed): "
                f"pass a datasets.Dataset (e.g. Dataset.from_list(list(stream.take(n)))), or set "
                f"dynamic_sampling=False."
            )
        self.run = run
        run.start_tools()  # e.g. the sandbox isolation in force, said before any model work
        check_peft_model(model, args, needs_values=run.advantage.needs_values)
        check_model_dropout(model, args)  # dropout is refused unless disable_dropout, which then removes all of it
        # A critic-based estimator brings its critic, initialised from the policy before TRL wraps it.
        critic = build_critic(model) if run.critic is not None else None
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
        run.bind_tokenizer(self.processing_class)
        self._teacher = None  # on-policy distillation: the teacher, checked against the student and placed once
        if args.features.distillation is not None:
            check_teacher_rows(args.features.distillation, train_dataset)
            unwrapped = self.accelerator.unwrap_model(self.model)
            self._teacher = load_teacher(
                args.features.distillation,
                self.accelerator,
                tokenizer=self.processing_class,
                tools=run.chat.tools,
                dtype=next(unwrapped.parameters()).dtype,
                attn_implementation=getattr(unwrapped.config, "_attn_implementation", None),
                deepspeed=self.is_deepspeed_enabled,
            )
            check_divergence_models(run.policy_loss, unwrapped, self._teacher)
        # After TRL's PEFT wrap (the adapter set is on the model now), with the teacher's identity when there is one.
        run.bind_version(self.model, teacher_version(args.features.distillation, self._teacher))
        if args.disable_dropout:  # TRL's disable_dropout_in_model sets nn.Dropout only, not attention dropout
            for module in (self.model, self.ref_model, critic):
                if module is not None:
                    disable_dropout(module)
        args.resolve_padding_free(self.accelerator.unwrap_model(self.model))  # auto: by the attention implementation
        args.resolve_shared_prefix(self.accelerator.unwrap_model(self.model))  # after TRL settled the checkpointing
        # sequence_parallel_size > 1: checked on the loaded model, the update's attention redirected (no compute yet).
        sequence_parallel = setup_sequence_parallel(
            self.accelerator, self.accelerator.unwrap_model(self.model), args, policy_loss=run.policy_loss
        )
        # One sampler for the run, its model refreshed per rollout (Accelerate/DeepSpeed wrap it when training starts);
        # vLLM: TRL's __init__ built self.vllm_generation (colocate or server), turns go through it.
        self._sampler = make_backend(
            run.sampler,
            args,
            run.chat,
            model=self.model_wrapped,
            pad_token_id=self.processing_class.pad_token_id,
            accelerator=self.accelerator,
            vllm_generation=self.vllm_generation if run.sampler.is_vllm else None,
            token_budget=run.rollout.token_budget,
        )
        if critic is not None:
            if not self.is_deepspeed_enabled:  # DeepSpeed places (and under ZeRO-3 shards) it itself
                critic.to(device=self.accelerator.device, dtype=next(self.model.parameters()).dtype)
            self._critic, self._critic_optimizer = prepare_critic(
                self.accelerator,
                critic,
                learning_rate=run.critic.learning_rate or args.learning_rate,
                weight_decay=args.weight_decay,
                optimizer_cls=torch.optim.SGD if run.critic.optim == "sgd" else torch.optim.AdamW,
            )
        self.step_runner = StepRunner(
            run,
            self.accelerator,
            pad_token_id=self.processing_class.pad_token_id,
            critic=self._critic,
            critic_optimizer=self._critic_optimizer,
            sequence_parallel=sequence_parallel,
        )
        self.add_callback(OptimizerTimer(self))
        self.add_callback(PeakMemory(self))
        if args.console_metrics == "compact":
            use_compact_console(self)
        self.add_callback(StopAtStepEnd(self))
        self.add_callback(SaveRunConfig(self))  # output_dir/run_config/: what a replay rebuilds the plugins from
        self.add_callback(ViewerPages(self))  # trajectory pages every viewer_steps (docs/viewer.md)
        self.metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
        """Where every logged record goes, one JSON line per logging step."""
        self.last_batch: StepBatch | None = None
        """The last rollout batch: trajectories, datums, rows, and why the update left each out (the viewer reads
        it)."""
        # How the plugins' step_metrics() combine over ranks (what they declare).
        self._metric_reductions = {
            k: v
            for plugin in (*run.tools.values(), *run.rewards, run.advantage, run.policy_loss)
            for k, v in plugin.metric_reductions().items()
        }
        self._last_table_step = -1
        # async_rollouts: a generation replica samples the next batches while this one trains (docs/training.md).
        # vLLM server mode: no replica, the rollouts run on threads of this process against the server.
        self._async = (
            AsyncRollouts(
                args.features.async_rollouts,
                run.rollout_parts(),
                sampler=run.sampler,
                pad_token_id=self.processing_class.pad_token_id,
                token_budget=run.rollout.token_budget,
                server_backend=self._sampler.with_sampling(sampling_settings(args)) if run.sampler.is_vllm else None,
            )
            if args.features.async_rollouts is not None
            else None
        )

    def generation_backend(self, *, temperature: float | None = None) -> Any:
        """The run's sampler (vLLM, transformers' continuous batching or HF generate on the training model) with the
        config's sampling settings; ``temperature`` overrides the config's (e.g. 0 for greedy evaluation)."""
        if not self.run.sampler.is_vllm:
            self._sampler.model = self.model_wrapped  # Accelerate/DeepSpeed wrap it when training starts
        sampling = sampling_settings(self.args, temperature=temperature)
        shared = self._async.generation_backend(sampling) if self._async is not None else None
        return shared if shared is not None else self._sampler.with_sampling(sampling)

    def reward_names(self) -> list[str]:
        """The reward components the run logs as ``reward/<name>`` (:meth:`~trl_plugins.run.Run.reward_names`)."""
        return self.run.reward_names()

    def record_metrics(self, metrics: Mapping[str, float]) -> None:
        """Add values to the current step's record (e.g. from a callback's periodic evaluation); they are
        logged with the step's other metrics at the next logging step, to the loggers and ``metrics.jsonl``."""
        for key, value in metrics.items():
            self._metrics["train"][key].append(float(value))

    def stop_after_this_step(self, signum: int) -> None:
        """Every rank agreed to stop (signal ``signum``): the step being finished is saved, then ``train`` raises."""
        self._stop_signum = signum

    # -- one step --------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: list[dict], num_items_in_batch: Any = None) -> torch.Tensor:
        """Roll out, score and update once (the HF Trainer loop clips and steps the optimizer after)."""
        start = time.perf_counter()
        reset_peak_memory()
        # As Trainer.training_step: a model loaded with from_pretrained starts in eval mode, and
        # GRPOTrainer.log files metrics under "eval" while it is.
        model.train()
        rows = list(inputs)[:: self.num_generations]  # TRL's sampler repeats each question G times
        fresh = self._step % self.num_iterations == 0 or self.last_batch is None
        if fresh:
            self.last_batch = self._roll_out(rows) if self._async is None else self._roll_out_async(rows)
            metrics = dict(self.last_batch.metrics)
        else:
            self._raise_if_stop_agreed()
            metrics = {"train/reused_rollout": 1.0}
        batch = self.last_batch
        # How stale the data is: optimizer steps between the sampling weights and these.
        metrics["train/policy_version_lag"] = float(self.state.global_step - batch.policy_step) if batch.datums else 0.0
        self._step += 1
        loss, update = self.step_runner.update(
            batch, model, self.optimizer, global_step=self.state.global_step, teacher=self._teacher
        )
        metrics.update(update)
        metrics["timing/step_s"] = time.perf_counter() - start  # memory/*: PeakMemory, after the optimizer step
        if "timing/trainer_idle_s" in metrics:  # async: the share of the step the trainer waited for its sampler
            metrics["timing/trainer_idle_ratio"] = metrics["timing/trainer_idle_s"] / max(
                metrics["timing/step_s"], 1e-9
            )
        merged = self.step_runner.merge_metrics(metrics, batch.summaries if fresh else None, self._metric_reductions)
        self.record_metrics(merged)
        self._count_update(
            batch.update_skipped, warmup=batch.skipped_for_warmup, limit=self.args.max_steps_without_update
        )
        return loss

    def _sampler_for_step(self) -> Any:
        """``sample(rows, seed, id_offset)``: phases 1-2 on ``rows`` with the run's sampler in this process, sampled by
        this step's weights (collectives inside: every rank)."""
        args, steps, step = self.args, self.step_runner, self.state.global_step
        backend = self.generation_backend()

        def sample(part: list[dict], seed: int, id_offset: int = 0) -> tuple[Any, StepBatch]:
            result = steps.roll_out(
                backend,
                part,
                policy_step=step,
                seed=seed,
                id_offset=id_offset,
                progress=args.progress_rollout and not args.disable_tqdm and self.accelerator.is_local_main_process,
                stop=self.stop_event,
            )
            # Every rank agrees here, before the round's first other collective, whether a stop was requested.
            self._raise_if_stop_agreed()
            assert result is not None  # a cancelled rollout means this rank asked for the stop
            return result, steps.score(result, part, policy_step=step)

        return sample

    def _fill(self, result: Any, batch: StepBatch, sample: Any) -> StepBatch:
        """Dynamic sampling's refill rounds (``dynamic_sampling``), sampled by ``sample`` in this process."""
        args, step, rank = self.args, self.state.global_step, self.accelerator.process_index

        def refill(indices: list[int], round_index: int, id_offset: int) -> tuple[Any, StepBatch]:
            return sample(
                [self.train_dataset[i] for i in indices],
                derive_seed(args.seed, step, rank, "refill", round_index),
                id_offset=id_offset,
            )

        return self.step_runner.fill(
            result,
            batch,
            sample=refill,
            num_rows=len(self.train_dataset),
            seed=derive_seed(args.seed, step, "refill-rows"),
        )

    def _roll_out(self, rows: list[dict]) -> StepBatch:
        """Phases 1-6 of :mod:`~trl_plugins.trainers.phases` on this rank's rows (collectives inside: every rank)."""
        args, step, rank = self.args, self.state.global_step, self.accelerator.process_index
        sample = self._sampler_for_step()
        result, batch = sample(rows, derive_seed(args.seed, step, rank))
        if args.features.dynamic_sampling is not None:
            batch = self._fill(result, batch, sample)
        return self._after_rollout(batch)

    def _after_rollout(self, batch: StepBatch, *, tool_metrics: Any = None) -> StepBatch:
        """Phases 3-6 on a scored batch: datums, reference, values and advantages, old (proximal) log-probs and the
        decoupled objective's tripwires, summaries (``tool_metrics``: those of the process that ran the tools)."""
        steps = self.step_runner
        steps.build_datums(batch)
        steps.reference(batch, *self._reference_model())
        steps.teacher(batch, self._teacher)
        steps.advantages(batch)
        steps.old_logprobs(batch, self.model_wrapped)
        steps.replay_gap(batch, self.model_wrapped, step=self.state.global_step)
        steps.check_off_policy(batch)
        steps.summarise(batch, tool_metrics=tool_metrics)
        return batch

    def _roll_out_async(self, rows: list[dict]) -> StepBatch:
        """Phases 1-6 with the rollout from the generation replica (:mod:`~trl_plugins.trainers.async_rollouts`): the
        weights of this step pushed, the next batches queued, this step's rollout collected; the rest as
        :meth:`_roll_out`, the old log-probs being the proximal policy's with the decoupled objective."""
        args, steps, step, rank = self.args, self.step_runner, self.state.global_step, self.accelerator.process_index
        upcoming = [list(b)[:: self.num_generations] for b in self._async.upcoming]
        stop = self.stop_event
        answer, metrics = self._async.roll_out(
            step,
            rows,
            upcoming,
            lambda: unwrapped_for_generation(self.model_wrapped, self.accelerator),
            group_size=self.num_generations,
            seed=lambda s: derive_seed(args.seed, s, rank),
            cancelled=(lambda: stop.is_set()) if stop is not None else None,
        )
        self._raise_if_stop_agreed()  # every rank agrees here, as after a synchronous rollout
        assert answer is not None  # a cancelled wait means this rank asked for the stop
        batch = steps.score(answer.result, rows, policy_step=answer.policy_step)
        if args.features.dynamic_sampling is not None:  # refill rounds here, by this step's weights (on-policy)
            batch = self._fill(answer.result, batch, self._sampler_for_step())
        batch.metrics.update(metrics)
        return self._after_rollout(batch, tool_metrics=answer.tool_metrics)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """As ``Trainer.get_batch_samples``; with ``async_rollouts`` the loader is read ``max_staleness`` batches
        ahead, so that the replica can roll them out while this step trains (the batches and their order unchanged)."""
        if self._async is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        steps_left = (self.state.max_steps - self.state.global_step) if self.state.max_steps > 0 else 1 << 30
        return self._async.take(epoch_iterator, num_batches, steps_left), None

    def _release_step_resources(self) -> None:
        """Stop the generation replica (however training ends)."""
        if self._async is not None:
            self._async.close()

    def _reference_model(self) -> tuple[Any, Any]:
        """The reference on the datums: TRL's frozen reference model (prepared like the policy, so sharded under
        ZeRO-3), or with PEFT the policy itself with its adapter disabled (no second copy)."""
        if not self.args.beta > 0:
            return None, None
        from accelerate.utils import is_peft_model
        from trl.trainer.utils import use_adapter

        if self.ref_model is not None:
            return self.ref_model, None
        unwrapped = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(unwrapped):
            raise RuntimeError("beta > 0 but TRL built no reference model and the policy has no adapter to disable.")
        name = "ref" if "ref" in unwrapped.peft_config else None
        return self.model_wrapped, (lambda: use_adapter(unwrapped, adapter_name=name))

    # -- logging and the model card ------------------------------------------------------------------

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
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": self.state.global_step, **logs}) + "\n")
            step = self.state.global_step
            if step != self._last_table_step and log_trajectory_tables(self, step):
                self._last_table_step = step

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        *,
        model_path: str | None = None,
    ) -> None:
        """TRL's card (``output_dir/README.md``), naming the base model also when it was loaded from a local
        folder (TRL names only Hub ids, which left "fine-tuned version of [None]"), and with a quick-start that loads
        the trained model from ``model_path`` (default: ``output_dir``) when the run pushes to no Hub repo (TRL's
        said ``model="None"``)."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if self.is_world_process_zero():
            card = os.path.join(self.args.output_dir, "README.md")
            name_local_base_model(card, self.model.config._name_or_path)
            name_quick_start_model(card, model_path or self.args.output_dir)
