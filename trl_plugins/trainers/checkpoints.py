"""Checkpoint completeness: a marker written last, and finding the newest complete checkpoint.

The trainer writes :data:`COMPLETE_MARKER` into ``checkpoint-N`` after everything else (all ranks
done), and rotates older checkpoints only after that, so a crash mid-save always leaves the previous
complete checkpoint to resume from.
"""

from __future__ import annotations

import json
import os
import re

__all__ = ["COMPLETE_MARKER", "latest_complete_checkpoint", "mark_complete"]

COMPLETE_MARKER = "checkpoint_complete.json"
"""Written into a checkpoint folder after everything else: a folder without it is a partial save."""


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder under ``output_dir`` that has the completion marker."""
    if not os.path.isdir(output_dir):
        return None
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, COMPLETE_MARKER)):
            found.append((int(m.group(1)), name))
    return os.path.join(output_dir, max(found)[1]) if found else None


def mark_complete(folder: str, *, global_step: int, tokenizer_digest: str) -> None:
    """Write the completion marker into ``folder`` atomically (temporary file, then rename)."""
    tmp = os.path.join(folder, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"global_step": global_step, "tokenizer_digest": tokenizer_digest}, f)
    os.replace(tmp, os.path.join(folder, COMPLETE_MARKER))
