"""The rendering replay: a trajectory's parsed conversation re-rendered with the chat template, and why it differs."""

from __future__ import annotations

import pytest

from conftest import code_schema
from trl_plugins.replay.rollout_check import RenderReplayError, replay_rendering
from trl_plugins.rollout import ChatFormat
from trl_plugins.tiny import build_tokenizer
from trl_plugins.types import StopReason, ToolCall, Trajectory, Turn

CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(build_tokenizer("qwen3"), [code_schema()])  # thinking on: the model writes <think> itself


def _trajectory(chat, first: str, final: str) -> Trajectory:
    """A call turn whose text is ``first`` + the call, the tool's "42\\n", and a final turn ``final``."""
    tok = chat.tokenizer
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    p1 = chat.initial_prompt_ids(MESSAGES)
    c1 = tok(first + CALL, add_special_tokens=False)["input_ids"] + end
    call = ToolCall("code_interpreter", {"code": "print(6 * 7)"}, output="42\n", ok=True)
    p2 = p1 + c1 + chat.tool_turn(c1, call.output, tool_name=call.name, arguments=call.arguments).ids
    c2 = tok(final, add_special_tokens=False)["input_ids"] + end
    return Trajectory(
        [Turn(p1, c1, [0.0] * len(c1), tool_calls=[call]), Turn(p2, c2, [0.0] * len(c2))],
        stop_reason=StopReason.FINAL_ANSWER,
    )


THOUGHT = "<think>\nI will compute it.\n</think>\n\n"
ANSWER = "The answer is \\boxed{42}."


def test_a_conversation_the_template_would_write_replays_to_its_tokens(chat):
    # Negative control for the two cases below: the same conversation, written as the template writes it.
    traj = _trajectory(chat, THOUGHT, THOUGHT + ANSWER)
    full = traj.turns[-1].prompt_ids + traj.turns[-1].completion_ids
    assert replay_rendering(chat, traj, MESSAGES)[: len(full)] == full


def test_a_final_turn_without_thinking_is_named_with_the_block_the_template_adds(chat):
    traj = _trajectory(chat, THOUGHT, ANSWER)  # the model skipped thinking in its final turn
    with pytest.raises(RenderReplayError) as info:
        replay_rendering(chat, traj, MESSAGES)
    msg = str(info.value)
    assert msg.startswith("assistant turn 2 of 2 (its final turn) was sampled without a reasoning block"), msg
    assert "'<think>\\n\\n</think>\\n\\n'" in msg  # what the template renders there
    assert "train from them (build_datum)" in msg


@pytest.mark.parametrize(
    "turn,first,final",
    [
        (2, THOUGHT, "<think>\n\nI will check it.\n\n</think>\n\n" + ANSWER),
        (1, "<think>\n\nI will compute it.\n\n</think>\n\n", THOUGHT + ANSWER),
    ],
)
def test_extra_newlines_inside_a_think_block_are_named_with_both_writings(chat, turn, first, final):
    traj = _trajectory(chat, first, final)
    with pytest.raises(RenderReplayError) as info:
        replay_rendering(chat, traj, MESSAGES)
    msg = str(info.value)
    assert msg.startswith(f"assistant turn {turn} of 2") and "whitespace inside its reasoning block" in msg, msg
    assert "2 extra newline(s)" in msg
    thought = "I will check it." if turn == 2 else "I will compute it."
    assert f"sampled '<think>\\n\\n{thought}\\n\\n</think>\\n\\n'" in msg
    assert f"the template writes '<think>\\n{thought}\\n</think>\\n\\n'" in msg


def test_the_first_prompt_must_come_from_the_messages_given(chat):
    traj = _trajectory(chat, THOUGHT, THOUGHT + ANSWER)
    with pytest.raises(RenderReplayError, match="first prompt is not the rendering of the messages given"):
        replay_rendering(chat, traj, [{"role": "user", "content": "Another question?"}])
