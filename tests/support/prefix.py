"""Shared-prefix inputs: seeded groups of datums that share their prompts, and small models of several architectures."""

from __future__ import annotations

import random

import torch

from conftest import make_trajectory
from trl_plugins.datum import build_datum


def group_datums(seed: int = 7, groups: int = 3, size: int = 3, extra: int = 1, vocab: int = 200) -> list:
    """``groups`` groups of ``size`` trajectories sharing a prompt (1-3 turns each), then ``extra`` lone ones."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 24))]
        for _ in range(size):
            traj = make_trajectory(rng, num_turns=rng.randint(1, 3), prompt=prompt, group_id=g, vocab=vocab)
            out.append(
                build_datum(traj, advantage=rng.choice([-1, 1]) * rng.uniform(0.2, 1.5), trajectory_index=len(out))
            )
    for _ in range(extra):
        out.append(
            build_datum(make_trajectory(rng, num_turns=2, vocab=vocab), advantage=0.7, trajectory_index=len(out))
        )
    return out


def small_model(arch: str):
    """A seeded 2-layer model of ``arch`` (qwen2 eager/sdpa/sliding/hybrid, llama, mistral_sliding)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    small = dict(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    attn = "eager" if arch.endswith("eager") else "sdpa"
    if arch.startswith("qwen2_sliding"):  # a window of 6, shorter than every shared prompt
        model = Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=6, max_window_layers=0))
    elif arch == "qwen2_hybrid":  # one full-attention layer, one sliding-window layer
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **small, use_sliding_window=True, sliding_window=6, layer_types=["full_attention", "sliding_attention"]
            )
        )
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small))
    elif arch == "mistral_sliding":
        model = MistralForCausalLM(MistralConfig(**small, sliding_window=5))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**small))
    model.config._attn_implementation = attn
    return model
