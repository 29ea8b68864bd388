"""On-policy distillation's settings (``teacher_model_name_or_path``): the teacher whose log-prob of each token the
student sampled becomes the student's per-token signal (the signal itself is an advantage estimator, ``opd``:
:class:`~trl_plugins.algos.advantages.OnPolicyDistillationAdvantage`; the teacher's forward:
:mod:`trl_plugins.trainers.teacher`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Distillation"]

FIELDS = ("teacher_request_timeout_s",)
"""The flat fields that configure it (beside the teacher, ``teacher_model_name_or_path``)."""


SERVER_SCHEMES = ("http://", "https://")
"""A teacher named by a URL is a server (``teacher_model_name_or_path: http://127.0.0.1:8000/v1``)."""


@dataclass(frozen=True)
class Distillation:
    """The teacher: a local model, loaded once by the trainer and placed like TRL's reference model (a frozen,
    no-gradient copy per rank under DDP, sharded under ZeRO-3), or an OpenAI-compatible server that returns prompt
    log-probs (vLLM's ``prompt_logprobs``), asked by every rank for its datums. It must share the student's tokenizer
    (checked at start-up)."""

    teacher: str
    """A local model folder or checkpoint, or a server's base URL (``teacher_model_name_or_path``)."""
    request_timeout_s: float = 120.0
    """A server teacher: the deadline of each request (``teacher_request_timeout_s``)."""

    @property
    def server(self) -> bool:
        """Whether the teacher is a server (its setting is an http(s) URL)."""
        return self.teacher.startswith(SERVER_SCHEMES)

    @classmethod
    def from_config(cls, config: Any) -> Distillation | None:
        """The settings of ``config`` (None without a teacher).

        Raises:
            ValueError: an empty teacher path, a request deadline without a teacher or not above 0, a server teacher
                with a sampling temperature other than 1.
        """
        from trl_plugins.run.settings import off_default

        teacher = config.teacher_model_name_or_path
        if teacher is None:
            given = off_default(config, FIELDS)
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure a server teacher, and the run has no teacher: set "
                    f"teacher_model_name_or_path (http://host:port/v1), or drop them."
                )
            return None
        if not str(teacher).strip():
            raise ValueError(
                "teacher_model_name_or_path is empty: give the teacher's model folder, or leave it unset (no teacher)."
            )
        timeout = float(config.teacher_request_timeout_s)
        if not timeout > 0:
            raise ValueError(f"teacher_request_timeout_s must be > 0 (seconds per request), got {timeout}.")
        settings = cls(teacher=str(teacher).strip(), request_timeout_s=timeout)
        temperature = config.temperature
        if settings.server and temperature not in (None, 0, 0.0, 1, 1.0):
            raise ValueError(
                f"teacher_model_name_or_path={settings.teacher!r} is a server, whose prompt log-probs are the "
                f"untempered distribution's (vLLM applies no sampling processor to prompt tokens), and the student "
                f"samples at temperature {temperature}: set temperature=1.0, or give a local teacher (scored at the "
                f"sampling temperature)."
            )
        return settings
