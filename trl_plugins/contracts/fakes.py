"""Fake data for plugin tests: a random prefix-consistent multi-turn trajectory, and a packing-plan checker."""

from __future__ import annotations

import random
from typing import Any, Sequence

from trl_plugins.types import PackPlan, StopReason, TokenSource, Trajectory, Turn

__all__ = ["make_trajectory", "make_compacting_trajectory", "plan_violations"]


def make_trajectory(
    rng: random.Random,
    *,
    num_turns: int,
    vocab: int = 200,
    group_id: int = 0,
    sample_index: int = 0,
    advantage: float | None = None,
    stop_reason: StopReason = StopReason.FINAL_ANSWER,
    prompt: Sequence[int] | None = None,
) -> Trajectory:
    """A prefix-consistent multi-turn trajectory with random tokens, log-probs and provenance; ``prompt``: its first
    prompt (a group's trajectories share it), else random."""
    turns = []
    history: list[int] = []
    for i in range(num_turns):
        if i == 0:
            new = list(prompt) if prompt is not None else [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
            new_sources = [TokenSource.PROMPT] * len(new)
        else:
            obs = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
            new = [1] + obs + [2]  # glue, tool output, glue
            new_sources = [TokenSource.GLUE] + [TokenSource.OBSERVATION] * len(obs) + [TokenSource.GLUE]
        prompt = history + new
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 14))]
        logprobs = [-rng.uniform(0.05, 3.0) for _ in completion]
        turns.append(
            Turn(prompt_ids=prompt, completion_ids=completion, completion_logprobs=logprobs, prompt_sources=new_sources)
        )
        history = prompt + completion
    return Trajectory(
        turns=turns,
        question_id=f"q{group_id}",
        group_id=group_id,
        sample_index=sample_index,
        stop_reason=stop_reason,
        advantage=advantage if advantage is not None else rng.uniform(-1.5, 1.5),
    )


def make_compacting_trajectory(
    rng: random.Random,
    *,
    system: Sequence[int],
    question_len: int,
    turns: int,
    every: int,
    summary_len: int,
    completion_len: int,
    observation_len: int,
    vocab: int = 200,
    group_id: int = 0,
    advantage: float | None = None,
) -> Trajectory:
    """A trajectory of a harness that compacts its history: every ``every`` turns it replaces what followed its
    system-and-tools prefix ``system`` (the question, then each turn's tool output and reply) with a summary of
    ``summary_len`` tokens, a rewrite that starts a new segment; each turn adds ``observation_len`` tokens of tool
    output (glue included; none in a segment's first turn) and a reply of ``completion_len``. Random tokens in
    ``[3, vocab)``, so segments share exactly ``system``."""
    out: list[Turn] = []
    history: list[int] = []
    for i in range(turns):
        start = i % every == 0
        if start:
            body = [rng.randrange(3, vocab) for _ in range(question_len if i == 0 else summary_len)]
            new, new_sources = list(system) + body, [TokenSource.PROMPT] * (len(system) + len(body))
            prompt = new
        else:
            obs = [rng.randrange(3, vocab) for _ in range(observation_len - 2)]
            new = [1] + obs + [2]
            new_sources = [TokenSource.GLUE] + [TokenSource.OBSERVATION] * len(obs) + [TokenSource.GLUE]
            prompt = history + new
        completion = [rng.randrange(3, vocab) for _ in range(completion_len)]
        logprobs = [-rng.uniform(0.05, 3.0) for _ in completion]
        out.append(
            Turn(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=logprobs,
                prompt_sources=new_sources,
                segment_start=start and i > 0,
            )
        )
        history = prompt + completion
    return Trajectory(
        turns=out,
        question_id=f"q{group_id}",
        group_id=group_id,
        stop_reason=StopReason.FINAL_ANSWER,
        advantage=advantage if advantage is not None else rng.uniform(-1.5, 1.5),
    )


def _shape_violations(plan: PackPlan, n: int, world_size: int) -> list[str]:
    # What any plan must be: world_size ranks with as many micro-batches each, a partition of the n items.
    problems = []
    if plan.world_size != world_size:
        problems.append(f"{plan.world_size} ranks, expected {world_size}")
    if len({len(r) for r in plan.ranks}) > 1:
        problems.append(f"unequal micro-batch counts {[len(r) for r in plan.ranks]}")
    if sorted(i for r in plan.ranks for mb in r for i in mb) != list(range(n)):
        problems.append("not a partition of the items")
    return problems


def plan_violations(
    plan: PackPlan, lengths: Sequence[int], max_items: int, max_padded_tokens: int, world_size: int
) -> list[str]:
    """Everything wrong with a plan; empty when it is a valid partition within the limits."""
    from trl_plugins.packing import padded_area

    problems = _shape_violations(plan, len(lengths), world_size)
    for r, rank in enumerate(plan.ranks):
        for k, mb in enumerate(rank):
            if len(mb) > max_items:
                problems.append(f"rank {r} mb {k}: {len(mb)} items > {max_items}")
            if padded_area(lengths, mb) > max_padded_tokens:
                problems.append(f"rank {r} mb {k}: area {padded_area(lengths, mb)} > {max_padded_tokens}")
    return problems


def tree_plan_violations(
    plan: PackPlan,
    rows: Sequence[Sequence[int]],
    trees: Sequence[Any],
    max_items: int,
    max_padded_tokens: int,
    world_size: int,
) -> list[str]:
    """Everything wrong with a plan made with ``prefix_trees=trees`` for items whose tokens are ``rows``: a partition
    with equal micro-batch counts, rows and the shared-prefix layout's area (as ``collate`` forms it) within the
    limits, and every tree that fits one micro-batch kept in one."""
    from trl_plugins.packing import prefix_trees, tree_area

    lengths = [len(r) for r in rows]
    problems = _shape_violations(plan, len(lengths), world_size)
    home = {}
    for r, rank in enumerate(plan.ranks):
        for k, mb in enumerate(rank):
            home.update({i: (r, k) for i in mb})
            sub = [rows[i] for i in mb]
            area = tree_area([len(x) for x in sub], prefix_trees(sub)) if mb else 0
            if len(mb) > max_items:
                problems.append(f"rank {r} mb {k}: {len(mb)} items > {max_items}")
            if area > max_padded_tokens:
                problems.append(f"rank {r} mb {k}: shared-prefix area {area} > {max_padded_tokens}")
    for tree in trees:
        fits = len(tree.members) <= max_items and tree_area(lengths, [tree]) <= max_padded_tokens
        if fits and len({home.get(i) for i in tree.members}) > 1:
            problems.append(
                f"a tree of {len(tree.members)} items sharing {tree.prefix_len} tokens fits one "
                f"micro-batch but was split"
            )
    return problems
