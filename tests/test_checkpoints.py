"""Checkpoint integrity before resuming: damage named by file, fallback only when asked, nothing deleted,
and metrics.jsonl trimmed to one record per step."""

from __future__ import annotations

import json
import os

import pytest

from support.checkpoints import fake_checkpoint, snapshot, truncate
from trl_plugins.trainers.checkpoints import (
    COMPLETE_MARKER,
    CheckpointDamaged,
    check_checkpoint,
    latest_complete_checkpoint,
    resolve_resume,
    set_aside_damaged,
    trim_metrics_log,
)


def test_the_marker_records_every_file_and_its_size(tmp_path):
    folder = fake_checkpoint(tmp_path / "checkpoint-1", 1)
    files = json.loads((folder / COMPLETE_MARKER).read_text())["files"]
    assert files == {
        name: (folder / name).stat().st_size
        for name in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")
    }
    check_checkpoint(str(folder))  # intact: no error


def _drop_sizes(folder):
    # A marker as an older version wrote it (no file list): only the structural checks are left.
    (folder / COMPLETE_MARKER).write_text(json.dumps({"global_step": 1, "tokenizer_digest": "d"}))


@pytest.mark.parametrize("sizes", [True, False], ids=["marker-sizes", "structure-only"])
@pytest.mark.parametrize(
    "damage,file,reason",
    [
        (lambda f: truncate(f / "model.safetensors"), "model.safetensors", "truncated"),
        (lambda f: truncate(f / "optimizer.pt", by=40), "optimizer.pt", "truncated"),
        (lambda f: (f / "optimizer.pt").unlink(), "optimizer.pt", "missing"),
        (lambda f: (f / "scheduler.pt").unlink(), "scheduler.pt", "missing"),
        (
            lambda f: (f / "trainer_state.json").write_text('{"global_step": 1, "log_hist'),
            "trainer_state.json",
            "bytes|JSON",
        ),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 4), "model.safetensors", "bytes"),
    ],
)
def test_each_kind_of_damage_is_named_by_its_file_and_nothing_is_touched(tmp_path, damage, file, reason, sizes):
    folder = fake_checkpoint(tmp_path / "checkpoint-1", 1)
    if not sizes:
        _drop_sizes(folder)
    damage(folder)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointDamaged, match=reason) as info:
        check_checkpoint(str(folder))
    assert info.value.file == str(folder / file) and file in str(info.value)
    assert snapshot(tmp_path) == before


def test_safetensors_with_bytes_appended_and_a_partial_save_are_refused(tmp_path):
    folder = fake_checkpoint(tmp_path / "checkpoint-1", 1)
    _drop_sizes(folder)
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\x00" * 8)
    with pytest.raises(CheckpointDamaged, match="model.safetensors: .*extra bytes"):
        check_checkpoint(str(folder))
    partial = fake_checkpoint(tmp_path / "checkpoint-2", 2, marker=False)
    with pytest.raises(CheckpointDamaged, match=f"{COMPLETE_MARKER}: missing: the save was cut short"):
        check_checkpoint(str(partial))


