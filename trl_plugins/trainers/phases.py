"""One training step as phases that read top-down (glue: each phase calls the plain functions of
:mod:`~trl_plugins.pipeline.batch`, :mod:`~trl_plugins.trainers.update` and :mod:`~trl_plugins.trainers.critic`, and
returns its metrics).

Once per rollout batch (:meth:`StepRunner.roll_out` ... :meth:`StepRunner.old_logprobs`):

1. **rollout**: the run's rollout plugin on this rank's rows (the sampler's weights brought up to date first);
2. **scoring**: every reward component on every trajectory, then the verifier-failure rate over the ranks
   (one all-reduce; the run stops on every rank alike above ``max_verifier_error_rate``, or above
   ``max_environment_error_rate`` of trajectories ending ``environment_error``); with ``dynamic_sampling``,
   **fill** (DAPO): groups whose rewards are all equal are dropped and refill rounds (phases 1-2 on fresh rows) run
   until the step holds its number of groups over the ranks (one gather of flags per round);
3. **datums**: why each trajectory is left out (:class:`~trl_plugins.types.LeftOutReason`, recorded on the batch), and
   one datum per trajectory trained on;
4. **reference log-probs** (``beta > 0``; forwards on every rank), the KL in the reward when asked;
5. **values and advantages**: the critic's values (forwards on every rank) when the estimator ``needs_values``, then
   the estimator (:func:`~trl_plugins.pipeline.batch.assign_advantages`);
6. **old log-probs** when the sampler/trainer mismatch correction applies (an all-reduce decides; forwards).

Every step (:meth:`StepRunner.update` ... :meth:`StepRunner.merge_metrics`):

7. **policy update**: the exact multi-rank update (:func:`~trl_plugins.trainers.update.policy_update`), unless
   nothing is to be trained (counted over the ranks) or the critic is warming up;
8. **critic update** (a critic's own exact step);
9. **metrics**: every rank's figures and trajectory summaries gathered once, reduced by meaning.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from trl_plugins.algos.dynamic_sampling import draw_rows, informative_groups, plan_fill, plan_round, refill_share
from trl_plugins.pipeline.batch import (
    add_kl_penalty,
    assign_advantages,
    build_datums_for_update,
    kl_per_token,
    left_out_reasons,
    rollout_rows,
    score_trajectories,
)
from trl_plugins.rollout import RolloutCancelled, RolloutResult
from trl_plugins.rollout.metrics import (
    TrajectorySummary,
    engine_metrics,
    reduce_rank_metrics,
    reward_metrics,
    staleness_counts,
    staleness_metrics,
    summarize,
    trajectory_metrics,
)
from trl_plugins.run import Run
from trl_plugins.trainers.async_rollouts import check_off_policy, off_policy_figures
from trl_plugins.trainers.critic import rollout_values, value_update
from trl_plugins.trainers.diagnosis import (
    SKIP_COUNTS,
    environment_error_message,
    nothing_to_train,
    skip_counts,
    top_error_kinds,
)
from trl_plugins.trainers.ranks import all_reduce_sum, reduce_over_ranks
from trl_plugins.trainers.update import (
    datums_to_forward,
    mismatch_correction_applies,
    old_logprobs,
    policy_update,
    reference_logprobs,
    teacher_logprobs,
)
from trl_plugins.types import Datum, LeftOutReason, StopReason, Trajectory

REPLAY_SAMPLE = 2
"""Datums per rank whose log-probs ``replay_every_steps`` recomputes."""

__all__ = ["StepBatch", "StepRunner"]


ROLLOUT_VERIFIER = "rollout"
"""The name the verifier failures a rollout reported itself count under (``reward/verifier_error_rate/rollout``): a
verifiers environment's judge, run inside the environment."""


