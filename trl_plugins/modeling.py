"""Forward passes shared by the rollout (replay check) and the trainer: per-token log-probs."""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = [
    "token_logprobs",
    "token_logprobs_and_entropy",
    "selective_log_softmax",
    "micro_batch_logprobs",
    "model_inputs",
    "unpack",
    "PackedAttentionLeak",
    "check_packed_isolation",
    "dropout_probabilities",
    "disable_dropout",
]

_HEAD_ONLY_DROPOUT = ("classifier_dropout",)
"""Dropout of a classification head, which a causal LM does not have (the critic sets its own to 0)."""


def _is_dropout(name: str, value: Any) -> bool:
    name = name.lower()
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and ("dropout" in name or name.endswith("pdrop")) and name not in _HEAD_ONLY_DROPOUT)


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _config_dropout(config: Any, where: str) -> Iterator[tuple[str, Any, str, float]]:
    for key, value in list(vars(config).items()):
        if _is_dropout(key, value):
            yield f"{where}.{key}", config, key, float(value)
        elif _is_config(value):  # a sub-config (e.g. text_config)
            yield from _config_dropout(value, f"{where}.{key}")


def _dropout_settings(model_or_config: Any) -> Iterator[tuple[str, Any, str, float]]:
    """``(where, owner, attribute, p)`` for every dropout probability above 0: config fields (sub-configs included)
    and, for a model, every module's config, its ``nn.Dropout.p`` and its float dropout attributes."""
    if not isinstance(model_or_config, torch.nn.Module):
        yield from _config_dropout(model_or_config, "config")
        return
    seen: set[int] = set()
    for name, module in model_or_config.named_modules():
        config = vars(module).get("config")
        if _is_config(config) and id(config) not in seen:
            seen.add(id(config))
            yield from _config_dropout(config, f"{name}.config" if name else "config")
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            yield name or "(model)", module, "p", float(module.p)
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and _is_dropout(key, value):
                yield f"{name}.{key}" if name else key, module, key, value


def dropout_probabilities(model_or_config: Any) -> dict[str, float]:
    """Every dropout probability above 0 that a model (or a model's config) would apply in training mode.

    A config's fields (``attention_dropout``, ``hidden_dropout``, GPT-2's ``attn_pdrop``, ..., sub-configs
    included), and for a model also its ``nn.Dropout`` modules and the float dropout attributes its modules read in
    their forward (Qwen2's attention passes ``self.attention_dropout`` to the attention kernel: TRL's
    ``disable_dropout_in_model`` sets only ``nn.Dropout.p`` and misses it).

    Returns:
        ``{where: p}``, e.g. ``{"config.attention_dropout": 0.1, "model.layers.0.self_attn.attention_dropout": 0.1}``.
    """
    return {where: p for where, _, _, p in _dropout_settings(model_or_config)}


def disable_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Set every dropout :func:`dropout_probabilities` finds in ``model`` to 0 (modules, module attributes, the
    configs they read), so the training forward is the deterministic one the sampler ran. Returns what it changed."""
    found = list(_dropout_settings(model))
    for _, owner, key, _ in found:
        setattr(owner, key, 0.0)
    return {where: p for where, _, _, p in found}


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
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, with ``with_entropy``, the entropy of the whole next-token
    distribution at each position, ``H_t = logsumexp(z) - sum softmax(z) z`` with ``z = logits / temperature``
    (the distribution the tokens were sampled from), both ``(B, T)``; the entropy carries the gradient.
    ``position_ids`` (with ``attention_mask=None``): packed sequences, see :func:`micro_batch_logprobs`."""
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, target_ids)
    if not with_entropy:
        return logp, None
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_z = torch.logsumexp(z, dim=-1)
    entropy = log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logp, entropy


# -- padding-free micro-batches --------------------------------------------------------------------


