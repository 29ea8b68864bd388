"""MultiTurnGRPOTrainer end to end in one process, its validation, and the TRL surface it relies on."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from support.trainer import ConstantReward, FlakyCodeTool, PickyVerifier, TokenReward, tiny_config, tiny_dataset
from trl_plugins.tiny import build_tiny_model, build_tokenizer


class UndeclaredLoss:
    """A third-party policy loss that does not say what it needs."""

    def __call__(self, inp):
        raise AssertionError("never called")


def test_trains_end_to_end_and_writes_metrics_jsonl(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in (
        "reward/length",
        "rollout/turns_mean",
        "rollout/stop/turn_length",
        "rollout/degenerate_group_rate",
        "train/loss_tokens",
        "train/forward_tokens",
        "train/padding_efficiency",
        "train/micro_batches",
        "memory/peak_rss_mb",
        "train/behaviour_logprob_gap",
        "train/ratio_p10",
        "train/ratio_p50",
        "train/ratio_p90",
        "timing/rollout_s",
        "timing/packing_s",
        "timing/forward_backward_s",
        "timing/optimizer_s",
    ):
        assert key in steps[0], key
    assert 0 < steps[0]["train/padding_efficiency"] <= 1
    assert steps[0]["rollout/trajectories"] == 4  # 2 questions x group 2 on this rank
    assert steps[0]["train/update_skipped"] == 0.0 and steps[0]["train/loss_tokens"] > 0
    # On-policy in fp32: the sampler's log-probs are the trainer's (gap ~1e-7, ratios ~1).
    assert steps[0]["train/behaviour_logprob_gap"] < 1e-4 and abs(steps[0]["train/ratio_p50"] - 1) < 1e-4


def test_step_without_any_advantage_skips_the_update_and_still_counts(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.resilience import NoPolicyUpdate

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok).eval()  # as from_pretrained returns it: the step must still log as "train"
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": ConstantReward()},
    )
    # Every step is counted and logged, and a run that trained nothing ends loudly, saying why, after its last step.
    with pytest.raises(
        NoPolicyUpdate,
        match=r"without one policy update: all 2 of its steps.*every group's rewards were "
        r"equal \(all 4 trajectories of the step, all ranks, have advantage 0\)",
    ):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.policy_updates == 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/update_skipped"] for r in records if "train/update_skipped" in r] == [1.0, 1.0]
    assert [r["reward/total"] for r in records if "reward/total" in r] == [1.0, 1.0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(per_device_train_batch_size=3), r"\(3\) must be divisible by num_generations \(2\)"),
        (dict(gradient_accumulation_steps=2), "keep gradient_accumulation_steps=1"),
        (dict(reward_components=[]), "reward_components is empty"),
        (dict(reward_component_weights=[1.0, 2.0]), "give one weight per component"),
        (dict(rollout_kwargs="{not json"), "rollout_kwargs must be a JSON object"),
        # Unreachable machinery is refused when the config is built, not at step 1.
        (dict(beta=-0.1), "must be >= 0"),
        (dict(kl_estimator="k4"), "'k4' is not a valid KLEstimator"),
        (dict(beta=0.1, kl_penalty="returns"), "kl_penalty must be 'loss' or 'reward'"),
        (dict(policy_loss_kwargs={"kl_coef": 0.1}), "pass --beta 0.1"),
        (dict(beta=0.1, policy_loss_kwargs={"kl_coef": 0.2}), "pass --beta 0.2"),
        (dict(beta=0.1, kl_penalty="reward", policy_loss_kwargs={"kl_coef": 0.1}), "--kl_penalty loss"),
        (dict(beta=0.1, kl_estimator="k1", policy_loss_kwargs={"kl_estimator": "k2"}), "set only --kl_estimator"),
        # Estimator and weighting whose expected gradient is not KL(policy || reference)'s (tests/test_algos.py).
        (dict(beta=0.1, kl_estimator="k2"), r"biased gradient.*Pass --use_bias_correction_kl false"),
        (
            dict(beta=0.1, kl_estimator="k1", use_bias_correction_kl=False),
            r"zero expected gradient.*Pass --use_bias_correction_kl true",
        ),
        (dict(entropy_coef=0.01, policy_loss_kwargs={"entropy_coef": 0.02}), "disagree"),
        (dict(aggregation="seq_mean_token_sum_norm"), "set norm_length"),
        (dict(use_vllm=True, vllm_mode="remote"), "vllm_mode"),
        (dict(advantage="gae", vf_clip=0.0), "vf_clip > 0"),
        (
            dict(rollout_kwargs={"max_turn": 2}),
            r"rollout_kwargs: rollouts plugin 'multi_turn' takes no 'max_turn'; it accepts \['max_turns',.*Did you mean 'max_turns'\?",
        ),
        (
            dict(rollout_kwargs={"max_turns": 0}),
            r"rollout_kwargs: rollouts plugin 'multi_turn' refused \{'max_turns': 0\}: max_turns must be >= 1",
        ),
        (dict(advantage="grpo"), "unknown advantages plugin 'grpo'"),
        (
            dict(policy_loss="test_trainer:UndeclaredLoss"),
            r"policy_loss 'test_trainer:UndeclaredLoss' does not declare needs_ref_logprobs \(a bool\)",
        ),
        (dict(console_metrics="json"), "console_metrics must be 'compact' or 'full'"),
    ],
)
def test_config_validation(tmp_path, overrides, message):
    from trl_plugins.registry import RegistryError
    from trl_plugins.run import resolve_run

    # The config's own fields are checked when it is built, what needs the plugins when the run is resolved.
    with pytest.raises((ValueError, RegistryError), match=message):
        resolve_run(tiny_config(tmp_path, **overrides), reward_components={"length": TokenReward()}).close()


def test_trainer_validation(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    with pytest.raises(ValueError, match="max_padded_tokens_per_micro_batch to at least 599"):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, max_padded_tokens_per_micro_batch=100),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
    with pytest.raises(ValueError, match="lower the rollout budget to 301"):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, max_context_tokens=300),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )


def test_pinned_trl_surface():
    # The TRL/transformers surface the trainer relies on; a change here must be looked at by hand.
    import trl
    from transformers import Trainer
    from trl import GRPOTrainer

    assert trl.__version__.startswith("1.16.")
    assert list(inspect.signature(GRPOTrainer.training_step).parameters) == [
        "self",
        "model",
        "inputs",
        "num_items_in_batch",
    ]
    assert list(inspect.signature(GRPOTrainer.log).parameters) == ["self", "logs", "start_time"]
    # Our log writes metrics.jsonl from `logs` after TRL's log has averaged the step's metrics into it.
    assert "logs.update(metrics)" in inspect.getsource(GRPOTrainer.log)
    # Private: overridden to add the completion marker after TRL's own save and rotate after it.
    assert list(inspect.signature(GRPOTrainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    from transformers.trainer_utils import rotate_checkpoints

    assert list(inspect.signature(rotate_checkpoints).parameters)[:4] == [
        "output_dir",
        "save_total_limit",
        "best_model_checkpoint",
        "use_mtime",
    ]
    assert "rotate_checkpoints(" in inspect.getsource(Trainer._save_checkpoint)
    assert list(inspect.signature(Trainer.train).parameters)[:2] == ["self", "resume_from_checkpoint"]
    # async_rollouts reads the loader ahead through get_batch_samples: the HF loop takes each step's batches from it,
    # one iterator per epoch (skipped to the resume point before it is made).
    assert list(inspect.signature(Trainer.get_batch_samples).parameters) == [
        "self",
        "epoch_iterator",
        "num_batches",
        "device",
    ]
    run_epoch = inspect.getsource(Trainer._run_epoch)
    assert "self.get_batch_samples(epoch_iterator, num_batches, self.args.device)" in run_epoch
    assert run_epoch.index("skip_first_batches(") < run_epoch.index("epoch_iterator = iter(train_dataloader)")
    init = inspect.signature(GRPOTrainer.__init__).parameters
    for name in (
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "processing_class",
        "callbacks",
        "optimizers",
        "peft_config",
    ):
        assert name in init, name
    # GRPOTrainer.__init__ sets these attributes, which training_step reads.
    src = inspect.getsource(GRPOTrainer.__init__)
    for attr in ("self._metrics = ", "self._step = 0", "self.num_generations = ", "self.num_iterations = "):
        assert attr in src, attr
    # The reference of beta > 0: TRL builds it (prepared with prepare_deepspeed under DeepSpeed) or, with
    # PEFT, leaves it None and disables the adapter with use_adapter.
    assert "self.ref_model = None" in src and "prepare_deepspeed(self.ref_model" in src
    from trl.trainer.utils import use_adapter

    assert list(inspect.signature(use_adapter).parameters) == ["model", "adapter_name"]
    # The HF loop calls training_step(model, inputs, num_items_in_batch), then clips and steps itself.
    loop = inspect.getsource(Trainer._run_epoch)
    assert "self.training_step(model, inputs, num_items_in_batch)" in loop and "self.optimizer.step()" in loop
    # The HF backend's ZeRO-3 gather for generation (rollout/backends.py:unwrapped_for_generation).
    from trl.distributed import DistributedBackend
    from trl.models.utils import add_hooks, remove_hooks

    assert isinstance(DistributedBackend.is_zero3, property)
    assert (
        list(inspect.signature(add_hooks).parameters) == list(inspect.signature(remove_hooks).parameters) == ["model"]
    )
    # The console: HF prints each log through one of these two, which the compact ones replace.
    from transformers import PrinterCallback, ProgressCallback

    assert "PrinterCallback if self.args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK" in inspect.getsource(
        Trainer.__init__
    )
    assert "self.training_bar.write(" in inspect.getsource(ProgressCallback.on_log) and PrinterCallback.on_log
    # The jsd loss runs TRL's divergence kernel itself (trl.kernels, not exported): its positional arguments as called.
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    assert list(inspect.signature(ChunkedDivergenceFunction.forward).parameters)[:9] == [
        "ctx",
        "student_hidden",
        "student_weight",
        "student_bias",
        "teacher_hidden",
        "teacher_weight",
        "teacher_bias",
        "beta",
        "temperature",
    ]


def test_resume_from_checkpoint_reproduces_the_next_step(tmp_path):
    # Uninterrupted: 2 steps. Interrupted: 1 step + checkpoint, then a fresh trainer resumes and
    # takes step 2. Same data order, same rollout seeds, same optimizer state: same parameters.
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")

    def run(out, **overrides):
        trainer = MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(out, **overrides),
            train_dataset=tiny_dataset(8),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        return trainer

    straight = run(tmp_path / "straight", max_steps=2, optim="adamw_torch")
    straight.train()
    first = run(tmp_path / "resumed", max_steps=2, optim="adamw_torch", save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoint-1"
    assert checkpoint.is_dir()
    second = run(tmp_path / "resumed", max_steps=2, optim="adamw_torch", save_strategy="no")
    second.train(resume_from_checkpoint=str(checkpoint))
    assert second.state.global_step == 2
    for (name, a), b in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
    # Negative control: the state after step 1 differs from the state after step 2.
    one = run(tmp_path / "one", max_steps=1, optim="adamw_torch")
    one.train()
    assert any(not torch.allclose(a, b) for a, b in zip(straight.model.parameters(), one.model.parameters()))


class FailingReward(TokenReward):
    def __init__(self, fail_at_call: int) -> None:
        self.calls, self.fail_at_call = 0, fail_at_call

    def __call__(self, trajectory, example) -> float:
        self.calls += 1
        if self.calls >= self.fail_at_call:
            raise RuntimeError("reward server down")
        return super().__call__(trajectory, example)


def test_checkpoints_are_marked_complete_and_resume_skips_partial_ones(tmp_path):
    from trl_plugins.trainers.checkpoints import COMPLETE_MARKER, latest_complete_checkpoint
    from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, save_strategy="steps", save_steps=1, save_total_limit=1),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    assert (tmp_path / "checkpoint-2" / COMPLETE_MARKER).is_file()
    assert not (tmp_path / "checkpoint-1").exists()  # rotated out, but only after checkpoint-2 was complete
    # A save that crashed half-way: a newer folder without the marker is never resumed from.
    (tmp_path / "checkpoint-9").mkdir()
    (tmp_path / "checkpoint-9" / "model.safetensors").write_text("truncated")
    assert latest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="has no complete checkpoint"):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path / "empty"),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        ).train(resume_from_checkpoint=True)


def test_exception_saves_an_emergency_checkpoint_then_reraises(tmp_path):
    from trl_plugins.trainers.checkpoints import COMPLETE_MARKER
    from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    # 4 trajectories per step: from the 5th reward call (step 2) on, the verifier fails every time, over
    # max_verifier_error_rate: the run stops with the component's error.
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, max_steps=3),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": FailingReward(fail_at_call=5)},
    )
    with pytest.raises(
        RuntimeError, match=r"100% of this step's trajectories failed a reward component .*reward server down"
    ):
        trainer.train()
    assert (tmp_path / "checkpoint-1" / COMPLETE_MARKER).is_file()


class WrongDigestRollout:
    """A rollout plugin whose trajectories claim another tokenizer (e.g. replayed from elsewhere)."""

    token_budget = 600

    def __call__(self, request):
        from dataclasses import replace

        from trl_plugins.rollout import MultiTurnRollout

        result = MultiTurnRollout(max_turns=1, max_assistant_tokens=4, max_trajectory_tokens=600)(request)
        for t in result.trajectories:
            t.policy_version = replace(t.policy_version, tokenizer_digest="0123456789abcdef")
        return result


def test_trajectories_from_another_tokenizer_are_rejected(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.types import TrajectoryError

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, rollout="test_trainer:WrongDigestRollout", rollout_kwargs={}),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    with pytest.raises(TrajectoryError, match="digest 0123456789abcdef, but the trainer's is"):
        trainer.train()


def test_num_iterations_reuses_the_rollout_and_measures_its_age(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, num_iterations=2, max_steps=2),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    records = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "train/policy_version_lag" in line
    ]
    assert [r["train/policy_version_lag"] for r in records] == [0.0, 1.0]
    assert records[1]["train/reused_rollout"] == 1.0 and "train/reused_rollout" not in records[0]
    # The reused data is one update stale: the ratio moved away from 1.
    assert abs(records[1]["train/ratio_mean"] - 1.0) > 1e-4 or records[1]["train/ratio_max"] > 1.0 + 1e-4


def test_logs_to_wandb_offline_with_a_trajectory_table(tmp_path, monkeypatch):
    import wandb

    from trl_plugins.trainers import MultiTurnGRPOTrainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "trl-plugins-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path / "out", report_to=["wandb"], trajectory_table_steps=1),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    wandb.finish()
    # finish() returns once the run is closed; the service process may still hold the record log's
    # last block in its buffer. teardown() stops the service, which flushes and closes the file.
    wandb.teardown()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    # The record log holds the metric names; the trajectory tables are written as media files.
    for needle in (b"reward/total", b"rollout/turns_mean", b"train/forward_tokens", b"trajectories"):
        assert needle in data, needle
    tables = sorted(runs[0].parent.glob("files/media/table/trajectories_*.table.json"))
    assert len(tables) == 2  # one per step with trajectory_table_steps=1
    table = json.loads(tables[0].read_text())
    assert "stop_reason" in table["columns"] and len(table["data"]) == 4
    # Each row: the prompt and reference answer of its dataset row, every turn, each reward component.
    for row in (dict(zip(table["columns"], r)) for r in table["data"]):
        i = int(row["prompt"].split()[2])  # "What is i + i?"
        assert row["prompt"] == f"What is {i} + {i}?" and row["answer"] == str(2 * i)
        assert row["transcript"].startswith("[assistant 1]\n") and row["reward/length"] == pytest.approx(row["reward"])
    turns = sorted(runs[0].parent.glob("files/media/table/trajectory_turns_*.table.json"))
    assert len(turns) == 2 and json.loads(turns[0].read_text())["columns"][:4] == [
        "step",
        "question_id",
        "sample",
        "turn",
    ]


@pytest.mark.parametrize("policy", ["wrong", "mask"])
def test_truncated_policy_scores_or_masks_truncated_trajectories(tmp_path, policy):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    # 12 tokens per turn and no tool calls from a random model: every trajectory is cut (turn_length).
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path, max_steps=1, truncated_policy=policy),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    if policy == "mask":  # every trajectory masked: the run trained nothing, and says so
        from trl_plugins.trainers.resilience import NoPolicyUpdate

        with pytest.raises(NoPolicyUpdate, match="4 truncated"):
            trainer.train()
    else:
        trainer.train()
    trajs = trainer.last_batch.trajectories
    assert trajs and all(t.truncated for t in trajs)
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    if policy == "mask":
        assert record["train/masked_truncated_frac"] == 1.0 and record["train/datums"] == 0.0
        assert all(t.advantage == 0.0 for t in trajs) and record["train/update_skipped"] == 1.0 and not changed
    else:
        assert record["train/masked_truncated_frac"] == 0.0 and record["train/datums"] > 0 and changed


def test_configured_tools_are_keyed_by_the_name_the_model_calls(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    args = tiny_config(
        tmp_path,
        tools=["trl_plugins.tools.code_interpreter:CodeInterpreter"],
        tool_kwargs={"trl_plugins.tools.code_interpreter:CodeInterpreter": {"name": "python"}},
    )
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        args,
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    assert list(trainer.run.tools) == ["python"]
    assert [s["function"]["name"] for s in trainer.run.chat.tools] == ["python"]


def _saved_model(tmp_path, tok):
    # TRL builds the frozen reference from the policy's name_or_path, as it does for a Hub model.
    path = tmp_path / "policy"
    build_tiny_model(tok).save_pretrained(path)
    return str(path)


def _train(tmp_path, name, tok, model, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    out = tmp_path / name
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(out, **overrides),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward/total" in line]
    return trainer, records


def test_beta_trains_against_a_frozen_reference_in_the_loss(tmp_path):
    tok = build_tokenizer("qwen2_5")
    path = _saved_model(tmp_path, tok)
    plain, _ = _train(tmp_path, "plain", tok, path, max_steps=3)
    kl, records = _train(tmp_path, "kl", tok, path, max_steps=3, beta=0.5, kl_estimator="k3")
    assert plain.ref_model is None and kl.ref_model is not None
    # The reference stays the starting policy; the policies of the two runs part ways once the KL bites.
    ref_params = dict(kl.ref_model.named_parameters())
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert all(torch.equal(ref_params[n], initial[n]) for n in initial)
    assert any(not torch.equal(a, b) for a, b in zip(plain.model.parameters(), kl.model.parameters()))
    for key in ("train/kl_k1", "train/kl_k2", "train/kl_k3", "train/ref_logprob_gap", "timing/reference_s"):
        assert key in records[0], key
    assert records[0]["train/kl_k3"] < 1e-6  # step 1: the policy is the reference
    assert records[-1]["train/kl_k3"] > records[0]["train/kl_k3"]
    assert records[-1]["train/forwarded_datums"] == records[-1]["train/datums"]  # nothing skipped with a KL term


def test_kl_in_the_reward_is_a_stored_reward_component(tmp_path):
    tok = build_tokenizer("qwen2_5")
    path = _saved_model(tmp_path, tok)
    trainer, records = _train(
        tmp_path, "kl_reward", tok, path, max_steps=2, beta=0.2, kl_penalty="reward", kl_estimator="k1"
    )
    assert "reward/kl_penalty" in records[0]
    assert abs(records[0]["reward/kl_penalty"]) < 1e-4  # step 1: behaviour policy == reference (float noise)
    trajs = trainer.last_batch.trajectories
    comps = [t.reward_component("kl_penalty") for t in trajs]
    assert all(c.weight == 0.2 for c in comps) and any(c.value != 0.0 for c in comps)
    assert all(
        abs(t.reward - (t.reward_component("length").value + 0.2 * t.reward_component("kl_penalty").value)) < 1e-9
        for t in trajs
    )


def test_entropy_bonus_is_trained_and_logged(tmp_path):
    tok = build_tokenizer("qwen2_5")
    _, records = _train(tmp_path, "ent", tok, build_tiny_model(tok), max_steps=1, entropy_coef=0.01)
    assert records[0]["train/entropy"] > 0


def test_sampling_temperature_is_the_update_temperature(tmp_path):
    tok = build_tokenizer("qwen2_5")
    _, records = _train(tmp_path, "t07", tok, build_tiny_model(tok), max_steps=1, temperature=0.7)
    # The sampler's log-probs at temperature 0.7 are the trainer's: on-policy, the gap is float noise.
    assert records[0]["train/behaviour_logprob_gap"] < 1e-4 and abs(records[0]["train/ratio_p50"] - 1) < 1e-4


def test_a_plugin_rollouts_bad_trajectory_is_reported_before_it_becomes_a_datum(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.types import TrajectoryError

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, rollout="test_evaluation:LyingRollout"),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    with pytest.raises(
        TrajectoryError,
        match=r"rollout plugin 'test_evaluation:LyingRollout'.*sample 1\), turn 0: "
        r"\d+ completion tokens but \d+ behaviour log-probs",
    ):
        trainer.train()


def test_mask_leaves_truncated_members_out_of_their_group_statistics():
    from types import SimpleNamespace

    from trl_plugins.algos import GroupAdvantage
    from trl_plugins.pipeline.batch import assign_advantages, training_mask
    from trl_plugins.protocols import as_advantage
    from trl_plugins.types import StopReason

    def compute_advantages(plugins, trajs, masked):  # the batch builder makes one datum per trajectory trained on
        datums = [
            SimpleNamespace(trajectory_index=i, action_mask=[0, 1], num_tokens=2, advantages=None)
            for i, m in enumerate(masked)
            if not m
        ]
        assign_advantages(as_advantage(plugins.advantage, "group"), trajs, datums)
        for d in datums:
            assert d.advantages == [0.0, trajs[d.trajectory_index].advantage]  # on the action position only

    # Group 0: rewards [1, 0, 0.5 (truncated), 0 (truncated)]; group 1: [0.2, 0.2 (truncated)].
    spec = [(0, 1.0, False), (0, 0.0, False), (0, 0.5, True), (0, 0.0, True), (1, 0.2, False), (1, 0.7, True)]
    trajs = [
        SimpleNamespace(
            group_id=g,
            reward=r,
            truncated=t,
            advantage=None,
            world_failure=False,
            stop_reason=StopReason.TURN_LENGTH if t else StopReason.FINAL_ANSWER,
        )
        for g, r, t in spec
    ]
    plugins = SimpleNamespace(advantage=GroupAdvantage())
    masked = training_mask(trajs, mask_truncated=True)
    compute_advantages(plugins, trajs, masked)
    s = 0.5 / (0.5**0.5)  # group 0 kept: [1, 0] -> mean 0.5, unbiased std sqrt(0.5)
    got = [t.advantage for t in trajs]
    assert got[2:4] == [0.0, 0.0] and got[5] == 0.0
    assert abs(got[0] - s) < 1e-5 and abs(got[1] + s) < 1e-5
    assert got[4] == 0.0  # a group left with one member gets exactly 0
    compute_advantages(plugins, trajs, training_mask(trajs, mask_truncated=False))
    assert all(t.advantage != 0.0 for t in trajs[:4])  # scored with the truncated members, all four differ


def _critic_params(trainer):
    return [p.detach().clone() for p in trainer.accelerator.unwrap_model(trainer._critic).parameters()]


def test_gae_brings_a_critic_that_warms_up_alone_then_trains_with_the_policy(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    initial = [p.detach().clone() for p in model.parameters()]
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path, advantage="gae", max_steps=1, critic_warmup_steps=1, critic_learning_rate=1e-2),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    critic = trainer.accelerator.unwrap_model(trainer._critic)
    # Initialised from the policy: the same backbone weights, a zero head (values start at 0).
    assert torch.equal(critic.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert float(critic.score.weight.abs().sum()) == 0.0
    before = _critic_params(trainer)
    trainer.train()
    # Warm-up step: only the critic learned.
    assert all(torch.equal(a, b.detach()) for a, b in zip(initial, trainer.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before, _critic_params(trainer)))
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    assert record["critic/warmup"] == 1.0 and record["train/update_skipped"] == 1.0
    for key in (
        "critic/value_loss",
        "critic/clip_frac",
        "critic/explained_variance",
        "critic/returns_mean",
        "critic/returns_std",
        "critic/values_mean",
        "timing/critic_values_s",
        "timing/critic_update_s",
    ):
        assert key in record, key
    assert record["critic/values_mean"] == 0.0  # the zero head
    # Per-token advantages on the datums: whitened over the batch's action tokens.
    trajs = trainer.last_batch.trajectories
    assert len({round(t.advantage, 6) for t in trajs}) > 1


def test_critic_settings_without_a_critic_are_refused(tmp_path):
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match=r"\['critic_learning_rate'\] configure the critic"):
        resolve_run(tiny_config(tmp_path, critic_learning_rate=1e-4), reward_components={"length": TokenReward()})


def test_resume_restores_the_critic_and_reproduces_the_next_step(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")

    def run(out, **overrides):
        return MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(out, advantage="gae", critic_learning_rate=1e-2, **overrides),
            train_dataset=tiny_dataset(8),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )

    straight = run(tmp_path / "straight", max_steps=2)
    straight.train()
    first = run(tmp_path / "resumed", max_steps=2, save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoint-1"
    assert (checkpoint / "critic" / "state.pt").is_file()
    second = run(tmp_path / "resumed", max_steps=2)
    second.train(resume_from_checkpoint=str(checkpoint))
    for a, b in zip(_critic_params(straight), _critic_params(second)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # Negative control: the critic after step 1 is not the critic after step 2.
    one = run(tmp_path / "one", max_steps=1)
    one.train()
    assert any(not torch.allclose(a, b) for a, b in zip(_critic_params(straight), _critic_params(one)))
    # A checkpoint without a critic cannot silently start one afresh.
    plain = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path / "plain", max_steps=1, save_strategy="steps", save_steps=1),
        train_dataset=tiny_dataset(8),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    plain.train()
    with pytest.raises(FileNotFoundError, match="has no critic/ folder"):
        run(tmp_path / "plain2", max_steps=2).train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_with_peft_the_reference_is_the_policy_with_its_adapter_disabled(tmp_path):
    from peft import LoraConfig

    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.update import reference_logprobs

    tok = build_tokenizer("qwen2_5")
    base = build_tiny_model(tok)
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, beta=0.5, max_steps=2, learning_rate=5e-2),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    assert trainer.ref_model is None  # no second copy
    trainer.train()
    records = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    ]
    # init_lora_weights=False: the adapter changes the policy from the start, so the KL to the base is > 0 at step 1.
    assert records[0]["train/kl_k3"] > 0
    datums = [build_datum_for(t, i) for i, t in enumerate(trainer.last_batch.trajectories)]
    model, context = trainer._reference_model()
    reference_logprobs(trainer.accelerator, model, datums, trainer.args, pad_token_id=tok.pad_token_id, context=context)
    # The reference log-probs are the base model's (adapter off), not the adapted policy's.
    from accelerate import Accelerator

    expected = [build_datum_for(t, i) for i, t in enumerate(trainer.last_batch.trajectories)]
    reference_logprobs(Accelerator(cpu=True), base, expected, trainer.args, pad_token_id=tok.pad_token_id)
    for d, e in zip(datums, expected):
        assert max(abs(a - b) for a, b in zip(d.ref_logprobs, e.ref_logprobs)) < 1e-5
    policy = [build_datum_for(t, i) for i, t in enumerate(trainer.last_batch.trajectories)]
    reference_logprobs(Accelerator(cpu=True), trainer.model, policy, trainer.args, pad_token_id=tok.pad_token_id)
    assert any(max(abs(a - b) for a, b in zip(d.ref_logprobs, p.ref_logprobs)) > 1e-3 for d, p in zip(datums, policy))


def build_datum_for(trajectory, index):
    from trl_plugins.datum import build_datum

    return build_datum(trajectory, advantage=0.0, trajectory_index=index)


def test_gae_with_the_kl_in_the_reward_puts_it_on_every_token(tmp_path):
    tok = build_tokenizer("qwen2_5")
    path = _saved_model(tmp_path, tok)
    trainer, records = _train(
        tmp_path, "gae_kl", tok, path, max_steps=2, advantage="gae", beta=0.2, kl_penalty="reward", kl_estimator="k1"
    )
    assert "reward/kl_penalty" in records[-1] and "critic/value_loss" in records[-1]
    # Recorded with weight 0 (it went into GAE per token), so the reward the logs show is the task's.
    trajs = trainer.last_batch.trajectories
    assert all(t.reward_component("kl_penalty").weight == 0.0 for t in trajs)
    assert any(t.reward_component("kl_penalty").value != 0.0 for t in trajs)


def test_infrastructure_failures_carry_no_training_signal(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.types import StopReason

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(
            tmp_path,
            max_steps=1,
            per_device_train_batch_size=8,
            num_generations=4,
            rollout="support.trainer:ScriptedToolRollout",
            rollout_kwargs={},
            reward_time_limit_s=0.5,
            max_verifier_error_rate=0.9,
            max_environment_error_rate=0.9,
            min_valid_group_fraction=0.5,
        ),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        tools={"code_interpreter": FlakyCodeTool()},
        reward_components={"length": PickyVerifier()},
    )
    trainer.train()  # completes: neither the tool nor the verifier stops the run
    trajs = trainer.last_batch.trajectories
    reasons = [t.stop_reason for t in trajs]
    env = [t for t in trajs if t.stop_reason == StopReason.ENVIRONMENT_ERROR]
    ver = [t for t in trajs if t.stop_reason == StopReason.VERIFIER_ERROR]
    assert env and ver and StopReason.FINAL_ANSWER in reasons
    assert all(t.error.startswith("tool 'code_interpreter': SandboxError") for t in env)
    assert any("ValueError: cannot parse answer" in t.error for t in ver)
    assert any("VerifierTimeout: no result after 0.5 s" in t.error for t in ver)
    # No signal from them: advantage 0, no reward, and the group statistics are over the others only.
    assert all(t.advantage == 0.0 and t.reward_components == [] for t in env + ver)
    from trl_plugins.algos import group_advantages

    for g in {t.group_id for t in trajs}:
        members = [t for t in trajs if t.group_id == g]
        valid = [t for t in members if not t.world_failure]
        if len(valid) < 0.5 * len(members):  # dropped whole
            assert all(t.advantage == 0.0 for t in members)
            continue
        expected = group_advantages(
            torch.tensor([t.reward for t in valid], dtype=torch.float64), torch.zeros(len(valid), dtype=torch.long)
        ).tolist()
        assert [t.advantage for t in valid] == pytest.approx(expected)
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    n = len(trajs)
    assert record["rollout/stop/environment_error"] == pytest.approx(len(env) / n)
    assert record["rollout/stop/verifier_error"] == pytest.approx(len(ver) / n)
    assert record["reward/verifier_error_rate"] == pytest.approx(len(ver) / n)
    assert record["reward/verifier_error_rate/length"] == pytest.approx(len(ver) / n)
    assert record["train/world_failure_frac"] == pytest.approx((len(env) + len(ver)) / n)
    assert 0 < record["rollout/environment_error_rate/code_interpreter"] < 1
    # Only the valid trajectories became datums.
    assert record["train/datums"] <= n - len(env) - len(ver)


def test_a_group_that_lost_too_many_members_is_left_out_whole():
    from types import SimpleNamespace

    from trl_plugins.pipeline.batch import training_mask

    def t(g, failure=False, truncated=False):
        return SimpleNamespace(group_id=g, world_failure=failure, truncated=truncated)

    trajs = [t(0), t(0, True), t(0, True), t(0, True), t(1), t(1), t(1, True), t(1, truncated=True)]
    # Group 0 kept 1 of 4 (< 0.5): all out. Group 1 kept 3 of 4: only its failure is out (truncation is the policy's).
    assert training_mask(trajs, mask_truncated=False, min_valid_group_fraction=0.5) == [True] * 4 + [
        False,
        False,
        True,
        False,
    ]
    assert training_mask(trajs, mask_truncated=False, min_valid_group_fraction=0.0) == [
        False,
        True,
        True,
        True,
        False,
        False,
        True,
        False,
    ]


class ClosingTool:
    """A tool that counts its closes (and the reward plugin that uses the same lifecycle)."""

    name = "code_interpreter"

    def __init__(self):
        self.closed = 0

    def schema(self):
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        return CodeInterpreter().schema()

    async def __call__(self, arguments):
        from trl_plugins.tools.base import ToolOutput

        return ToolOutput(text="1\n", ok=True)

    def close(self):
        self.closed += 1


class ClosingReward(TokenReward):
    def __init__(self, fail_at_call=None):
        self.closed, self.calls, self.fail_at_call = 0, 0, fail_at_call

    def __call__(self, trajectory, example):
        self.calls += 1
        if self.fail_at_call is not None and self.calls >= self.fail_at_call:
            raise ValueError("reward server down")
        return super().__call__(trajectory, example)

    def close(self):
        self.closed += 1


@pytest.mark.parametrize("fails", [False, True], ids=["end-of-training", "exception"])
def test_the_trainer_closes_its_tools_and_plugins(tmp_path, fails):
    from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    tool, reward = ClosingTool(), ClosingReward(fail_at_call=5 if fails else None)
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": reward},
        tools={"code_interpreter": tool},
    )
    if fails:
        with pytest.raises(RuntimeError, match="reward server down"):
            trainer.train()
    else:
        trainer.train()
    assert tool.closed == 1 and reward.closed == 1


def test_a_signal_during_the_update_saves_that_step_and_raises(tmp_path):
    import os
    import signal

    from transformers import TrainerCallback

    from trl_plugins.trainers import TrainingInterrupted
    from trl_plugins.trainers.checkpoints import COMPLETE_MARKER
    from trl_plugins.trainers.multi_turn_trainer import MultiTurnGRPOTrainer

    class SignalBeforeStep2Optimizer(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in the middle of step 2

    tok = build_tokenizer("qwen2_5")
    tool = ClosingTool()
    # What was there before (Python's default; SIG_IGN where the suite was started in the background by a shell).
    before = signal.getsignal(signal.SIGINT)
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, max_steps=4),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
        tools={"code_interpreter": tool},
        callbacks=[SignalBeforeStep2Optimizer()],
    )
    with pytest.raises(TrainingInterrupted, match=r"SIGINT after step 2; resume with") as info:
        trainer.train()
    assert info.value.exit_code == 130 and info.value.step == 2 and trainer.state.global_step == 2
    assert (tmp_path / "checkpoint-2" / COMPLETE_MARKER).is_file() and not (tmp_path / "checkpoint-3").exists()
    assert tool.closed == 1 and signal.getsignal(signal.SIGINT) is before


def test_a_tool_declaring_an_unknown_metric_reduction_is_refused_at_start_up(tmp_path):
    from support.tools import MedianTool
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    # An unknown reduction would silently become a mean over ranks.
    with pytest.raises(
        ValueError,
        match=r"tool 'echo' step_metric_reductions\(\) returned "
        r"\{'echo/calls': 'median'\}; each value must be one of",
    ):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, max_steps=1, tools=["echo"]),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            tools={"echo": MedianTool()},
            reward_components={"length": ConstantReward()},
        )


def test_metrics_with_an_unknown_declared_reduction_are_refused():
    from trl_plugins.rollout.metrics import reduce_rank_metrics

    assert reduce_rank_metrics([{"a": 1.0}, {"a": 3.0}], {"a": "max"}) == {"a": 3.0}
    with pytest.raises(ValueError, match="declares the reduction 'median'"):
        reduce_rank_metrics([{"a": 1.0}, {"a": 3.0}], {"a": "median"})


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_from_latest_continues_after_the_checkpoint_and_metrics_have_each_step_once(tmp_path, capsys):
    # The "interrupted" run trained 3 steps, but its save of step 3 was cut short (no marker): its step-3 record
    # and end-of-training summary come after the last complete checkpoint, checkpoint-2. Resuming from "latest"
    # trains step 3 again; metrics.jsonl ends with steps 1, 2, 3 once each and the later records are kept aside.
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.checkpoints import COMPLETE_MARKER

    tok = build_tokenizer("qwen2_5")

    def run(**overrides):
        return MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, max_steps=3, **overrides),
            train_dataset=tiny_dataset(8),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )

    run(save_strategy="steps", save_steps=2).train()
    (tmp_path / "checkpoint-3" / COMPLETE_MARKER).unlink()
    first = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 3]  # three steps and the summary
    capsys.readouterr()
    second = run()
    second.train(resume_from_checkpoint="latest")
    out = capsys.readouterr().out
    assert second.state.global_step == 3
    assert f"resuming from step 2 of 3: {tmp_path / 'checkpoint-2'}" in out
    records = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "reward/total" in r] == [1, 2, 3]
    assert [r["step"] for r in records] == [1, 2, 3, 3] and records[:2] == first[:2]  # the earlier lines as they were
    (aside,) = tmp_path.glob("metrics.after-step-2-*.jsonl")
    assert _records(aside) == first[2:] and "2 record(s) the interrupted run wrote after step 2 moved to" in out


def test_a_damaged_checkpoint_is_refused_by_name_and_falls_back_only_when_asked(tmp_path, capsys):
    import os

    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.checkpoints import CheckpointDamaged

    tok = build_tokenizer("qwen2_5")

    def run(**overrides):
        return MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, max_steps=2, **overrides),
            train_dataset=tiny_dataset(8),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )

    run(save_strategy="steps", save_steps=1).train()
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for value in ("latest", str(tmp_path / "checkpoint-2")):
        with pytest.raises(
            CheckpointDamaged,
            match=r"checkpoint-2/model.safetensors: .*truncated.*Nothing was deleted.*"
            r"checkpoint-1\) instead, add --resume_fallback true",
        ):
            run().train(resume_from_checkpoint=value)
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files  # nothing lost or rewritten
    capsys.readouterr()
    resumed = run(resume_fallback=True)
    resumed.train(resume_from_checkpoint="latest")
    out = capsys.readouterr().out
    assert resumed.state.global_step == 2
    assert f"falling back to {tmp_path / 'checkpoint-1'}" in out and "resuming from step 1 of 2" in out
    (damaged,) = tmp_path.glob("damaged-checkpoint-2-*")  # moved aside whole, not overwritten by the new run
    assert (damaged / "model.safetensors").read_bytes() == files[weights]
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl") if "reward/total" in r] == [1, 2]
    assert not os.path.exists(tmp_path / "checkpoint-2")  # save_strategy="no": nothing written in its place


def test_a_step_prints_one_compact_line_reports_tokens_per_s_and_no_checkpointing_warning(tmp_path, capsys):
    import warnings

    from transformers import PrinterCallback, ProgressCallback

    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.console import CompactPrinterCallback, CompactProgressCallback

    tok = build_tokenizer("qwen2_5")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        assert trainer.args.activation_checkpointing  # TRL's default, on: the warnings' trigger is there
        trainer.train()
        assert trainer.model.is_activation_checkpointing  # still on after the rollouts
    noisy = [
        str(w.message)
        for w in caught
        if issubclass(w.category, FutureWarning)
        and ("checkpointing" in str(w.message) or "use_reentrant" in str(w.message))
    ]
    assert noisy == []
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2", "step 2/2"]  # two steps, the summary
    for line in lines[:2]:
        for part in ("reward ", "length ", "tools ", "loss ", " tok/s", "gen ", "train ", "rss "):
            assert part in line, (part, line)
    assert "'rollout/turns_mean'" not in out and "train_runtime" in lines[2]  # not HF's dict of every metric
    steps = [r for r in _records(tmp_path / "metrics.jsonl") if "reward/total" in r]
    for r in steps:  # every metric still in metrics.jsonl; the rates are the record's tokens over its seconds
        assert r["rollout/generated_tokens_per_s"] == pytest.approx(
            r["rollout/action_tokens"] / r["timing/generation_s"]
        )
        assert r["train/forward_tokens_per_s"] == pytest.approx(
            r["train/forward_tokens"] / r["timing/forward_backward_s"]
        )
        assert r["rollout/action_tokens"] == pytest.approx(r["rollout/action_tokens_mean"] * r["rollout/trajectories"])
        assert r["memory/peak_rss_mb"] > 0 and "rollout/turns_mean" in r
    # The console is a setting: 'full' keeps HF's printer (under tqdm, the progress bar's).
    kinds = {}
    for console, tqdm_off in (("full", True), ("full", False), ("compact", False)):
        t = MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, console_metrics=console, disable_tqdm=tqdm_off),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        kinds[console, tqdm_off] = {type(cb) for cb in t.callback_handler.callbacks} & {
            PrinterCallback,
            ProgressCallback,
            CompactPrinterCallback,
            CompactProgressCallback,
        }
    assert kinds == {
        ("full", True): {PrinterCallback},
        ("full", False): {ProgressCallback},
        ("compact", False): {CompactProgressCallback},
    }
    assert {type(cb) for cb in trainer.callback_handler.callbacks} >= {CompactPrinterCallback}


def test_rollouts_leave_the_activation_checkpointing_settings_alone(tmp_path):
    # every_n_layers=2 checkpoints layer 0 of 2 only. TRL's unwrap_model_for_generation turned checkpointing off
    # for each rollout and back on with default settings (every layer): the layers' flags would read [True, True].
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, max_steps=1, activation_checkpointing_kwargs={"every_n_layers": 2}),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    layers = trainer.accelerator.unwrap_model(trainer.model).model.layers
    assert len(layers) == 2 and [layer.gradient_checkpointing for layer in layers] == [True, False]


def test_reward_names_include_the_kl_penalty_when_the_kl_is_a_reward(tmp_path):
    # What the recipe plots per component: a KL paid in the reward is one of them.
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    path = _saved_model(tmp_path, tok)  # TRL builds the reference model from a path

    def names(**overrides):
        return MultiTurnGRPOTrainer(
            path,
            tiny_config(tmp_path, max_steps=1, **overrides),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        ).reward_names()

    assert names() == ["length"]
    assert names(beta=0.1, kl_penalty="reward") == ["length", "kl_penalty"]
    assert names(beta=0.1, kl_penalty="loss") == ["length"]


def test_critic_value_pass_fits_the_micro_batch_budget_the_start_up_check_allows(tmp_path):
    # Issue 30.3: trajectories cut by the token budget make datums of exactly budget - 1 tokens, and
    # max_padded_tokens_per_micro_batch is exactly that. The critic's value pass used to forward every datum with
    # one token more (the state after its last token) and died mid-step with a packing error. Under 'wrong' nothing
    # is bootstrapped, so nothing more is forwarded; under 'bootstrap' the start-up check counts the extra token,
    # and following its advice trains.
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    budget = 380  # prompts are ~340 tokens (system prompt with the tool schema)
    rollout = {"max_turns": 2, "max_assistant_tokens": 80, "max_trajectory_tokens": budget}

    def train(policy, max_padded):
        out = tmp_path / f"{policy}-{max_padded}"
        trainer = MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(
                out,
                max_steps=1,
                advantage="gae",
                truncated_policy=policy,
                rollout_kwargs=rollout,
                max_padded_tokens_per_micro_batch=max_padded,
            ),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        trainer.train()
        return trainer

    trainer = train("wrong", budget - 1)
    datums = trainer.last_batch.datums
    assert max(d.num_tokens for d in datums) == budget - 1  # the longest datum is exactly the micro-batch budget
    assert any(t.truncated for t in trainer.last_batch.trajectories) and not any(d.bootstrap_mask for d in datums)
    with pytest.raises(ValueError, match=rf"the state after a truncated one's last token.*at least {budget}\b"):
        train("bootstrap", budget - 1)
    trainer = train("bootstrap", budget)
    longest = [d for d in trainer.last_batch.datums if d.num_tokens == budget - 1]
    assert longest and all(d.bootstrap_mask for d in longest)  # forwarded with budget tokens by the value pass


def test_truncated_policy_bootstrap_needs_a_critic(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    with pytest.raises(ValueError, match=r"truncated_policy='bootstrap'.*runs no critic; use --advantage gae"):
        MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path, truncated_policy="bootstrap"),
            train_dataset=tiny_dataset(),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )


def test_dropout_in_the_base_model_is_refused_or_removed_whole(tmp_path):
    # Issue 30.4: lora_dropout > 0 is refused because dropout acts in the update's forward and not in generation; the
    # base model's own dropout was not. TRL's disable_dropout_in_model zeroes nn.Dropout only, and Qwen2's attention
    # reads attention_dropout from itself at forward time, so the ratios of exactly on-policy data spread (0.98-1.04).
    from transformers import AutoModelForCausalLM

    from trl_plugins.modeling import dropout_probabilities
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    config = build_tiny_model(tok).config
    config.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(config)
    path = tmp_path / "with-dropout"
    model.save_pretrained(path)
    for source in (model, str(path)):  # an instance, or a path (checked from its config, before it loads)
        with pytest.raises(ValueError, match=r"attention_dropout=0\.1.*Pass --disable_dropout true"):
            MultiTurnGRPOTrainer(
                source,
                tiny_config(tmp_path),
                train_dataset=tiny_dataset(),
                processing_class=tok,
                reward_components={"length": TokenReward()},
            )
    model = AutoModelForCausalLM.from_pretrained(path)  # TRL loads the reference (beta > 0) from its path
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path, max_steps=1, disable_dropout=True, beta=0.1),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    assert dropout_probabilities(trainer.model) == {} and dropout_probabilities(trainer.ref_model) == {}
    trainer.train()
    record = next(
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    )
    # HF generate on the training model: one update on exactly on-policy data, ratios 1 up to float noise.
    assert abs(record["train/ratio_max"] - 1.0) < 1e-4 and abs(record["train/ratio_min"] - 1.0) < 1e-4


@pytest.mark.parametrize(
    "loss,kwargs",
    [
        ("gspo", {}),
        ("turn_ppo", {}),
        ("turn_ppo", {"normalize": True}),
    ],
)
def test_span_ratio_losses_train_end_to_end_with_the_contracts_turn_ids(tmp_path, loss, kwargs, monkeypatch):
    # The turn ids reach the loss through the real path (datum -> micro-batch -> PolicyLossInput), and the loss
    # sees exactly the datum's turns: spy on what it receives.
    from trl_plugins.algos import span_losses

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    real = span_losses.span_ratio_loss

    def spy(logprobs, behaviour, advantages, action_mask, span_ids, **kw):
        seen.append((action_mask.detach().clone(), span_ids.detach().clone()))
        return real(logprobs, behaviour, advantages, action_mask, span_ids, **kw)

    monkeypatch.setattr(span_losses, "span_ratio_loss", spy)
    trainer, records = _train(
        tmp_path,
        loss,
        tok,
        model,
        policy_loss=loss,
        policy_loss_kwargs=kwargs,
        max_steps=1,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
    )
    assert trainer.state.global_step == 1 and seen
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    for mask, spans in seen:
        assert (spans >= 0).eq(mask.bool()).all() if loss == "turn_ppo" else (spans == 0).all()


def test_turn_level_credit_trains_end_to_end(tmp_path):
    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    trainer, records = _train(
        tmp_path, "turn_group", tok, model, advantage="turn_group", advantage_kwargs={"step_weight": 0.5}, max_steps=1
    )
    assert trainer.state.global_step == 1 and len(records) == 1
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))


def test_skipped_steps_in_a_row_stop_the_run_at_max_steps_without_update(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.resilience import NoPolicyUpdate

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, max_steps=4, max_steps_without_update=2),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": ConstantReward()},
    )
    with pytest.raises(NoPolicyUpdate, match=r"2 steps in a row made no policy update \(max_steps_without_update=2\)"):
        trainer.train()
    assert trainer.state.global_step == 1  # step 2 raised: the HF loop counts a step after it returns
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/update_skipped"] for r in records if "train/update_skipped" in r] == [1.0]  # step 1, skipped


def test_a_run_whose_every_trajectory_is_an_environment_error_stops_naming_the_error(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, max_steps=2, rollout="support.trainer:BrokenWorldRollout"),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": ConstantReward()},
    )
    with pytest.raises(
        RuntimeError,
        match=r"100% of this step's trajectories .* ended environment_error, over "
        r"max_environment_error_rate=0.5.*Most common error \(4 of 4\): ConnectionRefusedError: 404"
        r".*Likely cause: the agent could not reach the endpoint: use the base_url",
    ):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("broken,cancelled,stops", [(2, 0, False), (3, 0, True), (2, 1, True), (3, 1, True)])
def test_the_environment_error_rate_leaves_cancelled_trajectories_out(tmp_path, broken, cancelled, stops):
    # 4 trajectories: `broken` end environment_error, `cancelled` are cancelled (in neither count), the rest are fine.
    # 2 of 4 is at the limit 0.5 (passes, the negative control); 2 of 3 live ones is over it.
    import random
    from types import SimpleNamespace

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.trainers.phases import StepRunner
    from trl_plugins.types import StopReason

    trajs = [make_trajectory(random.Random(i), num_turns=1, group_id=i // 2, sample_index=i % 2) for i in range(4)]
    for t in trajs[:broken]:
        t.stop_reason, t.error = StopReason.ENVIRONMENT_ERROR, "agent failed: boom"
    for t in trajs[broken : broken + cancelled]:
        t.stop_reason = StopReason.CANCELLED
    runner = StepRunner.__new__(StepRunner)
    runner.run = SimpleNamespace(rewards=[])
    runner.accelerator = SimpleNamespace(num_processes=1, device="cpu")
    runner.config = SimpleNamespace(max_verifier_error_rate=0.5, max_environment_error_rate=0.5)
    if stops:
        with pytest.raises(RuntimeError, match=f"\\({broken} of {broken}\\): agent failed: boom"):
            runner._check_world_failures({}, trajs)
    else:
        runner._check_world_failures({}, trajs)


@pytest.mark.parametrize("failed,stops", [(2, False), (3, True)])
def test_verifier_errors_a_rollout_reported_count_against_the_limit(failed, stops):
    # A verifiers environment's judge fails its trajectories inside the rollout (verifier_error before any scoring):
    # they count in max_verifier_error_rate, under "rollout"; 2 of 4 is at the limit (the negative control).
    import random
    from types import SimpleNamespace

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.rollout import RolloutResult
    from trl_plugins.trainers.phases import StepRunner
    from trl_plugins.types import StopReason

    trajs = [make_trajectory(random.Random(i), num_turns=1, group_id=i // 2, sample_index=i % 2) for i in range(4)]
    for t in trajs[:failed]:
        t.stop_reason, t.error = StopReason.VERIFIER_ERROR, "the environment's judge failed: no verdict"
    runner = StepRunner.__new__(StepRunner)
    runner.run = SimpleNamespace(rewards=[])
    runner.accelerator = SimpleNamespace(num_processes=1, device="cpu")
    runner.config = SimpleNamespace(
        max_verifier_error_rate=0.5,
        max_environment_error_rate=0.5,
        reward_time_limit_s=None,
        truncated_policy="mask",
        min_valid_group_fraction=0.0,
    )
    result = RolloutResult(trajectories=trajs)
    if stops:
        with pytest.raises(RuntimeError, match=r"75% .*most: the rollout's own verifier.*the environment's judge"):
            runner.score(result, [{}, {}], policy_step=0)
    else:
        batch = runner.score(result, [{}, {}], policy_step=0)
        assert batch.metrics["reward/verifier_error_rate/rollout"] == 0.5
