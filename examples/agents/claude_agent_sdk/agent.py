"""The ReTool agent written with the Claude Agent SDK (``claude-agent-sdk``) as its guide teaches: the code tool is an
in-process SDK MCP tool (``@tool`` and ``create_sdk_mcp_server``), and ``query(...)`` runs the agent loop in the Claude
Code CLI the SDK bundles, which posts to the Messages API (``POST /v1/messages``, streamed) of the agent endpoint.

    pip install -e ".[agents]"
    accelerate launch recipes/retool_ppo.py --config examples/agents/claude_agent_sdk/retool_agent.yaml

Nothing in the agent knows about training: with ``client: anthropic`` the endpoint hands ``solve`` an
``anthropic.AsyncAnthropic`` client whose base URL and key are the run's, and the agent gives them to the CLI it starts
(``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``); against Anthropic's API the same code runs with the user's own.

What the CLI adds to the conversation (one request per model turn, measured on claude-agent-sdk 0.2.190, CLI 2.1.337):
a first line before the system prompt ("You are a Claude agent, built on Anthropic's Claude Agent SDK."), a reserved
``DeferredToolPlaceholder`` tool beside the code tool, whose name it prefixes (``mcp__retool__code_interpreter``), and
an environment reminder as a second user message; about 960 prompt tokens with the tiny tokenizer. Claude Code's own
tools are off (``tools=[]``) and its system prompt is replaced by the recipe's, so this is not stock Claude Code
(examples/agents/claude_code runs that). Each run gets a fresh home and config folder (``HOME``,
``CLAUDE_CONFIG_DIR``), removed after it, and the variables that keep the CLI from calling anything but the endpoint.
"""

from __future__ import annotations

import os
import re
import tempfile

from claude_agent_sdk import ClaudeAgentOptions, ResultError, ResultMessage, create_sdk_mcp_server, query, tool

SYSTEM = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""The recipe's system prompt (examples/openai_agent/agent.py): the embedded default was cold-started with it."""

MAX_TURNS = 8

QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
"""What every CLI the agent starts is given: no update checks, telemetry, error reports or other side traffic."""

_sandbox = None


async def run_python(code: str) -> str:
    """What the code prints (or its error), from trl-plugins' isolated interpreter with a 5 s limit."""
    global _sandbox
    if _sandbox is None:
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        _sandbox = CodeInterpreter(timeout_s=5.0, memory_mb=1024, max_output_chars=4000, mode="warm")
    return (await _sandbox({"code": code})).text


@tool(
    "code_interpreter",
    "Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last "
    "expression is printed. numpy and sympy are available.",
    {"code": str},
)
async def code_interpreter(args: dict) -> dict:
    return {"content": [{"type": "text", "text": await run_python(args.get("code", ""))}]}


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


def options(base_url: str, api_key: str, home: str) -> ClaudeAgentOptions:
    """The agent's options: the recipe's system prompt, the code tool alone (allowed without asking), no settings
    files read, and the CLI's environment: the endpoint, a home of its own, no side traffic."""
    return ClaudeAgentOptions(
        system_prompt=SYSTEM,
        tools=[],
        mcp_servers={"retool": create_sdk_mcp_server("retool", tools=[code_interpreter])},
        allowed_tools=["mcp__retool__code_interpreter"],
        model="policy",
        max_turns=MAX_TURNS,
        setting_sources=[],
        cwd=home,
        env={
            **QUIET,
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            "HOME": home,
            "CLAUDE_CONFIG_DIR": os.path.join(home, ".claude"),
        },
    )


async def solve(client, row: dict) -> float:
    """Run the agent on the row's question; 1.0 when its final answer is the row's (recorded as ``agent_return``)."""
    result = ""
    with tempfile.TemporaryDirectory(prefix="claude-agent-") as home:
        try:
            settings = options(str(client.base_url), client.api_key, home)
            async for message in query(prompt=row["prompt"], options=settings):
                if isinstance(message, ResultMessage):
                    result = message.result or ""
        except ResultError as exc:
            # The CLI passes on the endpoint's message, not its code: a budget (turns, tokens) ended the trajectory.
            if "this trajectory has ended" in str(exc):
                return 0.0
            raise
    return score(result, row)
