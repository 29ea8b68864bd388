"""Rollout test doubles and backends: a policy scripted by a directive in the question, a fake code tool, and the
real generation backends on a tiny model."""

from __future__ import annotations

import asyncio
import re

from conftest import code_schema
from trl_plugins.rollout import ChatFormat, HFGenerationBackend, ScriptedBackend
from trl_plugins.tools.base import ToolOutput
from trl_plugins.types import SamplingSettings

SCHEMA = code_schema()


class FakeTool:
    """Async tool that sleeps, echoes (or returns a fixed text), and records its concurrency."""

    name = "code_interpreter"

    def __init__(self, delay: float = 0.0, text: str | None = None) -> None:
        self.delay, self.text = delay, text
        self.running = self.peak = self.calls = 0

    def schema(self) -> dict:
        return SCHEMA

    async def __call__(self, arguments: dict) -> ToolOutput:
        self.calls += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay)
        self.running -= 1
        return ToolOutput(text=self.text if self.text is not None else f"ran {arguments['code']}", ok=True)


def scripted(chat: ChatFormat) -> ScriptedBackend:
    """A policy driven by a directive in the question: ``calls=N``, ``invalid``, ``ramble``, ``shrug``."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        done = text.count("<tool_response>")
        if "ramble" in text:
            return tok(" word" * 200, add_special_tokens=False)["input_ids"]
        if "par=" in text:  # parallel calls: N calls in the first turn, then the answer
            n = int(re.search(r"par=(\d+)", text).group(1))
            calls = "".join(
                f'\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({k})"}}}}\n</tool_call>'
                for k in range(n)
            )
            body = f"Step {done}.{calls}" if done == 0 else "The answer is \\boxed{7}."
        elif "invalid" in text:
            body = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": \n</tool_call>'
        elif "shrug" in text:
            body = "I am not sure."
        else:
            wanted = int(re.search(r"calls=(\d+)", text).group(1))
            if done < wanted:
                body = f'Step {done}.\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({done})"}}}}\n</tool_call>'
            else:
                body = "The answer is \\boxed{7}."
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


def make_backend(kind, setup, **sampling):
    """A ``kind`` (hf or continuous_batching) generation backend on ``setup``'s tiny model."""
    tok, chat, model, _ = setup
    if kind == "continuous_batching":
        from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend, continuous_batching_config

        config = continuous_batching_config({"page_size": 16, "num_blocks": 64, "max_batch_tokens": 256})
        return ContinuousBatchingBackend(
            model, stop_token_ids=chat.stop_token_ids, sampling=SamplingSettings(**sampling), config=config
        )
    return HFGenerationBackend(
        model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=SamplingSettings(**sampling)
    )
