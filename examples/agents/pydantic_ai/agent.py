"""The ReTool agent written with pydantic-ai as its docs teach: an ``Agent`` with a tool and a typed ``output_type``,
run with ``agent.run``. ``'openai:...'`` models are ``OpenAIResponsesModel`` (the Responses API, ``POST /responses``);
a typed output is returned through an output tool (``final_result``), so every request carries
``tool_choice: "required"``, which the endpoint serves unforced (``endpoint/tool_choice_unforced``, docs/agents.md).

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/pydantic_ai/retool_agent.yaml

The model gives its answer as the output tool's argument, not as ``\\boxed{}`` text, so the recipe layer trains on
what the agent returns (``reward_components: [agent_reward]``). Nothing in the agent knows about training: the endpoint
hands ``solve`` an ``openai.AsyncOpenAI`` client and the agent builds pydantic-ai's own provider from its ``base_url``
and ``api_key``.
"""

from __future__ import annotations

import openai
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelRequestRejectedError
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool and wait for its output. "
    "Give the final answer with the final_result tool."
)
"""The recipe's system prompt (examples/openai_agent/agent.py), its last sentence for the typed output."""


class Answer(BaseModel):
    """The final answer."""

    answer: str = Field(description="The final answer alone (a number or an expression), without \\boxed{}.")


_sandbox = None


async def run_python(code: str) -> str:
    """What the code prints (or its error), from trl-plugins' isolated interpreter with a 5 s limit."""
    global _sandbox
    if _sandbox is None:
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        _sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="warm")
    return (await _sandbox({"code": code})).text


agent = Agent(output_type=Answer, system_prompt=SYSTEM_PROMPT)  # the model is given per run (below)


@agent.tool_plain
async def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last
    expression is printed. numpy and sympy are available.

    Args:
        code: The Python code to run.
    """
    return await run_python(code)


async def solve(client: openai.AsyncOpenAI, row: dict) -> float:
    """``agent.run`` on the question; 1.0 when the typed answer is the row's (``agent_return``, trained on through
    ``agent_reward``)."""
    model = OpenAIResponsesModel(
        "policy", provider=OpenAIProvider(base_url=str(client.base_url), api_key=client.api_key)
    )
    try:
        result = await agent.run(row["prompt"], model=model)
    except ModelRequestRejectedError as exc:  # pydantic-ai's for the client's 400
        if isinstance(exc.body, dict) and exc.body.get("code") == "trajectory_ended":  # a budget (turns, tokens, ...)
            return 0.0
        raise
    return float(result.output.answer.strip() == str(row.get("answer", "")).strip())
