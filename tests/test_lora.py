"""LoRA: TRL's ModelConfig fields (honoured or refused, before any model loads), adapter-only training,
adapter checkpoints and resuming (trl_plugins/trainers/lora.py; the reference with an adapter is in
tests/test_trainer.py, the ZeRO-3 equivalence in tests/test_distributed.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support.trainer import TokenReward, tiny_config, tiny_dataset
from trl_plugins.run.lora import (
    MODEL_FIELDS,
    check_model_config,
    check_peft_config,
    check_peft_model,
    peft_config_from,
    render_table,
)
from trl_plugins.tiny import build_tiny_model, build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "training.md"


def _recipe_args(argv):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        from retool.config import parse_args

        return parse_args(argv)
    finally:
        sys.path.pop(0)


def _lora(**overrides):
    from trl import ModelConfig

    kwargs = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"])
    return peft_config_from(ModelConfig(**{**kwargs, **overrides}))


def test_every_model_config_field_has_a_rule():
    # A TRL upgrade that adds or drops a ModelConfig field fails here until MODEL_FIELDS says what it does.
    from trl import ModelConfig

    assert sorted(f.name for f in dataclasses.fields(ModelConfig)) == sorted(MODEL_FIELDS)
    for name, rule in MODEL_FIELDS.items():
        assert rule.reason and "|" not in rule.reason and "\n" not in rule.reason, name


def test_docs_carry_the_rendered_model_table():
    text = DOCS.read_text()
    section = text[text.index("## LoRA") :]
    assert render_table() in section, "docs/training.md is stale: paste lora.render_table() into its LoRA section"


def test_the_recipe_parses_lora_into_trls_lora_config():
    script_args, args = _recipe_args(
        ["--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj", "--use_rslora", "true"]
    )
    check_model_config(script_args, args)
    config = peft_config_from(script_args)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora) == (8, 32, 0.0, True)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and str(config.task_type) == "CAUSAL_LM"
    script_args, args = _recipe_args([])  # the recipe's defaults: full fine-tuning, nothing refused
    check_model_config(script_args, args)
    assert peft_config_from(script_args) is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lora_r", "8"], r"lora_r=8: a LoRA setting without --use_peft would be ignored"),
        (["--use_dora", "true"], r"use_dora=True: a LoRA setting without --use_peft"),
        (["--use_peft", "--load_in_4bit", "true"], r"load_in_4bit=True: 4/8-bit loading \(QLoRA\) is not supported"),
        (["--use_peft", "--load_in_8bit", "true"], r"load_in_8bit=True: 4/8-bit"),
        (["--use_peft", "--bnb_4bit_quant_type", "fp4"], r"bnb_4bit_quant_type='fp4': a setting of load_in_4bit"),
        (["--model_revision", "v2"], r"model_revision='v2': .* default revision"),
        (["--use_peft", "--lora_dropout", "0.05"], r"lora_dropout=0.05 is refused above 0"),
        (["--use_peft", "--lora_task_type", "SEQ_CLS"], r"lora_task_type='SEQ_CLS'.*use CAUSAL_LM"),
    ],
)
def test_the_recipe_refuses_what_cannot_work_before_any_model_loads(monkeypatch, tmp_path, argv, message):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import retool.default_model
        import retool_ppo
    finally:
        sys.path.pop(0)

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded("the recipe went on to load a model")

    monkeypatch.setattr(retool.default_model, "model_path_or_default", load)
    common = ["--eval_problems", "0", "--report_to", "none", "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit, match=message):
        retool_ppo.main(*_recipe_args([*argv, *common]))
    # Negative control: valid LoRA settings pass the check and the recipe goes on to load the model.
    with pytest.raises(Loaded):
        retool_ppo.main(*_recipe_args(["--use_peft", "--lora_r", "8", *common]))


def test_check_peft_refuses_other_adapters_dora_under_zero3_and_a_wrapped_policy_with_a_critic(tmp_path):
    from peft import PromptTuningConfig, get_peft_model

    config = tiny_config(tmp_path)
    check_peft_config(_lora(), config)  # plain LoRA passes
    with pytest.raises(ValueError, match="only LoRA adapters are supported"):
        check_peft_config(PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), config)
    zero3 = SimpleNamespace(disable_dropout=False, deepspeed_plugin=SimpleNamespace(zero_stage=3))
    check_peft_config(_lora(use_dora=True), config)  # DoRA without ZeRO-3 passes
    with pytest.raises(ValueError, match="use_dora under DeepSpeed ZeRO-3 is untested"):
        check_peft_config(_lora(use_dora=True), zero3)
    wrapped = get_peft_model(build_tiny_model(build_tokenizer("qwen2_5")), _lora())
    check_peft_model(wrapped, config)
    with pytest.raises(ValueError, match="pass the base model with peft_config"):
        check_peft_model(wrapped, config, needs_values=True)
    with pytest.raises(ValueError, match="only LoRA adapters are supported"):  # a wrapped policy's adapters too
        check_peft_model(
            get_peft_model(
                build_tiny_model(build_tokenizer("qwen2_5")),
                PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
            ),
            config,
        )


def _trainer(out, tok, model, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    return MultiTurnGRPOTrainer(
        model,
        tiny_config(out, **overrides),
        train_dataset=tiny_dataset(8),
        processing_class=tok,
        reward_components={"length": TokenReward()},
        peft_config=_lora(),
    )


def _split(model):
    """(base, adapter) parameters of a PeftModel by name, cloned."""
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = {n: p for n, p in named.items() if ".lora_" in n}
    return {n: p for n, p in named.items() if n not in adapter}, adapter


def test_lora_trains_only_the_adapter_and_the_checkpoint_holds_only_the_adapter(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer("qwen2_5")
    path = tmp_path / "base"
    build_tiny_model(tok).save_pretrained(path)  # the adapter's config names the base it belongs to
    trainer = _trainer(tmp_path / "run", tok, str(path), max_steps=1, save_strategy="steps", save_steps=1)
    base_before, adapter_before = _split(trainer.model)
    assert adapter_before and all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()
    base_after, adapter_after = _split(trainer.model)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)  # bit-identical
    assert any(not torch.equal(adapter_before[n], adapter_after[n]) for n in adapter_before)
    assert all(float(p.abs().sum()) > 0 for n, p in adapter_after.items() if "lora_B" in n)  # B started at 0

    folder = tmp_path / "run" / "checkpoint-1"
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
    assert not list(folder.glob("model*.safetensors")) and not (folder / "pytorch_model.bin").exists()
    saved = load_file(folder / "adapter_model.safetensors")
    assert saved and all(".lora_" in k for k in saved)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in adapter_after.values())
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(path)
    # The checkpoint loads by its path as the trained policy (base + adapter), e.g. for the evaluation.
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    trainer.model.eval()
    with torch.no_grad():
        want, got, plain = trainer.model(input_ids=ids).logits, loaded(input_ids=ids).logits, base(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert (plain - want).abs().max() > 1e-4  # negative control: the adapter did change the policy


def test_lora_resume_from_checkpoint_reproduces_the_next_step(tmp_path):
    # Uninterrupted: 2 steps, saving after each. Resumed: a fresh trainer (fresh base, fresh adapter) takes
    # step 2 from checkpoint-1: the adapter and its optimizer state come back, so the adapters are equal.
    from safetensors.torch import load_file

    tok = build_tokenizer("qwen2_5")
    straight = _trainer(
        tmp_path / "straight",
        tok,
        build_tiny_model(tok),
        max_steps=2,
        optim="adamw_torch",
        save_strategy="steps",
        save_steps=1,
    )
    straight.train()
    resumed = _trainer(tmp_path / "resumed", tok, build_tiny_model(tok), max_steps=2, optim="adamw_torch")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    base_a, adapter_a = _split(straight.model)
    base_b, adapter_b = _split(resumed.model)
    assert all(torch.equal(base_a[n], base_b[n]) for n in base_a)
    for name in adapter_a:
        assert torch.allclose(adapter_a[name], adapter_b[name], rtol=1e-5, atol=1e-7), name
    # Negative control: the adapter after step 1 (the checkpoint) is not the adapter after step 2.
    step1 = load_file(tmp_path / "straight" / "checkpoint-1" / "adapter_model.safetensors")
    step2 = load_file(tmp_path / "straight" / "checkpoint-2" / "adapter_model.safetensors")
    assert step1.keys() == step2.keys() and any(not torch.allclose(step1[k], step2[k]) for k in step1)


def test_lora_with_a_critic_trains_the_adapter_and_a_full_critic_from_the_base(tmp_path):
    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    trainer = _trainer(tmp_path, tok, model, advantage="gae", max_steps=1, critic_learning_rate=1e-2)
    critic = trainer.accelerator.unwrap_model(trainer._critic)
    assert torch.equal(critic.model.embed_tokens.weight, model.model.embed_tokens.weight)
    critic_before = [p.detach().clone() for p in critic.parameters()]
    base_before, adapter_before = _split(trainer.model)
    trainer.train()
    base_after, adapter_after = _split(trainer.model)
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    assert any(not torch.equal(adapter_before[n], adapter_after[n]) for n in adapter_before)
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, critic.parameters()))


def test_disabling_the_adapter_also_switches_off_modules_to_save():
    # The reference (beta > 0) is the policy under use_adapter(model, None): lora_modules_to_save copies
    # must fall back to the original modules there too, or the reference would be a half-trained model.
    from peft import get_peft_model
    from trl.trainer.utils import use_adapter

    tok = build_tokenizer("qwen2_5")
    base = build_tiny_model(tok).eval()
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    with torch.no_grad():
        want = base(input_ids=ids).logits
    model = get_peft_model(build_tiny_model(tok), _lora(lora_modules_to_save=["norm"])).eval()
    copies = [p for n, p in model.named_parameters() if "modules_to_save" in n]
    assert copies and all(p.requires_grad for p in copies)
    with torch.no_grad():
        for p in copies:  # as if trained: only the copy of the final norm moves (lora_B is still 0)
            p.mul_(1.5)
        adapted = model(input_ids=ids).logits
        with use_adapter(model, adapter_name=None):
            reference = model(input_ids=ids).logits
    assert (adapted - want).abs().max() > 1e-3  # the copy acts on the adapted policy...
    assert torch.allclose(reference, want, atol=1e-6)  # ...and is off in the reference
