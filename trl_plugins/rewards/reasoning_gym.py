"""A reasoning-gym dataset's own scorer as a reward component (``reasoning_gym``).

reasoning-gym (https://github.com/open-thought/reasoning-gym) generates problems procedurally and scores an answer
with the generating dataset's ``score_answer(answer, entry)``: 1.0 for a right answer, 0.0 for a wrong or missing
one, and for many datasets partial credit in between (the base scorer gives ``len(oracle) / len(answer)`` to an
answer that contains the oracle). This component reads the answer from the last turn in the format the prompt asks
for (``\\boxed{...}`` or ``<answer>...</answer>``) and returns that score unchanged; ``is_success`` is
``score == 1.0``, so accuracy and pass@k count only full marks.

The row must carry the whole entry: its question (``prompt``), ``answer`` and ``metadata`` (the dataset that made
it is ``metadata["source_dataset"]``, which reasoning-gym's composite dataset writes), and optionally
``reasoning_gym_config``, the dataset's config, so that a scorer that reads its config scores as the generating
dataset did. A replay re-scores a saved row the same way. Needs the ``reasoning-gym`` package
(``pip install "trl-plugins[environments]"``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from trl_plugins.registry import REWARDS
from trl_plugins.rewards.math import final_text, last_boxed
from trl_plugins.types import StopReason, Trajectory

__all__ = ["ReasoningGymReward", "reasoning_gym_version", "extract_answer", "ANSWER_FORMATS"]

ANSWER_FORMATS = ("boxed", "answer_tag")
"""Where the answer is read from: the last ``\\boxed{...}`` or the last ``<answer>...</answer>``."""

INSTALL_HINT = 'pip install "trl-plugins[environments]" (or pip install reasoning-gym)'


def reasoning_gym_version() -> str:
    """``"reasoning-gym <version>"`` of the installed distribution.

    Raises:
        ImportError: reasoning-gym is not installed (naming how to install it).
    """
    from importlib import metadata

    try:
        return f"reasoning-gym {metadata.version('reasoning-gym')}"
    except metadata.PackageNotFoundError:
        raise ImportError(f"the reasoning_gym reward needs the reasoning-gym package: {INSTALL_HINT}.") from None


def extract_answer(text: str, answer_format: str) -> str | None:
    """The answer in ``text``: the content of its last ``\\boxed{}`` (``boxed``) or of its last
    ``<answer>...</answer>`` (``answer_tag``, read by reasoning-gym's own ``extract_answer``), stripped; None when
    there is none."""
    if answer_format == "boxed":
        found = last_boxed(text)
    else:
        from reasoning_gym.utils import extract_answer as rg_extract

        found = rg_extract(text, tag_name="answer")
    return None if found is None else found.strip()


@functools.lru_cache(maxsize=64)
def _scorer(name: str, config_json: str | None) -> Callable[[str | None, dict], float]:
    # One dataset instance per (dataset, config) and process: the dataset's own score_answer, bound to a dataset built
    # with the config that generated the row (or reasoning-gym's default one when the row does not say).
    import reasoning_gym

    if config_json is None:
        return reasoning_gym.get_score_answer_fn(name)
    return reasoning_gym.create_dataset(name, **json.loads(config_json), size=1, seed=0).score_answer


def entry_of(example: Mapping[str, Any]) -> dict[str, Any]:
    """The reasoning-gym entry a row holds: ``{"question", "answer", "metadata"}``.

    Raises:
        KeyError: the row lacks ``metadata`` with ``source_dataset`` (naming what it has).
    """
    metadata = example.get("metadata")
    if not isinstance(metadata, Mapping) or "source_dataset" not in metadata:
        raise KeyError(
            f"the reasoning_gym reward scores rows made by reasoning-gym: it needs the entry's metadata with "
            f"'source_dataset' in the row's 'metadata'; the row has {sorted(example)}. Use --task "
            f"reasoning_gym (its rows carry the whole entry)."
        )
    return {"question": example.get("prompt"), "answer": example.get("answer"), "metadata": dict(metadata)}


def score_answer(example: Mapping[str, Any], answer: str | None) -> float:
    """The score the dataset that made ``example`` (a ``--task reasoning_gym`` row) gives ``answer``: its own
    ``score_answer``, bound to the row's config."""
    entry = entry_of(example)
    config = example.get("reasoning_gym_config")
    score = _scorer(entry["metadata"]["source_dataset"], None if config is None else json.dumps(config, sort_keys=True))
    return float(score(answer, entry))


@REWARDS.register("reasoning_gym")
@dataclass
class ReasoningGymReward:
    """The generating dataset's ``score_answer`` on the answer of the last turn: its score (1.0 right, 0.0 wrong or
    missing, partial credit where the dataset gives it). A trajectory that did not end with a final answer is scored
    as no answer (``score_answer(None, entry)``)."""

    answer_format: Literal["boxed", "answer_tag"] = "boxed"
    """Where the answer is read: the last ``\\boxed{...}`` (``boxed``) or ``<answer>...</answer>`` (``answer_tag``)
    of the last turn; the prompt should ask for that format."""
    window_chars: int = 2000
    """Only the end of the last turn is searched for the answer."""
    version: str = field(default_factory=reasoning_gym_version)
    """Recorded as the component's version (a replay refuses to re-score under another): reasoning-gym's."""

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {list(ANSWER_FORMATS)}, got {self.answer_format!r}.")
        if self.window_chars < 1:
            raise ValueError(f"window_chars must be >= 1, got {self.window_chars}.")

    def is_success(self, value: float) -> bool:
        """Full marks only: partial credit is not a right answer."""
        return value == 1.0

    def answer(self, trajectory: Trajectory) -> str | None:
        """The answer this component reads from ``trajectory`` (None: none given)."""
        if trajectory.stop_reason != StopReason.FINAL_ANSWER:
            return None
        return extract_answer(final_text(trajectory)[-self.window_chars :], self.answer_format)

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        return score_answer(example, self.answer(trajectory))
