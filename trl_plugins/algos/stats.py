"""Detached statistics of an update that need the maths, not the glue: importance ratios and their quantiles."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["importance_ratios", "quantiles"]


def importance_ratios(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> torch.Tensor:
    """``exp(logprobs - behaviour_logprobs)`` at the action tokens, detached, as a flat float32 tensor.

    Args:
        logprobs, behaviour_logprobs, action_mask: ``(B, T)``.

    Returns:
        ``(n,)`` with ``n`` = number of action tokens, in row-major order.
    """
    on = action_mask.bool()
    return torch.exp((logprobs.detach() - behaviour_logprobs)[on]).float()


def quantiles(values: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """``torch.quantile`` of a flat tensor at each of ``qs`` (linear interpolation); zeros when empty."""
    q = torch.tensor(list(qs), dtype=values.dtype)
    if values.numel() == 0:
        return torch.zeros_like(q)
    if values.numel() > 2**24:  # torch.quantile's input limit; numpy's default is the same interpolation
        import numpy as np

        return torch.tensor(np.quantile(values.detach().cpu().numpy(), list(qs)), dtype=values.dtype)
    return torch.quantile(values, q)
