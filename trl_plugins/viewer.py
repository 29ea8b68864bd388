"""Trajectory viewer: a step's trajectories and their datums, saved as JSON and drawn as one HTML page.

It shows what the datum builder did: every token of each trajectory, coloured by its provenance
(:class:`~trl_plugins.types.TokenSource`: prompt, sampled action, tool observation, template glue), with
the datum's behaviour log-prob, advantage and loss mask on hover; turn boundaries, the stop reason,
the reward components and whether the update trained on it. The page is self-contained (inline CSS
and JS, nothing fetched), so it opens from disk, from a W&B ``Html`` panel or from a CI artifact.

A *saved batch* is a JSON file (``FORMAT``) written by :func:`save_batch`; the trainer writes one every
``viewer_steps`` steps under ``output_dir/trajectories/`` next to its page (:func:`write_step_pages`).
Any saved batch can be drawn again, e.g. with fewer trajectories::

    python -m trl_plugins.viewer outputs/run/trajectories/step-000010.json -o page.html --max-trajectories 4

Every token span carries machine-readable attributes: ``data-pos`` (place in the whole sequence
``full``), ``data-index`` (datum position ``t``, whose target is ``full[t + 1]``; absent on the first
token, which is context only), ``data-source``, ``data-mask``, ``data-logprob``, ``data-adv`` and
``data-id``; numbers are written as Python's ``repr`` of the datum's float, so they compare exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import html
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from trl_plugins.datum import DatumError, build_datum
from trl_plugins.types import Datum, TokenSource, Trajectory

__all__ = [
    "FORMAT",
    "SOURCE_COLOURS",
    "UpdateRole",
    "ViewerError",
    "make_batch",
    "save_batch",
    "load_batch",
    "datum_from_dict",
    "display_text",
    "render_html",
    "write_step_pages",
    "main",
]

FORMAT = "trl_plugins.viewer/1"
"""Value of a saved batch's ``format`` key; :func:`load_batch` refuses anything else."""

SOURCE_COLOURS = {
    TokenSource.PROMPT: "#dde3ea",
    TokenSource.ACTION: "#bfe8c4",
    TokenSource.OBSERVATION: "#fde3b5",
    TokenSource.GLUE: "#e4d5f3",
}
"""Background colour of a token of each provenance (the page's legend shows the same)."""

_ADV_COLOURS = {"pos": "#1f6fd1", "neg": "#d1321f", "zero": "#9aa0a6"}
_QUESTION_KEYS = ("prompt",)
_ANSWER_KEYS = ("answer", "reference_answer", "solution", "ground_truth")
_MAX_FIELD_CHARS = 4000


class UpdateRole(enum.StrEnum):
    """What the step's update did with a trajectory."""

    TRAINED = "trained"
    """Its datum was in the update with a non-zero advantage somewhere: it moved the policy."""
    ZERO_ADVANTAGE = "zero_advantage"
    """Its datum was in the update with advantage 0 everywhere: counted in the loss denominators, but no
    policy-gradient signal (its forward is skipped with ``drop_zero_advantage``)."""
    LEFT_OUT = "left_out"
    """Masked out of the update (a world failure, ``truncated_policy='mask'``, or a group that lost too
    many members); its datum here was built for display only."""
    UPDATE_SKIPPED = "update_skipped"
    """The step made no policy update at all (the critic's warm-up, or no trajectory to train on): nothing
    of this batch moved the policy."""


class ViewerError(ValueError):
    """A saved batch cannot be read or drawn; the message names the file and what to do."""


def _source_name(source: Any) -> str:
    return TokenSource(int(source)).name.lower()


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _floats(xs: Sequence[float] | None) -> list[float | None] | None:
    return None if xs is None else [_finite(x) for x in xs]


def _datum_to_dict(d: Datum) -> dict:
    out = {
        "input_ids": list(d.input_ids), "target_ids": list(d.target_ids),
        "behaviour_logprobs": _floats(d.behaviour_logprobs), "advantages": _floats(d.advantages),
        "action_mask": [int(m) for m in d.action_mask], "sources": [_source_name(s) for s in d.sources],
        "trajectory_index": d.trajectory_index, "group_id": d.group_id, "bootstrap_mask": d.bootstrap_mask,
    }
    for name in ("ref_logprobs", "old_logprobs", "old_values", "returns"):
        value = getattr(d, name)
        if value is not None:
            out[name] = _floats(value)
    return out


