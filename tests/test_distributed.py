"""2-process DDP and ZeRO-3 on CPU through the real launcher: ranks with different numbers of datums
and turns take one update that equals a 1-process plain-torch step on all the data.

A launch costs 10-15 s of imports per rank before its first step, more than most cases take: the cases of each
script run one after the other in one launch per accelerate config (``--cases``), each writing its own report,
and the tests read them (:class:`CaseLaunches`); the fake vLLM server of the server-mode case serves while the DDP
launch runs. Runs that need a launch of their own (two "nodes", signals) still get one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import accelerate_launch, cpu_launch_env, hang_guard_s

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_update_equivalence.py"
MULTI_NODE_SCRIPT = ROOT / "tests" / "dist_multi_node.py"


# -- one update on two ranks vs one process: one launch per backend ----------------------------------------------

UPDATE_EXTRA = {
    "plain": (),
    "rebalance-seq-mean": ("--rebalance", "--aggregation", "seq_mean_token_mean"),
    "kl-entropy": ("--kl",),
    "critic": ("--critic",),
    "token_truncate": ("--mismatch", "token_truncate"),
    "sequence_mask": ("--mismatch", "sequence_mask"),
}
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
# The shared-prefix layout with every term on (reference KL, entropy, importance weights): one update per aggregation
# mode, chained on the same engines (each against a one-process step from where the last one left the weights).
UPDATE_EXTRA.update(
    {
        "shared": ("--shared-prefix", "--kl", "--mismatch", "token_truncate", "--aggregations", ",".join(AGGREGATIONS)),
        "shared-critic": ("--shared-prefix", "--critic"),
        "shared-rebalance": ("--shared-prefix", "--rebalance", "--aggregation", "seq_mean_token_mean"),
        "chunked-head": ("--chunked-head",),
    }
)
SHARED = ("shared", "shared-critic")
# Sequence parallelism (sequence_parallel_size=2, ZeRO-3): on 2 ranks one group, every aggregation mode chained with
# the reference KL, the entropy bonus and token-level importance weights; sequence-level weights (taken on the whole
# row) under activation checkpointing; on 4 ranks two groups (data parallelism over them), planned per group or
# rebalanced.
UPDATE_EXTRA.update(
    {
        "sp": ("--sequence-parallel", "--kl", "--mismatch", "token_truncate", "--aggregations", ",".join(AGGREGATIONS)),
        "sp-sequence-mask": (
            "--sequence-parallel",
            "--mismatch",
            "sequence_mask",
            "--checkpointing",
            "--aggregation",
            "seq_mean_token_mean",
        ),
        "sp-groups": ("--sequence-parallel", "--kl"),
        "sp-groups-rebalance": ("--sequence-parallel", "--rebalance", "--aggregation", "seq_mean_token_mean"),
    }
)
UPDATE_CASES = {
    "cpu_ddp.yaml": (
        "plain",
        "rebalance-seq-mean",
        "kl-entropy",
        "critic",
        "token_truncate",
        *SHARED,
        "shared-rebalance",
    ),
    "cpu_zero3.yaml": (
        "plain",
        "kl-entropy",
        "critic",
        "sequence_mask",
        *SHARED,
        "chunked-head",
        "sp",
        "sp-sequence-mask",
    ),
    "cpu_zero3.yaml@4": ("sp-groups", "sp-groups-rebalance"),
}


def update_cases(config: str, root: Path) -> dict[str, list[str]]:
    """The cases of tests/dist_update_equivalence.py under ``config``, by name."""
    return {name: ["--out", str(root / f"{name}.json"), *UPDATE_EXTRA[name]] for name in UPDATE_CASES[config]}


@pytest.fixture(scope="module")
def update_runs(tmp_path_factory) -> "CaseLaunches":
    return CaseLaunches(tmp_path_factory.mktemp("update_runs"), SCRIPT, update_cases)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
def test_two_ranks_critic_update_matches_one_process(config, update_runs):
    report = update_runs(config, "critic")
    assert report["world"] == 2 and report["deepspeed"] == (config == "cpu_zero3.yaml")
    # Rollout-time values taken on the ranks (dummies under ZeRO-3) are the one-process ones.
    assert report["values_err"] < 1e-5 and report["after_err"] < 1e-5
    assert 0.0 < report["clip_frac"] < 1.0  # both branches of the clipped value loss were taken
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))


@pytest.mark.slow
def test_zero3_gathers_the_chunked_heads_weight_once_per_forward_and_once_per_backward(update_runs):
    # Every parameter partitioned (no persistence threshold; the tiny model's would otherwise all persist), both ranks
    # on the same micro-batch: the log-probs, entropies and full gradients equal one process's full logits (1e-5),
    # untied, tied (the head's weight is the input embedding's) and with a LoRA adapter on lm_head (PEFT's wrapper, a
    # head with submodules; only the adapter trains), with 94 action positions in chunks of 7, in one chunk, in chunks
    # of 7 in the shared-prefix layout, and with the full logits. The head's weight is all-gathered once in the forward
    # (by the head's hooks in the model's forward, or the embedding's where tied, then kept for the chunks; the
    # adapter's with its base layer, by the chunks) and once in the backward (for every chunk's recompute). Once more
    # in the backward: tied, by the embedding's own backward (as with the full logits); in the shared-prefix layout,
    # by the head's hooks of its second forward. Before: 15 gathers in the forward and 29 in the backward with chunks
    # of 7; the adapter's, 15 in the backward.
    report = update_runs("cpu_zero3.yaml", "chunked-head")
    assert report["world"] == 2 and report["n_action"] > 10 * 7
    for kind in ("untied", "tied", "lora-head"):
        assert set(report[kind]) == {"chunks-of-7", "one-chunk", "shared-prefix-chunks-of-7", "full"}
        for mode, got in report[kind].items():
            assert got["lp_err"] < 1e-5 and got["ent_err"] < 1e-5 and got["grad_err"] < 1e-5, (kind, mode, got)
            assert got["head_grad_norm"] > 1.0
            if mode != "full":
                backward_cap = 2 if kind == "tied" or (kind == "untied" and mode.startswith("shared")) else 1
                assert got["forward_gathers"] == 1 and got["backward_gathers"] <= backward_cap, (kind, mode, got)
                assert got["adapter_forward_gathers"] == 1 and got["adapter_backward_gathers"] <= backward_cap, (
                    kind,
                    mode,
                    got,
                )


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_in_the_shared_prefix_layout_match_one_padded_process(config, aggregation, update_runs):
    # Each pair's prompt forwarded once per micro-batch on the ranks (micro-batches of 2 rows, so pairs stay together
    # or are cut), with the reference KL, the entropy bonus and token-level importance weights: the update is the
    # one-process padded one, and so are the reference and old log-probs the ranks took in that layout.
    launch = update_runs(config, "shared")
    report = launch["steps"][AGGREGATIONS.index(aggregation)]
    assert report["aggregation"] == aggregation
    assert report["world"] == 2 and report["deepspeed"] == (config == "cpu_zero3.yaml")
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))
    assert report["ref_err"] < 1e-5 and report["old_err"] < 1e-5 and report["entropy"] > 0
    assert report["computed_tokens"] < report["input_tokens"]  # the prompts were shared


@pytest.mark.slow
def test_rebalanced_ranks_share_prefixes_across_the_gathered_datums(update_runs):
    report = update_runs("cpu_ddp.yaml", "shared-rebalance")
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert report["computed_tokens"] < report["input_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
def test_two_ranks_critic_update_in_the_shared_prefix_layout_matches_one_process(config, update_runs):
    report = update_runs(config, "shared-critic")
    assert report["values_err"] < 1e-5 and report["after_err"] < 1e-5
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,case",
    [
        ("cpu_ddp.yaml", "plain"),
        ("cpu_ddp.yaml", "rebalance-seq-mean"),
        ("cpu_zero3.yaml", "plain"),
        ("cpu_ddp.yaml", "kl-entropy"),
        ("cpu_zero3.yaml", "kl-entropy"),
    ],
    ids=["ddp", "ddp-rebalance-seq-mean", "zero3", "ddp-kl-entropy", "zero3-kl-entropy"],
)
def test_two_ranks_match_one_process(config, case, update_runs):
    report = update_runs(config, case)
    assert report["world"] == 2 and report["deepspeed"] == (config == "cpu_zero3.yaml")
    assert report["rebalance"] == (case == "rebalance-seq-mean")
    # The ranks held 3 and 7 datums: one rank ran zero-weight dummy micro-batches (rebalanced: as the plan falls).
    assert (report["dummies"] >= 1 or case == "rebalance-seq-mean") and report["micro_batches"] >= 2
    assert report["clip_frac"] > 0.0  # behaviour != current: the clip really acted
    assert report["update_norm"] > 1e-3
    assert report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))
    if case == "kl-entropy":
        # Zero-advantage datums are forwarded anyway (the KL and entropy terms reach them), and the reference
        # log-probs computed by the prepared (under ZeRO-3 sharded) reference model were the right ones.
        assert report["forwarded"] == 10 and report["kl_k3"] > 0 and report["entropy"] > 0 and report["ref_err"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,mode",
    [("cpu_ddp.yaml", "token_truncate"), ("cpu_zero3.yaml", "sequence_mask")],
    ids=["ddp-token-truncate", "zero3-sequence-mask"],
)
def test_two_ranks_mismatch_correction_matches_one_process(config, mode, update_runs):
    # Ranks take pi_old of their own datums (3 and 7: different forward counts, dummies under ZeRO-3) and the
    # update weighted by the bounded pi_old / pi_sampler equals the one-process step.
    report = update_runs(config, mode)
    assert report["world"] == 2 and report["dummies"] >= 1
    assert report["old_err"] < 1e-5
    bounded = report["mismatch"]["is_masked_frac" if mode.endswith("mask") else "is_truncated_frac"]
    assert 0.0 < bounded < 1.0, report  # the bounds really acted, and not on everything
    assert report["update_norm"] > 1e-3 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))


# -- trainer runs: one launch per backend ------------------------------------------------------------------------
# A launch costs 10-15 s of imports per rank before its first step, more than most runs here take. The trainer runs
# of this file are cases of one launch per accelerate config (tests/dist_trainer_run.py --cases), run one after the
# other in the same processes; each writes its own report.

STEP = ("--max_steps", "1", "--optim", "sgd", "--slot_reward", "--per_row_seed")
"""Rollouts sampled row by row with per-row seeds (the same however the questions are split) and SGD (Adam's first
step would hide a wrongly scaled gradient): one step on 2 ranks x 2 questions equals one on 1 rank x 4."""
STEP_EXTRA = {
    "grpo": (),
    "reference-kl-2-steps": ("--beta", "0.5", "--max_steps", "2"),
    "critic-gae-2-steps": ("--gae", "--max_steps", "2"),
    "padding-free-critic-gae-2-steps": ("--padding_free", "--gae", "--max_steps", "2"),
    "dynamic-sampling": ("--dynamic_sampling", "3"),
    "dynamic-sampling-fractional": ("--dynamic_sampling", "1.25"),
    "async-staleness-0": ("--async_k", "0"),
    "distillation": ("--teacher",),  # the teacher placed like the reference: a copy per DDP rank, sharded by ZeRO-3
}
STEP_CONFIGS = {"dynamic-sampling-fractional": ("cpu.yaml", "cpu_zero3.yaml")}
"""The accelerate configs a STEP_EXTRA case runs under, where not all three (the suite's wall time is tight)."""
LORA_EXTRA = {"lora": (), "lora-reference-kl-2-steps": ("--beta", "0.5", "--max_steps", "2")}
RESUME_EXTRA = {"grpo": (), "critic": ("--gae",)}
ASYNC = ("--async_k", "1", "--max_steps", "3")
"""Asynchronous rollouts with max_staleness 1: step 2 trains a batch sampled by the weights of step 1."""
ASYNC_CONFIGS = ("cpu.yaml", "cpu_ddp.yaml", "cpu_zero3.yaml")


def trainer_cases(config: str, root: Path) -> dict[str, list[str]]:
    """Every trainer run this file makes under ``config``, by name, in the order they run (a resumed run after the
    run whose checkpoint it takes)."""

    def run(name: str, *extra: str) -> tuple[str, list[str]]:
        return name, ["--out", str(root / f"{name}.json"), "--output_dir", str(root / name), *extra]

    per_device = "8" if config == "cpu.yaml" else "4"
    cases = []
    if config != "cpu.yaml":
        # --reward_model: scored with a tiny reward model too, at weight 0 (the run is the same, the scoring cheap).
        cases.append(run("real-steps", "--slot_reward", "--reward_model"))
        # Infrastructure failures; each rank dumps its trajectories, which the logged metrics must be the union of.
        cases.append(
            run("flaky", "--max_steps", "2", "--flaky", "--per_device", "8", "--dump", str(root / "flaky-dump"))
        )
    if config == "cpu_ddp.yaml":
        # Runs that must stop, on every rank alike: a broken world (with asynchronous rollouts), and no update.
        cases.append(run("broken-world", "--max_steps", "2", "--broken_world", "--async_k", "1", "--expect_stop"))
        cases.append(run("trained-nothing", "--max_steps", "2", "--constant_reward", "--expect_stop"))
    if config == "cpu_zero3.yaml":
        for kind, extra in RESUME_EXTRA.items():
            # One uninterrupted run both saves the checkpoint of step 1 and gives the parameters after step 2 that the
            # run resumed from that checkpoint must reproduce (saving changes nothing the run goes on with).
            cases.append(
                run(
                    f"resume-{kind}-straight",
                    "--max_steps",
                    "2",
                    "--save_steps",
                    "1",
                    "--params_out",
                    str(root / f"resume-{kind}-straight.pt"),
                    *extra,
                )
            )
            cases.append(
                run(
                    f"resume-{kind}-resumed",
                    "--max_steps",
                    "2",
                    "--resume",
                    str(root / f"resume-{kind}-straight" / "checkpoint-1"),
                    "--params_out",
                    str(root / f"resume-{kind}-resumed.pt"),
                    *extra,
                )
            )
    for kind, extra in STEP_EXTRA.items():
        if config in STEP_CONFIGS.get(kind, (config,)):
            cases.append(
                run(
                    f"step-{kind}",
                    "--per_device",
                    per_device,
                    "--params_out",
                    str(root / f"step-{kind}.pt"),
                    *STEP,
                    *extra,
                )
            )
    if config == "cpu_zero3.yaml":  # against cpu.yaml's step-grpo (one process cannot split)
        cases.append(
            run(
                "step-sequence-parallel",
                "--per_device",
                per_device,
                "--params_out",
                str(root / "step-sequence-parallel.pt"),
                *STEP,
                "--sequence_parallel",
            )
        )
    if config in ASYNC_CONFIGS:
        cases.append(
            run("step-async", "--per_device", per_device, "--params_out", str(root / "step-async.pt"), *STEP, *ASYNC)
        )
    if config != "cpu_ddp.yaml":
        for kind, extra in LORA_EXTRA.items():
            cases.append(
                run(
                    f"lora-{kind}",
                    "--per_device",
                    per_device,
                    "--initial_out",
                    str(root / f"lora-{kind}.init.pt"),
                    "--params_out",
                    str(root / f"lora-{kind}.pt"),
                    *STEP,
                    "--lora",
                    *extra,
                )
            )
    # Last: they patch TRL's vLLM names with the fakes in these processes. The server's address is added by
    # fake_vllm_server while the DDP launch runs.
    if config == "cpu_zero3.yaml":
        cases.append(run("vllm-colocate", "--vllm", "colocate"))
    if config == "cpu_ddp.yaml":
        cases.append(run("vllm-server", "--vllm", "server"))
    return dict(cases)


@contextlib.contextmanager
def fake_vllm_server(config: str, root: Path):
    """While the DDP launch runs: the fake vLLM server (tests/fake_vllm.py) on the tiny model, its address given to
    the launch's vllm-server case; afterwards the requests it answered are in ``<root>/vllm-server.requests``."""
    if config != "cpu_ddp.yaml":
        yield {}
        return
    from fake_vllm import FakeVLLMServer
    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer("qwen2_5")
    build_tiny_model(tok).save_pretrained(root / "served")
    tok.save_pretrained(root / "served")
    with FakeVLLMServer(str(root / "served")) as server:
        yield {"vllm-server": ["--vllm_url", server.base_url]}
        (root / "vllm-server.requests").write_text(str(server.engine.requests))


class CaseLaunches:
    """The cases of ``script`` under each accelerate config (``cases(config, folder)`` names them, in order),
    launched once per config on first use: ``launches(config, name)`` is that case's report. ``around(config,
    folder)``, where given, is a context manager held open while that config's launch runs (a server some cases use);
    it gives more arguments for cases by name."""

    def __init__(self, root: Path, script: Path, cases, around=None) -> None:
        self.root, self.script, self.cases, self.reports = root, script, cases, {}
        self.around = around or (lambda config, folder: contextlib.nullcontext({}))

    def folder(self, config: str) -> Path:
        return self.root / config

    def __call__(self, config: str, name: str) -> dict:
        if config not in self.reports:
            self.reports[config] = self._launch(config)
        found = self.reports[config]
        assert name in found, f"no case {name!r} of {self.script.name} under {config}"
        outcome = found[name]
        assert not isinstance(outcome, str), outcome
        return outcome

    def _launch(self, config: str) -> dict[str, dict | str]:
        root = self.folder(config)
        root.mkdir(parents=True, exist_ok=True)
        with self.around(config, root) as more:
            return self._launch_cases(config, root, more)

    def _launch_cases(self, config: str, root: Path, more: dict[str, list[str]]) -> dict[str, dict | str]:
        cases = self.cases(config, root)
        for name, args in more.items():
            cases[name] = [*cases[name], *args]
        (root / "cases.json").write_text(json.dumps(list(cases.values())))
        # "<config>@<N>": the config with N processes.
        name, _, processes = config.partition("@")
        cmd = accelerate_launch(name, self.script, "--cases", str(root / "cases.json"))
        if processes:
            cmd[cmd.index("--main_process_port") : cmd.index("--main_process_port")] = ["--num_processes", processes]
        env = cpu_launch_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        # An outer timeout: a stuck gloo collective would otherwise hang the suite.
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard_s(120 + 60 * len(cases))
        )
        log = proc.stdout[-3000:] + proc.stderr[-5000:]
        out: dict[str, dict | str] = {}
        for name in cases:
            report = root / f"{name}.json"
            # A rank whose peer crashed fails too ("Connection closed by peer"): the other rank's error is the cause.
            errors = sorted(
                (e.read_text() for e in root.glob(f"{name}.json.error.rank*")),
                key=lambda text: "Connection closed by peer" in text,
            )
            if errors:
                out[name] = f"case {name!r} of {self.script.name} under {config} failed:\n{errors[0]}\n{log}"
            elif report.exists():
                out[name] = json.loads(report.read_text())
            else:
                out[name] = (
                    f"case {name!r} of {self.script.name} under {config} did not run (exit {proc.returncode}):\n{log}"
                )
        return out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory) -> CaseLaunches:
    return CaseLaunches(
        tmp_path_factory.mktemp("trainer_runs"), ROOT / "tests" / "dist_trainer_run.py", trainer_cases, fake_vllm_server
    )


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
def test_trainer_runs_real_steps_on_two_ranks(config, trainer_runs):
    # Real MultiTurnGRPOTrainer steps: rollout (ZeRO-3: weights gathered once per rollout), scoring,
    # packing with dummies where a rank has fewer micro-batches, one update per step; no hang.
    # --slot_reward: the questions without "Explain" get a constant reward (zero-advantage groups, skipped), so
    # the ranks hold different numbers of datums and one of them runs dummy micro-batches.
    report = trainer_runs(config, "real-steps")
    assert report["world"] == 2 and report["global_step"] == 3
    assert report["deepspeed"] == (config == "cpu_zero3.yaml")
    steps = report["steps"]
    assert len(steps) == 3 and all(s["train/update_skipped"] == 0.0 for s in steps)
    assert any(s["train/dummy_micro_batches"] >= 1 for s in steps)
    # On-policy in fp32: the sampler's behaviour log-probs match the trainer's forward.
    assert all(abs(s["train/ratio_min"] - 1) < 1e-3 and abs(s["train/ratio_max"] - 1) < 1e-3 for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
def test_reward_model_on_two_ranks_scores_as_one_process(config, trainer_runs):
    # The real-steps run also scored with the reward_model component (weight 0): each rank scored its own trajectories
    # with a whole replica (under ZeRO-3 too: loaded without partitioning, no engine), in batches of 3 with padding.
    # Each value equals this process's, one trajectory at a time, on the same model.
    import pickle

    from trl_plugins.rewards.reward_model import RewardModelReward

    trainer_runs(config, "real-steps")
    out = trainer_runs.folder(config) / "real-steps"
    weights = [(out / f"reward-model-{r}" / "model.safetensors").read_bytes() for r in (0, 1)]
    assert weights[0] == weights[1]  # one model on both ranks
    dumps = sorted((out / "reward-model-dump").glob("rank*-step*.pkl"))
    assert [p.name for p in dumps] == [f"rank{r}-step{s}.pkl" for r in (0, 1) for s in (1, 2, 3)]
    component = RewardModelReward(model=str(out / "reward-model-0"), batch_size=1)
    values = []
    for path in dumps:
        for trajectory, row in pickle.loads(path.read_bytes()):
            scored = trajectory.reward_component("reward_model")
            assert scored.weight == 0.0
            assert scored.value == pytest.approx(component(trajectory, row), abs=1e-5), (path.name, row)
            values.append(scored.value)
    assert len(values) == 24 and max(values) - min(values) > 1e-3  # 4 per rank and step; not all one value


@pytest.mark.slow
def test_infrastructure_failures_on_two_ranks(trainer_runs):
    # A flaky tool and a verifier that raises and hangs, on 2 DDP ranks: the run completes, the failures are
    # counted over both ranks, and the ranks agree on the verifier-error rate (the stop threshold is global).
    report = trainer_runs("cpu_ddp.yaml", "flaky")
    assert report["world"] == 2 and report["global_step"] == 2
    for step in report["steps"]:
        assert step["rollout/stop/environment_error"] > 0 and step["rollout/stop/verifier_error"] > 0
        assert step["reward/verifier_error_rate"] == pytest.approx(step["rollout/stop/verifier_error"])
        assert step["train/world_failure_frac"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_ddp.yaml", "cpu_zero3.yaml"], ids=["ddp", "zero3"])
def test_logged_metrics_on_two_ranks_are_those_of_the_union_of_their_trajectories(trainer_runs, config):
    # The flaky run of each launch (above): every rank dumped its trajectories per step; the logged step metrics are
    # those of the union of both ranks' trajectories, not a mean of the ranks' own values.
    from trl_plugins.rollout.metrics import quantile

    trainer_runs(config, "flaky")
    root = trainer_runs.folder(config)
    dump = root / "flaky-dump"
    logged = [json.loads(line) for line in (root / "flaky" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in logged if "rollout/trajectories" in r}
    ranks = [[json.loads(line) for line in (dump / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 2
    differs = 0
    for r0, r1 in zip(*ranks):
        step = r0["step"]
        both = r0["trajectories"] + r1["trajectories"]

        def view(trajs):
            scored = [t for t in trajs if not t["world_failure"]]
            tokens = sorted(t["tokens"] for t in trajs)
            return {
                "rollout/trajectories": len(trajs),
                "reward/total": sum(t["reward"] for t in scored) / max(len(scored), 1),
                "rollout/stop/final_answer": sum(t["stop"] == "final_answer" for t in trajs) / len(trajs),
                "rollout/stop/environment_error": sum(t["stop"] == "environment_error" for t in trajs) / len(trajs),
                "rollout/trajectory_tokens_p50": quantile(tokens, 0.5),
                "rollout/trajectory_tokens_p90": quantile(tokens, 0.9),
            }

        union = view(both)
        for key, value in union.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)
        # Negative control: the mean of the ranks' own values is another number for some of them.
        per_rank = [view(r0["trajectories"]), view(r1["trajectories"])]
        differs += sum(abs((a[k] + b[k]) / 2 - union[k]) > 1e-6 for a, b in [per_rank] for k in union)
    assert differs > 0


@pytest.mark.slow
def test_a_broken_world_stops_both_ranks_alike_naming_the_most_common_error_of_either(trainer_runs):
    # Rank 1: its 4 trajectories end environment_error (a 404, a different path in each message); rank 0: 1 of 4 (a
    # time limit). 5 of 8 > 0.5 over the ranks, though rank 0 alone is at 1 of 4: both stop at the first step with one
    # message, which names rank 1's error (gathered) as the most common, its usual cause, and rank 0's after it.
    # Asynchronous rollouts (--async_k 1): scored by the trainer, so the same check; the replica is closed.
    report = trainer_runs("cpu_ddp.yaml", "broken-world")
    assert report["world"] == 2 and report["global_step"] == 0 and report["policy_updates"] == 0
    first, second = report["stops"]
    assert first == second, (first, second)
    assert first.startswith("RuntimeError: 62% of this step's trajectories (all ranks, cancelled ones not counted)")
    assert (
        "Most common error (4 of 5): the agent failed: NotFoundError: Error code: 404 - no such endpoint "
        "'/q0/chat/completions'; then (1) the agent ran past agent_time_limit_s=1.0. Likely cause: the agent could "
        "not reach the endpoint: use the base_url"
    ) in first


@pytest.mark.slow
def test_a_run_without_an_update_ends_with_the_same_verdict_on_both_ranks(trainer_runs):
    # A constant reward: both steps skip the update (every group's rewards equal); the run goes to its end, then
    # train() raises NoPolicyUpdate(finished=True) on each rank, with the reason counted over both.
    report = trainer_runs("cpu_ddp.yaml", "trained-nothing")
    assert report["world"] == 2 and report["global_step"] == 2 and report["policy_updates"] == 0
    assert report["finished"] is True
    first, second = report["stops"]
    assert first == second, (first, second)
    assert first.startswith("NoPolicyUpdate: the run finished without one policy update: all 2 of its steps skipped it")
    assert "every group's rewards were equal (all 8 trajectories of the step, all ranks, have advantage 0)" in first


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(RESUME_EXTRA), ids=list(RESUME_EXTRA))
def test_zero3_resume_reproduces_the_next_step(trainer_runs, kind):
    # With --gae the saved parameters include the critic's (its own sharded engine, saved with its optimizer).
    import torch

    report = trainer_runs("cpu_zero3.yaml", f"resume-{kind}-resumed")
    assert report["global_step"] == 2
    root = trainer_runs.folder("cpu_zero3.yaml")
    a, b = torch.load(root / f"resume-{kind}-straight.pt"), torch.load(root / f"resume-{kind}-resumed.pt")
    assert a.keys() == b.keys() and any(k.startswith("critic.") for k in a) == bool(RESUME_EXTRA[kind])
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STEP_EXTRA), ids=list(STEP_EXTRA))
def test_trainer_step_on_two_ranks_equals_one_process(trainer_runs, kind):
    # One trainer step on 2 ranks x 2 questions must equal one step on 1 rank x 4 questions (STEP). With beta, two
    # steps (the KL to TRL's reference, sharded under ZeRO-3, has no gradient at step 1, where the policy is the
    # reference). With dynamic sampling, the groups kept and the refill rounds' rows do not depend on the ranks; at a
    # fractional cap (1.25 x 4 groups: the refill round counts one group, and the 2 ranks draw a filler besides) too.
    import torch

    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    extra = STEP_EXTRA[kind]
    configs = STEP_CONFIGS.get(kind, ("cpu.yaml", "cpu_ddp.yaml", "cpu_zero3.yaml"))
    params, drawn, digests = {}, {}, {}
    for config in configs:
        report = trainer_runs(config, f"step-{kind}")
        assert report["steps"][0]["train/update_skipped"] == 0.0
        digests[config] = report["weights_digests"]
        if "--beta" in extra:
            assert report["global_step"] == 2 and report["steps"][-1]["train/kl_k3"] > 0
        if "--gae" in extra:  # advantages whitened over both ranks' tokens; the critic's update is exact too
            assert report["global_step"] == 2 and "critic/value_loss" in report["steps"][-1]
        if "--padding_free" in extra:  # the policy's and the critic's forwards processed exactly the real tokens
            assert all(s["train/forward_tokens"] == s["train/input_tokens"] for s in report["steps"])
        if "--dynamic_sampling" in extra:  # equal-reward groups dropped, refill rounds split over the ranks
            drawn[config] = {k: v for k, v in report["steps"][0].items() if k.startswith("dynamic_sampling/")}
            fillers = drawn[config].pop("dynamic_sampling/filler_groups")
            assert drawn[config]["dynamic_sampling/rounds"] >= 2
            if kind == "dynamic-sampling":
                assert drawn[config]["dynamic_sampling/short_groups"] == 0
            else:  # the cap leaves the refill round one group: counted on rank 0, a filler on rank 1
                assert drawn[config]["dynamic_sampling/groups_drawn"] == 5 and fillers == (config != "cpu.yaml")
        if "--teacher" in extra:  # the teacher forwarded on every rank, and its signal reached the advantages
            assert report["steps"][0]["timing/teacher_forward_s"] > 0 and report["steps"][0]["advantage/teacher_kl"]
            digests[config] = report["teacher_version"].split(" weights ")[1]  # ZeRO-3: gathered parameter by parameter
        params[config] = torch.load(trainer_runs.folder(config) / f"step-{kind}.pt")
    if drawn:  # the same groups drawn and kept however many ranks
        assert all(d == drawn["cpu.yaml"] for d in drawn.values()), drawn
    start = build_tiny_model(build_tokenizer("qwen2_5"))
    if (
        kind == "grpo"
    ):  # one step: sampled by the initial weights, whose digest every setup reads (ZeRO-3 in its gather)
        from trl_plugins.rollout.weights import weights_digest

        assert all(d == [weights_digest(start)] for d in digests.values()), digests
    initial = {k: v.float() for k, v in start.state_dict().items()}
    reference = params["cpu.yaml"]
    update = sum(float((reference[k] - initial[k]).pow(2).sum()) for k in reference if k in initial) ** 0.5
    assert update > 1e-4
    for config in configs[1:]:
        diff = sum(float((params[config][k] - reference[k]).pow(2).sum()) for k in reference) ** 0.5
        assert diff / update < 1e-5, (config, diff, update)
    if kind == "distillation":  # one teacher, read whole however it is placed; not GRPO's step
        from trl_plugins.rollout.weights import weights_digest

        teacher = weights_digest(build_tiny_model(build_tokenizer("qwen2_5"), seed=1))
        assert all(d == teacher for d in digests.values()), (digests, teacher)
        grpo = torch.load(trainer_runs.folder("cpu.yaml") / "step-grpo.pt")
        apart = sum(float((reference[k] - grpo[k]).pow(2).sum()) for k in grpo) ** 0.5
        assert apart / update > 1e-2, (apart, update)
    if kind == "async-staleness-0":  # async_rollouts with max_staleness 0 is the synchronous loop, bit for bit
        for config in ("cpu.yaml", "cpu_ddp.yaml", "cpu_zero3.yaml"):
            grpo = torch.load(trainer_runs.folder(config) / "step-grpo.pt")
            assert all(torch.equal(params[config][k], grpo[k]) for k in grpo), config


@pytest.mark.slow
def test_async_rollouts_on_two_ranks_equal_one_process(trainer_runs):
    # Each rank rolls out its own rows in its own generation replica, one step ahead; 3 steps on 2 ranks x 2 questions
    # equal 3 on 1 rank x 4 (per-row seeds: the samples do not depend on the split), the last one 1 step stale. Under
    # ZeRO-3 every rank gathers the full weights for each push.
    import torch

    params = {}
    for config in ASYNC_CONFIGS:
        report = trainer_runs(config, "step-async")
        assert report["global_step"] == 3
        assert [s["train/staleness_max"] for s in report["steps"]] == [0.0, 1.0, 1.0]
        assert all(s["async/probe_max_diff"] <= 1e-3 for s in report["steps"])
        params[config] = torch.load(trainer_runs.folder(config) / "step-async.pt")
    reference = params["cpu.yaml"]
    scale = sum(float(v.pow(2).sum()) for v in reference.values()) ** 0.5
    for config in ("cpu_ddp.yaml", "cpu_zero3.yaml"):
        diff = sum(float((params[config][k] - reference[k]).pow(2).sum()) for k in reference) ** 0.5
        assert diff / scale < 1e-6, (config, diff)


def check_vllm_generation_run(report: dict) -> None:
    assert report["world"] == 2 and report["global_step"] == 3
    steps = report["steps"]
    assert all(s["train/update_skipped"] == 0.0 for s in steps)
    # The fake samples from exactly the pushed weights: its log-probs match the trainer's forward.
    assert all(abs(s["train/ratio_min"] - 1) < 1e-3 and abs(s["train/ratio_max"] - 1) < 1e-3 for s in steps)


@pytest.mark.slow
def test_vllm_colocate_generation_on_two_zero3_ranks(trainer_runs):
    # The fake vLLM (tests/fake_vllm.py) behind TRL's VLLMGeneration: under ZeRO-3 colocate each rank's engine receives
    # the gathered weights after every update (the last case of the ZeRO-3 launch).
    report = trainer_runs("cpu_zero3.yaml", "vllm-colocate")
    assert report["vllm_weights_match"] is True
    check_vllm_generation_run(report)


@pytest.mark.slow
def test_vllm_server_generation_on_two_ddp_ranks(trainer_runs):
    # In server mode both ranks send their own turns to one server, which TRL's main-process client keeps in sync (the
    # last case of the DDP launch, while fake_vllm_server serves).
    report = trainer_runs("cpu_ddp.yaml", "vllm-server")
    requests = int((trainer_runs.folder("cpu_ddp.yaml") / "vllm-server.requests").read_text())
    turns = sum(s["rollout/turns_mean"] * s["rollout/trajectories"] for s in report["steps"])
    assert requests == round(turns)  # every turn of both ranks, one request each
    check_vllm_generation_run(report)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LORA_EXTRA), ids=list(LORA_EXTRA))
