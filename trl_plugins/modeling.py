"""Forward passes shared by the rollout (replay check) and the trainer: per-token log-probs."""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "token_logprobs_and_entropy", "selective_log_softmax"]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full log-softmax twice.

    Args:
        logits: ``(B, T, V)``.
        index: ``(B, T)`` token ids.

    Returns:
        ``(B, T)`` log-probs, in float32 at least.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``target_ids`` under ``model`` at temperature ``temperature``: ``(B, T)``.

    Position ``t`` scores ``target_ids[:, t]`` from ``input_ids[:, : t + 1]`` (the datum layout). The
    logits are divided by ``temperature`` first, matching behaviour log-probs taken from the
    temperature-scaled sampling distribution.
    """
    return token_logprobs_and_entropy(
        model, input_ids, attention_mask, target_ids, temperature=temperature, with_entropy=False
    )[0]


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, with ``with_entropy``, the entropy of the whole next-token
    distribution at each position, ``H_t = logsumexp(z) - sum softmax(z) z`` with ``z = logits / temperature``
    (the distribution the tokens were sampled from), both ``(B, T)``; the entropy carries the gradient."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, target_ids)
    if not with_entropy:
        return logp, None
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_z = torch.logsumexp(z, dim=-1)
    entropy = log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy
