"""The run's settings and tokenizer, saved once in its output folder when training starts.

``output_dir/run_config/`` holds what a checkpoint holds besides the weights: the config as ``training_args.bin``
(``torch.save`` of the ``MultiTurnGRPOConfig``, as transformers' ``Trainer`` saves it in every checkpoint) and the
tokenizer (``save_pretrained``). A saved batch (``output_dir/trajectories/step-N.json``) can then be re-scored and
its tool calls re-run (``python -m trl_plugins.replay BATCH --rewards``; docs/replay.md) whatever ``save_steps`` left:
the plugins and the tokenizer need the run's settings, not its weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["RUN_CONFIG_DIR", "CONFIG_FILE", "save_run_config"]

RUN_CONFIG_DIR = "run_config"
"""The folder under ``output_dir`` that holds the run's config and tokenizer."""

CONFIG_FILE = "training_args.bin"
"""The config's file name, in ``run_config/`` as in every ``checkpoint-N`` (transformers' ``TRAINING_ARGS_NAME``)."""


def save_run_config(output_dir: str | os.PathLike, config: Any, tokenizer: Any) -> Path:
    """Write ``config`` and ``tokenizer`` to ``output_dir/run_config/``, replacing what an earlier start of the same
    run wrote there (a resumed run's is the config it resumed with); returns that folder.

    Written into a hidden sibling folder and renamed into place, so a reader never sees half a folder: a crash
    leaves the previous one (or, between the two renames, none and a hidden ``.run_config-*`` folder).
    """
    import torch

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / RUN_CONFIG_DIR
    fresh = Path(tempfile.mkdtemp(prefix=f".{RUN_CONFIG_DIR}-", dir=out))
    old = None
    try:
        torch.save(config, fresh / CONFIG_FILE)
        tokenizer.save_pretrained(str(fresh))
        if final.exists():  # a directory cannot be renamed over a non-empty one: move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".{RUN_CONFIG_DIR}-old-", dir=out))
            final.rename(old / RUN_CONFIG_DIR)
        fresh.rename(final)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