def test_lora_step_under_zero3_on_two_ranks_equals_one_process(trainer_runs, kind):
    # A LoRA adapter (TRL wraps the policy from peft_config), per-row seeds and SGD as above: one step on
    # 2 ZeRO-3 ranks x 2 questions equals one step on 1 process x 4 questions, and only the adapter moves.
    # With beta, the reference is the (sharded) policy with its adapter disabled: at step 1 the fresh adapter
    # (lora_B = 0) leaves the policy exactly the base, at step 2 they differ, by the same amount on both setups.
    import torch

    extra = LORA_EXTRA[kind]
    initial, final, gaps = {}, {}, {}
    for config in ("cpu.yaml", "cpu_zero3.yaml"):
        report = trainer_runs(config, f"lora-{kind}")
        assert report["steps"][0]["train/update_skipped"] == 0.0
        if "--beta" in extra:
            first, last = report["steps"][0], report["steps"][-1]
            assert report["global_step"] == 2 and first["train/ref_logprob_gap"] == 0.0
            gaps[config] = last["train/ref_logprob_gap"]
            assert gaps[config] > 1e-6 and last["train/kl_k2"] > 0
        folder = trainer_runs.folder(config)
        initial[config], final[config] = (
            torch.load(folder / f"lora-{kind}.init.pt"),
            torch.load(folder / f"lora-{kind}.pt"),
        )
    if gaps:
        # The gap is a mean of |log pi - log pi_ref| ~ 3e-5, each a difference of float32 log-probs of magnitude ~1-10
        # (rounding ~1e-6 per token, summed in another order on 2 sharded ranks with the chunked head): rel 1e-3 is
        # 3e-8, at that noise floor (1.5e-3 seen once on this machine). The gap is the adapter's whole effect after
        # one step, so another reference or update moves it far more than 1e-2.
        assert gaps["cpu_zero3.yaml"] == pytest.approx(gaps["cpu.yaml"], rel=1e-2)
    one, two = final["cpu.yaml"], final["cpu_zero3.yaml"]
    assert one.keys() == two.keys() == initial["cpu.yaml"].keys()
    adapter = [k for k in one if ".lora_" in k]
    assert adapter and all(torch.equal(initial["cpu.yaml"][k], initial["cpu_zero3.yaml"][k]) for k in one)  # same start
    for params in (one, two):  # the base weights are bit-identical after the step: only the adapter trained
        assert all(torch.equal(params[k], initial["cpu.yaml"][k]) for k in one if k not in adapter)
    update = sum(float((one[k] - initial["cpu.yaml"][k]).pow(2).sum()) for k in adapter) ** 0.5
    assert update > 1e-4
    diff = sum(float((two[k] - one[k]).pow(2).sum()) for k in adapter) ** 0.5
    assert diff / update < 1e-5, (diff, update)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(
    config: str, tmp_path: Path, *extra: str, overrides: tuple[str, ...] = ("--num_processes", "2"), timeout: int = 300
) -> tuple[dict | None, list[dict]]:
    """Two launchers on this machine as two "nodes", as on a cluster: the same command with ``--num_machines 2``
    and ``--machine_rank 0`` or ``1``, rendezvous on 127.0.0.1 at an explicit free port (a multi-node launch
    cannot use port 0: every node must be told the same port); ``overrides`` are more launcher options (by
    default one rank per node). Returns rank 0's report (None with ``--topology_only``) and every rank's
    environment as the launchers set it up, in rank order. If either launcher fails, the other is killed at
    once (it would wait for its peer until torch's rendezvous timeout); both are killed after the hang guard.
    """
    for attempt in range(3):  # the free port can be taken by someone else before the main node binds it
        out, port = tmp_path / f"report{attempt}.json", free_port()
        env = cpu_launch_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        logs = [tmp_path / f"node{rank}-{attempt}.log" for rank in (0, 1)]
        procs, hung = [], False
        try:
            for rank in (0, 1):
                cmd = [
                    sys.executable,
                    "-m",
                    "accelerate.commands.launch",
                    "--config_file",
                    str(ROOT / "accelerate_configs" / config),
                    "--num_machines",
                    "2",
                    *overrides,
                    "--machine_rank",
                    str(rank),
                    "--main_process_ip",
                    "127.0.0.1",
                    "--main_process_port",
                    str(port),
                    str(MULTI_NODE_SCRIPT),
                    "--out",
                    str(out),
                    *extra,
                ]
                with open(logs[rank], "w") as log:  # files, not pipes: nobody reads a pipe while both run
                    procs.append(
                        subprocess.Popen(
                            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                        )
                    )
            deadline = time.monotonic() + hang_guard_s(timeout)
            while time.monotonic() < deadline:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.2)
            else:
                hung = True
        finally:
            for p in procs:  # each launcher leads its own session: its torchrun workers go with it
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        text = [log.read_text() for log in logs]
        if attempt < 2 and any(
            s in text[0] for s in ("another process is utilizing it", "Address already in use", "EADDRINUSE")
        ):
            continue
        codes = [p.returncode for p in procs]
        tail = f"hang guard: killed after {hang_guard_s(timeout):.0f} s\n" if hung else ""
        tail += "\n".join(f"--- node {rank} (exit {codes[rank]}) ---\n" + text[rank][-4000:] for rank in (0, 1))
        assert codes == [0, 0] and (out.exists() or "--topology_only" in extra), tail
        ranks = sorted(
            (json.loads(f.read_text()) for f in tmp_path.glob(f"{out.name}.rank*.json")), key=lambda r: int(r["RANK"])
        )
        return (json.loads(out.read_text()) if out.exists() else None), ranks
    raise AssertionError("unreachable")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu_multi_node_zero3.yaml", "cpu_ddp.yaml"], ids=["zero3", "ddp"])
