"""Asynchronous rollouts (issue 27): the generation replica, pacing, the decoupled objective, tripwires, resume.

The trainer runs here in-process on the tiny model (a few seconds each); the kill/resume test runs it in a child.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from support.judges import scripted_judge as scripted_judge_module
from support.trainer import TokenReward, tiny_config, tiny_dataset, tiny_trainer
from support.vllm import install_fake_vllm, same_weights, save_tiny_model, train_with_vllm
from trl_plugins.tiny import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_model(tmp_path_factory)


@pytest.fixture()
def patched(monkeypatch):
    return install_fake_vllm(monkeypatch)


HERE = os.path.dirname(__file__)


def _record_batches(trainer):
    """Each fresh batch's step, rows and trajectories, as the step trains them."""
    seen = []
    score = trainer.step_runner.score

    def recording(result, rows, *, policy_step):
        batch = score(result, rows, policy_step=policy_step)
        seen.append((trainer.state.global_step, [r["prompt"] for r in rows], batch))
        return batch

    trainer.step_runner.score = recording
    return seen


def _records(tmp_path):
    return [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if "train/staleness_mean" in line
    ]


# -- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_staleness=2), "configure asynchronous rollouts, which are off"),
        (dict(off_policy_objective="behaviour"), "configure asynchronous rollouts, which are off"),
        (dict(async_rollouts=True, max_staleness=-1), "counts optimizer steps"),
        (dict(async_rollouts=True, off_policy_objective="decouple"), "Did you mean 'decoupled'"),
        (
            dict(async_rollouts=True, max_staleness=0, off_policy_objective="behaviour"),
            "max_staleness=0 is the synchronous loop",
        ),
        (dict(async_rollouts=True, vllm_importance_sampling_correction=False), "set off_policy_objective='behaviour'"),
        (dict(async_rollouts=True, num_iterations=2), "num_iterations=2"),
        (dict(async_rollouts=True, async_min_importance_ess=1.5), "share in"),
        (dict(async_rollouts=True, async_replica_threads=0), "async_replica_threads"),
        (dict(async_rollouts=True, vllm_importance_sampling_clip_max=None), "set one"),
    ],
)
def test_settings_are_honoured_or_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, **overrides)


def test_what_is_not_built_yet_is_refused_before_anything_loads(tmp_path):
    from trl_plugins.run.settings.async_rollouts import unavailable

    c = tiny_config(tmp_path, async_rollouts=True)
    assert unavailable(c, {}) == []
    c.use_vllm, c.vllm_mode = True, "colocate"  # (vLLM itself is not installed here)
    assert "vLLM colocate mode" in unavailable(c, {})[0]
    c.vllm_mode = "server"
    assert unavailable(c, {}) == []
    with pytest.raises(ValueError, match=r"not available with num_iterations=2.*Or set max_staleness=0"):
        tiny_config(tmp_path, async_rollouts=True, num_iterations=2)
    tiny_config(tmp_path, async_rollouts=True, max_staleness=0, num_iterations=2)  # the synchronous loop does it


def test_span_losses_are_refused_with_the_decoupled_objective(tmp_path):
    from trl_plugins.run import resolve_run

    # The decoupled objective weighs tokens by pi_prox / pi_behaviour: a loss that drops the weights cannot train it.
    with pytest.raises(ValueError, match="supports_is_weights"):
        resolve_run(
            tiny_config(tmp_path, async_rollouts=True, policy_loss="gspo"), reward_components={"length": TokenReward()}
        )
    run = resolve_run(
        tiny_config(tmp_path, async_rollouts=True, policy_loss="gspo", off_policy_objective="behaviour"),
        reward_components={"length": TokenReward()},
    )
    run.close()


