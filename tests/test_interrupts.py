"""SIGINT / SIGTERM stop a run at a safe point with a complete checkpoint; tools and plugins are closed;
metrics are reduced over all ranks by their meaning."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import accelerate_launch, cpu_launch_env, hang_guard_s
from trl_plugins.rollout.metrics import (
    TrajectorySummary,
    quantile,
    reduce_rank_metrics,
    reward_metrics,
    trajectory_metrics,
)
from trl_plugins.trainers.interrupts import StopSignals, TrainingInterrupted, active_stop_event

ROOT = Path(__file__).resolve().parents[1]


# -- signals -----------------------------------------------------------------------------------------


def test_a_signal_only_asks_for_a_stop_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert active_stop_event() is stop.event and not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal: the handler runs, nothing is raised
        time.sleep(0.05)
        assert stop.requested and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # within a second: the same request delivered twice, ignored
        time.sleep(0.05)
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before and active_stop_event() is None
    error = TrainingInterrupted(signal.SIGTERM, 3, "/x/checkpoint-3")
    assert error.exit_code == 143 and "resume with --resume_from_checkpoint /x/checkpoint-3" in str(error)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, sig):
    marker = tmp_path / "closed"
    code = f"""
import os, signal, time
from trl_plugins.trainers.interrupts import StopSignals
try:
    with StopSignals(on_hard_stop=lambda: open({str(marker)!r}, "w").close()) as stop:
        os.kill(os.getpid(), signal.{sig})
        time.sleep(StopSignals.REPEAT_S + 0.2)
        os.kill(os.getpid(), signal.{sig})
        time.sleep(5)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
    raise SystemExit(130)
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == (130 if sig == "SIGINT" else 143) and "not reached" not in proc.stdout, proc.stderr[
        -2000:
    ]
    assert marker.exists()  # the sandboxes are killed first
    # A second Ctrl-C is Python's own KeyboardInterrupt (a notebook kernel survives it); SIGTERM exits.
    assert ("KeyboardInterrupt" in proc.stdout) == (sig == "SIGINT")


# -- the rollout cancels tool calls in flight ------------------------------------------------------------


def test_a_stop_request_cancels_the_tool_calls_in_flight():
    from support.rollout import SCHEMA, scripted
    from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutCancelled, RolloutRequest, questions_from_rows
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.tools.base import ToolOutput

    chat = ChatFormat(build_tokenizer("qwen2_5"), [SCHEMA])
    stop = threading.Event()
    cancelled = []

    class SlowTool:
        name = "code_interpreter"

        def schema(self):
            return SCHEMA

        async def __call__(self, arguments):
            stop.set()  # the signal arrives while the calls run
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            return ToolOutput(text="1", ok=True)

    request = RolloutRequest(
        questions_from_rows(chat, [{"prompt": "calls=1"}, {"prompt": "calls=1"}]),
        2,
        scripted(chat),
        chat,
        {"code_interpreter": SlowTool()},
        stop=stop,
    )
    start = time.perf_counter()
    with pytest.raises(RolloutCancelled) as info:
        MultiTurnRollout()(request)
    assert time.perf_counter() - start < 5 and len(cancelled) == 4
    result = info.value.rollout_result
    assert [t.stop_reason.value for t in result.trajectories] == ["cancelled"] * 4


# -- plugins are closed ---------------------------------------------------------------------------------


def test_run_plugins_close_every_plugin_even_when_one_fails(tmp_path):
    from support.trainer import tiny_config
    from trl_plugins.protocols import as_advantage, as_policy_loss, as_reward, as_rollout, as_tool
    from trl_plugins.run import Run, RunSpec, SamplerKind

    closed = []

    class Sync:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError(f"{self.name} could not close")

    class Async:
        name = "async"

        async def close(self):
            await asyncio.sleep(0)
            closed.append("async")

    class Declared(Sync):
        token_budget = None
        needs_values = needs_groups = needs_ref_logprobs = needs_entropy = False

        def __call__(self, *args):
            return 0.0

    class Inert(Declared):
        close = None  # nothing to close

    shared = Declared("shared")
    config = tiny_config(tmp_path)  # a real config: the run builds its settings (the critic's) from it
    plugins = Run(
        RunSpec(config),
        rollout=as_rollout(Declared("rollout", fail=True)),
        tools={"a": as_tool(shared), "b": as_tool(Async())},
        rewards=[as_reward(shared, "r"), as_reward(Inert("s"), "s")],
        advantage=as_advantage(Inert("adv")),
        policy_loss=as_policy_loss(Declared("loss")),
        sampler=SamplerKind.HF_GENERATE,
    )
    with pytest.raises(OSError, match="rollout could not close"):
        plugins.close()
    assert sorted(closed) == ["async", "loss", "rollout", "shared"]  # each once, all of them


