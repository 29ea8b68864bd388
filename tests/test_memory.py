"""Peak memory per step: the RSS high-water mark is reset at each step, so a step reports its own peak."""

from __future__ import annotations

import torch

from trl_plugins.trainers.memory import peak_memory_mb, reset_peak_memory


def test_a_step_reports_its_own_peak_not_the_runs():
    assert reset_peak_memory()  # Linux: the high-water mark can be reset
    base = peak_memory_mb()["memory/peak_rss_mb"]
    big = torch.ones(300 * 2**20 // 4)  # 300 MB, touched
    del big
    spiked = peak_memory_mb()["memory/peak_rss_mb"]
    assert spiked > base + 250
    reset_peak_memory()
    assert peak_memory_mb()["memory/peak_rss_mb"] < spiked - 250  # the next step does not inherit the spike
