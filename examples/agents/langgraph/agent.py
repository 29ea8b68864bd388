"""The ReTool agent written with LangGraph as its docs teach: a ``ChatOpenAI`` model (``langchain-openai``), a
``@tool`` and the prebuilt ReAct agent, run with ``ainvoke`` (``solve``) or streamed token by token with
``astream(stream_mode="messages")`` (``solve_streamed``). ``ChatOpenAI`` sends chat completions by default.

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/langgraph/retool_agent.yaml

Nothing in the agent knows about training: the endpoint hands ``solve`` an ``openai.AsyncOpenAI`` client and the agent
builds LangChain's own model from its ``base_url`` and ``api_key``.
"""

from __future__ import annotations

import re
import warnings

import openai
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

with warnings.catch_warnings():  # langgraph 1.x points at langchain.agents.create_agent (the langchain package)
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

SYSTEM_PROMPT = (
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


@tool
async def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last expression is printed. numpy and sympy are available."""  # noqa: E501 - the tool's description, one line
    return await run_python(code)


def build_agent(client: openai.AsyncOpenAI):
    """The ReAct graph with LangChain's own model on the endpoint's base URL and key."""
    model = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(model, tools=[code_interpreter], prompt=SYSTEM_PROMPT)


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


def _ended(exc: openai.BadRequestError) -> bool:
    return getattr(exc, "code", None) == "trajectory_ended"  # a budget (turns, tokens, calls) ended it


async def solve(client: openai.AsyncOpenAI, row: dict) -> float:
    """``ainvoke`` the graph on the question; 1.0 when the last message's answer is the row's."""
    try:
        state = await build_agent(client).ainvoke({"messages": [{"role": "user", "content": row["prompt"]}]})
    except openai.BadRequestError as exc:
        if _ended(exc):
            return 0.0
        raise
    return score(state["messages"][-1].text, row)


async def solve_streamed(client: openai.AsyncOpenAI, row: dict) -> float:
    """:func:`solve` streamed token by token (``stream_mode="messages"``: every request ``stream: true``)."""
    text = ""  # every token the model streamed: the last \\boxed{} in it is the answer
    try:
        async for chunk, metadata in build_agent(client).astream(
            {"messages": [{"role": "user", "content": row["prompt"]}]}, stream_mode="messages"
        ):
            if isinstance(chunk, AIMessage) and metadata.get("langgraph_node") == "agent":
                text += chunk.text
    except openai.BadRequestError as exc:
        if _ended(exc):
            return 0.0
        raise
    return score(text, row)
