"""A tiny local reward model for the ``reward_model`` component's tests (tests/test_reward_model.py) and the 2-rank
trainer runs that score with it (tests/dist_trainer_run.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_reward_model(folder: str | Path, template: str = "qwen2_5", seed: int = 0) -> str:
    """A random tiny ``Qwen2ForSequenceClassification`` (one label; the same for the same ``seed``) and its tokenizer
    (:func:`trl_plugins.tiny.build_tokenizer` with ``template``), saved to ``folder``; returns the folder."""
    from transformers import Qwen2ForSequenceClassification

    from trl_plugins.tiny import build_tokenizer, tiny_model_config

    tok = build_tokenizer(template)
    config = tiny_model_config(tok)
    config.num_labels = 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def zero3_child(folder: str, store: str) -> None:
    """Run in a process of its own (a process group, DeepSpeed's globals): under a ZeRO-3 config transformers builds a
    model partitioned (``zero.Init``: every weight empty on one rank); the component loads it whole, to the value it
    has without DeepSpeed, and leaves the config as it was. Prints ``zero3 ok``."""
    import random

    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.rewards import reward_model

    traj, row = make_trajectory(random.Random(0), num_turns=1), {"prompt": "What is 6 * 7?"}
    traj.turns[-1].text = "The answer is \\boxed{42}."
    expected = reward_model.RewardModelReward(model=folder)(traj, row)
    reward_model._LOADED.clear()  # the process's replica: loaded again below, under ZeRO-3
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    zero3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    held = HfDeepSpeedConfig({**zero3, "train_micro_batch_size_per_gpu": 1})  # noqa: F841 - read through a weakref
    assert AutoModelForSequenceClassification.from_pretrained(folder).score.weight.numel() == 0  # negative control
    assert reward_model.RewardModelReward(model=folder)(traj, row) == expected
    assert is_deepspeed_zero3_enabled()
    dist.destroy_process_group()
    print("zero3 ok")
