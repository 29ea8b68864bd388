"""The rollout seam's call contract: a :class:`RolloutRequest` in (questions, group size, sampler, chat format,
tools, seed, policy step), a :class:`RolloutResult` out (trajectories, question-major, and what the rollout
spent); the errors a rollout raises; and the seeds it derives."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from trl_plugins.protocols import ToolPlugin, as_tool
from trl_plugins.rollout.backends import GenerationBackend
from trl_plugins.rollout.chat import ChatFormat
from trl_plugins.types import Trajectory

__all__ = [
    "RolloutError",
    "RolloutCancelled",
    "derive_seed",
    "RolloutQuestion",
    "questions_from_rows",
    "RolloutRequest",
    "RolloutResult",
]


class RolloutError(ValueError):
    """A rollout cannot start; the message says what to change."""


class RolloutCancelled(Exception):
    """The rollout stopped because ``RolloutRequest.stop`` was set; ``rollout_result`` holds what was done
    (the unfinished trajectories are ``cancelled``)."""


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from (base seed, step, rank, round, ...): a repeated question never replays a sample."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class RolloutQuestion:
    """One question to roll out ``group_size`` times."""

    question_id: str
    """Identifier, copied to every trajectory."""
    prompt_ids: list[int]
    """The rendered first prompt (``ChatFormat.initial_prompt_ids``)."""
    group_id: int
    """Group id for group-relative advantages."""
    row: Mapping[str, Any] | None = None
    """The dataset row it came from, for a rollout that hands it on (an agent behind the endpoint gets it)."""


def questions_from_rows(
    chat: Any, rows: Sequence[Mapping[str, Any]], system_prompt: str | None = None, *, id_offset: int = 0
) -> list[RolloutQuestion]:
    """One :class:`RolloutQuestion` per dataset row, its group id the row's place in ``rows``.

    A row's ``prompt`` is a string (one user message) or a list of chat messages; ``system_prompt``
    goes first. The question id is the row's ``id`` (or ``question_id``), else ``id_offset`` + place.
    """
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    out = []
    for k, row in enumerate(rows):
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        qid = str(row.get("id", row.get("question_id", id_offset + k)))
        out.append(RolloutQuestion(qid, chat.initial_prompt_ids(system + messages), group_id=k, row=row))
    return out


@dataclass
class RolloutRequest:
    """Everything a rollout needs; the rollout plugin itself holds only its budgets."""

    questions: list[RolloutQuestion]
    """Questions to roll out."""
    group_size: int
    """Samples per question."""
    backend: GenerationBackend
    """The sampler."""
    chat: ChatFormat
    """Token-in, token-out turn building and parsing for the tokenizer's chat template."""
    tools: Mapping[str, ToolPlugin]
    """Tools by the name the model calls, each with its declarations read (a plain tool given here is adapted:
    :func:`~trl_plugins.protocols.as_tool`)."""
    policy_step: int = 0
    """Optimizer step of the sampling weights, recorded in each trajectory's policy version."""
    seed: int = 0
    """Base seed of this rollout (derive it from base seed, step and rank)."""
    progress: bool = False
    """Show a progress bar of finished trajectories."""
    stop: threading.Event | None = None
    """When set (a stop was requested, e.g. on SIGTERM), the rollout cancels its tool calls in flight and
    raises :class:`RolloutCancelled` before the next generation round."""
    on_finished: Callable[[Trajectory], None] | None = None
    """Called with each trajectory as it ends (its stop reason set), from the rollout's own thread: the run's
    judges start scoring it while the others still run (:class:`~trl_plugins.pipeline.prescoring.RolloutScorer`).
    It must return at once and never raise. A rollout plugin that does not call it loses only that overlap."""

    def __post_init__(self) -> None:
        self.tools = {name: as_tool(tool, name) for name, tool in self.tools.items()}


@dataclass
class RolloutResult:
    """Trajectories and what the rollout spent on them."""

    trajectories: list[Trajectory]
    """``len(questions) * group_size`` trajectories, question-major."""
    rounds: int = 0
    """Calls to the backend's ``generate``."""
    generation_s: float = 0.0
    """Wall time with at least one ``generate`` call in flight."""
    tools_s: float = 0.0
    """Wall time with at least one tool call in flight (it overlaps ``generation_s``)."""
    total_s: float = 0.0
    """Wall time of the whole rollout."""
    critical_path_s: float = 0.0
    """The longest trajectory's own chain of generation and tool calls (:func:`critical_path`): the floor
    ``total_s`` cannot go below however turns are scheduled."""
    max_concurrent_tool_calls: int = 0
    """Most tool calls that ran at once."""
    counters: dict[str, float] = field(default_factory=dict)
    """Counts a rollout plugin keeps (e.g. ``endpoint/tool_choice_unforced``), logged as metrics of those names and
    summed over rounds and ranks."""
