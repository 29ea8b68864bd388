"""Added-token text (control tokens, markup) in chat messages, for
:meth:`~trl_plugins.rollout.chat.format.ChatFormat.initial_prompt_ids`: the text strings of a message, a way to mark
where the template puts them, and an escape for when it cannot be told."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

__all__ = ["MARKS", "texts_of", "map_texts", "escape", "unmark"]


MARKS = tuple((chr(0xE000 + 2 * k), chr(0xE001 + 2 * k)) for k in range(256))
"""Private-use character pairs that mark added-token text in messages while the template renders them (the first
pair the rendering does not hold)."""
_NOT_TEXT = frozenset({"role", "name", "tool_call_id", "id", "type"})
"""Message keys whose values are names and ids, not text: never spelled out."""


def texts_of(value: Any, key: str | None = None) -> Iterator[str]:
    """The text strings in a message (content, reasoning, tool-call arguments), not its names and ids."""
    if key in _NOT_TEXT:
        return
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from texts_of(v, k)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from texts_of(v)


def map_texts(value: Any, fn: Callable[[str], str], key: str | None = None) -> Any:
    """``value`` with ``fn`` applied to each of its :func:`texts_of`."""
    if key in _NOT_TEXT:
        return value
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_texts(v, fn, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_texts(v, fn) for v in value]
    return value


def escape(pattern: re.Pattern, text: str) -> str:
    """``text`` with a space after the first character of each match of ``pattern`` (a few rounds: a space inserted
    can complete an overlapping match)."""
    for _ in range(4):
        text, n = pattern.subn(
            lambda m: m.group(0)[:1] + " " + m.group(0)[1:] if len(m.group(0)) > 1 else m.group(0), text
        )
        if not n:
            break
    return text


def unmark(text: str, start: str, end: str) -> tuple[str, list[tuple[int, int]]] | None:
    """``text`` without the marks, and where the marked spans lie in it; None when the marks do not pair up."""
    out: list[str] = []
    regions: list[tuple[int, int]] = []
    at = size = 0
    while (lo := text.find(start, at)) >= 0:
        hi = text.find(end, lo + 1)
        if hi < 0 or end in text[at:lo] or start in text[lo + 1 : hi]:
            return None
        out += [text[at:lo], text[lo + 1 : hi]]
        size += lo - at
        regions.append((size, size + hi - lo - 1))
        size += hi - lo - 1
        at = hi + 1
    if end in text[at:]:
        return None
    out.append(text[at:])
    return "".join(out), regions
