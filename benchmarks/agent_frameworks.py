"""The agent endpoint's time per request for each framework of examples/agents/, over the raw backend call.

    python benchmarks/agent_frameworks.py [--requests 200] [--calls 3] [--frameworks openai_agents_sdk langgraph ...]

Each example agent (its sandboxed ``run_python`` replaced by an instant scripted tool) solves scripted questions of
``--calls`` code calls and an answer (pydantic-ai and smolagents answer through their own answer tool) until
``--requests`` requests have been served, one agent at a time (``max_concurrent_agents: 1``), so a request never
waits for another's. Per request, the endpoint's time is measured in its request handler (from the parsed request
to the reply body, HTTP framing not included) and the raw backend call (the scripted sampler) is subtracted. Printed
per framework: the median and mean of that difference, the backend call's median, the framework's whole wall time
per request (its own client and agent loop included), the segments per trajectory and the environment-error share.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import statistics
import time
from pathlib import Path

from trl_plugins.rollout import ChatFormat, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.rollout.endpoint.agent import _load
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.code_interpreter import CodeInterpreter
from trl_plugins.types import StopReason

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ["openai_agents_sdk", "langgraph", "pydantic_ai", "smolagents"]


def scripted(chat: ChatFormat, backend_s: list[float]) -> ScriptedBackend:
    """``calls=N`` code calls, then ``\\boxed{7}`` (or the framework's answer tool where the request offers one)."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def call(name: str, arguments: dict) -> str:
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'

    def script(prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        text = tok.decode(prompt)
        question = re.findall(r"user\n(.*?)<\|im_end\|>", text, re.DOTALL)[0]
        done = len(set(re.findall(r"ran print\((\d+)\)", text)))
        if done < int(re.search(r"calls=(\d+)", question).group(1)):
            body = f"Step {done}.\n" + call("code_interpreter", {"code": f"print({done})"})
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


class TimedEndpoint(AgentEndpointRollout):
    """The endpoint with its request handler timed."""

    def __init__(self, *args, served_s: list[float], **kwargs):
        super().__init__(*args, **kwargs)
        self._served_s = served_s

    async def _serve(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await super()._serve(*args, **kwargs)
        finally:
            self._served_s.append(time.perf_counter() - t0)


def example(framework: str):
    agent = _load(f"{ROOT}/examples/agents/{framework}/agent.py:solve")

    async def run_python(code: str) -> str:
        return f"ran {code}"

    def run_python_sync(code: str) -> str:
        return f"ran {code}"

    sync = not inspect.iscoroutinefunction(agent.__globals__["run_python"])
    agent.__globals__["run_python"] = run_python_sync if sync else run_python
    return agent


def measure(framework: str, chat: ChatFormat, *, requests: int, calls: int) -> dict:
    agent = example(framework)
    turns = calls + 1
    n = -(-requests // turns)
    questions = [RolloutQuestion(f"q{i}", chat.initial_prompt_ids([{"role": "user", "content": f"calls={calls}"}]), i,
                                 row={"prompt": f"calls={calls}", "answer": "7"}) for i in range(n)]
    served, backend = [], []
    # a warm-up trajectory: imports, the format per tool set, the framework's first client
    warm = RolloutRequest(questions[:1], 1, scripted(chat, []), chat, {}, policy_step=0, seed=0)
    TimedEndpoint(agent=agent, max_concurrent_agents=1, served_s=[], max_turns=turns + 1)(warm)
    req = RolloutRequest(questions, 1, scripted(chat, backend), chat, {}, policy_step=1, seed=0)
    t0 = time.perf_counter()
    result = TimedEndpoint(agent=agent, max_concurrent_agents=1, served_s=served, max_turns=turns + 1)(req)
    wall = time.perf_counter() - t0
    if len(served) != len(backend):
        raise RuntimeError(f"{framework}: {len(served)} requests served, {len(backend)} backend calls")
    over = [s - b for s, b in zip(served, backend)]
    trajs = result.trajectories
    return {"requests": len(served), "over_median_ms": 1e3 * statistics.median(over),
            "over_mean_ms": 1e3 * statistics.mean(over), "backend_median_ms": 1e3 * statistics.median(backend),
            "wall_per_request_ms": 1e3 * wall / len(served),
            "segments": statistics.mean(t.num_segments for t in trajs),
            "env_errors": sum(t.stop_reason == StopReason.ENVIRONMENT_ERROR for t in trajs) / len(trajs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=FRAMEWORKS)
    args = parser.parse_args()
    chat = ChatFormat(build_tokenizer("qwen2_5"), [CodeInterpreter().schema()], final_answer_pattern=r"\\boxed\{",
                      calls_per_turn=2)
    print(f"{args.calls} code calls + an answer per trajectory, one agent at a time, tiny tokenizer (qwen2_5)")
    print(f"{'framework':<18s}{'requests':>9s}{'endpoint ms (median)':>22s}{'(mean)':>8s}{'backend ms':>12s}"
          f"{'wall ms/request':>17s}{'segments':>10s}{'env errors':>12s}")
    for framework in args.frameworks:
        m = measure(framework, chat, requests=args.requests, calls=args.calls)
        print(f"{framework:<18s}{m['requests']:>9d}{m['over_median_ms']:>22.2f}{m['over_mean_ms']:>8.2f}"
              f"{m['backend_median_ms']:>12.2f}{m['wall_per_request_ms']:>17.2f}{m['segments']:>10.2f}"
              f"{m['env_errors']:>12.1%}")


if __name__ == "__main__":
    main()