def test_two_nodes_match_one_process(config, tmp_path):
    """Multi-node through the real launchers: two ``accelerate launch --num_machines 2 --machine_rank 0/1`` on one
    machine (gloo, one rank per "node") find each other at 127.0.0.1 and take one update equal to a
    1-process plain-torch step on all the data. ZeRO-3 is the engine of multi_node_zero3.yaml (same launcher
    settings: standard = torchrun per node, static rendezvous); DDP the same launch through cpu_ddp.yaml."""
    report, ranks = launch_two_nodes(config, tmp_path)
    # Two nodes of one rank each, both pointed at the main node's address: a real 2-node topology.
    assert [(r["RANK"], r["GROUP_RANK"], r["LOCAL_RANK"]) for r in ranks] == [("0", "0", "0"), ("1", "1", "0")], ranks
    assert all(
        r["WORLD_SIZE"] == "2"
        and r["GROUP_WORLD_SIZE"] == "2"
        and r["LOCAL_WORLD_SIZE"] == "1"
        and r["MASTER_ADDR"] == "127.0.0.1"
        for r in ranks
    ), ranks
    assert report["world"] == 2 and report["deepspeed"] == (config == "cpu_multi_node_zero3.yaml")
    # The nodes held 3 and 7 datums: one ran zero-weight dummy micro-batches (under ZeRO-3 every forward is a
    # collective across the nodes).
    assert report["dummies"] >= 1 and report["micro_batches"] >= 2 and report["clip_frac"] > 0.0
    assert report["update_norm"] > 1e-3
    assert report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))


