"""The evaluation runs the training config's own plugins through the shared rows -> trajectories ->
scores path, and whatever a rollout plugin returns is checked at the seam, naming the plugin."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trl_plugins.rollout import MultiTurnRollout, RolloutResult
from trl_plugins.tiny import build_tiny_model, build_tokenizer
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

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # set through tool_kwargs

    def schema(self):
        return {
            "type": "function",
            "function": {
                "name": "echo",
                "description": "Echo.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            },
        }

    async def __call__(self, arguments):
        return ToolOutput(text=self.prefix + str(arguments.get("text")), ok=True)


class Length:
    def __call__(self, trajectory, example):
        return float(trajectory.num_tokens)


def _args(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        rollout="test_evaluation:RecordingRollout",
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 8, "max_trajectory_tokens": 700},
        tools=["code_interpreter", "test_evaluation:Echo"],
        tool_kwargs={"code_interpreter": {"mode": "cold"}},
        reward_components=["correct", "format", "test_evaluation:Length"],
        reward_component_weights=[1.0, 0.1, 0.0],
        system_prompt="Answer in \\boxed{}.",
        max_padded_tokens_per_micro_batch=4000,
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


ROWS = [
    {"id": "q1", "prompt": "What is 1 + 1?", "answer": "2"},
    {"id": "q2", "prompt": "What is 2 + 2?", "answer": "4"},
]


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
        (
            "test_evaluation:DroppingRollout",
            r"rollout plugin 'test_evaluation:DroppingRollout' returned 3 trajectories for 2 questions x 2",
        ),
        (
            "test_evaluation:LyingRollout",
            r"rollout plugin 'test_evaluation:LyingRollout': trajectory \(question 'q1', group 0, sample 1\), turn 0: \d+ completion tokens but \d+ behaviour log-probs",
        ),
    ],
)
def test_a_rollout_plugin_that_breaks_the_contract_is_named(tmp_path, rollout, message):
    from trl_plugins.evaluation import evaluate_policy

    tok = build_tokenizer("qwen2_5")
    with pytest.raises(TrajectoryError, match=message):
        evaluate_policy(build_tiny_model(tok), tok, ROWS, _args(tmp_path, rollout=rollout), samples=2)


# --- Uncertainty: standard errors clustered by problem, and the paired gain -------------------------------


def test_clustered_standard_error_matches_a_hand_computation():
    from trl_plugins.evaluation import clustered_se

    # 3 problems x 2 samples, correct 2, 1, 0: R = 3/6 = 0.5; x_p - R n_p = 1, 0, -1; sum of squares 2;
    # var = P/(P-1) * 2 / 6^2 = 1.5 * 2 / 36 = 1/12, se = 0.288675 = sd([1, 0.5, 0]) / sqrt(3) = 0.5 / 1.732.
    assert clustered_se([2, 1, 0], [2, 2, 2]) == pytest.approx((1 / 12) ** 0.5)
    # Wider than the binomial sqrt(0.5 * 0.5 / 6) = 0.204, which would treat the 6 samples as independent.
    assert clustered_se([2, 1, 0], [2, 2, 2]) > (0.25 / 6) ** 0.5
    # A ratio over unequal clusters: 1/1, 0/2, 1/1 -> R = 2/4; z = 0.5, -1, 0.5; 1.5 * 1.5 = 2.25; sqrt / 4 = 0.375.
    assert clustered_se([1, 0, 1], [1, 2, 1]) == pytest.approx(0.375)
    assert clustered_se([2, 2, 2], [2, 2, 2]) == 0.0  # every problem alike: no spread between problems
    assert clustered_se([1], [2]) is None and clustered_se([0, 0], [0, 0]) is None  # one problem / no samples


def _tool_traj(qid, tools):
    from trl_plugins.types import ToolCall, Trajectory, Turn

    turns = [Turn([1], [2], [-0.1], tool_calls=[ToolCall(name, {}, ok=True)]) for name in tools]
    turns.append(Turn([1], [3], [-0.1], text="\\boxed{1}"))
    return Trajectory(turns=turns, question_id=qid)


def test_summarise_gives_each_accuracy_and_pass_at_k_a_standard_error_clustered_by_problem():
    from trl_plugins.evaluation import summarise

    # a: right (tool), right (no tool); b: right (tool), wrong (tool, twice: code then echo); c: wrong, wrong (no tool).
    trajs = [
        _tool_traj("a", ["code_interpreter"]),
        _tool_traj("a", []),
        _tool_traj("b", ["code_interpreter"]),
        _tool_traj("b", ["code_interpreter", "echo"]),
        _tool_traj("c", []),
        _tool_traj("c", []),
    ]
    result = summarise(trajs, [True, True, True, False, False, False], ks=(1, 2))
    assert result.accuracy == 0.5
    # Per-problem accuracies 1, 0.5, 0: sd 0.5, / sqrt(3).
    assert result.accuracy_se == pytest.approx(0.5 / 3**0.5) and result.pass_at_k_se[1] == pytest.approx(0.5 / 3**0.5)
    # pass@2 per problem 1, 1, 0 (mean 2/3): sd sqrt(1/3) = 0.57735, / sqrt(3) = 1/3.
    assert result.pass_at_k[2] == pytest.approx(2 / 3) and result.pass_at_k_se[2] == pytest.approx(1 / 3)
    # With the tool: a 1/1, b 1/2, c 0/0 -> 2/3; z = 1/3, -1/3, 0; 1.5 * 2/9 = 1/3; sqrt / 3 = 0.19245.
    assert result.accuracy_with_tool == pytest.approx(2 / 3)
    assert result.accuracy_with_tool_se == pytest.approx((1 / 3) ** 0.5 / 3)
    # Without: a 1/1, b 0/0, c 0/2 -> 1/3; z = 2/3, 0, -2/3; 1.5 * 8/9 = 4/3; sqrt / 3 = 0.3849.
    assert result.accuracy_without_tool == pytest.approx(1 / 3)
    assert result.accuracy_without_tool_se == pytest.approx((4 / 3) ** 0.5 / 3)
    assert result.correct_by_problem == {"a": [2, 2], "b": [1, 2], "c": [0, 2]}
    assert result.tool_calls_by_tool == {"code_interpreter": pytest.approx(3 / 6), "echo": pytest.approx(1 / 6)}


def test_paired_standard_error_of_the_gain_matches_a_hand_computation():
    from trl_plugins.evaluation import clustered_se, paired_difference_se

    before = {"a": [1, 2], "b": [0, 2], "c": [1, 2], "d": [2, 2]}  # per problem 0.5, 0, 0.5, 1 (mean 0.5)
    after = {"a": [2, 2], "b": [1, 2], "c": [1, 2], "d": [2, 2]}  # 1, 0.5, 0.5, 1 (mean 0.75)
    # Changes d_p = 0.5, 0.5, 0, 0 (mean 0.25): sd = sqrt(4 * 0.25^2 / 3) = 0.288675, / sqrt(4) = 0.144338.
    assert paired_difference_se(before, after) == pytest.approx((0.25 / 3) ** 0.5 / 2)
    # Unpaired: sqrt(0.204124^2 + 0.144338^2) = 0.25, wider: pairing removes the problems' own difficulty.
    unpaired = (clustered_se([1, 0, 1, 2], [2] * 4) ** 2 + clustered_se([2, 1, 1, 2], [2] * 4) ** 2) ** 0.5
    assert unpaired == pytest.approx(0.25) and paired_difference_se(before, after) < unpaired
    assert paired_difference_se(before, {**after, "e": [1, 2]}) is None  # not the same problems: no pairing
    assert paired_difference_se(before, before) == 0.0


# --- The recipe's evaluation (its child process and retool_eval.py) with two tools and a custom reward -------


@dataclasses.dataclass
class ScriptedToolsRollout(MultiTurnRollout):
    """The built-in rollout with a scripted policy instead of the model: it runs the question's expression in
    the code interpreter, then calls ``echo``, then answers what the interpreter printed, quoting what echo
    returned (so the printed answer shows the tool outputs the policy was given)."""

    def __call__(self, request):
        import json
        import re

        from trl_plugins.rollout import ScriptedBackend

        tok = request.chat.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")

        def script(prompt):
            text = tok.decode(prompt)
            expression = re.findall(r"What is ([0-9 +*-]+)\?", text)[-1]
            outputs = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", text, re.DOTALL)
            if not outputs:
                call = {"name": "code_interpreter", "arguments": {"code": f"print({expression})"}}
            elif len(outputs) == 1:
                call = {"name": "echo", "arguments": {"text": "echo-output"}}
            else:
                answer = f"echo said {outputs[1]}. The answer is \\boxed{{{outputs[0]}}}."
                return tok(answer, add_special_tokens=False)["input_ids"] + [end]
            return tok(f"<tool_call>\n{json.dumps(call)}\n</tool_call>", add_special_tokens=False)["input_ids"] + [end]

        backend = ScriptedBackend(script, stop_token_ids=request.chat.stop_token_ids)
        return super().__call__(dataclasses.replace(request, backend=backend))


def _two_tool_run(tmp_path):
    """A saved tiny model and the recipe's arguments for a run trained with two tools and a third reward."""
    import json

    tok = build_tokenizer("qwen2_5")
    model_dir = tmp_path / "model"
    build_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    argv = [
        "--model_name_or_path",
        str(model_dir),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
        "--tools",
        "code_interpreter",
        "test_evaluation:Echo",
        "--tool_kwargs",
        json.dumps({"code_interpreter": {"mode": "cold"}, "test_evaluation:Echo": {"prefix": "kw-"}}),
        "--reward_components",
        "correct",
        "format",
        "test_evaluation:Length",
        "--reward_component_weights",
        "1.0",
        "0.1",
        "0.0",
        "--rollout",
        "test_evaluation:ScriptedToolsRollout",
        "--rollout_kwargs",
        json.dumps({"max_turns": 4, "max_assistant_tokens": 256, "max_trajectory_tokens": 4096}),
        "--max_padded_tokens_per_micro_batch",
        "8192",
        "--eval_problems",
        "3",
        "--eval_samples",
        "2",
    ]
    return model_dir, argv


