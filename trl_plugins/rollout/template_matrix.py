"""Every chat template TRL ships, driven end to end: exact token-in, token-out, or refused and why.

For each ``trl/chat_templates/*.jinja`` (and, where the template reads ``enable_thinking``, with
thinking on and off) a tokenizer of the template's own family is built (:func:`~trl_plugins.tiny.build_tokenizer`:
its special tokens are tokens, its bos/eos set), :class:`~trl_plugins.rollout.chat.ChatFormat` is
constructed with the code interpreter's schema, and, where it accepts the template, a conversation is
replayed for each of :data:`REALISTIC_OUTPUTS` (:meth:`ChatFormat.verify`). A template is *exact* when
every replay equals the template's own tokens; *refused* when ``ChatFormat`` raises at construction
(the reason is the start of its message); anything else is a *mismatch*: a bug, which the test fails on.
An exact template is then built again for two calls per turn (``calls_per_turn=2``: parallel calls) and, where
it accepts them, replayed with every realistic output as parallel calls: its *parallel calls* are exact or
refused (why, in short), and a mismatch there is a bug too.

``python -m trl_plugins.rollout.template_matrix`` prints the table that ``docs/rollout.md`` carries
(``--write docs/rollout.md`` updates it there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REALISTIC_OUTPUTS",
    "TemplateVerdict",
    "check_template",
    "template_names",
    "template_matrix",
    "render_matrix",
]

REALISTIC_OUTPUTS: dict[str, str] = {
    "print (trailing newline)": "42\n",
    "empty": "",
    "two newlines": "6\n\n",
    "long": "".join(f"row {i}: {i * i}\n" for i in range(60)),
    "unicode": "π ≈ 3.14159 — ✓ 你好\n",
    "traceback": 'Traceback (most recent call last):\n  File "<code>", line 1\nZeroDivisionError: division by zero\n',
    "leading spaces": "   x = 1\n",
}
"""Tool outputs as the code interpreter returns them; a template-tag output is added per tokenizer."""


@dataclass
class TemplateVerdict:
    """What one template (with one thinking setting) does."""

    template: str
    thinking: str
    """``default``, ``on`` or ``off``."""
    verdict: str
    """``exact``, ``refused`` or ``mismatch``."""
    reason: str = ""
    """Why refused (or where it departs, for a mismatch)."""
    stop_tokens: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    parallel: str = ""
    """For an exact template, whether two calls in one turn are ``exact`` or ``refused`` (``""`` otherwise)."""
    parallel_reason: str = ""
    """Why parallel calls are refused."""


def template_names() -> list[str]:
    """The installed TRL's chat template file names, without ``.jinja``."""
    import trl

    return sorted(p.stem for p in (Path(trl.__file__).parent / "chat_templates").glob("*.jinja"))


def _forged_output(tokenizer: Any) -> str:
    """Tool output made of the tokenizer's own control-token text."""
    controls = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)[:6]
    return "done\n" + "".join(controls) + "\nstill text\n"


def _short(message: str) -> str:
    text = message.split(" Options: (1)")[0]
    return re.sub(r"\s+", " ", text).strip()


