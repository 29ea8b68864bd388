"""Stop strings (the OpenAI API's ``stop``), token-exact: a turn ends at the first sampled token whose text completes
one. That token stays as sampled even where it straddles the stop (the trajectory holds exactly the tokens sampled,
none after); the text handed back is cut before the stop, as the OpenAI API cuts it. Backends that can end a turn
there (``stop_strings = True``: HF ``generate``, vLLM) save the tokens after it; the endpoint cuts every sample at
the stop either way, so a backend without it (continuous batching, a scripted policy) gives the same tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["StopStrings"]


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings and the tokenizer's ``decode`` they are matched in."""

    strings: tuple[str, ...]
    decode: Callable[[Sequence[int]], str]
    """Token ids to the text they are matched in (the reply's text: special tokens skipped)."""

    def first(self, text: str) -> int:
        """Where the earliest stop begins in ``text``; -1 when none occurs."""
        found = [at for at in (text.find(x) for x in self.strings) if at >= 0]
        return min(found) if found else -1

    def hit(self, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids`` holds a stop."""
        return self.first(self.decode(ids)) >= 0

    def cut(self, ids: Sequence[int], text: str | None = None) -> tuple[int, int] | None:
        """``(k, at)``: token ``k`` is the first whose prefix ``ids[:k + 1]`` holds a stop, which begins at character
        ``at`` of that prefix's text; None when no stop occurs. ``text`` is ``decode(ids)`` where the caller has it:
        no stop there (the usual case) costs nothing more, else a binary search decodes ~``log2(len(ids))``
        prefixes."""
        if not self.strings or self.first(self.decode(ids) if text is None else text) < 0:
            return None
        lo, hi = 0, len(ids) - 1  # ids[:hi + 1] holds a stop; the shortest such prefix is wanted
        while lo < hi:
            mid = (lo + hi) // 2
            if self.hit(ids[: mid + 1]):
                hi = mid
            else:
                lo = mid + 1
        return lo, self.first(self.decode(ids[: lo + 1]))
