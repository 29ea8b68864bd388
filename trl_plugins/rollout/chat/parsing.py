"""Reading an assistant turn back (mixed into :class:`~trl_plugins.rollout.chat.ChatFormat`): the template's response
parser, checked against how the template writes the calls it parsed, so that no text a parser skipped is lost."""

from __future__ import annotations

import re
from functools import cached_property, lru_cache
from typing import Any, Sequence

from trl_plugins.rollout.chat.vocab import ParsedCall, ParsedTurn, TurnKind, first_difference, placeholder_outputs
from trl_plugins.tools.base import check_arguments

__all__ = ["TurnParsing"]


class TurnParsing:
    """Parsing of sampled turns (mixed into ``ChatFormat``, whose rendering it uses)."""

    @lru_cache(maxsize=4096)  # noqa: B019 - a handful of distinct calls repeat across a group
    def _canonical_call(self, calls_json: str) -> str:
        """How the template writes the calls ``[[name, arguments], ...]`` of one turn (up to the stop token that ends
        them), whitespace removed."""
        import json

        calls = json.loads(calls_json)
        names = tuple(name for name, _ in calls)
        placeholders = placeholder_outputs(len(calls))
        messages = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": "", "tool_calls": [self._call(n, a, k) for k, (n, a) in enumerate(calls)]},
            *[self._tool_message(n, p, k) for k, (n, p) in enumerate(zip(names, placeholders))],
        ]
        rendered = self._render(messages, add_generation_prompt=True)
        start = first_difference(rendered, self._generation_prompt_text)
        end = rendered.index(placeholders[0])
        stop = rendered.rfind(self._call_stop, start, end)
        call = rendered[start : stop if stop >= 0 else end]
        marker = self._call_marker
        return re.sub(r"\s+", "", call[call.find(marker) :] if marker and marker in call else call)

    @cached_property
    def _generation_prompt_text(self) -> str:
        """The rendering of one user question and the generation prompt."""
        return self._render([{"role": "user", "content": "question"}], add_generation_prompt=True)

    @cached_property
    def _call_marker(self) -> str:
        """The text that opens a call (``<tool_call>``, ``<|tool_call>call:``, ``{"name": "``)."""
        name = self._tool_name()
        rendered = self._render(self._call_messages(name), add_generation_prompt=False)
        start = first_difference(rendered, self._generation_prompt_text)
        segment = rendered[start : rendered.index(name, start)]
        added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        hits = [(segment.rfind(s), s) for s in added if s in segment]  # the control token nearest the name
        return max(hits)[1] if hits else segment.strip()

    def parse(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> ParsedTurn:
        """Classify an assistant turn: valid tool calls (one, or several in one turn), a final answer, no call, or
        invalid.

        Calls are valid only if each names a known tool with arguments that fit its schema, the template writes the
        parsed calls as the turn wrote them (whitespace aside; one call may also be a JSON object with its keys in
        another order) and nothing but stop tokens follows them: text a parser skipped or cut short (an argument
        ended at the first ``)``, text after the call) makes the turn invalid, never silently lost. How many calls
        a turn may make is the rollout's to decide (``max_tool_calls_per_turn``).
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
        reasoning = parsed.get("reasoning_content")
        reasoning = reasoning if isinstance(reasoning, str) else ""
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
            return ParsedTurn(kind, content=content, reasoning=reasoning)
        # The model wrote the JSON: a call may be any value (5, null, a list), a name any type.
        checked: list[ParsedCall] = []
        for call in calls:
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return ParsedTurn(
                    TurnKind.INVALID,
                    content=content,
                    error=f"malformed tool call: {call!r:.80} is not an object with a string name",
                )
            name, arguments = fn.get("name"), fn.get("arguments")
            if name not in self._schemas:
                known = ", ".join(self._schemas) or "none"
                return ParsedTurn(
                    TurnKind.INVALID, content=content, tool_name=name, error=f"unknown tool {name!r} (tools: {known})"
                )
            problem = check_arguments(self._schemas[name], arguments)
            if problem:
                return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=problem)
            checked.append(ParsedCall(name, dict(arguments)))
        for stop in self.stop_tokens:
            bare = bare.removesuffix(stop)
        canonical = self._canonical_call(json.dumps([[c.name, c.arguments] for c in checked], sort_keys=True))
        name, arguments = checked[0].name, checked[0].arguments
        single = len(checked) == 1 and self._json_call_accounts_for(text, name, arguments)
        if not bare.endswith(canonical) and not single:
            at = bare.rfind(canonical[: max(1, len(canonical) // 2)])
            written = ", ".join(f"{c.name}({json.dumps(c.arguments)})" for c in checked)
            what = (
                "text after the tool call"
                if canonical in bare
                else "the call as written does not read back as parsed (the parser left part of it unaccounted "
                f"for: it understood {written}, which the template writes as "
                f"{canonical[:120]!r}{' at ' + str(at) if at >= 0 else ''})"
            )
            return ParsedTurn(TurnKind.INVALID, content=content, tool_name=name, error=what)
        return ParsedTurn(
            TurnKind.TOOL_CALL, content=content, tool_name=name, arguments=arguments, calls=checked, reasoning=reasoning
        )

    def _json_call_accounts_for(self, text: str, name: str, arguments: Any) -> bool:
        """Whether the call, from its opening marker on, is one JSON object holding exactly the parsed call
        (keys in another order or other spacing than the template's), followed only by markup tokens."""
        import json

        marker = self._call_marker
        at = text.rfind(marker) if marker else -1
        if at < 0:
            return False
        body = text[at + len(marker) :] if marker in self.tokenizer.get_added_vocab() else text[at:]
        start = body.find("{")
        if start < 0 or body[:start].strip():
            return False
        try:
            obj, end = json.JSONDecoder().raw_decode(body[start:])
        except ValueError:
            return False
        rest = body[start + end :]
        if self._control_re is not None:
            rest = self._control_re.sub("", rest)
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        return not rest.strip() and obj.get("name") == name and args == arguments
