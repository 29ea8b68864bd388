"""The contract check of rollout plugins, on a scripted tool-calling policy."""

from __future__ import annotations

from typing import Any, Mapping

from trl_plugins.contracts._base import check, check_pickles, read_declarations, resolve_plugin
from trl_plugins.protocols import as_rollout
from trl_plugins.tiny import build_tokenizer

__all__ = ["check_rollout_contract"]


def check_rollout_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """A rollout: declares ``token_budget``; on a scripted tool-calling policy it returns
    ``len(questions) * group_size`` trajectories, question-major, each passing
    :func:`~trl_plugins.rollout.validate.validate_trajectory` and within the token budget.
    """
    from trl_plugins.registry import ROLLOUTS
    from trl_plugins.rollout import ChatFormat, RolloutRequest, ScriptedBackend, questions_from_rows
    from trl_plugins.rollout.validate import validate_trajectory
    from trl_plugins.tools.base import ToolOutput

    label, rollout = resolve_plugin(ROLLOUTS, plugin, kwargs)
    budget = read_declarations(as_rollout, rollout, label).token_budget  # a positive int or None

    class EchoTool:
        name = "echo"

        def schema(self) -> dict:
            return {
                "type": "function",
                "function": {
                    "name": "echo",
                    "description": "Echo the text.",
                    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
                },
            }

        async def __call__(self, arguments: dict) -> ToolOutput:
            return ToolOutput(text=str(arguments.get("text")) + "\n", ok=True)

    tool = EchoTool()
    chat = ChatFormat(build_tokenizer("qwen2_5"), [tool.schema()])
    tok = chat.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        if tok.decode(prompt).count("<tool_response>") < 1:
            body = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
        else:
            body = "The answer is \\boxed{1}."
        return tok(body, add_special_tokens=False)["input_ids"] + [end]

    rows = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Say hi twice."}]
    request = RolloutRequest(
        questions_from_rows(chat, rows),
        2,
        ScriptedBackend(script, stop_token_ids=chat.stop_token_ids),
        chat,
        {"echo": tool},
    )
    result = rollout(request)
    trajs = result.trajectories
    check(len(trajs) == 4, label, f"returned {len(trajs)} trajectories for 2 questions x 2 samples")
    check([t.question_id for t in trajs] == ["a", "a", "b", "b"], label, "trajectories are not question-major")
    for t in trajs:
        validate_trajectory(t)
        if budget is not None:
            check(t.num_tokens <= budget, label, f"a trajectory of {t.num_tokens} tokens exceeds token_budget {budget}")
    check_pickles(rollout, label)
