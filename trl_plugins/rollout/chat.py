"""Token-in, token-out (TITO) multi-turn chat: the next prompt is built from tokens, never re-rendered.

A turn's prompt for turn ``i + 1`` is ``prompt_i + sampled_i + tool turn``: the tokens the sampler
actually produced, then the *tool turn*: what the chat template itself renders after such a call (the
closing of the assistant turn, the tool message with the output as the template writes it, trimmed or
JSON-encoded if that is what it does, and the next generation prompt), tokenised as one piece, so that
tokens merging across the output's edges (Qwen's ``\\n\\n``) come out as the template's tokenisation
makes them. A closing token the sampler already produced (``<|im_end|>``) is not appended again:
sampled, it is an ACTION and is trained; appended by us, it is GLUE and is not. The one deliberate
difference from the template: control-token text inside tool output is tokenised as plain text.

Re-rendering the history with the template instead would re-tokenise what the model wrote: a
different token sequence than the one sampled, so the stored behaviour log-probs would score the
wrong tokens. :class:`ChatFormat` checks at construction, with the template's own rendering of a
three-turn tool conversation, that this incremental path reproduces the template token for token, and
refuses the template (saying why and what to use instead) where it cannot.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Sequence

from trl_plugins.tools.base import check_arguments
from trl_plugins.types import TokenSource

logger = logging.getLogger(__name__)

__all__ = [
    "ChatTemplateError",
    "TurnKind",
    "ParsedTurn",
    "ToolTurn",
    "ChatFormat",
    "tokenizer_digest",
]

_A = "ASSISTANT_SENTINEL_7f3a"
_T = "TOOL_SENTINEL_9c2e"
_ARG = "ARG_SENTINEL_5d1b"


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
class ToolTurn:
    """The tokens appended after a sampled tool-call turn, with their provenance."""

    ids: list[int]
    """Closing glue the sampler did not produce, the tool message, the next generation prompt."""
    sources: list[TokenSource]
    """GLUE, or OBSERVATION for tokens holding tool output (a token straddling both is OBSERVATION)."""
    truncated: bool
    """The output was cut to its tail."""


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over the vocabulary, added tokens and chat template: what a trajectory must match."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:16]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_OPTIONS = (
    "Options: (1) use a chat template that renders tool turns and keeps the history verbatim (TRL's "
    "`_training` templates do: `from trl.chat_template_utils import get_training_chat_template; "
    "tokenizer.chat_template = get_training_chat_template(tokenizer)`, or one of the templates listed as exact "
    "in docs/rollout.md); (2) supply your own chat template; (3) only when you drive the rollout yourself (not "
    "through the trainer): ChatFormat(..., check_prefix=False) and build_datum(..., on_prefix_mismatch='split') "
    "(each consistent run of turns trains separately)."
)


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@lru_cache(maxsize=None)
def _training_originals() -> dict[str, str]:
    """TRL's ``_training`` templates -> the original template whose response parser they share."""
    from trl import chat_template_utils as ctu

    out = {}
    for attr in dir(ctu):
        if attr.endswith("_training_chat_template"):
            original = getattr(ctu, attr.replace("_training_chat_template", "_chat_template"), None)
            if isinstance(original, str):
                out[getattr(ctu, attr)] = original
    return out


def _training_alternative(tokenizer: Any, tools: Sequence[dict], template_kwargs: dict) -> str:
    """A sentence naming TRL's training variant of this template, when there is one that passes."""
    try:
        from trl.chat_template_utils import get_training_chat_template

        patched = get_training_chat_template(tokenizer)
    except Exception:  # noqa: BLE001 - no variant known; the generic options follow
        return ""
    if not patched or patched == tokenizer.chat_template:
        return ""
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = patched
        ChatFormat(tokenizer, tools, **template_kwargs)
    except ChatTemplateError:
        return ""
    finally:
        tokenizer.chat_template = original
    return ("TRL's training variant of this template passes this check: `tokenizer.chat_template = "
            "trl.chat_template_utils.get_training_chat_template(tokenizer)`. ")