def test_the_code_interpreter_is_a_context_manager_that_closes_its_sandbox():
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    with CodeInterpreter(mode="cold") as tool:
        out = asyncio.run(tool({"code": "print(6 * 7)"}))
        assert out.text.strip() == "42" and tool._sandbox is not None
    assert tool._sandbox is None


# -- metrics over ranks ---------------------------------------------------------------------------------


def _summary(rank, group, stop, tokens, reward, world_failure=False, advantage=0.0):
    return TrajectorySummary(
        group=(rank, group),
        turns=1,
        tool_calls=0,
        stop_reason=stop,
        terminated=stop == "final_answer",
        truncated=stop == "turn_length",
        world_failure=world_failure,
        tool_errors=0,
        outputs_truncated=0,
        tokens=tokens,
        action_tokens=tokens // 2,
        calls_by_tool=(),
        reward=reward,
        components=(("correct", reward),) if not world_failure else (),
        advantage=advantage,
        masked=False,
    )


def test_trajectory_metrics_are_over_the_union_not_a_mean_of_rank_means():
    rank0 = [_summary(0, 0, "final_answer", 100, 1.0), _summary(0, 0, "final_answer", 110, 0.0)]
    rank1 = [
        _summary(1, 0, "turn_length", 900, 0.0),
        _summary(1, 0, "final_answer", 300, 1.0),
        _summary(1, 1, "environment_error", 50, 0.0, world_failure=True),
        _summary(1, 1, "final_answer", 400, 1.0),
    ]
    union = trajectory_metrics(rank0 + rank1) | reward_metrics(rank0 + rank1, ["correct"])
    assert union["rollout/stop/final_answer"] == 4 / 6 and union["rollout/trajectories"] == 6
    assert union["rollout/trajectory_tokens_p50"] == quantile([100, 110, 900, 300, 50, 400], 0.5) == 205
    assert union["reward/total"] == 3 / 5  # the world failure is not scored
    assert union["train/world_failure_frac"] == 1 / 6
    # Negative control: the old way (each rank's own metrics, then the mean) gives other numbers.
    per_rank = [trajectory_metrics(r) | reward_metrics(r, ["correct"]) for r in (rank0, rank1)]
    old = reduce_rank_metrics(per_rank)
    for key in ("rollout/stop/final_answer", "rollout/trajectory_tokens_p50", "reward/total"):
        assert abs(old[key] - union[key]) > 1e-6, key


def test_rank_metrics_are_reduced_by_their_meaning():
    out = reduce_rank_metrics(
        [
            {
                "timing/step_s": 1.0,
                "timing/rollout_s": 0.5,
                "train/datums": 3,
                "rollout/generate_calls": 2,
                "sandbox/calls": 4,
            },
            {"timing/step_s": 3.0, "timing/rollout_s": 2.5, "train/datums": 5, "rollout/generate_calls": 4},
        ]
    )
    assert out["timing/step_s"] == 3.0 and out["timing/rollout_s"] == 2.5  # the step waits for the slowest
    assert out["train/datums"] == 8 and out["rollout/generate_calls"] == 4
    assert out["sandbox/calls"] == 4  # plugin metrics: the mean over the ranks that reported them
    assert out["ranks/step_s/0"] == 1.0 and out["ranks/step_s/1"] == 3.0 and out["ranks/datums/1"] == 5
    assert out["ranks/step_s_imbalance"] == pytest.approx(1.5)
    assert "ranks/step_s/0" not in reduce_rank_metrics([{"timing/step_s": 1.0}])


# -- real runs: signals to the launcher -----------------------------------------------------------------
# (The logged metrics of real runs on two ranks are checked in tests/test_distributed.py, on the flaky run of its
# DDP and ZeRO-3 launches: a launch of their own cost each some 15 s of imports per rank.)


