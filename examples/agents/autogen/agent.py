"""The ReTool agent written with AutoGen AgentChat as its docs teach: an ``AssistantAgent`` with a tool and an
``OpenAIChatCompletionClient`` (``autogen-ext[openai]``), run with ``agent.run`` or, with ``--stream``, streamed token
by token (``model_client_stream=True`` and ``run_stream``). The client sends chat completions.

AutoGen pins a protobuf that the project's wandb cannot share, so it has an interpreter of its own and runs as a
``command:`` agent, once per trajectory (docs/agents.md#agents-written-with-frameworks):

    python3 -m venv .venv-autogen && .venv-autogen/bin/pip install -q -r constraints/autogen.txt
    accelerate launch recipes/retool_ppo.py --config examples/agents/autogen/retool_agent.yaml

The endpoint starts it with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (this trajectory's) and the row as JSON on its
stdin; it prints its reward as its last line. Nothing in it knows about training: the model is whatever serves that
URL, and the tool is the run's ``code_interpreter`` (the recipe's sandbox), asked for through the endpoint's tools
route (docs/agents.md#the-runs-tools), since this interpreter has no trl_plugins.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import openai
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.base import TaskResult
from autogen_ext.models.openai import OpenAIChatCompletionClient

SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt (examples/openai_agent/agent.py): the embedded default was cold-started with it."""

MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": False,
    "structured_output": False,
    "family": "unknown",
}
"""What AutoGen needs to be told about a model whose name is not one of OpenAI's (it refuses to guess)."""

_tools: openai.AsyncOpenAI | None = None


async def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last expression is printed. numpy and sympy are available."""  # noqa: E501 - the tool's description, one line
    global _tools
    if _tools is None:
        _tools = openai.AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: this trajectory's session
    reply = await _tools.post(
        "tools/call", cast_to=object, body={"name": "code_interpreter", "arguments": {"code": code}}
    )
    return reply["content"]


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


async def solve(row: dict, *, stream: bool = False) -> float:
    """Run the agent on the row's question; 1.0 when its last message's answer is the row's (0.0 when a budget of
    the run ended the trajectory: the endpoint refuses the next request with ``trajectory_ended``)."""
    model_client = OpenAIChatCompletionClient(
        model="policy",
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        model_info=MODEL_INFO,
    )
    agent = AssistantAgent(
        "solver",
        model_client=model_client,
        tools=[code_interpreter],
        system_message=SYSTEM_PROMPT,
        max_tool_iterations=4,
        model_client_stream=stream,
    )
    try:
        if stream:
            result = None
            async for item in agent.run_stream(task=row["prompt"]):  # chunks, then the run's TaskResult
                if isinstance(item, TaskResult):
                    result = item
        else:
            result = await agent.run(task=row["prompt"])
    except openai.BadRequestError as exc:
        if getattr(exc, "code", None) == "trajectory_ended":  # a budget (turns, tokens, calls) ended it
            return 0.0
        raise
    finally:
        await model_client.close()
    last = result.messages[-1].content
    return score(last if isinstance(last, str) else "", row)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(solve(json.load(sys.stdin), stream="--stream" in sys.argv[1:]))))
