"""The divergence to a teacher that returns only some tokens' log-probs (a server teacher: vLLM's top-k prompt
log-probs) at each action position, as TRL's experimental ``ServerDistillationTrainer`` computes it: the student's
log-softmax over the whole vocabulary read at the support's tokens, then the generalised JSD over the support, with
the mass outside it either appended as one tail bucket (``tail=True``, TRL's default ``loss_add_tail``) or dropped by
renormalising both distributions over the support (``tail=False``).

The student's ``(positions, vocabulary)`` logits are never held whole: the output head runs on ``chunk_size``
positions at a time, each chunk recomputed in the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from trl_plugins.modeling.chunked_head import (
    auto_chunk_size,
    head_gathered_once,
    hidden_states_instead_of_logits,
    output_head,
)
from trl_plugins.modeling.logprobs import hidden_rows, needed_positions, scatter_chunked, scatter_positions

__all__ = ["support_logprobs", "support_divergence", "micro_batch_logprobs_and_support_divergence"]


def _chunk_support(head: torch.nn.Module, rows: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = head(rows).float() / temperature
    return logits.gather(-1, ids) - torch.logsumexp(logits, dim=-1, keepdim=True)


def support_logprobs(
    head: torch.nn.Module, rows: torch.Tensor, ids: torch.Tensor, *, temperature: float, chunk_size: int | None
) -> torch.Tensor:
    """``log softmax(head(rows) / temperature)`` at ``ids``: ``rows`` ``(n, H)``, ``ids`` ``(n, S)`` -> ``(n, S)``
    float32, ``chunk_size`` rows at a time (each chunk's logits recomputed in the backward)."""
    size = chunk_size or auto_chunk_size(int(getattr(head, "out_features", 0) or head.weight.shape[0]))
    parts = [
        checkpoint(_chunk_support, head, rows[i : i + size], ids[i : i + size], temperature, use_reentrant=False)
        for i in range(0, rows.shape[0], size)
    ]
    return torch.cat(parts) if parts else rows.new_zeros((0, ids.shape[-1]), dtype=torch.float32)


def support_divergence(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, *, beta: float, tail: bool
) -> torch.Tensor:
    """The generalised JSD between two distributions known on a support, per row: ``student``, ``teacher``
    ``(n, S)`` log-probs over the whole vocabulary at the support's tokens, ``mask`` ``(n, S)`` the support's real
    entries (each row has at least one). ``tail``: the mass outside the support is one more bucket,
    ``log(1 - sum p)`` (the sum kept below 1 by 1e-7, as TRL does); otherwise both are renormalised over the support.
    ``beta`` 0 is KL(teacher || student), 1 KL(student || teacher), in between the divergence to the mixture
    ``(1 - beta) p_student + beta p_teacher``. Returns ``(n,)``."""
    mask = mask.bool()
    none = torch.tensor(float("-inf"), dtype=student.dtype, device=student.device)
    s, t = torch.where(mask, student, none), torch.where(mask, teacher.to(student.dtype), none)
    if tail:
        s, t = (torch.cat([x, _log_rest(x)], dim=-1) for x in (s, t))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    else:
        s, t = (x - torch.logsumexp(x, dim=-1, keepdim=True) for x in (s, t))
    zero = torch.zeros_like(s)
    p_s, p_t = torch.where(mask, s.exp(), zero), torch.where(mask, t.exp(), zero)
    s, t = torch.where(mask, s, zero), torch.where(mask, t, zero)
    if beta == 0.0:
        terms = p_t * (t - s)
    elif beta == 1.0:
        terms = p_s * (s - t)
    else:
        mixed = (1.0 - beta) * p_s + beta * p_t
        m = torch.where(mask, mixed.clamp_min(torch.finfo(mixed.dtype).tiny).log(), zero)
        terms = beta * p_t * (t - m) + (1.0 - beta) * p_s * (s - m)
    return torch.nan_to_num(terms, nan=0.0).sum(dim=-1)


def _log_rest(logp: torch.Tensor) -> torch.Tensor:
    # log(1 - sum exp(logp)) per row, the sum kept below 1.
    total = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.log(-torch.expm1(total))


def micro_batch_logprobs_and_support_divergence(
    model: torch.nn.Module,
    mb: Any,
    device: Any,
    *,
    support_ids: torch.Tensor,
    teacher_support: torch.Tensor,
    support_mask: torch.Tensor,
    beta: float,
    tail: bool,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`~trl_plugins.modeling.logprobs.micro_batch_logprobs` at the action positions and
    :func:`support_divergence` there, ``(B, T)``, 0 elsewhere, with gradient to ``model``: ``support_ids``,
    ``teacher_support`` and ``support_mask`` ``(B, T, S)`` are each position's support tokens, the teacher's
    log-probs of them and which are real. ``model`` forwards ``mb`` in its layout (padded, padding-free or
    shared-prefix); its head must be :func:`~.chunked_head.chunkable`."""
    needed = mb.action_mask.bool() & mb.attention_mask.bool()
    with head_gathered_once(output_head(model)):
        with hidden_states_instead_of_logits(model) as head:
            rows, row_index = hidden_rows(model, mb, device)
        logp, entropy = scatter_chunked(
            head,
            rows,
            mb.target_ids,
            needed,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
            row_index=row_index,
        )
        where, source, keep = needed_positions(needed, row_index, rows.device)
        width = support_ids.shape[-1]
        ids = support_ids.reshape(-1, width).to(rows.device)[where]
        mask = support_mask.reshape(-1, width).to(rows.device)[where].bool()
        mask[:, 0] |= ~keep  # a dummy position: one real entry, scored and then zeroed
        student = support_logprobs(head, rows[source], ids, temperature=temperature, chunk_size=chunk_size)
        teacher = teacher_support.reshape(-1, width).to(rows.device)[where]
        divergence = support_divergence(student, teacher, mask, beta=beta, tail=tail)
    return logp, entropy, scatter_positions(divergence * keep.to(divergence.dtype), where, needed.shape)
