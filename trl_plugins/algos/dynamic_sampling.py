"""Dynamic sampling (DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 11
and Algorithm 1), the pure decisions of the batch-level stage the trainer runs between the rollout and the datums.

A group whose members all got the same outcome (all right, all wrong) has no group-relative signal: every
group-normalised advantage is 0, yet its tokens still count in the loss denominators and dilute the others'. DAPO
keeps only groups with ``0 < |{correct}| < G`` and refills the batch with fresh groups until it holds the batch's
number of groups. Here a group is *informative* when the values of its members that the update would train on
(not left out by the infrastructure or a mask) are not all equal; a group with fewer than two such members is not.
That is DAPO's rule for a 0/1 outcome and verl's ``std(metric) > 0`` for any metric (verl also keeps a group of
one, which GRPOConfig refuses: ``num_generations >= 2``).

The order of groups is global and independent of the number of ranks: round by round, in each round the groups
in the order of the round's global list of rows (the first round: the ranks' rows in rank order; a refill round:
the rows :func:`draw_rows` drew, split over the ranks by :func:`rank_share`). The first informative groups in that
order fill the batch (:func:`choose_groups`); every rank computes the same choice from the same gathered flags.

The round loop's decisions are :class:`FillPlan` (:func:`plan_fill`, :func:`plan_round`), a function of the global
batch only: how many groups each round *counts* never depends on the number of ranks. A refill round that counts
fewer groups than there are ranks still draws one group per rank (under ZeRO-3 a rank that generates nothing would
leave the others waiting in DeepSpeed's start-of-forward collective); the groups beyond its count are *fillers*, never
kept and not counted towards the cap (:func:`refill_share`).

Pure: lists in, lists out (no torch, no accelerator).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Sequence

__all__ = [
    "informative_groups",
    "choose_groups",
    "refill_size",
    "draw_rows",
    "rank_share",
    "FillPlan",
    "plan_fill",
    "plan_round",
    "refill_share",
]


def informative_groups(
    values: Sequence[float], group_ids: Sequence[int], trained: Sequence[bool], num_groups: int
) -> list[bool]:
    """Per group ``0 .. num_groups - 1``, whether its trained-on members' ``values`` are not all equal.

    Args:
        values: Each trajectory's metric (its total reward, or one reward component).
        group_ids: Each trajectory's group, in ``range(num_groups)``.
        trained: Each trajectory, whether the update would train on it (members left out do not count).
        num_groups: How many groups (a group with no trajectory is not informative).
    """
    if not len(values) == len(group_ids) == len(trained):
        raise ValueError(
            f"need one group id and one trained flag per value; got {len(values)}, {len(group_ids)} and {len(trained)}."
        )
    seen: list[list[float]] = [[] for _ in range(num_groups)]
    for value, group, keep in zip(values, group_ids, trained):
        if not 0 <= group < num_groups:
            raise ValueError(f"group id {group} outside range({num_groups}).")
        if keep:
            seen[group].append(float(value))
    return [len(v) >= 2 and min(v) != max(v) for v in seen]


def choose_groups(flags_by_rank: Sequence[Sequence[bool]], wanted: int) -> list[list[bool]]:
    """Which groups of one round each rank keeps: the first ``wanted`` informative groups in the round's global order
    (rank 0's groups first, then rank 1's, ...; see :func:`rank_share`), given every rank's flags.

    Returns, per rank, one keep flag per group (True only where the flag is True).
    """
    if wanted < 0:
        raise ValueError(f"wanted must be >= 0, got {wanted}.")
    left, out = wanted, []
    for flags in flags_by_rank:
        keep = []
        for flag in flags:
            keep.append(bool(flag) and left > 0)
            left -= keep[-1]
        out.append(keep)
    return out


def refill_size(*, missing: int, drawn: int, informative: int, per_round: int, budget: int) -> int:
    """How many groups the next refill round counts (over all ranks; the ranks may draw more, see
    :func:`refill_share`).

    Enough to fill the ``missing`` groups at the share of informative groups seen so far in the step
    (``informative / drawn``; with none yet, as if one had been), at least ``missing``, at most ``per_round`` (a round
    never rolls out more than the step's first round did) and never more than ``budget`` (what the cap leaves). 0 when
    nothing is missing or nothing is left. No term depends on the number of ranks.
    """
    if missing <= 0 or budget <= 0:
        return 0
    estimate = math.ceil(missing * max(drawn, 1) / max(informative, 1))
    return min(max(missing, estimate), max(per_round, 1), budget)


def draw_rows(num_rows: int, start: int, count: int, *, seed: int) -> list[int]:
    """Dataset indices ``start .. start + count - 1`` of a stream of seeded random permutations of
    ``range(num_rows)``, one after the other: within a step (one ``seed``) no row is drawn twice before every row has
    been drawn once. The same on every rank."""
    if num_rows < 1:
        raise ValueError("cannot draw rows from an empty dataset.")
    out, epoch = [], start // num_rows
    offset = start - epoch * num_rows
    while len(out) < count:
        order = list(range(num_rows))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        out += order[offset : offset + count - len(out)]
        epoch, offset = epoch + 1, 0
    return out


def rank_share(count: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of ``count`` items split over ``world`` ranks (sizes differ by at most one,
    the larger shares first); the shares in rank order are ``range(count)``."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class FillPlan:
    """Where a step's dynamic sampling stands, over all ranks: the same on every rank, and for the same global batch
    the same whatever the number of ranks. Counts are groups; fillers (:func:`refill_share`) are in none of them."""

    target: int
    """Groups the step wants: its first round's, over all ranks."""
    budget: int
    """The most groups the step counts, the first round included (``dynamic_sampling_max_groups`` x ``target``)."""
    rounds: int = 0
    """Rounds planned so far (the first round included)."""
    drawn: int = 0
    """Groups the rounds so far counted."""
    informative: int = 0
    """Of those, the informative ones."""
    kept: int = 0
    """Of those, the ones the step keeps."""
    next_count: int = 0
    """Groups the next round counts (the first round: ``target``; 0: the step is done)."""

    @property
    def next_start(self) -> int:
        """Where the next refill round starts in the step's stream of refill rows (:func:`draw_rows`): the refill
        groups counted so far."""
        return max(self.drawn - self.target, 0)


def plan_fill(target: int, max_groups: float) -> FillPlan:
    """The plan before a step's first round of ``target`` groups, under a cap of ``max_groups`` x ``target`` groups
    (``dynamic_sampling_max_groups``, >= 1; rounded down)."""
    if target < 0 or not max_groups >= 1:
        raise ValueError(f"need target >= 0 and max_groups >= 1, got {target} and {max_groups}.")
    return FillPlan(target=target, budget=int(max_groups * target + 1e-9), next_count=target)


def plan_round(plan: FillPlan, flags: Sequence[bool]) -> tuple[FillPlan, list[bool]]:
    """One round's decisions: which of its counted groups the step keeps, and how many the next round counts.

    Args:
        plan: The plan before the round (``plan.next_count`` groups counted in it).
        flags: Whether each counted group of the round is informative, in the round's global order (fillers left
            out: they are the round's last groups).

    Returns:
        The plan after the round, and one keep flag per counted group (the first informative ones, as many as the
        batch still misses).

    Raises:
        ValueError: ``flags`` is not one flag per counted group, or the plan is done.
    """
    if len(flags) != plan.next_count or (plan.rounds and not plan.next_count):
        raise ValueError(f"the round counts {plan.next_count} groups; got {len(flags)} flags.")
    (keep,) = choose_groups([flags], plan.target - plan.kept)
    plan = replace(
        plan,
        rounds=plan.rounds + 1,
        drawn=plan.drawn + len(flags),
        informative=plan.informative + sum(map(bool, flags)),
        kept=plan.kept + sum(keep),
    )
    count = refill_size(
        missing=plan.target - plan.kept,
        drawn=plan.drawn,
        informative=plan.informative,
        per_round=plan.target,
        budget=plan.budget - plan.drawn,
    )
    return replace(plan, next_count=count), keep


def refill_share(plan: FillPlan, rank: int, world: int) -> range:
    """Rank ``rank``'s rows of the next refill round, as positions in the step's stream of refill rows
    (:func:`draw_rows`).

    The round draws ``max(plan.next_count, world)`` rows from ``plan.next_start`` on, split over the ranks in
    contiguous shares in rank order (:func:`rank_share`), so that every rank generates. Its first
    ``plan.next_count`` rows in that order count; the rest are fillers, rows the stream gives the next round again
    (their groups are never kept, whatever their rewards).
    """
    share = rank_share(max(plan.next_count, world), rank, world)
    return range(plan.next_start + share.start, plan.next_start + share.stop)
