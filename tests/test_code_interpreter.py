"""The built-in code_interpreter tool over the sandbox: what the model gets back."""

from __future__ import annotations

import pickle

import pytest

from trl_plugins.aio import run_async
from trl_plugins.registry import TOOLS
from trl_plugins.tools.base import Tool, check_arguments


@pytest.fixture(scope="module")
def tool():
    cls = TOOLS.get("code_interpreter")
    t = cls(timeout_s=2.0, mode="warm", max_concurrency=2)
    yield t
    t.close()


def test_registered_and_schema_is_a_function(tool):
    assert isinstance(tool, Tool)
    schema = tool.schema()
    assert schema["function"]["name"] == "code_interpreter"
    assert check_arguments(schema, {"code": "1"}) is None
    assert check_arguments(schema, {}) == "missing required argument 'code'"


def test_success_returns_stdout_and_last_expression(tool):
    out = run_async(tool({"code": "x = 6 * 7\nprint('x is', x)\nx + 1"}))
    assert out.ok and out.text == "x is 42\n43\n"


def test_error_returns_the_traceback_naming_the_model_line(tool):
    out = run_async(tool({"code": "a = 1\nb = a / 0"}))
    assert not out.ok and "ZeroDivisionError" in out.text and "line 2" in out.text


def test_timeout_is_reported_plainly(tool):
    out = run_async(tool({"code": "while True: pass"}))
    assert not out.ok and out.timed_out and "TimeoutError" in out.text


def test_bad_argument_type_is_an_output_not_an_exception(tool):
    out = run_async(tool({"code": 5}))
    assert not out.ok and "must be a string" in out.text


def test_pickles_without_its_running_sandbox(tool):
    run_async(tool({"code": "1"}))
    clone = pickle.loads(pickle.dumps(tool))
    assert clone == tool and clone._sandbox is None


def test_a_sandbox_failure_is_an_infrastructure_error_and_the_model_s_error_is_not():
    from trl_plugins.tools.code_interpreter import CodeInterpreter
    from trl_plugins.tools.sandbox import ExecResult

    class BrokenSandbox:
        async def arun(self, code):
            return ExecResult(
                ok=False,
                stdout="",
                stderr="SandboxError: could not start the server\n",
                exit_code=None,
                timed_out=False,
                latency_s=0.01,
            )

    tool = CodeInterpreter(mode="cold")
    tool._sandbox = BrokenSandbox()
    out = run_async(tool({"code": "print(1)"}))
    assert not out.ok and out.infra_error == "SandboxError: could not start the server"
    assert CodeInterpreter.idempotent  # a fresh sandbox per call: retrying is harmless
    tool._sandbox = None
    out = run_async(tool({"code": "1 / 0"}))
    assert not out.ok and out.infra_error is None and "ZeroDivisionError" in out.text
    tool.close()


def test_start_up_logs_the_isolation_in_force(caplog, tmp_path):
    # Issue 12, hole 7: the run's start-up says how model code will run (the run starts its tools right after
    # building them: the recipe before any model loads, the trainer before TRL's own setup), and fails there
    # when it cannot run it safely.
    import logging

    from trl_plugins.run import resolve_run
    from trl_plugins.tools.sandbox import detect_isolation
    from trl_plugins.trainers import MultiTurnGRPOConfig

    config = MultiTurnGRPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        reward_components=["correct"],
        tool_kwargs={"code_interpreter": {"mode": "cold"}},
    )
    run = resolve_run(config)
    try:
        with caplog.at_level(logging.INFO, logger="trl_plugins.run.build"):
            said = run.start_tools()
            assert run.start_tools() == said  # started once: a second call says the same, logs nothing
    finally:
        run.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "trl_plugins.run.build"]
    assert len(lines) == 1 and said == {"code_interpreter": lines[0].removeprefix("tool 'code_interpreter': ")}
    assert lines[0].startswith(
        f"tool 'code_interpreter': sandbox isolation={detect_isolation().value}, mode=cold, memory 1024 MB per"
    ), lines
