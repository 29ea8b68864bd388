"""Launched by tests/test_distributed.py once per "node" (two launchers on one machine, --machine_rank 0 and 1).

Records where this rank runs, as torchrun set it up (node rank, local rank, ranks per node, rendezvous
address), and the engine accelerate hands it, in ``<out>.rank<RANK>.json``. Then, unless ``--topology_only``
(the launch alone is under test), runs tests/dist_update_equivalence.py unchanged: one policy_update over the
ranks against one plain-torch step over all datums, reported by rank 0 in ``<out>``; with ``--trainer``,
tests/dist_trainer_run.py with the other arguments instead.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT",
)

out = sys.argv[sys.argv.index("--out") + 1]
Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps({k: os.environ.get(k) for k in KEYS}))
if "--topology_only" in sys.argv:
    sys.exit(0)
if "--trainer" in sys.argv:  # the trainer's run instead (tests/dist_trainer_run.py), with the other arguments
    sys.argv.remove("--trainer")
    sys.argv[0] = str(Path(__file__).with_name("dist_trainer_run.py"))
else:
    sys.argv[0] = str(Path(__file__).with_name("dist_update_equivalence.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