@pytest.mark.slow
def test_async_rollouts_on_two_nodes_equal_one_process(trainer_runs, tmp_path):
    """Asynchronous rollouts on two "nodes" (two launchers, one DDP rank each): each rank's generation replica runs on
    its own node; 3 steps equal the 1-process run of the same case."""
    import torch

    report, ranks = launch_two_nodes(
        "cpu_ddp.yaml",
        tmp_path,
        "--trainer",
        "--output_dir",
        str(tmp_path / "run"),
        "--per_device",
        "4",
        "--params_out",
        str(tmp_path / "async.pt"),
        *STEP,
        *ASYNC,
    )
    assert [r["GROUP_RANK"] for r in ranks] == ["0", "1"] and all(r["LOCAL_WORLD_SIZE"] == "1" for r in ranks)
    assert report["global_step"] == 3 and [s["train/staleness_max"] for s in report["steps"]] == [0.0, 1.0, 1.0]
    trainer_runs("cpu.yaml", "step-async")
    reference = torch.load(trainer_runs.folder("cpu.yaml") / "step-async.pt")
    params = torch.load(tmp_path / "async.pt")
    diff = sum(float((params[k] - reference[k]).pow(2).sum()) for k in reference) ** 0.5
    scale = sum(float(v.pow(2).sum()) for v in reference.values()) ** 0.5
    assert diff / scale < 1e-6, diff


