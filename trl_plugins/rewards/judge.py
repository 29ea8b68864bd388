"""An LLM judge as a reward component (``judge``): an OpenAI-compatible chat server scores each trajectory
(``mode: pointwise``) or each group of them in one call (``mode: group``, RULER's way), on a scale, read from its
answer by a JSON object or a regex (docs/rewards.md).

The component's value is the score mapped onto [0, 1] (``low`` -> 0, ``high`` -> 1); with ``mode: group`` and
``group_value: rank`` it is the trajectory's rank in its group mapped onto [0, 1] instead (best 1, ties share their
mean rank). The run's advantage estimator then compares the values within the group as it does any reward's.

A judge that fails (no answer within ``timeout_s``, an error after its retries, an answer that does not parse or
leaves the scale) fails the trajectories it was asked about: they end as ``verifier_error`` with the judge's text in
their ``error``, and the run's ``max_verifier_error_rate`` counts them. The wire (deadlines, retries, the concurrency
limit, the cache) is :mod:`trl_plugins.rewards.judge_client`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from trl_plugins.registry import REWARDS
from trl_plugins.rewards.judge_client import (
    JudgeAnswer,
    JudgeCache,
    JudgeError,
    JudgeStats,
    call_judge,
    endpoint_limit,
    endpoint_problems,
    request_digest,
)
from trl_plugins.rewards.math import final_text, turn_text
from trl_plugins.types import Trajectory

__all__ = ["JudgeReward", "JudgeError", "POINTWISE_TEMPLATE", "GROUP_TEMPLATE", "render_trajectory"]

POINTWISE_TEMPLATE = (
    "You grade an assistant's response to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer: {reference}\n\n"
    "Response:\n{response}\n\n"
    "Score the response from {low:g} (wrong or unhelpful) to {high:g} (right and helpful). "
    "{answer_format}"
)
"""The default pointwise rubric. Placeholders: ``{question}``, ``{reference}`` (``none given`` without one),
``{response}`` (the trajectory as ``show`` renders it), ``{low}``, ``{high}`` and ``{answer_format}`` (what the parser
reads: a JSON object, or the regex's line)."""

GROUP_TEMPLATE = (
    "You compare {n} responses to the same question and score each one.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer: {reference}\n\n"
    "{responses}\n\n"
    "Score every response from {low:g} (wrong or unhelpful) to {high:g} (right and helpful), comparing them with "
    "each other. {answer_format}"
)
"""The default group rubric (one call per group): ``{responses}`` lists them as ``Response 1:`` ... and ``{n}`` is
how many; the other placeholders as in :data:`POINTWISE_TEMPLATE`."""

_NUMBER = r"(-?\d+(?:\.\d+)?)"


def render_trajectory(trajectory: Trajectory, show: str) -> str:
    """What the judge sees of ``trajectory``: its final answer (the last turn's text), or every turn with its tool
    calls and their outputs (``show="turns"``)."""
    if show == "final_answer":
        return final_text(trajectory).strip()
    parts = []
    for i, turn in enumerate(trajectory.turns):
        parts.append(f"[assistant turn {i + 1}]\n{turn_text(turn).strip()}")
        for call in turn.tool_calls:
            args = json.dumps(call.arguments, sort_keys=True)
            parts.append(f"[tool {call.name}({args}) returned]\n{call.output.strip()}")
    return "\n\n".join(parts)


def _question(row: Mapping[str, Any], key: str) -> str:
    prompt = row.get(key)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages: the last user message
        users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise KeyError(
        f"the judge needs the question in column {key!r} (a string or chat messages); the row has {sorted(row)}. "
        f"Set question_key in reward_component_kwargs."
    )


@REWARDS.register("judge")
@dataclass
class JudgeReward:
    """An LLM judge behind an OpenAI-compatible ``/chat/completions`` endpoint (vLLM, a hosted API, a scripted
    server). Every setting is checked when the component is built; the endpoint is first called by the run's
    start-up contract check."""

    base_url: str = ""
    """The server's OpenAI base URL, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended)."""
    model: str = ""
    """The judge model's name as the server serves it."""
    api_key_env: str | None = None
    """The environment variable holding the key sent as ``Authorization: Bearer``; the key itself is never a setting,
    so it never reaches a log, the banner, ``summary.json`` or W&B. None: no key (a local server)."""
    mode: Literal["pointwise", "group"] = "pointwise"
    """``pointwise``: one call per trajectory. ``group``: one call per group scores all its members, which the judge
    sees side by side (identical responses shown once, in a fixed order: the scores do not depend on the order the
    rollout produced them in)."""
    group_value: Literal["score", "rank"] = "score"
    """With ``mode: group``: the component's value is the judge's score, or the rank those scores give."""
    show: Literal["final_answer", "turns"] = "final_answer"
    """What the judge sees: the last turn's text, or every turn with its tool calls and their outputs."""
    template: str | None = None
    """The rubric (a ``str.format`` template; see :data:`POINTWISE_TEMPLATE` and :data:`GROUP_TEMPLATE`, the
    defaults). Its digest is part of the run's record (``versions()``)."""
    system_prompt: str | None = None
    """A system message before the rubric."""
    question_key: str = "prompt"
    """The row's column with the question (a string, or chat messages: the last user message)."""
    reference_key: str | None = "answer"
    """The row's column with a reference answer shown to the judge; None: none (a row without it is refused)."""
    low: float = 0.0
    """The bottom of the judge's scale (value 0)."""
    high: float = 10.0
    """The top of the judge's scale (value 1)."""
    parser: Literal["json", "regex"] = "json"
    """``json``: the answer is a JSON object ``{"score": x}`` (``{"scores": [...]}`` for a group), asked for as
    structured output. ``regex``: ``score_regex`` finds the score (for a group, one match per response in order)."""
    structured_output: bool = True
    """With ``parser: json``, send ``response_format`` with the JSON schema (vLLM and OpenAI honour it); turn it off
    for a server that refuses the field."""
    score_regex: str = r"(?i)score\s*[:=]\s*" + _NUMBER
    """With ``parser: regex``: the pattern whose first group is a score (the last match wins for one response)."""
    extra_body: dict[str, Any] | None = None
    """Fields added to every request (a server's own options: vLLM's ``structured_outputs`` with a ``regex`` for a
    regex parser, ``chat_template_kwargs``, ``top_k``); part of the request, so of the cache's key. It may not set
    ``model``, ``messages``, ``temperature``, ``max_tokens`` or ``response_format`` (the settings above do)."""
    temperature: float = 0.0
    """The judge's sampling temperature (with a cached answer, a sampled judge is not asked again)."""
    max_tokens: int = 256
    """The judge's answer's length limit; an answer cut there is a failure (``truncated``)."""
    concurrency: int = 8
    """Requests in flight to this endpoint at most (shared by every judge of this process on that URL)."""
    timeout_s: float = 30.0
    """Deadline of one judged item (a trajectory, or a group), retries and their waits included."""
    max_retries: int = 3
    """Retries after a refused connection, a 429 or a 5xx (never after an answer)."""
    cache_path: str | None = "~/.cache/trl_plugins/judge.sqlite"
    """Answers already given, keyed by the digest of the whole request: a resumed run and a replay do not pay twice.
    None: no cache."""
    _client: Any = field(default=None, init=False, repr=False, compare=False)
    _stats: JudgeStats = field(default_factory=JudgeStats, init=False, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _inflight: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _cache_db: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = endpoint_problems(self.base_url, self.api_key_env)
        if not self.model:
            problems.append("model is empty: name the judge model the server serves")
        if not self.high > self.low:
            problems.append(f"the scale low={self.low:g} .. high={self.high:g} is empty")
        if self.mode not in ("pointwise", "group"):
            problems.append(f"mode={self.mode!r}: use 'pointwise' or 'group'")
        if self.group_value not in ("score", "rank"):
            problems.append(f"group_value={self.group_value!r}: use 'score' or 'rank'")
        if self.group_value == "rank" and self.mode != "group":
            problems.append("group_value='rank' ranks a group's members: set mode: group, or group_value: score")
        if self.show not in ("final_answer", "turns"):
            problems.append(f"show={self.show!r}: use 'final_answer' or 'turns'")
        if self.parser not in ("json", "regex"):
            problems.append(f"parser={self.parser!r}: use 'json' or 'regex'")
        if self.parser == "regex":
            try:
                if re.compile(self.score_regex).groups < 1:
                    problems.append("score_regex has no group: its first group must capture the score")
            except re.error as exc:
                problems.append(f"score_regex does not compile: {exc}")
        for name in ("concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        if not self.timeout_s > 0 or self.max_retries < 0:
            problems.append(f"timeout_s={self.timeout_s} must be > 0 and max_retries={self.max_retries} >= 0")
        taken = {"model", "messages", "temperature", "max_tokens", "response_format"} & set(self.extra_body or {})
        if taken:
            problems.append(f"extra_body sets {sorted(taken)}, which the judge's own settings set")
        if problems:
            raise ValueError("the judge's settings: " + "; ".join(problems) + ".")
        self._template()  # a template with an unknown placeholder fails here, not at the first step

    # -- what the run reads ------------------------------------------------------------------------------

    def versions(self) -> dict[str, str | None]:
        """The judge's identity in the run's record: the model, where it is served, and the digest of the rubric,
        the parser and the sampling settings (the replay command names a change)."""
        recipe = json.dumps(
            [self._template(), self.system_prompt, self.parser, self.score_regex, self.low, self.high, self.show,
             self.mode, self.group_value, self.temperature, self.max_tokens, self.extra_body],
            default=str,
        )  # fmt: skip
        return {
            "model": f"{self.model} at {self.base_url}",
            "rubric": hashlib.sha256(recipe.encode()).hexdigest()[:16],
        }

    def step_metrics(self) -> dict[str, float]:
        """The step's cost: ``judge/calls``, ``judge/retries``, ``judge/cache_hits``, ``judge/tokens_in``,
        ``judge/tokens_out``, ``judge/errors``, ``judge/latency_p50_s``, ``judge/latency_p95_s``."""
        return {f"judge/{k}": v for k, v in self._stats.take().items()}

    def step_metric_reductions(self) -> dict[str, str]:
        counts = ("calls", "retries", "cache_hits", "tokens_in", "tokens_out", "errors")
        return {**{f"judge/{k}": "sum" for k in counts}, "judge/latency_p50_s": "max", "judge/latency_p95_s": "max"}

    @property
    def scores_during_rollout(self) -> str | None:
        """With a cache, each trajectory (``pointwise``) or each whole group (``group``) is judged as it ends, during
        the rollout, and the scoring after it reads the cache: the judge's latency hides behind the generation."""
        if self.cache_path is None:
            return None
        return "trajectory" if self.mode == "pointwise" else "group"

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        """One trajectory's value (with ``mode: group``, the trajectory judged as a group of one)."""
        (value,) = self.score_batch([trajectory], [example])
        if isinstance(value, BaseException):
            raise value
        return value

    def score_batch(
        self, trajectories: Sequence[Trajectory], rows: Sequence[Mapping[str, Any]], *, during_rollout: bool = False
    ) -> list[float | BaseException]:
        """Every trajectory's value, or the exception that failed it. ``rows[i]`` is ``trajectories[i]``'s row.
        With ``mode: group`` the members of a group (same ``group_id``) are judged together. Identical requests (two
        samples with the same answer) are asked once; the calls run ``concurrency`` at a time.

        ``during_rollout``: called as trajectories end (``scores_during_rollout``); a failure is then kept in the
        cache for the scoring after the rollout to report once, instead of asking the judge again."""
        if self.mode == "pointwise":
            items = [[i] for i in range(len(trajectories))]
        else:
            by_group: dict[int, list[int]] = {}
            for i, t in enumerate(trajectories):
                by_group.setdefault(t.group_id, []).append(i)
            items = list(by_group.values())
        prepared: list[tuple[list[str], list[str], str] | BaseException] = []
        requests: dict[str, tuple[dict[str, Any], int]] = {}
        for members in items:
            try:
                responses = [render_trajectory(trajectories[i], self.show) for i in members]
                shown = sorted(set(responses), key=lambda r: hashlib.sha256(r.encode()).hexdigest())
                body = self._body(rows[members[0]], shown)
                key = request_digest(body, self._parser_key(len(shown)))
            except Exception as exc:  # noqa: BLE001 - a row without its question: these trajectories fail, named
                self._stats.add(errors=1)
                prepared.append(exc)
                continue
            prepared.append((responses, shown, key))
            requests[key] = (body, len(shown))
        keys = list(requests)
        if len(keys) <= 1:
            answers = [self._resolve(k, *requests[k], during_rollout) for k in keys]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(keys)), thread_name_prefix="judge") as pool:
                answers = list(pool.map(lambda k: self._resolve(k, *requests[k], during_rollout), keys))
        by_key = dict(zip(keys, answers))
        out: list[float | BaseException] = [0.0] * len(trajectories)
        for members, item in zip(items, prepared):
            result = item if isinstance(item, BaseException) else by_key[item[2]]
            if not isinstance(result, BaseException):
                by_text = dict(zip(item[1], result))
                values = [(by_text[r] - self.low) / (self.high - self.low) for r in item[0]]
                result = _ranks(values) if self.group_value == "rank" else values
            for k, i in enumerate(members):
                out[i] = result if isinstance(result, BaseException) else result[k]
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:  # a copy gets its own connection, counters and calls in flight
        skip = ("_client", "_stats", "_lock", "_inflight", "_cache_db")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = dict(_client=None, _stats=JudgeStats(), _lock=threading.Lock(), _inflight={}, _cache_db=None)
        self.__dict__.update(state, **fresh)

    # -- one request -------------------------------------------------------------------------------------

    def _resolve(self, key: str, body: dict[str, Any], n: int, during_rollout: bool) -> list[float] | BaseException:
        """The scores of the ``n`` responses of one request: from the cache, from the same request in flight on
        another thread, from a failure the rollout's call left (reported once), or from the judge."""
        import time

        cache = self._cache()
        try:
            text = cache.get(key) if cache is not None else None
            if text is not None:
                self._stats.add(cache_hits=1)
                return self._parse(text, n)
        except JudgeError as exc:
            return exc
        with self._lock:
            pending = self._inflight.get(key)
            if pending is None:
                pending = self._inflight[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            self._stats.add(cache_hits=1)
            return pending.exception() or pending.result()
        result: list[float] | BaseException
        try:
            remembered = cache.take_failure(key) if cache is not None and not during_rollout else None
            if remembered is not None:  # counted as an error where the call was made
                result = JudgeError(remembered[0], remembered[1] + " (during the rollout)")
            else:
                start = time.monotonic()
                answer = self._call(body)
                self._stats.add(
                    latency=time.monotonic() - start,
                    prompt_tokens=answer.prompt_tokens,
                    completion_tokens=answer.completion_tokens,
                )
                result = self._parse(answer.text, n)
                if cache is not None:
                    cache.put(key, answer.text)
        except JudgeError as exc:
            self._stats.add(errors=1)
            if during_rollout and cache is not None:
                cache.put_failure(key, exc.kind, exc.detail)
            result = exc
        except Exception as exc:  # noqa: BLE001 - the cache's disk, say: this request fails, named
            self._stats.add(errors=1)
            result = exc
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        if isinstance(result, BaseException):
            pending.set_exception(result)
        else:
            pending.set_result(result)
        return result

    def _cache(self) -> JudgeCache | None:
        if self.cache_path is None:
            return None
        with self._lock:
            if self._cache_db is None:
                self._cache_db = JudgeCache(self.cache_path)  # one connection per thread, kept
            return self._cache_db

    def _template(self) -> str:
        template = self.template or (POINTWISE_TEMPLATE if self.mode == "pointwise" else GROUP_TEMPLATE)
        fields = dict(question="q", reference="r", response="x", responses="x", n=2, low=0, high=1, answer_format="")
        try:
            template.format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"the judge's template does not format: {type(exc).__name__}: {exc} (placeholders: "
                f"{', '.join('{' + k + '}' for k in fields)})."
            ) from None
        return template

    def _answer_format(self, n: int) -> str:
        if self.parser == "json":
            return 'Answer with a JSON object {"score": <number>}.' if self.mode == "pointwise" else (
                f'Answer with a JSON object {{"scores": [<number>, ...]}} with {n} scores, in the responses\' order.'
            )  # fmt: skip
        return "End with a line 'Score: <number>'." if self.mode == "pointwise" else (
            "Give one line 'Response <i> score: <number>' per response, in order."
        )  # fmt: skip

    def _body(self, row: Mapping[str, Any], shown: list[str]) -> dict[str, Any]:
        reference = "none given"
        if self.reference_key is not None:
            if self.reference_key not in row:
                raise KeyError(
                    f"the judge shows the reference from column {self.reference_key!r}; the row has {sorted(row)}. "
                    f"Set reference_key (None: no reference)."
                )
            reference = str(row[self.reference_key])
        fields: dict[str, Any] = dict(
            question=_question(row, self.question_key),
            reference=reference,
            low=self.low,
            high=self.high,
            answer_format=self._answer_format(len(shown)),
            n=len(shown),
            response=shown[0] if len(shown) == 1 else "",
            responses="\n\n".join(f"Response {i + 1}:\n{r}" for i, r in enumerate(shown)),
        )
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self._template().format(**fields)})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        body.update(self.extra_body or {})
        if self.parser == "json" and self.structured_output:
            body["response_format"] = {"type": "json_schema", "json_schema": self._schema(len(shown))}
        return body

    def _schema(self, n: int) -> dict[str, Any]:
        number = {"type": "number", "minimum": self.low, "maximum": self.high}
        if self.mode == "pointwise":
            props: dict[str, Any] = {"score": number}
        else:
            props = {"scores": {"type": "array", "items": number, "minItems": n, "maxItems": n}}
        schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        return {"name": "judge_score", "strict": True, "schema": schema}

    def _parser_key(self, n: int) -> str:
        return json.dumps([self.parser, self.score_regex, self.low, self.high, self.mode, n])

    def _call(self, body: dict[str, Any]) -> JudgeAnswer:
        import httpx

        with self._lock:  # one client (its TLS context costs ~20 ms of CPU to make) for every thread
            if self._client is None:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.concurrency)
                self._client = httpx.Client(trust_env=False, limits=limits)  # no proxy from the environment
        headers = {}
        if self.api_key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.api_key_env, '')}"
        return call_judge(
            self._client,
            self.base_url.rstrip("/") + "/chat/completions",
            body,
            headers=headers,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            limit=endpoint_limit(self.base_url, self.concurrency),
            stats=self._stats,
            where=f"the judge {self.model!r} at {self.base_url}",
        )

    def _parse(self, text: str, n: int) -> list[float]:
        where = f"the judge {self.model!r} at {self.base_url} answered {text[:300]!r}, which"
        if self.parser == "json":
            try:
                start, end = text.index("{"), text.rindex("}") + 1
                obj = json.loads(text[start:end])
                raw = [obj["score"]] if self.mode == "pointwise" else list(obj["scores"])
            except (ValueError, KeyError, TypeError):
                raise JudgeError("unparsable", f"{where} holds no JSON object with its score(s)") from None
        else:
            found = re.findall(self.score_regex, text)
            found = [f[0] if isinstance(f, tuple) else f for f in found]
            raw = found[-1:] if self.mode == "pointwise" else found
            if not raw:
                raise JudgeError("unparsable", f"{where} does not match score_regex")
        if len(raw) != n:
            raise JudgeError("unparsable", f"{where} gives {len(raw)} scores for {n} responses")
        try:
            scores = [float(x) for x in raw]
        except (TypeError, ValueError):
            raise JudgeError("unparsable", f"{where} holds a score that is not a number") from None
        bad = [s for s in scores if not self.low <= s <= self.high]
        if bad:
            raise JudgeError("out_of_scale", f"{where} scores {bad} outside {self.low:g}..{self.high:g}")
        return scores


def _ranks(values: list[float]) -> list[float]:
    """Each value's rank among ``values`` mapped onto [0, 1] (the highest 1, ties their mean rank; one value: 1)."""
    if len(values) == 1:
        return [1.0]
    order = sorted(values)
    out = []
    for v in values:
        first = order.index(v)
        last = len(order) - 1 - order[::-1].index(v)
        out.append((first + last) / 2 / (len(values) - 1))
    return out
