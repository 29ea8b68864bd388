"""Checkpoint completeness and integrity: a marker written last, the newest complete checkpoint, what
to resume from, and the metrics log of a resumed run.

The trainer writes :data:`COMPLETE_MARKER` into ``checkpoint-N`` after everything else (all ranks
done), and rotates older checkpoints only after that, so a crash mid-save always leaves the previous
complete checkpoint to resume from. The marker records the size of every file of the checkpoint;
:func:`check_checkpoint` compares them and parses what is cheap to parse (safetensors headers against
the file length, the zip directory at the end of every ``torch.save`` file, JSON files), so a damaged
checkpoint (a truncated file, a missing one, an unreadable ``trainer_state.json``) is reported by name
*before* anything loads it. Sizes, not digests: hashing a large model's files at every save would cost
seconds to minutes, and what goes wrong in practice (a full disk, a copy cut short) changes the size.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "COMPLETE_MARKER",
    "latest_complete_checkpoint",
    "mark_complete",
    "complete_checkpoints",
    "CheckpointDamaged",
    "check_checkpoint",
    "ResumePoint",
    "resolve_resume",
    "wants_latest",
    "set_aside_damaged",
    "trim_metrics_log",
]

COMPLETE_MARKER = "checkpoint_complete.json"
"""Written into a checkpoint folder after everything else: a folder without it is a partial save."""

LATEST = ("true", "latest")
"""Values of ``resume_from_checkpoint`` (any case; or ``True``) that mean the newest complete checkpoint."""

_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, folder)`` of every ``checkpoint-N`` under ``output_dir`` with the completion marker, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, COMPLETE_MARKER)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that has the completion marker."""
    found = complete_checkpoints(output_dir)
    return found[0][1] if found else None