def _launch(config: str, out: Path, *extra: str) -> subprocess.Popen:
    cmd = accelerate_launch(config, ROOT / "tests" / "dist_trainer_run.py", "--out", str(out / "report.json"), *extra)
    env = cpu_launch_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _params(path: Path):
    import torch

    return torch.load(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,when",
    [("cpu.yaml", "rollout"), ("cpu_ddp.yaml", "rollout"), ("cpu_ddp.yaml", "update")],
    ids=["1-process-mid-rollout", "ddp-mid-rollout", "ddp-mid-update"],
)
def test_sigterm_to_the_launcher_stops_at_a_safe_point_and_resume_reproduces_the_run(config, when, tmp_path):
    markers = tmp_path / "markers"
    extra = ["--slow_tool", "--max_steps", "3", "--markers", str(markers)] + (
        ["--slow_update", "3"] if when == "update" else []
    )
    proc = _launch(config, tmp_path / "a", "--output_dir", str(tmp_path / "a"), *extra)
    try:
        deadline = time.monotonic() + hang_guard_s(240)
        while not (markers / f"{when}-step2-rank0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 2"
            time.sleep(0.1)
        time.sleep(0.5)  # sandbox calls (1 s each) or the slowed update are in flight
        pids = _descendants(proc.pid)
        assert len(pids) > (2 if config == "cpu_ddp.yaml" else 1), "no sandbox processes were running"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=hang_guard_s(120))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    step = 1 if when == "rollout" else 2  # mid-rollout: the last finished step; mid-update: the step finishes
    checkpoint = tmp_path / "a" / f"checkpoint-{step}"
    assert f"resume with --resume_from_checkpoint {checkpoint}" in output, output[-3000:]
    assert json.loads((checkpoint / "checkpoint_complete.json").read_text())["global_step"] == step
    assert not list((tmp_path / "a").glob(f"checkpoint-{step + 1}"))
    time.sleep(1.0)
    assert _alive(pids) == [], "processes of the run outlived it"
    if when != "rollout" or config != "cpu_ddp.yaml":
        return
    # Resuming from the emergency checkpoint gives the parameters of the uninterrupted run: both runs are cases of one
    # launch (tests/dist_trainer_run.py --cases), one after the other (a launch costs some 10-15 s of imports per rank).
    cases = [
        [
            "--out",
            str(tmp_path / name / "report.json"),
            "--output_dir",
            str(tmp_path / name),
            "--slow_tool",
            "--max_steps",
            "3",
            *resume,
            "--params_out",
            str(tmp_path / f"{name}.pt"),
        ]
        for name, resume in (("straight", []), ("resumed", ["--resume", str(checkpoint)]))
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    both = subprocess.run(
        accelerate_launch(config, ROOT / "tests" / "dist_trainer_run.py", "--cases", str(tmp_path / "cases.json")),
        cwd=ROOT,
        env=cpu_launch_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
        capture_output=True,
        text=True,
        timeout=hang_guard_s(300),
    )
    errors = [e.read_text() for e in tmp_path.glob("*/report.json.error.rank*")]
    assert both.returncode == 0 and not errors, (errors, both.stdout[-3000:] + both.stderr[-3000:])
    a, b = _params(tmp_path / "straight.pt"), _params(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() < 1e-6, name


def test_plugins_declare_how_their_step_metrics_combine_over_ranks():
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    declared = CodeInterpreter().step_metric_reductions()
    out = reduce_rank_metrics(
        [
            {"sandbox/calls": 3, "sandbox/latency_max_s": 0.5, "sandbox/latency_p50_s": 0.1},
            {"sandbox/calls": 5, "sandbox/latency_max_s": 2.0, "sandbox/latency_p50_s": 0.3},
        ],
        declared,
    )
    assert out["sandbox/calls"] == 8 and out["sandbox/latency_max_s"] == 2.0
    assert out["sandbox/latency_p50_s"] == pytest.approx(0.2)
    from dataclasses import replace

    union = trajectory_metrics(
        [
            replace(_summary(0, 0, "final_answer", 10, 1.0), tool_latencies=(0.1, 0.2)),
            replace(_summary(1, 0, "final_answer", 10, 1.0), tool_latencies=(0.4,)),
        ]
    )
    assert union["rollout/tool_latency_p50_s"] == pytest.approx(0.2) and union["rollout/tool_latency_max_s"] == 0.4
