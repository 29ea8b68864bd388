"""Held-out evaluation of a tool-calling policy: pass@1, pass@k and tool-call statistics.

The evaluation runs the same rollout plugin, chat format, tools and ``correct`` reward as training,
so a number here means the same thing as ``reward/correct`` in the training logs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from trl_plugins.types import Trajectory

__all__ = ["EvalResult", "pass_at_k", "evaluate_policy", "summarise"]


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
    )


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    tools: Mapping[str, Any],
    rollout: Any,
    samples: int = 1,
    temperature: float = 1.0,
    ks: Sequence[int] = (1,),
    system_prompt: str | None = None,
    answer_key: str = "answer",
    seed: int = 0,
    batch_questions: int = 64,
    progress: bool = False,
) -> tuple[EvalResult, list[Trajectory]]:
    """Roll out every row ``samples`` times and score it with the ``correct`` reward.

    ``temperature=0`` is greedy decoding (then ``samples`` should be 1). Rows need ``prompt`` (a string
    or chat messages) and ``answer_key``.

    Returns:
        The numbers and the scored trajectories (their ``reward_components`` hold ``correct``).
    """
    import torch

    from trl_plugins.rewards.math import CorrectReward
    from trl_plugins.rollout import ChatFormat, HFGenerationBackend, RolloutRequest, derive_seed, questions_from_rows
    from trl_plugins.types import RewardComponent, SamplingSettings

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}.")
    chat = ChatFormat(tokenizer, [t.schema() for t in tools.values()])
    backend = HFGenerationBackend(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=temperature),
    )
    scorer = CorrectReward(answer_key=answer_key)
    trajectories: list[Trajectory] = []
    correct: list[bool] = []
    was_training = model.training
    model.eval()
    try:
        from tqdm.auto import tqdm

        starts = range(0, len(rows), batch_questions)
        for b, start in enumerate(tqdm(starts, desc="evaluate", unit="batch", disable=not progress, leave=False)):
            chunk = list(rows[start : start + batch_questions])
            questions = questions_from_rows(chat, chunk, system_prompt, id_offset=start)
            request = RolloutRequest(questions, samples, backend, chat, tools, seed=derive_seed(seed, b, 0))
            with torch.no_grad():
                result = rollout(request)
            for traj in result.trajectories:
                value = scorer(traj, chunk[traj.group_id])
                traj.reward_components = [RewardComponent("correct", value, 1.0)]
                trajectories.append(traj)
                correct.append(value == scorer.correct)
    finally:
        model.train(was_training)
    return summarise(trajectories, correct, ks), trajectories

