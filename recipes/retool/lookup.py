"""The second bundled task: a number behind a key, then arithmetic on it (two dependent tool calls).

Each problem names a key and asks for the square of the number it holds:

    What is x * x, where x is the number under key "K417"?

The number is only in the ``lookup`` tool (:class:`LookupTool`, a table the prompt never shows and the sandbox
cannot read), so a solution takes at least two calls: ``lookup`` for ``x``, then the code interpreter for the
square (five digits: out of a tiny model's head), whose code needs what the first call printed. Some keys were moved:
looking one up fails with an error
that names the new key (``Error: key K417 was moved to K902; look up K902.``), which the model must read and follow.
These failures come from the world (which keys moved is a fixed property of the table), not from the model's code.

The table is a pure function of the key (no seed): every run, build and process sees the same world. A problem's
split follows its key (a hash), so held-out problems ask about keys no training problem names; the seed orders them.

Every copy a solution makes (the key into the first call, a moved key's new name into the next, the number into the
code, the code's output into the answer) reaches at most ~35 tokens back, within the tiny model's attention window:
an earlier version asked for ``x * b + c``, whose second call had to copy ``b`` and ``c`` from ~130 tokens back, and its
cold start never learned to (docs/experiment_log.md).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["LookupTool", "lookup_problems", "resolve_key", "key_value", "moved_to", "KEY_PATTERN", "MOVED_PERCENT"]

KEY_PATTERN = re.compile(r"K[1-9][0-9]{2}")
"""A key: ``K`` and a three-digit number (K100 to K999)."""
MOVED_PERCENT = 40
"""Share of keys (percent) that were moved to another key."""
ANSWER_DIGITS = 5
"""Every answer has this many digits (one layout: the copies the model makes are at constant offsets)."""


def _hash(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("/".join(("lookup", *parts)).encode()).digest()[:8], "big")


def moved_to(key: str) -> str | None:
    """The key ``key`` was moved to, or None when it holds its number itself. A key is moved at most once: the
    new key holds the number."""
    if _hash("moved", key) % 100 >= MOVED_PERCENT:
        return None
    salt = 0
    while True:
        target = f"K{100 + _hash('target', key, str(salt)) % 900}"
        if target != key and _hash("moved", target) % 100 >= MOVED_PERCENT:
            return target
        salt += 1


def key_value(key: str) -> int:
    """The number a key that was not moved holds: 100 to 316, so that its square has :data:`ANSWER_DIGITS` digits."""
    return 100 + _hash("value", key) % 217


def resolve_key(key: str) -> tuple[str, int]:
    """``(the key that holds the number, the number)`` for a key of the table."""
    target = moved_to(key) or key
    return target, key_value(target)


def _split_of(key: str) -> str:
    return "test" if _hash("split", key) % 10 < 2 else "train"


def lookup_problems(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` problems of the split: rows ``{"id", "prompt", "answer", "key", "moved_to", "value"}`` (``value``: the
    number behind the key, after following a move; ``moved_to``: the key it moved to, or None). One problem per key
    (741 train, 159 test), in an order the seed shuffles; more training rows than keys go round again, each round
    shuffled anew (a held-out split never repeats a problem).

    Raises:
        ValueError: an unknown split, a non-positive ``n``, or more problems than the split has.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    keys = [f"K{k}" for k in range(100, 1000) if _split_of(f"K{k}") == split]
    if n > len(keys) and split == "test":
        raise ValueError(f"the {split} split has {len(keys)} problems (one per key); asked for {n}.")
    order: list[str] = []
    for round_ in range(-(-n // len(keys))):
        random.Random(f"lookup/{seed}/{round_}").shuffle(keys)
        order += keys
    rows = []
    for key in order[:n]:
        target, value = resolve_key(key)
        rows.append(
            {
                "id": f"lookup-{split}-{seed}-{len(rows)}",
                "prompt": f'What is x * x, where x is the number under key "{key}"?',
                "answer": str(value * value),
                "key": key,
                "moved_to": target if target != key else None,
                "value": value,
            }
        )
    return rows


@dataclass
class LookupTool:
    """The table's only reader: ``lookup(key)`` prints the number a key holds.

    Outputs: the number (``ok``); ``Error: key K417 was moved to K902; look up K902.`` for a moved key and ``Error:
    no key 'x'. Keys are K100 to K999, e.g. K417.`` for anything else (both ``ok=False``: the model's next call
    should fix it). Pure and instant: no resources, idempotent.
    """

    name: str = "lookup"
    idempotent: ClassVar[bool] = True

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Print the number stored under a key",
                "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
            },
        }

    def lookup(self, key: Any) -> tuple[str, bool]:
        """``(text, ok)`` of a call with ``key``."""
        key = str(key).strip()
        if not KEY_PATTERN.fullmatch(key):
            return f"Error: no key {key!r}. Keys are K100 to K999, e.g. K417.", False
        target = moved_to(key)
        if target is not None:
            return f"Error: key {key} was moved to {target}; look up {target}.", False
        return str(key_value(key)), True

    async def __call__(self, arguments: dict[str, Any]) -> Any:
        from trl_plugins.tools.base import ToolOutput, check_arguments

        problem = check_arguments(self.schema(), arguments)
        if problem is not None:
            return ToolOutput(text=f"Error: {problem}.", ok=False)
        text, ok = self.lookup(arguments["key"])
        return ToolOutput(text=text, ok=ok)
