"""LoRA: TRL's ``ModelConfig`` fields, each honoured or refused, and the checks on a PEFT config.

A recipe parses TRL's ``ModelConfig`` (``--use_peft``, ``--lora_r``, ...), calls
:func:`check_model_config` before any model loads, builds the adapter config with TRL's own
``get_peft_config`` (:func:`peft_config_from`) and loads the policy with :func:`model_init_kwargs`.
``MultiTurnGRPOTrainer`` hands the ``peft_config`` to TRL's ``GRPOTrainer.__init__``, which wraps the
policy (only the adapter trains) and, with ``beta > 0``, uses the policy with its adapter disabled as
the reference (no second copy). :func:`check_peft_config` refuses what this trainer cannot do with an
adapter, once, when the run is resolved (:func:`trl_plugins.run.resolve_run`); :func:`check_peft_model` checks a
policy handed over already wrapped in adapters.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from trl_plugins.run.trl_fields import FieldKind, FieldRule

__all__ = [
    "MODEL_FIELDS",
    "check_model_config",
    "check_model_dropout",
    "check_peft_config",
    "check_peft_model",
    "peft_config_from",
    "model_init_kwargs",
    "render_table",
]

_H, _R = FieldKind.HONOURED, FieldKind.REFUSED

_QUANTISED = (
    "4/8-bit loading (QLoRA) is not supported: bitsandbytes needs a CUDA GPU (it cannot work on CPU, and it is not "
    "installed here), and a quantised rollout, update and adapter-disabled reference have not been tested on a GPU; "
    "train the adapter on a bf16 base (--use_peft --bf16 true)."
)
_LORA_DROPOUT = (
    "refused above 0: with disable_dropout=True TRL would set it to 0 (every dropout of the wrapped policy), and "
    "otherwise it would act in the update's forward but not in generation, so the on-policy ratio is no longer 1 "
    "and the clip acts on dropout noise (as neftune_noise_alpha, refused for that reason); set --lora_dropout 0."
)

MODEL_FIELDS: dict[str, FieldRule] = {
    "model_name_or_path": FieldRule(_H, "the policy to load (a recipe may give it a default of its own)."),
    "model_revision": FieldRule(
        _R,
        "the policy and tokenizer, TRL's reference (beta > 0) and the held-out evaluation load model_name_or_path at "
        "its default revision; download the revision and pass its local path.",
    ),
    "dtype": FieldRule(
        _H,
        "from_pretrained dtype of the policy (model_init_kwargs); at its default 'float32': float32, or 'auto' with "
        "--bf16; TRL's reference and the critic take the policy's dtype.",
    ),
    "attn_implementation": FieldRule(
        _H, "from_pretrained attention of the policy (model_init_kwargs); TRL's reference takes the policy's."
    ),
    "use_peft": FieldRule(
        _H,
        "wraps the policy in a LoRA adapter built by TRL's get_peft_config; only the adapter (and "
        "lora_modules_to_save) trains, checkpoints hold the adapter.",
    ),
    "lora_r": FieldRule(_H, "LoraConfig r (TRL's get_peft_config); refused without use_peft."),
    "lora_alpha": FieldRule(_H, "LoraConfig lora_alpha; refused without use_peft."),
    "lora_dropout": FieldRule(_H, "LoraConfig lora_dropout; " + _LORA_DROPOUT),
    "lora_target_modules": FieldRule(
        _H,
        "LoraConfig target_modules (None: PEFT's default for the architecture, q_proj and v_proj for Qwen2); refused "
        "without use_peft.",
    ),
    "lora_target_parameters": FieldRule(
        _H, "LoraConfig target_parameters (e.g. MoE expert weights); refused without use_peft."
    ),
    "lora_modules_to_save": FieldRule(
        _H,
        "LoraConfig modules_to_save: fully trained copies saved with the adapter and switched off with it for the "
        "reference; refused without use_peft.",
    ),
    "lora_task_type": FieldRule(
        _H, "LoraConfig task_type; anything but CAUSAL_LM is refused (the policy is a causal LM)."
    ),
    "use_rslora": FieldRule(_H, "LoraConfig use_rslora (scaling lora_alpha / sqrt(r)); refused without use_peft."),
    "use_dora": FieldRule(
        _H,
        "LoraConfig use_dora; refused without use_peft and under DeepSpeed ZeRO-3 (untested there: DoRA reads the "
        "base layer's weight in its own forward, outside ZeRO-3's gather of that layer).",
    ),
    "load_in_8bit": FieldRule(_R, _QUANTISED),
    "load_in_4bit": FieldRule(_R, _QUANTISED),
    "bnb_4bit_quant_type": FieldRule(_R, "a setting of load_in_4bit, which is refused."),
    "use_bnb_nested_quant": FieldRule(_R, "a setting of load_in_4bit, which is refused."),
    "bnb_4bit_quant_storage": FieldRule(_R, "a setting of load_in_4bit, which is refused."),
}
"""The fate of every field of TRL's ``ModelConfig`` (``tests/test_lora.py`` fails when TRL adds one)."""

