"""The ReTool agent written with DSPy as its docs teach: a ``dspy.ReAct`` program with a tool, on a ``dspy.LM`` pointed
at the endpoint (``openai/<name>`` with ``api_base`` and ``api_key``), with DSPy's response cache turned off.

DSPy runs in the interpreter AutoGen's example uses (constraints/autogen.txt: its pins resolve with AutoGen's):

    python3 -m venv .venv-autogen && .venv-autogen/bin/pip install -q -r constraints/autogen.txt
    accelerate launch recipes/retool_ppo.py --config examples/agents/dspy/retool_agent.yaml

**The cache.** ``dspy.LM`` caches every completion, in memory and on disk (``~/.dspy_cache``), under a key that leaves
out ``api_base``, ``base_url`` and ``api_key``: a request the program has made before, in an earlier run, step or
sample, against any model, is answered from the cache and never reaches the endpoint, so the policy never samples it
and nothing is trained from it (the endpoint ends such a trajectory as ``environment_error``, naming this). A program
pointed at a policy in training builds its LM with ``cache=False``, as here.

The endpoint starts it with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (this trajectory's) and the row as JSON on its
stdin; it prints its reward as its last line. The tool is the run's ``code_interpreter`` (the recipe's sandbox),
asked for through the endpoint's tools route (docs/agents.md#the-runs-tools), since this interpreter has no
trl_plugins.
"""

from __future__ import annotations

import json
import os
import re
import sys

import dspy
import openai

INSTRUCTIONS = (
    "You solve maths problems. You may run Python with the code_interpreter tool. End with the final answer as "
    "\\boxed{...}."
)
"""The program's instructions (DSPy writes the rest of the prompt from its signature)."""

_tools: openai.OpenAI | None = None


def code_interpreter(code: str) -> str:
    """Run Python 3 code and return what it prints. Each call starts from a fresh interpreter; the value of the last expression is printed. numpy and sympy are available."""  # noqa: E501 - the tool's description, one line
    global _tools
    if _tools is None:
        _tools = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: this trajectory's session
    reply = _tools.post("tools/call", cast_to=object, body={"name": "code_interpreter", "arguments": {"code": code}})
    return reply["content"]


def build_lm(*, cache: bool = False) -> dspy.LM:
    """DSPy's LM on the endpoint; ``cache=True`` is DSPy's default, the trap above. ``engine="lm15"``: DSPy's own
    client; its default (``auto``) hands a model to LiteLLM wherever ``OPENAI_BASE_URL`` is set, as it is for every
    command the endpoint runs, and importing LiteLLM costs ~3 s of CPU per process and fetches a price list from the
    network (retried, then given up offline) unless ``LITELLM_LOCAL_MODEL_COST_MAP=True``."""
    return dspy.LM(
        "openai/policy",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        cache=cache,
        num_retries=0,
        engine="lm15",
    )


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


def solve(row: dict, lm: dspy.LM) -> float:
    """Run the ReAct program on the row's question; 1.0 when its answer is the row's."""
    signature = dspy.Signature("question -> answer", INSTRUCTIONS)
    program = dspy.ReAct(signature, tools=[code_interpreter], max_iters=4)
    with dspy.context(lm=lm):
        prediction = program(question=row["prompt"])
    return score(prediction.answer, row)


if __name__ == "__main__":
    print(json.dumps(solve(json.load(sys.stdin), build_lm())))