def test_deepspeed_layout_is_checked_through_latest(tmp_path):
    folder = fake_checkpoint(tmp_path / "checkpoint-2", 2, deepspeed=True)
    check_checkpoint(str(folder))
    (folder / "latest").write_text("global_step9")
    with pytest.raises(CheckpointDamaged, match="latest: names 'global_step9', which is not there"):
        check_checkpoint(str(folder))
    (folder / "latest").write_text("global_step2")
    truncate(folder / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", by=40)
    with pytest.raises(CheckpointDamaged, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        check_checkpoint(str(folder))


@pytest.mark.parametrize("value", [True, "true", "TRUE", "latest", "Latest"])
def test_true_and_latest_mean_the_newest_complete_checkpoint(tmp_path, value):
    for step in (1, 3):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    fake_checkpoint(tmp_path / "checkpoint-5", 5, marker=False)  # a save cut short: never resumed from
    point = resolve_resume(value, str(tmp_path))
    assert (point.folder, point.step, point.skipped) == (str(tmp_path / "checkpoint-3"), 3, [])


def test_bad_resume_values_are_refused_with_what_to_do(tmp_path):
    assert resolve_resume(None, str(tmp_path)) is None and resolve_resume(False, str(tmp_path)) is None
    with pytest.raises(ValueError, match="has no complete checkpoint"):
        resolve_resume("latest", str(tmp_path))
    with pytest.raises(
        ValueError, match="'false' is not a checkpoint folder: pass a checkpoint-N folder, 'true' or 'latest'"
    ):
        resolve_resume("false", str(tmp_path))
    with pytest.raises(ValueError, match="resume_fallback=True .* but this run does not resume"):
        resolve_resume(None, str(tmp_path), fallback=True)
    # A finished run has nothing left to train: refused (the HF loop would train a step past max_steps).
    fake_checkpoint(tmp_path / "checkpoint-3", 3)
    assert resolve_resume("latest", str(tmp_path), max_steps=4).step == 3
    with pytest.raises(ValueError, match="checkpoint-3 is at step 3 and max_steps=3: nothing is left to train"):
        resolve_resume("latest", str(tmp_path), max_steps=3)


def test_a_damaged_checkpoint_is_refused_unless_fallback_is_asked_for(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    truncate(tmp_path / "checkpoint-3" / "model.safetensors")
    before = snapshot(tmp_path)
    for value in ("latest", str(tmp_path / "checkpoint-3")):  # the newest, or named explicitly: refused alike
        with pytest.raises(CheckpointDamaged) as info:
            resolve_resume(value, str(tmp_path))
        message = str(info.value)
        assert str(tmp_path / "checkpoint-3" / "model.safetensors") in message and "truncated" in message
        assert "Nothing was deleted" in message and "--resume_fallback true" in message
        assert str(tmp_path / "checkpoint-2") in message  # what the fallback would take
    assert snapshot(tmp_path) == before
    for value in ("latest", str(tmp_path / "checkpoint-3")):
        point = resolve_resume(value, str(tmp_path), fallback=True)
        assert (point.folder, point.step) == (str(tmp_path / "checkpoint-2"), 2)
        assert [e.file for e in point.skipped] == [str(tmp_path / "checkpoint-3" / "model.safetensors")]
    assert snapshot(tmp_path) == before
    # Every checkpoint damaged: nothing to fall back to, said so.
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointDamaged, match="found no intact checkpoint to fall back to"):
        resolve_resume("latest", str(tmp_path), fallback=True)


def test_falling_back_moves_the_damaged_checkpoint_aside(tmp_path):
    for step in (1, 2):
        fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()
    content = snapshot(tmp_path / "checkpoint-2")
    point = resolve_resume("latest", str(tmp_path), fallback=True)
    messages = []
    (moved,) = set_aside_damaged(point, log=messages.append)
    assert os.path.basename(moved).startswith("damaged-checkpoint-2-") and snapshot(moved) == content
    assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1") and "moved aside" in messages[0]


def test_trim_metrics_log_moves_the_records_after_the_checkpoint_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"step": 1, "loss": 0.1}),
        json.dumps({"step": 2, "loss": 0.2}),
        json.dumps({"step": 3, "loss": 0.3}),
        json.dumps({"step": 3, "train_runtime": 9.0}),
        '{"step": 4, "lo',
    ]
    path.write_text("\n".join(lines) + "\n")
    moved, aside = trim_metrics_log(str(path), 2)
    assert moved == 3 and path.read_text().splitlines() == lines[:2]
    assert os.path.basename(aside).startswith("metrics.after-step-2-") and open(aside).read().splitlines() == lines[2:]
    assert trim_metrics_log(str(path), 2) == (0, None)  # nothing after step 2 any more
    assert trim_metrics_log(str(tmp_path / "missing.jsonl"), 2) == (0, None)
