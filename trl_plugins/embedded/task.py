"""The bundled task: multi-digit arithmetic, hard "in the head" for a tiny model, easy with Python.

Problems are generated deterministically from a seed; a problem belongs to the train or the test
split by a hash of its text, so the splits never share a problem whatever sizes are asked for.
"""

from __future__ import annotations

import hashlib
import random

__all__ = ["arithmetic_problems", "SPLITS"]

SPLITS = ("train", "test")

_TEMPLATES = (
    ("{a} * {b} + {c}", lambda a, b, c: a * b + c),
    ("{a} * {b} - {c}", lambda a, b, c: a * b - c),
    ("({a} + {b}) * {c}", lambda a, b, c: (a + b) * c),
    ("{a} * {b} * {c}", lambda a, b, c: a * b * c),
)


def _split_of(expression: str) -> str:
    bucket = hashlib.sha256(expression.encode()).digest()[0] % 10
    return "test" if bucket < 2 else "train"


def arithmetic_problems(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` problems of the split: rows ``{"id", "prompt", "answer", "expression"}``.

    Raises:
        ValueError: an unknown split or a non-positive ``n``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    rng = random.Random(f"arithmetic/{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        k = rng.randrange(len(_TEMPLATES))
        template, fn = _TEMPLATES[k]
        a, b = rng.randint(12, 999), rng.randint(12, 99)
        # Keep every answer at two digits or more: subtract at most half, multiply by at least 3.
        c = (rng.randint(2, 999), rng.randint(2, a * b // 2), rng.randint(3, 29), rng.randint(3, 29))[k]
        expression = template.format(a=a, b=b, c=c)
        if expression in seen or _split_of(expression) != split:
            continue
        seen.add(expression)
        rows.append({
            "id": f"{split}-{seed}-{len(rows)}",
            "prompt": f"What is {expression}?",
            "answer": str(fn(a, b, c)),
            "expression": expression,
        })
    return rows
