"""The agent endpoint's time per request for each framework of examples/agents/, over the raw backend call.

    python benchmarks/agent_frameworks.py [--requests 200] [--calls 3] [--frameworks openai_agents_sdk langgraph ...]

Each example agent solves scripted questions of ``--calls`` code calls and an answer (pydantic-ai and smolagents
answer through their own answer tool; DSPy's ReAct asks once more to finish and once to extract the answer) until
``--requests`` requests have been served, one agent at a time (``max_concurrent_agents: 1``), so a request never
waits for another's. The in-process examples run as ``agent:`` with their sandboxed ``run_python`` replaced by an
instant scripted tool; AutoGen's and DSPy's run as the ``command:`` agents their YAMLs name, a process per trajectory
in their own interpreter (``$TRL_PLUGINS_AUTOGEN_PYTHON``, else ``.venv-autogen/bin/python``; a framework whose
interpreter is absent is skipped, naming the command that makes it), and their tool, the run's ``code_interpreter``
asked for through the endpoint's ``POST tools/call``, is an instant scripted tool of the same answers. Claude Code
runs as its harness (``python -m trl_plugins.harness.claude_code``, sandboxed, a CLI per trajectory; skipped without
bubblewrap or the CLI), its ``Bash`` tool echoing the same answers.

Per model request (``chat/completions``, ``responses`` or ``messages``), the endpoint's time is measured in its request handler
(from the parsed request to the reply body, HTTP framing not included) and the raw backend call (the scripted
sampler) is subtracted. Printed per framework: the median and mean of that difference, the backend call's median,
the framework's whole wall time per request (its own client and agent loop included; for a command, its process's
start and imports too), the segments per trajectory and the environment-error share; for a command, the handler's
median time for a ``tools/call`` (the instant tool included) on a line of its own.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from trl_plugins.rollout import ChatFormat, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.rollout.endpoint.agent import _load
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.tools.code_interpreter import CodeInterpreter
from trl_plugins.types import StopReason

ROOT = Path(__file__).resolve().parents[1]
IN_PROCESS = ["openai_agents_sdk", "langgraph", "pydantic_ai", "smolagents", "anthropic_sdk", "claude_agent_sdk"]
"""Examples run as ``agent: examples/agents/<name>/agent.py:solve``, in this interpreter."""
COMMANDS = ["autogen", "dspy"]
"""Examples run as ``command: [<own python>, examples/agents/<name>/agent.py]``, as their YAMLs run them."""
HARNESSES = ["claude_code"]
"""Harnesses of ``trl_plugins.harness`` run as ``command: [<this python>, -m, trl_plugins.harness.<name>]`` (Claude
Code in its sandbox: it needs bubblewrap and the CLI, else it is skipped)."""
CLIENTS = {"anthropic_sdk": "anthropic", "claude_agent_sdk": "anthropic"}
"""The client an in-process example is handed (``rollout_kwargs: client``), where it is not OpenAI's."""
FRAMEWORKS = IN_PROCESS + COMMANDS + HARNESSES
MAX_COMMAND_CALLS = 3
"""The most code calls a command example makes before its answer: 4 iterations (AutoGen's ``max_tool_iterations``,
DSPy's ReAct ``max_iters``), the last one the answer (AutoGen) or ``finish`` (DSPy)."""
MAKE_OWN_PYTHON = "python3 -m venv .venv-autogen && .venv-autogen/bin/pip install -q -r constraints/autogen.txt"
"""The command (in the repository's root) that makes the commands' interpreter (docs/agents.md)."""


SDK_CODE_TOOL = "mcp__retool__code_interpreter"
"""The code tool's name where the Claude Agent SDK offers it: an in-process tool, prefixed by its MCP server's name."""


def code_tool(prompt_text: str) -> str:
    """The code tool's name as the prompt offers it (the Claude Agent SDK's prefixed one, Claude Code's ``Bash``, else
    ``code_interpreter``)."""
    if '"name": "Bash"' in prompt_text:
        return "Bash"
    return SDK_CODE_TOOL if f'"{SDK_CODE_TOOL}"' in prompt_text else "code_interpreter"


def code_call(prompt_text: str, k: int) -> tuple[str, dict]:
    """The k-th code call as the prompt's tools take it: ``print(k)`` for a code tool, for Claude Code's ``Bash`` a
    command printing what the scripted code tools answer (``ran print(k)``)."""
    name = code_tool(prompt_text)
    return name, {"command": f"echo 'ran print({k})'"} if name == "Bash" else {"code": f"print({k})"}


def harness_missing() -> str | None:
    """Why the Claude Code harness cannot run here (no bubblewrap, no CLI), or None."""
    import shutil

    from trl_plugins.harness.claude_code import HarnessError, find_claude

    if shutil.which("bwrap") is None:
        return "no bubblewrap (apt-get install bubblewrap)"
    try:
        find_claude()
    except HarnessError as exc:
        return str(exc)
    return None


