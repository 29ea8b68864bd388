"""Loss aggregation: per-token losses -> one scalar, with explicit *global* denominators.

The denominators (loss tokens, sequences) are counted over the whole optimizer step, across every
micro-batch and every data-parallel rank, by the caller, and passed in. Then the sum over micro-batches
of ``aggregate(...)`` is the same scalar however the batch was split, and its gradient is the gradient
of the one-batch loss. Dividing by a per-micro-batch count instead (what "mean over the micro-batch,
then average micro-batches" does) weights tokens by the size of the micro-batch they landed in.

Under data parallelism the framework *averages* gradients over ``dp_size`` ranks; ``dp_size``
multiplies the local loss back so the averaged gradient is the global one.
"""

from __future__ import annotations

import torch

from trl_plugins.types import AggregationMode

__all__ = ["aggregate", "local_denominators"]


def local_denominators(action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss tokens and sequences with at least one loss token in a ``(B, T)`` mask.

    Sum these over micro-batches and ranks to get the global denominators of :func:`aggregate`.
    """
    m = action_mask.to(torch.float32)
    return m.sum(), (m.sum(dim=1) > 0).to(torch.float32).sum()


def aggregate(
    per_token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    mode: AggregationMode | str,
    *,
    num_tokens: float | torch.Tensor,
    num_sequences: float | torch.Tensor,
    norm_length: float | None = None,
    dp_size: int = 1,
    row_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate a micro-batch's ``(B, T)`` loss into its share of the global loss.

    With ``L`` = loss, ``m`` = mask, ``N_tok`` = ``num_tokens``, ``N_seq`` = ``num_sequences``:

    - ``token_mean``: ``sum(L m) / N_tok``
    - ``seq_mean_token_mean``: ``sum_rows(sum_t(L m) / sum_t(m)) / N_seq`` (rows without tokens add 0)
    - ``seq_mean_token_sum``: ``sum(L m) / N_seq``
    - ``seq_mean_token_sum_norm``: ``sum(L m) / (N_seq * norm_length)`` (Dr. GRPO; ``norm_length`` is
      a constant such as the maximum completion length)

    each multiplied by ``dp_size``.

    Args:
        per_token_loss: ``(B, T)``.
        action_mask: ``(B, T)``.
        num_tokens: global loss-token count for the step (all micro-batches, all ranks).
        num_sequences: global count of sequences with at least one loss token.
        norm_length: required for ``seq_mean_token_sum_norm``.
        dp_size: number of data-parallel ranks whose gradients are averaged.
        row_tokens: ``(B,)`` loss tokens of each whole row, for ``seq_mean_token_mean`` when ``per_token_loss`` is a
            shard of its rows (sequence parallelism); None: counted in ``action_mask``.

    Returns:
        A scalar. Summing it over all micro-batches and ranks gives the global loss.

    Raises:
        ValueError: ``seq_mean_token_sum_norm`` without a positive ``norm_length``.
    """
    mode = AggregationMode(mode)
    on = action_mask.bool()
    masked = torch.where(on, per_token_loss, torch.zeros_like(per_token_loss))
    num_tokens = torch.as_tensor(num_tokens, dtype=per_token_loss.dtype).clamp(min=1)
    num_sequences = torch.as_tensor(num_sequences, dtype=per_token_loss.dtype).clamp(min=1)
    if mode == AggregationMode.TOKEN_MEAN:
        total = masked.sum() / num_tokens
    elif mode == AggregationMode.SEQ_MEAN_TOKEN_MEAN:
        rows = on.sum(dim=1) if row_tokens is None else row_tokens
        total = (masked.sum(dim=1) / rows.to(per_token_loss.dtype).clamp(min=1)).sum() / num_sequences
    elif mode == AggregationMode.SEQ_MEAN_TOKEN_SUM:
        total = masked.sum() / num_sequences
    else:
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                "seq_mean_token_sum_norm needs a positive norm_length (e.g. the maximum completion "
                "length); pass norm_length=..."
            )
        total = masked.sum() / (num_sequences * norm_length)
    return total * dp_size