def datum_from_dict(data: Mapping[str, Any]) -> Datum:
    """The :class:`~trl_plugins.types.Datum` a saved batch stores (a ``trajectories[i]["datum"]`` entry; copied)."""
    kwargs = {f.name: list(v) if isinstance(v := data[f.name], list) else v for f in dataclasses.fields(Datum) if f.name in data}
    kwargs["sources"] = [TokenSource[s.upper()] for s in data["sources"]]
    return Datum(**kwargs)


def _scalar(value: Any) -> Any:
    if isinstance(value, int):  # bool included
        return value
    if isinstance(value, float):
        return _finite(value)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _MAX_FIELD_CHARS else text[:_MAX_FIELD_CHARS] + f"... [{len(text)} chars]"


def _question(row: Mapping[str, Any]) -> str | None:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages: the last user message is the question
        users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return None


def _role(traj: Trajectory, datum: Datum | None, in_update: bool, forwarded: bool | None,
          mask_truncated: bool, update_skipped: str | None = None) -> tuple[UpdateRole, str]:
    if update_skipped and in_update:
        return UpdateRole.UPDATE_SKIPPED, f"not trained on: the step's policy update was skipped ({update_skipped})"
    if not in_update:
        if traj.world_failure:
            why = f"the world failed ({traj.stop_reason}{': ' + traj.error if traj.error else ''})"
        elif traj.truncated and mask_truncated:
            why = "truncated, and truncated_policy='mask'"
        else:
            why = "too few members of its group survived the infrastructure (min_valid_group_fraction)"
        return UpdateRole.LEFT_OUT, f"not trained on: {why}"
    if datum is not None and all(a == 0.0 for a in datum.advantages):
        how = ("its forward/backward was skipped (drop_zero_advantage)" if forwarded is False else
               "it adds no policy-gradient signal")
        return UpdateRole.ZERO_ADVANTAGE, f"advantage 0: in the loss denominators, but {how}"
    return UpdateRole.TRAINED, "trained on"


def _turns(traj: Trajectory) -> list[dict]:
    out, pos = [], 0
    for i, turn in enumerate(traj.turns):
        start = len(turn.prompt_ids)
        call = None
        if turn.tool_call is not None:
            c = turn.tool_call
            call = {"name": c.name, "arguments": _scalar(c.arguments), "output": _scalar(c.output), "ok": c.ok,
                    "timed_out": c.timed_out, "output_truncated": c.output_truncated, "latency_s": _finite(c.latency_s),
                    "infra_error": c.infra_error}
        out.append({"index": i, "prompt_start": pos, "completion_start": start, "completion_end": start + len(turn.completion_ids),
                    "text": turn.text, "truncated": turn.truncated, "tool_call": call})
        pos = start + len(turn.completion_ids)
    return out


