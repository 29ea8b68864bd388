"""On-policy distillation's settings (``teacher_model_name_or_path``): the teacher whose log-prob of each token the
student sampled becomes the student's per-token signal (the signal itself is an advantage estimator, ``opd``:
:class:`~trl_plugins.algos.advantages.OnPolicyDistillationAdvantage`, or the ``jsd`` loss; the teacher's forward:
:mod:`trl_plugins.trainers.teacher`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Distillation"]

FIELDS = ("teacher_request_timeout_s", "teacher_route_field", "teacher_privileged_field", "teacher_privileged_template")
"""The flat fields that configure it (beside the teacher, ``teacher_model_name_or_path``)."""

SERVER_SCHEMES = ("http://", "https://")
"""A teacher named by a URL is a server (``teacher_model_name_or_path: http://127.0.0.1:8000/v1``)."""


@dataclass(frozen=True)
class Distillation:
    """The teacher: a local model, loaded once by the trainer and placed like TRL's reference model (a frozen,
    no-gradient copy per rank under DDP, sharded under ZeRO-3), or an OpenAI-compatible server that returns prompt
    log-probs (vLLM's ``prompt_logprobs``), asked by every rank for its datums; or several of them, each scoring the
    trajectories of the rows whose ``route_field`` names it. Each must share the student's tokenizer (checked at
    start-up)."""

    teacher: str
    """A local model folder or checkpoint, or a server's base URL (``teacher_model_name_or_path``); with several
    teachers, their mapping as JSON."""
    request_timeout_s: float = 120.0
    """A server teacher: the deadline of each request (``teacher_request_timeout_s``)."""
    routes: tuple[tuple[str, str], ...] = ()
    """Several teachers: ``(value of the row's route field, teacher)`` pairs (``teacher_model_name_or_path`` given as a
    mapping); empty with one teacher."""
    route_field: str | None = None
    """Several teachers: the dataset row's field whose value picks a row's teacher (``teacher_route_field``)."""
    privileged_field: str | None = None
    """Self-distillation: the dataset row's field the teacher is shown and the student is not
    (``teacher_privileged_field``, e.g. the reference answer); None: the teacher sees the student's prompt."""
    privileged_template: str = "{content}\n\n(Reference answer, for the teacher only: {value})"
    """How the privileged field joins the last user message of the teacher's first prompt
    (``teacher_privileged_template``; ``{content}`` the message, ``{value}`` the field)."""

    @property
    def teachers(self) -> dict[str, str]:
        """Each teacher by its route (``{"": teacher}`` with one)."""
        return dict(self.routes) if self.routes else {"": self.teacher}

    @property
    def server(self) -> bool:
        """Whether a teacher is a server (its setting is an http(s) URL)."""
        return any(spec.startswith(SERVER_SCHEMES) for spec in self.teachers.values())

    def single(self, route: str) -> Distillation:
        """The settings of one route's teacher alone."""
        return Distillation(
            teacher=self.teachers[route],
            request_timeout_s=self.request_timeout_s,
            privileged_field=self.privileged_field,
            privileged_template=self.privileged_template,
        )

    def privileged(self, messages: list[dict], row: Mapping[str, Any]) -> list[dict]:
        """``messages`` (a first prompt's) with :attr:`privileged_field`'s value of ``row`` joined to the last user
        message by :attr:`privileged_template`.

        Raises:
            ValueError: the row lacks the field, or the prompt has no user message with text content.
        """
        if self.privileged_field not in row or row[self.privileged_field] is None:
            raise ValueError(
                f"teacher_privileged_field={self.privileged_field!r}: a row has no such field (its fields: "
                f"{', '.join(map(str, row))}); name the field the teacher is shown."
            )
        out = [dict(m) for m in messages]
        last = next((m for m in reversed(out) if m.get("role") == "user"), None)
        if last is None or not isinstance(last.get("content"), str):
            raise ValueError(
                f"teacher_privileged_field={self.privileged_field!r}: the prompt has no user message with text "
                f"content to join the field to."
            )
        last["content"] = self.privileged_template.format(content=last["content"], value=row[self.privileged_field])
        return out

    @classmethod
    def from_config(cls, config: Any) -> Distillation | None:
        """The settings of ``config`` (None without a teacher).

        Raises:
            ValueError: an empty teacher path, a setting of it without a teacher, a request deadline not above 0,
                several teachers without a route field (or a route field with one teacher), a server teacher with a
                sampling temperature other than 1.
        """
        from trl_plugins.run.settings import off_default

        teacher = config.teacher_model_name_or_path
        if teacher is None:
            given = off_default(config, FIELDS)
            if given:
                raise ValueError(
                    f"{', '.join(given)} configure distillation's teacher, and the run has none: set "
                    f"teacher_model_name_or_path, or drop them."
                )
            return None
        routes = _routes(teacher)
        field = config.teacher_route_field
        if routes and not field:
            raise ValueError(
                f"teacher_model_name_or_path names {len(routes)} teachers ({', '.join(r for r, _ in routes)}): set "
                f"teacher_route_field, the dataset row's field whose value picks each row's teacher."
            )
        if field and not routes:
            raise ValueError(
                f"teacher_route_field={field!r} routes rows to several teachers, and teacher_model_name_or_path names "
                f"one: give a mapping {{value: teacher}} (JSON), or drop teacher_route_field."
            )
        if not routes and not str(teacher).strip():
            raise ValueError(
                "teacher_model_name_or_path is empty: give the teacher's model folder, or leave it unset (no teacher)."
            )
        timeout = float(config.teacher_request_timeout_s)
        if not timeout > 0:
            raise ValueError(f"teacher_request_timeout_s must be > 0 (seconds per request), got {timeout}.")
        template = config.teacher_privileged_template
        if "{content}" not in template or "{value}" not in template:
            raise ValueError(
                f"teacher_privileged_template={template!r} must hold {{content}} (the user message) and {{value}} "
                f"(the privileged field)."
            )
        settings = cls(
            teacher=json.dumps(dict(routes)) if routes else str(teacher).strip(),
            request_timeout_s=timeout,
            routes=routes,
            route_field=field or None,
            privileged_field=config.teacher_privileged_field or None,
            privileged_template=template,
        )
        temperature = config.temperature
        if settings.server and temperature not in (None, 0, 0.0, 1, 1.0):
            raise ValueError(
                f"teacher_model_name_or_path={settings.teacher!r} is a server, whose prompt log-probs are the "
                f"untempered distribution's (vLLM applies no sampling processor to prompt tokens), and the student "
                f"samples at temperature {temperature}: set temperature=1.0, or give a local teacher (scored at the "
                f"sampling temperature)."
            )
        return settings


def _routes(teacher: Any) -> tuple[tuple[str, str], ...]:
    """A mapping of teachers (a dict, or its JSON) as sorted pairs; ``()`` for one teacher."""
    if isinstance(teacher, str) and teacher.lstrip().startswith("{"):
        try:
            teacher = json.loads(teacher)
        except json.JSONDecodeError as exc:
            raise ValueError(f"teacher_model_name_or_path is not valid JSON ({exc}): {teacher[:80]!r}") from None
    if not isinstance(teacher, Mapping):
        return ()
    bad = [k for k, v in teacher.items() if not isinstance(v, str) or not v.strip()]
    if not teacher or bad:
        raise ValueError(
            f"teacher_model_name_or_path: a mapping of teachers needs a non-empty folder or URL for each route"
            f"{' (not ' + ', '.join(map(str, bad)) + ')' if bad else ''}."
        )
    return tuple(sorted((str(k), str(v).strip()) for k, v in teacher.items()))