def test_a_lora_push_is_the_merged_base_model():
    # The replica runs the plain base model: the push is the base weights with the active adapter merged, under the
    # base model's names, computed without touching the training weights.
    import copy

    from peft import LoraConfig, get_peft_model

    from trl_plugins.trainers.replica import base_model, cpu_state_dict

    tok = build_tokenizer("qwen2_5")
    torch.manual_seed(0)
    model = get_peft_model(
        build_tiny_model(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter (B starts at 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = cpu_state_dict(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing merged in place
    merged = copy.deepcopy(model).merge_and_unload()
    assert set(state) == set(merged.state_dict())
    assert all(torch.allclose(state[k], v, atol=1e-6) for k, v in merged.state_dict().items())
    assert not torch.allclose(
        state["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )
    assert type(base_model(model)) is type(merged)


@pytest.mark.slow
def test_async_rollouts_train_a_lora_adapter(tmp_path, monkeypatch):
    # and a judge (weight 0, the scripted one on loopback) scores in the replica as trajectories end: the trainer's
    # scoring reads its cache and calls nothing (docs/rewards.md)

    from peft import LoraConfig

    from trl_plugins.rewards.judge import JudgeReward
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    scripted_judge = scripted_judge_module()
    server, _ = scripted_judge.serve(0)
    url = f"http://127.0.0.1:{server.server_port}/v1"
    here, trainer_calls, call = os.getpid(), [], JudgeReward._call
    monkeypatch.setattr(
        JudgeReward, "_call", lambda self, body: trainer_calls.append(os.getpid() == here) or call(self, body)
    )
    judge = JudgeReward(base_url=url, model="scripted-judge", cache_path=str(tmp_path / "judge.sqlite"))
    tok = build_tokenizer("qwen2_5")
    torch.manual_seed(0)
    config = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=3,
        async_rollouts=True,
        learning_rate=5e-2,
        reward_components=["length", "judge"],
        reward_component_weights=[1.0, 0.0],
    )
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        config,
        train_dataset=tiny_dataset(12),
        processing_class=tok,
        reward_components={"length": TokenReward(), "judge": judge},
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    try:
        trainer.train()
    finally:
        server.shutdown()
    records = _records(tmp_path)
    figures = [{k: v for k, v in r.items() if k.startswith(("judge/", "timing/judge"))} for r in records]
    assert 0 < sum(r["judge/calls"] for r in records) == scripted_judge._state["requests"], figures  # all reported
    # Every answer was fetched in the replica as trajectories ended; the trainer's scoring read them from the cache.
    assert not any(trainer_calls) and all(r["judge/cache_hits"] > 0 and r["judge/errors"] == 0 for r in records), (
        figures
    )
    assert all("reward/judge" in r for r in records)
    assert all("timing/judge_tail_s" in r for r in records)
    # The adapter moved, each push reached the replica (probe), and the last steps trained 1-step-stale tokens.
    assert [r["train/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["async/probe_max_diff"] <= 1e-3 for r in records)
    assert any(float(p.detach().abs().max()) > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_the_decoupled_weight_is_per_token_unless_chosen():
    from support.trainer import tiny_config as cfg

    assert cfg("/tmp/x", async_rollouts=True).vllm_importance_sampling_mode == "token_truncate"
    assert (
        cfg("/tmp/x", async_rollouts=True, vllm_importance_sampling_mode="sequence_mask").vllm_importance_sampling_mode
        == "sequence_mask"
    )
    assert cfg("/tmp/x").vllm_importance_sampling_mode == "sequence_mask"  # TRL's default elsewhere


# -- the tripwires' figures by hand -----------------------------------------------------------------


def test_off_policy_figures_by_hand():
    import random

    from conftest import make_trajectory
    from support.trainer import tiny_config as cfg
    from trl_plugins.datum import build_datum
    from trl_plugins.trainers.async_rollouts import check_off_policy, off_policy_figures

    datum = build_datum(make_trajectory(random.Random(0), num_turns=2))
    on = [i for i, m in enumerate(datum.action_mask) if m]
    assert len(on) >= 2
    d = [0.0] * len(datum.action_mask)
    d[on[0]], d[on[1]] = 0.5, -0.25
    datum.old_logprobs = [b + x for b, x in zip(datum.behaviour_logprobs, d)]
    n, gap, w_sum, w_sq = off_policy_figures(
        [datum, build_datum(make_trajectory(random.Random(1), num_turns=2))]
    )  # one without old log-probs
    expect_w = [1.0] * (len(on) - 2) + [float(torch.exp(torch.tensor(0.5))), float(torch.exp(torch.tensor(-0.25)))]
    assert n == len(on) and gap == pytest.approx(0.75)
    assert w_sum == pytest.approx(sum(expect_w)) and w_sq == pytest.approx(sum(x * x for x in expect_w))
    c = cfg("/tmp/x", async_rollouts=True).features.async_rollouts
    out = check_off_policy(c, [n, gap, w_sum, w_sq])
    assert out["async/logprob_gap"] == pytest.approx(0.75 / n)
    assert out["async/importance_ess"] == pytest.approx(sum(expect_w) ** 2 / (n * sum(x * x for x in expect_w)))
    from trl_plugins.trainers.async_rollouts import OffPolicyDrift

    with pytest.raises(OffPolicyDrift, match=r"log-prob gap: .* over async_max_logprob_gap=0.01"):
        check_off_policy(
            cfg("/tmp/x", async_rollouts=True, async_max_logprob_gap=0.01).features.async_rollouts,
            [n, gap, w_sum, w_sq],
        )
    with pytest.raises(OffPolicyDrift, match=r"importance-weight ESS: .* under async_min_importance_ess=0.999"):
        check_off_policy(
            cfg("/tmp/x", async_rollouts=True, async_min_importance_ess=0.999).features.async_rollouts,
            [n, gap, w_sum, w_sq],
        )
    assert (
        check_off_policy(
            cfg(
                "/tmp/x", async_rollouts=True, async_max_logprob_gap=None, async_min_importance_ess=None
            ).features.async_rollouts,
            [n, gap, w_sum, w_sq],
        )["async/logprob_gap"]
        > 0
    )


# -- the trainer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synchronous_twin(tmp_path_factory):
    """The synchronous loop on the async tests' workload (12 rows, 4 per step: 3 steps per epoch, 6 steps): each
    step's rows and batch, and the final parameters."""
    trainer = tiny_trainer(tmp_path_factory.mktemp("sync"), n_rows=12, max_steps=6)
    seen = _record_batches(trainer)
    trainer.train()
    return seen, [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.slow
def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tmp_path, synchronous_twin):
    trainer = tiny_trainer(tmp_path, n_rows=12, max_steps=6, async_rollouts=True, max_staleness=0)
    trainer.train()
    assert trainer._async is None
    assert all(torch.equal(a, b.detach()) for a, b in zip(synchronous_twin[1], trainer.model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("k,versions", [(1, [0, 0, 1, 3, 3, 4]), (2, [0, 0, 0, 3, 3, 3])])
def test_async_trains_every_row_once_per_epoch_within_the_bound(tmp_path, synchronous_twin, k, versions):
    # 2 epochs of 3 steps. Each step trains the rows the synchronous loop would train at that step, sampled by the
    # weights of step - k or newer: the read-ahead stays within an epoch (the HF loop makes the next epoch's loader
    # only when this one ends), so the first batches of an epoch are queued when it starts, with that step's weights.
    sync_seen, _ = synchronous_twin
    trainer = tiny_trainer(tmp_path, n_rows=12, max_steps=6, async_rollouts=True, max_staleness=k)
    seen = _record_batches(trainer)
    snapshots = _capture_updates(trainer)
    trainer.train()
    assert [(s, rows) for s, rows, _ in seen] == [(s, rows) for s, rows, _ in sync_seen]
    # Step 0 was sampled by the replica with the initial weights and step 0's seed: the synchronous loop's tokens
    # (sampled in-process), with log-probs equal to float precision.
    (_, _, mine), (_, _, theirs) = sync_seen[0], seen[0]
    assert [u.completion_ids for t in theirs.trajectories for u in t.turns] == [
        u.completion_ids for t in mine.trajectories for u in t.turns
    ]
    for t, u in zip(mine.trajectories, theirs.trajectories):
        for x, y in zip(t.turns, u.turns):
            assert x.completion_logprobs == pytest.approx(y.completion_logprobs, abs=1e-5)
    for epoch in range(2):
        rows = [r for s, rs, _ in seen[3 * epoch : 3 * epoch + 3] for r in rs]
        assert sorted(rows) == sorted(r["prompt"] for r in tiny_dataset(12))
    # Pacing: batch s is queued once the weights of step s - k are pushed; the replica runs queued batches in order.
    assert [batch.policy_step for _, _, batch in seen] == versions
    for step, _, batch in seen:
        assert step - k <= batch.policy_step <= step
        assert {s for t in batch.trajectories for s in t.turn_policy_steps()} == {batch.policy_step}
    records = _records(tmp_path)
    assert [r["train/staleness_max"] for r in records] == [float(s - v) for s, v in enumerate(versions)]
    assert [r["train/policy_version_lag"] for r in records] == [float(s - v) for s, v in enumerate(versions)]
    assert all(r["async/probe_max_diff"] <= 1e-3 for r in records)
    assert all(0 < r["async/importance_ess"] <= 1 for r in records)
    # Who waited for whom: the trainer's wait is part of its step; the replica's busy and idle time split the interval
    # between two collected rollouts (none before the second). An interval may hold no sampling (the batch was done
    # before it began, and the next one waits for its weights: pacing), not the run.
    for r in records:
        assert 0 <= r["timing/trainer_idle_s"] <= r["timing/step_s"] and 0 <= r["timing/trainer_idle_ratio"] <= 1
    assert "timing/sampler_busy_s" not in records[0]
    assert sum(r["timing/sampler_busy_s"] for r in records[1:]) > 0
    for r in records[1:]:
        assert r["timing/sampler_busy_s"] >= 0 and r["timing/sampler_idle_s"] >= 0, r
        interval = r["timing/sampler_busy_s"] + r["timing/sampler_idle_s"]
        assert r["timing/sampler_idle_ratio"] == pytest.approx(r["timing/sampler_idle_s"] / interval)
    assert trainer._async.producer is None  # stopped when training ended
    if k == 1:
        _check_decoupled_objective(trainer, snapshots, step=2)


def _capture_updates(trainer):
    """The weights at the start of each update and the batch it trains, by step."""
    snapshots = {}
    update = trainer.step_runner.update

    def capturing(batch, model, optimizer, *, global_step, **kwargs):
        snapshots[global_step] = ({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, batch)
        return update(batch, model, optimizer, global_step=global_step, **kwargs)

    trainer.step_runner.update = capturing
    return snapshots


def _check_decoupled_objective(trainer, snapshots, step):
    # At `step` the tokens were sampled by the weights of step - 1; the update's old log-probs are the weights of
    # `step`'s own (the proximal policy), its behaviour log-probs step - 1's, and the importance weight is their ratio
    # truncated at vllm_importance_sampling_clip_max, per token.
    from trl_plugins.algos import importance_weights

    assert trainer.args.features.decoupled and trainer.args.features.async_rollouts.decoupled
    proximal, batch = snapshots[step]
    assert batch.policy_step == step - 1
    behaviour_weights, _ = snapshots[step - 1]
    model = build_tiny_model(trainer.processing_class)
    checked = 0
    for weights, field in ((proximal, "old_logprobs"), (behaviour_weights, "behaviour_logprobs")):
        model.load_state_dict(weights)
        for d in batch.datums:
            if d.old_logprobs is None:
                continue
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([d.input_ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_ids)[:, None])[:, 0]
            mask = torch.tensor(d.action_mask, dtype=torch.bool)
            assert torch.allclose(lp[mask], torch.tensor(getattr(d, field))[mask].float(), atol=1e-4), field
            checked += 1
    assert checked >= 2
    d = next(d for d in batch.datums if d.old_logprobs is not None)
    old, beh = torch.tensor([d.old_logprobs]), torch.tensor([d.behaviour_logprobs])
    mask = torch.tensor([d.action_mask])
    w = importance_weights(
        old, beh, mask, "token_truncate", clip_max=trainer.args.vllm_importance_sampling_clip_max
    ).weights
    expect = torch.where(mask.bool(), torch.exp(old - beh).clamp(max=3.0), torch.zeros_like(old))
    assert torch.allclose(w, expect) and not torch.allclose(old[mask.bool()], beh[mask.bool()])


@pytest.mark.slow
def test_a_weight_push_that_does_nothing_stops_the_run(tmp_path, monkeypatch):
    from trl_plugins.trainers import async_rollouts
    from trl_plugins.trainers.async_rollouts import OffPolicyDrift

    trainer = tiny_trainer(tmp_path, max_steps=3, async_rollouts=True)
    first = async_rollouts.cpu_state_dict(trainer.model)
    monkeypatch.setattr(async_rollouts, "cpu_state_dict", lambda model: first)  # the replica keeps step 0's weights
    with pytest.raises(
        OffPolicyDrift, match=r"weight-push probe: after the push of step 1's weights.*async_probe_tolerance=0.001"
    ):
        trainer.train()
    assert trainer._async.producer is None


@pytest.mark.slow
def test_a_failing_replica_names_its_error_and_leaves_no_process(tmp_path):
    from trl_plugins.trainers.replica import ReplicaError

    trainer = tiny_trainer(
        tmp_path,
        max_steps=2,
        async_rollouts=True,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
    )
    trainer._async.parts = dataclasses.replace(trainer._async.parts, rollout=None)  # the replica cannot roll out
    pids = []
    real = trainer._async.roll_out

    def spying(*a, **k):
        try:
            return real(*a, **k)
        finally:
            if trainer._async.producer is not None:
                pids.append(trainer._async.producer.pid)

    trainer._async.roll_out = spying
    with pytest.raises(ReplicaError, match="the generation replica failed"):
        trainer.train()
    assert pids and not _alive(pids[0])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not yet reaped counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


_JOB = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {tests!r})
    from transformers import TrainerCallback
    from support.trainer import tiny_trainer
    from pathlib import Path

    out, mode, at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if mode == "term" and state.global_step == at:  # stop while the trainer waits for step at + 1's rollout
                os.kill(os.getpid(), signal.SIGTERM)

        def on_step_end(self, args, state, control, **kwargs):
            batch = trainer.last_batch
            with open(out / "trained.jsonl", "a") as f:
                f.write(json.dumps({{"step": state.global_step, "rows": [r["prompt"] for r in batch.rows],
                                    "replica": trainer._async.producer.pid}}) + "\\n")
            if mode.endswith("kill") and state.global_step == at:
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = tiny_trainer(out, n_rows=8, max_steps=6, async_rollouts=True, max_staleness=2, save_strategy="steps",
                       save_steps=2)
    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=mode.startswith("resume"))
""")


@pytest.mark.slow
def test_stops_in_the_middle_then_resumes_train_each_row_once(tmp_path):
    # With the rows of the next steps read ahead and in flight in the replica (max_staleness 2): SIGTERM while the
    # trainer waits for step 2's rollout (the stop saves step 1), resumed from it; kill -9 after step 3 (no checkpoint
    # since step 2's), resumed again to the end. Every row is trained once per epoch (3 epochs of 2 steps), counted
    # by the rows each final step trained, and no replica outlives its trainer.
    script = tmp_path / "job.py"
    script.write_text(_JOB.format(tests=HERE))
    env = {**os.environ, "PYTHONPATH": HERE}

    def launch(mode, at, code):
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path), mode, str(at)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == code, proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
        replica = records[-1]["replica"]
        deadline = time.time() + 10
        while _alive(replica) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(replica), f"the replica outlived its trainer ({mode})"
        return proc

    term = launch("term", 1, 1)  # TrainingInterrupted (a script's own exit code; the recipe turns it into 143)
    assert "training stopped on SIGTERM after step 1; resume with" in term.stderr
    launch("resume-kill", 3, -signal.SIGKILL)  # killed after step 3's record: checkpoint-2 is the latest
    launch("resume", -1, 0)
    records = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 3, 4, 5, 6]
    final = {}
    for r in records:  # a step the kill cut short is trained again after the resume: the last record counts
        final[r["step"]] = r["rows"]
    everything = sorted(r["prompt"] for r in tiny_dataset(8))
    for epoch in range(3):
        assert sorted(final[2 * epoch + 1] + final[2 * epoch + 2]) == everything


@pytest.mark.slow
def test_async_rollouts_against_a_vllm_server(tmp_path, saved, patched):
    # vLLM server mode: no replica; the rollouts run on threads of the trainer against the (fake) server, each push
    # waits for the requests in flight, every turn says which weights sampled it, and the server's probe continuation
    # scores the same under the trainer's weights after every push.
    import fake_vllm as fake

    path = saved[0]
    with fake.FakeVLLMServer(path) as server:
        trainer, seen = train_with_vllm(
            tmp_path, path, vllm_mode="server", vllm_server_base_url=server.base_url, max_steps=3, async_rollouts=True
        )
        # 4 rows, 2 per step: steps 0 and 2 start an epoch (sampled by their own step's weights), step 1 was queued
        # with step 0's weights (its later turns may have come after the push of step 1's).
        records = _records(tmp_path)
        assert [r["train/policy_version_lag"] for r in records] == [0.0, 1.0, 0.0]
        assert records[0]["train/staleness_max"] == 0.0 and records[1]["train/staleness_max"] in (0.0, 1.0)
        assert all(r["async/probe_max_diff"] <= 1e-3 for r in records)
        assert all(r["async/importance_ess"] > 0.2 for r in records)
        # who waited: the push's drain is part of the trainer's idle time; the server worked for this rank's requests
        assert all(0 <= r["timing/push_drain_s"] <= r["timing/trainer_idle_s"] <= r["timing/step_s"] for r in records)
        assert sum(r["timing/sampler_busy_s"] for r in records[1:]) > 0
        last = trainer.last_batch.trajectories
        assert all(t.policy_version.step == 2 and t.turn_policy_steps() == [2] * len(t.turns) for t in last)
        assert not seen  # no rollout in the trainer's own phases
        assert trainer._async.producer is None  # the rollout threads stopped when training ended
        # After training (an evaluation of the trained model), the sampler still syncs through a drained push.
        trainer.generation_backend().sync_weights(trainer.state.global_step)
        assert same_weights(server.engine.model, trainer)


@pytest.mark.slow
def test_a_server_whose_logprobs_are_off_stops_the_run_at_the_probe(tmp_path, saved, patched):
    # Negative control of the server's probe: a server whose log-probs are 0.5 off the trainer's is caught at the
    # first push, before any step trains on its tokens.
    import fake_vllm as fake
    from trl_plugins.trainers.async_rollouts import OffPolicyDrift

    with fake.FakeVLLMServer(saved[0], logprob_shift=0.5) as server:
        with pytest.raises(OffPolicyDrift, match=r"weight-push probe: after the push of step 0's weights.* by 0.5"):
            train_with_vllm(
                tmp_path,
                saved[0],
                vllm_mode="server",
                vllm_server_base_url=server.base_url,
                max_steps=1,
                async_rollouts=True,
            )


class HalfConstantReward(TokenReward):
    """Constant for even questions (their groups carry no signal: dynamic sampling drops them)."""

    def __call__(self, trajectory, example) -> float:
        return 1.0 if int(example["prompt"].split()[2]) % 2 == 0 else super().__call__(trajectory, example)


@pytest.mark.slow
def test_async_rollouts_with_dynamic_sampling_refill_in_the_trainer(tmp_path):
    # The first round comes from the replica (1 step stale); the refill rounds replacing the dropped groups are sampled
    # in the trainer by this step's weights: the step holds its groups, and its tokens mix staleness 1 and 0.
    # And a judge (weight 0, the scripted one, group ranking) scores the replica's rounds and the trainer's refills.
    from trl_plugins.rewards.judge import JudgeReward
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    scripted_judge = scripted_judge_module()
    server, _ = scripted_judge.serve(0)
    judge = JudgeReward(
        base_url=f"http://127.0.0.1:{server.server_port}/v1",
        model="scripted-judge",
        mode="group",
        cache_path=str(tmp_path / "judge.sqlite"),
    )
    tok = build_tokenizer("qwen2_5")
    torch.manual_seed(0)
    config = tiny_config(
        tmp_path,
        per_device_train_batch_size=8,
        max_steps=3,
        async_rollouts=True,
        dynamic_sampling=True,
        reward_components=["length", "judge"],
        reward_component_weights=[1.0, 0.0],
    )
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        config,
        train_dataset=tiny_dataset(12),
        processing_class=tok,
        reward_components={"length": HalfConstantReward(), "judge": judge},
    )
    try:
        trainer.train()
    finally:
        server.shutdown()
    records = _records(tmp_path)
    assert all(r["judge/errors"] == 0 and r["reward/verifier_error_rate"] == 0 for r in records)
    assert sum(r["judge/calls"] for r in records) == scripted_judge._state["requests"] > 0
    assert all(any(c.name == "judge" for c in t.reward_components) for t in trainer.last_batch.trajectories)
    assert all(r["dynamic_sampling/rounds"] >= 2 and r["dynamic_sampling/kept_groups"] >= 2 for r in records)
    assert records[1]["train/staleness_max"] == 1.0 and 0.0 < records[1]["train/on_policy_token_frac"] < 1.0
    batch = trainer.last_batch
    first_round = {t.policy_version.step for t in batch.trajectories[:8]}
    refills = {t.policy_version.step for t in batch.trajectories[8:]}
    assert first_round == {1} and refills == {2}


def test_turns_record_the_weights_that_sampled_them_when_weights_change_mid_trajectory():
    # A sampler whose weights change during a rollout (the replica's with streaming, the vLLM server's): each generate
    # call is stamped with the step of the weights loaded then.
    # A tool that "pushes new weights" while it runs moves every later turn to the next step; the trajectory keeps
    # the version it started with, its turns say which weights sampled each, and its datum carries them per token.
    import threading

    from support.rollout import SCHEMA, FakeTool, scripted
    from trl_plugins.datum import build_datum
    from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest
    from trl_plugins.trainers.replica import StampedSampler

    chat = ChatFormat(build_tokenizer("qwen2_5"), [SCHEMA], final_answer_pattern=r"\\boxed\{")
    version, lock = [5], threading.Lock()

    class Pushing(FakeTool):
        async def __call__(self, arguments):
            with lock:
                version[0] += 1  # the trainer's next weights arrive while the call runs
            return await super().__call__(arguments)

    backend = StampedSampler(scripted(chat), lambda: lock, lambda: version[0])
    q = RolloutQuestion("q0", chat.initial_prompt_ids([{"role": "user", "content": "calls=2"}]), group_id=0)
    result = MultiTurnRollout()(
        RolloutRequest([q], 1, backend, chat, {"code_interpreter": Pushing()}, policy_step=5, seed=0)
    )
    (traj,) = result.trajectories
    assert traj.policy_version.step == 5
    assert traj.turn_policy_steps() == [5, 6, 7]
    datum = build_datum(traj, advantage=1.0)
    steps = [s for s, m in zip(datum.behaviour_steps, datum.action_mask) if m]
    assert steps and sorted(set(steps)) == [5, 6, 7]
    assert all(s == -1 for s, m in zip(datum.behaviour_steps, datum.action_mask) if not m)


# -- a stop that reaches the replica too (issue 50.12) -----------------------------------------------------------


def _refused():
    raise ConnectionRefusedError(111, "Connection refused")


class _HalfShared:
    """An answer whose tensors' owner has died: unpickling it asks the dead replica for them (torch's file-descriptor
    sharing connects to the sender), as a batch the replica left half-shared when a SIGTERM killed it."""

    def __reduce__(self):
        return _refused, ()


class _Replica:
    """The replica process as the trainer sees it: alive until ``die()``, then dead of ``signum``."""

    def __init__(self):
        self.pid, self.exitcode, self.alive = 4242, None, True

    def is_alive(self):
        return self.alive

    def die(self, signum=signal.SIGTERM):
        self.alive, self.exitcode = False, -signum

    def join(self, timeout=None):
        pass

    kill = join


def _replica_waiting_for(key):
    """A GenerationReplica handle whose rollout ``key`` is pending, on a real queue, without a process behind it."""
    import torch.multiprocessing as mp

    from trl_plugins.trainers.replica import GenerationReplica

    ctx = mp.get_context("spawn")
    handle = GenerationReplica.__new__(GenerationReplica)
    handle._jobs, handle._results, handle._process = ctx.Queue(), ctx.Queue(), _Replica()
    handle._pending, handle._done, handle._probes, handle.closed, handle.pushed_step = [key], {}, {}, False, key
    return handle


def _fail(handle, error):
    if error == "half-shared":
        handle._results.put(("rollout", 5, _HalfShared(), 5, {}))
    elif error == "error message":  # its rollout failed first (a tool killed by the same signal), then it died
        handle._results.put(
            ("error", "Traceback (most recent call last):\n  ...\nBrokenPipeError: [Errno 32] Broken pipe")
        )
    handle._process.die()


@pytest.mark.parametrize("error", ["half-shared", "error message", "exited"])
@pytest.mark.parametrize("phase", ["update", "rollout", "between"])
def test_a_replica_that_dies_of_the_stop_signal_is_the_stop(phase, error):
    # A SIGTERM to the process group kills the replica (SIG_DFL) and asks the trainer to stop. The trainer then meets
    # the replica's end as it reads step 5's answer: "update", the signal came during the previous update (the stop is
    # pending before the read); "rollout", it comes while the trainer waits; "between", the replica's failure is read
    # before the trainer's handler has run (the stop arrives 0.3 s later). Each way result() is None (the trainer
    # then stops as documented: "training stopped on SIGTERM after step N"), not a ReplicaError or the
    # ConnectionRefusedError of the half-shared answer ("The run stopped at step 5 (ConnectionRefusedError)").
    import threading

    handle = _replica_waiting_for(5)
    stop = threading.Event()
    if phase == "update":
        stop.set()
        _fail(handle, error)
        timer = None
    elif phase == "rollout":

        def signal_arrives():
            stop.set()
            _fail(handle, error)

        timer = threading.Timer(0.3, signal_arrives)
    else:
        _fail(handle, error)
        timer = threading.Timer(0.3, stop.set)  # after the first 0.2 s poll of an empty queue
    if timer is not None:
        timer.start()
    try:
        assert handle.result(5, cancelled=stop.is_set) is None
    finally:
        if timer is not None:
            timer.cancel()
        handle.close()


@pytest.mark.parametrize("error", ["half-shared", "error message", "exited"])
def test_a_replica_that_fails_without_a_stop_is_an_error(error, monkeypatch):
    # The negative control: no stop asked for, the same failure is the replica's error, named, after the grace.
    from trl_plugins.trainers import replica
    from trl_plugins.trainers.replica import ReplicaError

    monkeypatch.setattr(replica, "STOP_GRACE_S", 0.2)

    says = {
        "half-shared": r"ConnectionRefusedError.*was killed by SIGTERM",
        "error message": "BrokenPipeError",
        "exited": "was killed by SIGTERM without an error message",
    }[error]
    handle = _replica_waiting_for(5)
    _fail(handle, error)
    start = time.monotonic()
    try:
        with pytest.raises(ReplicaError, match=says):
            handle.result(5, cancelled=lambda: False)
        assert 0.2 <= time.monotonic() - start < 0.2 + 1.0  # it waited the grace for a stop, no longer
    finally:
        handle.close()


@pytest.mark.parametrize("stopping", [True, False])
def test_a_server_rollout_that_fails_while_a_stop_is_pending_is_the_stop(stopping, monkeypatch):
    # vLLM server mode: the rollouts run on threads of the trainer against a server that the same SIGTERM may kill.
    import concurrent.futures
    from types import SimpleNamespace

    from trl_plugins.trainers import replica
    from trl_plugins.trainers.async_rollouts import ServerRollouts

    monkeypatch.setattr(replica, "STOP_GRACE_S", 0.2)
    server = ServerRollouts.__new__(ServerRollouts)
    failed = concurrent.futures.Future()
    failed.set_exception(ConnectionRefusedError(111, "Connection refused"))
    server._futures, server._starts, server._probes, server.parts = {5: failed}, {5: 4}, {}, SimpleNamespace(tools={})
    if stopping:
        assert server.result(5, cancelled=lambda: True) is None
    else:
        with pytest.raises(ConnectionRefusedError):
            server.result(5, cancelled=lambda: False)


def test_the_samplers_busy_clock_counts_overlapping_calls_once():
    import threading

    from trl_plugins.trainers.replica import BusyClock, sampler_figures

    clock = BusyClock()
    before = clock.reading()
    started, release = threading.Barrier(3), threading.Event()

    def call():
        with clock.timing():
            started.wait()
            release.wait()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait()  # both calls are running
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join()
    time.sleep(0.1)  # idle
    after = clock.reading()
    busy = after[1] - before[1]
    # once, not twice: counted twice, the two overlapping calls would exceed the wall time less the idle 0.1 s
    assert 0.2 <= busy <= after[0] - before[0] - 0.1
    figures = sampler_figures(before, after)
    assert figures["timing/sampler_busy_s"] == pytest.approx(busy)
    assert figures["timing/sampler_busy_s"] + figures["timing/sampler_idle_s"] == pytest.approx(after[0] - before[0])
    assert figures["timing/sampler_idle_s"] >= 0.1
    assert sampler_figures(None, after) == {} and sampler_figures(after, after) == {}
