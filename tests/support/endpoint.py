"""The agent endpoint's test world: its chat format, a policy scripted by the question, an echoing code tool, rollout
requests, and a plain OpenAI-SDK agent."""

from __future__ import annotations

import json
import re

from conftest import code_schema
from trl_plugins.rollout import ChatFormat, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import ToolOutput

SCHEMA = code_schema()


class EchoTool:
    """The built-in rollout's side of the comparison: what the agents below compute for a call."""

    name = "code_interpreter"

    def schema(self) -> dict:
        return SCHEMA

    async def __call__(self, arguments: dict) -> ToolOutput:
        return ToolOutput(text=run_code(arguments), ok=True)


def run_code(arguments: dict) -> str:
    """The echo code tool's answer to ``arguments``: ``ran <code>``."""
    return f"ran {arguments['code']}"


def endpoint_chat() -> ChatFormat:
    """The chat format the endpoint tests share: two calls per turn, answers in ``\\boxed{}``."""
    return ChatFormat(build_tokenizer("qwen2_5"), [SCHEMA], final_answer_pattern=r"\\boxed\{", calls_per_turn=2)


def policy(chat: ChatFormat, *, delay: float = 0.0) -> ScriptedBackend:
    """Scripted samples driven by the question: ``calls=N`` tool calls then ``\\boxed{7}``; ``think`` opens each turn
    with a reasoning block; ``badjson`` writes a malformed call; ``par=N`` makes N calls in one turn; ``ramble`` never
    stops."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        if delay:
            import time

            time.sleep(delay)
        text = tok.decode(prompt)
        done = text.count("<tool_response>")
        question = re.findall(r"user\n(.*?)<\|im_end\|>", text, re.DOTALL)[0]
        think = "<think>I should compute.</think>\n" if "think" in question else ""
        if "ramble" in question:
            return tok(" word" * 300, add_special_tokens=False)["input_ids"]
        if "badjson" in question:
            body = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": \n</tool_call>'
        elif "par=" in question and done == 0:
            n = int(re.search(r"par=(\d+)", question).group(1))
            body = "".join(
                f'\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "print({k})"}}}}\n</tool_call>'
                for k in range(n)
            )
        else:
            wanted = int((re.search(r"calls=(\d+)", question) or re.search("(0)", "0")).group(1))
            if done < wanted:
                body = (
                    f'{think}Step {done}.\n<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": '
                    f'"print({done})"}}}}\n</tool_call>'
                )
            else:
                follow = text.count("Are you sure?")
                body = f"{think}The answer is \\boxed{{{7 + follow}}}."
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


def questions(chat: ChatFormat, prompts: list[str]) -> list[RolloutQuestion]:
    """One rollout question per prompt, rendered by ``chat``, with the prompt as its row."""
    return [
        RolloutQuestion(f"q{i}", chat.initial_prompt_ids([{"role": "user", "content": p}]), i, row={"prompt": p})
        for i, p in enumerate(prompts)
    ]


def request(chat, prompts, *, group_size=1, backend=None, **kwargs) -> RolloutRequest:
    """A rollout request for ``prompts`` with the scripted policy and the echo code tool, at policy step 2, seed 5."""
    return RolloutRequest(
        questions(chat, prompts),
        group_size,
        backend or policy(chat),
        chat,
        {"code_interpreter": EchoTool()},
        policy_step=2,
        seed=5,
        **kwargs,
    )


async def tool_agent(client, row):
    """A plain OpenAI-SDK agent: call the model, run each tool call it makes, send the result back, until it answers."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA])
        message = response.choices[0].message
        messages.append(message)  # the SDK's own message object, re-serialised by the SDK
        if not message.tool_calls:
            return 1.0 if "\\boxed{7}" in (message.content or "") else 0.0
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": run_code(json.loads(call.function.arguments))}
            )
