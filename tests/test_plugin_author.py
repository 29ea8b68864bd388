"""A plugin author's day (issue 33): every seam refuses a bad setting the same way (one line, before any model loads,
naming the setting, where its value came from, what is accepted and the nearest name); plugin kwargs stay with the
plugin they were written for; each plugin's cheap contract check runs at start-up; tool failures are logged once per
kind; a stopped run still leaves its record; advantage and loss plugins report metrics; summary.json says which
package and version each plugin came from and every keyword in force."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import pickle
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

import pytest
import torch

from conftest import tiny_recipe_inputs
from support.recipes import recipe_module
from support.run import counting_config
from trl_plugins.algos.advantages import GroupAdvantage
from trl_plugins.algos.losses import PPOClipLoss
from trl_plugins.tools.base import ToolOutput

# -- plugins the tests below configure by import path ------------------------------------------------------


class PlainLoss:
    """A third-party loss that takes none of ppo_clip's settings."""

    needs_ref_logprobs = False
    needs_entropy = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __eq__(self, other: object) -> bool:
        return type(other) is PlainLoss and other.scale == self.scale

    def __call__(self, inp):
        1 / self.scale
        return PPOClipLoss()(inp)


class NaNReward:
    def __call__(self, trajectory, example) -> float:
        return float("nan")


class MisnamedTool:
    """Named ``echo``, but its schema tells the model to call ``shout``."""

    name = "echo"

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "shout",
                "description": "Echo.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            },
        }

    async def __call__(self, arguments: dict) -> ToolOutput:
        return ToolOutput(text="", ok=True)


@dataclass
class MeteredAdvantage(GroupAdvantage):
    """Group advantages that report how many batches and trajectories they saw since the last step."""

    def __post_init__(self) -> None:
        self.seen = 0

    def __call__(self, inp):
        self.seen += len(inp.rewards)
        return super().__call__(inp)

    def step_metrics(self) -> dict:
        seen, self.seen = self.seen, 0
        return {"trajectories": seen}

    def step_metric_reductions(self) -> dict:
        return {"trajectories": "sum"}