def make_batch(
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    tokenizer: Any = None,
    *,
    step: int | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
    masked: Sequence[bool] | None = None,
    forwarded: Collection[int] | None = None,
    mask_truncated: bool = False,
    max_trajectories: int | None = None,
    update_skipped: str | None = None,
) -> dict:
    """A saved batch (a JSON-ready dict) of the first ``max_trajectories`` of ``trajectories``.

    Args:
        trajectories: The step's trajectories, scored and with advantages.
        datums: The datums the update built (``datum.trajectory_index`` = place in ``trajectories``); a
            trajectory without one (masked out) gets a datum built here for display, with its advantage.
        tokenizer: Decodes each token on its own (``None``: token ids are shown instead).
        step: Optimizer step the page belongs to.
        rows: The dataset rows of the batch (``rows[traj.group_id]``): question and reference answer.
        masked: Per trajectory, True when the update left it out (:func:`~trl_plugins.trainers.batch.training_mask`);
            default: the trajectories without a datum in ``datums``.
        forwarded: Trajectory indices whose datum went through forward/backward (``None``: not recorded).
        mask_truncated: ``truncated_policy == 'mask'`` (only to say why a trajectory was left out).
        max_trajectories: Keep only the first N (``None``: all).
        update_skipped: Why the step made no policy update at all (``None``: it made one); every trajectory the
            update would have taken is then marked ``update_skipped``.

    Returns:
        ``{"format", "step", "created", "num_trajectories", "trajectories": [...]}``; each trajectory holds
        its ids, stop reason, reward components, advantage, ``update_role``/``update_note``, ``turns`` (token
        boundaries in the whole sequence, text, tool call), ``tokens`` (every id and its decoded string),
        ``datum`` (or ``datum_error``) and ``datum_for_display``.
    """
    by_index = {d.trajectory_index: d for d in datums}
    keep = list(trajectories)[: max_trajectories] if max_trajectories is not None else list(trajectories)
    out = []
    for i, traj in enumerate(keep):
        in_update = (not masked[i]) if masked is not None else i in by_index
        datum, for_display, error = by_index.get(i), False, None
        if datum is None:
            try:
                datum = build_datum(traj, advantage=traj.advantage if traj.advantage is not None else 0.0, trajectory_index=i)
                for_display = True
            except (DatumError, ValueError) as exc:
                error = str(exc)
        role, note = _role(traj, datum, in_update, None if forwarded is None else i in forwarded, mask_truncated,
                           update_skipped)
        entry: dict[str, Any] = {
            "index": i, "question_id": traj.question_id, "group_id": traj.group_id, "sample_index": traj.sample_index,
            "stop_reason": None if traj.stop_reason is None else str(traj.stop_reason),
            "stop_kind": ("terminated" if traj.terminated else "truncated" if traj.truncated else
                          "world_failure" if traj.world_failure else "unfinished"),
            "error": traj.error, "reward": _finite(traj.reward), "advantage": _finite(traj.advantage),
            "reward_components": [{"name": c.name, "value": _finite(c.value), "weight": _finite(c.weight)}
                                  for c in traj.reward_components],
            "policy_step": None if traj.policy_version is None else traj.policy_version.step,
            "update_role": str(role), "update_note": note, "turns": _turns(traj),
            "datum": None if datum is None else _datum_to_dict(datum), "datum_for_display": for_display, "datum_error": error,
        }
        if rows is not None and 0 <= traj.group_id < len(rows):
            row = rows[traj.group_id]
            entry["question"] = _question(row)
            answer = next((row[k] for k in _ANSWER_KEYS if k in row), None)
            entry["reference_answer"] = None if answer is None else _scalar(answer)
            entry["example"] = {k: _scalar(v) for k, v in row.items() if k not in _QUESTION_KEYS + _ANSWER_KEYS}
        if datum is not None:
            ids = list(datum.input_ids) + [datum.target_ids[-1]] if datum.target_ids else list(datum.input_ids)
            first = traj.turns[0].prompt_sources
            entry["first_source"] = _source_name(first[0] if first else TokenSource.PROMPT)
            entry["tokens"] = {"ids": ids, "strings": _decode(tokenizer, ids)}
        out.append(entry)
    return {
        "format": FORMAT, "step": step, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "num_trajectories": len(trajectories), "trajectories": out,
    }


