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

import logging
import re
from functools import cached_property, lru_cache
from typing import Any, Sequence

from trl_plugins.rollout.chat.checks import TemplateChecks
from trl_plugins.rollout.chat.vocab import (
    _ARG,
    _OPTIONS,
    _T,
    ChatTemplateError,
    ParsedTurn,
    ToolTurn,
    TurnKind,
    _encode,
    _first_difference,
    tokenizer_digest,
)
from trl_plugins.tools.base import check_arguments, valid_text
from trl_plugins.types import TokenSource

__all__ = ["ChatFormat"]

logger = logging.getLogger(__name__)


def _observed(sources: Sequence[TokenSource]) -> int:
    return sum(s == TokenSource.OBSERVATION for s in sources)


class ChatFormat(TemplateChecks):
    """Token-in, token-out turn building and parsing for one tokenizer and chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template that supports tool messages.
        tools: Tool schemas shown to the model (OpenAI function format).
        final_answer_pattern: Regex that marks a final answer in a turn without a tool call (e.g. ``r"\\\\boxed\\{"``);
            such a turn that does not match it is ``NO_TOOL_CALL``. None (the default): every turn without a
            tool call is the final answer.
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
        final_answer_pattern: str | None = None,
        check_prefix: bool = True,
        stop_tokens: Sequence[str] | None = None,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.template_kwargs = template_kwargs
        self.final_answer_re = re.compile(final_answer_pattern) if final_answer_pattern is not None else None
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
        return next(iter(self._schemas), "probe_tool")  # only renders the template's own probes when no tool is configured

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

        The template renders the tool message with the output; everything from the stop token ending the call to
        the next generation prompt is tokenised as one piece, control-token text inside the output as plain text.
        Closing tokens the sampler already produced are not repeated. Code points no tokenizer can encode (a lone
        surrogate) become U+FFFD first (:func:`~trl_plugins.tools.base.valid_text`). With ``max_tokens``, the
        output's tokens as they reach the model (OBSERVATION tokens: after the template escaped or trimmed it, with
        control-token text spelled out) are at most ``max_tokens``: a longer output keeps its tail behind a marker.
        """
        name = tool_name or self._tool_name()
        text = valid_text(output)
        ids, sources = self._rendered_turn(name, text)
        truncated = max_tokens is not None and _observed(sources) > max_tokens
        if truncated:
            ids, sources = self._cut_to_budget(name, text, max_tokens, _observed(sources))
        k = 0
        for n in range(min(len(ids), len(completion_ids)), 0, -1):
            if tuple(completion_ids[-n:]) == tuple(ids[:n]) and all(s == TokenSource.GLUE for s in sources[:n]):
                k = n
                break
        return ToolTurn(ids[k:], sources[k:], truncated)

    def _rendered_turn(self, name: str, text: str) -> tuple[list[int], list[TokenSource]]:
        """The whole tool turn after a call to ``name`` that returned ``text``, tokenised, with its provenance."""
        start, placeholder, before, after = self._layout(name)
        rendered = self._render(self._call_messages(name) + [self._tool_message(name, text)], add_generation_prompt=True)
        glue = rendered[start:]
        # The output as the template wrote it: what differs from the placeholder rendering.
        lo = min(_first_difference(glue, placeholder), before)
        hi = len(glue) - min(_first_difference(glue[::-1], placeholder[::-1]), after)
        return self._tokenize_turn(glue, lo, max(hi, lo))

    def _cut_to_budget(self, name: str, text: str, max_tokens: int, full: int) -> tuple[list[int], list[TokenSource]]:
        """The tool turn whose output is the longest tail of ``text`` (behind a marker saying it was cut) that the
        template renders in at most ``max_tokens`` OBSERVATION tokens; ``full`` is what the whole output took.

        Counted on the rendered turn, not on the output alone: control-token text (``<|im_end|>``: one token as a
        token, ~7 spelled out) and a template's escaping (JSON's ``\\n``) change how many tokens reach the model.
        """
        # A marker tells the model output was cut; it may take at most a quarter of the budget.
        markers = [m for m in (f"[... {full - max_tokens} earlier tokens cut ...]\n", "[...]\n")
                   if len(_encode(self.tokenizer, m)) <= max_tokens // 4] + [""]
        for marker in markers:
            turn = self._rendered_turn(name, marker)
            if _observed(turn[1]) <= max_tokens:
                break
        fitting: dict[int, tuple[list[int], list[TokenSource]]] = {len(text): turn}

        def fits(at: int) -> bool:
            candidate = self._rendered_turn(name, marker + text[at:])
            if _observed(candidate[1]) <= max_tokens:
                fitting[at] = candidate
            return at in fitting

        # The tail kept is text[hi:], hi the smallest start found to fit: from the start the token rate of the whole
        # output suggests, a bracket widened by doubling steps, then bisected (the whole text never fits: lo = 0).
        guess = max(1, len(text) - len(text) * (max_tokens - _observed(turn[1])) // full)
        step = max(1, (len(text) - guess) // 8)
        if fits(guess):
            hi, lo = guess, max(0, guess - step)
            while lo > 0 and fits(lo):
                hi, step = lo, step * 2
                lo = max(0, lo - step)
        else:
            lo, hi = guess, min(len(text), guess + step)
            while hi < len(text) and not fits(hi):
                lo, step = hi, step * 2
                hi = min(len(text), hi + step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return fitting[hi]

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
            final = self.final_answer_re is None or self.final_answer_re.search(content) is not None
            kind = TurnKind.FINAL_ANSWER if final else TurnKind.NO_TOOL_CALL
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