def own_python() -> str | None:
    """The commands' interpreter: ``$TRL_PLUGINS_AUTOGEN_PYTHON``, else ``.venv-autogen/bin/python`` (None: neither)."""
    given = os.environ.get("TRL_PLUGINS_AUTOGEN_PYTHON")
    path = Path(given) if given else ROOT / ".venv-autogen" / "bin" / "python"
    return str(path) if path.exists() else None


def requests_per_trajectory(framework: str, calls: int) -> int:
    """A request per code call and one that answers; DSPy's ReAct one more (a step that calls ``finish``, then the
    extraction of the answer)."""
    return calls + (2 if framework == "dspy" else 1)


def scripted(chat: ChatFormat, backend_s: list[float]) -> ScriptedBackend:
    """``calls=N`` code calls, then ``\\boxed{7}`` (or the framework's answer tool where the request offers one; for
    DSPy's ReAct, its fields as text: the calls, ``finish``, then the answer's extraction)."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def call(name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def script(prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        text = tok.decode(prompt)
        question = re.findall(r"user\n(.*?)<\|im_end\|>", text, re.DOTALL)[0]
        done = len(set(re.findall(r"ran print\((\d+)\)", text)))
        calls = int(re.search(r"calls=(\d+)", question).group(1))
        if "[[ ## next_tool_name ## ]]" in text:  # a step of DSPy's ReAct: its fields as text, no tools offered
            name, arguments = ("code_interpreter", {"code": f"print({done})"}) if done < calls else ("finish", {})
            body = (
                f"[[ ## next_thought ## ]]\nStep {done}.\n\n[[ ## next_tool_name ## ]]\n{name}\n\n"
                f"[[ ## next_tool_args ## ]]\n{json.dumps(arguments)}\n\n[[ ## completed ## ]]"
            )
        elif "[[ ## answer ## ]]" in text:  # its extraction of the answer from the trajectory
            body = "[[ ## reasoning ## ]]\nDone.\n\n[[ ## answer ## ]]\n\\boxed{7}\n\n[[ ## completed ## ]]"
        elif done < calls:
            body = f"Step {done}.\n" + call(*code_call(text, done))
        elif '"name": "final_result"' in text:
            body = call("final_result", {"answer": "7"})
        elif '"name": "final_answer"' in text:
            body = call("final_answer", {"answer": "\\boxed{7}"})
        else:
            body = "The answer is \\boxed{7}."
        ids = tok(body, add_special_tokens=False)["input_ids"] + [im_end]
        backend_s.append(time.perf_counter() - t0)
        return ids

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


class InstantTool:
    """The run's ``code_interpreter`` as a command agent asks for it (``POST tools/call``), answered at once with what
    the in-process examples' replaced ``run_python`` answers: ``ran <code>``."""

    name = "code_interpreter"

    def schema(self) -> dict:
        return CodeInterpreter().schema()

    async def __call__(self, arguments: dict) -> ToolOutput:
        return ToolOutput(text=f"ran {arguments['code']}", ok=True)


