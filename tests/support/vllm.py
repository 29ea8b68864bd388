"""vLLM without vLLM: a tiny model saved for the fake engine (tests/fake_vllm.py), the patch that installs the
fake, and a short training run that generates with it."""

from __future__ import annotations

import torch

import fake_vllm as fake
from conftest import code_schema
from support.trainer import tiny_config
from trl_plugins.rollout import ChatFormat
from trl_plugins.tiny import build_tiny_model, build_tokenizer


def save_tiny_model(tmp_path_factory):
    """A tiny model and tokenizer saved to disk (vLLM loads the model by its path)."""
    path = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer("qwen2_5")
    build_tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    chat = ChatFormat(tok, [code_schema()])
    prompts = [chat.initial_prompt_ids([{"role": "user", "content": q}]) for q in ("What is 2 + 2?", "Compute 17 * 3.")]
    return str(path), tok, chat, prompts


def install_fake_vllm(monkeypatch):
    """Puts the fake engine where TRL looks for vLLM; returns ``install(**kwargs)`` to reinstall it differently."""
    import trl.generation.vllm_client as trl_client
    import trl.generation.vllm_generation as trl_generation
    import trl.trainer.grpo_trainer as trl_grpo

    def install(**kwargs):
        monkeypatch.setattr(trl_grpo, "VLLMGeneration", fake.generation_class(**kwargs))
        monkeypatch.setattr(trl_generation, "SamplingParams", fake.SamplingParams, raising=False)
        monkeypatch.setattr(trl_client, "VLLMClient", fake.FakeVLLMClient)

    install()
    return install


def train_with_vllm(tmp_path, path, peft_config=None, **overrides):
    """Trains the model saved at ``path`` for two steps with vLLM; returns the trainer and each rollout's trajectories."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_plugins.trainers import MultiTurnGRPOTrainer

    config = tiny_config(tmp_path, **{"use_vllm": True, **overrides})  # the trainer tests' config, sampled by vLLM
    rows = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)])

    class LastTokenReward:
        def __call__(self, trajectory, example):
            return (sum(trajectory.turns[-1].completion_ids) % 7) / 7.0

    trainer = MultiTurnGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        config,
        train_dataset=rows,
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_components={"length": LastTokenReward()},
        peft_config=peft_config,
    )
    import trl_plugins.trainers.phases as module

    seen, original = [], module.rollout_rows

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(result.trajectories)
        return result

    module.rollout_rows = spy
    try:
        trainer.train()
    finally:
        module.rollout_rows = original
    return trainer, seen


def same_weights(engine_model, trainer) -> bool:
    """Whether the engine's model holds the trainer's current weights."""
    theirs = dict(engine_model.named_parameters())
    return all(torch.equal(theirs[n], p.detach()) for n, p in trainer.model.named_parameters())
