"""Held-out evaluation of a tool-calling policy: pass@1, pass@k and tool-call statistics.

The evaluation runs the training run's own tools, rollout plugin and reward components (its
:class:`~trl_plugins.run.Run`) on the training path (:mod:`trl_plugins.pipeline.batch`), so a number here means
the same thing as ``reward/correct`` in the training logs.

Every held-out figure carries a standard error clustered by problem (:func:`clustered_se`): the samples
of one problem share its difficulty, so they are not independent draws, and the problems are the
units. The gain between two evaluations of the same problems has a paired one
(:func:`paired_difference_se`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from trl_plugins.types import Trajectory

__all__ = [
    "EvalResult",
    "pass_at_k",
    "clustered_se",
    "paired_difference_se",
    "check_success_component",
    "evaluate_policy",
    "summarise",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def clustered_se(numerators: Sequence[float], denominators: Sequence[float]) -> float | None:
    """Standard error of the ratio ``R = sum(numerators) / sum(denominators)`` over independent clusters
    (one per problem: e.g. its correct samples and its samples), the samples inside a cluster correlated.

    The cluster-robust (linearised, "sandwich") variance ``P / (P - 1) * sum_p (x_p - R n_p)^2 / (sum_p n_p)^2``
    over ``P`` clusters (Cameron & Miller, 2015). With ``S`` samples per problem it is the standard error of
    the mean of the per-problem accuracies, ``sd(x_p / S) / sqrt(P)``, which counts the spread between
    problems; the binomial ``sqrt(R (1 - R) / (P S))`` treats the ``P S`` samples as independent and is too
    small when problems differ in difficulty. Zero when every cluster has the same ratio (e.g. all correct).

    Returns:
        The standard error, or None with fewer than 2 clusters or no denominator.
    """
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators.")
    total = sum(denominators)
    clusters = len(numerators)
    if clusters < 2 or total <= 0:
        return None
    ratio = sum(numerators) / total
    spread = sum((x - ratio * n) ** 2 for x, n in zip(numerators, denominators))
    return math.sqrt(clusters / (clusters - 1) * spread) / total


def paired_difference_se(before: Mapping[str, Sequence[int]], after: Mapping[str, Sequence[int]]) -> float | None:
    """Standard error of ``accuracy(after) - accuracy(before)`` when both evaluated the same problems.

    ``before`` and ``after`` map a problem to ``(correct, samples)`` (:attr:`EvalResult.correct_by_problem`).
    The difference of the two ratios is linearised per problem, ``z_p = (a_p - A m_p) / M - (b_p - B n_p) / N``,
    and ``se = sqrt(P / (P - 1) * sum_p z_p^2)``: with ``S`` samples per problem on both sides it is
    ``sd(d_p) / sqrt(P)`` of the per-problem accuracy changes ``d_p``. Pairing removes the problems'
    difficulty from the noise, so it is smaller than the unpaired ``sqrt(se_before^2 + se_after^2)`` when a
    problem that was easy before stays easy after.

    Returns:
        The standard error, or None when the problem sets differ or hold fewer than 2 problems.
    """
    if set(before) != set(after) or len(before) < 2:
        return None
    n_before = sum(n for _, n in before.values())
    n_after = sum(n for _, n in after.values())
    if n_before <= 0 or n_after <= 0:
        return None
    acc_before = sum(c for c, _ in before.values()) / n_before
    acc_after = sum(c for c, _ in after.values()) / n_after
    z = [
        (after[q][0] - acc_after * after[q][1]) / n_after - (before[q][0] - acc_before * before[q][1]) / n_before
        for q in before
    ]
    return math.sqrt(len(z) / (len(z) - 1) * sum(v * v for v in z))


@dataclass
class EvalResult:
    """Evaluation numbers over ``problems`` questions, ``samples`` rollouts each."""

    problems: int
    samples: int
    accuracy: float
    """Mean correctness over every sample (= pass@1)."""
    pass_at_k: dict[int, float]
    """Unbiased pass@k for each requested k."""
    tool_call_rate: float
    """Fraction of samples with at least one tool call."""
    tool_calls_mean: float
    """Tool calls per sample."""
    tool_error_rate: float
    """Failed tool calls over all tool calls."""
    accuracy_with_tool: float | None
    """Accuracy of the samples that called the tool (None when none did)."""
    accuracy_without_tool: float | None
    """Accuracy of the samples that did not."""
    truncated_frac: float
    """Fraction of samples that hit a budget."""
    turns_mean: float
    world_failure_frac: float = 0.0
    """Fraction of samples the infrastructure failed (``environment_error``, ``verifier_error``): counted
    as not correct above; a high value means the numbers measure the infrastructure, not the policy."""
    accuracy_se: float | None = None
    """Standard error of ``accuracy``, clustered by problem (:func:`clustered_se`); None under 2 problems."""
    pass_at_k_se: dict[int, float | None] = field(default_factory=dict)
    """Standard error of each pass@k: the spread of the per-problem estimates over ``sqrt(problems)``."""
    accuracy_with_tool_se: float | None = None
    """Standard error of ``accuracy_with_tool``, clustered by problem."""
    accuracy_without_tool_se: float | None = None
    """Standard error of ``accuracy_without_tool``, clustered by problem."""
    correct_by_problem: dict[str, list[int]] = field(default_factory=dict)
    """``[correct, samples]`` per problem (by question id, as text): what a paired comparison of two
    evaluations of the same problems needs (:func:`paired_difference_se`)."""
    tool_calls_by_tool: dict[str, float] = field(default_factory=dict)
    """Tool calls per sample, by the name of the tool called."""
    tool_calls_per_solved: float | None = None
    """Tool calls per correct sample (None when none is correct)."""
    failed_call_frac: float = 0.0
    """Fraction of samples with at least one failed tool call (``ok=False``: an error the model was shown; the
    infrastructure's failures are not counted here but in ``world_failure_frac``)."""
    recovery_rate: float | None = None
    """Of the samples with a failed tool call, the share that still ended correct (None when none failed)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(trajectories: Sequence[Trajectory], correct: Sequence[bool], ks: Sequence[int] = (1,)) -> EvalResult:
    """Numbers of scored trajectories (``correct[i]`` for ``trajectories[i]``), grouped by question."""
    if len(trajectories) != len(correct):
        raise ValueError(f"{len(trajectories)} trajectories but {len(correct)} correctness flags.")
    if not trajectories:
        raise ValueError("no trajectories to summarise.")
    calls = [traj.num_tool_calls for traj in trajectories]
    by_question: dict[Any, list[tuple[bool, int]]] = {}  # (correct, tool calls) of each sample
    for traj, ok, c in zip(trajectories, correct, calls):
        by_question.setdefault(traj.question_id, []).append((bool(ok), c))
    n = min(len(v) for v in by_question.values())
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= samples per question ({n}); got k={bad}.")
    groups = list(by_question.values())
    errors = sum(1 for traj in trajectories for t in traj.turns for c in t.tool_calls if not c.ok)
    by_tool: dict[str, int] = {}
    for traj in trajectories:
        for t in traj.turns:
            for c in t.tool_calls:
                by_tool[c.name] = by_tool.get(c.name, 0) + 1
    with_tool = [ok for ok, c in zip(correct, calls) if c > 0]
    without = [ok for ok, c in zip(correct, calls) if c == 0]
    total = len(trajectories)
    solved_calls = [c for ok, c in zip(correct, calls) if ok]
    failed = [
        bool(ok)
        for traj, ok in zip(trajectories, correct)
        if any(not c.ok and c.infra_error is None for t in traj.turns for c in t.tool_calls)
    ]
    per_problem_pass = {k: [pass_at_k(len(v), sum(ok for ok, _ in v), k) for v in groups] for k in ks}

    def se(keep: Any) -> float | None:  # of the accuracy of the samples whose tool calls ``keep`` selects
        return clustered_se(
            [sum(ok for ok, c in v if keep(c)) for v in groups], [sum(1 for _, c in v if keep(c)) for v in groups]
        )

    return EvalResult(
        problems=len(by_question),
        samples=n,
        accuracy=sum(map(bool, correct)) / total,
        pass_at_k={k: sum(est) / len(est) for k, est in per_problem_pass.items()},
        tool_call_rate=sum(c > 0 for c in calls) / total,
        tool_calls_mean=sum(calls) / total,
        tool_error_rate=errors / max(sum(calls), 1),
        accuracy_with_tool=sum(with_tool) / len(with_tool) if with_tool else None,
        accuracy_without_tool=sum(without) / len(without) if without else None,
        truncated_frac=sum(t.truncated for t in trajectories) / total,
        turns_mean=sum(len(t.turns) for t in trajectories) / total,
        world_failure_frac=sum(t.world_failure for t in trajectories) / total,
        accuracy_se=se(lambda c: True),
        pass_at_k_se={k: clustered_se(est, [1] * len(est)) for k, est in per_problem_pass.items()},
        accuracy_with_tool_se=se(lambda c: c > 0) if with_tool else None,
        accuracy_without_tool_se=se(lambda c: c == 0) if without else None,
        correct_by_problem={str(q): [sum(ok for ok, _ in v), len(v)] for q, v in by_question.items()},
        tool_calls_by_tool={name: count / total for name, count in sorted(by_tool.items())},
        tool_calls_per_solved=sum(solved_calls) / len(solved_calls) if solved_calls else None,
        failed_call_frac=len(failed) / total,
        recovery_rate=sum(failed) / len(failed) if failed else None,
    )


def check_success_component(run: Any, success_component: str = "correct") -> None:
    """Refuse a run whose ``success_component`` an evaluation cannot use: it must be among the run's reward
    components and define ``is_success(value)``.

    Raises:
        ValueError: naming what to configure instead.
    """
    names = [r.name for r in run.rewards]
    if success_component not in names:
        raise ValueError(
            f"the evaluation counts a sample correct by the reward component {success_component!r}, which is not among "
            f"reward_components={names}; add it (it may have weight 0)."
        )
    if run.reward(success_component).is_success_fn is None:
        raise ValueError(
            f"reward component {success_component!r} has no is_success(value) method, so the evaluation cannot tell a "
            f"correct sample from a wrong one."
        )


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    run: Any,
    *,
    samples: int = 1,
    temperature: float = 1.0,
    ks: Sequence[int] = (1,),
    seed: int = 0,
    batch_questions: int = 64,
    success_component: str = "correct",
    progress: bool = False,
    accelerator: Any = None,
    backend: Any = None,
    policy_step: int = 0,
) -> tuple[EvalResult, list[Trajectory]]:
    """Roll out every row ``samples`` times with the run's own plugins and score it with every reward component.

    The tools, the rollout plugin, the reward components and the system prompt are the run's
    (:class:`~trl_plugins.run.Run`; a ``MultiTurnGRPOConfig`` given instead is resolved into one here, and closed
    at the end), and the rows take the same rows -> trajectories -> scores path as training
    (:mod:`trl_plugins.pipeline.batch`), so a trajectory is rolled out and scored here exactly as in a training
    step. A sample counts as correct when the component ``success_component`` says so (its ``is_success(value)``).
    ``temperature=0`` is greedy decoding (then ``samples`` should be 1); the other sampling settings are the
    config's. With ``accelerator`` (a prepared, possibly ZeRO-3-sharded ``model`` during training), each batch of
    rows is generated with the full weights gathered once; every rank must then call this with the same number of
    batches. The sampler is HF ``generate``, or transformers' continuous batching when the run generates with it;
    ``backend`` replaces it (the trainer's ``generation_backend``, e.g. vLLM, whose weights are brought to
    ``policy_step``'s first).

    Returns:
        The numbers and the scored trajectories.

    Raises:
        ValueError: ``samples < 1``, or a ``success_component`` that :func:`check_success_component` refuses.
    """
    import torch

    from trl_plugins.pipeline.batch import rollout_rows, score_trajectories
    from trl_plugins.rollout import derive_seed
    from trl_plugins.run import Run, SamplerKind, resolve_run
    from trl_plugins.run.sampler import make_backend

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}.")
    owned = not isinstance(run, Run)
    if owned:
        run = resolve_run(run)
    trajectories: list[Trajectory] = []
    correct: list[bool] = []
    was_training = model.training
    try:
        check_success_component(run, success_component)
        judge = run.reward(success_component)
        run.bind_tokenizer(tokenizer)
        if backend is None:
            kind = (
                SamplerKind.CONTINUOUS_BATCHING
                if run.sampler is SamplerKind.CONTINUOUS_BATCHING
                else SamplerKind.HF_GENERATE
            )
            backend = make_backend(
                kind,
                run.config,
                run.chat,
                model=model,
                pad_token_id=tokenizer.pad_token_id,
                accelerator=accelerator,
                temperature=temperature,
                token_budget=run.rollout.token_budget,
                trajectories=min(len(rows), batch_questions) * samples,
            )
        model.eval()
        from tqdm.auto import tqdm

        starts = range(0, len(rows), batch_questions)
        for b, start in enumerate(tqdm(starts, desc="evaluate", unit="batch", disable=not progress, leave=False)):
            chunk = list(rows[start : start + batch_questions])
            with torch.no_grad():
                result = rollout_rows(
                    run,
                    backend,
                    chunk,
                    group_size=samples,
                    seed=derive_seed(seed, b, 0),
                    id_offset=start,
                    policy_step=policy_step,
                )
            score_trajectories(run.rewards, result.trajectories, chunk)
            for traj in result.trajectories:
                trajectories.append(traj)
                # A sample the infrastructure failed (environment_error, verifier_error) counts as not correct
                # here, and is reported apart (world_failure_frac).
                correct.append(
                    not traj.world_failure and judge.is_success(traj.reward_component(success_component).value)
                )
    finally:
        model.train(was_training)
        if owned:
            run.close()
    return summarise(trajectories, correct, ks), trajectories
