"""Small fake checkpoints and the byte-level checks on them."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from trl_plugins.trainers.checkpoints import mark_complete


def fake_checkpoint(folder, step, *, deepspeed=False, marker=True):
    """What the HF Trainer saves (weights, optimizer, scheduler, trainer state), small, plus our marker."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (folder / "config.json").write_text("{}")
    if deepspeed:
        tag = folder / f"global_step{step}"
        tag.mkdir()
        torch.save({"module": {"w": torch.zeros(8)}}, tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"m": torch.zeros(64)}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (folder / "latest").write_text(f"global_step{step}")
    else:
        save_file({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, str(folder / "model.safetensors"))
        torch.save({"state": {0: {"exp_avg": torch.zeros(64)}}}, folder / "optimizer.pt")
        torch.save({"last_epoch": step}, folder / "scheduler.pt")
    if marker:
        mark_complete(str(folder), global_step=step, tokenizer_digest="d")
    return folder


def snapshot(root):
    """Every file under ``root`` with its bytes: what 'nothing was deleted or changed' compares."""
    return {
        os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(root)
        for n in names
    }


def truncate(path, by=16):
    """Cuts the last ``by`` bytes off ``path`` (a partial write)."""
    data = path.read_bytes()
    path.write_bytes(data[:-by])