class ChatFormat:
    """Token-in, token-out turn building and parsing for one tokenizer and chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template that supports tool messages.
        tools: Tool schemas shown to the model (OpenAI function format).
        final_answer_pattern: Regex that marks a final answer in a turn without tool calls.
        check_prefix: Check at construction that the incremental path reproduces the template's own
            rendering of a three-turn tool conversation token for token (refusing a template that
            rewrites history); ``False`` skips that check.
        stop_tokens: Token strings that end a turn. Default: eos, the first control token the template
            renders after a tool call (``<|im_end|>``, ``<|observation|>``, ``<|call|>``, ``<|eot_id|>``,
            ``<tool_call|>``) and the one it renders after a final answer.
        template_kwargs: Extra ``apply_chat_template`` arguments (e.g. ``enable_thinking=False``).

    Raises:
        ChatTemplateError: at construction, when the template cannot be used: says why and what to use.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict] = (),
        *,
        final_answer_pattern: str = r"\\boxed\{",
        check_prefix: bool = True,
        stop_tokens: Sequence[str] | None = None,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template_kwargs = template_kwargs
        self.final_answer_re = re.compile(final_answer_pattern)
        self._schemas = {s["function"]["name"]: s for s in self.tools}
        self.digest = tokenizer_digest(tokenizer)
        added = tokenizer.get_added_vocab()
        self._control_ids = set(added.values()) | set(tokenizer.all_special_ids)
        # Longest first, so that "</tool_call>" is matched before any shorter overlapping token.
        strings = sorted(added, key=len, reverse=True)
        self._control_re = re.compile("|".join(re.escape(s) for s in strings)) if strings else None
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special = sorted({t.content for t in decoder.values() if getattr(t, "special", False)}
                               | set(tokenizer.all_special_tokens), key=len, reverse=True)
        self._check_renders_tools()
        self._ensure_response_parser()
        self._derive_stops(stop_tokens)
        self.reasoning = self._generation_prompt_leaves_reasoning_open()
        self.notes: list[str] = []
        """What the start-up check accepted with a caveat (also logged)."""
        if check_prefix:
            self._check_exact()

    # -- rendering ----------------------------------------------------------------------------

    def _render(self, messages: list[dict], *, add_generation_prompt: bool, tools: Any = None, **overrides: Any) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **{**self.template_kwargs, **overrides}
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            roles = " -> ".join(m["role"] for m in messages)
            raise ChatTemplateError(
                f"the chat template cannot render a tool conversation ({roles}): {type(exc).__name__}: {exc}. "
                f"It does not support tool turns the way this rollout uses them. " + _OPTIONS
            ) from exc

    @staticmethod
    def _call(name: str, arguments: dict) -> dict:
        return {"type": "function", "id": "call_0", "function": {"name": name, "arguments": arguments}}

    @staticmethod
    def _tool_message(name: str, content: str) -> dict:
        return {"role": "tool", "name": name, "tool_call_id": "call_0", "content": content}

    def _tool_name(self) -> str:
        return next(iter(self._schemas), "code_interpreter")

    def _arg_key(self, name: str) -> str:
        params = (self._schemas.get(name, {}).get("function", {}).get("parameters") or {})
        return next(iter(params.get("required") or params.get("properties") or ["code"]))

    def _sample_arguments(self, name: str, k: int) -> dict[str, Any]:
        """Arguments that fit ``name``'s schema (every required property, of its type), different for each ``k``."""
        params = (self._schemas.get(name, {}).get("function", {}).get("parameters") or {})
        props = params.get("properties") or {}
        samples = {"integer": k + 6, "number": k + 0.5, "boolean": k % 2 == 0, "array": [k, 7], "object": {"n": k}}
        keys = list(params.get("required") or []) or list(props)[:1] or ["code"]
        return {key: samples.get((props.get(key) or {}).get("type"), f"print({k} * 7)") for key in keys}

    def _call_messages(self, name: str) -> list[dict]:
        """A question and an assistant turn calling ``name`` with the argument placeholder."""
        return [{"role": "user", "content": "question"},
                {"role": "assistant", "content": "", "tool_calls": [self._call(name, {self._arg_key(name): _ARG})]}]

    def _first_special(self, text: str, start: int, strings: Sequence[str]) -> tuple[int, str] | None:
        hits = [(at, s) for s in strings if (at := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    # -- start-up checks ----------------------------------------------------------------------

    def _ensure_response_parser(self) -> None:
        tok = self.tokenizer
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            from types import SimpleNamespace

            from trl.chat_template_utils import add_response_schema

            original = _training_originals().get(tok.chat_template)
            try:
                if original is not None:  # a TRL training template parses like the original it patches
                    probe = SimpleNamespace(chat_template=original)
                    add_response_schema(probe)
                    for attr in ("response_template", "response_schema"):
                        if getattr(probe, attr, None) is not None:
                            setattr(tok, attr, getattr(probe, attr))
                else:
                    add_response_schema(tok)
            except ValueError as exc:
                raise ChatTemplateError(
                    "no tool-call parser is known for this chat template (TRL recognises templates by exact "
                    "string match, and this one is not among those it can parse tool calls for). Set "
                    "tokenizer.response_template (see the transformers docs on response parsing) or use one of "
                    f"the templates listed as exact in docs/rollout.md. TRL said: {exc}"
                ) from exc

    def _check_renders_tools(self) -> None:
        """The template must show the tool schemas and render structured calls (some drop them silently)."""
        if self.tools:
            prompt = self._render([{"role": "user", "content": "question"}], add_generation_prompt=True, tools=self.tools)
            missing = [n for n in self._schemas if n not in prompt]
            if missing:
                raise ChatTemplateError(
                    f"the chat template does not show the tool schemas to the model: the tool name(s) {missing} "
                    f"are missing from the rendered prompt, so the model is never told what it can call. " + _OPTIONS
                )
        name = self._tool_name()
        text = self._render(self._call_messages(name), add_generation_prompt=False)
        if _ARG not in text or name not in text:
            raise ChatTemplateError(
                f"the chat template drops structured tool calls: an assistant message calling {name!r} renders "
                f"without the call, so the history a deployed model sees would not hold its own calls. " + _OPTIONS
            )

    def _derive_stops(self, stop_tokens: Sequence[str] | None) -> None:
        tok = self.tokenizer
        name = self._tool_name()
        rendered = self._render(self._call_messages(name) + [self._tool_message(name, _T)], add_generation_prompt=True)
        if _T not in rendered:
            raise ChatTemplateError(
                "the chat template does not render a tool message after an assistant tool call (the tool output "
                "is missing from its output): it does not support tool turns. " + _OPTIONS
            )
        if stop_tokens is not None:
            bad = [s for s in stop_tokens if len(_encode(tok, s)) != 1]
            if bad or not stop_tokens:
                raise ChatTemplateError(f"stop_tokens must be single tokens of this tokenizer; {bad or 'none given'} "
                                        f"are not (each must encode to exactly one id).")
            stops = list(stop_tokens)
            call_candidates = stops
        else:
            stops, call_candidates = [], self._special
        self._final_stop = None
        hit = self._first_special(rendered, rendered.index(_ARG) + len(_ARG), call_candidates)
        if hit is None or hit[0] > rendered.index(_T):
            raise ChatTemplateError(
                "the chat template ends a tool-call turn without a control token"
                + (" from stop_tokens" if stop_tokens is not None else "")
                + f" (after the call it renders {rendered[rendered.index(_ARG) + len(_ARG):rendered.index(_T)]!r} "
                f"before the tool output), so generation cannot stop at the end of a call. Pass "
                f"stop_tokens=[...] naming the token that ends a call turn, or use another template. " + _OPTIONS
            )
        self._call_stop = hit[1]
        if stop_tokens is None:
            # What closes a final answer: as the last message, else (GLM renders nothing there) as the
            # template closes it when the user speaks next.
            answer = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _A}]
            end = None
            for messages in (answer, answer + [{"role": "user", "content": "next"}]):
                final = self._render(messages, add_generation_prompt=False)
                end = self._first_special(final, final.index(_A) + len(_A), self._special) if _A in final else None
                if end:
                    break
            self._final_stop = end[1] if end else None
            stops = [self._call_stop] + ([end[1]] if end else []) + ([tok.eos_token] if tok.eos_token else [])
        self.stop_tokens = list(dict.fromkeys(stops))
        """Token strings that end a turn."""
        self.stop_token_ids = sorted({tok.convert_tokens_to_ids(s) for s in self.stop_tokens})
        """Their ids (what a backend stops on)."""

    def _generation_prompt_leaves_reasoning_open(self) -> bool:
        """Whether the model reasons before it answers, as far as the template tells.

        False where the template does not render reasoning at all, where thinking is switched off
        (``enable_thinking=False`` passed, or the template's default when it is not), or where the
        generation prompt itself closes an empty reasoning block.
        """
        probe = [{"role": "user", "content": "question"},
                 {"role": "assistant", "content": _A, "reasoning_content": _T, "thinking": _T}]
        if _T not in self._render(probe, add_generation_prompt=False):
            return False
        if "enable_thinking" in str(self.tokenizer.chat_template or ""):
            user = [{"role": "user", "content": "question"}]
            if "enable_thinking" in self.template_kwargs:
                if not self.template_kwargs["enable_thinking"]:
                    return False
            else:
                off = self._render(user, add_generation_prompt=True, enable_thinking=False)
                on = self._render(user, add_generation_prompt=True, enable_thinking=True)
                if self._generation_prompt_text == off and off != on:
                    return False
        user = [{"role": "user", "content": "question"}]
        tail = self._generation_prompt_text[len(self._render(user, add_generation_prompt=False)):]
        return not re.search(r"</think>|<channel\|>", tail)

    def _check_exact(self) -> None:
        """The incremental path must reproduce the template's rendering of a real conversation, token for token.

        Assistant turns are taken from the template's own rendering (what a model trained on it writes),
        cut at the first stop token; each must parse back as the call or answer it was, and each next
        prompt (sampled tokens + :meth:`tool_turn`) must equal the template's tokens for the conversation
        so far. A template that reproduces the conversation only when call turns carry no text (it drops
        such text when re-rendering history) is accepted with a note.
        """
        # Reasoning is part of every turn where the model reasons: a template that cannot keep it is refused.
        variants = [(True, self.reasoning), (False, self.reasoning)]
        errors: list[ChatTemplateError] = []
        for with_text, reasoning in variants:
            try:
                self._replay_conversation(with_text=with_text, reasoning=reasoning)
            except ChatTemplateError as exc:
                errors.append(exc)
                continue
            first = errors[0] if errors else None
            if (with_text, reasoning) != variants[0]:
                note = (f"the chat template reproduces tool turns exactly only without text before a tool call: "
                        f"what the model "
                        f"writes there is kept in the trajectory as sampled, but the template renders the history "
                        f"differently (with it: {str(first).removesuffix(' ' + _OPTIONS)})")
                self.notes.append(note)
                logger.warning(note)
            return
        a, b = (str(e).removesuffix(" " + _OPTIONS) for e in errors)
        if a == b:
            raise errors[0]
        raise ChatTemplateError(f"with text before a tool call: {a} Without it: {b} {_OPTIONS}")

    def verify(self, outputs: Sequence[str] = ("42\n", "")) -> None:
        """Replay a conversation whose tool calls return ``outputs`` and check it against the template.

        Each next prompt must equal the template's tokens for the conversation so far; where an output
        holds control-token text (which the template would turn into control tokens) the text must be
        the template's and no observation token may be a control token.

        Raises:
            ChatTemplateError: where the incremental path departs from the template.
        """
        with_text = not any("text before a tool call" in n for n in self.notes)
        self._replay_conversation(with_text=with_text, reasoning=self.reasoning, outputs=outputs)

    def _replay_conversation(self, *, with_text: bool, reasoning: bool, outputs: Sequence[str] = ("42\n", "")) -> None:
        name = self._tool_name()
        reasoning = {"reasoning_content": "I compute it.", "thinking": "I compute it."} if reasoning else {}
        texts = ["Let me run it.", "Once more.", "And again."]
        turns = [({"role": "assistant", "content": texts[k % 3] if with_text else "",
                   "tool_calls": [self._call(name, self._sample_arguments(name, k))], **reasoning}, out)
                 for k, out in enumerate(outputs)]
        turns.append(({"role": "assistant", "content": "The answer is \\boxed{42}.", **reasoning}, None))
        tools = self.tools or None
        messages: list[dict] = [{"role": "user", "content": "What is 6 * 7?"}]
        prompt = self.initial_prompt_ids(messages)
        tok = self.tokenizer

        def show(ids: Sequence[int], k: int) -> str:
            return repr(tok.decode(list(ids[max(0, k - 3):k + 3]), skip_special_tokens=False))

        for i, (turn, output) in enumerate(turns):
            messages.append(turn)
            if output is not None:
                messages.append(self._tool_message(name, output))
            expected = _encode(tok, self._render(messages, add_generation_prompt=output is not None, tools=tools))
            if output is None and self._final_stop and not set(expected[len(prompt):]) & set(self.stop_token_ids):
                # A template that renders nothing after a final answer (GLM): the model ends it with the token
                # that opens the next user turn.
                expected = expected + [tok.convert_tokens_to_ids(self._final_stop)]
            if expected[: len(prompt)] != prompt:
                k = _first_difference(prompt, expected)
                raise ChatTemplateError(
                    f"the chat template is not prefix-preserving for tool turns: after assistant turn {i + 1} it "
                    f"renders the earlier conversation differently (at token {k}: {show(prompt, k)} became "
                    f"{show(expected, k)}; e.g. it strips earlier reasoning or rewrites earlier tool calls), so "
                    f"training sequences would differ from what the template shows the model. "
                    + _training_alternative(tok, self.tools, self.template_kwargs) + _OPTIONS
                )
            end = next((j for j in range(len(prompt), len(expected)) if expected[j] in self.stop_token_ids), None)
            if end is None:
                raise ChatTemplateError(
                    f"the chat template renders assistant turn {i + 1} without any stop token "
                    f"({', '.join(self.stop_tokens)}), so generation would not stop where the template ends the "
                    f"turn. Pass stop_tokens=[...] naming the token that ends a turn. " + _OPTIONS
                )
            completion = expected[len(prompt): end + 1]
            parsed = self.parse(prompt, completion)
            want_args = turn.get("tool_calls", [{}])[0].get("function", {}).get("arguments")
            if output is None:
                ok = parsed.kind == TurnKind.FINAL_ANSWER
            else:
                ok = parsed.kind == TurnKind.TOOL_CALL and parsed.tool_name == name and parsed.arguments == want_args
            if not ok:
                raise ChatTemplateError(
                    f"the tool-call parser for this chat template does not read back the template's own assistant "
                    f"turn {i + 1} ({tok.decode(completion, skip_special_tokens=False)!r} parsed as {parsed.kind}"
                    f"{': ' + parsed.error if parsed.error else ''}). " + _OPTIONS
                )
            if output is None:
                return
            tool_turn = self.tool_turn(completion, output, tool_name=name, arguments=want_args)
            nxt = prompt + completion + tool_turn.ids
            forged = self._control_re is not None and self._control_re.search(output) is not None
            if forged and self._same_text_without_forged_controls(nxt, expected, len(prompt) + len(completion), tool_turn):
                nxt = expected  # the one deliberate difference: control-token text in tool output stays text
            if nxt != expected:
                k = _first_difference(nxt, expected)
                raise ChatTemplateError(
                    f"the tool turn after assistant turn {i + 1} does not tokenise as the template's rendering (at "
                    f"token {k}: {show(nxt, k)} where the template has {show(expected, k)}). " + _OPTIONS
                )
            prompt = nxt

    def _same_text_without_forged_controls(self, ours: list[int], template: list[int], start: int,
                                           turn: ToolTurn) -> bool:
        """Our tool turn reads as the template's text, and none of its observation tokens is a control token."""
        decode = self.tokenizer.decode
        return (ours[:start] == template[:start]
                and decode(ours, skip_special_tokens=False) == decode(template, skip_special_tokens=False)
                and not any(t in self._control_ids for t, src in zip(turn.ids, turn.sources)
                            if src == TokenSource.OBSERVATION))

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

    def _truncate(self, text: str, max_tokens: int | None) -> tuple[str, bool]:
        """Keep the tail of tool output longer than ``max_tokens`` tokens, behind a marker saying so."""
        if max_tokens is None:
            return text, False
        ids = _encode(self.tokenizer, text)
        if len(ids) <= max_tokens:
            return text, False
        # A marker tells the model output was cut; it may take at most a quarter of the budget.
        marker = ""
        for candidate in (f"[... {len(ids) - max_tokens} earlier tokens cut ...]\n", "[...]\n"):
            if len(_encode(self.tokenizer, candidate)) <= max_tokens // 4:
                marker = candidate
                break
        keep = max_tokens - len(_encode(self.tokenizer, marker))
        return marker + self.tokenizer.decode(ids[len(ids) - keep:]), True

    @lru_cache(maxsize=64)  # noqa: B019 - one ChatFormat per run; the cache is per (self, tool name)
    def _layout(self, name: str) -> tuple[int, str, int, int]:
        """Where the tool turn starts in the rendering of a call to ``name``, and the output's edges in it.

        Returns ``(start, placeholder_glue, before, after)``: the tool turn is ``rendering[start:]`` (from
        the stop token ending the call), the placeholder output sits at ``before`` in ``placeholder_glue``
        and ``after`` characters follow it.
        """
        rendered = self._render(self._call_messages(name) + [self._tool_message(name, _T)], add_generation_prompt=True)
        start = rendered.index(self._call_stop, rendered.index(_ARG) + len(_ARG))
        glue = rendered[start:]
        at = glue.index(_T)
        return start, glue, at, len(glue) - at - len(_T)

    def tool_turn(self, completion_ids: Sequence[int], output: str, *, tool_name: str | None = None,
                  arguments: dict | None = None, max_tokens: int | None = None) -> ToolTurn:
        """The tokens to append after a sampled completion that called ``tool_name`` and got ``output``.

        The template renders the tool message with the (tail-truncated) output; everything from the stop
        token ending the call to the next generation prompt is tokenised as one piece, control-token text
        inside the output as plain text. Closing tokens the sampler already produced are not repeated.
        """
        name = tool_name or self._tool_name()
        text, truncated = self._truncate(output, max_tokens)
        start, placeholder, before, after = self._layout(name)
        rendered = self._render(self._call_messages(name) + [self._tool_message(name, text)], add_generation_prompt=True)
        glue = rendered[start:]
        # The output as the template wrote it: what differs from the placeholder rendering.
        lo = min(_first_difference(glue, placeholder), before)
        hi = len(glue) - min(_first_difference(glue[::-1], placeholder[::-1]), after)
        hi = max(hi, lo)
        ids, sources = self._tokenize_turn(glue, lo, hi)
        k = 0
        for n in range(min(len(ids), len(completion_ids)), 0, -1):
            if tuple(completion_ids[-n:]) == tuple(ids[:n]) and all(s == TokenSource.GLUE for s in sources[:n]):
                k = n
                break
        return ToolTurn(ids[k:], sources[k:], truncated)

    def _tokenize_turn(self, text: str, lo: int, hi: int) -> tuple[list[int], list[TokenSource]]:
        """Tokenise ``text`` as one piece, except that control-token text inside ``[lo, hi)`` is split."""
        cuts = [0]
        for m in self._control_re.finditer(text, lo, hi) if self._control_re else ():
            cuts += [m.start(), m.start() + 1]
        cuts.append(len(text))
        ids: list[int] = []
        sources: list[TokenSource] = []
        for a, b in zip(cuts, cuts[1:]):
            if a == b:
                continue
            enc = self.tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
            for tid, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
                ids.append(tid)
                inside = a + s < hi and a + e > lo
                sources.append(TokenSource.OBSERVATION if inside else TokenSource.GLUE)
        leaked = [i for i, (t, src) in enumerate(zip(ids, sources)) if src == TokenSource.OBSERVATION and t in self._control_ids]
        if leaked:  # a tokenizer that re-forms control tokens from pieces: escape the text instead
            inner = self._control_re.sub(lambda m: m.group(0).replace("<", "< "), text[lo:hi])
            return self._tokenize_turn(text[:lo] + inner + text[hi:], lo, lo + len(inner))
        return ids, sources

    # -- parsing ------------------------------------------------------------------------------

    @lru_cache(maxsize=4096)  # noqa: B019 - a handful of distinct calls repeat across a group
    def _canonical_call(self, name: str, arguments_json: str) -> str:
        """How the template writes a call (up to the stop token that ends it), whitespace removed."""
        import json

        arguments = json.loads(arguments_json)
        messages = [{"role": "user", "content": "question"},
                    {"role": "assistant", "content": "", "tool_calls": [self._call(name, arguments)]},
                    self._tool_message(name, _T)]
        rendered = self._render(messages, add_generation_prompt=True)
        start = _first_difference(rendered, self._generation_prompt_text)
        stop = rendered.rfind(self._call_stop, start, rendered.index(_T))
        call = rendered[start:stop if stop >= 0 else rendered.index(_T)]
        marker = self._call_marker
        return re.sub(r"\s+", "", call[call.find(marker):] if marker and marker in call else call)

    @cached_property
    def _generation_prompt_text(self) -> str:
        """The rendering of one user question and the generation prompt."""
        return self._render([{"role": "user", "content": "question"}], add_generation_prompt=True)

    @cached_property
    def _call_marker(self) -> str:
        """The text that opens a call (``<tool_call>``, ``<|tool_call>call:``, ``{"name": "``)."""
        name = self._tool_name()
        rendered = self._render(self._call_messages(name), add_generation_prompt=False)
        start = _first_difference(rendered, self._generation_prompt_text)
        segment = rendered[start:rendered.index(name, start)]
        added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        hits = [(segment.rfind(s), s) for s in added if s in segment]  # the control token nearest the name
        return max(hits)[1] if hits else segment.strip()

    def parse(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> ParsedTurn:
        """Classify an assistant turn: one valid tool call, a final answer, no call, or invalid.

        A call is valid only if the template writes the parsed call as the turn wrote it (whitespace
        aside) and nothing but stop tokens follows it: text a parser skipped or cut short (an argument
        ended at the first ``)``, text after the call) makes the turn invalid, never silently lost.
        """
        import json

        tok = self.tokenizer
        text = tok.decode(list(completion_ids), skip_special_tokens=False)
        try:
            # With the schemas, parsers that write arguments as text (XML parameters) type them.
            parsed = tok.parse_response(list(completion_ids), prefix=list(prompt_ids), tools=self.tools or None)
        except (ValueError, TypeError, KeyError) as exc:
            return ParsedTurn(TurnKind.INVALID, content=text, error=f"malformed tool call: {exc}")
        if parsed is None:
            return ParsedTurn(TurnKind.INVALID, content=text, error="the turn could not be parsed")
        content = parsed.get("content") or ""
        calls = parsed.get("tool_calls") or []
        if not isinstance(calls, list):
            calls = [calls]
        bare = re.sub(r"\s+", "", text)
        if not calls:
            marker = re.sub(r"\s+", "", self._call_marker)
            if marker and marker in bare:
                return ParsedTurn(TurnKind.INVALID, content=content, error="an unterminated or malformed tool call")
            kind = TurnKind.FINAL_ANSWER if self.final_answer_re.search(content) else TurnKind.NO_TOOL_CALL
            return ParsedTurn(kind, content=content)
        if len(calls) > 1:
            return ParsedTurn(TurnKind.INVALID, content=content, error=f"{len(calls)} tool calls; make one per turn")
        # The model wrote the JSON: a call may be any value (5, null, a list), a name any type.
        call = calls[0]
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return ParsedTurn(TurnKind.INVALID, content=content,
                              error=f"malformed tool call: {call!r:.80} is not an object with a string name")
        name, arguments = fn.get("name"), fn.get("arguments")
        if name not in self._schemas:
            known = ", ".join(self._schemas) or "none"
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=f"unknown tool {name!r} (tools: {known})")
        problem = check_arguments(self._schemas[name], arguments)
        if problem:
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=problem)
        for stop in self.stop_tokens:
            bare = bare.removesuffix(stop)
        canonical = self._canonical_call(name, json.dumps(arguments, sort_keys=True))
        if not bare.endswith(canonical) and not self._json_call_accounts_for(text, name, arguments):
            at = bare.rfind(canonical[: max(1, len(canonical) // 2)])
            what = ("text after the tool call" if canonical in bare else
                    "the call as written does not read back as parsed (the parser left part of it unaccounted "
                    f"for: it understood {name}({json.dumps(arguments)}), which the template writes as "
                    f"{canonical[:120]!r}{' at ' + str(at) if at >= 0 else ''})")
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=what)
        return ParsedTurn(TurnKind.TOOL_CALL, content=content, tool_name=name, arguments=dict(arguments))

    def _json_call_accounts_for(self, text: str, name: str, arguments: Any) -> bool:
        """Whether the call, from its opening marker on, is one JSON object holding exactly the parsed call
        (keys in another order or other spacing than the template's), followed only by markup tokens."""
        import json

        marker = self._call_marker
        at = text.rfind(marker) if marker else -1
        if at < 0:
            return False
        body = text[at + len(marker):] if marker in self.tokenizer.get_added_vocab() else text[at:]
        start = body.find("{")
        if start < 0 or body[:start].strip():
            return False
        try:
            obj, end = json.JSONDecoder().raw_decode(body[start:])
        except ValueError:
            return False
        rest = body[start + end:]
        if self._control_re is not None:
            rest = self._control_re.sub("", rest)
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        return not rest.strip() and obj.get("name") == name and args == arguments