_LORA_ONLY = (
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_target_parameters",
    "lora_modules_to_save",
    "lora_task_type",
    "use_rslora",
    "use_dora",
)


def _is_set(model_args: Any, name: str) -> bool:
    """Off the default of ``model_args``'s own class (a recipe may subclass ModelConfig with other defaults)."""
    f = {f.name: f for f in dataclasses.fields(model_args)}[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return getattr(model_args, name) != default


def _zero3(config: Any) -> bool:
    plugin = getattr(config, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def check_model_config(model_args: Any, config: Any) -> None:
    """Refuse ``ModelConfig`` settings that would be ignored or cannot work, before any model loads.

    Args:
        model_args: TRL's ``ModelConfig`` (or a subclass, such as a recipe's script arguments).
        config: The run's ``MultiTurnGRPOConfig``.

    Raises:
        ValueError: one message naming every refused field and what to do instead.
    """
    refused = [
        f"  - {name}={getattr(model_args, name)!r}: {rule.reason}"
        for name, rule in MODEL_FIELDS.items()
        if rule.kind == FieldKind.REFUSED and _is_set(model_args, name)
    ]
    if not model_args.use_peft:
        refused += [
            f"  - {name}={getattr(model_args, name)!r}: a LoRA setting without --use_peft would be ignored; "
            f"add --use_peft or drop it."
            for name in _LORA_ONLY
            if _is_set(model_args, name)
        ]
    if refused:
        raise ValueError(
            "these model settings would be ignored or cannot work here (docs/training.md#lora lists "
            "every field):\n" + "\n".join(refused)
        )


def peft_config_from(model_args: Any) -> Any:
    """TRL's ``get_peft_config(model_args)``: a ``LoraConfig`` with ``use_peft``, else None."""
    from trl import get_peft_config

    return get_peft_config(model_args)


def check_peft_config(peft_config: Any, config: Any, *, needs_values: bool = False) -> None:
    """Refuse an adapter this trainer cannot train correctly (once, when the run is resolved).

    Args:
        peft_config: The ``PeftConfig`` the policy trains (None: full fine-tuning, nothing to check).
        config: The run's ``MultiTurnGRPOConfig``.
        needs_values: Whether the advantage estimator brings a critic.

    Raises:
        ValueError: what cannot work, why, and what to set instead.
    """
    if peft_config is not None:
        _check_lora(peft_config, config)


def check_peft_model(model: Any, config: Any, *, needs_values: bool = False) -> None:
    """Refuse a policy handed to the trainer already wrapped in adapters (a ``PeftModel``) that cannot train here:
    its adapters are checked as :func:`check_peft_config` checks one, and a critic cannot start from it.

    Raises:
        ValueError: what cannot work, why, and what to do instead.
    """
    from accelerate.utils import is_peft_model

    if isinstance(model, (str, os.PathLike, type(None))) or not is_peft_model(model):
        return
    for pc in model.peft_config.values():
        if pc is not None:
            _check_lora(pc, config)
    if needs_values:
        raise ValueError(
            "a critic (advantage with needs_values, e.g. 'gae') is initialised from the policy's weights, which a "
            "PeftModel instance does not expose as a plain backbone; pass the base model with peft_config (the critic "
            "then starts from the base, which the fresh adapter leaves unchanged), or merge the adapter first."
        )


def check_model_dropout(model_or_config: Any, config: Any) -> None:
    """Refuse a policy that would train with dropout: ``lora_dropout``'s rule, for the base model's own dropout.

    Args:
        model_or_config: The policy, its ``PretrainedConfig`` (before it loads), or a path to load that config from.
        config: The run's ``MultiTurnGRPOConfig``; with ``disable_dropout`` the trainer sets every dropout to 0
            (:func:`trl_plugins.modeling.disable_dropout`), so there is nothing to refuse.

    Raises:
        ValueError: dropout above 0 with ``disable_dropout`` off (names where, and says to pass --disable_dropout).
    """
    from trl_plugins.modeling import dropout_probabilities

    if config.disable_dropout or model_or_config is None:
        return
    if isinstance(model_or_config, (str, os.PathLike)):
        from transformers import AutoConfig

        model_or_config = AutoConfig.from_pretrained(model_or_config)
    found = dropout_probabilities(model_or_config)
    if found:
        shown = ", ".join(f"{k}={v:g}" for k, v in list(found.items())[:4]) + (
            f" and {len(found) - 4} more" if len(found) > 4 else ""
        )
        raise ValueError(
            f"the policy has dropout ({shown}) and disable_dropout is off: it would act in the update's forward but "
            f"not in generation, so the on-policy ratio is no longer 1 and the clip acts on dropout noise (the reason "
            f"lora_dropout is refused). Pass --disable_dropout true (every dropout of the policy, its reference and "
            f"the critic set to 0, attention dropout included)."
        )


def _check_lora(pc: Any, config: Any) -> None:
    from peft import LoraConfig

    if not isinstance(pc, LoraConfig):
        raise ValueError(
            f"{type(pc).__name__}: only LoRA adapters are supported (prompt-learning methods add virtual tokens, "
            f"which would shift the per-token log-probs); use peft.LoraConfig (--use_peft)."
        )
    task = str(getattr(pc.task_type, "value", pc.task_type)) if pc.task_type is not None else None
    if task not in (None, "CAUSAL_LM"):
        raise ValueError(f"lora_task_type={task!r}: the policy is a causal language model; use CAUSAL_LM.")
    if pc.lora_dropout:
        raise ValueError(f"lora_dropout={pc.lora_dropout} is " + _LORA_DROPOUT)
    if pc.use_dora and _zero3(config):
        raise ValueError(
            "use_dora under DeepSpeed ZeRO-3 is untested: DoRA reads the base layer's weight in its own forward, "
            "outside ZeRO-3's gather of that layer; use plain LoRA, or ZeRO-2 / DDP for DoRA."
        )


def model_init_kwargs(model_args: Any, config: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords of the policy: ``dtype`` (``model_args.dtype`` when set off its default,
    else float32, or ``"auto"`` with ``bf16``) and ``attn_implementation`` when given."""
    import torch

    dtype: Any = model_args.dtype if _is_set(model_args, "dtype") else ("auto" if config.bf16 else torch.float32)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    out: dict[str, Any] = {"dtype": dtype}
    if model_args.attn_implementation is not None:
        out["attn_implementation"] = model_args.attn_implementation
    return out


def render_table() -> str:
    """The Markdown table of :data:`MODEL_FIELDS` (refused, then honoured; by name), as in docs/training.md."""
    order = {FieldKind.REFUSED: 0, FieldKind.HONOURED: 1}
    rows = sorted(MODEL_FIELDS.items(), key=lambda item: (order[item[1].kind], item[0]))
    lines = ["| ModelConfig field | kind | in the recipe and MultiTurnGRPOTrainer |", "|---|---|---|"]
    lines += [f"| `{name}` | {rule.kind} | {rule.reason} |" for name, rule in rows]
    return "\n".join(lines) + "\n"