@dataclass
class StepBatch:
    """One rollout batch and everything decided about it: what the step trains on, and why not the rest.

    The trainer keeps the last one (``MultiTurnGRPOTrainer.last_batch``): the trajectory viewer, the W&B tables and
    tests read it.
    """

    policy_step: int
    """The optimizer step whose weights sampled it."""
    rows: list[dict]
    """This rank's dataset rows (``rows[traj.group_id]``)."""
    trajectories: list[Trajectory]
    """Scored, with advantages."""
    left_out: list[LeftOutReason | None]
    """Per trajectory, why the update leaves it out (None: trained on)."""
    datums: list[Datum]
    """One per trajectory trained on (``datum.trajectory_index``), with advantages."""
    forwarded: frozenset[int] = frozenset()
    """Trajectory indices whose datum the update forwards (zero-advantage ones may be skipped)."""
    update_skipped: str | None = None
    """Why the last step on this batch made no policy update (None: it made one)."""
    skipped_for_warmup: bool = False
    """The update was skipped for a configured warm-up (``critic_warmup_steps``), not for want of data."""
    metrics: dict[str, float] = field(default_factory=dict)
    """This rank's rollout-side figures (engine, scoring, timings of the phases above)."""
    summaries: list[TrajectorySummary] = field(default_factory=list)
    """This rank's trajectory summaries (gathered over the ranks for the step's trajectory metrics)."""

    @property
    def masked(self) -> list[bool]:
        """Per trajectory, whether the update leaves it out."""
        return [r is not None for r in self.left_out]


