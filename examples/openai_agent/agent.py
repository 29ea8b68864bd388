"""A ReTool agent written only against the OpenAI chat-completions API, trained by the recipe unchanged.

It is the kind of agent people already have: a loop that asks the model, runs the tool calls it makes, sends the
results back and stops when the model answers. Nothing in it knows about training. The recipe trains it through
``rollout: agent_endpoint`` (examples/openai_agent/retool_agent.yaml), which hands it an ``openai.AsyncOpenAI`` client
whose base URL is a local endpoint served by the policy being trained:

    accelerate launch recipes/retool_ppo.py --config examples/openai_agent/retool_agent.yaml

The same file runs as a command (``rollout_kwargs: {command: [python, examples/openai_agent/agent.py]}``): it then
reads its row as JSON on stdin, its endpoint from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, and prints its result as
JSON. Model-written code runs in trl-plugins' sandbox (an isolated interpreter, no network), called as a library:
any code runner would do.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import openai

SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt: the embedded default was cold-started with it."""

CODE_TOOL = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value "
        "of the last expression is printed. numpy and sympy are available.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
"""The code interpreter as an OpenAI function tool (the schema the embedded default was cold-started with)."""

_sandbox = None


async def run_python(code: str) -> str:
    """What the code prints (or its error), from an isolated interpreter with a 5 s limit."""
    global _sandbox
    if _sandbox is None:
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        _sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="warm")
    return (await _sandbox({"code": code})).text


async def solve(client: openai.AsyncOpenAI, row: dict) -> float:
    """Ask, run the calls, send the results back, until the model answers; returns 1.0 when its last ``\\boxed{}``
    is the row's answer (recorded as ``agent_return``; the run's configured reward components score the trajectory)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["prompt"]}]
    while True:
        try:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[CODE_TOOL])
        except openai.BadRequestError as exc:
            if getattr(exc, "code", None) == "trajectory_ended":  # a budget (turns, tokens, calls) ended it
                return 0.0
            raise
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answers = re.findall(r"\\boxed\{([^{}]*)\}", message.content or "")
            return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())
        for call in message.tool_calls:
            code = json.loads(call.function.arguments).get("code", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_python(code)})


async def _main() -> None:
    row = json.load(sys.stdin)
    async with openai.AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
        reward = await solve(client, row)
    if _sandbox is not None:
        _sandbox.close()
    print(json.dumps(reward))


if __name__ == "__main__":
    asyncio.run(_main())
