"""Held-out evaluation of a tool-calling policy: pass@1, pass@k and tool-call statistics.

The evaluation builds its tools, rollout plugin and reward components from the training config through
the registries and runs the training path (:mod:`trl_plugins.trainers.batch`), so a number here means
the same thing as ``reward/correct`` in the training logs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from trl_plugins.types import Trajectory

__all__ = ["EvalResult", "pass_at_k", "check_success_component", "evaluate_policy", "summarise"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(trajectories: Sequence[Trajectory], correct: Sequence[bool], ks: Sequence[int] = (1,)) -> EvalResult:
    """Numbers of scored trajectories (``correct[i]`` for ``trajectories[i]``), grouped by question."""
    if len(trajectories) != len(correct):
        raise ValueError(f"{len(trajectories)} trajectories but {len(correct)} correctness flags.")
    if not trajectories:
        raise ValueError("no trajectories to summarise.")
    by_question: dict[Any, list[bool]] = {}
    for traj, ok in zip(trajectories, correct):
        by_question.setdefault(traj.question_id, []).append(bool(ok))
    n = min(len(v) for v in by_question.values())
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= samples per question ({n}); got k={bad}.")
    calls = [sum(t.tool_call is not None for t in traj.turns) for traj in trajectories]
    errors = sum(1 for traj in trajectories for t in traj.turns if t.tool_call is not None and not t.tool_call.ok)
    with_tool = [ok for ok, c in zip(correct, calls) if c > 0]
    without = [ok for ok, c in zip(correct, calls) if c == 0]
    total = len(trajectories)
    return EvalResult(
        problems=len(by_question),
        samples=n,
        accuracy=sum(map(bool, correct)) / total,
        pass_at_k={k: sum(pass_at_k(len(v), sum(v), k) for v in by_question.values()) / len(by_question) for k in ks},
        tool_call_rate=sum(c > 0 for c in calls) / total,
        tool_calls_mean=sum(calls) / total,
        tool_error_rate=errors / max(sum(calls), 1),
        accuracy_with_tool=sum(with_tool) / len(with_tool) if with_tool else None,
        accuracy_without_tool=sum(without) / len(without) if without else None,
        truncated_frac=sum(t.truncated for t in trajectories) / total,
        turns_mean=sum(len(t.turns) for t in trajectories) / total,
        world_failure_frac=sum(t.world_failure for t in trajectories) / total,
    )


def check_success_component(args: Any, success_component: str = "correct") -> None:
    """Refuse, before anything is built, a config whose ``success_component`` an evaluation cannot use:
    it must be among ``args.reward_components`` and its plugin must define ``is_success(value)``.

    Raises:
        ValueError: naming what to configure instead.
    """
    from trl_plugins.registry import REWARDS

    if success_component not in args.reward_components:
        raise ValueError(
            f"the evaluation counts a sample correct by the reward component {success_component!r}, which is not among "
            f"reward_components={args.reward_components}; add it (it may have weight 0)."
        )
    if not callable(getattr(REWARDS.get(success_component), "is_success", None)):
        raise ValueError(
            f"reward component {success_component!r} has no is_success(value) method, so the evaluation cannot tell a "
            f"correct sample from a wrong one."
        )


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    args: Any,
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

    The tools, the rollout plugin, the reward components and the system prompt come from ``args`` (the
    training ``MultiTurnGRPOConfig``) through the registries, and the rows take the same
    rows -> trajectories -> scores path as training (:mod:`trl_plugins.trainers.batch`), so a trajectory
    is rolled out and scored here exactly as in a training step. A sample counts as correct when the
    component ``success_component`` says so (its ``is_success(value)``). ``temperature=0`` is greedy
    decoding (then ``samples`` should be 1); the other sampling settings are the config's. With
    ``accelerator`` (a prepared, possibly ZeRO-3-sharded ``model`` during training), each batch of rows is
    generated with the full weights gathered once; every rank must then call this with the same number of
    batches. The sampler is HF ``generate``, or transformers' continuous batching when ``args`` asks for it
    (``use_transformers_continuous_batching``); ``backend`` replaces it (the trainer's ``generation_backend``,
    e.g. vLLM, whose weights are brought to ``policy_step``'s first).

    Returns:
        The numbers and the scored trajectories.

    Raises:
        ValueError: ``samples < 1``, or a ``success_component`` that :func:`check_success_component` refuses.
    """
    import torch

    from trl_plugins.rollout import derive_seed
    from trl_plugins.trainers.batch import cb_backend, chat_format, hf_backend, rollout_rows, sampling_settings, score_trajectories
    from trl_plugins.trainers.plugins import build_plugins

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}.")
    check_success_component(args, success_component)
    plugins = build_plugins(args)
    judge = next(fn for name, _, fn in plugins.reward_components if name == success_component)
    chat = chat_format(tokenizer, plugins, args)
    if backend is None and getattr(args, "use_transformers_continuous_batching", False):
        backend = cb_backend(model, chat, args, accelerator).with_sampling(sampling_settings(args, temperature=temperature))
    elif backend is None:
        backend = hf_backend(model, tokenizer, chat, args, temperature=temperature, accelerator=accelerator)
    trajectories: list[Trajectory] = []
    correct: list[bool] = []
    was_training = model.training
    model.eval()
    try:
        from tqdm.auto import tqdm

        starts = range(0, len(rows), batch_questions)
        for b, start in enumerate(tqdm(starts, desc="evaluate", unit="batch", disable=not progress, leave=False)):
            chunk = list(rows[start : start + batch_questions])
            with torch.no_grad():
                result = rollout_rows(plugins, args, chat, backend, chunk, group_size=samples,
                                      seed=derive_seed(seed, b, 0), id_offset=start, policy_step=policy_step)
            score_trajectories(plugins, result.trajectories, chunk)
            for traj in result.trajectories:
                trajectories.append(traj)
                # A sample the infrastructure failed (environment_error, verifier_error) counts as not correct
                # here, and is reported apart (world_failure_frac).
                correct.append(not traj.world_failure and bool(judge.is_success(traj.reward_component(success_component).value)))
    finally:
        model.train(was_training)
        plugins.close()
    return summarise(trajectories, correct, ks), trajectories