class StepRunner:
    """The phases of a step for one run on one rank.

    Args:
        run: The run (plugins, config, chat format bound).
        accelerator: The trainer's accelerator.
        pad_token_id: Padding id for collation.
        critic, critic_optimizer: The prepared critic and its optimizer when the estimator ``needs_values``.
        sequence_parallel: This rank's sequence-parallel group (the policy update's forwards split), or None.
    """

    def __init__(
        self,
        run: Run,
        accelerator: Any,
        *,
        pad_token_id: int,
        critic: Any = None,
        critic_optimizer: Any = None,
        sequence_parallel: Any = None,
    ) -> None:
        self.run, self.accelerator, self.pad_token_id = run, accelerator, pad_token_id
        self.critic, self.critic_optimizer = critic, critic_optimizer
        self.sequence_parallel = sequence_parallel
        self.config = run.config

    # -- once per rollout batch ----------------------------------------------------------------------

    def roll_out(
        self,
        backend: Any,
        rows: list[dict],
        *,
        policy_step: int,
        seed: int,
        progress: bool,
        stop: Any,
        id_offset: int = 0,
    ) -> RolloutResult | None:
        """1. This rank's trajectories (None: a stop request cancelled the rollout here)."""
        try:
            return rollout_rows(
                self.run,
                backend,
                rows,
                group_size=self.config.num_generations,
                seed=seed,
                policy_step=policy_step,
                id_offset=id_offset,
                progress=progress,
                stop=stop,
            )
        except RolloutCancelled:
            return None

    def score(self, result: RolloutResult, rows: list[dict], *, policy_step: int) -> StepBatch:
        """2. Scores (a collective: the verifier and environment failure rates over the ranks) and left-out reasons; no
        datums yet."""
        c, trajs = self.config, result.trajectories
        start = time.perf_counter()
        examples: dict[str, str] = {}
        # A verifier the rollout ran (a verifiers environment's judge) fails its trajectories before this scoring.
        earlier = [t for t in trajs if t.stop_reason == StopReason.VERIFIER_ERROR]
        failures = score_trajectories(
            self.run.rewards, trajs, rows, time_limit_s=c.reward_time_limit_s, examples=examples
        )
        scoring_s = time.perf_counter() - start
        # The most common kind of failure on this rank (a judge's timeouts, say), one of its messages as the example.
        example = next(iter(examples.values()), None) or next((t.error for t in earlier), None)
        if earlier:
            failures = {**failures, ROLLOUT_VERIFIER: len(earlier)}
        metrics = self._check_world_failures(failures, trajs, example=example)
        left_out = left_out_reasons(
            trajs, mask_truncated=c.truncated_policy == "mask", min_valid_group_fraction=c.min_valid_group_fraction
        )
        metrics.update({**engine_metrics(result), "timing/scoring_s": scoring_s})
        return StepBatch(policy_step, list(rows), trajs, left_out, [], metrics=metrics)

    def build_datums(self, batch: StepBatch) -> None:
        """3. One datum per trajectory the update trains on."""
        c = self.config
        batch.datums = build_datums_for_update(
            batch.trajectories,
            batch.left_out,
            max_context_tokens=self.run.max_context_tokens,
            bootstrap_truncated=c.truncated_policy == "bootstrap",
        )

    def fill(
        self,
        result: RolloutResult,
        batch: StepBatch,
        *,
        sample: Callable[[list[int], int, int], tuple[RolloutResult, StepBatch]],
        num_rows: int,
        seed: int,
    ) -> StepBatch:
        """2b. Dynamic sampling (``dynamic_sampling``; :mod:`~trl_plugins.algos.dynamic_sampling`): keep the step's
        first informative groups, drop the rest, and refill from the training set until the step holds as many groups
        as its first round did over the ranks, or ``dynamic_sampling_max_groups`` is reached. The decisions are the
        pure :func:`~trl_plugins.algos.dynamic_sampling.plan_round`'s, a function of the global batch only.

        ``result`` and ``batch`` are this rank's first round, scored. ``sample(indices, round, id_offset)`` rolls out
        and scores the training rows ``indices``, this rank's share of a refill round (every rank gets at least one row,
        so that every rank generates in every round; rows beyond what the round counts are fillers), their question ids
        numbered from ``id_offset`` (the rows this rank drew before). Collectives inside (one gather of flags per
        round): every rank calls it. Returns the merged batch: every trajectory drawn, those of dropped groups left out
        (``equal_rewards``, ``surplus``, ``filler``), with the ``dynamic_sampling/*`` metrics; no datums yet.
        """
        c, acc = self.config, self.accelerator
        world, rank = acc.num_processes, acc.process_index
        (target,) = reduce_over_ranks(acc, [float(len(batch.rows))], "sum")
        settings = c.features.dynamic_sampling
        plan = plan_fill(int(target), settings.max_groups)
        rounds: list[_Round] = []
        while True:
            flags = informative_groups(
                [_metric_of(t, settings.metric) for t in batch.trajectories],
                [t.group_id for t in batch.trajectories],
                [r is None for r in batch.left_out],
                len(batch.rows),
            )
            by_rank = _gather_lists(acc, flags)
            in_order = [f for rank_flags in by_rank for f in rank_flags]  # the round's global order
            counted = plan.next_count  # the round's first `counted` groups count; the rest are fillers
            plan, keep = plan_round(plan, in_order[:counted])
            first = sum(len(f) for f in by_rank[:rank])
            mine = range(first, first + len(flags))
            rounds.append(
                _Round(
                    result,
                    batch,
                    flags,
                    [i < counted and keep[i] for i in mine],
                    [i >= counted for i in mine],
                    len(in_order),
                )
            )
            if plan.next_count == 0:
                break
            share = refill_share(plan, rank, world)
            indices = draw_rows(num_rows, share.start, len(share), seed=seed)
            result, batch = sample(indices, len(rounds), sum(len(r.batch.rows) for r in rounds))
        merged = _merge_rounds(rounds, self.config.num_generations)
        fillers = sum(r.groups for r in rounds) - plan.drawn
        merged.metrics.update(
            {
                "dynamic_sampling/rounds": float(plan.rounds),
                "dynamic_sampling/groups_drawn": float(plan.drawn),
                "dynamic_sampling/draw_factor": plan.drawn / max(plan.target, 1),
                "dynamic_sampling/informative_frac": plan.informative / max(plan.drawn, 1),
                "dynamic_sampling/kept_groups": float(plan.kept),
                "dynamic_sampling/short_groups": float(plan.target - plan.kept),
                "dynamic_sampling/surplus_groups": float(plan.informative - plan.kept),
                "dynamic_sampling/filler_groups": float(fillers),
            }
        )
        return merged

    def reference(self, batch: StepBatch, model: Any, context: Callable[[], Any] | None) -> None:
        """4. Reference log-probs (``beta > 0``; every rank forwards), and the KL in the reward when asked."""
        c = self.config
        if not c.beta > 0:
            return
        start = time.perf_counter()
        reference_logprobs(self.accelerator, model, batch.datums, c, pad_token_id=self.pad_token_id, context=context)
        batch.metrics["timing/reference_s"] = time.perf_counter() - start
        if c.kl_penalty == "reward" and self.critic is None:
            add_kl_penalty(batch.trajectories, batch.datums, beta=c.beta, estimator=c.kl_estimator)

    def teacher(self, batch: StepBatch, model: Any) -> None:
        """4b. The teacher's log-probs of the action tokens for an advantage estimator that reads them (on-policy
        distillation; every rank forwards), and a server teacher's top tokens there for a loss that reads the
        divergence to it. A loss that reads the divergence to a local teacher forwards it in the update instead."""
        loss = self.run.policy_loss
        top_k = 0  # a server teacher's top tokens, for a loss that compares the distributions there
        if loss.teacher_divergence is not None and model is not None and not isinstance(model, torch.nn.Module):
            top_k = loss.teacher_top_k or 1
        if model is None or not (self.run.advantage.needs_teacher_logprobs or top_k):
            return
        start = time.perf_counter()
        prompts = self._privileged_prompts(batch)
        routed = getattr(model, "teachers", None)  # RoutedTeachers: each route's datums to its teacher, on every rank
        if routed is None:
            teacher_logprobs(
                self.accelerator,
                model,
                batch.datums,
                self.config,
                pad_token_id=self.pad_token_id,
                prompts=prompts,
                top_k=top_k,
            )
        else:
            routes = [model.route(batch.rows[batch.trajectories[d.trajectory_index].group_id]) for d in batch.datums]
            for route, teacher in routed.items():
                mine = [k for k, r in enumerate(routes) if r == route]
                teacher_logprobs(
                    self.accelerator,
                    teacher,
                    [batch.datums[k] for k in mine],
                    self.config,
                    pad_token_id=self.pad_token_id,
                    prompts=None if prompts is None else [prompts[k] for k in mine],
                )
        batch.metrics["timing/teacher_forward_s"] = time.perf_counter() - start

    def _privileged_prompts(self, batch: StepBatch) -> list[tuple[list[int], int]] | None:
        """Self-distillation: per datum, the teacher's first prompt (its row's, with the privileged field joined to the
        last user message) and the length of the datum's own; None without a privileged field."""
        settings = self.config.features.distillation
        if settings is None or settings.privileged_field is None:
            return None
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        out = []
        for d in batch.datums:
            traj = batch.trajectories[d.trajectory_index]
            row = batch.rows[traj.group_id]
            prompt = row["prompt"]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            teacher_prompt = self.run.chat.initial_prompt_ids(settings.privileged(system + messages, row))
            out.append((teacher_prompt, len(traj.turns[0].prompt_ids)))
        return out

    def advantages(self, batch: StepBatch) -> None:
        """5. The critic's values (every rank forwards) when the estimator needs them, then the advantages."""
        c, trajs, datums = self.config, batch.trajectories, batch.datums
        if self.critic is None:
            assign_advantages(self.run.advantage, trajs, datums)
            return
        start = time.perf_counter()
        after = rollout_values(self.accelerator, self.critic, datums, c, pad_token_id=self.pad_token_id)
        batch.metrics["timing/critic_values_s"] = time.perf_counter() - start
        token_rewards = None
        if c.beta > 0 and c.kl_penalty == "reward":
            # Per token, as in classic PPO; the kl_penalty component is kept for the record with weight 0.
            token_rewards = [-c.beta * kl_per_token(d, c.kl_estimator) for d in datums]
            add_kl_penalty(trajs, datums, beta=0.0, estimator=c.kl_estimator)
        world = self.accelerator.num_processes
        assign_advantages(
            self.run.advantage,
            trajs,
            datums,
            bootstrap_values=after,
            token_rewards=token_rewards,
            all_reduce=(lambda t: all_reduce_sum(self.accelerator, t)) if world > 1 else None,
        )

    def old_logprobs(self, batch: StepBatch, policy: Any) -> None:
        """6. The policy's own log-probs of the sampling weights (pi_old) when the mismatch correction applies (an
        all-reduce decides, on every rank alike). Reused rollouts keep them."""
        c = self.config
        if not mismatch_correction_applies(self.accelerator, batch.trajectories, self.run.policy_loss, c):
            return
        start = time.perf_counter()
        forwarded = [batch.datums[i] for i in datums_to_forward(batch.datums, self.run.policy_loss, c)]
        old_logprobs(self.accelerator, policy, forwarded, c, pad_token_id=self.pad_token_id)
        batch.metrics["timing/old_logprobs_s"] = time.perf_counter() - start

    def check_off_policy(self, batch: StepBatch) -> None:
        """6b. With the decoupled objective (``async_rollouts``): the gap between the proximal and the behaviour
        log-probs and the importance weights' effective sample size over every rank's trained tokens, against their
        tripwires (one all-reduce; every rank stops alike)."""
        if not self.config.features.decoupled:
            return
        forwarded = [batch.datums[i] for i in datums_to_forward(batch.datums, self.run.policy_loss, self.config)]
        totals = reduce_over_ranks(self.accelerator, off_policy_figures(forwarded), "sum")
        batch.metrics.update(check_off_policy(self.config.features.async_rollouts, totals))

    def replay_gap(self, batch: StepBatch, policy: Any, *, step: int) -> None:
        """6c. Every ``replay_every_steps`` steps: the log-probs of up to :data:`REPLAY_SAMPLE` of this rank's datums
        sampled at ``step`` recomputed by ``policy`` (the weights that sampled them: before the update) and their
        gap to the behaviour log-probs, max and mean over every rank's action tokens (``replay/*``). Every rank
        calls it (a forward pass per rank, two all-reduces)."""
        every = self.config.replay_every_steps
        if not every or step % every:
            return
        sample = [
            dataclasses.replace(d, old_logprobs=None)
            for d in batch.datums
            if (v := batch.trajectories[d.trajectory_index].policy_version) is not None and v.step == step
        ]
        sample = sample[:REPLAY_SAMPLE]
        old_logprobs(self.accelerator, policy, sample, self.config, pad_token_id=self.pad_token_id)
        gaps = [abs(o - b) for d in sample for o, b, m in zip(d.old_logprobs, d.behaviour_logprobs, d.action_mask) if m]
        (largest,) = reduce_over_ranks(self.accelerator, [max(gaps, default=0.0)], "max")
        total, count = reduce_over_ranks(self.accelerator, [float(sum(gaps)), float(len(gaps))], "sum")
        batch.metrics["replay/logprob_gap_max"] = largest
        batch.metrics["replay/logprob_gap_mean"] = total / count if count else 0.0

    def summarise(self, batch: StepBatch, *, tool_metrics: Mapping[str, float] | None = None) -> None:
        """The batch's trajectory summaries and this rank's tools' and reward components' step metrics
        (``tool_metrics``: those reported by the process that ran the rollout, the generation replica: its tools and
        the judges that scored during the rollout)."""
        rank = self.accelerator.process_index
        batch.summaries = [summarize(t, rank=rank, masked=m) for t, m in zip(batch.trajectories, batch.masked)]
        batch.metrics["train/datums"] = float(len(batch.datums))
        local: dict[str, float] = {}
        plugins = [*self.run.tools.values(), *self.run.rewards]  # a judge's calls, tokens, latency and cache hits
        for plugin in plugins:
            local.update(plugin.step_metrics())
        if tool_metrics is not None and local:  # both processes ran tools or judges (async): combined by meaning
            reductions = {k: v for plugin in plugins for k, v in plugin.metric_reductions().items()}
            local = reduce_rank_metrics([dict(tool_metrics), local], reductions)
        batch.metrics.update(local if local or tool_metrics is None else tool_metrics)

    # -- every step ------------------------------------------------------------------------------------

    def update(
        self, batch: StepBatch, model: Any, optimizer: Any, *, global_step: int, teacher: Any = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """7. The policy update (or why none), and 8. the critic's; returns the loss and the update's metrics."""
        c, run = self.config, self.run
        metrics: dict[str, float] = {}
        forwarded = datums_to_forward(batch.datums, run.policy_loss, c)
        batch.forwarded = frozenset(batch.datums[i].trajectory_index for i in forwarded)
        # With what each rank left out, in the same all-reduce: a skip says why, the same on every rank.
        counts = reduce_over_ranks(
            self.accelerator,
            skip_counts(len(batch.trajectories), len(batch.datums), len(forwarded), batch.left_out),
            "sum",
        )
        total = counts[SKIP_COUNTS.index("forwarded")]
        warmup = self.critic is not None and global_step < run.critic.warmup_steps
        if self.critic is not None:
            metrics["critic/warmup"] = float(warmup)
        batch.update_skipped = (
            "the critic's warm-up, critic_warmup_steps" if warmup else nothing_to_train(counts) if total == 0 else None
        )
        batch.skipped_for_warmup = warmup
        if batch.update_skipped:
            metrics["train/update_skipped"] = 1.0
            loss = torch.zeros((), device=c.device)
        else:
            start = time.perf_counter()
            result = policy_update(
                self.accelerator,
                model,
                optimizer,
                batch.datums,
                run.policy_loss,
                c,
                pad_token_id=self.pad_token_id,
                step_optimizer=False,
                sequence_parallel=self.sequence_parallel,
                teacher=teacher,
            )
            metrics["timing/forward_backward_s"] = time.perf_counter() - start
            metrics.update(_update_metrics(result))
            loss = torch.tensor(result.loss, device=c.device)
        if self.critic is not None:
            start = time.perf_counter()
            vr = value_update(
                self.accelerator,
                self.critic,
                self.critic_optimizer,
                batch.datums,
                c,
                vf_clip=run.critic.vf_clip,
                vf_coef=run.critic.vf_coef,
                max_grad_norm=c.max_grad_norm,
                pad_token_id=self.pad_token_id,
            )
            metrics.update(
                {
                    "critic/value_loss": vr.loss,
                    "critic/clip_frac": vr.clip_frac,
                    "critic/explained_variance": vr.explained_variance,
                    "critic/returns_mean": vr.returns_mean,
                    "critic/returns_std": vr.returns_std,
                    "critic/values_mean": vr.values_mean,
                    "timing/critic_update_s": time.perf_counter() - start,
                }
            )
        # How stale the trained tokens are: optimizer steps between the weights that sampled each and these.
        counts = reduce_over_ranks(self.accelerator, staleness_counts(batch.datums, global_step), "sum")
        metrics.update(staleness_metrics(counts))
        # What the advantage estimator and the policy loss report of this step (advantage/*, policy_loss/*).
        metrics.update(run.advantage.step_metrics())
        metrics.update(run.policy_loss.step_metrics())
        return loss, metrics

    def merge_metrics(
        self, metrics: Mapping[str, float], summaries: list[TrajectorySummary] | None, reductions: Mapping[str, str]
    ) -> dict[str, float]:
        """9. One gather per step: every rank's metrics and trajectory summaries. Trajectory metrics are computed over
        the union of all ranks' trajectories; the rest is reduced by its meaning
        (:func:`~trl_plugins.rollout.metrics.reduce_rank_metrics`). Every rank gets the same numbers."""
        if self.accelerator.num_processes == 1:
            per_rank, union = [dict(metrics)], summaries
        else:
            from accelerate.utils import gather_object

            gathered = gather_object([(dict(metrics), summaries)])
            per_rank = [m for m, _ in gathered]
            union = None if summaries is None else [s for _, ss in gathered for s in (ss or [])]
        out = reduce_rank_metrics(per_rank, reductions)
        if union is not None:
            out.update(trajectory_metrics(union, tools=list(self.run.tools)))
            out.update(reward_metrics(union, self.run.reward_names()))
        return out

    def _check_world_failures(
        self, failures: Mapping[str, int], trajs: list[Trajectory], *, example: str | None = None
    ) -> dict[str, float]:
        """Verifier and environment error rates of the step over all ranks (one all-reduce); stops the run, on every
        rank alike, above ``max_verifier_error_rate`` or ``max_environment_error_rate`` (the latter over the
        trajectories not cancelled; before stopping, one gather of each rank's three most common error kinds names
        the most common over the ranks)."""
        names = [r.name for r in self.run.rewards] + [ROLLOUT_VERIFIER]
        environment = [t for t in trajs if t.stop_reason == StopReason.ENVIRONMENT_ERROR]
        live = sum(t.stop_reason != StopReason.CANCELLED for t in trajs)
        counts = reduce_over_ranks(
            self.accelerator,
            [float(failures.get(name, 0)) for name in names]
            + [float(len(trajs)), float(len(environment)), float(live)],
            "sum",
        )
        total = max(counts[len(names)], 1.0)
        rates = {
            f"reward/verifier_error_rate/{name}": c / total
            for name, c in zip(names, counts)
            if name != ROLLOUT_VERIFIER or c > 0  # logged where a rollout reported verifier failures
        }
        rate = sum(counts[: len(names)]) / total
        limit = self.config.max_verifier_error_rate
        if rate > limit:
            worst = max(zip(names, counts), key=lambda item: item[1])[0]
            worst = "the rollout's own verifier" if worst == ROLLOUT_VERIFIER else repr(worst)
            raise RuntimeError(
                f"{rate:.0%} of this step's trajectories failed a reward component (most: {worst}), over "
                f"max_verifier_error_rate={limit}: the verifier looks broken, so the run stops instead of training on "
                f"noise (e.g. {example or 'see the other ranks'}; every failure is logged as a 'verifier_error' "
                f"warning). Fix the component or raise max_verifier_error_rate."
            )
        env_rate = counts[-2] / max(counts[-1], 1.0)
        env_limit = self.config.max_environment_error_rate
        if env_rate > env_limit:  # every rank sees the same sums, so every rank gathers the kinds and stops alike
            kinds = top_error_kinds(t.error for t in environment)
            if self.accelerator.num_processes > 1:
                from accelerate.utils import gather_object

                kinds = gather_object(kinds)  # each rank's few (kind, count) pairs, concatenated
            raise RuntimeError(environment_error_message(env_rate, env_limit, kinds, int(counts[-2])))
        return {"reward/verifier_error_rate": rate, **rates}


def _metric_of(traj: Trajectory, metric: str) -> float:
    """The value dynamic sampling compares: the weighted total reward, or one component's value (0 for a trajectory
    without components: the world failed it, and it is left out anyway)."""
    if metric == "reward" or not traj.reward_components:
        return float(traj.reward)
    return float(traj.reward_component(metric).value)


def _gather_lists(accelerator: Any, flags: list[bool]) -> list[list[bool]]:
    """Every rank's ``flags``, in rank order, on every rank."""
    if accelerator.num_processes == 1:
        return [list(flags)]
    from accelerate.utils import gather_object

    return [list(f) for f in gather_object([list(flags)])]


@dataclass
class _Round:
    """One round of dynamic sampling on this rank."""

    result: RolloutResult
    batch: StepBatch
    informative: list[bool]
    """Per group of this rank's round, whether its rewards differ."""
    keep: list[bool]
    """Per group of this rank's round, whether the step keeps it."""
    filler: list[bool]
    """Per group of this rank's round, whether it is a filler (drawn beyond the round's count; never kept)."""
    groups: int
    """The round's groups over all ranks, fillers included."""


def _merge_rounds(rounds: list[_Round], group_size: int) -> StepBatch:
    """One batch of this rank's rounds: rows and trajectories in round order (group ids renumbered), the dropped
    groups' members left out, the engine metrics of the rounds as one rollout (their times add up), the verifier-error
    rates over every round's trajectories (each round's rate is global: weighted by the round's trajectories over the
    ranks) and the scoring time summed."""
    rows: list[dict] = []
    trajs: list[Trajectory] = []
    left_out: list[LeftOutReason | None] = []
    metrics: dict[str, float] = {"timing/scoring_s": 0.0}
    total = sum(r.groups for r in rounds) * group_size
    for r in rounds:
        for traj, reason in zip(r.batch.trajectories, r.batch.left_out):
            g = traj.group_id
            if reason is None and not r.keep[g]:
                reason = (
                    LeftOutReason.FILLER
                    if r.filler[g]
                    else LeftOutReason.SURPLUS
                    if r.informative[g]
                    else LeftOutReason.EQUAL_REWARDS
                )
            traj.group_id += len(rows)
            trajs.append(traj)
            left_out.append(reason)
        rows += r.batch.rows
        for key, value in r.batch.metrics.items():
            if key.startswith("reward/verifier_error_rate"):
                metrics[key] = metrics.get(key, 0.0) + value * r.groups * group_size / max(total, 1)
        metrics["timing/scoring_s"] += r.batch.metrics.get("timing/scoring_s", 0.0)
    results = [r.result for r in rounds]
    merged = RolloutResult(
        trajectories=trajs,
        rounds=sum(x.rounds for x in results),
        generation_s=sum(x.generation_s for x in results),
        tools_s=sum(x.tools_s for x in results),
        total_s=sum(x.total_s for x in results),
        critical_path_s=sum(x.critical_path_s for x in results),
        max_concurrent_tool_calls=max(x.max_concurrent_tool_calls for x in results),
        counters={k: sum(x.counters.get(k, 0.0) for x in results) for x in results for k in x.counters},
    )
    metrics.update(engine_metrics(merged))
    return StepBatch(rounds[0].batch.policy_step, rows, trajs, left_out, [], metrics=metrics)


def _update_metrics(result: Any) -> dict[str, float]:
    out = {
        "train/update_skipped": 0.0,
        "train/micro_batches": float(result.num_micro_batches),
        "train/dummy_micro_batches": float(result.num_dummies),
        "train/input_tokens": float(result.num_input_tokens),
        "train/loss_tokens": float(result.num_loss_tokens),
        "train/forward_tokens": float(result.num_padded_tokens),
        # Real tokens the forwards computed (each shared prefix once in the shared-prefix layout), per input token.
        "train/computed_tokens": float(result.num_computed_tokens),
        "train/computed_per_input_token": result.num_computed_tokens / max(result.num_input_tokens, 1),
        "train/padding_efficiency": result.num_computed_tokens / max(result.num_padded_tokens, 1),
        "train/policy_loss": result.loss,
        "train/forwarded_datums": float(result.num_forwarded),
        "timing/packing_s": result.packing_s,
    }
    if result.reference is not None:
        out.update({f"train/{k}": v for k, v in result.reference.items()})
    if result.entropy is not None:
        out["train/entropy"] = result.entropy
    if result.stats is not None:
        out.update({f"train/{k}": v for k, v in result.stats.summary().items()})
    if result.ratio_quantiles:
        out.update({f"train/{k}": v for k, v in result.ratio_quantiles.items()})
    if result.mismatch is not None:
        out.update({f"train/{k}": v for k, v in result.mismatch.items()})
    return out