def test_the_recipes_child_evaluation_uses_every_configured_tool_and_reward(tmp_path, monkeypatch, capfd):
    # The recipe's before/after path: evaluate_checkpoint in a clean child process, which imports the plugins the
    # parent named ("test_evaluation:..."; this test folder is on the parent's sys.path, not on PYTHONPATH).
    from retool.config import parse_args
    from retool.evaluate import evaluate_checkpoint
    from retool.launch import run_in_child

    monkeypatch.delenv("PYTHONPATH", raising=False)
    model_dir, argv = _two_tool_run(tmp_path)
    from trl_plugins.run import resolve_run

    script_args, training_args = parse_args(argv)
    spec = resolve_run(training_args).spec  # the child rebuilds the run from its spec (pickled), checking nothing again
    out = run_in_child(
        evaluate_checkpoint,
        str(model_dir),
        script_args,
        spec,
        ks=[1, 2],
        output_json=str(tmp_path / "eval.json"),
        what="the held-out evaluation",
    )
    # Both tools were called once per sample, and the interpreter's output was the right answer.
    assert out["tool_calls_by_tool"] == {"code_interpreter": 1.0, "echo": 1.0}
    assert out["tool_error_rate"] == 0.0 and out["accuracy"] == 1.0 and out["problems"] == 3
    printed = capfd.readouterr().out
    # The echo tool, built with its tool_kwargs (prefix "kw-"), answered the policy (the call itself says "echo-output").
    assert "echo said kw-echo-output." in printed
    assert "test_evaluation:Length=+" in printed  # the third reward component scored every sample
    assert json.loads((tmp_path / "eval.json").read_text())["tool_calls_by_tool"] == out["tool_calls_by_tool"]


