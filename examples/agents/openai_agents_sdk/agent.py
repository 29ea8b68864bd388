"""The ReTool agent written with the OpenAI Agents SDK (``openai-agents``) as its quick start teaches: an ``Agent``
with instructions and a ``@function_tool``, run by ``Runner.run`` (``solve``) or ``Runner.run_streamed``
(``solve_streamed``). The SDK's default model is the Responses API (``POST /responses``), which the endpoint serves.

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/openai_agents_sdk/retool_agent.yaml

Nothing in the agent knows about training: the endpoint hands ``solve`` an ``openai.AsyncOpenAI`` client, and the
agent gives it to the SDK's own provider (``OpenAIProvider(openai_client=...)`` in the run's ``RunConfig``: no global
default client is touched). Not ``OpenAIProvider(base_url=..., api_key=...)``: the provider then makes its client on
one HTTP pool shared by the whole process, bound to the first event loop that used it, and the endpoint runs each
rollout's agents on a loop of their own, so every request of the second rollout failed ("Event loop is closed").

The SDK sends traces of every run to OpenAI's servers by default. This file sets ``OPENAI_AGENTS_DISABLE_TRACING=1``
(read once, on the SDK's first trace) and passes ``tracing_disabled=True``: a training run would otherwise try to
upload a trace per trajectory.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # before the SDK's first trace: no uploads to OpenAI

import openai  # noqa: E402
from agents import Agent, RunConfig, Runner, function_tool  # noqa: E402
from agents.models.openai_provider import OpenAIProvider  # noqa: E402

INSTRUCTIONS = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt (examples/openai_agent/agent.py): the embedded default was cold-started with it."""

_sandbox = None


async def run_python(code: str) -> str:
    """What the code prints (or its error), from trl-plugins' isolated interpreter with a 5 s limit."""
    global _sandbox
    if _sandbox is None:
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        _sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="warm")
    return (await _sandbox({"code": code})).text


@function_tool
async def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last
    expression is printed. numpy and sympy are available.

    Args:
        code: The Python code to run.
    """
    return await run_python(code)


agent = Agent(name="ReTool solver", instructions=INSTRUCTIONS, tools=[code_interpreter])


def _run_config(client: openai.AsyncOpenAI) -> RunConfig:
    # the endpoint's client (its base URL, key and this rollout's HTTP pool) in the SDK's provider: the Responses API,
    # the SDK's default
    provider = OpenAIProvider(openai_client=client)
    return RunConfig(model_provider=provider, tracing_disabled=True)


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


async def solve(client: openai.AsyncOpenAI, row: dict) -> float:
    """``Runner.run`` until the agent answers; 1.0 when its answer is the row's (recorded as ``agent_return``)."""
    try:
        result = await Runner.run(agent, row["prompt"], run_config=_run_config(client))
    except openai.BadRequestError as exc:
        if getattr(exc, "code", None) == "trajectory_ended":  # a budget (turns, tokens, calls) ended it
            return 0.0
        raise
    return score(str(result.final_output), row)


async def solve_streamed(client: openai.AsyncOpenAI, row: dict) -> float:
    """:func:`solve` with ``Runner.run_streamed`` (every request ``stream: true``), reading its events to the end."""
    result = Runner.run_streamed(agent, row["prompt"], run_config=_run_config(client))
    try:
        async for _event in result.stream_events():
            pass
    except openai.BadRequestError as exc:
        if getattr(exc, "code", None) == "trajectory_ended":
            return 0.0
        raise
    return score(str(result.final_output), row)