def _decode(tokenizer: Any, ids: Sequence[int]) -> list[str] | None:
    if tokenizer is None:
        return None
    return list(tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open() honours the umask (mkstemp would make it 0600)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_batch(path: str | os.PathLike, trajectories: Sequence[Trajectory], datums: Sequence[Datum], tokenizer: Any = None,
               **kwargs: Any) -> dict:
    """Write :func:`make_batch` (same arguments) to ``path`` as JSON (atomically: a crash leaves the old file or
    none, never half of one). Returns the batch."""
    batch = make_batch(trajectories, datums, tokenizer, **kwargs)
    _write_atomic(Path(path), json.dumps(batch, allow_nan=False, ensure_ascii=False))
    return batch


def load_batch(path: str | os.PathLike) -> dict:
    """Read a saved batch.

    Raises:
        ViewerError: the file is missing, not JSON (e.g. cut short), or not a saved batch of this format.
    """
    p = Path(path)
    if not p.is_file():
        raise ViewerError(f"{p}: no such file. A saved batch is what the trainer writes every viewer_steps steps as "
                          f"output_dir/trajectories/step-<step>.json (or save_batch() writes).")
    try:
        batch = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ViewerError(f"{p} is not a text file ({exc}); give a saved batch (.json).") from None
    except json.JSONDecodeError as exc:
        raise ViewerError(f"{p} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); was it cut short "
                          f"or edited? Write it again with save_batch() or take another step's file.") from None
    if not isinstance(batch, dict) or batch.get("format") != FORMAT:
        got = batch.get("format") if isinstance(batch, dict) else type(batch).__name__
        raise ViewerError(f"{p} is not a saved trajectory batch: its format is {got!r}, expected {FORMAT!r}.")
    if not isinstance(batch.get("trajectories"), list):
        raise ViewerError(f"{p} has no 'trajectories' list; the file is damaged.")
    for i, t in enumerate(batch["trajectories"]):
        d = t.get("datum") if isinstance(t, dict) else None
        if d is not None:
            lengths = {k: len(d.get(k) or []) for k in ("target_ids", "behaviour_logprobs", "advantages", "action_mask", "sources")}
            if len(set(lengths.values())) != 1 or len(t.get("tokens", {}).get("ids", [])) != lengths["target_ids"] + 1:
                raise ViewerError(f"{p}: trajectory {i}'s datum arrays disagree in length ({lengths}, "
                                  f"{len(t.get('tokens', {}).get('ids', []))} tokens); the file is damaged.")
    return batch


# -- HTML ------------------------------------------------------------------------------------------

_CONTROL = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROL[0x7F] = "\u2421"


def display_text(token: str) -> str:
    """What a token's span shows: the token with control characters (``\\r``, NUL, ...) as visible symbols
    (U+2400...), since HTML cannot carry them; newlines and tabs stay (the page keeps whitespace)."""
    return token.translate(_CONTROL)


def _esc(value: Any) -> str:
    return html.escape(display_text("" if value is None else str(value)), quote=True)


def _num(x: Any) -> str:
    return "" if x is None else repr(float(x))


def _fmt(x: Any, spec: str = "+.3f") -> str:
    return "n/a" if x is None else format(float(x), spec)


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1d2127;background:#f6f7f9}
header{background:#22303f;color:#fff;padding:12px 20px}header h1{font-size:18px;margin:0 0 4px}
header .meta{opacity:.8;font-size:13px}main{padding:12px 20px 80px}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;background:#fff;border:1px solid #d8dde3;
 border-radius:6px;padding:8px 12px;margin:10px 0}.sw{display:inline-block;width:14px;height:14px;border-radius:3px;
 vertical-align:-2px;margin-right:4px;border:1px solid #0002}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #d8dde3;padding:3px 8px;text-align:left;font-size:13px}
th{background:#eef1f4}.traj{background:#fff;border:1px solid #d8dde3;border-radius:6px;margin:16px 0;padding:10px 14px}
.traj h2{font-size:15px;margin:0 0 6px}.badge{display:inline-block;border-radius:10px;padding:1px 8px;font-size:12px;
 margin-left:6px;color:#fff}.k-terminated{background:#2e7d32}.k-truncated{background:#e07b00}
.k-world_failure{background:#c62828}.k-unfinished{background:#6d6d6d}
.r-trained{background:#1f6fd1}.r-zero_advantage{background:#7a8794}.r-left_out{background:#8e24aa}.r-update_skipped{background:#b26a00}
.note{font-size:13px;margin:4px 0}.qa{font-size:13px;margin:4px 0;white-space:pre-wrap}
.tokens{font:12.5px/1.9 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;
 border:1px solid #e3e6ea;border-radius:4px;padding:8px;margin:8px 0;background:#fcfcfd}
.tok{border-radius:2px;padding:0 1px;cursor:default;box-shadow:inset -1px 0 0 #fffc}.tok:hover{outline:2px solid #22303f}
.s-prompt{background:#dde3ea}.s-action{background:#bfe8c4}.s-observation{background:#fde3b5}.s-glue{background:#e4d5f3}
.tok.m1{border-bottom:3px solid #9aa0a6}.tok.a-pos{border-bottom-color:#1f6fd1}.tok.a-neg{border-bottom-color:#d1321f}
.tok.first{font-style:italic}.nl::before{content:"\\21B5";opacity:.45}
.lp .tok.m1{background:rgba(46,160,67,var(--p,1))}
.turn-mark{display:block;font:600 11px/1.6 system-ui,sans-serif;color:#51606f;border-top:1px dashed #b7c0ca;margin:6px 0 2px}
.turn-mark.obs{color:#9a5b00}.first-prompt summary{font:12px system-ui,sans-serif;color:#51606f;cursor:pointer}.calls td{vertical-align:top}.calls pre{margin:0;white-space:pre-wrap;max-height:12em;overflow:auto}
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
    lines.push("source " + d.source + (d.index === undefined ? "  (first token: context only)" : "  position " + d.index));
    if (d.index !== undefined) {
      lines.push("loss mask " + d.mask);
      lines.push("behaviour log-prob " + (d.mask === "1" ? Number(d.logprob).toFixed(4) + "  (p=" + Math.exp(Number(d.logprob)).toFixed(3) + ")" : "n/a (not sampled)"));
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
    observations = {turn["prompt_start"]: turn["index"] for turn in t["turns"] if turn["index"] > 0}
    prompt_end = t["turns"][0]["completion_start"] if t["turns"] else 0
    parts = []
    for pos, tok_id in enumerate(ids):
        if pos == 0 and prompt_end:
            parts.append(f'<details class="first-prompt"><summary>first prompt: {prompt_end} tokens (system, user, '
                         f'template header); click to show</summary>')
        if pos == prompt_end and pos:
            parts.append("</details>")
        if pos in observations:
            parts.append(f'<span class="turn-mark obs" data-turn="{observations[pos]}">tool output and template glue, '
                         f'before turn {observations[pos] + 1}</span>')
        if pos in starts:
            parts.append(f'<span class="turn-mark" data-turn="{starts[pos]}">assistant turn {starts[pos] + 1}</span>')
        text = display_text(strings[pos]) if strings is not None else f"\u27e8{tok_id}\u27e9"
        nl = " nl" if "\n" in text else ""
        if pos == 0:
            src = t["first_source"]
            title = f"first token ({src}): context only, no datum position; id {tok_id}"
            parts.append(f'<span class="tok s-{src} first{nl}" data-pos="0" data-source="{src}" data-id="{tok_id}" '
                         f'title="{_esc(title)}">{html.escape(text, quote=True)}</span>')
            continue
        k = pos - 1
        src, mask, lp, adv = d["sources"][k], d["action_mask"][k], d["behaviour_logprobs"][k], d["advantages"][k]
        cls = f"tok s-{src} m{mask}{nl}"
        if mask:
            cls += " a-pos" if (adv or 0) > 0 else " a-neg" if (adv or 0) < 0 else " a-zero"
        ref = d.get("ref_logprobs")
        title = (f"#{k} {src} | mask {mask} | log-prob {_fmt(lp, '.4f') if mask else 'n/a'} | "
                 f"advantage {_fmt(adv, '+.4f') if mask else '0'} | id {tok_id}")
        extra = f' data-ref="{_num(ref[k])}"' if ref is not None else ""
        parts.append(f'<span class="{cls}" data-pos="{pos}" data-index="{k}" data-source="{src}" data-mask="{mask}" '
                     f'data-logprob="{_num(lp)}" data-adv="{_num(adv)}" data-id="{tok_id}"{extra} '
                     f'title="{_esc(title)}">{html.escape(text, quote=True)}</span>')
    if prompt_end >= len(ids):  # a first turn that sampled nothing: the prompt box is still open
        parts.append("</details>")
    return "".join(parts)


def _tool_calls(t: Mapping[str, Any]) -> str:
    rows = []
    for turn in t["turns"]:
        c = turn.get("tool_call")
        flags = ["cut at max_new_tokens"] if turn.get("truncated") else []
        if c is None:
            rows.append(f"<tr><td>{turn['index'] + 1}</td><td colspan=3>no tool call"
                        f"{' (' + ', '.join(flags) + ')' if flags else ''}</td></tr>")
            continue
        flags += [name for name, on in (("ok", c["ok"]), ("timed out", c["timed_out"]),
                                        ("output truncated", c["output_truncated"])) if on]
        if not c["ok"]:
            flags.append("failed")
        if c.get("infra_error"):
            flags.append(f"infrastructure error: {c['infra_error']}")
        latency = "" if c.get("latency_s") is None else f", {c['latency_s']:.3f} s"
        rows.append(f"<tr><td>{turn['index'] + 1}</td><td><b>{_esc(c['name'])}</b>{_esc(latency)}<br>{_esc(', '.join(flags))}</td>"
                    f"<td><pre>{_esc(c['arguments'])}</pre></td><td><pre>{_esc(c['output'])}</pre></td></tr>")
    return ("<table class=calls><tr><th>turn</th><th>tool call</th><th>arguments</th><th>output</th></tr>"
            + "".join(rows) + "</table>")


def _trajectory(t: Mapping[str, Any]) -> str:
    kind, role = t["stop_kind"], t["update_role"]
    head = (f'<h2>#{t["index"]} &middot; question {_esc(t["question_id"])} &middot; group {t["group_id"]}, '
            f'sample {t["sample_index"]}<span class="badge k-{_esc(kind)}" data-stop="{_esc(t["stop_reason"])}">'
            f'{_esc(t["stop_reason"])} ({_esc(kind.replace("_", " "))})</span>'
            f'<span class="badge r-{_esc(role)}">{_esc(role.replace("_", " "))}</span></h2>')
    parts = [f'<section class="traj" id="traj-{t["index"]}" data-trajectory="{t["index"]}" data-role="{_esc(role)}">', head]
    parts.append(f'<div class="note">reward <b>{_fmt(t["reward"], ".4f")}</b> &middot; advantage <b>{_fmt(t["advantage"], "+.4f")}</b>'
                 f' &middot; {_esc(t["update_note"])}'
                 + (f' &middot; sampled by the weights of step {t["policy_step"]}' if t.get("policy_step") is not None else "")
                 + "</div>")
    if t.get("error"):
        parts.append(f'<div class="note"><b>error:</b> {_esc(t["error"])}</div>')
    if t.get("question") is not None:
        parts.append(f'<div class="qa"><b>question:</b> {_esc(t["question"])}</div>')
    if t.get("reference_answer") is not None:
        parts.append(f'<div class="qa"><b>reference answer:</b> {_esc(t["reference_answer"])}</div>')
    if t.get("example"):
        fields = ", ".join(f"{k}={v}" for k, v in t["example"].items())
        parts.append(f'<div class="qa"><b>row:</b> {_esc(fields)}</div>')
    comps = t["reward_components"]
    if comps:
        body = "".join(f'<tr data-component="{_esc(c["name"])}"><td>{_esc(c["name"])}</td><td>{_fmt(c["value"], ".4f")}</td>'
                       f'<td>{_fmt(c["weight"], ".4g")}</td><td>{_fmt(None if c["value"] is None or c["weight"] is None else c["value"] * c["weight"], ".4f")}</td></tr>'
                       for c in comps)
        parts.append("<table class=rewards><tr><th>reward component</th><th>value</th><th>weight</th><th>weighted</th></tr>"
                     + body + "</table>")
    else:
        parts.append('<div class="note">no reward components (not scored)</div>')
    if t.get("datum") is not None:
        d = t["datum"]
        loss = sum(d["action_mask"])
        parts.append(f'<div class="note">{len(d["target_ids"]) + 1} tokens, {loss} of them sampled (loss mask 1)'
                     + (" &middot; datum built for display" if t.get("datum_for_display") else "")
                     + f' &middot; bootstrap mask {d["bootstrap_mask"]}</div>')
        parts.append(f'<div class="tokens">{_token_spans(t)}</div>')
    else:
        parts.append(f'<div class="note"><b>no datum:</b> {_esc(t.get("datum_error") or "none was built")}</div>')
        for turn in t["turns"]:
            parts.append(f'<div class="tokens"><span class="turn-mark">assistant turn {turn["index"] + 1}</span>'
                         f'{_esc(turn["text"])}</div>')
    if t["turns"]:
        parts.append(_tool_calls(t))
    parts.append("</section>")
    return "".join(parts)


def render_html(batch: Mapping[str, Any], *, max_trajectories: int | None = None, title: str | None = None) -> str:
    """A self-contained HTML page (inline CSS and JS, no external resources) of a saved batch.

    Args:
        batch: What :func:`make_batch` returns or :func:`load_batch` reads.
        max_trajectories: Draw only the first N.
        title: Page title (default: the step).

    Returns:
        The page. Its script sets ``body[data-ready="1"]`` once it ran, and collects JS errors into
        ``#js-errors`` and ``body[data-js-errors]`` (for a headless-browser check).
    """
    trajs = list(batch["trajectories"])[: max_trajectories] if max_trajectories is not None else list(batch["trajectories"])
    step = batch.get("step")
    title = title or (f"Trajectories, step {step}" if step is not None else "Trajectories")
    legend = "".join(f'<span><span class="sw s-{_source_name(s)}" data-source="{_source_name(s)}"></span>{label}</span>' for s, label in (
        (TokenSource.PROMPT, "prompt (system, user, first template header)"), (TokenSource.ACTION, "sampled action (trained)"),
        (TokenSource.OBSERVATION, "tool observation"), (TokenSource.GLUE, "template glue")))
    legend += ('<span>underline: <b style="color:#1f6fd1">advantage &gt; 0</b> / <b style="color:#d1321f">&lt; 0</b> / '
               '<b style="color:#9aa0a6">0</b> on loss-mask tokens; <i>italic</i>: first token (context only)</span>'
               '<label><input type="checkbox" id="shade"> shade sampled tokens by probability</label>')
    summary = "".join(
        f'<tr><td><a href="#traj-{t["index"]}">#{t["index"]}</a></td><td>{_esc(t["question_id"])}</td><td>{t["group_id"]}</td>'
        f'<td>{t["sample_index"]}</td><td>{len(t["turns"])}</td><td>{sum(1 for x in t["turns"] if x.get("tool_call"))}</td>'
        f'<td>{_esc(t["stop_reason"])}</td><td>{_fmt(t["reward"], ".3f")}</td><td>{_fmt(t["advantage"], "+.3f")}</td>'
        f'<td>{_esc(t["update_role"].replace("_", " "))}</td></tr>' for t in trajs)
    meta = (f'{len(trajs)} of {batch.get("num_trajectories", len(trajs))} trajectories of the batch'
            f'{" &middot; written " + _esc(batch["created"]) if batch.get("created") else ""} &middot; hover a token for its '
            f'datum values')
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{_esc(title)}</title><style>{_CSS}</style><script>{_HEAD_SCRIPT}</script></head>"
        f'<body data-ready="0" data-js-errors="0"><header><h1>{_esc(title)}</h1><div class="meta">{meta}</div></header><main>'
        '<div id="js-errors" hidden></div>'
        f'<div class="legend">{legend}</div>'
        "<table class=summary><tr><th>#</th><th>question</th><th>group</th><th>sample</th><th>turns</th><th>tool calls</th>"
        f"<th>stop reason</th><th>reward</th><th>advantage</th><th>update</th></tr>{summary}</table>"
        + "".join(_trajectory(t) for t in trajs)
        + '</main><div id="hover">hover a token</div>'
        f"<script>{_BODY_SCRIPT}</script></body></html>\n"
    )


def write_step_pages(output_dir: str | os.PathLike, step: int, trajectories: Sequence[Trajectory], datums: Sequence[Datum],
                     tokenizer: Any = None, *, log_to_wandb: bool = False, **kwargs: Any) -> tuple[Path, Path]:
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
    _write_atomic(html_path, page)
    if log_to_wandb:
        import wandb

        if wandb.run is not None:
            wandb.log({"trajectories/viewer": wandb.Html(page, inject=False, data_is_not_path=True)}, commit=False)
    return json_path, html_path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trl_plugins.viewer BATCH.json [-o OUT.html] [--max-trajectories N]``; exit 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m trl_plugins.viewer",
                                     description="Draw a saved trajectory batch (JSON) as a self-contained HTML page.")
    parser.add_argument("batch", help="a saved batch, e.g. output_dir/trajectories/step-000010.json")
    parser.add_argument("-o", "--output", help="the page to write (default: the batch's path with .html)")
    parser.add_argument("--max-trajectories", type=int, default=None, help="draw only the first N trajectories")
    args = parser.parse_args(argv)
    if args.max_trajectories is not None and args.max_trajectories < 1:
        parser.error(f"--max-trajectories must be >= 1, got {args.max_trajectories}")
    source = Path(args.batch)
    out = Path(args.output) if args.output else source.with_suffix(".html")
    if out.resolve() == source.resolve():
        parser.error(f"the output {out} is the batch itself; give another -o")
    try:
        batch = load_batch(source)
        page = render_html(batch, max_trajectories=args.max_trajectories)
    except ViewerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        print(f"error: {source} is a saved batch but cannot be drawn ({type(exc).__name__}: {exc}); the file is damaged "
              f"or from another version of trl_plugins.", file=sys.stderr)
        return 2
    _write_atomic(out, page)
    shown = len(batch["trajectories"]) if args.max_trajectories is None else min(args.max_trajectories, len(batch["trajectories"]))
    print(f"wrote {out} ({shown} trajectories)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