def test_retool_eval_takes_the_runs_tools_and_rewards_and_refuses_unknown_ones_before_loading(tmp_path, capsys):
    import retool_eval

    model_dir, argv = _two_tool_run(tmp_path)
    out = retool_eval.main([*argv, "--output_json", str(tmp_path / "eval.json"), "--show_samples", "1"])
    assert out["tool_calls_by_tool"] == {"code_interpreter": 1.0, "echo": 1.0} and out["accuracy"] == 1.0
    printed = capsys.readouterr().out
    assert "echo said kw-echo-output." in printed and "test_evaluation:Length=+" in printed
    assert "tool calls/sample 2.00 (code_interpreter 1.00, echo 1.00)" in printed  # each tool's calls per sample

    # A tool name that resolves nowhere: refused, naming it, before the model loads (its folder is gone).
    import shutil

    shutil.rmtree(model_dir)
    bad = [a if a != "test_evaluation:Echo" else "ecko" for a in argv]
    with pytest.raises(SystemExit, match="configuration error \\(before any model loads\\): .*ecko"):
        retool_eval.main(bad)
    # A bad kwarg of a known tool is refused the same way (the tool itself refuses it when built).
    bad_kwarg = [*argv, "--tool_kwargs", json.dumps({"code_interpreter": {"timeout_s": -1}})]
    with pytest.raises(SystemExit, match="configuration error \\(before any model loads\\)"):
        retool_eval.main(bad_kwarg)
    # Settings the evaluation would ignore are refused, saying what to do instead.
    with pytest.raises(SystemExit, match="--use_peft trains a new LoRA adapter; retool_eval.py trains nothing"):
        retool_eval.main([*argv, "--use_peft"])
    with pytest.raises(SystemExit, match="not vLLM: drop --use_vllm"):
        retool_eval.main([*argv, "--use_vllm", "true"])