@pytest.mark.slow
def test_multi_node_zero3_config_launches_two_nodes_of_eight(tmp_path):
    """accelerate_configs/multi_node_zero3.yaml itself, launched as the docs say (the config, --machine_rank,
    --main_process_ip/port) on two "nodes" of this machine with a script that records its environment and
    exits: 16 ranks, 8 per node, node ranks 0/1, one rendezvous address, DeepSpeed ZeRO-3 in bf16 with
    zero3_init handed to every rank. Nothing is trained (no GPU here): the GPU side is untested."""
    _, ranks = launch_two_nodes("multi_node_zero3.yaml", tmp_path, "--topology_only", overrides=(), timeout=120)
    assert [int(r["RANK"]) for r in ranks] == list(range(16)), ranks
    assert [(int(r["GROUP_RANK"]), int(r["LOCAL_RANK"])) for r in ranks] == [(n, i) for n in (0, 1) for i in range(8)]
    port = ranks[0]["MASTER_PORT"]
    assert all(
        r["WORLD_SIZE"] == "16"
        and r["LOCAL_WORLD_SIZE"] == "8"
        and r["GROUP_WORLD_SIZE"] == "2"
        and r["MASTER_ADDR"] == "127.0.0.1"
        and r["MASTER_PORT"] == port
        for r in ranks
    ), ranks
    assert all(
        r["ACCELERATE_USE_DEEPSPEED"] == "true"
        and r["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
        and r["ACCELERATE_MIXED_PRECISION"] == "bf16"
        and r["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
        for r in ranks
    ), ranks[0]


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_ranks_splitting_each_datum_match_one_process(aggregation, update_runs):
    # sequence_parallel_size=2 under ZeRO-3 on 2 ranks: one group, every datum's tokens split over both (sdpa through
    # Ulysses), with the reference KL, the entropy bonus and token-level importance weights, chained over every
    # aggregation mode: the update, the loss, the KL and the entropy are the one-process ones. Each rank forwarded every
    # datum's half: 10 micro-batches each, and the padded area over both ranks is the datums' tokens plus at most one
    # pad per odd-length datum (unsplit, the two ranks together would have forwarded every datum twice).
    launch = update_runs("cpu_zero3.yaml", "sp")
    report = launch["steps"][AGGREGATIONS.index(aggregation)]
    assert report["aggregation"] == aggregation and report["sequence_parallel"] and report["deepspeed"]
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))
    assert report["micro_batches"] == 10 and report["forwarded"] == 10 and report["dummies"] == 0
    assert report["input_tokens"] <= report["padded_tokens"] <= report["input_tokens"] + 10
    assert report["ref_err"] < 1e-5 and report["old_err"] < 1e-5 and report["entropy"] > 0 and report["kl_k3"] > 0


