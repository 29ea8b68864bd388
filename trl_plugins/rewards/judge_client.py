"""The judge's side of the wire: one OpenAI-compatible ``/chat/completions`` call with a deadline, the retries that are
safe, a concurrency limit per endpoint, a disk cache keyed by the whole request, and the cost counters
(:mod:`trl_plugins.rewards.judge` builds the requests and reads the answers).

What is retried, always within the call's deadline (``timeout_s``, counted from the first attempt):

- a refused or failed connection, a 5xx: after a backoff (0.25 s, doubling);
- a 429: after its ``Retry-After`` (seconds or an HTTP date), or the backoff when it has none; a ``Retry-After``
  beyond the deadline ends the call at once (waiting would only fail later).

Never retried: an answer that came back (a 200, whatever its content: a malformed or truncated answer stays one when
asked again at temperature 0), another 4xx, and a call that used up its deadline waiting for the answer.
"""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

__all__ = ["JudgeError", "JudgeAnswer", "JudgeCache", "JudgeStats", "call_judge", "endpoint_problems", "request_digest"]

_BACKOFF_S = 0.25
_LIMITS: dict[str, threading.BoundedSemaphore] = {}
_LIMITS_LOCK = threading.Lock()


class JudgeError(Exception):
    """A judge call that gave no usable score: the trajectory ends as ``verifier_error`` (the judge's fault, not the
    policy's). ``kind`` is one word a failure rate can be counted by (``timeout``, ``connect``, ``http_500``,
    ``retry_after``, ``malformed``, ``truncated``, ``unparsable``, ``out_of_scale``, ``refused``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.detail = kind, message


@dataclass
class JudgeAnswer:
    """What the judge said: its text and the tokens the call cost (0 when served from the cache)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False


