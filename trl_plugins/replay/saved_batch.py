"""Replay a saved batch: re-derive what was trained from its saved tokens and name the first difference.

:func:`replay_batch` runs, per trajectory, the checks a saved batch (format 3) allows, and reports for each the first
thing that differs and where (trajectory, turn, token index, the token text on both sides):

1. **rendering**: the first prompt rendered again from the saved row (and the saved system prompt) with the current
   tokenizer and chat template, and every later turn's prompt rebuilt as ``previous prompt + previous completion +
   the tool turn`` (:meth:`~trl_plugins.rollout.ChatFormat.tool_results_turn` of the saved tool outputs);
2. **logprobs** (a model given): each action token's log-prob recomputed with a plain forward and compared with the
   saved behaviour log-prob (max and p99 of the difference; tokens beyond the tolerance, which depends on the saved
   precision and sampler: :func:`default_tolerance`). Only trajectories sampled at the model's step are compared;
   with ``resample=True`` each seeded turn is also regenerated from its saved prompt, seed and sampling settings
   (HF generate and continuous-batching batches) and the first token drawn differently is named;
   **teacher** (a teacher given; on-policy distillation): each action token's teacher log-prob recomputed with the
   teacher the saved version names (its weights digest checked first: :func:`teacher_identity`) at the sampling
   temperature, and compared with the saved one the same way, for every trajectory (the teacher does not train);
3. **tools** (``tools=True``): every call of an idempotent tool run again, its output compared and its observation
   tokens re-derived from the new output (a tool that is not idempotent is skipped, and said);
4. **rewards** (``rewards=True``): every reward component recomputed and compared with the saved value, and the
   stop reason re-derived from the saved turns by the rollout's rules (its ``rederive_stop``);
5. **datum**: the datum built again (:func:`~trl_plugins.datum.build_datum`) from the trajectory the saved tokens,
   turns and behaviour log-probs describe, compared field by field (ids, mask, sources, log-probs, advantages).

Before any check it compares the saved version with the current one and refuses (:class:`ReplayRefused`, naming what
changed) when the tokenizer digest, the tool schemas or a verifier's (reward component's), tool's or (with
``rewards``) the rollout's version differ;
``anyway=True`` runs the comparison regardless, and the report says so on every line.

A format-2 file (before the version was saved) replays with what it holds: no version to check, the first prompt
rebuilt from the saved question alone (one user message, no system prompt) and tool outputs that were cut at 4,000
characters, so a long output cannot be compared.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Mapping

import torch

from trl_plugins.datum import DatumError, build_datum
from trl_plugins.replay.logprob_check import check_logprobs, nan_for_none, turn_of
from trl_plugins.replay.report import (
    CHECKS,
    Difference,
    ReplayRefused,
    ReplayReport,
    default_tolerance,
    first_mismatch,
    token_text,
)
from trl_plugins.rollout.chat import ChatFormat, tokenizer_digest
from trl_plugins.run.version import plugin_versions, tool_schemas_digest
from trl_plugins.types import (
    LogprobSource,
    PolicyVersion,
    RewardComponent,
    SamplingSettings,
    StopReason,
    TokenSource,
    ToolCall,
    Trajectory,
    Turn,
)
from trl_plugins.viewer.batch import datum_from_dict

__all__ = [
    "Difference",
    "ReplayReport",
    "ReplayRefused",
    "replay_batch",
    "saved_trajectory",
    "teacher_identity",
    "default_tolerance",
    "CHECKS",
]


def saved_trajectory(entry: Mapping[str, Any]) -> Trajectory:
    """The :class:`~trl_plugins.types.Trajectory` a saved batch's entry describes: each turn's prompt and completion
    cut from the saved token ids at the saved turn boundaries, behaviour log-probs and provenance from the saved
    datum (position ``p``'s are at datum index ``p - 1``), tool calls, stop reason, reward components, version.

    Raises:
        ValueError: the entry holds no datum (it could not be built when the batch was saved) or a segmented turn.
    """
    datum = entry.get("datum")
    if datum is None:
        raise ValueError(f"no datum was saved ({entry.get('datum_error') or 'none recorded'})")
    ids = list(entry["tokens"]["ids"])
    logprobs = [math.nan] + [nan_for_none(x) for x in datum["behaviour_logprobs"]]
    sources = [TokenSource[entry.get("first_source", "prompt").upper()]] + [
        TokenSource[s.upper()] for s in datum["sources"]
    ]
    turns, added = [], 0  # added: where the tokens this turn's prompt adds begin
    for t in entry["turns"]:
        start, end = t["completion_start"], t["completion_end"]
        if t.get("segment_start") or start < added:
            raise ValueError("it has a segmented turn (a rewritten conversation), which the replay does not rebuild")
        calls = [
            ToolCall(
                name=c["name"],
                arguments=c["arguments"],
                output=c["output"] or "",
                ok=bool(c["ok"]),
                timed_out=bool(c["timed_out"]),
                output_truncated=bool(c["output_truncated"]),
                infra_error=c.get("infra_error"),
            )
            for c in t["tool_calls"]
        ]
        turn = Turn(
            prompt_ids=ids[:start],
            completion_ids=ids[start:end],
            completion_logprobs=logprobs[start:end],
            text=t["text"],
            prompt_sources=sources[added:start],
            completion_sources=sources[start:end],
            truncated=bool(t["truncated"]),
            tool_calls=calls,
            policy_step=t.get("policy_step"),
            seed=t.get("seed"),
        )
        turns.append(turn)
        added = end
    pv = entry.get("policy_version")
    version = (
        None
        if pv is None
        else PolicyVersion(
            step=pv["step"],
            tokenizer_digest=pv["tokenizer_digest"],
            weights_digest=pv.get("weights_digest"),
            sampling=SamplingSettings(**pv["sampling"]),
            logprob_source=LogprobSource(pv["logprob_source"]),
            run_digest=pv.get("run_digest"),
        )
    )
    return Trajectory(
        turns=turns,
        question_id=entry["question_id"],
        group_id=entry["group_id"],
        sample_index=entry["sample_index"],
        stop_reason=None if entry.get("stop_reason") is None else StopReason(entry["stop_reason"]),
        reward_components=[
            RewardComponent(c["name"], nan_for_none(c["value"]), nan_for_none(c["weight"]))
            for c in entry["reward_components"]
        ],
        advantage=entry.get("advantage"),
        policy_version=version,
        error=entry.get("error"),
    )


def _messages(batch: Mapping[str, Any], entry: Mapping[str, Any]) -> list[dict]:
    chat = batch.get("chat") or {}
    system = [{"role": "system", "content": chat["system_prompt"]}] if chat.get("system_prompt") else []
    row = entry.get("row")
    prompt = row.get("prompt") if isinstance(row, Mapping) else entry.get("question")
    return system + ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or []))


def _version_gate(batch: Mapping[str, Any], tokenizer: Any, run: Any, *, tools: bool, rewards: bool) -> list[str]:
    saved = batch.get("version")
    if saved is None:
        return []
    out = []
    now = tokenizer_digest(tokenizer)
    if saved["tokenizer_digest"] != now:
        out.append(
            f"tokenizer/chat-template digest: {saved['tokenizer_digest']} (saved) vs {now} (current): the saved "
            f"ids mean other text with this tokenizer, or the template renders other tokens"
        )
    if run is not None:
        current = tool_schemas_digest(run.chat.tools)
        if current != saved["tool_schemas_digest"]:
            out.append(
                f"tool schemas digest: {saved['tool_schemas_digest']} (saved) vs {current} (current): the model "
                f"was shown other tools than the run now has"
            )
    versions = saved.get("plugin_versions") or {}
    plugins = [(f"reward/{r.name}", r) for r in (run.rewards if run is not None and rewards else [])]
    plugins += [(f"tool/{n}", t) for n, t in (run.tools.items() if run is not None and tools else [])]
    if run is not None and rewards:  # the stop reason is re-derived by the rollout's rules
        plugins.append((f"rollout/{run.rollout.name}", run.rollout))
    why = {
        "reward": "the verifier changed: it may score the same trajectory differently",
        "tool": "the tool changed: its outputs may differ",
        "rollout": "the rollout's rules changed",
    }
    for root, plugin in plugins:
        if root not in versions:
            continue  # saved before this plugin's version was recorded
        current = plugin_versions(root, plugin)
        for key in sorted({k for k in (*versions, *current) if k == root or k.startswith(root + "/")}):
            a, b = versions.get(key, "absent"), current.get(key, "absent")
            if a != b:
                out.append(f"{key} version: {a} (saved) vs {b} (current): {why[root.split('/')[0]]}")
    return out


def _chat(batch: Mapping[str, Any], tokenizer: Any, run: Any) -> ChatFormat:
    if run is not None and run.chat is not None and run.chat.tokenizer is tokenizer:
        return run.chat
    c = batch.get("chat") or {}
    return ChatFormat(
        tokenizer,
        batch.get("tool_schemas") or [],
        final_answer_pattern=c.get("final_answer_pattern"),
        stop_tokens=c.get("stop_tokens"),
        calls_per_turn=c.get("calls_per_turn") or 1,
        **(c.get("chat_template_kwargs") or {}),
    )


def _rerun_tools(run: Any, traj: Trajectory, i: int, report: ReplayReport) -> list[list[str]]:
    from trl_plugins.rollout.engine import call_tool

    outputs: list[list[str]] = []
    for t, turn in enumerate(traj.turns):
        mine = []
        for call in turn.tool_calls:
            tool = run.tools.get(call.name)
            if tool is None or not tool.idempotent or call.infra_error:
                why = (
                    "the run has no such tool"
                    if tool is None
                    else "it is not idempotent"
                    if not tool.idempotent
                    else "it failed in the infrastructure"
                )
                report.notes.append(
                    f"trajectory {i}, turn {t}: tool call {call.name!r} not re-run ({why}); its saved output stands"
                )
                mine.append(call.output)
                continue
            out = asyncio.run(call_tool(tool, dict(call.arguments)))
            mine.append(out.text)
        outputs.append(mine)
    return outputs


def _check_rendering(
    chat: ChatFormat,
    batch: Mapping[str, Any],
    entry: Mapping[str, Any],
    traj: Trajectory,
    i: int,
    outputs: list[list[str]] | None,
    check: str,
) -> Difference | None:
    tok = chat.tokenizer
    turns = traj.turns
    first = chat.initial_prompt_ids(_messages(batch, entry))
    k = first_mismatch(turns[0].prompt_ids, first)
    if k is not None:
        return Difference(
            check,
            i,
            "the first prompt renders differently",
            0,
            k,
            token_text(tok, turns[0].prompt_ids, k),
            token_text(tok, first, k),
        )
    mtr = (batch.get("chat") or {}).get("max_tool_response_tokens")
    for t in range(1, len(turns)):
        prev = turns[t - 1]
        results = [(c.name, outputs[t - 1][j] if outputs else c.output) for j, c in enumerate(prev.tool_calls)]
        if outputs and check == "tools":
            for j, c in enumerate(prev.tool_calls):
                if outputs[t - 1][j] != c.output:
                    expected = (
                        prev.prompt_ids
                        + prev.completion_ids
                        + chat.tool_results_turn(prev.completion_ids, results, max_tokens=mtr).ids
                    )
                    k = first_mismatch(turns[t].prompt_ids, expected)
                    return Difference(
                        check,
                        i,
                        f"tool call {j} ({c.name!r}) returned {outputs[t - 1][j][:80]!r} where "
                        f"it returned {c.output[:80]!r}",
                        t - 1,
                        k,
                        None if k is None else token_text(tok, turns[t].prompt_ids, k),
                        None if k is None else token_text(tok, expected, k),
                    )
            continue
        if not results:
            continue  # a turn after one without calls is the rollout's own continuation: nothing to re-derive
        expected = (
            prev.prompt_ids
            + prev.completion_ids
            + chat.tool_results_turn(prev.completion_ids, results, max_tokens=mtr).ids
        )
        k = first_mismatch(turns[t].prompt_ids, expected)
        if k is not None:
            return Difference(
                check,
                i,
                f"the tool turn after turn {t - 1} renders differently",
                t,
                k,
                token_text(tok, turns[t].prompt_ids, k),
                token_text(tok, expected, k),
            )
    return None


def teacher_identity(batch: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(where, identity)`` of the teacher the saved batch's version names (``plugin_versions["teacher"]``), or None
    when it was trained without one: a local teacher's ``(path, weights digest)`` (written ``"<path> weights
    <digest>"``), a server teacher's ``(url, "model <name> server <version>")``.

    Raises:
        ReplayRefused: the batch was distilled from several teachers routed by a row field.
    """
    versions = (batch.get("version") or {}).get("plugin_versions") or {}
    routed = sorted(k for k in versions if k.startswith("teacher/"))
    if routed:
        raise ReplayRefused(
            f"the saved batch was distilled from {len(routed)} teachers routed by a row field "
            f"({', '.join(routed)}): --teacher re-derives one teacher's log-probs, not routed ones yet; replay "
            f"without --teacher."
        )
    entry = versions.get("teacher")
    if not entry:
        return None
    entry = str(entry)
    if entry.startswith(("http://", "https://")):
        url, _, rest = entry.partition(" ")
        return url, rest
    path, _, digest = entry.rpartition(" weights ")
    return path, digest


def _check_teacher(
    batch: Mapping[str, Any],
    teacher: Any,
    tok: Any,
    entries: list[tuple[int, Mapping, Trajectory]],
    tolerance: float | None,
    anyway: bool,
    report: ReplayReport,
) -> None:
    from trl_plugins.rollout.weights import weights_digest

    named = teacher_identity(batch)
    if named is None:
        raise ReplayRefused(
            "--teacher: the saved batch names no teacher (its run distilled from none): replay without --teacher."
        )
    local = isinstance(teacher, torch.nn.Module)
    digest = weights_digest(teacher) if local else teacher.identity().partition(" ")[2]
    if digest != named[1]:
        what = (
            f"teacher weights digest: {named[1]} (saved, {named[0]}) vs {digest} (given)"
            if local
            else f"teacher server: {named[1]} (saved, {named[0]}) vs {digest} (given, {teacher.url})"
        )
        if not anyway:
            raise ReplayRefused(
                f"the teacher given is not the one the batch was distilled from: {what}. Give the teacher the saved "
                f"version names ({named[0]}), or pass --anyway to compare regardless (labelled)."
            )
        report.ran_anyway.append(what)
    with_logprobs = [(i, e, t) for i, e, t in entries if e["datum"].get("teacher_logprobs") is not None]
    report.notes += [
        f"trajectory {i}: no teacher log-probs saved (its datum was built before the teacher phase)"
        for i, e, _ in entries
        if e["datum"].get("teacher_logprobs") is None
    ]
    pv = next((t.policy_version for _, _, t in with_logprobs if t.policy_version), None)
    tol = (
        tolerance
        if tolerance is not None
        else default_tolerance(batch.get("version"), None if pv is None else str(pv.logprob_source))
    )
    report.compared["teacher"] = len(with_logprobs)
    check_logprobs(teacher, tok, with_logprobs, tol, report, saved_field="teacher_logprobs", check="teacher")


def _check_rewards(
    run: Any, batch: Mapping[str, Any], entry: Mapping[str, Any], traj: Trajectory, i: int
) -> Difference | None:
    from trl_plugins.rewards import reward_value

    row = entry.get("row")
    if not isinstance(row, Mapping):
        return Difference(
            "rewards", i, "no dataset row was saved (a format-2 file): the components cannot be recomputed"
        )
    saved = {c.name: c.value for c in traj.reward_components}
    for component in run.rewards:
        if component.name not in saved:
            return Difference(
                "rewards", i, f"component {component.name!r} was not saved", None, None, "absent", "present"
            )
        value = reward_value(component(traj, row))
        if not math.isclose(value, saved[component.name], rel_tol=1e-9, abs_tol=1e-12):
            return Difference(
                "rewards",
                i,
                f"component {component.name!r} scores it differently",
                None,
                None,
                repr(saved[component.name]),
                repr(value),
            )
    return None


_WORLD_STOPS = (StopReason.CANCELLED, StopReason.VERIFIER_ERROR)


def _check_stop(run: Any, chat: ChatFormat, traj: Trajectory, i: int, report: ReplayReport) -> Difference | None:
    """The stop reason the rollout's rules give the saved turns, against the saved one (None: equal, or not
    derivable, which a note says)."""
    saved, last = traj.stop_reason, len(traj.turns) - 1
    if saved in _WORLD_STOPS:
        report.notes.append(
            f"trajectory {i}: its stop reason {saved} was set by the world around the rollout, not by "
            f"its turns: not re-derived"
        )
        return None
    turn, reason = run.rollout.rederive_stop_fn(traj, chat)
    if turn < last:
        return Difference(
            "stop_reason",
            i,
            f"the rollout's rules now end it after turn {turn} ({reason}), but it went "
            f"on to turn {last} and ended {saved}",
            max(turn, 0),
            None,
            "another turn",
            str(reason),
        )
    if reason != saved:
        return Difference(
            "stop_reason",
            i,
            "the stop reason re-derived from its saved turns differs",
            last,
            None,
            str(saved),
            "another turn" if reason is None else str(reason),
        )
    return None


_RESAMPLERS = ("hf_generate", "continuous_batching")
"""Samplers whose seeded draws :func:`_check_resample` reproduces: both draw a turn's tokens from its seed and the
token's index alone (:mod:`trl_plugins.rollout.sampling`), in the training process."""


def _why_not_resampled(batch: Mapping[str, Any], traj: Trajectory) -> str | None:
    version = batch.get("version")
    if version is None:
        return "no version was saved (a format-2 file), so the sampler that drew it is unknown"
    if version.get("sampler") not in _RESAMPLERS:
        return (
            f"it was sampled by {version.get('sampler') or 'an unrecorded sampler'}, whose seeded draws are made "
            f"inside the vLLM engine; only {' and '.join(_RESAMPLERS)} batches are regenerated (with transformers)"
        )
    if traj.policy_version is None:
        return "no policy version was saved, so its sampling settings are unknown"
    missing = [t for t, turn in enumerate(traj.turns) if turn.seed is None]
    if missing:
        return (
            f"no sampling seed was saved for turn(s) {missing} (a batch saved before seeds were recorded, or a "
            f"rollout that does not record Turn.seed)"
        )
    return None


def _check_resample(
    model: Any, chat: ChatFormat, entries: list[tuple[int, Mapping, Trajectory]], step: int | None, report: ReplayReport
) -> None:
    from trl_plugins.rollout.backends import HFGenerationBackend

    tok = chat.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else chat.stop_token_ids[0]
    for i, _, traj in entries:
        backend = HFGenerationBackend(
            model, pad_token_id=pad, stop_token_ids=chat.stop_token_ids, sampling=traj.policy_version.sampling
        )
        steps = traj.turn_policy_steps()
        for t, turn in enumerate(traj.turns):
            if step is not None and steps[t] != step:
                report.notes.append(
                    f"trajectory {i}, turn {t}: sampled at step {steps[t]}, not resampled with step {step}'s weights"
                )
                continue
            if not turn.completion_ids:
                continue
            (sample,) = backend.generate([turn.prompt_ids], [len(turn.completion_ids)], seeds=[turn.seed])
            k = first_mismatch(turn.completion_ids, sample.token_ids)
            if k is not None:
                report.differences.append(
                    Difference(
                        "resample",
                        i,
                        f"turn {t} draws other tokens from its seed {turn.seed}",
                        t,
                        len(turn.prompt_ids) + k,
                        token_text(tok, turn.completion_ids, k) or "end",
                        token_text(tok, sample.token_ids, k) or "end",
                    )
                )
                break  # later turns' prompts follow the saved tokens, not these


def _check_datum(entry: Mapping[str, Any], traj: Trajectory, i: int, tok: Any) -> Difference | None:
    saved = datum_from_dict(entry["datum"])
    try:
        rebuilt = build_datum(traj, advantage=traj.advantage if traj.advantage is not None else 0.0, trajectory_index=i)
    except (DatumError, ValueError) as exc:
        return Difference("datum", i, f"the datum can no longer be built ({exc})")
    per_token_advantage = len({a for a, m in zip(saved.advantages, saved.action_mask) if m}) > 1  # a critic's GAE
    ids = entry["tokens"]["ids"]
    for name in ("input_ids", "target_ids", "action_mask", "sources", "behaviour_logprobs", "advantages"):
        if name == "advantages" and per_token_advantage:
            continue
        a, b = list(getattr(saved, name)), list(getattr(rebuilt, name))
        same = [
            x == y
            or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
            or (x is None and isinstance(y, float) and math.isnan(y))
            for x, y in zip(a, b)
        ]
        if len(a) != len(b) or not all(same):
            k = same.index(False) if not all(same) else min(len(a), len(b))
            return Difference(
                "datum",
                i,
                f"{name} differs (token {token_text(tok, ids, k + 1)})",
                turn_of(traj, k + 1),
                k + 1,
                repr(a[k]) if k < len(a) else "end",
                repr(b[k]) if k < len(b) else "end",
            )
    return None


def replay_batch(
    batch: Mapping[str, Any],
    tokenizer: Any,
    *,
    model: Any = None,
    model_step: int | None = None,
    run: Any = None,
    tools: bool = False,
    rewards: bool = False,
    resample: bool = False,
    anyway: bool = False,
    tolerance: float | None = None,
    teacher: Any = None,
) -> ReplayReport:
    """Re-derive a saved batch (:func:`~trl_plugins.viewer.load_batch`) and report the first difference per
    trajectory and check (module docstring).

    Args:
        batch: The saved batch.
        tokenizer: The current tokenizer (its chat template is the current one).
        model: Weights to recompute the behaviour log-probs with (None: not compared).
        model_step: The optimizer step of ``model`` (0: the base model); only trajectories sampled at that step are
            compared, the others are named in the notes. None with ``anyway``: every trajectory.
        run: The current run (:class:`~trl_plugins.run.Run`, tokenizer bound): its tool schemas and plugin versions
            are checked, and its tools and reward components re-run with ``tools``/``rewards``.
        tools, rewards: Re-run the idempotent tool calls / the reward components and re-derive the stop reasons
            (need ``run``).
        resample: Regenerate each seeded turn with ``model`` (needed) from its saved prompt, seed and sampling
            settings, and name the first token that differs.
        anyway: Compare even when the version differs; the report is then never ``ok``.
        tolerance: Largest accepted log-prob difference (None: :func:`default_tolerance`).
        teacher: The teacher the saved version names (on-policy distillation): its log-probs of every trajectory's
            action tokens are re-derived and compared with the saved ones (None: not compared).

    Raises:
        ReplayRefused: the version differs (and not ``anyway``), ``model_step`` matches no trajectory's step, or
            ``resample`` and no trajectory holds what regenerating it needs (each one's missing piece named), or
            ``teacher`` is not the one the saved version names (its weights digest; not with ``anyway``) or the batch
            names none.
        ValueError: ``tools``/``rewards`` without a run, ``resample`` without a model.
    """
    if (tools or rewards) and run is None:
        raise ValueError("tools=True and rewards=True re-run the run's plugins: pass run= (resolve_run(config)).")
    if resample and model is None:
        raise ValueError(
            "resample=True regenerates the turns with the weights that sampled them: pass model= (the "
            "checkpoint of the batch's policy_step)."
        )
    report = ReplayReport()
    if run is not None and run.chat is None:
        run.bind_tokenizer(tokenizer)  # its tool schemas as the model would now be shown them
    if run is not None and tools:
        run.start_tools()  # a tool's versions() may need it started (an MCP server reports its version on connect)
    changed = _version_gate(batch, tokenizer, run, tools=tools, rewards=rewards)
    if changed and not anyway:
        raise ReplayRefused(
            "the saved batch was made with another version than the current one:\n  - "
            + "\n  - ".join(changed)
            + "\nReplay with the run's own tokenizer, tools and components "
            "(e.g. --checkpoint of that run), or pass --anyway to compare regardless (labelled)."
        )
    report.ran_anyway = changed
    if batch.get("version") is None:
        report.notes.append(
            f"{batch.get('format')}: no version was saved, so none was checked; the first prompt is "
            f"rebuilt from the saved question alone and tool outputs over 4,000 characters were cut"
        )
    chat = _chat(batch, tokenizer, run)
    entries = []
    for i, entry in enumerate(batch["trajectories"]):
        try:
            entries.append((i, entry, saved_trajectory(entry)))
        except ValueError as exc:
            report.notes.append(f"trajectory {i} not replayed: {exc}")
    version_of = {i: traj.policy_version for i, _, traj in entries}
    checks: list[tuple[str, Any]] = [("rendering", None)]
    if tools:
        checks.append(("tools", None))
    for check, _ in checks:
        report.compared[check] = len(entries)
        for i, entry, traj in entries:
            outputs = _rerun_tools(run, traj, i, report) if check == "tools" else None
            found = _check_rendering(chat, batch, entry, traj, i, outputs, check)
            if found is not None:
                report.differences.append(found)
    if model is not None:
        steps = sorted({v.step for v in version_of.values() if v is not None})
        chosen = [
            (i, e, t)
            for i, e, t in entries
            if model_step is None or (t.policy_version and t.policy_version.step == model_step)
        ]
        if not chosen and not anyway:
            raise ReplayRefused(
                f"the weights given are step {model_step}, but the batch was sampled at step(s) {steps}: "
                f"a batch is sampled by the weights of its trajectories' policy_step, not those of the "
                f"step that trained on it. Give checkpoint-{steps[0] if steps else 'N'} (the base model "
                f"for step 0), or pass --anyway to measure the gap to these weights."
            )
        at_step = model_step if chosen else None  # None: every turn is compared with these weights (anyway)
        if not chosen:
            report.ran_anyway.append(f"weights of step {model_step} compared with tokens sampled at step(s) {steps}")
            chosen = entries
        for i, _, t in entries:
            if (i, _, t) not in chosen:
                report.notes.append(
                    f"trajectory {i} sampled at step {t.policy_version.step if t.policy_version else '?'}: "
                    f"its log-probs are not compared with step {model_step}'s weights"
                )
        pv = next((t.policy_version for _, _, t in chosen if t.policy_version), None)
        tol = (
            tolerance
            if tolerance is not None
            else default_tolerance(batch.get("version"), None if pv is None else str(pv.logprob_source))
        )
        report.compared["logprobs"] = len(chosen)
        check_logprobs(model, tokenizer, chosen, tol, report)
        if resample:
            why = {i: _why_not_resampled(batch, t) for i, _, t in chosen}
            able = [(i, e, t) for i, e, t in chosen if why[i] is None]
            if not able:
                raise ReplayRefused(
                    "--resample: no trajectory of this batch can be regenerated deterministically:\n  - "
                    + "\n  - ".join(f"trajectory {i}: {w}" for i, w in why.items())
                    + "\nReplay without --resample (the log-prob check compares these weights with "
                    "the saved tokens all the same)."
                )
            report.notes += [f"trajectory {i} not resampled: {w}" for i, w in why.items() if w is not None]
            report.compared["resample"] = len(able)
            _check_resample(model, chat, able, at_step, report)
    if teacher is not None:
        _check_teacher(batch, teacher, tokenizer, entries, tolerance, anyway, report)
    if rewards:
        report.compared["rewards"] = len(entries)
        report.differences += [d for i, e, t in entries if (d := _check_rewards(run, batch, e, t, i)) is not None]
        if run.rollout.rederive_stop_fn is None:
            report.notes.append(
                f"{run.rollout.label} declares no rederive_stop(trajectory, chat): the stop reasons are not re-derived"
            )
        else:
            report.compared["stop_reason"] = len(entries)
            report.differences += [d for i, _, t in entries if (d := _check_stop(run, chat, t, i, report)) is not None]
    report.compared["datum"] = len(entries)
    report.differences += [d for i, e, t in entries if (d := _check_datum(e, t, i, tokenizer)) is not None]
    return report