class TimedEndpoint(AgentEndpointRollout):
    """The endpoint with its request handler timed: model requests in ``served_s``, ``tools/call`` in ``tools_s``."""

    def __init__(self, *args, served_s: list[float], tools_s: list[float] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._served_s, self._tools_s = served_s, tools_s if tools_s is not None else []

    async def _serve(self, http, *args, **kwargs):
        route = http.path.split("?", 1)[0].split("/v1/", 1)[-1]
        model = ("chat/completions", "responses", "messages")
        times = self._served_s if route in model else self._tools_s if route == "tools/call" else None
        t0 = time.perf_counter()
        try:
            return await super()._serve(http, *args, **kwargs)
        finally:
            if times is not None:
                times.append(time.perf_counter() - t0)


def example(framework: str):
    agent = _load(f"{ROOT}/examples/agents/{framework}/agent.py:solve")

    async def run_python(code: str) -> str:
        return f"ran {code}"

    def run_python_sync(code: str) -> str:
        return f"ran {code}"

    sync = not inspect.iscoroutinefunction(agent.__globals__["run_python"])
    agent.__globals__["run_python"] = run_python_sync if sync else run_python
    return agent


def measure(framework: str, chat: ChatFormat, *, requests: int, calls: int, python: str | None = None) -> dict:
    """``python``: the interpreter of a ``command:`` example (one of :data:`COMMANDS`)."""
    if framework in COMMANDS:
        runs = dict(command=[python, str(ROOT / "examples/agents" / framework / "agent.py")])
        tools = {"code_interpreter": InstantTool()}
    elif framework in HARNESSES:
        runs = dict(command=[sys.executable, "-m", f"trl_plugins.harness.{framework}", "--system-prompt", "Solve it."])
        runs["max_trajectory_tokens"] = 16_000  # the CLI's own prompt is ~6,300 tokens with this tokenizer
        tools = {}
    else:
        runs, tools = dict(agent=example(framework), client=CLIENTS.get(framework, "openai")), {}
    turns = requests_per_trajectory(framework, calls)
    n = -(-requests // turns)
    questions = [
        RolloutQuestion(
            f"q{i}",
            chat.initial_prompt_ids([{"role": "user", "content": f"calls={calls}"}]),
            i,
            row={"prompt": f"calls={calls}", "answer": "7"},
        )
        for i in range(n)
    ]
    served, backend, tools_s = [], [], []
    # a warm-up trajectory: imports (a command's files in the page cache), the format per tool set, the first client
    warm = RolloutRequest(questions[:1], 1, scripted(chat, []), chat, tools, policy_step=0, seed=0)
    TimedEndpoint(**runs, max_concurrent_agents=1, served_s=[], max_turns=turns + 1)(warm)
    req = RolloutRequest(questions, 1, scripted(chat, backend), chat, tools, policy_step=1, seed=0)
    t0 = time.perf_counter()
    result = TimedEndpoint(**runs, max_concurrent_agents=1, served_s=served, tools_s=tools_s, max_turns=turns + 1)(req)
    wall = time.perf_counter() - t0
    trajs = result.trajectories
    failed = [t.error for t in trajs if t.stop_reason == StopReason.ENVIRONMENT_ERROR]
    if len(served) != len(backend) or not served:
        raise RuntimeError(
            f"{framework}: {len(served)} requests served, {len(backend)} backend calls"
            + (f"; first environment error: {failed[0]}" if failed else "")
        )
    over = [s - b for s, b in zip(served, backend)]
    return {
        "requests": len(served),
        "over_median_ms": 1e3 * statistics.median(over),
        "over_mean_ms": 1e3 * statistics.mean(over),
        "backend_median_ms": 1e3 * statistics.median(backend),
        "wall_per_request_ms": 1e3 * wall / len(served),
        "segments": statistics.mean(t.num_segments for t in trajs),
        "env_errors": len(failed) / len(trajs),
        "tool_calls": len(tools_s),
        "tool_call_median_ms": 1e3 * statistics.median(tools_s) if tools_s else None,
        "first_error": failed[0] if failed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="model requests served per framework (at least)")
    parser.add_argument("--calls", type=int, default=3, help="code calls per trajectory before the answer")
    parser.add_argument(
        "--frameworks",
        nargs="+",
        default=FRAMEWORKS,
        choices=FRAMEWORKS,
        help="default: all; autogen and dspy run as commands in their own interpreter",
    )
    args = parser.parse_args()
    if args.requests < 1 or args.calls < 0:
        parser.error(f"--requests must be >= 1 and --calls >= 0, got {args.requests} and {args.calls}")
    if args.calls > MAX_COMMAND_CALLS and set(args.frameworks) & set(COMMANDS):
        parser.error(
            f"--calls {args.calls}: AutoGen's and DSPy's examples stop after 4 tool iterations "
            f"(max_tool_iterations=4, max_iters=4), so at most {MAX_COMMAND_CALLS} calls and an answer; "
            f"give --calls {MAX_COMMAND_CALLS} or less, or leave autogen and dspy out of --frameworks"
        )
    chat = None  # made for the first framework measured (none, where every one is skipped)
    print(
        f"{args.calls} code calls + an answer per trajectory (DSPy: then its finish step, and the answer's "
        f"extraction), one agent at a time, tiny tokenizer (qwen2_5)"
    )
    print(
        f"{'framework':<18s}{'requests':>9s}{'endpoint ms (median)':>22s}{'(mean)':>8s}{'backend ms':>12s}"
        f"{'wall ms/request':>17s}{'segments':>10s}{'env errors':>12s}"
    )
    notes = []
    for framework in args.frameworks:
        python = own_python() if framework in COMMANDS else None
        if framework in COMMANDS and python is None:
            print(
                f"{framework:<18s}skipped: no interpreter of its own (.venv-autogen/bin/python, or "
                f"$TRL_PLUGINS_AUTOGEN_PYTHON): make it in {ROOT} with {MAKE_OWN_PYTHON}",
                flush=True,
            )
            continue
        missing = harness_missing() if framework in HARNESSES else None
        if missing:
            print(f"{framework:<18s}skipped: {missing}", flush=True)
            continue
        if chat is None:
            chat = ChatFormat(
                build_tokenizer("qwen2_5"),
                [CodeInterpreter().schema()],
                final_answer_pattern=r"\\boxed\{",
                calls_per_turn=2,
            )
        m = measure(framework, chat, requests=args.requests, calls=args.calls, python=python)
        print(
            f"{framework:<18s}{m['requests']:>9d}{m['over_median_ms']:>22.2f}{m['over_mean_ms']:>8.2f}"
            f"{m['backend_median_ms']:>12.2f}{m['wall_per_request_ms']:>17.2f}{m['segments']:>10.2f}"
            f"{m['env_errors']:>12.1%}",
            flush=True,
        )
        if m["tool_calls"]:
            notes.append(
                f"{framework}: {m['tool_calls']} tools/call, handler median {m['tool_call_median_ms']:.2f} ms "
                f"(the instant tool included)"
            )
        if m["first_error"]:
            notes.append(f"{framework}: first environment error: {m['first_error']}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
