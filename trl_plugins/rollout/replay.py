"""Replay check: recompute the behaviour log-probs of sampled tokens with a plain forward pass.

With unchanged weights the difference measures sampler/trainer mismatch (kernels, padding, KV cache,
dtype, a log-prob taken from the wrong distribution). It is small in fp32 on CPU (< 1e-4); tests and
benchmarks call it (the trainer does not yet log it per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.types import Trajectory

__all__ = ["ReplayReport", "replay_logprobs"]


@dataclass
class ReplayReport:
    """How far stored behaviour log-probs are from a fresh forward pass."""

    max_abs_diff: float
    """Largest ``|stored - recomputed|`` over all sampled tokens."""
    mean_abs_diff: float
    """Mean of the same."""
    num_tokens: int
    """Sampled tokens compared."""


@torch.no_grad()
def replay_logprobs(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int,
    temperature: float = 1.0,
    batch_size: int = 8,
) -> ReplayReport:
    """Compare stored behaviour log-probs with ``log_softmax(logits / temperature)`` of a plain forward.

    ``temperature`` must be the sampling temperature (use 1.0 for greedy sampling).
    """
    datums = [build_datum(t, advantage=0.0, trajectory_index=i) for i, t in enumerate(trajectories)]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    diffs = []
    try:
        for k in range(0, len(datums), batch_size):
            mb = collate(datums, list(range(k, min(k + batch_size, len(datums)))), pad_token_id=pad_token_id)
            lp = token_logprobs(
                model, mb.input_ids.to(device), mb.attention_mask.to(device), mb.target_ids.to(device), temperature=temperature
            ).cpu()
            mask = mb.action_mask.bool()
            diffs.append((lp[mask].double() - mb.behaviour_logprobs[mask].double()).abs())
    finally:
        model.train(was_training)
    all_diffs = torch.cat(diffs) if diffs else torch.zeros(0)
    if all_diffs.numel() == 0:
        return ReplayReport(0.0, 0.0, 0)
    return ReplayReport(float(all_diffs.max()), float(all_diffs.mean()), int(all_diffs.numel()))
