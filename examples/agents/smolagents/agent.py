"""The ReTool agent written with smolagents as its docs teach: a ``ToolCallingAgent`` with a ``@tool`` and an
``OpenAIServerModel``, run with ``agent.run``. smolagents is synchronous, so ``solve`` is a plain function: the endpoint
runs it on a worker thread with an ``openai.OpenAI`` client, and the agent builds smolagents' own model from the
client's ``base_url`` and ``api_key``.

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/smolagents/retool_agent.yaml

What smolagents sends (docs/agents.md): chat completions with ``tool_choice: "required"`` (served unforced) and
``stop: ["Observation:", "Calling tools:"]`` (honoured), its own long system prompt (the recipe's becomes its
``instructions``), and earlier turns re-sent as text ("Calling tools: [...]", "Observation: ..."), not as the
assistant's tool calls: every turn is a rewrite and starts a segment of its own. The model answers through the
``final_answer`` tool, so the recipe layer trains on what the agent returns (``reward_components: [agent_reward]``).
"""

from __future__ import annotations

import asyncio
import re

import openai
from smolagents import AgentGenerationError, OpenAIServerModel, ToolCallingAgent, tool

INSTRUCTIONS = (
    "You solve maths problems. You may run Python with the code_interpreter tool and wait for its output. "
    "Give the final answer as \\boxed{...} with the final_answer tool."
)
"""The recipe's system prompt (examples/openai_agent/agent.py), its last sentence for smolagents' answer tool."""


def run_python(code: str) -> str:
    """What the code prints (or its error), from trl-plugins' isolated interpreter (a fresh one per call, 5 s limit:
    this runs on the agent's worker thread, outside any event loop)."""
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="cold")
    try:
        return asyncio.run(sandbox({"code": code})).text
    finally:
        sandbox.close()


@tool
def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last
    expression is printed. numpy and sympy are available.

    Args:
        code: The Python code to run.
    """
    return run_python(code)


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` (else the text itself) is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "") or [text or ""]
    return float(answers[-1].strip() == str(row.get("answer", "")).strip())


def solve(client: openai.OpenAI, row: dict) -> float:
    """``agent.run`` on the question (at most 4 steps, the recipe's ``max_turns``); 1.0 when the answer given to
    ``final_answer`` is the row's (``agent_return``, trained on through ``agent_reward``)."""
    model = OpenAIServerModel(model_id="policy", api_base=str(client.base_url), api_key=client.api_key)
    agent = ToolCallingAgent(
        tools=[code_interpreter], model=model, instructions=INSTRUCTIONS, max_steps=4, verbosity_level=0
    )
    try:
        answer = agent.run(row["prompt"])
    except AgentGenerationError as exc:  # smolagents wraps the client's error
        if getattr(exc.__cause__, "code", None) == "trajectory_ended":  # a budget (turns, tokens, calls) ended it
            return 0.0
        raise
    return score(str(answer), row)
