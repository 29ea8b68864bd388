"""Rollout benchmark: trajectories/s and tool-call concurrency, ours vs TRL GRPOTrainer's tool loop.

    python benchmarks/rollout.py [--questions 4] [--group 4] [--calls 2] [--tool-s 0.5] [--skip-trl]

Both sides run the same tiny local Qwen2 model through Hugging Face ``generate`` with a *scripted
tool-calling policy*: a logits processor forces the tokens of a fixed script (``--calls`` tool calls,
then a ``\\boxed{}`` answer), so the model's forward passes are real while its behaviour is fixed.
The tool sleeps ``--tool-s`` seconds per call (an async tool for us; a sync function for TRL, which
is what its tool loop runs one at a time). Also printed: our engine with the real sandbox
``code_interpreter`` (warm and cold) running a small computation.

``ours, continuous batching`` runs the same script through ``ContinuousBatchingBackend`` (transformers'
continuous batching, one request per turn; its sampler forces the script instead of sampling).

Our rows also print the rollout's critical path (the longest trajectory's own chain of generation and
tool calls, the floor of any schedule) and wall / critical path. gen s and tools s are wall time with
at least one generate call / tool call in flight (they overlap).

Numbers are wall-clock on a shared 2-core machine: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
import warnings

import torch

from trl_plugins.rollout import ChatFormat, HFGenerationBackend, MultiTurnRollout, RolloutQuestion, RolloutRequest
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.tools.code_interpreter import CodeInterpreter
from trl_plugins.types import SamplingSettings

SCHEMA = CodeInterpreter().schema()
CODE = "print(123 * 456 + 789)"


def script_text(prompt_text: str, calls: int, row: int = 0, vary: bool = False) -> str:
    """The scripted turn: ``calls`` tool calls, then an answer. With ``vary`` the first turn picks,
    from the row it is sampled in, a plan of 0..calls calls and a padding of reasoning text, and
    writes the plan down so later turns (re-rendered or not) follow it: a long-tailed multi-turn mix."""
    done = prompt_text.count("<tool_response>")
    filler = ""
    if vary:
        plan = re.search(r"Plan: (\d+) calls", prompt_text)
        if plan is None:
            calls, words = row % (calls + 1), (row * 7) % 11
            filler = f"Plan: {calls} calls. " + "Let me think about it carefully. " * words
        else:
            calls = int(plan.group(1))
    if done < calls:
        return (
            filler
            + f'Step {done}.\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "{CODE}"}}}}\n</tool_call>'
        )
    return filler + "The answer is \\boxed{56877}."


class ForceScript:
    """Logits processor that forces each row to emit its scripted completion, then ``<|im_end|>``.

    ``keys``: what picks each row's plan (with ``vary``); default the row's place in the batch. Our sampler's
    per-row seeds (a function of the step, question and sample) make the plan follow the trajectory, however its
    turns are batched (streaming rollouts batch differently)."""

    def __init__(self, tokenizer, calls: int, vary: bool = False, keys=None) -> None:
        self.tok, self.calls, self.vary, self.keys = tokenizer, calls, vary, keys
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.start, self.targets = None, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            self.start = input_ids.shape[1]
            pad = self.tok.pad_token_id
            self.targets = []
            for r, row in enumerate(input_ids.tolist()):
                text = self.tok.decode([t for t in row if t != pad])
                body = script_text(
                    text, self.calls, r if self.keys is None else int(self.keys[r]) % 1_000_003, self.vary
                )
                self.targets.append(self.tok(body, add_special_tokens=False)["input_ids"] + [self.im_end])
        k = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, float("-inf"))
        for r, target in enumerate(self.targets):
            forced[r, target[min(k, len(target) - 1)]] = 0.0
        return forced


def scripted_cb_sampler(tokenizer, calls: int, vary: bool = False) -> type:
    """The continuous-batching twin of :class:`ForceScript`: a sampler that forces each request's script.

    Each request's row in a forward carries its forced token (computed from the request's prompt and how
    many tokens it has generated), so the model's forward passes are real while its behaviour is fixed.
    """
    from trl_plugins.rollout import continuous_batching as cb

    base = cb._sampler_class()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets: dict[str, list[int]] = {}

    class Scripted(base):
        def prepare_tensor_args(self, requests_with_new_token):
            forced = []
            for future in requests_with_new_token:
                state = future.state
                _, prompt_len = self.rows[state.request_id]
                if state.request_id not in targets:
                    text = tokenizer.decode(state.initial_tokens[:prompt_len])
                    row = int(state.request_id.rsplit("-", 1)[1])
                    body = script_text(text, calls, row, vary)
                    targets[state.request_id] = tokenizer(body, add_special_tokens=False)["input_ids"] + [im_end]
                target = targets[state.request_id]
                forced.append(target[min(state.position_offset - prompt_len, len(target) - 1)])
            return torch.tensor(forced, dtype=torch.int32)

        def __call__(self, scores, tensor_arg):
            chosen = tensor_arg[: scores.shape[0]].to(torch.int64)[:, None]
            self.logprobs = torch.log_softmax(scores.float(), dim=-1).gather(-1, chosen).squeeze(-1)
            return torch.full_like(scores.float(), float("-inf")).scatter(-1, chosen, 0.0)

    return Scripted


def cb_backend(model, tokenizer, calls: int):
    """A ContinuousBatchingBackend whose sampler plays the script (see :func:`scripted_cb_sampler`)."""
    from trl_plugins.rollout import continuous_batching as cb

    scripted = scripted_cb_sampler(tokenizer, calls)
    cb._SeededCBSamplerCls = scripted  # the backend builds its sampler from this class
    chat = ChatFormat(tokenizer, [SCHEMA])
    config = cb.continuous_batching_config({"page_size": 32, "num_blocks": 256, "max_batch_tokens": 2048})
    return cb.ContinuousBatchingBackend(
        model, stop_token_ids=chat.stop_token_ids, sampling=SamplingSettings(), config=config
    )


def patch_generate(model, tokenizer, calls: int, vary: bool = False) -> None:
    # Every generate() call gets a fresh forcing processor (it knows each row's script from its prompt).
    from transformers import LogitsProcessorList

    original = model.generate

    def generate(*args, **kwargs):
        kwargs["logits_processor"] = LogitsProcessorList([ForceScript(tokenizer, calls, vary)])
        return original(*args, **kwargs)

    model.generate = generate


def scripted_model(model, calls: int, vary: bool = False):
    """``model`` (a tiny Qwen2) as a :class:`ScriptedQwen2`: the script is in its class and config, so a copy built
    from them (the asynchronous generation replica) plays it too; plans keyed on our sampler's per-row seeds."""
    model.__class__ = ScriptedQwen2
    model.config.script_calls, model.config.script_vary = calls, vary
    return model


