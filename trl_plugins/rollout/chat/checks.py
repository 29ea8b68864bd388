"""The chat template's start-up checks, as a mixin of :class:`~trl_plugins.rollout.chat.format.ChatFormat`: it shows
the tool schemas and renders structured calls, a parser reads its calls back, stop tokens end its turns, and the
incremental token-in, token-out path reproduces its own rendering of a three-turn tool conversation token for
token (else the template is refused, saying why and what to use instead)."""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any, Sequence

from trl_plugins.rollout.chat.vocab import (
    ARG_SENTINEL,
    ASSISTANT_SENTINEL,
    TEMPLATE_OPTIONS,
    TOOL_SENTINEL,
    ChatTemplateError,
    ToolTurn,
    TurnKind,
    encode_text,
    first_difference,
)
from trl_plugins.types import TokenSource

__all__ = ["TemplateChecks"]

logger = logging.getLogger(__name__)


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


@lru_cache(maxsize=None)
def _parser_templates() -> dict[str, str]:
    """Templates TRL has no parser for -> the template whose parser reads their calls.

    A TRL ``_training`` template parses like the original it patches; Diffusion Gemma writes calls, arguments and
    tool responses as Gemma 4 does (its header, ``null`` arguments and reasoning gate differ), so Gemma 4's parser
    reads it. The start-up check judges each: it replays the template's own turns through the parser.
    """
    from trl import chat_template_utils as ctu

    out = dict(_training_originals())
    gemma4 = getattr(ctu, "gemma4_chat_template", None)
    for attr in ("diffusion_gemma_chat_template", "diffusion_gemma_training_chat_template"):
        if isinstance(gemma4, str) and isinstance(getattr(ctu, attr, None), str):
            out[getattr(ctu, attr)] = gemma4
    return out


def _training_alternative(chat_format: Any, tokenizer: Any, tools: Sequence[dict], template_kwargs: dict) -> str:
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
        chat_format(tokenizer, tools, **template_kwargs)
    except ChatTemplateError:
        return ""
    finally:
        tokenizer.chat_template = original
    return (
        "TRL's training variant of this template passes this check: `tokenizer.chat_template = "
        "trl.chat_template_utils.get_training_chat_template(tokenizer)`. "
    )


