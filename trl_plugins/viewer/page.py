"""A saved batch drawn as one self-contained HTML page (inline CSS and JS, nothing fetched): every token coloured
by its provenance, its behaviour log-prob, advantage and loss mask on hover, turn boundaries, stop reasons,
reward components and the trajectory's role in the update."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from trl_plugins.types import Datum, TokenSource, Trajectory
from trl_plugins.viewer.batch import save_batch, source_name, write_atomic

__all__ = ["SOURCE_COLOURS", "display_text", "render_html", "write_step_pages"]

SOURCE_COLOURS = {
    TokenSource.PROMPT: "#dde3ea",
    TokenSource.ACTION: "#bfe8c4",
    TokenSource.OBSERVATION: "#fde3b5",
    TokenSource.GLUE: "#e4d5f3",
}
"""Background colour of a token of each provenance (the page's legend shows the same)."""

_ADV_COLOURS = {"pos": "#1f6fd1", "neg": "#d1321f", "zero": "#9aa0a6"}

_CONTROL = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROL[0x7F] = "\u2421"


def display_text(token: str) -> str:
    """What a token's span shows: the token with control characters (``\\r``, NUL, ...) as visible symbols
    (U+2400...), since HTML cannot carry them; newlines and tabs stay (the page keeps whitespace)."""
    return token.translate(_CONTROL)


def _weighted(component: dict) -> float | None:
    """A saved reward component's weighted value (None where either part was not finite)."""
    value, weight = component["value"], component["weight"]
    return None if value is None or weight is None else value * weight


def _esc(value: Any) -> str:
    return html.escape(display_text("" if value is None else str(value)), quote=True)


_SHOWN_CHARS = 4000
"""A tool output, its arguments or a row field longer than this is shown cut on the page (the saved batch keeps it
whole)."""


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return _esc(
        text
        if len(text) <= _SHOWN_CHARS
        else text[:_SHOWN_CHARS] + f"... [{len(text)} chars; whole in the saved batch]"
    )


def _num(x: Any) -> str:
    return "" if x is None else repr(float(x))


def _fmt(x: Any, spec: str = "+.3f") -> str:
    return "n/a" if x is None else format(float(x), spec)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1d2127;background:#f6f7f9}
header{background:#22303f;color:#fff;padding:12px 20px}header h1{font-size:18px;margin:0 0 4px}
header .meta{opacity:.8;font-size:13px}.version{font-size:13px;margin:6px 0}
.version-mismatch{background:#fde2e1;border:1px solid #d1321f;padding:6px 10px;margin:6px 0;font-size:13px}
main{padding:12px 20px 80px}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;background:#fff;border:1px solid #d8dde3;
 border-radius:6px;padding:8px 12px;margin:10px 0}.sw{display:inline-block;width:14px;height:14px;border-radius:3px;
 vertical-align:-2px;margin-right:4px;border:1px solid #0002}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #d8dde3;padding:3px 8px;text-align:left;font-size:13px}
th{background:#eef1f4}.traj{background:#fff;border:1px solid #d8dde3;border-radius:6px;margin:16px 0;padding:10px 14px}
.traj h2{font-size:15px;margin:0 0 6px}.badge{display:inline-block;border-radius:10px;padding:1px 8px;font-size:12px;
 margin-left:6px;color:#fff}.k-terminated{background:#2e7d32}.k-truncated{background:#e07b00}
.k-world_failure{background:#c62828}.k-unfinished{background:#6d6d6d}
.r-trained{background:#1f6fd1}.r-zero_advantage{background:#7a8794}.r-left_out{background:#8e24aa}.r-update_skipped{background:#b26a00}
.note{font-size:13px;margin:4px 0}.qa{font-size:13px;margin:4px 0;white-space:pre-wrap}
.tokens{font:12.5px/1.9 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;
 border:1px solid #e3e6ea;border-radius:4px;padding:8px;margin:8px 0;background:#fcfcfd}
.tok{border-radius:2px;padding:0 1px;cursor:default;box-shadow:inset -1px 0 0 #fffc}
.tok:hover{outline:2px solid #22303f}
.s-prompt{background:#dde3ea}.s-action{background:#bfe8c4}.s-observation{background:#fde3b5}.s-glue{background:#e4d5f3}
.tok.m1{border-bottom:3px solid #9aa0a6}.tok.a-pos{border-bottom-color:#1f6fd1}.tok.a-neg{border-bottom-color:#d1321f}
.tok.first{font-style:italic}.nl::before{content:"\\21B5";opacity:.45}
.lp .tok.m1{background:rgba(46,160,67,var(--p,1))}
.turn-mark{display:block;font:600 11px/1.6 system-ui,sans-serif;color:#51606f;
  border-top:1px dashed #b7c0ca;margin:6px 0 2px}
.turn-mark.obs{color:#9a5b00}.first-prompt summary{font:12px system-ui,sans-serif;color:#51606f;cursor:pointer}
.calls td{vertical-align:top}.calls pre{margin:0;white-space:pre-wrap;max-height:12em;overflow:auto}
#hover{position:fixed;right:14px;bottom:14px;background:#22303f;color:#fff;font:12px/1.5 ui-monospace,monospace;
 padding:8px 10px;border-radius:6px;min-width:260px;max-width:420px;white-space:pre-wrap;box-shadow:0 2px 8px #0004}
#js-errors{background:#c62828;color:#fff;padding:8px;white-space:pre-wrap}
"""

_HEAD_SCRIPT = """
window.__viewerErrors = [];
window.onerror = function (msg, src, line, col) {
  window.__viewerErrors.push(String(msg) + " (line " + line + ":" + col + ")");
  var box = document.getElementById("js-errors");
  if (box) { box.textContent = window.__viewerErrors.join("\\n"); box.hidden = false; }
  if (document.body) { document.body.dataset.jsErrors = String(window.__viewerErrors.length); }
};
"""

_BODY_SCRIPT = """
(function () {
  var hover = document.getElementById("hover");
  function describe(el) {
    var d = el.dataset, lines = [];
    lines.push("token " + JSON.stringify(el.textContent) + "  id " + d.id);
    lines.push("source " + d.source +
      (d.index === undefined ? "  (first token: context only)" : "  position " + d.index));
    if (d.index !== undefined) {
      lines.push("loss mask " + d.mask);
      lines.push("behaviour log-prob " + (d.mask === "1" ? Number(d.logprob).toFixed(4) + "  (p=" +
        Math.exp(Number(d.logprob)).toFixed(3) + ")" : "n/a (not sampled)"));
      lines.push("advantage " + (d.mask === "1" ? Number(d.adv).toFixed(4) : "0 (off the mask)"));
      if (d.ref !== undefined && d.mask === "1") lines.push("reference log-prob " + Number(d.ref).toFixed(4));
    }
    return lines.join("\\n");
  }
  document.addEventListener("mouseover", function (e) {
    var el = e.target.closest ? e.target.closest(".tok") : null;
    if (el) hover.textContent = describe(el);
  });
  var toks = document.querySelectorAll(".tok");
  var sampled = document.querySelectorAll(".tok.m1");
  for (var i = 0; i < sampled.length; i++) {
    sampled[i].style.setProperty("--p", String(Math.max(0.08, Math.exp(Number(sampled[i].dataset.logprob)))));
  }
  var shade = document.getElementById("shade");
  shade.addEventListener("change", function () { document.body.classList.toggle("lp", shade.checked); });
  if (sampled.length) hover.textContent = describe(sampled[0]);
  if (location.hash === "#selftest") {  // the browser test reads back the colours the page really drew
    var all = document.querySelectorAll(".tok, .sw");
    for (var j = 0; j < all.length; j++) all[j].dataset.bg = getComputedStyle(all[j]).backgroundColor;
  }
  document.body.dataset.tokens = String(toks.length);
  document.body.dataset.ready = "1";
})();
"""


def _token_spans(t: Mapping[str, Any]) -> str:
    d, tokens = t["datum"], t["tokens"]
    ids, strings = tokens["ids"], tokens.get("strings")
    starts = {turn["completion_start"]: turn["index"] for turn in t["turns"]}
    sampled_by = {turn["index"]: turn.get("policy_step") for turn in t["turns"]}
    observations = {turn["prompt_start"]: turn["index"] for turn in t["turns"] if turn["index"] > 0}
    prompt_end = t["turns"][0]["completion_start"] if t["turns"] else 0
    parts = []
    for pos, tok_id in enumerate(ids):
        if pos == 0 and prompt_end:
            parts.append(
                f'<details class="first-prompt"><summary>first prompt: {prompt_end} tokens (system, user, '
                f"template header); click to show</summary>"
            )
        if pos == prompt_end and pos:
            parts.append("</details>")
        if pos in observations:
            parts.append(
                f'<span class="turn-mark obs" data-turn="{observations[pos]}">tool output and template glue, '
                f"before turn {observations[pos] + 1}</span>"
            )
        if pos in starts:
            by = sampled_by.get(starts[pos])
            parts.append(
                f'<span class="turn-mark" data-turn="{starts[pos]}">assistant turn {starts[pos] + 1}'
                + (f", sampled by the weights of step {by}" if by is not None else "")
                + "</span>"
            )
        text = display_text(strings[pos]) if strings is not None else f"\u27e8{tok_id}\u27e9"
        nl = " nl" if "\n" in text else ""
        if pos == 0:
            src = t["first_source"]
            title = f"first token ({src}): context only, no datum position; id {tok_id}"
            parts.append(
                f'<span class="tok s-{src} first{nl}" data-pos="0" data-source="{src}" data-id="{tok_id}" '
                f'title="{_esc(title)}">{html.escape(text, quote=True)}</span>'
            )
            continue
        k = pos - 1
        src, mask, lp, adv = d["sources"][k], d["action_mask"][k], d["behaviour_logprobs"][k], d["advantages"][k]
        cls = f"tok s-{src} m{mask}{nl}"
        if mask:
            cls += " a-pos" if (adv or 0) > 0 else " a-neg" if (adv or 0) < 0 else " a-zero"
        ref, teacher = d.get("ref_logprobs"), d.get("teacher_logprobs")
        taught = f" | teacher log-prob {_fmt(teacher[k], '.4f')}" if teacher is not None and mask else ""
        title = (
            f"#{k} {src} | mask {mask} | log-prob {_fmt(lp, '.4f') if mask else 'n/a'}{taught} | "
            f"advantage {_fmt(adv, '+.4f') if mask else '0'} | id {tok_id}"
        )
        extra = f' data-ref="{_num(ref[k])}"' if ref is not None else ""
        extra += f' data-teacher="{_num(teacher[k])}"' if teacher is not None else ""
        parts.append(
            f'<span class="{cls}" data-pos="{pos}" data-index="{k}" data-source="{src}" data-mask="{mask}" '
            f'data-logprob="{_num(lp)}" data-adv="{_num(adv)}" data-id="{tok_id}"{extra} '
            f'title="{_esc(title)}">{html.escape(text, quote=True)}</span>'
        )
    if prompt_end >= len(ids):  # a first turn that sampled nothing: the prompt box is still open
        parts.append("</details>")
    return "".join(parts)


def _tool_calls(t: Mapping[str, Any]) -> str:
    rows = []
    for turn in t["turns"]:
        cut = ["cut at max_new_tokens"] if turn.get("truncated") else []
        if not turn["tool_calls"]:
            rows.append(
                f"<tr><td>{turn['index'] + 1}</td><td colspan=3>no tool call"
                f"{' (' + ', '.join(cut) + ')' if cut else ''}</td></tr>"
            )
            continue
        for k, c in enumerate(turn["tool_calls"]):  # parallel calls: one row each, numbered within the turn
            flags = cut + [
                name
                for name, on in (
                    ("ok", c["ok"]),
                    ("timed out", c["timed_out"]),
                    ("output truncated", c["output_truncated"]),
                )
                if on
            ]
            if not c["ok"]:
                flags.append("failed")
            if c.get("infra_error"):
                flags.append(f"infrastructure error: {c['infra_error']}")
            latency = "" if c.get("latency_s") is None else f", {c['latency_s']:.3f} s"
            which = f"{turn['index'] + 1}" + (f".{k + 1}" if len(turn["tool_calls"]) > 1 else "")
            rows.append(
                f"<tr><td>{which}</td><td><b>{_esc(c['name'])}</b>{_esc(latency)}<br>{_esc(', '.join(flags))}</td>"
                f"<td><pre>{_shown(c['arguments'])}</pre></td><td><pre>{_shown(c['output'])}</pre></td></tr>"
            )
    return (
        "<table class=calls><tr><th>turn</th><th>tool call</th><th>arguments</th><th>output</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _trajectory(t: Mapping[str, Any]) -> str:
    kind, role = t["stop_kind"], t["update_role"]
    head = (
        f"<h2>#{t['index']} &middot; question {_esc(t['question_id'])} &middot; group {t['group_id']}, "
        f'sample {t["sample_index"]}<span class="badge k-{_esc(kind)}" data-stop="{_esc(t["stop_reason"])}">'
        f"{_esc(t['stop_reason'])} ({_esc(kind.replace('_', ' '))})</span>"
        f'<span class="badge r-{_esc(role)}">{_esc(role.replace("_", " "))}</span></h2>'
    )
    parts = [
        f'<section class="traj" id="traj-{t["index"]}" data-trajectory="{t["index"]}" data-role="{_esc(role)}">',
        head,
    ]
    parts.append(
        f'<div class="note">reward <b>{_fmt(t["reward"], ".4f")}</b> &middot; advantage '
        f"<b>{_fmt(t['advantage'], '+.4f')}</b>"
        f" &middot; {_esc(t['update_note'])}"
        + (f" &middot; sampled by the weights of step {t['policy_step']}" if t.get("policy_step") is not None else "")
        + "</div>"
    )
    if t.get("error"):
        parts.append(f'<div class="note"><b>error:</b> {_esc(t["error"])}</div>')
    if t.get("question") is not None:
        parts.append(f'<div class="qa"><b>question:</b> {_esc(t["question"])}</div>')
    if t.get("reference_answer") is not None:
        parts.append(f'<div class="qa"><b>reference answer:</b> {_shown(t["reference_answer"])}</div>')
    if t.get("example"):
        fields = ", ".join(f"{k}={_shown(v)}" for k, v in t["example"].items())
        parts.append(f'<div class="qa"><b>row:</b> {fields}</div>')
    comps = t["reward_components"]
    if comps:
        body = "".join(
            f'<tr data-component="{_esc(c["name"])}"><td>{_esc(c["name"])}</td><td>{_fmt(c["value"], ".4f")}</td>'
            f"<td>{_fmt(c['weight'], '.4g')}</td>"
            f"<td>{_fmt(_weighted(c), '.4f')}</td></tr>"
            for c in comps
        )
        parts.append(
            "<table class=rewards><tr><th>reward component</th><th>value</th><th>weight</th><th>weighted</th></tr>"
            + body
            + "</table>"
        )
    else:
        parts.append('<div class="note">no reward components (not scored)</div>')
    if t.get("datum") is not None:
        d = t["datum"]
        loss = sum(d["action_mask"])
        parts.append(
            f'<div class="note">{len(d["target_ids"]) + 1} tokens, {loss} of them sampled (loss mask 1)'
            + (" &middot; datum built for display" if t.get("datum_for_display") else "")
            + f" &middot; bootstrap mask {d['bootstrap_mask']}</div>"
        )
        parts.append(f'<div class="tokens">{_token_spans(t)}</div>')
    else:
        parts.append(f'<div class="note"><b>no datum:</b> {_esc(t.get("datum_error") or "none was built")}</div>')
        for turn in t["turns"]:
            by = turn.get("policy_step")
            parts.append(
                f'<div class="tokens"><span class="turn-mark">assistant turn {turn["index"] + 1}'
                + (f", sampled by the weights of step {by}" if by is not None else "")
                + "</span>"
                f"{_esc(turn['text'])}</div>"
            )
    if t["turns"]:
        parts.append(_tool_calls(t))
    parts.append("</section>")
    return "".join(parts)


def _version_html(batch: Mapping[str, Any], beside: Mapping[str, Any] | None) -> str:
    from trl_plugins.run.version import version_differences
    from trl_plugins.types import RunVersion

    v = batch.get("version")
    if v is None:
        return '<div class="version">version: not saved (a format-2 batch)</div>'
    adapters = (
        ", ".join(f"{a['name']} ({a['kind']} r={a['rank']} on {'/'.join(a['targets'])})" for a in v["adapters"])
        or "none"
    )
    plugins = ", ".join(f"{k} {val}" for k, val in sorted(v["plugin_versions"].items())) or "none"
    out = (
        f'<div class="version">version <b>{_esc(v["digest"])}</b>: sampler {_esc(v["sampler"])}, {_esc(v["dtype"])}'
        f"{', quantization ' + _esc(v['quantization']) if v.get('quantization') else ''}, adapters {_esc(adapters)}, "
        f"tokenizer {_esc(v['tokenizer_digest'])}, tool schemas {_esc(v['tool_schemas_digest'])}, plugins "
        f"{_esc(plugins)}</div>"
    )
    problems = []
    others = sorted(
        {
            str(t["policy_version"]["run_digest"])
            for t in batch["trajectories"]
            if t.get("policy_version") and t["policy_version"].get("run_digest") not in (None, v["digest"])
        }
    )
    if others:
        problems.append(f"trajectories of other run versions in this batch: {', '.join(others)}")
    if beside is not None and beside.get("digest") != v["digest"]:
        problems += version_differences(RunVersion.from_dict(v), RunVersion.from_dict(beside)) or ["the digests differ"]
    if problems:
        out += (
            '<div class="version-mismatch"><b>version differs from the run it is opened beside:</b><ul>'
            + "".join(f"<li>{_esc(p)}</li>" for p in problems)
            + "</ul></div>"
        )
    return out


def render_html(
    batch: Mapping[str, Any],
    *,
    max_trajectories: int | None = None,
    title: str | None = None,
    beside: Mapping[str, Any] | None = None,
) -> str:
    """A self-contained HTML page (inline CSS and JS, no external resources) of a saved batch.

    Args:
        batch: What :func:`make_batch` returns or :func:`load_batch` reads.
        max_trajectories: Draw only the first N.
        title: Page title (default: the step).
        beside: The version record (a ``RunVersion`` dict with its ``digest``) of the run the page is opened beside:
            each field that differs from the batch's is listed in a warning (``.version-mismatch``).

    Returns:
        The page. Its script sets ``body[data-ready="1"]`` once it ran, and collects JS errors into
        ``#js-errors`` and ``body[data-js-errors]`` (for a headless-browser check).
    """
    trajs = (
        list(batch["trajectories"])[:max_trajectories] if max_trajectories is not None else list(batch["trajectories"])
    )
    step = batch.get("step")
    title = title or (f"Trajectories, step {step}" if step is not None else "Trajectories")
    legend = "".join(
        f'<span><span class="sw s-{source_name(s)}" data-source="{source_name(s)}"></span>{label}</span>'
        for s, label in (
            (TokenSource.PROMPT, "prompt (system, user, first template header)"),
            (TokenSource.ACTION, "sampled action (trained)"),
            (TokenSource.OBSERVATION, "tool observation"),
            (TokenSource.GLUE, "template glue"),
        )
    )
    legend += (
        '<span>underline: <b style="color:#1f6fd1">advantage &gt; 0</b> / <b style="color:#d1321f">&lt; 0</b> / '
        '<b style="color:#9aa0a6">0</b> on loss-mask tokens; <i>italic</i>: first token (context only)</span>'
        '<label><input type="checkbox" id="shade"> shade sampled tokens by probability</label>'
    )
    summary = "".join(
        "<tr><td><a "
        f'href="#traj-{t["index"]}">#{t["index"]}</a></td><td>{_esc(t["question_id"])}</td><td>{t["group_id"]}</td>'
        f"<td>{t['sample_index']}</td><td>{len(t['turns'])}</td>"
        f"<td>{sum(len(x['tool_calls']) for x in t['turns'])}</td>"
        f"<td>{_esc(t['stop_reason'])}</td><td>{_fmt(t['reward'], '.3f')}</td><td>{_fmt(t['advantage'], '+.3f')}</td>"
        f"<td>{_esc(t['update_role'].replace('_', ' '))}</td></tr>"
        for t in trajs
    )
    meta = (
        f"{len(trajs)} of {batch.get('num_trajectories', len(trajs))} trajectories of the batch"
        f"{' &middot; written ' + _esc(batch['created']) if batch.get('created') else ''} &middot; hover a token for "
        "its "
        f"datum values"
    )
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{_esc(title)}</title><style>{_CSS}</style><script>{_HEAD_SCRIPT}</script></head>"
        f'<body data-ready="0" data-js-errors="0"><header><h1>{_esc(title)}</h1><div '
        f'class="meta">{meta}</div></header><main>'
        '<div id="js-errors" hidden></div>' + _version_html(batch, beside) + f'<div class="legend">{legend}</div>'
        "<table class=summary><tr><th>#</th><th>question</th><th>group</th><th>sample</th><th>turns</th><th>tool "
        "calls</th>"
        f"<th>stop reason</th><th>reward</th><th>advantage</th><th>update</th></tr>{summary}</table>"
        + "".join(_trajectory(t) for t in trajs)
        + '</main><div id="hover">hover a token</div>'
        f"<script>{_BODY_SCRIPT}</script></body></html>\n"
    )


def write_step_pages(
    output_dir: str | os.PathLike,
    step: int,
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    tokenizer: Any = None,
    *,
    log_to_wandb: bool = False,
    **kwargs: Any,
) -> tuple[Path, Path]:
    """Save the step's batch and its page as ``output_dir/trajectories/step-<step>.{json,html}``; with
    ``log_to_wandb`` (and a W&B run active) also log the page as ``wandb.Html`` under ``trajectories/viewer``
    (uncommitted: it goes out with the step's metrics). ``kwargs`` go to :func:`make_batch`.

    Returns:
        The JSON and HTML paths.
    """
    folder = Path(output_dir) / "trajectories"
    json_path, html_path = folder / f"step-{step:06d}.json", folder / f"step-{step:06d}.html"
    batch = save_batch(json_path, trajectories, datums, tokenizer, step=step, **kwargs)
    page = render_html(batch)
    write_atomic(html_path, page)
    if log_to_wandb:
        import wandb

        if wandb.run is not None:
            wandb.log({"trajectories/viewer": wandb.Html(page, inject=False, data_is_not_path=True)}, commit=False)
    return json_path, html_path