def _scripted_class():
    from transformers import Qwen2ForCausalLM

    class ScriptedQwen2(Qwen2ForCausalLM):
        """A Qwen2 whose ``generate`` plays :class:`ForceScript` (see :func:`scripted_model`)."""

        def generate(self, *args, **kwargs):
            from transformers import LogitsProcessorList

            given = kwargs.get("logits_processor") or []
            seeds = next((p.seeds.tolist() for p in given if hasattr(p, "seeds")), None)
            script = ForceScript(_tokenizer(), self.config.script_calls, self.config.script_vary, keys=seeds)
            kwargs["logits_processor"] = LogitsProcessorList([script])
            return super().generate(*args, **kwargs)

    ScriptedQwen2.__module__, ScriptedQwen2.__qualname__ = __name__, "ScriptedQwen2"
    return ScriptedQwen2


_TOKENIZER = []


def _tokenizer():
    if not _TOKENIZER:
        _TOKENIZER.append(build_tokenizer("qwen2_5"))
    return _TOKENIZER[0]


ScriptedQwen2 = _scripted_class()


class SleepTool:
    name = "code_interpreter"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def schema(self) -> dict:
        return SCHEMA

    async def __call__(self, arguments: dict) -> ToolOutput:
        await asyncio.sleep(self.seconds)
        return ToolOutput(text="56877", ok=True)


def run_ours(tok, model, questions: int, group: int, calls: int, tool, backend=None) -> dict:
    chat = ChatFormat(tok, [SCHEMA])
    if backend is None:
        backend = HFGenerationBackend(
            model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=SamplingSettings()
        )
    qs = [
        RolloutQuestion(
            f"q{i}",
            chat.initial_prompt_ids([{"role": "user", "content": f"Question {i}: what is 123 * 456 + 789?"}]),
            i,
        )
        for i in range(questions)
    ]
    rollout = MultiTurnRollout(
        max_turns=calls + 2, max_tool_calls=calls + 1, max_assistant_tokens=128, max_trajectory_tokens=2048
    )
    start = time.perf_counter()
    res = rollout(RolloutRequest(qs, group, backend, chat, {"code_interpreter": tool}, seed=0))
    wall = time.perf_counter() - start
    trajs = res.trajectories
    assert all(t.stop_reason == "final_answer" for t in trajs), [t.stop_reason for t in trajs]
    assert all(t.num_tool_calls == calls for t in trajs)
    return dict(
        wall=wall,
        gen=res.generation_s,
        tools=res.tools_s,
        n=len(trajs),
        calls=sum(t.num_tool_calls for t in trajs),
        conc=res.max_concurrent_tool_calls,
        crit=res.critical_path_s,
    )


