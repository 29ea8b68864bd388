"""Peak memory of one step: the process's resident set (CPU RSS) and, where CUDA is used, the GPU's
allocated memory. Linux lets a process reset its RSS high-water mark (``/proc/self/clear_refs``), so the
peak is the step's own, not the run's so far."""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["reset_peak_memory", "peak_memory_mb"]


def _high_water_mark_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return None


def reset_peak_memory() -> bool:
    """Start a new peak: the RSS high-water mark (Linux) and CUDA's peak statistics. False when the RSS
    peak cannot be reset here (not Linux, or ``/proc`` read-only): :func:`peak_memory_mb` then reports the
    process's peak since it started."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_memory_mb() -> dict[str, float]:
    """``memory/peak_rss_mb`` (since the last :func:`reset_peak_memory` where it worked) and, with CUDA in
    use, ``memory/cuda_max_allocated_mb`` and ``memory/cuda_max_reserved_mb``."""
    rss = _high_water_mark_mb()
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux
    out = {"memory/peak_rss_mb": rss}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["memory/cuda_max_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    return out
