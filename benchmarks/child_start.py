"""How long the recipe waits for a child job (an evaluation, the embedded default's build) to start working: a child
started for the job (it imports torch, transformers and TRL first) against a spare started ahead (``prepare_child``),
measured alternately in one run.

    python benchmarks/child_start.py [--rounds 3] [--head_start_s 20]

Each round times ``run_in_child`` of a job that imports what the recipe's jobs import (``retool.launch.PRELOAD``) and
returns: once cold, once after ``prepare_child`` with ``--head_start_s`` seconds of head start (the parent's own work
before the job: the build, the trainer's set-up, the training steps). Prints the wait per round and the medians.
Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def job() -> float:
    """What a recipe job does before its work: import the heavy modules (free when the spare already did)."""
    from retool.launch import PRELOAD

    start = time.perf_counter()
    for name in PRELOAD:
        importlib.import_module(name)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head_start_s", type=float, default=20.0)
    args = parser.parse_args()
    from child_start import job as benchmark_job  # importable by name in the child (this folder is on its path)

    from retool.launch import prepare_child, run_in_child

    cold, warm = [], []
    for k in range(args.rounds):
        start = time.perf_counter()
        run_in_child(benchmark_job, what="cold job")
        cold.append(time.perf_counter() - start)
        prepare_child()
        time.sleep(args.head_start_s)
        start = time.perf_counter()
        run_in_child(benchmark_job, what="job in a spare")
        warm.append(time.perf_counter() - start)
        print(
            f"round {k + 1}: cold child {cold[-1]:.2f} s, spare started {args.head_start_s:g} s ahead {warm[-1]:.2f} s",
            flush=True,
        )
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"median wait for a child job: cold {c:.2f} s, spare {w:.2f} s ({c - w:.2f} s saved per job, {c / max(w, 1e-9):.1f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