def run_trl(tok, model, questions: int, group: int, calls: int, tool_s: float) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def code_interpreter(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: The Python code to run.
        """
        time.sleep(tool_s)
        return "56877"

    counter = {"calls": 0}
    tool = code_interpreter

    def counting_tool(code: str) -> str:
        """Run Python code and return what it prints.

        Args:
            code: The Python code to run.
        """
        counter["calls"] += 1
        return tool(code)

    counting_tool.__name__ = "code_interpreter"
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"Question {i}: what is 123 * 456 + 789?"}]} for i in range(questions)]
    )
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=questions * group,
            num_generations=group,
            max_completion_length=1024,
            max_steps=1,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            max_tool_calling_iterations=calls + 1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=args,
            train_dataset=data,
            processing_class=tok,
            tools=[counting_tool],
        )
        timing = {}
        original = trainer._generate_and_score_completions

        def timed(inputs):
            start = time.perf_counter()
            result = original(inputs)
            timing["wall"] = time.perf_counter() - start
            return result

        trainer._generate_and_score_completions = timed
        trainer.train()
    return dict(
        wall=timing["wall"], gen=float("nan"), tools=float("nan"), n=questions * group, calls=counter["calls"], conc=1
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2, help="tool calls per trajectory")
    ap.add_argument("--tool-s", type=float, default=0.5, help="seconds per tool call")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-sandbox", action="store_true")
    ap.add_argument("--skip-cb", action="store_true", help="skip the continuous-batching backend's row")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    tok = build_tokenizer("qwen2_5")
    rows = []
    model = build_tiny_model(tok)
    patch_generate(model, tok, args.calls)
    rows.append(
        ("ours, concurrent tools", run_ours(tok, model, args.questions, args.group, args.calls, SleepTool(args.tool_s)))
    )
    if not args.skip_cb:
        model = build_tiny_model(tok)
        backend = cb_backend(model, tok, args.calls)
        run_ours(tok, model, 1, 1, args.calls, SleepTool(0.0), backend=backend)  # warm-up: builds the manager
        rows.append(
            (
                "ours, continuous batching",
                run_ours(tok, model, args.questions, args.group, args.calls, SleepTool(args.tool_s), backend=backend),
            )
        )
    if not args.skip_trl:
        model = build_tiny_model(tok)
        patch_generate(model, tok, args.calls)
        rows.append(
            ("TRL GRPOTrainer tool loop", run_trl(tok, model, args.questions, args.group, args.calls, args.tool_s))
        )
    if not args.skip_sandbox:
        for mode in ("warm", "cold"):
            tool = CodeInterpreter(mode=mode, max_concurrency=8)
            model = build_tiny_model(tok)
            patch_generate(model, tok, args.calls)
            if mode == "warm":
                tool.sandbox.warm_up()  # start the interpreters outside the timing
            rows.append((f"ours, sandbox {mode}", run_ours(tok, model, args.questions, args.group, args.calls, tool)))
            tool.close()

    n = args.questions * args.group
    print(
        f"{args.questions} questions x group {args.group} = {n} trajectories, {args.calls} tool calls each "
        f"({n * args.calls} calls), sleep tool {args.tool_s} s/call, tiny Qwen2 on CPU, torch threads=1"
    )
    header = (
        f"{'rollout':<28} {'wall s':>8} {'traj/s':>8} {'gen s':>7} {'tools s':>8} {'calls':>6} {'max conc':>9} "
        f"{'crit. path s':>13} {'wall/crit':>10}"
    )
    print(header)
    print("-" * len(header))
    base = rows[0][1]["wall"]
    for name, r in rows:
        crit = f"{r['crit']:>13.2f} {r['wall'] / r['crit']:>10.2f}" if r.get("crit") else f"{'-':>13} {'-':>10}"
        print(
            f"{name:<28} {r['wall']:>8.2f} {r['n'] / r['wall']:>8.2f} {r['gen']:>7.2f} {r['tools']:>8.2f} {r['calls']:>6} {r['conc']:>9} {crit}"
        )
    trl = [r for name, r in rows if name.startswith("TRL")]
    if trl:
        print(f"TRL wall / ours wall = {trl[0]['wall'] / base:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
