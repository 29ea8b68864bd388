"""Token-in, token-out (TITO) multi-turn chat: the next prompt is built from tokens, never re-rendered.

A turn's prompt for turn ``i + 1`` is ``prompt_i + sampled_i + tool turn``: the tokens the sampler
actually produced, then the *tool turn*: what the chat template itself renders after such a call (the
closing of the assistant turn, the tool message with the output as the template writes it, trimmed or
JSON-encoded if that is what it does (a message per call, in the order of the calls, for a turn with parallel
calls), and the next generation prompt), tokenised as one piece, so that
tokens merging across the output's edges (Qwen's ``\\n\\n``) come out as the template's tokenisation
makes them. A closing token the sampler already produced (``<|im_end|>``) is not appended again:
sampled, it is an ACTION and is trained; appended by us, it is GLUE and is not. The one deliberate
difference from the template: content is text. The text of an added token (control tokens such as ``<|im_end|>``,
markup such as ``<tool_call>`` or ``<think>``) written inside a message's content, on every path (the first prompt, a
conversation rendered afresh, the messages that continue one, tool output), is tokenised as plain text; only the markup
the template writes itself becomes those tokens.

Re-rendering the history with the template instead would re-tokenise what the model wrote: a
different token sequence than the one sampled, so the stored behaviour log-probs would score the
wrong tokens. :class:`ChatFormat` checks at construction, with the template's own rendering of a
three-turn tool conversation, that this incremental path reproduces the template token for token, and
refuses the template (saying why and what to use instead) where it cannot.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any, Sequence

from trl_plugins.rollout.chat.checks import TemplateChecks
from trl_plugins.rollout.chat.marks import MARKS, escape, map_texts, texts_of, unmark
from trl_plugins.rollout.chat.parsing import TurnParsing
from trl_plugins.rollout.chat.vocab import (
    ARG_SENTINEL,
    ASSISTANT_SENTINEL,
    TEMPLATE_OPTIONS,
    ChatTemplateError,
    ToolTurn,
    encode_text,
    first_difference,
    placeholder_outputs,
    tokenizer_digest,
)
from trl_plugins.tools.base import valid_text
from trl_plugins.types import TokenSource

__all__ = ["ChatFormat"]

logger = logging.getLogger(__name__)


TAIL_CHARS = 16_384
TAIL_CHARS_PER_TOKEN = 32
"""The tail of a long tool output that its cut to ``max_tokens`` examines first (:meth:`ChatFormat.tool_results_turn`):
the larger of ``TAIL_CHARS`` characters and ``TAIL_CHARS_PER_TOKEN`` per token of ``max_tokens``. A tail that does not
fit whole holds the longest tail that does; text usually takes 2-6 characters a token, and a tail that fits whole (a
tokenizer that packs more) is widened until it does not."""


_PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
"""What a format without tools checks its template with (an exact template is exact whatever the tool)."""


class ChatFormat(TemplateChecks, TurnParsing):
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
            renders after a tool call that it never renders inside one (``<|im_end|>``, ``<|observation|>``,
            ``<|call|>``, ``<|eot_id|>``, ``<tool_call|>``: found by probing a call to every tool, whatever the
            tokenizer flags as special), and the one it renders after a final answer.
        calls_per_turn: The most tool calls of one turn the rollout runs (parallel calls). Above 1, the start-up
            check also replays a conversation whose call turns make that many calls each (the template's own
            rendering of them, parsed back and followed token for token), and refuses a template that cannot.
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
        calls_per_turn: int = 1,
        **template_kwargs: Any,
    ) -> None:
        if isinstance(calls_per_turn, bool) or not isinstance(calls_per_turn, int) or calls_per_turn < 1:
            raise ValueError(f"calls_per_turn must be an int >= 1, got {calls_per_turn!r}.")
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
        self._special = sorted(
            {t.content for t in decoder.values() if getattr(t, "special", False)} | set(tokenizer.all_special_tokens),
            key=len,
            reverse=True,
        )
        self._check_renders_tools()
        self._ensure_response_parser()
        self._derive_stops(stop_tokens)
        self.reasoning = self._generation_prompt_leaves_reasoning_open()
        self.notes: list[str] = []
        """What the start-up check accepted with a caveat (also logged)."""
        self.calls_per_turn = calls_per_turn
        """The most calls of one turn the rollout may run; above 1 checked at construction (with ``check_prefix``)."""
        if check_prefix and not self.tools:  # nothing to call: the template is checked with a probe tool instead
            ChatFormat(
                tokenizer,
                [_PROBE_SCHEMA],
                final_answer_pattern=final_answer_pattern,
                stop_tokens=self.stop_tokens,
                calls_per_turn=calls_per_turn,
                **template_kwargs,
            )
        elif check_prefix:
            self._check_exact()
            if calls_per_turn > 1:
                self._check_parallel_calls(calls_per_turn)

    def for_tools(self, tools: Sequence[dict]) -> "ChatFormat":
        """This format with other tool schemas: the same tokenizer, template arguments, final-answer pattern, stop
        tokens and calls per turn, checked against the template as at construction (itself when the tools are its
        own). Built once per tool set and kept: a run's agents send the same tools at every step."""
        if list(tools) == self.tools:
            return self
        import json

        key = json.dumps(list(tools), sort_keys=True)
        cache = self.__dict__.setdefault("_for_tools", {})
        if key not in cache:
            cache[key] = ChatFormat(
                self.tokenizer,
                tools,
                final_answer_pattern=self.final_answer_re.pattern if self.final_answer_re else None,
                stop_tokens=self.stop_tokens,
                calls_per_turn=self.calls_per_turn,
                **self.template_kwargs,
            )
        return cache[key]

    # -- rendering ----------------------------------------------------------------------------

    def _render(self, messages: list[dict], *, add_generation_prompt: bool, tools: Any = None, **overrides: Any) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **{**self.template_kwargs, **overrides},
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            roles = " -> ".join(m["role"] for m in messages)
            raise ChatTemplateError(
                f"the chat template cannot render a tool conversation ({roles}): {type(exc).__name__}: {exc}. "
                f"It does not support tool turns the way this rollout uses them. " + TEMPLATE_OPTIONS
            ) from exc

    def renders_alike(self, a: list[dict], b: list[dict]) -> bool:
        """Whether the template renders two conversations (with this format's tools, a generation prompt after) to
        the same text: e.g. whether it shows an earlier assistant turn's reasoning at all."""
        tools = list(self.tools) or None
        return self._render(a, add_generation_prompt=True, tools=tools) == self._render(
            b, add_generation_prompt=True, tools=tools
        )

    @staticmethod
    def _call(name: str, arguments: dict, k: int = 0) -> dict:
        return {"type": "function", "id": f"call_{k}", "function": {"name": name, "arguments": arguments}}

    @staticmethod
    def _tool_message(name: str, content: str, k: int = 0) -> dict:
        return {"role": "tool", "name": name, "tool_call_id": f"call_{k}", "content": content}

    def _tool_name(self) -> str:
        return next(
            iter(self._schemas), "probe_tool"
        )  # only renders the template's own probes when no tool is configured

    def _arg_key(self, name: str) -> str:
        params = self._schemas.get(name, {}).get("function", {}).get("parameters") or {}
        return next(iter(params.get("required") or params.get("properties") or ["code"]))

    def _sample_arguments(self, name: str, k: int) -> dict[str, Any]:
        """Arguments that fit ``name``'s schema (every required property, of its type), different for each ``k``."""
        params = self._schemas.get(name, {}).get("function", {}).get("parameters") or {}
        props = params.get("properties") or {}
        samples = {"integer": k + 6, "number": k + 0.5, "boolean": k % 2 == 0, "array": [k, 7], "object": {"n": k}}
        keys = list(params.get("required") or []) or list(props)[:1] or ["code"]
        return {key: samples.get((props.get(key) or {}).get("type"), f"print({k} * 7)") for key in keys}

    def _call_messages(self, *names: str) -> list[dict]:
        """A question and an assistant turn calling each of ``names`` (in one turn) with the argument placeholder."""
        calls = [self._call(name, {self._arg_key(name): ARG_SENTINEL}, k) for k, name in enumerate(names)]
        return [{"role": "user", "content": "question"}, {"role": "assistant", "content": "", "tool_calls": calls}]

    def _first_special(self, text: str, start: int, strings: Sequence[str]) -> tuple[int, str] | None:
        hits = [(at, s) for s in strings if (at := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    # -- prompts -----------------------------------------------------------------------------

    def initial_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Render the first prompt (system/user messages + tool schemas + generation prompt) and tokenise it, the
        messages' text as text.

        Content is text: the text of every added token written in a message (control tokens such as
        ``<|im_end|>\\n<|im_start|>assistant`` and markup such as ``<tool_call>`` or ``<think>``, in a question, a
        system prompt, a tool output, an assistant message's content, reasoning or call arguments) is spelled out, as
        :meth:`tool_results_turn` and :meth:`messages_turn` spell it out: only the template's own markup becomes those
        tokens, so a message cannot open a turn nobody wrote nor write markup the template did not. The text written
        is kept as written; a conversation without such text tokenises exactly as
        ``apply_chat_template(..., tokenize=True)`` does. One exception, the template's: where it reads markup from
        an assistant message's text (Qwen3 takes the reasoning from ``<think>...</think>`` in the content and
        renders it as its own markup, or drops it), that message's markup is the template's input, rendered and
        tokenised as the template does; its control-token text still stays text.
        """
        kwargs = dict(tools=self.tools or None, add_generation_prompt=True, **self.template_kwargs)
        pattern = self._control_re
        if pattern is None or not any(pattern.search(t) for m in messages for t in texts_of(m)):
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        # Each added token's text in the messages is rendered between two private-use marks, which tell where the
        # template put it; the rendering without the marks must be the template's own. Else the template read some
        # of it: an assistant message's markup is left to it (its control-token text still marked); else escaped.
        start, end = next(pair for pair in MARKS if pair[0] not in rendered and pair[1] not in rendered)
        special = self._special_pattern()
        for assistant in (pattern, special):
            marked = [
                map_texts(
                    m,
                    lambda t, p=(assistant if m.get("role") == "assistant" else pattern): (
                        p.sub(f"{start}\\g<0>{end}", t) if p else t
                    ),
                )
                for m in messages
            ]
            unmarked = unmark(self.tokenizer.apply_chat_template(marked, tokenize=False, **kwargs), start, end)
            if unmarked is not None and unmarked[0] == rendered:
                return self._tokenize_turn(*unmarked)[0]
        escaped = [map_texts(m, lambda t: escape(pattern, t)) for m in messages]
        return list(self.tokenizer.apply_chat_template(escaped, tokenize=True, return_dict=False, **kwargs))

    def _special_pattern(self) -> re.Pattern | None:
        """The added tokens the tokenizer flags special (control tokens), longest first."""
        if "_special_re" not in self.__dict__:
            added = self.tokenizer.get_added_vocab()
            strings = [s for s in self._special if s in added]  # already longest first
            self._special_re = re.compile("|".join(map(re.escape, strings))) if strings else None
        return self._special_re

    def _rendering(self, names: tuple[str, ...], outputs: Sequence[str]) -> str:
        messages = self._call_messages(*names) + [
            self._tool_message(n, o, k) for k, (n, o) in enumerate(zip(names, outputs))
        ]
        return self._render(messages, add_generation_prompt=True)

    @lru_cache(maxsize=64)  # noqa: B019 - one ChatFormat per run; the cache is per (self, tool names)
    def _turn_start(self, names: tuple[str, ...]) -> int:
        """Where the tool turn starts in the rendering of a turn calling ``names``: at the stop token ending the
        calls."""
        rendered = self._rendering(names, placeholder_outputs(len(names)))
        return rendered.index(
            self._call_stop,
            rendered.rindex(ARG_SENTINEL, 0, rendered.index(placeholder_outputs(len(names))[0])) + len(ARG_SENTINEL),
        )

    @lru_cache(maxsize=64)  # noqa: B019 - one ChatFormat per run; the cache is per (self, tool names)
    def _placeholder_glue(self, names: tuple[str, ...]) -> str:
        return self._glue(names, placeholder_outputs(len(names)))

    def _glue(self, names: tuple[str, ...], outputs: Sequence[str]) -> str:
        """The template's rendering after a turn calling ``names`` whose tool messages hold ``outputs``, from the stop
        token ending the calls to the next generation prompt."""
        return self._rendering(names, outputs)[self._turn_start(names) :]

    def tool_turn(
        self,
        completion_ids: Sequence[int],
        output: str,
        *,
        tool_name: str | None = None,
        arguments: dict | None = None,
        max_tokens: int | None = None,
    ) -> ToolTurn:
        """The tokens to append after a sampled completion that called ``tool_name`` and got ``output``: the one-call
        case of :meth:`tool_results_turn`."""
        return self.tool_results_turn(completion_ids, [(tool_name or self._tool_name(), output)], max_tokens=max_tokens)

    def tool_results_turn(
        self, completion_ids: Sequence[int], results: Sequence[tuple[str, str]], *, max_tokens: int | None = None
    ) -> ToolTurn:
        """The tokens to append after a sampled completion whose calls (one, or several in one turn) returned
        ``results``: ``(tool name, output)`` per call, in the order of the calls.

        The template renders a tool message per call, in that order, each with its output; everything from the stop
        token ending the calls to the next generation prompt is tokenised as one piece, control-token text inside
        the outputs as plain text. Closing tokens the sampler already produced are not repeated. Code points no
        tokenizer can encode (a lone surrogate) become U+FFFD first (:func:`~trl_plugins.tools.base.valid_text`).
        With ``max_tokens``, each output's tokens as they reach the model (its OBSERVATION tokens: after the
        template escaped or trimmed it, with control-token text spelled out) are at most ``max_tokens``: a longer
        output keeps its tail behind a marker saying how many tokens were cut. Of an output longer than
        :data:`TAIL_CHARS` and ``max_tokens *`` :data:`TAIL_CHARS_PER_TOKEN` characters only that tail is rendered and
        tokenised (widened while it fits whole), so the work is bounded by the budget, not by the output; its marker
        counts the characters cut instead (the tokens of a part never tokenised are not known).
        """
        names = tuple(name for name, _ in results)
        whole = [valid_text(output) for _, output in results]
        texts = list(whole)
        if max_tokens is not None:  # only a tail can reach the model: the rest is never rendered nor tokenised
            bound = max(TAIL_CHARS, max_tokens * TAIL_CHARS_PER_TOKEN)
            texts = [text if len(text) <= bound else text[-bound:] for text in whole]
        ids, sources, counts = self._rendered_turn(names, texts)
        for k in range(len(texts)):  # a tail that fits whole may not be the longest that fits: widen it
            while len(texts[k]) < len(whole[k]) and counts[k] <= max_tokens:
                texts[k] = whole[k][-4 * len(texts[k]) :]
                ids, sources, counts = self._rendered_turn(names, texts)
        cut = [False] * len(texts)
        while max_tokens is not None and any(c > max_tokens for c in counts):
            k = next(k for k, c in enumerate(counts) if c > max_tokens)
            before = len(whole[k]) - len(texts[k])
            texts[k] = self._cut_to_budget(names, texts, k, max_tokens, counts[k], before=before if before else None)
            cut[k] = True
            ids, sources, counts = self._rendered_turn(names, texts)
        k = 0
        for n in range(min(len(ids), len(completion_ids)), 0, -1):
            if tuple(completion_ids[-n:]) == tuple(ids[:n]) and all(s == TokenSource.GLUE for s in sources[:n]):
                k = n
                break
        return ToolTurn(ids[k:], sources[k:], any(cut), tuple(cut))

    def messages_turn(
        self,
        completion_ids: Sequence[int],
        called: Sequence[str],
        messages: Sequence[dict],
        *,
        max_tokens: int | None = None,
    ) -> ToolTurn:
        """The tokens to append after a sampled completion (which called the tools ``called``, in order; none for a
        plain reply) when the conversation goes on with ``messages``: tool results, user or system messages, each a
        chat message whose ``content`` is a string (a tool message also names its tool).

        When ``messages`` are exactly one tool message per call, in the order of the calls, this is
        :meth:`tool_results_turn` (``max_tokens`` applies to each output). Otherwise the template's own rendering of
        ``messages`` after such a turn, from the stop token that ends it to the next generation prompt, is tokenised
        as one piece: each message's content OBSERVATION (control-token text as plain text), the template's markup
        GLUE; ``max_tokens`` is not applied there (the trajectory's token budget still is).

        Raises:
            ChatTemplateError: the template renders no stop token between the turn and the messages.
        """
        if (
            called
            and len(messages) == len(called)
            and all(m.get("role") == "tool" and m.get("name") == n for m, n in zip(messages, called))
        ):
            return self.tool_results_turn(
                completion_ids, [(n, m.get("content") or "") for n, m in zip(called, messages)], max_tokens=max_tokens
            )
        if called:
            probe, anchor = self._call_messages(*called), ARG_SENTINEL
        else:
            probe, anchor = (
                [{"role": "user", "content": "question"}, {"role": "assistant", "content": ASSISTANT_SENTINEL}],
                ASSISTANT_SENTINEL,
            )
        slots = placeholder_outputs(len(messages))
        texts = [valid_text(m.get("content") or "") for m in messages]

        def render(contents: Sequence[str]) -> str:
            return self._render(
                probe + [{**m, "content": c} for m, c in zip(messages, contents)], add_generation_prompt=True
            )

        previous = render(slots)
        first = previous.index(slots[0])
        hit = self._first_special(previous, previous.rindex(anchor, 0, first) + len(anchor), self.stop_tokens)
        if hit is None or hit[0] > first:
            raise ChatTemplateError(
                f"the chat template renders no stop token ({', '.join(self.stop_tokens)}) between an "
                f"assistant turn and the messages after it, so they cannot continue its tokens."
            )
        start = hit[0]
        current, regions = list(slots), []
        for k, text in enumerate(texts):  # as in _rendered_turn: each content's region is where filling it in changed
            at = previous.index(current[k])
            after = len(previous) - at - len(current[k])
            current[k] = text
            rendered = render(current)
            lo = min(first_difference(rendered, previous), at)
            hi = len(rendered) - min(first_difference(rendered[::-1], previous[::-1]), after)
            regions.append((lo - start, max(hi, lo) - start))
            previous = rendered
        ids, sources, _ = self._tokenize_turn(previous[start:], regions)
        k = 0
        for n in range(min(len(ids), len(completion_ids)), 0, -1):
            if tuple(completion_ids[-n:]) == tuple(ids[:n]) and all(s == TokenSource.GLUE for s in sources[:n]):
                k = n
                break
        return ToolTurn(ids[k:], sources[k:], False, tuple(False for _ in messages))

    def _rendered_turn(
        self, names: tuple[str, ...], texts: Sequence[str]
    ) -> tuple[list[int], list[TokenSource], list[int]]:
        """The whole tool turn after calls to ``names`` that returned ``texts``, tokenised, with its provenance and
        each output's OBSERVATION tokens.

        Where each output sits is found one output at a time: the rendering with outputs ``0..k`` filled in and the
        rest placeholders differs from the one with ``0..k-1`` filled in only around output ``k`` (what the template
        wrote for it, trimmed or escaped), so text an output shares with the template's markup cannot confuse it.
        """
        current = list(placeholder_outputs(len(names)))
        previous = self._placeholder_glue(names)
        regions = []
        for k, text in enumerate(texts):
            at = previous.index(current[k])
            after = len(previous) - at - len(current[k])
            current[k] = text
            glue = self._glue(names, current)
            lo = min(first_difference(glue, previous), at)
            hi = len(glue) - min(first_difference(glue[::-1], previous[::-1]), after)
            regions.append((lo, max(hi, lo)))
            previous = glue
        ids, sources, owners = self._tokenize_turn(previous, regions)
        counts = [0] * len(texts)
        for src, owner in zip(sources, owners):
            if src == TokenSource.OBSERVATION:
                counts[owner] += 1
        return ids, sources, counts

    def _cut_to_budget(
        self,
        names: tuple[str, ...],
        texts: Sequence[str],
        k: int,
        max_tokens: int,
        full: int,
        before: int | None = None,
    ) -> str:
        """The longest tail of ``texts[k]`` (behind a marker saying it was cut) that the template renders in at most
        ``max_tokens`` OBSERVATION tokens in this tool turn; ``full`` is what ``texts[k]`` took. With ``before`` (how
        many characters of the output precede ``texts[k]``, never tokenised) the marker counts characters cut.

        Counted on the rendered turn, not on the output alone: control-token text (``<|im_end|>``: one token as a
        token, ~7 spelled out) and a template's escaping (JSON's ``\\n``) change how many tokens reach the model.
        """
        text = texts[k]

        def count(candidate: str) -> int:
            return self._rendered_turn(names, [*texts[:k], candidate, *texts[k + 1 :]])[2][k]

        def counted(at: int) -> str:
            return f"[... {(before or 0) + at} earlier characters cut ...]\n"

        # A marker tells the model output was cut; it may take at most a quarter of the budget. Counting characters,
        # its number is known once the cut is: the search runs with the largest it can be, then it is set.
        first = counted(len(text)) if before is not None else f"[... {full - max_tokens} earlier tokens cut ...]\n"
        markers = [m for m in (first, "[...]\n") if len(encode_text(self.tokenizer, m)) <= max_tokens // 4] + [""]
        marker = next(m for m in markers if not m or count(m) <= max_tokens)
        fitting = {len(text)}

        def fits(at: int) -> bool:
            if at not in fitting and count(marker + text[at:]) <= max_tokens:
                fitting.add(at)
            return at in fitting

        # The tail kept is text[hi:], hi the smallest start found to fit: from the start the token rate of the whole
        # output suggests, a bracket widened by doubling steps, then bisected (the whole text never fits: lo = 0).
        guess = max(1, len(text) - len(text) * max_tokens // full)
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
        if before is not None and marker == first:
            while hi < len(text) and count(counted(hi) + text[hi:]) > max_tokens:
                hi += 1
            marker = counted(hi)
        return marker + text[hi:]

    def _tokenize_turn(
        self, text: str, regions: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[TokenSource], list[int]]:
        """Tokenise ``text`` as one piece, except that control-token text inside the output ``regions`` (``[lo, hi)``,
        in order) is split. Returns the ids, their provenance and, per token, the region it holds output of (-1:
        none)."""
        cuts = [0]
        for lo, hi in regions:
            for m in self._control_re.finditer(text, lo, hi) if self._control_re else ():
                cuts += [m.start(), m.start() + 1]
        cuts.append(len(text))
        ids: list[int] = []
        sources: list[TokenSource] = []
        owners: list[int] = []
        for a, b in zip(cuts, cuts[1:]):
            if a == b:
                continue
            enc = self.tokenizer(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
            for tid, (s, e) in zip(enc["input_ids"], enc["offset_mapping"]):
                ids.append(tid)
                owner = next((r for r, (lo, hi) in enumerate(regions) if a + s < hi and a + e > lo), -1)
                owners.append(owner)
                sources.append(TokenSource.OBSERVATION if owner >= 0 else TokenSource.GLUE)
        leaked = any(src == TokenSource.OBSERVATION and t in self._control_ids for t, src in zip(ids, sources))
        if leaked:  # a tokenizer that re-forms control tokens from pieces: escape the text instead
            pieces, escaped, end = [], [], 0
            for lo, hi in regions:
                inner = self._control_re.sub(lambda m: m.group(0).replace("<", "< "), text[lo:hi])
                pieces.append(text[end:lo])
                start = sum(map(len, pieces))
                pieces.append(inner)
                escaped.append((start, start + len(inner)))
                end = hi
            pieces.append(text[end:])
            return self._tokenize_turn("".join(pieces), escaped)
        return ids, sources, owners