@dataclass
class MeteredLoss(PPOClipLoss):
    """PPO that counts the micro-batches it scored (a loss runs once per micro-batch: it accumulates)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.calls = 0

    def __call__(self, inp):
        self.calls += 1
        return super().__call__(inp)

    def step_metrics(self) -> dict:
        calls, self.calls = self.calls, 0
        return {"micro_batches": calls}


class BadMetricsLoss(PPOClipLoss):
    def step_metrics(self) -> dict:
        return {"ratio": "high"}


# -- one error style for every seam and every setting -----------------------------------------------------------

REFUSED = [
    # (argv, what the one line says); values the config's own fields refuse stop parse_args, plugin settings main().
    (
        ["--advantage", "grop"],
        r"advantage \(from the command line\): unknown advantages plugin 'grop'\. Did you mean 'group'\?",
    ),
    (
        ["--advantage_kwargs", '{"scale_by_sd": false}'],
        r"advantage_kwargs \(from the command line\): advantages plugin 'group' takes no 'scale_by_sd'; it accepts "
        r"\['scale_by_std', 'eps'\]\. Did you mean 'scale_by_std'\?",
    ),
    (
        ["--advantage_kwargs", '{"scale_by_std": "false"}'],
        r"advantage_kwargs\['scale_by_std'\] \(from the command line\): advantages plugin 'group' takes a bool \(true or "
        r"false, unquoted\), got 'false' \(str\) \(quoted: write it without quotes\)",
    ),
    (
        ["--rollout_kwargs", '{"max_turns": "4"}'],
        r"rollout_kwargs\['max_turns'\] \(from the command line\): rollouts plugin "
        r"'multi_turn' takes an integer, got '4' \(str\)",
    ),
    (
        ["--policy_loss_kwargs", '{"dual_clip": 1.1}'],
        r"policy_loss_kwargs \(from the command line\): policy_losses plugin 'ppo_clip' refused \{'dual_clip': 1\.1\}: "
        r"ppo_clip: dual_clip=1\.1 must be above 1 \+ clip_high = 1\.28",
    ),
    (
        ["--policy_loss", "ppo_clp"],
        r"policy_loss: unknown policy_losses plugin 'ppo_clp'\. Did you mean 'ppo_clip'\?.*"
        r"\[set by: policy_loss in the command line\]",
    ),
    (
        ["--tool_kwargs", '{"code_interpeter": {"timeout_s": 3}}'],
        r"tool_kwargs \(from the command line\): has settings for 'code_interpeter', which is not among tools "
        r"\['code_interpreter'\]; they would be used by nothing\. Did you mean 'code_interpreter'\?",
    ),
    (
        ["--reward_component_kwargs", '{"corect": {}}'],
        r"reward_component_kwargs \(from the command line\): has settings for 'corect', which is not among "
        r"reward_components \['correct', 'format'\].*Did you mean 'correct'\?",
    ),
    (
        ["--reward_component_weights", "1", "2", "3"],
        r"2 reward_components but 3 reward_component_weights; give one weight per component\. \[set by: "
        r"reward_component_weights in the command line; reward_components in the task 'arithmetic'\]",
    ),
    (["--max_steps", "0"], r"max_steps: 0 steps would train none.*\[set by: max_steps in the command line\]"),
    (
        ["--skip_startup_checks", "corect"],
        r"skip_startup_checks: 'corect' is no plugin this run checks at start-up; it "
        r"checks \['correct', 'format', 'group', 'ppo_clip'\] \(or 'all'\)\. Did you mean 'correct'\?",
    ),
]


@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(a)[:40] for a, _ in REFUSED])
def test_every_seam_refuses_a_bad_setting_in_one_line_before_any_model(
    tmp_path, argv, message, no_model_no_eval, capsys
):
    retool_ppo = recipe_module()
    argv = argv + ["--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    with pytest.raises(SystemExit) as refused:
        retool_ppo.main(*retool_ppo.parse_args(argv))
    said = str(refused.value)
    assert said.startswith("configuration error (before any model loads): ")
    assert "\n" not in said  # one line, no traceback
    import re

    assert re.search(message, said), said
    assert no_model_no_eval == []
    assert not (tmp_path / "out").exists()  # refused before the output folder was claimed


def test_kwargs_are_checked_against_the_plugins_annotations():
    from trl_plugins.run.plugins import SettingError, check_kwargs, fits

    class Colour(enum.Enum):
        RED = "red"

    # YAML/JSON values against annotations; None: an annotation the check does not judge (never refused).
    cases = [
        (True, bool, True),
        ("false", bool, False),
        (1, bool, False),
        (3, int, True),
        (True, int, False),
        ("3", int, False),
        (1, float, True),
        (0.5, float, True),
        ("0.5", float, False),
        (None, float | None, True),
        ("x", float | None, False),
        ("a", str, True),
        (3, str, False),
        ("red", Colour, True),
        ("blue", Colour, False),
        ("k2", Literal["k1", "k2"], True),
        ("k4", Literal["k1", "k2"], False),
        ([1], list[int], True),
        ({"a": 1}, list, False),
        ({"a": 1}, dict[str, int], True),
        (object(), torch.Tensor, None),
    ]
    for value, tp, expected in cases:
        assert fits(value, tp) is expected, (value, tp)

    @dataclass
    class Plugin:
        flag: bool = True
        rate: float = 0.1
        anything: object = None

    check_kwargs(Plugin, {"flag": False, "rate": 1, "anything": "x"}, "advantage_kwargs", "p")  # all fit
    with pytest.raises(SettingError, match=r"advantage_kwargs\['rate'\]: p takes a number, got '0.2' \(str\) \(quoted"):
        check_kwargs(Plugin, {"rate": "0.2"}, "advantage_kwargs", "p")
    with pytest.raises(
        SettingError, match=r"p takes no 'fleg'; it accepts \['flag', 'rate', 'anything'\]\. Did you mean 'flag'\?"
    ):
        check_kwargs(Plugin, {"fleg": True}, "advantage_kwargs", "p")

    def takes_anything(**kwargs):
        return kwargs

    check_kwargs(takes_anything, {"whatever": "x"}, "advantage_kwargs", "p")  # **kwargs: nothing to check against


# -- kwargs stay with the plugin they were written for -----------------------------------------------------------


def test_a_changed_plugin_drops_the_kwargs_a_lower_layer_wrote_for_another(tmp_path):
    from retool.config import parse_args
    from retool.startup import format_banner
    from trl_plugins.run import resolve_run

    base = ["--output_dir", str(tmp_path / "o"), "--report_to", "none"]
    # The recipe's YAML gives ppo_clip's clip settings; --policy_loss alone picks a loss that takes none of them.
    script_args, args = parse_args(["--policy_loss", "test_plugin_author:PlainLoss"] + base)
    assert args.policy_loss_kwargs == {}
    (note,) = script_args.dropped_kwargs
    assert note.startswith(
        'policy_loss_kwargs {"clip_high": 0.28, "clip_low": 0.2} from retool_ppo.yaml were written for '
        "policy_loss 'ppo_clip'; the command line chose 'test_plugin_author:PlainLoss', so they are dropped"
    )
    assert script_args.provenance["policy_loss_kwargs"] == "retool_ppo.yaml, less what was written for other plugins"
    run = resolve_run(args, provenance=script_args.provenance)  # before: "rejected its settings {'clip_low': 0.2, ...}"
    banner = format_banner(script_args, run, world_size=1, device="cpu", distributed="single process")
    assert f"note:         {note}" in banner
    run.close()
    # Kwargs given beside the plugin are its own; a higher layer that keeps the plugin keeps the lower kwargs.
    _, args = parse_args(
        ["--policy_loss", "test_plugin_author:PlainLoss", "--policy_loss_kwargs", '{"scale": 2}'] + base
    )
    assert args.policy_loss_kwargs == {"scale": 2}
    same = tmp_path / "same.yaml"
    same.write_text("policy_loss: ppo_clip\n")
    script_args, args = parse_args(["--config", str(same)] + base)
    assert args.policy_loss_kwargs == {"clip_low": 0.2, "clip_high": 0.28} and script_args.dropped_kwargs == []
    # A file that changes the plugin drops them too, and says which file did.
    other = tmp_path / "other.yaml"
    other.write_text("policy_loss: test_plugin_author:PlainLoss\n")
    script_args, args = parse_args(["--config", str(other)] + base)
    assert (
        args.policy_loss_kwargs == {}
        and "other.yaml chose 'test_plugin_author:PlainLoss'" in script_args.dropped_kwargs[0]
    )
    # Per-name kwargs: only the entries of names a higher layer took out of the list go.
    script_args, args = parse_args(["--tools", "support.run:CountingTool"] + base)
    assert args.tool_kwargs == {}
    assert script_args.dropped_kwargs == [
        "tool_kwargs for ['code_interpreter'] from retool_ppo.yaml dropped: the command "
        "line set tools ['support.run:CountingTool'] without them"
    ]
    _, args = parse_args(["--tools", "code_interpreter", "support.run:CountingTool"] + base)
    assert set(args.tool_kwargs) == {"code_interpreter"}


# -- tools: schema against name, prompt against schema ------------------------------------------------------------


def test_a_tool_whose_schema_names_another_tool_is_refused_when_the_run_is_built(tmp_path):
    from trl_plugins.run import resolve_run
    from trl_plugins.run.plugins import SettingError

    with pytest.raises(
        SettingError,
        match=r"tools: tool 'echo': schema\(\)\['function'\]\['name'\] is 'shout', but the "
        r"tool's name is 'echo'\. The model calls a tool by the name its schema shows.*"
        r"make the two the same\.$",
    ):
        resolve_run(counting_config(tmp_path, tools=["test_plugin_author:MisnamedTool"]))
    resolve_run(counting_config(tmp_path)).close()  # negative control: test_run's echo tool names itself in its schema


def test_the_prompt_check_matches_whole_names_and_the_schemas_arguments(tmp_path):
    from retool.startup import format_banner
    from support.run import CountingTool
    from trl_plugins.protocols import as_tool
    from trl_plugins.run import resolve_run
    from trl_plugins.run.checks import prompt_warnings

    tools = {"echo": as_tool(CountingTool())}
    assert prompt_warnings("Use the echo tool.", tools) == []
    assert prompt_warnings('Call echo as {"name": "echo", "arguments": {"text": "hi"}}.', tools) == []
    (missing,) = prompt_warnings("Use the echo_v2 tool.", tools)  # a longer name is not this tool's
    assert missing.startswith("system_prompt does not mention the tool 'echo'")
    (wrong,) = prompt_warnings('Call echo as {"name": "echo", "arguments": {"message": "hi", "loud": true}}.', tools)
    assert wrong.startswith(
        "system_prompt shows argument(s) ['loud', 'message'] that no tool's schema has (echo takes ['text'])"
    )
    # A tool configured by import path is checked by the name the model calls it: no false warning.
    run = resolve_run(
        counting_config(tmp_path)
    )  # tools=["support.run:CountingTool"], system_prompt="You may use the echo tool."
    script_args = _script_args()
    banner = format_banner(script_args, run, world_size=1, device="cpu", distributed="single process")
    assert "warning" not in banner and "tool:         support.run:CountingTool {} (the model calls it 'echo')" in banner
    run.close()
    run = resolve_run(counting_config(tmp_path, system_prompt="Answer."))
    assert "warning:      system_prompt does not mention the tool 'echo'" in format_banner(
        script_args, run, world_size=1, device="cpu", distributed="single process"
    )
    run.close()


def _script_args():
    from retool.config import ScriptArguments

    return ScriptArguments()


# -- tool failures: once per kind ---------------------------------------------------------------------------------


class Raising:
    name = "raiser"
    idempotent = True

    def __init__(self, exc: type[Exception] = ValueError) -> None:
        self.exc = exc

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": "raiser", "description": "Fails.", "parameters": {"type": "object", "properties": {}}},
        }

    async def __call__(self, arguments: dict) -> ToolOutput:
        raise self.exc("boom")


def test_a_tool_that_fails_every_call_logs_one_traceback_per_kind_and_counts(caplog):
    from trl_plugins.protocols import as_tool
    from trl_plugins.rollout import MultiTurnRollout
    from trl_plugins.rollout.dispatch import ToolFailures
    from trl_plugins.rollout.engine import call_tool

    failures = ToolFailures()
    caplog.set_level(logging.DEBUG, logger="trl_plugins.rollout.engine")
    for _ in range(5):
        out = asyncio.run(call_tool(as_tool(Raising()), {}, retries=1, failures=failures))
        assert out.infra_error == "ValueError: boom"  # each call still fails as before: one retry, then an env error
    asyncio.run(call_tool(as_tool(Raising(KeyError)), {}, retries=0, failures=failures))
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert [(r.levelno, r.exc_info[0]) for r in with_traceback if r.levelno == logging.WARNING] == [
        (logging.WARNING, ValueError),
        (logging.WARNING, KeyError),
    ]  # the first of each kind, with its traceback
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 9  # the other ValueErrors, at debug level
    caplog.clear()
    failures.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "tool failures in this rollout: 'raiser' KeyError x 1; 'raiser' ValueError x 10"
    ]
    caplog.clear()
    failures.flush()
    asyncio.run(call_tool(as_tool(Raising()), {}, retries=0, failures=failures))
    assert all(r.levelno == logging.DEBUG for r in caplog.records)  # a known kind stays quiet in the next rollout
    # The rollout that keeps the log still equals its pickled copy (plugins travel to child processes).
    rollout = MultiTurnRollout()
    rollout._failures.record("raiser", "ValueError: boom", attempt=1, attempts=1)
    assert pickle.loads(pickle.dumps(rollout)) == rollout


def test_run_async_does_not_chain_a_coroutines_error_to_the_event_loop_check():
    from trl_plugins.aio import run_async

    async def fails():
        raise ValueError("the tool's own error")

    with pytest.raises(ValueError) as raised:
        run_async(fails())
    assert raised.value.__context__ is None  # was: "During handling ... RuntimeError: no running event loop"


# -- start-up contract checks --------------------------------------------------------------------------------------


def test_a_reward_returning_nan_is_refused_at_start_up_unless_its_check_is_switched_off(tmp_path, no_model_no_eval):
    retool_ppo = recipe_module()
    argv = [
        "--reward_components",
        "correct",
        "test_plugin_author:NaNReward",
        "--output_dir",
        str(tmp_path / "o"),
        "--report_to",
        "none",
        "--eval_problems",
        "0",
    ]
    with pytest.raises(
        SystemExit,
        match=r"before any model loads\): reward component 'test_plugin_author:NaNReward': failed "
        r"its start-up contract check: .*returned nan; a reward must be finite.*pass "
        r"--skip_startup_checks test_plugin_author:NaNReward",
    ):
        retool_ppo.main(*retool_ppo.parse_args(argv))
    assert no_model_no_eval == []
    # Switched off (an expensive judge would be): the run goes on to the model (which this test refuses to build).
    script_args, args = retool_ppo.parse_args(argv + ["--skip_startup_checks", "test_plugin_author:NaNReward"])
    with pytest.raises(AssertionError, match="embedded default build was reached"):
        retool_ppo.main(script_args, args)
    assert no_model_no_eval == ["embedded default build"]


def test_start_up_checks_run_on_copies_and_say_what_they_skipped(tmp_path):
    from retool.startup import format_banner
    from trl_plugins.run import resolve_run
    from trl_plugins.run.checks import startup_checks
    from trl_plugins.run.plugins import SettingError

    run = resolve_run(
        counting_config(
            tmp_path, advantage="test_plugin_author:MeteredAdvantage", policy_loss="test_plugin_author:MeteredLoss"
        )
    )
    lines = startup_checks(run, {"prompt": "What is 1 + 1?", "answer": "2"})
    assert lines[0].startswith("passed their contract checks (") and lines[0].endswith(
        "support.run:CountingReward, test_plugin_author:MeteredAdvantage, test_plugin_author:MeteredLoss"
    )
    assert run.advantage.impl.seen == 0 and run.policy_loss.impl.calls == 0  # the checks called copies
    run.close()
    run = resolve_run(counting_config(tmp_path, skip_startup_checks=["support.run:CountingReward"]))
    lines = startup_checks(run)
    assert lines[-1] == "not checked (skip_startup_checks): support.run:CountingReward"
    assert (
        "checks:       each reward, the advantage and the policy loss run their contract check on a copy before any "
        "model loads; skipped (skip_startup_checks): support.run:CountingReward"
        in format_banner(_script_args(), run, world_size=1, device="cpu", distributed="single process")
    )
    run.close()
    run = resolve_run(counting_config(tmp_path, skip_startup_checks=["all"]))
    assert startup_checks(run) == [
        "not checked (skip_startup_checks): support.run:CountingReward, support.run:CountingAdvantage, support.run:CountingLoss"
    ]
    run.close()
    # A loss that breaks its contract is named, with what it broke and how to skip the check.
    run = resolve_run(counting_config(tmp_path, policy_loss="test_plugin_author:LeakyLoss"))
    with pytest.raises(
        SettingError,
        match=r"policy_loss 'test_plugin_author:LeakyLoss': failed its start-up contract "
        r"check: .*non-zero loss off the action mask",
    ):
        startup_checks(run)
    run.close()
    # One that raises in its check is named too, with its own error.
    run = resolve_run(counting_config(tmp_path, policy_loss="test_plugin_author:PlainLoss"))
    with pytest.raises(
        SettingError,
        match=r"policy_loss 'test_plugin_author:PlainLoss': raised ZeroDivisionError: "
        r"float division by zero in its start-up contract check",
    ):
        run.policy_loss.impl.scale = 0.0  # the copy the check makes carries it
        startup_checks(run)
    run.close()


class LeakyLoss:
    """A loss that forgets the action mask."""

    needs_ref_logprobs = False
    needs_entropy = False

    def __eq__(self, other: object) -> bool:
        return type(other) is LeakyLoss

    def __call__(self, inp):
        from dataclasses import replace

        return replace(PPOClipLoss()(inp), per_token_loss=-inp.logprobs)


# -- metrics from advantage and loss plugins; per-tool call counts -------------------------------------------------------


def test_advantage_and_loss_plugins_report_step_metrics(tmp_path):
    from datasets import Dataset

    from trl_plugins.protocols import PluginDeclarationError, as_policy_loss
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    run = resolve_run(
        counting_config(
            tmp_path,
            advantage="test_plugin_author:MeteredAdvantage",
            policy_loss="test_plugin_author:MeteredLoss",
            max_steps=2,
        )
    )
    assert run.advantage.metric_reductions() == {"advantage/trajectories": "sum"}
    tok = build_tokenizer("qwen2_5")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok), train_dataset=Dataset.from_list(rows), processing_class=tok, run=run
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "advantage/trajectories" in r]
    assert [r["advantage/trajectories"] for r in steps] == [4.0, 4.0]  # one estimate of 4 trajectories per step
    assert all(r["policy_loss/micro_batches"] == r["train/micro_batches"] for r in steps)
    assert all(r["rollout/tool_calls_mean/echo"] == r["rollout/tool_calls_mean"] for r in steps)  # the only tool
    run.close()
    # What a plugin reports is checked at the seam, naming it.
    with pytest.raises(
        PluginDeclarationError, match=r"policy_loss 'bad'.*step_metrics\(\) returned \{'ratio': 'high'\}"
    ):
        as_policy_loss(BadMetricsLoss(), "bad").step_metrics()


def test_per_tool_call_counts_count_every_configured_tool():
    from dataclasses import replace

    from trl_plugins.rollout.metrics import TrajectorySummary, trajectory_metrics

    base = TrajectorySummary(
        group=(0, 0),
        turns=2,
        tool_calls=0,
        stop_reason="final_answer",
        terminated=True,
        truncated=False,
        world_failure=False,
        tool_errors=0,
        outputs_truncated=0,
        tokens=10,
        action_tokens=5,
        calls_by_tool=(),
        reward=0.0,
        components=(),
        advantage=0.0,
        masked=False,
    )
    summaries = [
        replace(base, tool_calls=3, calls_by_tool=(("calc", 2, 0), ("search", 1, 1))),
        replace(base, tool_calls=1, calls_by_tool=(("calc", 1, 0),)),
    ]
    m = trajectory_metrics(summaries, tools=["calc", "search", "unit_converter"])
    assert (m["rollout/tool_calls_mean/calc"], m["rollout/tool_calls_mean/search"]) == (1.5, 0.5)
    assert m["rollout/tool_calls_mean/unit_converter"] == 0.0  # configured, never called
    assert m["rollout/environment_error_rate/search"] == 1.0


# -- summary.json: package, version, every keyword in force ---------------------------------------------------------


def test_the_record_names_each_plugins_package_version_and_resolved_kwargs(tmp_path):
    from retool.config import parse_args
    from retool.record import run_record
    from trl_plugins.run import resolve_run

    script_args, args = parse_args(
        ["--output_dir", str(tmp_path / "o"), "--report_to", "none", "--policy_loss", "test_plugin_author:PlainLoss"]
    )
    run = resolve_run(args, provenance=script_args.provenance)
    plugins = json.loads(json.dumps(run_record(script_args, args, run)))["plugins"]
    ours = metadata.version("trl-plugins")
    assert plugins["advantage"] == {
        "name": "group",
        "object": "trl_plugins.algos.advantages:GroupAdvantage",
        "package": "trl-plugins",
        "version": ours,
        "kwargs": {"scale_by_std": True, "eps": 1e-6},
    }  # the defaults, never given
    tool = plugins["tools"][0]
    assert tool["kwargs"]["timeout_s"] == 5.0 and tool["kwargs"]["isolation"] == "auto"  # given, and defaulted
    assert plugins["policy_loss"]["package"] is None  # a module no installed distribution provides
    assert plugins["policy_loss"]["object"] == "test_plugin_author:PlainLoss" and plugins["policy_loss"]["kwargs"] == {
        "scale": 1.0
    }
    assert plugins["dropped_kwargs"] == script_args.dropped_kwargs and len(plugins["dropped_kwargs"]) == 1
    run.close()


# -- a run that stops still leaves its record -------------------------------------------------------------------------


class BreaksAtStepTwo:
    """A verifier that works for the first step's four trajectories, then fails on every one."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, trajectory, example) -> float:
        self.calls += 1
        if self.calls > 4:
            raise ConnectionError("the judge went away")
        return 1.0


