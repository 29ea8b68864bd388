"""The evaluation runs the training config's own plugins through the shared rows -> trajectories ->
scores path, and whatever a rollout plugin returns is checked at the seam, naming the plugin."""

from __future__ import annotations

import dataclasses

import pytest

from trl_plugins.rollout import MultiTurnRollout, RolloutResult
from trl_plugins.testing import build_tiny_model, build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.types import TrajectoryError

CALLS: list[str] = []


@dataclasses.dataclass
class RecordingRollout(MultiTurnRollout):
    """The built-in rollout, recording that it was the one called."""

    def __call__(self, request):
        CALLS.append(f"rollout:{sorted(request.tools)}")
        return super().__call__(request)


@dataclasses.dataclass
class DroppingRollout(MultiTurnRollout):
    """Breaks the contract: returns one trajectory too few."""

    def __call__(self, request):
        result = super().__call__(request)
        return RolloutResult(trajectories=result.trajectories[:-1])


@dataclasses.dataclass
class LyingRollout(MultiTurnRollout):
    """Breaks the contract: one behaviour log-prob too many in a completion."""

    def __call__(self, request):
        result = super().__call__(request)
        result.trajectories[1].turns[0].completion_logprobs.append(-0.1)
        return result


class Echo:
    name = "echo"

    def schema(self):
        return {"type": "function", "function": {"name": "echo", "description": "Echo.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    async def __call__(self, arguments):
        return ToolOutput(text=str(arguments.get("text")), ok=True)


class Length:
    def __call__(self, trajectory, example):
        return float(trajectory.num_tokens)


def _args(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True, bf16=False,
        report_to=[], rollout="test_evaluation:RecordingRollout",
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 8, "max_trajectory_tokens": 700},
        tools=["code_interpreter", "test_evaluation:Echo"], tool_kwargs={"code_interpreter": {"mode": "cold"}},
        reward_components=["correct", "format", "test_evaluation:Length"], reward_component_weights=[1.0, 0.1, 0.0],
        system_prompt="Answer in \\boxed{}.", max_padded_tokens_per_micro_batch=4000,
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


ROWS = [{"id": "q1", "prompt": "What is 1 + 1?", "answer": "2"}, {"id": "q2", "prompt": "What is 2 + 2?", "answer": "4"}]


def test_evaluation_uses_the_configured_rollout_tools_and_every_reward_component(tmp_path):
    from trl_plugins.evaluation import evaluate_policy

    tok = build_tokenizer("qwen2_5")
    CALLS.clear()
    result, trajs = evaluate_policy(build_tiny_model(tok), tok, ROWS, _args(tmp_path), samples=2, ks=(1, 2), seed=0)
    assert CALLS == ["rollout:['code_interpreter', 'echo']"]  # the configured rollout, with both tools
    assert result.problems == 2 and result.samples == 2 and len(trajs) == 4
    for traj in trajs:
        assert [c.name for c in traj.reward_components] == ["correct", "format", "test_evaluation:Length"]
        assert traj.reward_component("test_evaluation:Length").value == traj.num_tokens
    # The system prompt of the config is in every prompt.
    assert all("Answer in" in tok.decode(t.turns[0].prompt_ids) for t in trajs)
    assert result.accuracy == sum(t.reward_component("correct").value == 1.0 for t in trajs) / 4


def test_evaluation_refuses_a_config_without_its_success_component(tmp_path):
    from trl_plugins.evaluation import evaluate_policy

    tok = build_tokenizer("qwen2_5")
    args = _args(tmp_path, reward_components=["format"], reward_component_weights=[1.0])
    with pytest.raises(ValueError, match="reward component 'correct', which is not among"):
        evaluate_policy(build_tiny_model(tok), tok, ROWS, args)
    with pytest.raises(ValueError, match="'format' has no is_success"):
        evaluate_policy(build_tiny_model(tok), tok, ROWS, args, success_component="format")


@pytest.mark.parametrize(
    "rollout, message",
    [
        ("test_evaluation:DroppingRollout", r"rollout plugin 'test_evaluation:DroppingRollout' returned 3 trajectories for 2 questions x 2"),
        ("test_evaluation:LyingRollout", r"rollout plugin 'test_evaluation:LyingRollout': trajectory \(question 'q1', group 0, sample 1\), turn 0: \d+ completion tokens but \d+ behaviour log-probs"),
    ],
)
def test_a_rollout_plugin_that_breaks_the_contract_is_named(tmp_path, rollout, message):
    from trl_plugins.evaluation import evaluate_policy

    tok = build_tokenizer("qwen2_5")
    with pytest.raises(TrajectoryError, match=message):
        evaluate_policy(build_tiny_model(tok), tok, ROWS, _args(tmp_path, rollout=rollout), samples=2)
