"""A cheap, stated digest of a sampler's weights (:func:`weights_digest`), filled into every trajectory's
``PolicyVersion.weights_digest`` after the sampler's weights sync: it proves which weights sampled."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import torch

__all__ = ["WEIGHTS_SAMPLE", "weights_digest"]

_SAMPLE_PER_TENSOR = 8
WEIGHTS_SAMPLE = (
    f"sha256 over every parameter tensor, names sorted (a leading 'module.' wrapper prefix dropped): "
    f"its name, shape and {_SAMPLE_PER_TENSOR} values at evenly spaced flat indices, cast to float32"
)
"""What :func:`weights_digest` hashes. It reads ``8 x number of tensors`` values (a few KB for a 7B model), not the
weights: a digest per sync costs a few milliseconds. Two different weights that agree on every sampled value are
not told apart (an update changes every trained tensor's values almost everywhere, so a step is)."""


def weights_digest(model: Any, *, gather_each: bool = False) -> str | None:
    """16 hex digits of :data:`WEIGHTS_SAMPLE` for ``model`` (an ``nn.Module``, possibly wrapped by DDP/Accelerate).

    Returns None when the weights are not in this process to read: a ZeRO-3 parameter outside a gather holds only
    its shard here (inside the rollout's own gather, ``unwrapped_for_generation``, it holds the full value and is
    read like any), and a model without parameters (a vLLM server's weights live in the server). With
    ``gather_each`` (every rank must call it alike), such a parameter is gathered for its sample, one parameter at a
    time, so no rank ever holds the whole model.
    """
    if not isinstance(model, torch.nn.Module):
        return None
    h = hashlib.sha256()
    named = sorted((n.removeprefix("module."), p) for n, p in model.named_parameters())
    if not named:
        return None
    with torch.no_grad():
        for name, p in named:
            gather = contextlib.nullcontext()
            if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", None) != "AVAILABLE":
                if not gather_each:
                    return None  # DeepSpeed ZeRO-3 outside a gather: only this rank's shard is here
                import deepspeed

                gather = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
            with gather:
                flat = p.detach().reshape(-1)
                k = min(
                    _SAMPLE_PER_TENSOR, flat.numel()
                )  # integer spacing: float indices round past the end of 1e8+ tensors
                idx = torch.arange(k, dtype=torch.int64) * (flat.numel() - 1) // max(k - 1, 1)
                values = flat[idx.to(flat.device)].to(device="cpu", dtype=torch.float32)
                h.update(f"{name}:{tuple(p.shape)}:".encode())  # in the gather: a ZeRO-3 shard's own shape is (0,)
            h.update(values.numpy().tobytes())
    return h.hexdigest()[:16]
