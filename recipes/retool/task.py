"""The bundled task: multi-digit arithmetic, hard "in the head" for a tiny model, easy with Python.

Problems are generated deterministically from a seed; a problem belongs to the train or the test
split by a hash of its text, so the splits never share a problem whatever sizes are asked for.
"""

from __future__ import annotations

import hashlib
import random

__all__ = ["arithmetic_problems", "bundled_problems", "SPLITS"]

SPLITS = ("train", "test")

_TEMPLATES = (
    # (text, function, digits of a, b, c)
    ("{a} * {b} + {c}", lambda a, b, c: a * b + c, (3, 2, 3)),
    ("{a} * {b} - {c}", lambda a, b, c: a * b - c, (3, 2, 3)),
)
# One token layout (the operators differ, the digit positions do not): with several layouts, e.g. a
# "(a + b) * c" one, a 2-layer model learned the copies of some digit positions only.
ANSWER_DIGITS = 5
"""Every answer has this many digits."""


def _split_of(expression: str) -> str:
    bucket = hashlib.sha256(expression.encode()).digest()[0] % 10
    return "test" if bucket < 2 else "train"


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def arithmetic_problems(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` problems of the split: rows ``{"id", "prompt", "answer", "expression"}``.

    Every problem of a layout has the same digit counts and every answer has ``ANSWER_DIGITS`` digits,
    so copying numbers (question -> code, tool output -> answer) is a constant-offset copy that a tiny
    model learns in minutes; computing the answer without the tool stays out of its reach.

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
        template, fn, digits = _TEMPLATES[rng.randrange(len(_TEMPLATES))]
        a, b, c = (_number(rng, d) for d in digits)
        answer = fn(a, b, c)
        expression = template.format(a=a, b=b, c=c)
        if len(str(answer)) != ANSWER_DIGITS or expression in seen or _split_of(expression) != split:
            continue
        seen.add(expression)
        rows.append(
            {
                "id": f"{split}-{seed}-{len(rows)}",
                "prompt": f"What is {expression}?",
                "answer": str(answer),
                "expression": expression,
            }
        )
    return rows


def bundled_problems(
    task: str, n: int, *, seed: int = 0, split: str = "train", task_kwargs: str | dict | None = None
) -> list[dict]:
    """``n`` problems of a task's split, for its embedded default's cold start: ``arithmetic``
    (:func:`arithmetic_problems`), ``lookup`` (:func:`retool.lookup.lookup_problems`) or ``reasoning_gym`` (the
    datasets ``task_kwargs`` names, :func:`retool.reasoning_gym_task.reasoning_gym_problems`, each row with the
    ``expression`` its entry's metadata holds).

    Raises:
        ValueError: an unknown task (naming the known ones), split or size; a reasoning-gym entry without an
            ``expression`` (naming its dataset: no cold start can write its code).
    """
    if task == "arithmetic":
        return arithmetic_problems(n, seed=seed, split=split)
    if task == "lookup":
        from retool.lookup import lookup_problems

        return lookup_problems(n, seed=seed, split=split)
    if task == "reasoning_gym":
        from retool.reasoning_gym_task import no_expression_refusal, parse_task_kwargs, reasoning_gym_problems

        rows = reasoning_gym_problems(parse_task_kwargs(task_kwargs or {}), n, seed=seed, split=split)
        for row in rows:
            expression = row["metadata"].get("expression")
            if not isinstance(expression, str) or not expression.strip():
                raise ValueError(no_expression_refusal([row["metadata"].get("source_dataset")]))
            row["expression"] = expression
        return rows
    raise ValueError(
        f"no task {task!r} with an embedded default; the tasks are 'arithmetic', 'lookup' and 'reasoning_gym'."
    )
