"""The run is resolved once: every plugin built once per process, every setting checked once, whoever uses it (the
trainer, an evaluation, the recipe); a process that receives the pickled spec rebuilds the plugins and checks
nothing again. Each count has a negative control showing the counter can see a second build or check."""

from __future__ import annotations

import json
import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import tiny_recipe_inputs
from support.run import BUILT, CountingTool, counting_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def checks(monkeypatch):
    """How often each of the run's checks ran: the config's own fields, the plugin settings, the sampler, the adapter."""
    import trl_plugins.run.build as build
    import trl_plugins.run.config as config
    import trl_plugins.run.lora as lora

    counts: Counter = Counter()

    def counted(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(config, "apply_trl_fields")
    counted(build, "check_plugin_settings")
    counted(build, "check_sampler_available")
    counted(lora, "check_peft_config")
    BUILT.clear()
    return counts


def test_a_run_builds_each_plugin_once_and_checks_each_setting_once(tmp_path, checks):
    from datasets import Dataset

    from trl_plugins.evaluation import evaluate_policy
    from trl_plugins.run import build_run, resolve_run
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    config = counting_config(tmp_path)
    assert checks == {"apply_trl_fields": 1} and BUILT == {}  # the config checks its own fields; builds nothing
    run = resolve_run(config)
    once = {"rollout": 1, "advantage": 1, "policy_loss": 1, "tool": 1, "reward": 1}
    assert BUILT == once
    assert checks == {
        "apply_trl_fields": 1,
        "check_plugin_settings": 1,
        "check_sampler_available": 1,
        "check_peft_config": 1,
    }
    # The trainer, its training and an in-process evaluation all take the run: nothing is built or checked again.
    tok = build_tokenizer("qwen2_5")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok), train_dataset=Dataset.from_list(rows), processing_class=tok, run=run
    )
    assert trainer.run is run and trainer.args is config
    trainer.train()
    result, _ = evaluate_policy(
        trainer.model_wrapped,
        tok,
        rows[:2],
        trainer.run,
        samples=2,
        ks=(1,),
        success_component="support.run:CountingReward",
        backend=trainer.generation_backend(),
    )
    assert result.problems == 2
    assert BUILT == once and sum(checks.values()) == 4
    # Another process rebuilds from the pickled spec (the recipe's child evaluation does): plugins once more there,
    # no check at all.
    spec = pickle.loads(pickle.dumps(run.spec))
    again = build_run(spec)
    assert BUILT == {k: 2 for k in once} and sum(checks.values()) == 4
    assert again.config.rollout_kwargs == config.rollout_kwargs and again.sampler == run.sampler
    # Negative control: resolving a second time is seen as a second build and a second check.
    resolve_run(config).close()
    assert BUILT == {k: 3 for k in once} and checks["check_plugin_settings"] == 2


def test_a_run_refuses_what_its_plugins_cannot_serve_before_any_model(tmp_path, checks):
    # What needs the plugins built is checked when the run is resolved, with the plugin named.
    from trl_plugins.run import resolve_run

    with pytest.raises(
        ValueError,
        match=r"the rollout's token budget of 600 makes datums of up to 599 tokens, over "
        r"max_context_tokens=300",
    ):
        resolve_run(counting_config(tmp_path, max_context_tokens=300))
    with pytest.raises(
        ValueError,
        match=r"\['critic_learning_rate'\] configure the critic, but advantage 'support.run:CountingAdvantage'",
    ):
        resolve_run(counting_config(tmp_path, critic_learning_rate=1e-4))
    with pytest.raises(
        ValueError,
        match="tool_kwargs\\['support.run:CountingTool'\\]: tools plugin 'support.run:CountingTool' takes no "
        "'text'; it accepts \\[\\]",
    ):
        resolve_run(counting_config(tmp_path, tool_kwargs={"support.run:CountingTool": {"text": "x"}}))


def test_a_trainer_given_a_run_takes_nothing_that_would_build_another(tmp_path):
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    config = counting_config(tmp_path)
    run = resolve_run(config)
    tok = build_tokenizer("qwen2_5")
    with pytest.raises(ValueError, match="built into the run: pass them to resolve_run"):
        MultiTurnGRPOTrainer(build_tiny_model(tok), processing_class=tok, run=run, tools={"echo": CountingTool()})
    with pytest.raises(ValueError, match="args differs from the run's config"):
        MultiTurnGRPOTrainer(build_tiny_model(tok), counting_config(tmp_path), processing_class=tok, run=run)
    run.close()


def test_the_run_spec_carries_where_each_setting_came_from(tmp_path):
    # The recipe records provenance where it layers the settings; the run carries it (and its pickled spec).
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        from retool.config import parse_args
    finally:
        sys.path.pop(0)
    from trl_plugins.run import resolve_run

    mine = tmp_path / "mine.yaml"
    mine.write_text("learning_rate: 1.0e-4\nnum_generations: 4\n")
    script_args, args = parse_args(
        ["--config", str(mine), "--num_generations", "2", "--output_dir", str(tmp_path / "o"), "--report_to", "none"]
    )
    run = resolve_run(args, provenance=script_args.provenance)
    spec = pickle.loads(pickle.dumps(run.spec))
    assert spec.origin("learning_rate") == "mine.yaml"
    assert spec.origin("num_generations") == "the command line"  # the command line wins over the file
    assert spec.origin("max_steps") == "retool_ppo.yaml" and spec.origin("policy_loss") == "retool_ppo.yaml"
    assert spec.origin("use_cpu") == "the CPU defaults" and spec.origin("gradient_checkpointing") == "default"
    run.close()


@pytest.mark.slow
def test_the_recipe_resolves_its_run_once_for_the_trainer_and_the_periodic_evaluation(tmp_path, monkeypatch):
    # The recipe in this process (its before/after evaluations run in child processes, from the pickled spec):
    # one resolution, each plugin built once, however many steps and periodic evaluations run.
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import retool_ppo
    finally:
        sys.path.pop(0)
    import trl_plugins.run.build as build

    model_dir, data = tiny_recipe_inputs(tmp_path)
    resolved = []
    original = build.resolve_run
    monkeypatch.setattr(build, "resolve_run", lambda *a, **k: resolved.append(1) or original(*a, **k))
    import trl_plugins.run as run_package

    monkeypatch.setattr(run_package, "resolve_run", build.resolve_run)
    BUILT.clear()
    argv = [
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--plot",
        "false",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "2",
        "--eval_problems",
        "2",
        "--eval_samples",
        "1",
        "--eval_every_steps",
        "1",
        "--eval_every_problems",
        "2",
        "--save_strategy",
        "no",
        "--reward_components",
        "correct",
        "support.run:CountingReward",
        "--reward_component_weights",
        "1.0",
        "1.0",
        "--rollout",
        "support.run:CountingRollout",
        "--advantage",
        "support.run:CountingAdvantage",
        "--policy_loss",
        "support.run:CountingLoss",
        "--rollout_kwargs",
        '{"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 1024}',
        "--max_padded_tokens_per_micro_batch",
        "8000",
    ]
    script_args, args = retool_ppo.parse_args(argv)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))  # the child evaluations import this module's plugins
    assert retool_ppo.main(script_args, args) == 0
    assert resolved == [1]
    assert BUILT == {"rollout": 1, "advantage": 1, "policy_loss": 1, "reward": 1}
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sum("heldout/accuracy" in r for r in records) == 2  # both periodic evaluations ran, on the same run