def _files(folder: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel not in (COMPLETE_MARKER, COMPLETE_MARKER + ".tmp"):
                out[rel] = os.path.getsize(path)
    return dict(sorted(out.items()))


def mark_complete(folder: str, *, global_step: int, tokenizer_digest: str, version: Any = None) -> None:
    """Write the completion marker into ``folder`` atomically (temporary file, then rename), with the size of
    every file in it (call it once every rank has finished writing) and the run's version (a
    :class:`~trl_plugins.types.RunVersion`, saved as a dict with its ``digest``; a replay checks it)."""
    tmp = os.path.join(folder, COMPLETE_MARKER + ".tmp")
    record = None if version is None else {**version.to_dict(), "digest": version.digest}
    with open(tmp, "w") as f:
        json.dump(
            {
                "global_step": global_step,
                "tokenizer_digest": tokenizer_digest,
                "version": record,
                "files": _files(folder),
            },
            f,
        )
    os.replace(tmp, os.path.join(folder, COMPLETE_MARKER))


class CheckpointDamaged(ValueError):
    """A checkpoint that cannot be resumed from; ``file`` is the damaged or missing file (a path)."""

    def __init__(self, checkpoint: str, file: str, reason: str, hint: str = "") -> None:
        self.checkpoint, self.file, self.reason = checkpoint, file, reason
        super().__init__(f"checkpoint {checkpoint} is damaged: {file}: {reason}.{' ' + hint if hint else ''}")


def _check_safetensors(path: str, size: int) -> str | None:
    # Layout: 8-byte little-endian header length N, N bytes of JSON, then the tensor data, whose end is the
    # largest data_offsets end: the file must be exactly 8 + N + that.
    if size < 8:
        return f"{size} bytes, shorter than a safetensors header"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            return f"its header claims {n} bytes but the file has {size}: truncated"
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            return f"unreadable safetensors header ({exc})"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return (
            f"{size} bytes but its header describes {8 + n + end}: "
            f"{'truncated' if size < 8 + n + end else 'extra bytes'}"
        )
    return None


def _check_torch_zip(path: str) -> str | None:
    # torch.save writes a zip archive; its directory is at the end, so a truncated file cannot be opened.
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return None  # the legacy pickle format: nothing cheap to check
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"not a readable torch.save archive ({exc}): truncated or overwritten"
    return None


def check_checkpoint(folder: str, *, needs_optimizer: bool = True) -> None:
    """Check that ``folder`` can be resumed from, without loading it (stat calls and small reads).

    Checked: the completion marker; every file it lists, present with its recorded size; every
    ``*.safetensors`` file's header against its length; every ``torch.save`` file's zip directory; every
    ``*.json`` file parses (``trainer_state.json`` with a ``global_step``); the weights (HF files, a shard
    index's shards, or DeepSpeed's ``global_step*`` folder named by ``latest``) and, with
    ``needs_optimizer``, the optimizer state (``optimizer.pt`` with ``scheduler.pt``, or DeepSpeed's
    ``*optim_states.pt``).

    Raises:
        CheckpointDamaged: naming the first damaged or missing file.
    """

    def damaged(file: str, reason: str) -> CheckpointDamaged:
        return CheckpointDamaged(folder, os.path.join(folder, file), reason)

    if not os.path.isdir(folder):
        raise CheckpointDamaged(folder, folder, "not a folder")
    marker = os.path.join(folder, COMPLETE_MARKER)
    if not os.path.isfile(marker):
        raise damaged(
            COMPLETE_MARKER,
            "missing: the save was cut short (the marker is written last), or the folder "
            "was not written by MultiTurnGRPOTrainer",
        )
    try:
        with open(marker) as f:
            recorded = json.load(f).get("files")
    except (ValueError, AttributeError) as exc:
        raise damaged(COMPLETE_MARKER, f"unreadable ({exc})") from None
    for rel, size in (recorded or {}).items():  # markers of older versions list no files
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise damaged(rel, "missing (the checkpoint had it when it was saved)")
        now = os.path.getsize(path)
        if now != size:
            raise damaged(rel, f"{now} bytes, but {size} when it was saved: {'truncated' if now < size else 'changed'}")
    files = _files(folder)
    for rel, size in files.items():
        path = os.path.join(folder, rel)
        problem = None
        if rel.endswith(".safetensors"):
            problem = _check_safetensors(path, size)
        elif rel.endswith((".pt", ".pth", ".bin")):
            problem = _check_torch_zip(path)
        elif rel.endswith(".json"):
            try:
                with open(path) as f:
                    json.load(f)
            except (ValueError, UnicodeDecodeError) as exc:
                problem = f"unreadable JSON ({exc})"
        if problem:
            raise damaged(rel, problem)
    if "trainer_state.json" not in files:
        raise damaged("trainer_state.json", "missing (the step, the data position and the logs to resume)")
    with open(os.path.join(folder, "trainer_state.json")) as f:
        if not isinstance(json.load(f).get("global_step"), int):
            raise damaged("trainer_state.json", "has no global_step")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in files:
            with open(os.path.join(folder, index)) as f:
                for shard in sorted(set(json.load(f).get("weight_map", {}).values())):
                    if shard not in files:
                        raise damaged(shard, f"missing (named by {index})")
    deepspeed_dirs = sorted(
        {rel.split(os.sep)[0] for rel in files if re.match(r"global_step\d+" + re.escape(os.sep), rel)}
    )
    if deepspeed_dirs:
        if "latest" not in files:
            raise damaged("latest", "missing (DeepSpeed reads the name of its global_step folder from it)")
        with open(os.path.join(folder, "latest")) as f:
            tag = f.read().strip()
        if tag not in deepspeed_dirs:
            raise damaged("latest", f"names {tag!r}, which is not there (found {deepspeed_dirs})")
        if not any(rel.startswith(tag + os.sep) and rel.endswith("model_states.pt") for rel in files):
            raise damaged(tag, "has no *model_states.pt")
    elif not any(name in files for name in _WEIGHTS):
        raise damaged(
            "model.safetensors", f"missing: no weights ({', '.join(_WEIGHTS)}) and no DeepSpeed global_step folder"
        )
    if needs_optimizer:
        if deepspeed_dirs:  # under ZeRO the optimizer state is in *optim_states.pt; without ZeRO in the model states
            zero = any(rel.startswith(tag + os.sep) and "zero_pp_rank" in rel for rel in files)
            if zero and not any(rel.startswith(tag + os.sep) and rel.endswith("optim_states.pt") for rel in files):
                raise damaged(tag, "has no *optim_states.pt (the optimizer state)")
        elif not ("optimizer.pt" in files or "optimizer.bin" in files):
            raise damaged("optimizer.pt", "missing: the run would resume with a fresh optimizer")
        elif "scheduler.pt" not in files:
            raise damaged("scheduler.pt", "missing: the HF Trainer loads the optimizer only together with it")


def wants_latest(value: Any) -> bool:
    """Whether ``resume_from_checkpoint`` asks for the newest complete checkpoint: ``True``, ``"true"`` or
    ``"latest"`` in any case."""
    return value is True or (isinstance(value, str) and value.strip().lower() in LATEST)


@dataclass
class ResumePoint:
    """Where a run resumes: the checkpoint folder and its step, and the damaged checkpoints passed over."""

    folder: str
    step: int
    skipped: list[CheckpointDamaged] = field(default_factory=list)
    """Newer checkpoints that were damaged (only with ``fallback``), newest first."""


def _step(folder: str) -> int:
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return int(json.load(f)["global_step"])


def resolve_resume(
    value: Any, output_dir: str, *, fallback: bool = False, needs_optimizer: bool = True, max_steps: int | None = None
) -> ResumePoint | None:
    """What ``resume_from_checkpoint=value`` resumes from, checked (:func:`check_checkpoint`) before anything loads.

    ``value``: ``None``/``False`` (no resume), ``True``/``"true"``/``"latest"`` (the newest complete checkpoint
    under ``output_dir``) or a checkpoint folder. A damaged checkpoint is refused, naming the file; with
    ``fallback`` the previous complete checkpoint (of ``output_dir``, or of the named folder's parent) that
    passes the check is taken instead and the damaged ones are listed in ``skipped``. Nothing is deleted.
    With ``max_steps`` (> 0), a checkpoint already at that step is refused: nothing is left to train (the HF
    loop would train one step past it).

    Raises:
        ValueError: nothing to resume from, ``fallback`` without a resume, an unusable value, or nothing left to train.
        CheckpointDamaged: the checkpoint (and, with ``fallback``, every older one) is damaged.
    """
    if value is None or value is False:
        if fallback:
            raise ValueError(
                "resume_fallback=True says what to do when the checkpoint to resume from is damaged, but this "
                "run does not resume: pass resume_from_checkpoint (true, latest or a checkpoint folder) or "
                "drop resume_fallback."
            )
        return None
    if wants_latest(value):
        candidates = complete_checkpoints(output_dir)
        if not candidates:
            raise ValueError(
                f"resume_from_checkpoint={value!r} (the newest complete checkpoint) but {output_dir} has no complete "
                f"checkpoint (a folder checkpoint-N with {COMPLETE_MARKER}); pass a path or start without resuming."
            )
        folders = [f for _, f in candidates]
    elif isinstance(value, (str, os.PathLike)):
        folder = os.fspath(value)
        if not os.path.isdir(folder):
            raise ValueError(
                f"resume_from_checkpoint={folder!r} is not a checkpoint folder: pass a checkpoint-N folder, "
                f"'true' or 'latest' (the newest complete checkpoint of output_dir), or leave it unset."
            )
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(folder)))
        older = [
            f for s, f in complete_checkpoints(os.path.dirname(os.path.normpath(folder))) if m and s < int(m.group(1))
        ]
        folders = [folder] + older
    else:
        raise ValueError(f"resume_from_checkpoint must be a folder, 'true' or 'latest'; got {value!r}.")
    skipped: list[CheckpointDamaged] = []
    for folder in folders:
        try:
            check_checkpoint(folder, needs_optimizer=needs_optimizer)
        except CheckpointDamaged as exc:
            if not fallback:
                previous = next((f for f in folders[1:] if f != folder), None)
                how = (
                    f"To resume from the previous complete checkpoint ({previous}) instead, add --resume_fallback "
                    "true (resume_fallback=True)"
                    if previous
                    else "There is no earlier complete checkpoint to fall back to"
                )
                raise CheckpointDamaged(
                    exc.checkpoint,
                    exc.file,
                    exc.reason,
                    f"Nothing was deleted. {how}, or pass another checkpoint folder.",
                ) from None
            skipped.append(exc)
            continue
        point = ResumePoint(folder, _step(folder), skipped)
        if max_steps is not None and 0 < max_steps <= point.step:
            raise ValueError(
                f"{folder} is at step {point.step} and max_steps={max_steps}: nothing is left to train. "
                f"Raise max_steps to train on from it."
            )
        return point
    raise CheckpointDamaged(
        skipped[0].checkpoint,
        skipped[0].file,
        skipped[0].reason,
        f"resume_fallback=True found no intact checkpoint to fall back to (also damaged: "
        f"{'; '.join(f'{e.file}: {e.reason}' for e in skipped[1:]) or 'none older'}). Nothing was deleted.",
    )


