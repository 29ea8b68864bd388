"""The ReTool agent written with Anthropic's Python SDK (``anthropic``) as its tool-use guide teaches: a client tool
with an ``input_schema``, ``client.messages.stream(...)`` until the reply's ``stop_reason`` is not ``tool_use``, each
``tool_use`` block answered by a ``tool_result`` block. The endpoint serves the Messages API (``POST /v1/messages``).

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/anthropic_sdk/retool_agent.yaml

Nothing in the agent knows about training: with ``client: anthropic`` in its rollout's settings the endpoint hands
``solve`` an ``anthropic.AsyncAnthropic`` client whose base URL and key are the run's; the same code runs against
Anthropic's API with ``anthropic.AsyncAnthropic()``.
"""

from __future__ import annotations

import re

import anthropic

SYSTEM = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt (examples/openai_agent/agent.py): the embedded default was cold-started with it."""

TOOL = {
    "name": "code_interpreter",
    "description": "Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value "
    "of the last expression is printed. numpy and sympy are available.",
    "input_schema": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python code to run."}},
        "required": ["code"],
    },
}
"""The code tool as an Anthropic client tool."""

MAX_TURNS = 8

_sandbox = None


async def run_python(code: str) -> str:
    """What the code prints (or its error), from trl-plugins' isolated interpreter with a 5 s limit."""
    global _sandbox
    if _sandbox is None:
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        _sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="warm")
    return (await _sandbox({"code": code})).text


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


async def solve(client: anthropic.AsyncAnthropic, row: dict) -> float:
    """Stream replies, run each tool call, until the model answers; 1.0 when its answer is the row's (recorded as
    ``agent_return``)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        try:
            async with client.messages.stream(
                model="policy", max_tokens=1024, system=SYSTEM, messages=messages, tools=[TOOL]
            ) as stream:
                reply = await stream.get_final_message()
        except anthropic.BadRequestError as exc:
            if (exc.body or {}).get("error", {}).get("code") == "trajectory_ended":  # a budget (turns, tokens) ended it
                return 0.0
            raise
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            return score("".join(b.text for b in reply.content if b.type == "text"), row)
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": await run_python(b.input.get("code", ""))}
            for b in reply.content
            if b.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    return 0.0
