"""A tiny Qwen2-architecture causal LM built from config (random weights, no download)."""

from __future__ import annotations

from typing import Any

__all__ = ["build_tiny_model"]


def build_tiny_model(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    sliding_window: int | None = None,
):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (vocab = ``len(tokenizer)``).

    ``sliding_window`` turns on Qwen2's sliding-window attention in every layer: each token attends to
    the last ``sliding_window`` positions only. A tiny model trained for minutes learns to copy numbers
    (question -> code, tool output -> answer) far faster when its attention is not spread over a long
    system prompt.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0} if sliding_window else {}),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn_implementation
    return model