class TemplateChecks:
    """The start-up checks of a chat format (mixed into ``ChatFormat``, whose rendering and parsing they drive)."""

    def _ensure_response_parser(self) -> None:
        tok = self.tokenizer
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            from types import SimpleNamespace

            from trl.chat_template_utils import add_response_schema

            original = _parser_templates().get(tok.chat_template)
            try:
                if original is not None:  # parses like another template TRL knows
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
            prompt = self._render(
                [{"role": "user", "content": "question"}], add_generation_prompt=True, tools=self.tools
            )
            missing = [n for n in self._schemas if n not in prompt]
            if missing:
                raise ChatTemplateError(
                    f"the chat template does not show the tool schemas to the model: the tool name(s) {missing} "
                    f"are missing from the rendered prompt, so the model is never told what it can call. "
                    + TEMPLATE_OPTIONS
                )
        name = self._tool_name()
        text = self._render(self._call_messages(name), add_generation_prompt=False)
        if ARG_SENTINEL not in text or name not in text:
            raise ChatTemplateError(
                f"the chat template drops structured tool calls: an assistant message calling {name!r} renders "
                f"without the call, so the history a deployed model sees would not hold its own calls. "
                + TEMPLATE_OPTIONS
            )

    def _inside_call_tokens(self, candidates: Sequence[str]) -> set[str]:
        """Candidates the template renders inside a call (before its last argument): they cannot end the turn.

        Probes a call to every configured tool with an argument placeholder per property, and a call with two
        arguments (so a closing token repeated between arguments, GLM's ``</arg_value>``, shows up even for a
        one-argument tool). What a tokenizer flags as special does not decide it: Gemma 4's string quote
        ``<|"|>`` opens every string argument, so it lies before the first placeholder.
        """
        first = self._tool_name()
        probes = [(first, {self._arg_key(first): ARG_SENTINEL, "probe_second_argument": ARG_SENTINEL + "_2"})]
        for name, schema in self._schemas.items():
            keys = list((schema.get("function", {}).get("parameters") or {}).get("properties") or [self._arg_key(name)])
            probes.append((name, {key: f"{ARG_SENTINEL}_{k}" for k, key in enumerate(keys)}))
        inside: set[str] = set()
        for name, arguments in probes:
            messages = [
                {"role": "user", "content": "question"},
                {"role": "assistant", "content": "", "tool_calls": [self._call(name, arguments)]},
            ]
            rendered = self._render(messages, add_generation_prompt=False)
            start = first_difference(rendered, self._generation_prompt_text)
            last = rendered.rfind(ARG_SENTINEL)
            inside |= {c for c in candidates if c in rendered[start:last]}
        return inside

    def _derive_stops(self, stop_tokens: Sequence[str] | None) -> None:
        tok = self.tokenizer
        name = self._tool_name()
        rendered = self._render(
            self._call_messages(name) + [self._tool_message(name, TOOL_SENTINEL)], add_generation_prompt=True
        )
        if TOOL_SENTINEL not in rendered:
            raise ChatTemplateError(
                "the chat template does not render a tool message after an assistant tool call (the tool output "
                "is missing from its output): it does not support tool turns. " + TEMPLATE_OPTIONS
            )
        if stop_tokens is not None:
            bad = [s for s in stop_tokens if len(encode_text(tok, s)) != 1]
            if bad or not stop_tokens:
                raise ChatTemplateError(
                    f"stop_tokens must be single tokens of this tokenizer; {bad or 'none given'} "
                    f"are not (each must encode to exactly one id)."
                )
            stops = list(stop_tokens)
            call_candidates = stops
        else:
            stops, call_candidates = [], self._special
        # The call's stop is the first candidate after the call that the template never writes inside one.
        inside = self._inside_call_tokens(call_candidates)
        hit = self._first_special(
            rendered, rendered.index(ARG_SENTINEL) + len(ARG_SENTINEL), [c for c in call_candidates if c not in inside]
        )
        if hit is None or hit[0] > rendered.index(TOOL_SENTINEL):
            after_call = rendered[rendered.index(ARG_SENTINEL) + len(ARG_SENTINEL) : rendered.index(TOOL_SENTINEL)]
            raise ChatTemplateError(
                "the chat template ends a tool-call turn without a control token"
                + (" from stop_tokens" if stop_tokens is not None else "")
                + f" (after the call it renders {after_call!r} "
                f"before the tool output"
                + (f"; {sorted(inside)} also occur inside a call, so they cannot end one" if inside else "")
                + "), so generation cannot stop at the end of a call. Pass "
                "stop_tokens=[...] naming the token that ends a call turn, or use another template. " + TEMPLATE_OPTIONS
            )
        self._call_stop = hit[1]
        if stop_tokens is None:
            answer = [{"role": "user", "content": "question"}, {"role": "assistant", "content": ASSISTANT_SENTINEL}]
            final = self._render(answer, add_generation_prompt=False)
            end = (
                self._first_special(final, final.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL), self._special)
                if ASSISTANT_SENTINEL in final
                else None
            )
            if end is None and ASSISTANT_SENTINEL in final:
                self._refuse_open_final_answer(answer, final)
            stops = [self._call_stop] + ([end[1]] if end else []) + ([tok.eos_token] if tok.eos_token else [])
        self.stop_tokens = list(dict.fromkeys(stops))
        """Token strings that end a turn."""
        self.stop_token_ids = sorted({tok.convert_tokens_to_ids(s) for s in self.stop_tokens})
        """Their ids (what a backend stops on)."""

    def _refuse_open_final_answer(self, answer: list[dict], final: str) -> None:
        """Refuse a template that renders no control token after a final answer (GLM-4.5's original).

        Its only candidate is the token that opens the next user message: trained as the end of the answer, it
        would be a token the template never renders after a final answer; left out, the model never learns to stop.
        """
        nxt = self._render(answer + [{"role": "user", "content": "next"}], add_generation_prompt=False)
        opener = (
            self._first_special(nxt, nxt.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL), self._special)
            if ASSISTANT_SENTINEL in nxt
            else None
        )
        tail = final[final.index(ASSISTANT_SENTINEL) + len(ASSISTANT_SENTINEL) :]
        raise ChatTemplateError(
            "the chat template renders no control token after a final answer ("
            + (f"only {tail!r}" if tail else "the conversation ends with the answer")
            + ")"
            + (f"; only a next user message brings one, {opener[1]!r}, which opens that message" if opener else "")
            + ", so nothing ends the model's last turn: a stop token there would be trained as an action though the "
            "template never renders it after the answer, and without one the model cannot learn to stop. "
            + _training_alternative(type(self), self.tokenizer, self.tools, self.template_kwargs)
            + TEMPLATE_OPTIONS
        )

    def _generation_prompt_leaves_reasoning_open(self) -> bool:
        """Whether the model reasons before it answers, as far as the template tells.

        False where the template does not render reasoning at all, where thinking is switched off
        (``enable_thinking=False`` passed, or the template's default when it is not), or where the
        generation prompt itself closes an empty reasoning block.
        """
        probe = [
            {"role": "user", "content": "question"},
            {
                "role": "assistant",
                "content": ASSISTANT_SENTINEL,
                "reasoning_content": TOOL_SENTINEL,
                "thinking": TOOL_SENTINEL,
            },
        ]
        if TOOL_SENTINEL not in self._render(probe, add_generation_prompt=False):
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
        tail = self._generation_prompt_text[len(self._render(user, add_generation_prompt=False)) :]
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
                note = (
                    f"the chat template reproduces tool turns exactly only without text before a tool call: "
                    f"what the model "
                    f"writes there is kept in the trajectory as sampled, but the template renders the history "
                    f"differently (with it: {str(first).removesuffix(' ' + TEMPLATE_OPTIONS)})"
                )
                self.notes.append(note)
                logger.warning(note)
            return
        a, b = (str(e).removesuffix(" " + TEMPLATE_OPTIONS) for e in errors)
        if a == b:
            raise errors[0]
        raise ChatTemplateError(f"with text before a tool call: {a} Without it: {b} {TEMPLATE_OPTIONS}")

    def verify(self, outputs: Sequence[str] = ("42\n", ""), *, calls_per_turn: int = 1) -> None:
        """Replay a conversation whose tool calls return ``outputs`` and check it against the template.

        Each next prompt must equal the template's tokens for the conversation so far; where an output
        holds control-token text (which the template would turn into control tokens) the text must be
        the template's and no observation token may be a control token. With ``calls_per_turn > 1`` each
        call turn makes that many calls in one turn (parallel calls), every one returning its output.

        Raises:
            ChatTemplateError: where the incremental path departs from the template.
        """
        with_text = not any("text before a tool call" in n for n in self.notes)
        self._replay_conversation(
            with_text=with_text, reasoning=self.reasoning, outputs=outputs, calls_per_turn=calls_per_turn
        )

    def _check_parallel_calls(self, calls_per_turn: int) -> None:
        """Refuse a template that cannot render ``calls_per_turn`` calls in one turn token for token."""
        try:
            self.verify(("42\n", "6\n\n"), calls_per_turn=calls_per_turn)
        except ChatTemplateError as exc:
            raise ChatTemplateError(
                f"the rollout runs up to {calls_per_turn} tool calls of one turn (parallel calls), but this chat "
                f"template cannot follow a turn with {calls_per_turn} calls token for token: "
                f"{str(exc).removesuffix(' ' + TEMPLATE_OPTIONS)} Set rollout_kwargs max_tool_calls_per_turn: 1 (a "
                f"turn with several calls is then an invalid_action), or use a template whose parallel calls are exact "
                f"(docs/rollout.md, 'Parallel tool calls')."
            ) from exc

    def _replay_conversation(
        self, *, with_text: bool, reasoning: bool, outputs: Sequence[str] = ("42\n", ""), calls_per_turn: int = 1
    ) -> None:
        name = self._tool_name()
        reasoning = {"reasoning_content": "I compute it.", "thinking": "I compute it."} if reasoning else {}
        texts = ["Let me run it.", "Once more.", "And again."]
        width = calls_per_turn
        turns = [
            (
                {
                    "role": "assistant",
                    "content": texts[k % 3] if with_text else "",
                    "tool_calls": [
                        self._call(name, self._sample_arguments(name, k * width + j), j) for j in range(width)
                    ],
                    **reasoning,
                },
                out,
            )
            for k, out in enumerate(outputs)
        ]
        turns.append(({"role": "assistant", "content": "The answer is \\boxed{42}.", **reasoning}, None))
        tools = self.tools or None
        messages: list[dict] = [{"role": "user", "content": "What is 6 * 7?"}]
        prompt = self.initial_prompt_ids(messages)
        tok = self.tokenizer

        def show(ids: Sequence[int], k: int) -> str:
            return repr(tok.decode(list(ids[max(0, k - 3) : k + 3]), skip_special_tokens=False))

        for i, (turn, output) in enumerate(turns):
            messages.append(turn)
            # Each call of a turn returns its own output (the first the one given, then numbered variants of it).
            results = [] if output is None else [output] + [f"{j}: {output}" for j in range(1, width)]
            messages += [self._tool_message(name, out, j) for j, out in enumerate(results)]
            expected = encode_text(tok, self._render(messages, add_generation_prompt=output is not None, tools=tools))
            if expected[: len(prompt)] != prompt:
                k = first_difference(prompt, expected)
                raise ChatTemplateError(
                    f"the chat template is not prefix-preserving for tool turns: after assistant turn {i + 1} it "
                    f"renders the earlier conversation differently (at token {k}: {show(prompt, k)} became "
                    f"{show(expected, k)}; e.g. it strips earlier reasoning or rewrites earlier tool calls), so "
                    f"training sequences would differ from what the template shows the model. "
                    + _training_alternative(type(self), tok, self.tools, self.template_kwargs)
                    + TEMPLATE_OPTIONS
                )
            end = next((j for j in range(len(prompt), len(expected)) if expected[j] in self.stop_token_ids), None)
            if end is None:
                raise ChatTemplateError(
                    f"the chat template renders assistant turn {i + 1} without any stop token "
                    f"({', '.join(self.stop_tokens)}), so generation would not stop where the template ends the "
                    f"turn. Pass stop_tokens=[...] naming the token that ends a turn. " + TEMPLATE_OPTIONS
                )
            completion = expected[len(prompt) : end + 1]
            parsed = self.parse(prompt, completion)
            want = [(name, c["function"]["arguments"]) for c in turn.get("tool_calls", [])]
            if output is None:
                ok = parsed.kind in (TurnKind.FINAL_ANSWER, TurnKind.NO_TOOL_CALL)  # whatever the answer pattern
            else:
                ok = parsed.kind == TurnKind.TOOL_CALL and [(c.name, c.arguments) for c in parsed.calls] == want
            if not ok:
                raise ChatTemplateError(
                    f"the tool-call parser for this chat template does not read back the template's own assistant "
                    f"turn {i + 1} ({tok.decode(completion, skip_special_tokens=False)!r} parsed as {parsed.kind}"
                    f"{': ' + parsed.error if parsed.error else ''}). " + TEMPLATE_OPTIONS
                )
            if output is None:
                return
            tool_turn = self.tool_results_turn(completion, [(name, out) for out in results])
            nxt = prompt + completion + tool_turn.ids
            forged = self._control_re is not None and self._control_re.search(output) is not None
            if forged and self._same_text_without_forged_controls(
                nxt, expected, len(prompt) + len(completion), tool_turn
            ):
                nxt = expected  # the one deliberate difference: control-token text in tool output stays text
            if nxt != expected:
                k = first_difference(nxt, expected)
                raise ChatTemplateError(
                    f"the tool turn after assistant turn {i + 1} does not tokenise as the template's rendering (at "
                    f"token {k}: {show(nxt, k)} where the template has {show(expected, k)}). " + TEMPLATE_OPTIONS
                )
            prompt = nxt

    def _same_text_without_forged_controls(
        self, ours: list[int], template: list[int], start: int, turn: ToolTurn
    ) -> bool:
        """Our tool turn reads as the template's text, and none of its observation tokens is a control token."""
        decode = self.tokenizer.decode
        return (
            ours[:start] == template[:start]
            and decode(ours, skip_special_tokens=False) == decode(template, skip_special_tokens=False)
            and not any(
                t in self._control_ids for t, src in zip(turn.ids, turn.sources) if src == TokenSource.OBSERVATION
            )
        )
