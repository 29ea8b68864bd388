"""Finding and switching off every dropout a model applies in training mode (the training forward must be the
deterministic one the sampler ran)."""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["dropout_probabilities", "disable_dropout"]

_HEAD_ONLY_DROPOUT = ("classifier_dropout",)
"""Dropout of a classification head, which a causal LM does not have (the critic sets its own to 0)."""


def _is_dropout(name: str, value: Any) -> bool:
    name = name.lower()
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > 0
        and ("dropout" in name or name.endswith("pdrop"))
        and name not in _HEAD_ONLY_DROPOUT
    )


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
