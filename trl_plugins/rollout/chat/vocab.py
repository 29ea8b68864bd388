"""What token-in, token-out chat exchanges: the error a template gets, what a parsed turn did, the tokens of a
tool turn, the tokenizer digest, and the probes the template checks render."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from trl_plugins.types import TokenSource

__all__ = ["ChatTemplateError", "TurnKind", "ParsedCall", "ParsedTurn", "ToolTurn", "tokenizer_digest"]

ASSISTANT_SENTINEL = "ASSISTANT_SENTINEL_7f3a"
TOOL_SENTINEL = "TOOL_SENTINEL_9c2e"
ARG_SENTINEL = "ARG_SENTINEL_5d1b"


class ChatTemplateError(ValueError):
    """The chat template cannot be used for token-in, token-out tool turns; says why and what to do."""


class TurnKind(enum.StrEnum):
    """What an assistant turn did."""

    TOOL_CALL = "tool_call"
    """Well-formed calls to known tools (one, or several in one turn), and nothing after them."""
    FINAL_ANSWER = "final_answer"
    """No tool call, and the text matches the final-answer pattern (any text when there is none)."""
    NO_TOOL_CALL = "no_tool_call"
    """No tool call and no final answer."""
    INVALID = "invalid"
    """A malformed call, text after the call, an unknown tool or bad arguments."""


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed call of an assistant turn."""

    name: str
    """The tool called."""
    arguments: dict[str, Any]
    """Its parsed arguments (they fit the tool's schema)."""


@dataclass
class ParsedTurn:
    """The parse of one assistant turn."""

    kind: TurnKind
    """What the turn did."""
    content: str = ""
    """Text content (without tool calls and reasoning)."""
    tool_name: str | None = None
    """Tool called, for TOOL_CALL (the first call's; and for INVALID when a name was readable)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Parsed arguments, for TOOL_CALL (the first call's)."""
    calls: list[ParsedCall] = field(default_factory=list)
    """Every call of a TOOL_CALL turn, in the order written."""
    reasoning: str = ""
    """The turn's reasoning (a ``<think>`` block), as the template's response parser separates it; empty if none."""
    error: str | None = None
    """Why the turn is INVALID."""


@dataclass(frozen=True)
class ToolTurn:
    """The tokens appended after a sampled tool-call turn, with their provenance."""

    ids: list[int]
    """Closing glue the sampler did not produce, the tool message, the next generation prompt."""
    sources: list[TokenSource]
    """GLUE, or OBSERVATION for tokens holding tool output (a token straddling both is OBSERVATION)."""
    truncated: bool
    """An output was cut to its tail."""
    truncated_outputs: tuple[bool, ...] = ()
    """Per call of the turn, in order: whether its output was cut to its tail."""


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the vocabulary, added tokens and chat template: what a trajectory must match."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def placeholder_outputs(n: int) -> tuple[str, ...]:
    """A placeholder output per call of a turn with ``n`` calls, none a prefix of another."""
    return (TOOL_SENTINEL,) if n == 1 else tuple(f"{TOOL_SENTINEL}_{k}_" for k in range(n))


def first_difference(a: Sequence, b: Sequence) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


TEMPLATE_OPTIONS = (
    "Options: (1) use a chat template that renders tool turns and keeps the history verbatim (TRL's "
    "`_training` templates do: `from trl.chat_template_utils import get_training_chat_template; "
    "tokenizer.chat_template = get_training_chat_template(tokenizer)`, or one of the templates listed as exact "
    "in docs/rollout.md); (2) supply your own chat template; (3) only when you drive the rollout yourself (not "
    "through the trainer): ChatFormat(..., check_prefix=False) and build_datum(..., on_prefix_mismatch='split') "
    "(each consistent run of turns trains separately)."
)