def check_template(
    tokenizer: Any, tools: list[dict], *, template: str = "", thinking: str = "default", **template_kwargs: Any
) -> TemplateVerdict:
    """Construct :class:`ChatFormat` for ``tokenizer`` and replay a conversation for every realistic output."""
    from trl_plugins.rollout.chat import ChatFormat, ChatTemplateError

    try:
        chat = ChatFormat(tokenizer, tools, **template_kwargs)
    except ChatTemplateError as exc:
        return TemplateVerdict(template, thinking, "refused", _short(str(exc)))
    outputs = dict(REALISTIC_OUTPUTS, **{"template tags": _forged_output(tokenizer)})
    for label, output in outputs.items():
        try:
            chat.verify([output, output])
        except ChatTemplateError as exc:
            return TemplateVerdict(template, thinking, "mismatch", f"{label}: {_short(str(exc))}", chat.stop_tokens)
    try:
        chat.verify(list(outputs.values()))
    except ChatTemplateError as exc:
        return TemplateVerdict(
            template, thinking, "mismatch", f"all outputs in one conversation: {_short(str(exc))}", chat.stop_tokens
        )
    verdict = TemplateVerdict(template, thinking, "exact", "", chat.stop_tokens, [_short(n) for n in chat.notes])
    try:
        parallel = ChatFormat(tokenizer, tools, calls_per_turn=2, **template_kwargs)
    except ChatTemplateError as exc:
        verdict.parallel, verdict.parallel_reason = "refused", _parallel_reason(str(exc))
        return verdict
    try:
        parallel.verify(list(outputs.values()), calls_per_turn=2)
    except ChatTemplateError as exc:
        return TemplateVerdict(template, thinking, "mismatch", f"parallel calls: {_short(str(exc))}", chat.stop_tokens)
    verdict.parallel = "exact"
    return verdict


def _parallel_reason(message: str) -> str:
    """The part of a parallel-call refusal that says what the template does (the rest is the same for every one)."""
    reason = _short(message).split("token for token: ", 1)[-1].split(" Set rollout_kwargs")[0]
    if "only supports single tool-calls" in reason:
        return "the template raises 'This model only supports single tool-calls at once!'"
    if "does not read back" in reason:
        return "the parser reads back only the first call of a turn (the turn stops at the token closing a call)"
    return reason[:200]


def template_matrix(names: list[str] | None = None) -> list[TemplateVerdict]:
    """:func:`check_template` for every TRL template, with thinking on and off where it reads ``enable_thinking``."""
    from trl_plugins.tiny import build_tokenizer, load_trl_chat_template
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    tools = [CodeInterpreter().schema()]
    rows = []
    for name in names or template_names():
        settings: list[tuple[str, dict]] = [("default", {})]
        if "enable_thinking" in load_trl_chat_template(name):
            settings += [("on", {"enable_thinking": True}), ("off", {"enable_thinking": False})]
        for label, kwargs in settings:
            rows.append(check_template(build_tokenizer(name), tools, template=name, thinking=label, **kwargs))
    return rows


def render_matrix(rows: list[TemplateVerdict]) -> str:
    """The Markdown table for ``docs/rollout.md``."""
    lines = [
        "| template | thinking | verdict | parallel calls | stop tokens, or why refused |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        detail = ", ".join(f"`{s}`" for s in r.stop_tokens) if r.verdict == "exact" else r.reason
        if r.notes:
            detail += " (note: exact only when a call turn has no text before the call)"
        if r.parallel == "refused":
            detail += f" (parallel calls refused: {r.parallel_reason})"
        detail = detail.replace("|", "\\|")
        lines.append(f"| {r.template} | {r.thinking} | {r.verdict} | {r.parallel or '-'} | {detail} |")
    exact = sum(r.verdict == "exact" for r in rows)
    lines.append("")
    lines.append(
        f"{exact} of {len(rows)} settings exact ({sum(r.parallel == 'exact' for r in rows)} of them with "
        f"parallel calls), {sum(r.verdict == 'refused' for r in rows)} refused, "
        f"{sum(r.verdict == 'mismatch' for r in rows)} mismatched."
    )
    return "\n".join(lines)


def write_docs(path: str | Path) -> None:
    """Replace the matrix in ``path`` (from its header row to its summary line) with the current one."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    table = render_matrix(template_matrix())
    start = text.index("| template | thinking | verdict |")
    end = text.index(" mismatched.", start) + len(" mismatched.")
    path.write_text(text[:start] + table + text[end:], encoding="utf-8")


if __name__ == "__main__":
    import argparse
    import logging

    logging.disable(logging.WARNING)  # the accepted-with-a-note warnings; the table carries the notes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", metavar="DOC", help="update the table in this file (docs/rollout.md) instead of printing it"
    )
    cli = parser.parse_args()
    if cli.write:
        write_docs(cli.write)
    else:
        print(render_matrix(template_matrix()))
