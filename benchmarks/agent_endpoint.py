"""Agent endpoint overhead: the same scripted workload through the built-in rollout and through the endpoint.

    python benchmarks/agent_endpoint.py [--questions 8] [--group 8] [--calls 3] [--gen-ms 0 20] [--tool-ms 0]
                                        [--repeats 3] [--no-command]

A scripted policy (no model: ``--gen-ms`` of sleep per generate call stands in for one) makes ``--calls`` tool calls
per trajectory, then answers. The built-in rollout runs them with an async tool that sleeps ``--tool-ms``; the endpoint
runs an agent written with the ``openai`` SDK that does the same (async and sync agents, and a command: one Python
process per trajectory), so both produce the same tokens (checked). Printed per setting, medians of ``--repeats``
alternated runs: wall time, wall per turn, the endpoint's added wall time per turn of a trajectory (its critical
path: turns run concurrently), and this process's CPU time per turn (what serving a turn costs: HTTP, JSON, matching,
the agent's SDK). Numbers are wall-clock on a shared machine: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.tools.code_interpreter import CodeInterpreter

SCHEMA = CodeInterpreter().schema()
TOOL_S = 0.0

COMMAND = """
import json, sys, time
import openai
row = json.load(sys.stdin)
schema, tool_s = json.loads(sys.argv[1]), float(sys.argv[2])
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": row["prompt"]}]
while True:
    message = client.chat.completions.create(model="policy", messages=messages, tools=[schema]).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        time.sleep(tool_s)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "ran " + json.loads(call.function.arguments)["code"]})
print(json.dumps(1.0))
"""


class SleepTool:
    name = "code_interpreter"

    def schema(self) -> dict:
        return SCHEMA

    async def __call__(self, arguments: dict) -> ToolOutput:
        await asyncio.sleep(TOOL_S)
        return ToolOutput(text=f"ran {arguments['code']}", ok=True)


async def async_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        message = (
            (await client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA])).choices[0].message
        )
        messages.append(message)
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            await asyncio.sleep(TOOL_S)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": f"ran {json.loads(call.function.arguments)['code']}",
                }
            )


def sync_agent(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        message = client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            time.sleep(TOOL_S)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": f"ran {json.loads(call.function.arguments)['code']}",
                }
            )


def backend(chat: ChatFormat, calls: int, gen_s: float) -> ScriptedBackend:
    tok = chat.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        done = tok.decode(prompt).count("<tool_response>")
        if done < calls:
            body = f'Step {done}.\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({done} * 7)"}}}}\n</tool_call>'
        else:
            body = "The answer is \\boxed{7}."
        return tok(body, add_special_tokens=False)["input_ids"] + [end]

    class Timed(ScriptedBackend):
        def generate(self, prompts, max_new_tokens, *, seeds):
            time.sleep(gen_s)  # one batched model call
            return super().generate(prompts, max_new_tokens, seeds=seeds)

    return Timed(script, stop_token_ids=chat.stop_token_ids)


def main() -> None:
    global TOOL_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--gen-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--tool-ms", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-command", action="store_true", help="skip the command agent (a process per trajectory)")
    args = parser.parse_args()
    TOOL_S = args.tool_ms / 1000
    chat = ChatFormat(build_tokenizer("qwen2_5"), [SCHEMA], final_answer_pattern=r"\\boxed\{")
    prompts = [f"Question {k}: compute." for k in range(args.questions)]
    questions = [
        RolloutQuestion(f"q{k}", chat.initial_prompt_ids([{"role": "user", "content": p}]), k, row={"prompt": p})
        for k, p in enumerate(prompts)
    ]
    script = Path(tempfile.mkdtemp()) / "agent.py"
    script.write_text(COMMAND)
    rollouts = {
        "built-in": MultiTurnRollout(max_turns=args.calls + 1, max_tool_calls=args.calls),
        "endpoint, async agent": AgentEndpointRollout(
            agent=async_agent, max_turns=args.calls + 1, max_tool_calls=args.calls
        ),
        "endpoint, sync agent": AgentEndpointRollout(
            agent=sync_agent, max_turns=args.calls + 1, max_tool_calls=args.calls
        ),
    }
    if not args.no_command:
        rollouts["endpoint, command"] = AgentEndpointRollout(
            command=[sys.executable, str(script), json.dumps(SCHEMA), str(TOOL_S)],
            max_turns=args.calls + 1,
            max_tool_calls=args.calls,
        )
    n = args.questions * args.group
    turns = n * (args.calls + 1)
    print(
        f"{args.questions} questions x {args.group} samples, {args.calls} tool calls + an answer each: {turns} turns; "
        f"tool {args.tool_ms:g} ms; medians of {args.repeats} alternated runs"
    )
    for rollout in rollouts.values():  # imports (openai: ~0.5 s) and first connections, not timed
        rollout(
            RolloutRequest(questions[:1], 1, backend(chat, args.calls, 0.0), chat, {"code_interpreter": SleepTool()})
        )
    for gen_ms in args.gen_ms:
        wall: dict[str, list[float]] = {k: [] for k in rollouts}
        cpu: dict[str, list[float]] = {k: [] for k in rollouts}
        reference = None
        for _ in range(args.repeats):
            for name, rollout in rollouts.items():
                request = RolloutRequest(
                    questions,
                    args.group,
                    backend(chat, args.calls, gen_ms / 1000),
                    chat,
                    {"code_interpreter": SleepTool()},
                    seed=3,
                )
                c0, t0 = time.process_time(), time.perf_counter()
                result = rollout(request)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                tokens = [[t.prompt_ids + t.completion_ids for t in traj.turns] for traj in result.trajectories]
                assert all(t.stop_reason.value == "final_answer" for t in result.trajectories), name
                reference = reference or tokens
                assert tokens == reference, f"{name} produced other tokens than the built-in rollout"
        base = statistics.median(wall["built-in"])
        print(f"\ngenerate call {gen_ms:g} ms")
        print(
            f"{'rollout':24s} {'wall s':>8s} {'ms/turn':>8s} {'x built-in':>10s} {'+ms per turn of a trajectory':>29s} "
            f"{'CPU ms/turn':>11s}"
        )
        for name in rollouts:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            added = (w - base) / (args.calls + 1) * 1000
            print(
                f"{name:24s} {w:8.3f} {w / turns * 1000:8.2f} {w / base:10.2f} {added:29.1f} {c / turns * 1000:11.2f}"
            )


if __name__ == "__main__":
    main()
