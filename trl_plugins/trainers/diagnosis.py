"""What a run says when its world fails or a step trains nothing: the kinds of ``environment_error`` and their usual
cause, and why a step made no policy update (plain functions over strings and counts; the trainer's phases gather
the inputs over the ranks and raise)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Mapping, Sequence

from trl_plugins.types import LeftOutReason

__all__ = [
    "error_kind",
    "top_error_kinds",
    "likely_cause",
    "environment_error_message",
    "SKIP_COUNTS",
    "skip_counts",
    "nothing_to_train",
]

_KIND_CHARS = 200
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")


def error_kind(error: str | None) -> str:
    """The kind of a trajectory's ``error``: its first line with quoted parts (a path, an id, a row's value) elided,
    cut to 200 characters: ``"the agent failed: NotFoundError: Error code: 404 - no such endpoint '/q0/v1'"`` and its
    ``'/q1/v1'`` twin are one kind."""
    lines = (error or "").strip().splitlines()
    return _QUOTED.sub("'...'", lines[0])[:_KIND_CHARS] if lines else "no message"


def top_error_kinds(errors: Iterable[str | None], k: int = 3) -> list[tuple[str, int, str]]:
    """The ``k`` most common kinds among ``errors``: ``(kind, count, first error of that kind's first line)``, what
    one rank sends to the others."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for error in errors:
        kind = error_kind(error)
        counts[kind] += 1
        examples.setdefault(kind, ((error or "").strip().splitlines() or ["no message"])[0][: _KIND_CHARS * 2])
    return [(kind, n, examples[kind]) for kind, n in counts.most_common(k)]


_CAUSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("404", "notfounderror", "no such endpoint", "no live trajectory has this session key"),
        "the agent could not reach the endpoint: use the base_url (or, for a command, the OPENAI_BASE_URL and "
        "OPENAI_API_KEY) the rollout hands it, not a URL of its own, and send POST <base_url>/chat/completions",
    ),
    (
        ("connection", "refused", "unreachable", "name or service not known"),
        "something the rollout calls is not reachable (a tool service, a remote sandbox, or an agent posting to an "
        "address "
        "of its own): check it is up and that the agent uses the base_url the rollout hands it",
    ),
    (
        ("agent_time_limit_s", "request_time_limit_s", "timed out", "timeout"),
        "the agent or a request ran past its time limit: make it faster, or raise agent_time_limit_s / "
        "request_time_limit_s "
        "(the tool's timeout_s for a tool)",
    ),
    (
        ("isolation", "sandbox", "bwrap", "unshare"),
        "the tool's sandbox failed: check its isolation works on this machine (docs/sandbox.md; the start-up banner "
        "names "
        "the isolation in force) or that its remote sandbox is up",
    ),
    (
        ("the agent failed", "the agent command exited"),
        "the agent raises on every call: run it once by hand on a training row and fix what it raises",
    ),
    (
        ("the agent returned",),
        "the agent returns something the rollout cannot record: return None, a number or a mapping of numbers, after "
        "asking the model at least once",
    ),
    (
        ("tool '",),
        "a tool fails on every call (its service, its sandbox, or its own bug): call it once by hand with the "
        "arguments "
        "in the trajectory",
    ),
)


def likely_cause(kind: str) -> str:
    """What usually produces an error of ``kind`` and what to change, from its words (any rollout or tool)."""
    text = kind.lower()
    for needles, cause in _CAUSES:
        if any(n in text for n in needles):
            return cause
    return "the rollout's world (an agent, a tool, a sandbox or a service it calls) fails on every trajectory"


def environment_error_message(rate: float, limit: float, kinds: Sequence[tuple[str, int, str]], num_errors: int) -> str:
    """The stop of a step in which ``rate`` (over ``limit``) of the trajectories not cancelled ended
    ``environment_error``: the most common of ``kinds`` (each rank's :func:`top_error_kinds`, merged here;
    ``num_errors``
    the step's count over the ranks), an example of it, and its usual cause."""
    merged: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for kind, n, example in kinds:
        merged[kind] += n
        examples.setdefault(kind, example)
    head = (
        f"{rate:.0%} of this step's trajectories (all ranks, cancelled ones not counted) ended environment_error, "
        f"over max_environment_error_rate={limit}: the rollout's world is broken, not the policy, so the run stops "
        f"instead of skipping every step."
    )
    if not merged:
        return head
    (first, n), *others = merged.most_common(3)
    also = "".join(f"; then ({m}) {examples[kind]}" for kind, m in others)
    return (
        f"{head} Most common error ({n} of {num_errors}): {examples[first]}{also}. Likely cause: "
        f"{likely_cause(first)}. Fix it, or raise max_environment_error_rate."
    )


SKIP_COUNTS = ("trajectories", "datums", "forwarded", *(r.value for r in LeftOutReason))
"""What :func:`skip_counts` counts, in order (one all-reduce sums them over the ranks)."""

_LEFT_OUT_WORDS: Mapping[str, str] = {
    LeftOutReason.WORLD_FAILURE: "failed by the world (environment_error, verifier_error or cancelled)",
    LeftOutReason.TRUNCATED: "truncated (truncated_policy='mask' leaves them out)",
    LeftOutReason.GROUP_TOO_SMALL: "in groups with too few survivors (min_valid_group_fraction)",
    LeftOutReason.EQUAL_REWARDS: "in groups dynamic sampling dropped (equal rewards)",
    LeftOutReason.SURPLUS: "surplus groups of dynamic sampling",
    LeftOutReason.FILLER: "filler groups of dynamic sampling",
}


def skip_counts(
    num_trajectories: int, num_datums: int, num_forwarded: int, left_out: Iterable[LeftOutReason | None]
) -> list[float]:
    """One rank's counts in :data:`SKIP_COUNTS` order."""
    reasons = Counter(r for r in left_out if r is not None)
    return [
        float(num_trajectories),
        float(num_datums),
        float(num_forwarded),
        *(float(reasons[r]) for r in LeftOutReason),
    ]


def nothing_to_train(counts: Sequence[float]) -> str:
    """Why a step forwarded no datum, from :func:`skip_counts` summed over the ranks: each left-out reason, and the
    datums whose advantage was 0 (equal rewards within their group)."""
    named = dict(zip(SKIP_COUNTS, (int(c) for c in counts)))
    total, zero = named["trajectories"], named["datums"] - named["forwarded"]
    if total and zero == total:
        return (
            f"no trajectory to train on: every group's rewards were equal (all {total} trajectories of the step, "
            f"all ranks, have advantage 0)"
        )
    parts = [f"{named[r.value]} {_LEFT_OUT_WORDS[r]}" for r in LeftOutReason if named[r.value]]
    if zero:
        parts.append(f"{zero} with zero advantage (equal rewards within their group)")
    return f"no trajectory to train on: of the step's {total} trajectories (all ranks), " + (", ".join(parts) or "none")
