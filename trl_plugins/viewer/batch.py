"""A step's trajectories and their datums as a *saved batch*: a JSON-ready dict (``FORMAT``), written and read back.

Each trajectory carries its tokens, turns and tool calls, its reward components and advantage, its datum, and
its role in the update (trained on, advantage 0, left out, update skipped) with the reason the trainer recorded.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import os
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from trl_plugins.datum import DatumError, build_datum
from trl_plugins.types import Datum, LeftOutReason, PolicyVersion, RunVersion, TokenSource, Trajectory

__all__ = [
    "FORMAT",
    "READABLE_FORMATS",
    "UpdateRole",
    "ViewerError",
    "make_batch",
    "save_batch",
    "load_batch",
    "datum_from_dict",
]

FORMAT = "trl_plugins.viewer/3"
"""Value of a saved batch's ``format`` key. Format 3 holds the full dataset rows, tool arguments and outputs (format 2
cut each at 4,000 characters), the tool schemas the model was shown, the run's version (``version``: a
:class:`~trl_plugins.types.RunVersion` dict, with its ``digest``) and each trajectory's ``policy_version``.
:func:`load_batch` also reads format 2 (``version`` and ``tool_schemas`` then None: a replay can re-derive its tokens
and datums, but not check the run's version, and a cut tool output cannot be compared); format 2 held
``tool_calls`` (a list) where format 1 held one ``tool_call``, which is refused."""

READABLE_FORMATS = ("trl_plugins.viewer/2", FORMAT)
"""The formats :func:`load_batch` reads."""

_QUESTION_KEYS = ("prompt",)
_ANSWER_KEYS = ("answer", "reference_answer", "solution", "ground_truth")


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


def source_name(source: Any) -> str:
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
        "input_ids": list(d.input_ids),
        "target_ids": list(d.target_ids),
        "behaviour_logprobs": _floats(d.behaviour_logprobs),
        "advantages": _floats(d.advantages),
        "action_mask": [int(m) for m in d.action_mask],
        "sources": [source_name(s) for s in d.sources],
        "trajectory_index": d.trajectory_index,
        "group_id": d.group_id,
        "bootstrap_mask": d.bootstrap_mask,
    }
    for name in ("ref_logprobs", "teacher_logprobs", "old_logprobs", "old_values", "returns"):
        value = getattr(d, name)
        if value is not None:
            out[name] = _floats(value)
    for name in ("turn_ids", "behaviour_steps"):
        value = getattr(d, name)
        if value is not None:
            out[name] = [int(k) for k in value]
    if d.teacher_top is not None:
        out["teacher_top"] = [[[int(tok), _finite(lp)] for tok, lp in top] for top in d.teacher_top]
    return out


def datum_from_dict(data: Mapping[str, Any]) -> Datum:
    """The :class:`~trl_plugins.types.Datum` a saved batch stores (a ``trajectories[i]["datum"]`` entry; copied)."""
    kwargs = {
        f.name: list(v) if isinstance(v := data[f.name], list) else v
        for f in dataclasses.fields(Datum)
        if f.name in data
    }
    kwargs["sources"] = [TokenSource[s.upper()] for s in data["sources"]]
    return Datum(**kwargs)


def _scalar(value: Any) -> Any:
    if isinstance(value, int):  # bool included
        return value
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, str) or value is None:
        return value
    try:  # JSON-ready values are kept whole (format 3 cuts nothing); anything else is written as its JSON text
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return json.dumps(value, default=str)


def _question(row: Mapping[str, Any]) -> str | None:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages: the last user message is the question
        users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    return None


_LEFT_OUT_NOTES = {
    LeftOutReason.TRUNCATED: "truncated, and truncated_policy='mask'",
    LeftOutReason.GROUP_TOO_SMALL: "too few members of its group survived the infrastructure "
    "(min_valid_group_fraction)",
    LeftOutReason.EQUAL_REWARDS: "dynamic sampling dropped its group: its members' rewards were all equal",
    LeftOutReason.SURPLUS: "dynamic sampling dropped its group: the batch was full before it was drawn",
    LeftOutReason.FILLER: "dynamic sampling drew it only so that every rank generates; never kept",
}


def _role(
    traj: Trajectory,
    datum: Datum | None,
    left_out: LeftOutReason | None,
    in_update: bool,
    forwarded: bool | None,
    update_skipped: str | None = None,
) -> tuple[UpdateRole, str]:
    if update_skipped and in_update:
        return UpdateRole.UPDATE_SKIPPED, f"not trained on: the step's policy update was skipped ({update_skipped})"
    if not in_update:
        if left_out == LeftOutReason.WORLD_FAILURE:
            why = f"the world failed ({traj.stop_reason}{': ' + traj.error if traj.error else ''})"
        else:
            why = _LEFT_OUT_NOTES.get(left_out, "left out of the update (no reason recorded)")
        return UpdateRole.LEFT_OUT, f"not trained on: {why}"
    if datum is not None and all(a == 0.0 for a in datum.advantages):
        how = (
            "its forward/backward was skipped (drop_zero_advantage)"
            if forwarded is False
            else "it adds no policy-gradient signal"
        )
        return UpdateRole.ZERO_ADVANTAGE, f"advantage 0: in the loss denominators, but {how}"
    return UpdateRole.TRAINED, "trained on"


def _turns(traj: Trajectory) -> list[dict]:
    out, pos, steps = [], 0, traj.turn_policy_steps()
    for i, turn in enumerate(traj.turns):
        start = len(turn.prompt_ids)
        calls = [
            {
                "name": c.name,
                "arguments": _scalar(c.arguments),
                "output": _scalar(c.output),
                "ok": c.ok,
                "timed_out": c.timed_out,
                "output_truncated": c.output_truncated,
                "latency_s": _finite(c.latency_s),
                "infra_error": c.infra_error,
            }
            for c in turn.tool_calls
        ]
        out.append(
            {
                "index": i,
                "prompt_start": pos,
                "completion_start": start,
                "completion_end": start + len(turn.completion_ids),
                "text": turn.text,
                "truncated": turn.truncated,
                "tool_calls": calls,
                "policy_step": steps[i],
                "seed": turn.seed,
                "segment_start": turn.segment_start,
            }
        )
        pos = start + len(turn.completion_ids)
    return out


def make_batch(
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    tokenizer: Any = None,
    *,
    step: int | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
    left_out: Sequence[LeftOutReason | None] | None = None,
    forwarded: Collection[int] | None = None,
    max_trajectories: int | None = None,
    update_skipped: str | None = None,
    version: RunVersion | None = None,
    tool_schemas: Sequence[Mapping[str, Any]] | None = None,
    chat_settings: Mapping[str, Any] | None = None,
) -> dict:
    """A saved batch (a JSON-ready dict) of the first ``max_trajectories`` of ``trajectories``.

    Args:
        trajectories: The step's trajectories, scored and with advantages.
        datums: The datums the update built (``datum.trajectory_index`` = place in ``trajectories``); a
            trajectory without one (masked out) gets a datum built here for display, with its advantage.
        tokenizer: Decodes each token on its own (``None``: token ids are shown instead).
        step: Optimizer step the page belongs to.
        rows: The dataset rows of the batch (``rows[traj.group_id]``): question and reference answer.
        left_out: Per trajectory, why the update left it out, as the batch builder decided
            (:func:`~trl_plugins.pipeline.batch.left_out_reasons`; None: trained on); default: the trajectories
            without a datum in ``datums`` are left out, for no recorded reason.
        forwarded: Trajectory indices whose datum went through forward/backward (``None``: not recorded).
        max_trajectories: Keep only the first N (``None``: all).
        update_skipped: Why the step made no policy update at all (``None``: it made one); every trajectory the
            update would have taken is then marked ``update_skipped``.
        version: The run's version (``Run.version``), saved whole with its digest (None: not recorded).
        tool_schemas: The tool schemas the model was shown (``ChatFormat.tools``).
        chat_settings: What rebuilds the run's chat format and turns (``system_prompt``, ``final_answer_pattern``,
            ``stop_tokens``, ``calls_per_turn``, ``chat_template_kwargs``, ``max_tool_response_tokens``): a replay
            re-derives every turn's prompt from them.

    Returns:
        ``{"format", "step", "created", "version", "tool_schemas", "chat", "num_trajectories", "trajectories": [...]}``;
        each trajectory holds
        its ids, stop reason, reward components, advantage, ``update_role``/``update_note``, ``turns`` (token
        boundaries in the whole sequence, text, tool calls), ``tokens`` (every id and its decoded string),
        ``datum`` (or ``datum_error``) and ``datum_for_display``.
    """
    by_index = {d.trajectory_index: d for d in datums}
    keep = list(trajectories)[:max_trajectories] if max_trajectories is not None else list(trajectories)
    out = []
    for i, traj in enumerate(keep):
        reason = left_out[i] if left_out is not None else None
        in_update = reason is None if left_out is not None else i in by_index
        datum, for_display, error = by_index.get(i), False, None
        if datum is None:
            try:
                datum = build_datum(
                    traj, advantage=traj.advantage if traj.advantage is not None else 0.0, trajectory_index=i
                )
                for_display = True
            except (DatumError, ValueError) as exc:
                error = str(exc)
        role, note = _role(
            traj, datum, reason, in_update, None if forwarded is None else i in forwarded, update_skipped
        )
        entry: dict[str, Any] = {
            "index": i,
            "question_id": traj.question_id,
            "group_id": traj.group_id,
            "sample_index": traj.sample_index,
            "stop_reason": None if traj.stop_reason is None else str(traj.stop_reason),
            "stop_kind": (
                "terminated"
                if traj.terminated
                else "truncated"
                if traj.truncated
                else "world_failure"
                if traj.world_failure
                else "unfinished"
            ),
            "error": traj.error,
            "reward": _finite(traj.reward),
            "advantage": _finite(traj.advantage),
            "reward_components": [
                {"name": c.name, "value": _finite(c.value), "weight": _finite(c.weight)} for c in traj.reward_components
            ],
            "policy_step": None if traj.policy_version is None else traj.policy_version.step,
            "policy_version": _policy_version(traj.policy_version),
            "update_role": str(role),
            "update_note": note,
            "left_out": None if reason is None else str(reason),
            "turns": _turns(traj),
            "datum": None if datum is None else _datum_to_dict(datum),
            "datum_for_display": for_display,
            "datum_error": error,
        }
        if rows is not None and 0 <= traj.group_id < len(rows):
            row = rows[traj.group_id]
            entry["question"] = _question(row)
            entry["row"] = _scalar(dict(row))  # whole: a replay renders the prompt and scores the answer from it
            answer = next((row[k] for k in _ANSWER_KEYS if k in row), None)
            entry["reference_answer"] = None if answer is None else _scalar(answer)
            entry["example"] = {k: _scalar(v) for k, v in row.items() if k not in _QUESTION_KEYS + _ANSWER_KEYS}
        if datum is not None:
            ids = list(datum.input_ids) + [datum.target_ids[-1]] if datum.target_ids else list(datum.input_ids)
            first = traj.turns[0].prompt_sources
            entry["first_source"] = source_name(first[0] if first else TokenSource.PROMPT)
            entry["tokens"] = {"ids": ids, "strings": _decode(tokenizer, ids)}
        out.append(entry)
    return {
        "format": FORMAT,
        "step": step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "version": None if version is None else {**version.to_dict(), "digest": version.digest},
        "tool_schemas": None if tool_schemas is None else _scalar(list(tool_schemas)),
        "chat": None if chat_settings is None else _scalar(dict(chat_settings)),
        "num_trajectories": len(trajectories),
        "trajectories": out,
    }


def _policy_version(v: PolicyVersion | None) -> dict | None:
    if v is None:
        return None
    return {
        "step": v.step,
        "tokenizer_digest": v.tokenizer_digest,
        "weights_digest": v.weights_digest,
        "run_digest": v.run_digest,
        "sampling": dataclasses.asdict(v.sampling),
        "logprob_source": str(v.logprob_source),
    }


def _decode(tokenizer: Any, ids: Sequence[int]) -> list[str] | None:
    if tokenizer is None:
        return None
    return list(
        tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    )


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # open() honours the umask (mkstemp would make it 0600)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_batch(
    path: str | os.PathLike,
    trajectories: Sequence[Trajectory],
    datums: Sequence[Datum],
    tokenizer: Any = None,
    **kwargs: Any,
) -> dict:
    """Write :func:`make_batch` (same arguments) to ``path`` as JSON (atomically: a crash leaves the old file or
    none, never half of one). Returns the batch."""
    batch = make_batch(trajectories, datums, tokenizer, **kwargs)
    write_atomic(Path(path), json.dumps(batch, allow_nan=False, ensure_ascii=False))
    return batch


def load_batch(path: str | os.PathLike) -> dict:
    """Read a saved batch.

    Raises:
        ViewerError: the file is missing, not JSON (e.g. cut short), or not a saved batch of this format.
    """
    p = Path(path)
    if not p.is_file():
        raise ViewerError(
            f"{p}: no such file. A saved batch is what the trainer writes every viewer_steps steps as "
            f"output_dir/trajectories/step-<step>.json (or save_batch() writes)."
        )
    try:
        batch = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ViewerError(f"{p} is not a text file ({exc}); give a saved batch (.json).") from None
    except json.JSONDecodeError as exc:
        raise ViewerError(
            f"{p} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); was it cut short "
            f"or edited? Write it again with save_batch() or take another step's file."
        ) from None
    if not isinstance(batch, dict) or batch.get("format") not in READABLE_FORMATS:
        got = batch.get("format") if isinstance(batch, dict) else type(batch).__name__
        raise ViewerError(
            f"{p} is not a saved trajectory batch: its format is {got!r}, expected one of {list(READABLE_FORMATS)}."
        )
    batch.setdefault("version", None)  # format 2 recorded neither
    batch.setdefault("tool_schemas", None)
    batch.setdefault("chat", None)
    if not isinstance(batch.get("trajectories"), list):
        raise ViewerError(f"{p} has no 'trajectories' list; the file is damaged.")
    for i, t in enumerate(batch["trajectories"]):
        d = t.get("datum") if isinstance(t, dict) else None
        if d is not None:
            lengths = {
                k: len(d.get(k) or [])
                for k in ("target_ids", "behaviour_logprobs", "advantages", "action_mask", "sources")
            }
            if len(set(lengths.values())) != 1 or len(t.get("tokens", {}).get("ids", [])) != lengths["target_ids"] + 1:
                raise ViewerError(
                    f"{p}: trajectory {i}'s datum arrays disagree in length ({lengths}, "
                    f"{len(t.get('tokens', {}).get('ids', []))} tokens); the file is damaged."
                )
    return batch


# -- HTML ------------------------------------------------------------------------------------------