def model_inputs(mb: Any, device: Any) -> dict[str, Any]:
    """The forward's inputs for a :class:`~trl_plugins.types.MicroBatch`: the padded ``(B, T)`` ids and mask,
    or padding-free the real tokens as one ``(1, N)`` row with their per-datum position ids and no 2-D mask
    (transformers then builds a block-diagonal causal mask from the restarting positions, or runs
    flash-attention's variable-length kernel)."""
    if mb.position_ids is None:
        return {"input_ids": mb.input_ids.to(device), "attention_mask": mb.attention_mask.to(device)}
    real = mb.attention_mask.bool()
    return {"input_ids": mb.input_ids[real][None, :].to(device), "attention_mask": None,
            "position_ids": mb.position_ids.to(device)}


def unpack(values: torch.Tensor, mb: Any) -> torch.Tensor:
    """Per-token ``values`` of a padding-free forward, ``(1, N)``, back in the micro-batch's ``(B, T)`` layout
    (0 on padding; differentiable); padded micro-batches' values are returned as they are."""
    if mb.position_ids is None:
        return values
    out = values.new_zeros(mb.attention_mask.shape)
    out[mb.attention_mask.to(values.device).bool()] = values.reshape(-1)
    return out


def micro_batch_logprobs(model: torch.nn.Module, mb: Any, device: Any, *, temperature: float = 1.0,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_and_entropy` of a micro-batch in either layout, returned as ``(B, T)``."""
    inputs = model_inputs(mb, device)
    targets = mb.target_ids if mb.position_ids is None else mb.target_ids[mb.attention_mask.bool()][None, :]
    logp, entropy = token_logprobs_and_entropy(
        model, inputs["input_ids"], inputs["attention_mask"], targets.to(device), temperature=temperature,
        with_entropy=with_entropy, position_ids=inputs.get("position_ids"),
    )
    return unpack(logp, mb), None if entropy is None else unpack(entropy, mb)


class PackedAttentionLeak(ValueError):
    """The model's attention does not keep packed sequences apart: padding-free micro-batches would mix datums."""


@torch.no_grad()
def check_packed_isolation(model: torch.nn.Module, device: Any, *, vocab_size: int, name: str = "the model") -> float:
    """Check that ``model`` attends within each packed sequence only; return the largest output gap found.

    Runs a 24-token and a 9-token sequence packed into one row (positions restarting) and the 9-token one on
    its own; the second's outputs (``.logits``: next-token logits, or a critic's values) must agree to 1e-4
    of their scale in fp32 (5e-2 in half precision). Every rank must call it (under ZeRO-3 a forward is a
    collective). Attention that ignores the positions' restarts (a model whose masking does not go through
    transformers' ``masking_utils``, a custom attention function) lets the second sequence see the first,
    and is refused.

    Raises:
        PackedAttentionLeak: the packed forward differs; the message says what to do.
    """
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(1, max(vocab_size, 2), (24,), generator=gen)
    second = torch.randint(1, max(vocab_size, 2), (9,), generator=gen)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=torch.cat([first, second])[None, :].to(device), attention_mask=None, use_cache=False,
                       position_ids=torch.cat([torch.arange(24), torch.arange(9)])[None, :].to(device)).logits[0, 24:]
        alone = model(input_ids=second[None, :].to(device), attention_mask=None, use_cache=False).logits[0]
    finally:
        model.train(was_training)
    scale = 1.0 + float(alone.float().abs().max())
    gap = float((packed.float() - alone.float()).abs().max())
    tolerance = (1e-4 if packed.dtype == torch.float32 else 5e-2) * scale
    if not gap <= tolerance:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise PackedAttentionLeak(
            f"padding-free micro-batches: {name} (attention implementation {impl!r}) does not keep packed sequences "
            f"apart - a sequence packed after another gets outputs {gap:.3g} away from its own (tolerance "
            f"{tolerance:.3g}). Set padding_free=False (right-padded micro-batches), or load the model with an "
            f"attention implementation that honours packed position ids (sdpa, eager, flash_attention_2)."
        )
    return gap