@pytest.mark.slow
def test_split_datums_take_sequence_level_importance_weights_from_the_whole_row(update_runs):
    # sequence_mask: one weight per datum from all its tokens (a shard's half would mask other datums), under
    # activation checkpointing (the backward recomputes each layer, its all-to-alls included), seq_mean_token_mean
    # dividing each row by its whole token count.
    report = update_runs("cpu_zero3.yaml", "sp-sequence-mask")
    assert report["sequence_parallel"] and 0.0 < report["mismatch"]["is_masked_frac"] < 1.0
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sp-groups", "sp-groups-rebalance"])
def test_four_ranks_in_two_sequence_parallel_groups_match_one_process(case, update_runs):
    # Data parallelism over the groups: planned per group (its members' 4 and 6 datums: the first group runs dummies,
    # each counted once) or rebalanced over both; the gradient averaged over all 4 ranks is the one-process one.
    report = update_runs("cpu_zero3.yaml@4", case)
    assert report["world"] == 4 and report["sequence_parallel"] and report["forwarded"] == 10
    assert report["dummies"] == (2 if case == "sp-groups" else 0)
    assert report["update_norm"] > 1e-4 and report["rel_err"] < 1e-5, report
    assert abs(report["loss"] - report["ref_loss"]) < 1e-5 * max(1.0, abs(report["ref_loss"]))


@pytest.mark.slow
def test_a_trainer_step_with_sequence_parallelism_equals_one_process(trainer_runs):
    # The trainer wired end to end (sequence_parallel_size=2 on 2 ZeRO-3 ranks: the update's forwards split, the
    # rollouts, the no-gradient passes and the shared-prefix auto-choice whole on each rank): one step of STEP moves the
    # weights as one process's step-grpo does.
    import torch

    report = trainer_runs("cpu_zero3.yaml", "step-sequence-parallel")
    assert report["steps"][0]["train/update_skipped"] == 0.0
    split = torch.load(trainer_runs.folder("cpu_zero3.yaml") / "step-sequence-parallel.pt")
    trainer_runs("cpu.yaml", "step-grpo")
    whole = torch.load(trainer_runs.folder("cpu.yaml") / "step-grpo.pt")
    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    initial = {k: v.float() for k, v in build_tiny_model(build_tokenizer("qwen2_5")).state_dict().items()}
    update = sum(float((whole[k] - initial[k]).pow(2).sum()) for k in whole if k in initial) ** 0.5
    diff = sum(float((split[k] - whole[k]).pow(2).sum()) for k in whole) ** 0.5
    assert update > 1e-4 and diff / update < 1e-5, (diff, update)