@dataclass
class JudgeStats:
    """Cost counters of one step, per judge component (thread-safe; :meth:`take` reads and resets them)."""

    calls: int = 0
    """Requests answered or failed by the server (retries counted: each is a request)."""
    retries: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    """Seconds per judged item (request to answer, retries and their waits included; cache hits excluded)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self.lock:
            for key, value in counts.items():
                if key == "latency":
                    self.latencies.append(float(value))
                else:
                    setattr(self, key, getattr(self, key) + int(value))

    def take(self) -> dict[str, float]:
        """The step's figures (``calls``, ``retries``, ``cache_hits``, ``tokens_in``, ``tokens_out``, ``errors``,
        ``latency_p50_s``, ``latency_p95_s``), the counters reset."""
        with self.lock:
            lat = sorted(self.latencies)
            out = {
                "calls": float(self.calls),
                "retries": float(self.retries),
                "cache_hits": float(self.cache_hits),
                "tokens_in": float(self.prompt_tokens),
                "tokens_out": float(self.completion_tokens),
                "errors": float(self.errors),
                "latency_p50_s": _quantile(lat, 0.5),
                "latency_p95_s": _quantile(lat, 0.95),
            }
            self.calls = self.retries = self.cache_hits = self.prompt_tokens = 0
            self.completion_tokens = self.errors = 0
            self.latencies = []
            return out


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def request_digest(body: Mapping[str, Any], parser: str) -> str:
    """SHA-256 of the whole request (model, messages with the reference, sampling settings, response format) and the
    parser that reads the answer (which includes the scale): the cache's key."""
    text = json.dumps({"body": body, "parser": parser}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class JudgeCache:
    """Answers already given, in one SQLite file shared by every process of a run (a resumed run and a replay read
    it too). Only answers that parsed are stored: an unparsable one is asked again next time. A judge sampled at a
    temperature above 0 is not re-sampled for a request it has answered: its first answer is the answer. A failure of
    a call made during the rollout is kept until the scoring after it reads it once (:meth:`take_failure`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30.0)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, text TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS failures (key TEXT PRIMARY KEY, kind TEXT, message TEXT)")
            self._local.db = db
        return db

    def take_failure(self, key: str) -> tuple[str, str] | None:
        """The failure a call made during the rollout got for ``key`` (kind, message), forgotten as it is read: the
        scoring after the rollout reports it instead of asking again, and the next ask calls the judge."""
        db = self._db()
        row = db.execute("SELECT kind, message FROM failures WHERE key = ?", (key,)).fetchone()
        if row is not None:
            db.execute("DELETE FROM failures WHERE key = ?", (key,))
            db.commit()
        return row

    def put_failure(self, key: str, kind: str, message: str) -> None:
        db = self._db()
        db.execute("INSERT OR REPLACE INTO failures (key, kind, message) VALUES (?, ?, ?)", (key, kind, message))
        db.commit()

    def get(self, key: str) -> str | None:
        row = self._db().execute("SELECT text FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, text: str) -> None:
        db = self._db()
        db.execute("INSERT OR IGNORE INTO answers (key, text) VALUES (?, ?)", (key, text))
        db.commit()

    def __getstate__(self) -> dict[str, Any]:  # connections stay with their thread
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._local = threading.local()


def endpoint_problems(
    base_url: Any, api_key_env: Any, *, names: tuple[str, str] = ("base_url", "api_key_env")
) -> list[str]:
    """What is wrong with a judge endpoint's settings (``names``: what the settings are called where they are set),
    each a clause for a one-line refusal: a URL that is not http(s), a key variable that is not set."""
    problems = []
    parts = urlsplit(str(base_url))
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append(f"{names[0]}={base_url!r} is not an http(s) URL (e.g. http://127.0.0.1:8011/v1)")
    if api_key_env is not None and not os.environ.get(str(api_key_env)):
        problems.append(f"{names[1]}={api_key_env!r} names an environment variable that is not set")
    return problems


def endpoint_limit(base_url: str, concurrency: int) -> threading.BoundedSemaphore:
    """The concurrency limit of one endpoint, shared by every judge component of this process that calls it (the
    first component to call it sets its size)."""
    with _LIMITS_LOCK:
        if base_url not in _LIMITS:
            _LIMITS[base_url] = threading.BoundedSemaphore(concurrency)
        return _LIMITS[base_url]


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def call_judge(
    client: Any,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    timeout_s: float,
    max_retries: int,
    limit: threading.BoundedSemaphore,
    stats: JudgeStats,
    where: str,
) -> JudgeAnswer:
    """POST ``body`` to ``url`` (an ``httpx.Client``'s) and return the answer's text, within ``timeout_s``.

    Raises:
        JudgeError: no usable answer (see the module's docstring for what is retried); ``where`` names the judge.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise JudgeError("timeout", f"no answer from {where} within timeout_s={timeout_s:g}")
        with limit:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JudgeError("timeout", f"no answer from {where} within timeout_s={timeout_s:g} (queued)")
            try:
                response = client.post(url, json=body, headers=dict(headers), timeout=httpx.Timeout(left))
            except httpx.TimeoutException:
                stats.add(calls=1)
                raise JudgeError("timeout", f"no answer from {where} within timeout_s={timeout_s:g}") from None
            except httpx.TransportError as exc:
                stats.add(calls=1)
                wait, kind, detail = _BACKOFF_S * 2**attempt, "connect", f"{type(exc).__name__}: {exc}"
            else:
                stats.add(calls=1)
                status = response.status_code
                if status == 200:
                    return _answer(response, where)
                detail = f"HTTP {status}: {response.text[:200]}"
                if status == 429:
                    asked = _retry_after(response.headers.get("retry-after"))
                    if asked is not None and asked > deadline - time.monotonic():
                        raise JudgeError(
                            "retry_after",
                            f"{where} answered 429 with Retry-After {asked:g} s, beyond what is left of "
                            f"timeout_s={timeout_s:g}; lower the judge's concurrency or raise timeout_s",
                        )
                    wait, kind = (asked if asked is not None else _BACKOFF_S * 2**attempt), "http_429"
                elif status >= 500:
                    wait, kind = _BACKOFF_S * 2**attempt, f"http_{status}"
                else:  # another 4xx: asking again gets the same answer
                    raise JudgeError(f"http_{status}", f"{where} refused the request: {detail}")
        if attempt >= max_retries:
            raise JudgeError(kind, f"{where} failed {attempt + 1} times (max_retries={max_retries}): {detail}")
        if wait > deadline - time.monotonic():
            raise JudgeError(kind, f"{where} failed and timeout_s={timeout_s:g} leaves no time to retry: {detail}")
        stats.add(retries=1)
        time.sleep(wait)
        attempt += 1


def _answer(response: Any, where: str) -> JudgeAnswer:
    try:
        payload = response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(
            "malformed", f"{where} answered 200 with no chat completion in it: {response.text[:300]!r}"
        ) from None
    if not isinstance(text, str):
        raise JudgeError("refused", f"{where} answered with no text (refusal: {choice['message'].get('refusal')!r})")
    if choice.get("finish_reason") == "length":
        raise JudgeError(
            "truncated", f"{where}'s answer was cut at max_tokens (raise the judge's max_tokens): {text[-300:]!r}"
        )
    usage = payload.get("usage") or {}
    return JudgeAnswer(text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
