"""Token-in, token-out (TITO) multi-turn chat: the next prompt is built from tokens, never re-rendered.

A turn's prompt for turn ``i + 1`` is ``prompt_i + sampled_i + glue + observation + glue``: the tokens the
sampler actually produced, then the chat template's own tokens that close the assistant turn and open
the tool message, the (sanitised, tail-truncated) tool output, and the tokens that close the tool
message and open the next assistant turn. The glue is derived once per template by rendering
placeholder conversations. A closing token the sampler already produced (``<|im_end|>``) is not
appended again: sampled, it is an ACTION and is trained; appended by us, it is GLUE and is not.

Re-rendering the history with the template instead would re-tokenise what the model wrote: a
different token sequence than the one sampled, so the stored behaviour log-probs would score the
wrong tokens.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from trl_plugins.tools.base import check_arguments
from trl_plugins.types import TokenSource

__all__ = [
    "ChatTemplateError",
    "TurnKind",
    "ParsedTurn",
    "ToolTurnFormat",
    "ChatFormat",
    "derive_tool_turn_format",
    "check_prefix_preserving",
    "tokenizer_digest",
]

_A = "ASSISTANT_SENTINEL_7f3a"
_T = "TOOL_SENTINEL_9c2e"


class ChatTemplateError(ValueError):
    """The chat template cannot be used for token-in, token-out tool turns; says why and what to do."""


class TurnKind(enum.StrEnum):
    """What an assistant turn did."""

    TOOL_CALL = "tool_call"
    """Exactly one well-formed call to a known tool, and nothing after it."""
    FINAL_ANSWER = "final_answer"
    """No tool call, and the text matches the final-answer pattern."""
    NO_TOOL_CALL = "no_tool_call"
    """No tool call and no final answer."""
    INVALID = "invalid"
    """A malformed call, several calls, text after the call, an unknown tool or bad arguments."""


@dataclass
class ParsedTurn:
    """The parse of one assistant turn."""

    kind: TurnKind
    """What the turn did."""
    content: str = ""
    """Text content (without tool calls and reasoning)."""
    tool_name: str | None = None
    """Tool called, for TOOL_CALL (and for INVALID when a name was readable)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Parsed arguments, for TOOL_CALL."""
    error: str | None = None
    """Why the turn is INVALID."""


@dataclass(frozen=True)
class ToolTurnFormat:
    """Token ids the chat template puts around a tool response."""

    assistant_end_ids: tuple[int, ...]
    """Tokens closing an assistant turn (Qwen: ``<|im_end|>``, ``\\n``)."""
    tool_open_ids: tuple[int, ...]
    """Tokens opening the tool message, before its content (Qwen2.5: ``<|im_start|>user\\n<tool_response>\\n``)."""
    tool_close_ids: tuple[int, ...]
    """Tokens closing the tool message and opening the next assistant turn (the generation prompt)."""


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the vocabulary, added tokens and chat template: what a trajectory must match."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


def _render(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool, tools=None, **kwargs) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except (TemplateError, TypeError) as exc:
        roles = " -> ".join(m["role"] for m in messages)
        raise ChatTemplateError(
            f"the chat template cannot render a tool conversation ({roles}): {type(exc).__name__}: {exc}. "
            f"It does not support tool turns the way this rollout uses them. " + _OPTIONS
        ) from exc


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_OPTIONS = (
    "Options: (1) use a template that renders history verbatim, e.g. TRL's patched training template "
    "(`from trl.chat_template_utils import get_training_chat_template; tokenizer.chat_template = "
    "get_training_chat_template(tokenizer)`); (2) pass check_prefix=False and build datums with "
    "on_prefix_mismatch='split' (each consistent run of turns trains separately); (3) supply your own "
    "chat template."
)


def derive_tool_turn_format(tokenizer: Any, **template_kwargs) -> ToolTurnFormat:
    """Derive the glue around a tool response by rendering placeholder conversations.

    Raises:
        ChatTemplateError: the template drops tool messages or does not extend the rendered history
            when a tool message is added.
    """
    # The placeholder turn carries reasoning: some templates (Qwen3) add an empty think block to the
    # last assistant turn only, which would look like a history rewrite.
    base = [{"role": "user", "content": "question"}, {"role": "assistant", "content": f"<think>\nhmm\n</think>\n\n{_A}"}]
    r1 = _render(tokenizer, base, add_generation_prompt=False, **template_kwargs)
    r2 = _render(tokenizer, base + [{"role": "tool", "content": _T}], add_generation_prompt=True, **template_kwargs)
    if _A not in r1 or _T not in r2:
        raise ChatTemplateError(
            "the chat template does not render an assistant message followed by a tool message (the "
            "placeholder text is missing from its output): it does not support tool turns. " + _OPTIONS
        )
    if not r2.startswith(r1):
        k = next((i for i, (a, b) in enumerate(zip(r1, r2)) if a != b), min(len(r1), len(r2)))
        raise ChatTemplateError(
            "the chat template is not prefix-preserving for tool turns: adding a tool message changes how "
            f"the earlier conversation renders (first difference at character {k}: {r1[k:k + 40]!r} became "
            f"{r2[k:k + 40]!r}). " + _OPTIONS
        )
    end_text = r1[r1.index(_A) + len(_A):]
    tail = r2[len(r1):]
    open_text, close_text = tail.split(_T, 1)
    return ToolTurnFormat(
        assistant_end_ids=tuple(_encode(tokenizer, end_text)),
        tool_open_ids=tuple(_encode(tokenizer, open_text)),
        tool_close_ids=tuple(_encode(tokenizer, close_text)),
    )


def check_prefix_preserving(tokenizer: Any, tools: list[dict] | None = None, **template_kwargs) -> None:
    """Check that a multi-turn tool conversation renders as a strict extension, turn after turn.

    Renders question -> assistant (reasoning + tool call) -> tool -> assistant (reasoning + tool call) ->
    tool -> assistant (reasoning + answer) from structured messages, and requires each rendering to
    start with the previous one: the generation prompt must be a prefix of the assistant turn it opens,
    and adding a tool message must not change how the earlier turns render. A template that strips
    earlier reasoning or re-renders earlier tool calls fails: a model trained on our token-in,
    token-out sequences would then see different text at inference.

    Raises:
        ChatTemplateError: naming the step, the first differing text, and the options.
    """
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}}
    turns = [
        {"role": "assistant", "reasoning_content": "first I compute", "content": "Let me run it.", "tool_calls": [call]},
        {"role": "assistant", "reasoning_content": "then I check", "content": "Once more.", "tool_calls": [call]},
        {"role": "assistant", "reasoning_content": "so it is 42", "content": "The answer is \\boxed{42}."},
    ]

    def fail(step: str, before: str, after: str) -> ChatTemplateError:
        k = next((j for j, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        return ChatTemplateError(
            f"the chat template is not prefix-preserving for tool turns: {step} (first difference at character "
            f"{k}: {before[k:k + 40]!r} became {after[k:k + 40]!r}; e.g. it strips earlier reasoning or rewrites "
            f"earlier tool calls). " + _OPTIONS
        )

    messages: list[dict] = [{"role": "user", "content": "What is 6 * 7?"}]
    prev = _render(tokenizer, messages, add_generation_prompt=True, tools=tools, **template_kwargs)
    for i, turn in enumerate(turns):
        messages.append(turn)
        full = _render(tokenizer, messages, add_generation_prompt=False, tools=tools, **template_kwargs)
        if not full.startswith(prev):
            raise fail(f"assistant turn {i} does not start with the generation prompt before it", prev, full)
        if i == len(turns) - 1:
            break
        messages.append({"role": "tool", "content": "42"})
        nxt = _render(tokenizer, messages, add_generation_prompt=True, tools=tools, **template_kwargs)
        if not nxt.startswith(full):
            raise fail(f"adding tool message {i} changes how the conversation before it renders", full, nxt)
        prev = nxt


class ChatFormat:
    """Token-in, token-out turn building and parsing for one tokenizer and chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template that supports tool messages.
        tools: Tool schemas shown to the model (OpenAI function format).
        final_answer_pattern: Regex that marks a final answer in a turn without tool calls.
        check_prefix: Run :func:`check_prefix_preserving` at construction.
        template_kwargs: Extra ``apply_chat_template`` arguments (e.g. ``enable_thinking=False``).

    Raises:
        ChatTemplateError: at construction, when the template cannot be used (with the options).
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict] = (),
        *,
        final_answer_pattern: str = r"\\boxed\{",
        check_prefix: bool = True,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template_kwargs = template_kwargs
        self.final_answer_re = re.compile(final_answer_pattern)
        self.format = derive_tool_turn_format(tokenizer, **template_kwargs)
        if check_prefix:
            check_prefix_preserving(tokenizer, self.tools or None, **template_kwargs)
        self._ensure_response_parser()
        self.digest = tokenizer_digest(tokenizer)
        stop = {tokenizer.eos_token_id}
        if self.format.assistant_end_ids:
            stop.add(self.format.assistant_end_ids[0])
        self.stop_token_ids = sorted(i for i in stop if i is not None)
        added = tokenizer.get_added_vocab()
        self._control_ids = set(added.values()) | set(tokenizer.all_special_ids)
        # Longest first, so that "</tool_call>" is matched before any shorter overlapping token.
        strings = sorted(added, key=len, reverse=True)
        self._control_re = re.compile("|".join(re.escape(s) for s in strings)) if strings else None
        self._schemas = {s["function"]["name"]: s for s in self.tools}

    def _ensure_response_parser(self) -> None:
        tok = self.tokenizer
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            from trl.chat_template_utils import add_response_schema

            try:
                add_response_schema(tok)
            except ValueError as exc:
                raise ChatTemplateError(
                    "no tool-call parser is known for this chat template (TRL recognises templates by exact "
                    "string match). Set tokenizer.response_template (see the transformers docs on response "
                    f"parsing) or use one of the templates in trl/chat_templates/. TRL said: {exc}"
                ) from exc
        template = getattr(tok, "response_template", None) or {}
        calls = (template.get("fields") or {}).get("tool_calls", {})
        self._call_open = calls.get("open", "<tool_call>")
        close = calls.get("close_pattern")
        self._call_close_at_end = re.compile(f"(?:{close})\\s*\\Z") if close else None

    # -- prompts -----------------------------------------------------------------------------

    def initial_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Render the first prompt (system/user messages + tool schemas + generation prompt)."""
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools or None,
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
                **self.template_kwargs,
            )
        )

    def encode_observation(self, text: str, max_tokens: int | None = None) -> tuple[list[int], bool]:
        """Tokenise tool output so it cannot contain a control token; keep the tail if too long.

        Every occurrence of a special or added token's text (``<|im_end|>``, ``</tool_response>``, ...) is
        tokenised as plain text, so tool output cannot close its message or forge a turn.

        Returns:
            ``(ids, truncated)``.
        """
        ids: list[int] = []
        pos = 0
        for m in self._control_re.finditer(text) if self._control_re else ():
            ids += _encode(self.tokenizer, text[pos : m.start()])
            s = m.group(0)
            ids += _encode(self.tokenizer, s[:1]) + _encode(self.tokenizer, s[1:])
            pos = m.end()
        ids += _encode(self.tokenizer, text[pos:])
        leaked = [i for i in ids if i in self._control_ids]
        if leaked:  # a tokenizer that re-forms control tokens from pieces: escape the text instead
            return self.encode_observation(self._control_re.sub(lambda m: m.group(0).replace("<", "< "), text), max_tokens)
        if max_tokens is None or len(ids) <= max_tokens:
            return ids, False
        # A marker tells the model output was cut; it may take at most a quarter of the budget.
        marker: list[int] = []
        for text_marker in (f"[... {len(ids) - max_tokens} earlier tokens cut ...]\n", "[...]\n"):
            candidate = _encode(self.tokenizer, text_marker)
            if len(candidate) <= max_tokens // 4:
                marker = candidate
                break
        keep = max_tokens - len(marker)
        return marker + ids[len(ids) - keep :], True

    def tool_turn_glue(
        self, completion_ids: Sequence[int], observation_ids: Sequence[int]
    ) -> tuple[list[int], list[TokenSource]]:
        """The tokens to append after a sampled completion that made a tool call, with provenance.

        Closing tokens the sampler already produced are not repeated: the longest suffix of the
        completion that is a prefix of the template's assistant-end tokens is skipped.
        """
        end = self.format.assistant_end_ids
        k = 0
        for n in range(min(len(end), len(completion_ids)), 0, -1):
            if tuple(completion_ids[-n:]) == end[:n]:
                k = n
                break
        glue_end = list(end[k:])
        ids = glue_end + list(self.format.tool_open_ids) + list(observation_ids) + list(self.format.tool_close_ids)
        sources = (
            [TokenSource.GLUE] * (len(glue_end) + len(self.format.tool_open_ids))
            + [TokenSource.OBSERVATION] * len(observation_ids)
            + [TokenSource.GLUE] * len(self.format.tool_close_ids)
        )
        return ids, sources

    # -- parsing ------------------------------------------------------------------------------

    def parse(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> ParsedTurn:
        """Classify an assistant turn: one valid tool call, a final answer, no call, or invalid."""
        tok = self.tokenizer
        text = tok.decode(list(completion_ids), skip_special_tokens=False)
        for stop in self.stop_token_ids:
            text = text.removesuffix(tok.convert_ids_to_tokens(stop))
        try:
            parsed = tok.parse_response(list(completion_ids), prefix=list(prompt_ids))
        except (ValueError, TypeError) as exc:
            return ParsedTurn(TurnKind.INVALID, content=text, error=f"malformed tool call: {exc}")
        if parsed is None:
            return ParsedTurn(TurnKind.INVALID, content=text, error="the turn could not be parsed")
        content = parsed.get("content") or ""
        calls = parsed.get("tool_calls") or []
        if not calls:
            if self._call_open in text:
                return ParsedTurn(TurnKind.INVALID, content=content, error="an unterminated tool call")
            kind = TurnKind.FINAL_ANSWER if self.final_answer_re.search(content) else TurnKind.NO_TOOL_CALL
            return ParsedTurn(kind, content=content)
        if len(calls) > 1:
            return ParsedTurn(TurnKind.INVALID, content=content, error=f"{len(calls)} tool calls; make one per turn")
        fn = calls[0].get("function", calls[0])
        name, arguments = fn.get("name"), fn.get("arguments")
        if self._call_close_at_end is not None and not self._call_close_at_end.search(text):
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error="text after the tool call")
        if name not in self._schemas:
            known = ", ".join(self._schemas) or "none"
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=f"unknown tool {name!r} (tools: {known})")
        problem = check_arguments(self._schemas[name], arguments)
        if problem:
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=problem)
        return ParsedTurn(TurnKind.TOOL_CALL, content=content, tool_name=name, arguments=dict(arguments))