@pytest.mark.slow
def test_a_run_that_stops_still_writes_its_metrics_and_summary(tmp_path, monkeypatch):
    retool_ppo = recipe_module()
    model_dir, data = tiny_recipe_inputs(tmp_path)
    out = tmp_path / "out"
    argv = [
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "2",
        "--eval_problems",
        "0",
        "--held_out_fraction",
        "0",
        "--save_strategy",
        "no",
        "--reward_components",
        "test_plugin_author:BreaksAtStepTwo",
        "--skip_startup_checks",
        "test_plugin_author:BreaksAtStepTwo",
        "--rollout_kwargs",
        '{"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 1024}',
        "--max_padded_tokens_per_micro_batch",
        "8000",
    ]
    with pytest.raises(RuntimeError, match="max_verifier_error_rate"):
        retool_ppo.main(*retool_ppo.parse_args(argv))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/total"] for r in records if "reward/total" in r] == [1.0]  # the step that ran
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["at_step"] == 1 and "RuntimeError" in summary["stopped"]["why"]
    assert "max_verifier_error_rate" in summary["stopped"]["why"] and summary["steps"] == 1
    assert summary["plugins"]["reward_components"][0]["object"] == "test_plugin_author:BreaksAtStepTwo"
    assert (out / "retool_ppo.png").is_file()
