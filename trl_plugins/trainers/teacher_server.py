"""On-policy distillation's teacher behind an OpenAI-compatible server that returns prompt log-probs (vLLM's
``prompt_logprobs`` extension of ``/v1/completions``): the student's tokens are sent as token ids and the server
scores each of them given the ones before it. Every rank asks for its own datums; no weights move.

At start-up (:meth:`ServerTeacher.connect`) the server is checked, each step in one request with its deadline: the
model it serves (``/v1/models``: one model, or the one named), its tokenizer against the student's (the student's
render of :data:`~trl_plugins.trainers.teacher.SAMPLE_CONVERSATION` sent as text to ``/tokenize`` and compared token by
token: the same ids for the same text, template tokens included; the server's own chat template is not used, since it
only ever scores the student's tokens), and a probe that it returns prompt log-probs at all.

What it cannot give: log-probs at another temperature (vLLM applies no sampling processor to prompt tokens: refused
unless the student samples at temperature 1, :class:`~trl_plugins.run.settings.Distillation`), and the whole
next-token distribution: the ``jsd`` loss reads its top-k (:meth:`ServerTeacher.sequence_top_logprobs`) and compares
the distributions there (:mod:`trl_plugins.modeling.sparse_divergence`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Sequence

__all__ = ["ServerTeacher", "TeacherServerError"]


class TeacherServerError(RuntimeError):
    """The teacher server did not answer within its deadline, answered an error, or lacks what distillation needs (the
    message names the server, the request and what to do)."""


class ServerTeacher:
    """A teacher server's client: :meth:`sequence_logprobs` of token-id sequences."""

    def __init__(self, url: str, model: str, *, timeout_s: float, batch_size: int = 16) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.batch_size = batch_size
        self.version: str | None = None
        """The server's software version (``/version``), when it says."""

    @property
    def root(self) -> str:
        """The server's root (its base URL without ``/v1``): where vLLM serves ``/tokenize`` and ``/version``."""
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url

    def _request(self, url: str, body: Mapping[str, Any] | None, what: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
            raise TeacherServerError(
                f"the teacher server at {self.url} answered {exc.code} to {what} ({url}): {detail}"
            ) from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            waited = time.monotonic() - start
            raise TeacherServerError(
                f"the teacher server at {self.url} gave no answer to {what} ({url}): {reason} (after {waited:.1f} s; "
                f"deadline {self.timeout_s:g} s, teacher_request_timeout_s); start it or check the URL, or raise the "
                f"deadline for a slow server."
            ) from None

    @classmethod
    def connect(cls, url: str, *, tokenizer: Any, sample: tuple[str, list[int]], timeout_s: float) -> ServerTeacher:
        """The client of the server at ``url``, checked (module docstring); ``sample``: the student's render of the
        check's conversation as text and as its token ids (:func:`~trl_plugins.trainers.teacher.render_sample`).

        Raises:
            TeacherServerError: the server does not answer, serves several models or none, tokenizes the student's
                text otherwise, or returns no prompt log-probs (each named, with what to do).
        """
        probe = cls(url, "", timeout_s=timeout_s)
        served = [m["id"] for m in probe._request(f"{probe.url}/models", None, "the model list").get("data", [])]
        if len(served) != 1:
            raise TeacherServerError(
                f"the teacher server at {probe.url} serves {len(served)} models ({', '.join(served) or 'none'}); "
                f"distillation reads one: serve the teacher alone."
            )
        teacher = cls(url, served[0], timeout_s=timeout_s)
        try:
            teacher.version = str(teacher._request(f"{teacher.root}/version", None, "the version").get("version"))
        except TeacherServerError:
            teacher.version = None  # not every OpenAI-compatible server says
        text, ids = sample
        answer = teacher._request(
            f"{teacher.root}/tokenize",
            {"model": teacher.model, "prompt": text, "add_special_tokens": False},
            "the tokenizer check",
        )
        theirs = list(answer.get("tokens", []))
        if theirs != ids:
            i = next((k for k, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
            shown = [repr(tokenizer.decode(x[i : i + 1])) if i < len(x) else "(end)" for x in (ids, theirs)]
            raise TeacherServerError(
                f"the teacher server at {teacher.url} ({teacher.model}) does not share the student's tokenizer: the "
                f"student's render of a conversation with a tool call tokenizes differently from token {i}: "
                f"{shown[0]} (student) vs id {theirs[i] if i < len(theirs) else '(end)'} (server). Distillation "
                f"compares log-probs token by token, so the teacher must use the student's tokenizer "
                f"(cross-tokenizer distillation is not supported)."
            )
        got = teacher.sequence_logprobs([ids[:8]], what="the prompt log-prob probe")[0]
        if len(got) != min(len(ids), 8) - 1:
            raise TeacherServerError(
                f"the teacher server at {teacher.url} returned {len(got)} prompt log-probs for 8 tokens"
            )
        return teacher

    def sequence_logprobs(
        self, sequences: Sequence[Sequence[int]], *, what: str = "prompt log-probs"
    ) -> list[list[float]]:
        """For each sequence, ``log p_teacher(s[j] | s[:j])`` for ``j >= 1`` (one fewer than its tokens), at
        temperature 1, asked ``batch_size`` sequences a request.

        Raises:
            TeacherServerError: a request failed or passed its deadline, or the answer holds no prompt log-probs.
        """
        return [actual for actual, _ in self.sequence_top_logprobs(sequences, top_k=0, what=what)]

    def sequence_top_logprobs(
        self, sequences: Sequence[Sequence[int]], *, top_k: int, what: str = "prompt log-probs"
    ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """:meth:`sequence_logprobs` and, at each of those positions, the teacher's ``top_k`` most likely tokens as
        ``(id, log-prob)`` by rank (vLLM's ``prompt_logprobs: k``; fewer where the vocabulary is smaller; empty lists
        for ``top_k`` 0).

        Raises:
            TeacherServerError: a request failed or passed its deadline (vLLM answers 400 to more top tokens than its
                ``--max-logprobs``, 20 by default), or the answer holds no prompt log-probs.
        """
        out: list[tuple[list[float], list[list[tuple[int, float]]]]] = []
        for start in range(0, len(sequences), self.batch_size):
            part = [list(map(int, s)) for s in sequences[start : start + self.batch_size]]
            answer = self._request(
                f"{self.url}/completions",
                {"model": self.model, "prompt": part, "max_tokens": 1, "prompt_logprobs": top_k, "temperature": 1.0},
                what,
            )
            choices = sorted(answer.get("choices", []), key=lambda c: c.get("index", 0))
            if len(choices) != len(part):
                raise TeacherServerError(
                    f"the teacher server at {self.url} answered {len(choices)} choices to {len(part)} prompts ({what})"
                )
            for seq, choice in zip(part, choices):
                scored = choice.get("prompt_logprobs")
                if not isinstance(scored, list) or len(scored) != len(seq):
                    raise TeacherServerError(
                        f"the teacher server at {self.url} returned no prompt log-probs ({what}): distillation needs "
                        f"vLLM's prompt_logprobs extension of /v1/completions; serve the teacher with vLLM, or give a "
                        f"local teacher folder."
                    )
                actual = [float(entry[str(tok)]["logprob"]) for tok, entry in zip(seq[1:], scored[1:])]
                tops = [_top(entry, top_k) for entry in scored[1:]] if top_k else [[] for _ in scored[1:]]
                out.append((actual, tops))
        return out

    def identity(self) -> str:
        """What the run's version records of it: the URL, the model it serves and the server's version."""
        return f"{self.url} model {self.model} server {self.version or 'unknown'}"


def _top(entry: Mapping[str, Any], k: int) -> list[tuple[int, float]]:
    # A vLLM prompt log-prob entry (token id -> {logprob, rank}: the top k, and the actual token whatever its rank):
    # the top k by rank.
    ranked = sorted((int(v.get("rank", k + 1)), int(tok), float(v["logprob"])) for tok, v in entry.items())
    return [(tok, lp) for rank, tok, lp in ranked if rank <= k][:k]
