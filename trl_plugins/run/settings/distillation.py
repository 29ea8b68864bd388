"""On-policy distillation's settings (``teacher_model_name_or_path``): the teacher whose log-prob of each token the
student sampled becomes the student's per-token signal (the signal itself is an advantage estimator, ``opd``:
:class:`~trl_plugins.algos.advantages.OnPolicyDistillationAdvantage`; the teacher's forward:
:mod:`trl_plugins.trainers.teacher`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Distillation"]


@dataclass(frozen=True)
class Distillation:
    """A local teacher, loaded once by the trainer and placed like TRL's reference model (a frozen, no-gradient copy
    per rank under DDP, sharded under ZeRO-3); it must share the student's tokenizer (checked at start-up)."""

    teacher: str
    """A local model folder or checkpoint (``teacher_model_name_or_path``)."""

    @classmethod
    def from_config(cls, config: Any) -> Distillation | None:
        """The settings of ``config`` (None without a teacher).

        Raises:
            ValueError: an empty teacher path.
        """
        teacher = config.teacher_model_name_or_path
        if teacher is None:
            return None
        if not str(teacher).strip():
            raise ValueError(
                "teacher_model_name_or_path is empty: give the teacher's model folder, or leave it unset (no teacher)."
            )
        return cls(teacher=str(teacher))