def set_aside_damaged(point: ResumePoint, log: Callable[[str], None]) -> list[str]:
    """Move the damaged checkpoints a fallback passed over to ``damaged-checkpoint-N-<time>`` beside them, so that
    the resumed run's saves of those steps do not write into them (nothing is deleted; rotation, which counts
    ``checkpoint-*`` folders, leaves them alone). Returns the new paths."""
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for exc in point.skipped:
        src = os.path.normpath(exc.checkpoint)
        dst = os.path.join(os.path.dirname(src), f"damaged-{os.path.basename(src)}-{stamp}")
        os.rename(src, dst)
        moved.append(dst)
        log(f"damaged checkpoint moved aside: {src} -> {dst}")
    return moved


def trim_metrics_log(path: str, step: int) -> tuple[int, str | None]:
    """Make ``path`` (``metrics.jsonl``) read as one run continuing after ``step``.

    A run resumed from ``checkpoint-<step>`` logs every step after it again; the interrupted run's records of
    those steps (``"step" > step``), its end-of-training summary (``train_runtime``) and any line cut short
    are moved, in order, to ``metrics.after-step-<step>-<time>.jsonl`` beside it; the earlier lines stay as they
    were. Returns ``(records moved, that file)``, ``(0, None)`` when there was nothing to move.
    """
    if not os.path.isfile(path):
        return 0, None
    with open(path) as f:
        lines = f.read().splitlines()
    keep, move = [], []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            later = not isinstance(record, dict) or int(record.get("step", 0)) > step or "train_runtime" in record
        except (ValueError, TypeError):
            later = True
        (move if later else keep).append(line)
    if not move:
        return 0, None
    root, ext = os.path.splitext(path)
    aside = f"{root}.after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}{ext}"
    with open(aside, "w") as f:  # first the copy, then the rewrite: a crash in between loses nothing
        f.write("\n".join(move) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(move), aside
