"""Shared fixtures: registry isolation, seeded multi-turn trajectories, a tiny local Qwen2 model."""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path

import pytest
import torch

from trl_plugins.registry import ALL_REGISTRIES
from trl_plugins.types import StopReason, TokenSource, Trajectory, Turn

ASSETS = Path(__file__).parent / "assets"


def code_schema() -> dict:
    """The built-in code_interpreter's JSON schema (what the chat template shows the model)."""
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    return CodeInterpreter().schema()


@pytest.fixture
def isolated_registries():
    """Snapshot every global registry and restore it afterwards (entry-point discovery included)."""
    for reg in ALL_REGISTRIES.values():
        reg._load_builtins()
    saved = {name: (dict(reg._entries), reg._entry_points_loaded) for name, reg in ALL_REGISTRIES.items()}
    for reg in ALL_REGISTRIES.values():
        reg._entries = dict(reg._entries)
        reg._entry_points_loaded = False
    yield ALL_REGISTRIES
    for name, reg in ALL_REGISTRIES.items():
        reg._entries, reg._entry_points_loaded = saved[name]


def make_trajectory(
    rng: random.Random,
    *,
    num_turns: int,
    vocab: int = 200,
    group_id: int = 0,
    sample_index: int = 0,
    advantage: float | None = None,
    stop_reason: StopReason = StopReason.FINAL_ANSWER,
) -> Trajectory:
    """A prefix-consistent multi-turn trajectory with random tokens, log-probs and provenance."""
    turns = []
    history: list[int] = []
    for i in range(num_turns):
        if i == 0:
            new = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
            new_sources = [TokenSource.PROMPT] * len(new)
        else:
            obs = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
            new = [1] + obs + [2]  # glue, tool output, glue
            new_sources = [TokenSource.GLUE] + [TokenSource.OBSERVATION] * len(obs) + [TokenSource.GLUE]
        prompt = history + new
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 14))]
        logprobs = [-rng.uniform(0.05, 3.0) for _ in completion]
        turns.append(
            Turn(prompt_ids=prompt, completion_ids=completion, completion_logprobs=logprobs, prompt_sources=new_sources)
        )
        history = prompt + completion
    return Trajectory(
        turns=turns,
        question_id=f"q{group_id}",
        group_id=group_id,
        sample_index=sample_index,
        stop_reason=stop_reason,
        advantage=advantage if advantage is not None else rng.uniform(-1.5, 1.5),
    )


def tiny_qwen2(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded 2-layer Qwen2 causal LM (vocab 200) built from config, in eval mode; no download."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    model.config._attn_implementation = "eager"
    model.eval()  # no dropout: gradients must be deterministic
    return model


@pytest.fixture(scope="session")
def tiny_model_factory():
    """Build (and cache) :func:`tiny_qwen2` per dtype; each call returns a fresh copy."""
    cache: dict[str, torch.nn.Module] = {}

    def build(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = str(dtype)
        if key not in cache:
            cache[key] = tiny_qwen2(dtype)
        return copy.deepcopy(cache[key])

    return build


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def isclose(a: float, b: float, tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
