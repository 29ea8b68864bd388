"""The worked example in examples/trl-plugins-example, installed the way another project would be: its entry points
make ``concise``, ``calculator``, ``rank`` and ``cispo`` resolvable by name, each keeps its seam's contract, and a run
trains with all four."""

from __future__ import annotations

import asyncio
import inspect
import math
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trl_plugins.registry import ADVANTAGES, POLICY_LOSSES, REWARDS, TOOLS
from trl_plugins.rollout.validate import validate_trajectory
from trl_plugins.types import AdvantageInput, PolicyLossInput, StopReason, TokenSource, Trajectory, Turn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl-plugins-example"
PACKAGE = "trl_plugins_example"
A, O, G, P = TokenSource.ACTION, TokenSource.OBSERVATION, TokenSource.GLUE, TokenSource.PROMPT
NAN = float("nan")


def _package_modules() -> list[str]:
    return [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """examples/trl-plugins-example pip-installed into a temporary directory: no network, venv untouched."""
    root = tmp_path_factory.mktemp("example_plugin")
    src = root / "src"
    # A build writes build/ and *.egg-info next to pyproject.toml: build a copy, not the repository's folder.
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(site),
        str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture
def example(isolated_registries, example_site, monkeypatch) -> Path:
    """The installed example on ``sys.path``; registries and ``sys.modules`` are restored afterwards.

    tests/assets/plugin_dist ships a different package under the same import name, so whichever of
    the two another test imported is set aside here and put back at the end.
    """
    saved = {name: sys.modules.pop(name) for name in _package_modules()}
    monkeypatch.syspath_prepend(str(example_site))
    yield example_site
    for name in _package_modules():
        del sys.modules[name]
    sys.modules.update(saved)


def test_names_resolve_to_the_installed_classes_through_entry_points(example):
    reward_entry, tool_entry = REWARDS.entry("concise"), TOOLS.entry("calculator")
    assert reward_entry.origin == (
        "entry point concise = trl_plugins_example.rewards:ConciseReward (distribution trl-plugins-example)"
    )
    assert tool_entry.origin == (
        "entry point calculator = trl_plugins_example.tools:Calculator (distribution trl-plugins-example)"
    )
    # Discovered, not imported: entry points are loaded only when a config uses the name.
    assert not reward_entry.builtin and reward_entry.target is None and tool_entry.target is None
    assert PACKAGE not in sys.modules

    reward_cls, tool_cls = REWARDS.get("concise"), TOOLS.get("calculator")
    assert (reward_cls.__module__, reward_cls.__qualname__) == ("trl_plugins_example.rewards", "ConciseReward")
    assert (tool_cls.__module__, tool_cls.__qualname__) == ("trl_plugins_example.tools", "Calculator")
    # The installed copy, not the source folder.
    assert Path(inspect.getfile(reward_cls)).is_relative_to(example)
    assert Path(inspect.getfile(tool_cls)).is_relative_to(example)
    # Built-ins are still there next to them.
    assert {"correct", "format", "concise"} <= set(REWARDS.names())
    assert {"code_interpreter", "calculator"} <= set(TOOLS.names())


def test_the_advantage_and_the_policy_loss_resolve_through_entry_points(example):
    rank_entry, cispo_entry = ADVANTAGES.entry("rank"), POLICY_LOSSES.entry("cispo")
    assert (
        rank_entry.origin
        == "entry point rank = trl_plugins_example.advantages:RankAdvantage (distribution trl-plugins-example)"
    )
    assert (
        cispo_entry.origin
        == "entry point cispo = trl_plugins_example.losses:CISPOLoss (distribution trl-plugins-example)"
    )
    assert not rank_entry.builtin and rank_entry.target is None and cispo_entry.target is None
    assert PACKAGE not in sys.modules
    rank_cls, cispo_cls = ADVANTAGES.get("rank"), POLICY_LOSSES.get("cispo")
    assert Path(inspect.getfile(rank_cls)).is_relative_to(example) and Path(inspect.getfile(cispo_cls)).is_relative_to(
        example
    )
    assert {"group", "rloo", "gae", "rank"} <= set(ADVANTAGES.names())
    assert {"ppo_clip", "cispo"} <= set(POLICY_LOSSES.names())


def _trajectory() -> Trajectory:
    # Turn 0: 3 prompt tokens, 4 sampled. Turn 1: the prompt adds glue + 2 tool-output tokens + glue;
    # the completion has 5 tokens of which 2 are tool output spliced in (OBSERVATION): 3 sampled.
    # Action tokens: 4 + 3 = 7; completion tokens: 4 + 5 = 9.
    t0 = Turn(
        prompt_ids=[5, 6, 7], completion_ids=[10, 11, 12, 13], completion_logprobs=[-0.5] * 4, prompt_sources=[P, P, P]
    )
    t1 = Turn(
        prompt_ids=[5, 6, 7, 10, 11, 12, 13, 1, 20, 21, 2],
        completion_ids=[30, 31, 32, 33, 34],
        completion_logprobs=[-0.1, NAN, NAN, -0.2, -0.3],
        prompt_sources=[G, O, O, G],
        completion_sources=[A, O, O, A, A],
    )
    traj = Trajectory(turns=[t0, t1], question_id="q0", stop_reason=StopReason.FINAL_ANSWER)
    assert validate_trajectory(traj).num_action_tokens == 7
    return traj


@pytest.mark.parametrize(
    "budget,expected",
    [
        (256, 0.0),  # default-sized budget: far within
        (10, 0.0),  # 7 <= 10
        (7, 0.0),  # exactly at the budget (counting all 9 completion tokens would give -2/7)
        (5, -0.4),  # -(7 - 5) / 5
        (2, -2.5),  # -(7 - 2) / 2
    ],
)
def test_concise_reward_is_zero_within_budget_and_linear_beyond(example, budget, expected):
    reward = REWARDS.get("concise")(budget_tokens=budget)
    assert math.isclose(reward(_trajectory(), {"answer": "42"}), expected, abs_tol=1e-12)


def test_concise_reward_validates_and_pickles(example):
    cls = REWARDS.get("concise")
    assert cls().budget_tokens == 256
    with pytest.raises(ValueError, match="budget_tokens must be >= 1, got 0"):
        cls(budget_tokens=0)
    assert pickle.loads(pickle.dumps(cls(budget_tokens=64))) == cls(budget_tokens=64)


def test_calculator_computes_and_returns_errors_as_output(example, tmp_path, monkeypatch):
    calc = TOOLS.get("calculator")()

    def run(arguments):
        return asyncio.run(calc(arguments))

    out = run({"expression": "2 * (3 + 4)"})
    assert (out.text, out.ok, out.timed_out) == ("14", True, False)
    assert run({"expression": "2 ** 100"}).text == "1267650600228229401496703205376"  # exact, not a float
    assert run({"expression": "7 / 2"}).text == "3.5"

    monkeypatch.chdir(tmp_path)
    cases = [
        ({"expression": "__import__('os')"}, "a function call is not allowed"),
        ({"expression": "open('written_by_the_calculator', 'w')"}, "a function call is not allowed"),
        ({"expression": "2 * (3 +"}, "invalid syntax"),
        ({"expression": "1 / 0"}, "division by zero"),
        ({"expression": "x + 1"}, "the name 'x' is not allowed"),
        ({"expression": "(1).__class__"}, "attribute access ('__class__') is not allowed"),
        ({"expression": "9 ** 9 ** 9"}, "the result would exceed 4096 bits"),
        ({"expression": 14}, "argument 'expression' must be of type string"),
        ({}, "missing required argument 'expression'"),
    ]
    for arguments, why in cases:
        out = run(arguments)
        assert not out.ok and out.text.startswith("Error: ") and why in out.text, (arguments, out)
    assert not (tmp_path / "written_by_the_calculator").exists()  # nothing was executed

    calc.close()
    assert pickle.loads(pickle.dumps(calc)) == calc


def test_calculator_schema_works_with_the_chat_format_and_the_rollout(example):
    from trl_plugins.rollout import (
        ChatFormat,
        MultiTurnRollout,
        RolloutQuestion,
        RolloutRequest,
        ScriptedBackend,
        TurnKind,
    )
    from trl_plugins.tiny import build_tokenizer

    calc = TOOLS.get("calculator")()
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [calc.schema()])  # checks the template renders it, prefix-preserving
    first = chat.initial_prompt_ids([{"role": "user", "content": "What is 2 * (3 + 4)?"}])
    assert '"name": "calculator"' in tok.decode(first)  # the model is shown the tool

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * (3 + 4)"}}\n</tool_call>'
    call_ids = tok(call, add_special_tokens=False)["input_ids"] + [im_end]
    parsed = chat.parse(first, call_ids)
    assert (parsed.kind, parsed.tool_name, parsed.arguments) == (
        TurnKind.TOOL_CALL,
        "calculator",
        {"expression": "2 * (3 + 4)"},
    )
    wrong_type = tok(call.replace('"2 * (3 + 4)"', "14"), add_special_tokens=False)["input_ids"] + [im_end]
    bad = chat.parse(first, wrong_type)
    assert bad.kind == TurnKind.INVALID and "must be of type string" in bad.error

    # One trajectory through the real engine: call the calculator, then answer.
    answer_ids = tok("The answer is \\boxed{14}.", add_special_tokens=False)["input_ids"] + [im_end]
    backend = ScriptedBackend(
        lambda prompt: call_ids if len(prompt) == len(first) else answer_ids, stop_token_ids=chat.stop_token_ids
    )
    request = RolloutRequest([RolloutQuestion("q0", first, group_id=0)], 1, backend, chat, {calc.name: calc})
    (traj,) = MultiTurnRollout(max_turns=3, max_trajectory_tokens=2048)(request).trajectories
    assert traj.stop_reason == StopReason.FINAL_ANSWER and len(traj.turns) == 2
    assert (traj.turns[0].tool_call.name, traj.turns[0].tool_call.output, traj.turns[0].tool_call.ok) == (
        "calculator",
        "14",
        True,
    )
    observation = [
        t
        for t, s in zip(traj.turns[1].prompt_ids[-len(traj.turns[1].prompt_sources) :], traj.turns[1].prompt_sources)
        if s == O
    ]
    assert tok.decode(observation) == "14"

    # The concise reward on that trajectory: every completion token was sampled.
    n = len(call_ids) + len(answer_ids)
    assert traj.num_action_tokens == n
    concise = REWARDS.get("concise")
    assert concise(budget_tokens=n)(traj, {}) == 0.0
    assert math.isclose(concise(budget_tokens=n - 4)(traj, {}), -4 / (n - 4))


def test_rank_advantage_by_hand(example):
    import torch

    rank = ADVANTAGES.get("rank")
    # Group 7: rewards 0.2, 0.9, 0.9, -1.0 (n = 4, 3 others each); group 2: 3.0 alone; group 5: 0.5, 0.5.
    rewards = torch.tensor([0.2, 0.9, 0.9, -1.0, 3.0, 0.5, 0.5])
    groups = torch.tensor([7, 7, 7, 7, 2, 5, 5])
    out = rank()(AdvantageInput(rewards=rewards, group_ids=groups))
    expected = [
        (1 - 2) / 3,  # 0.2 beats -1.0, loses to both 0.9s
        (2 - 0) / 3,  # 0.9 beats 0.2 and -1.0, ties the other 0.9
        (2 - 0) / 3,
        (0 - 3) / 3,  # -1.0 loses to all three
        0.0,  # a group of one: nobody to compare with
        0.0,
        0.0,  # a tie: neither wins
    ]
    assert out.advantages.dtype == torch.float32 and out.returns is None
    assert out.advantages.tolist() == pytest.approx(expected, abs=1e-7)
    assert float(out.advantages[:4].sum()) == pytest.approx(0.0, abs=1e-7)  # a group's advantages sum to 0
    # Only the order counts: 10 * r + 3 or exp(r) give the same advantages; scale multiplies them.
    for transformed in (10 * rewards + 3, torch.exp(rewards)):
        assert (
            rank()(AdvantageInput(rewards=transformed, group_ids=groups)).advantages.tolist() == out.advantages.tolist()
        )
    scaled = rank(scale=0.5)(AdvantageInput(rewards=rewards, group_ids=groups)).advantages
    assert scaled.tolist() == pytest.approx([0.5 * a for a in expected], abs=1e-7)


def test_cispo_loss_by_hand(example):
    import torch

    from trl_plugins.algos import PPOClipLoss

    cispo = POLICY_LOSSES.get("cispo")

    def inp(**extra):
        # One row, four positions; the last is off the mask (its values, even inf, must not count).
        logp = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9]])).requires_grad_(True)
        return PolicyLossInput(
            logprobs=logp,
            behaviour_logprobs=torch.log(
                torch.tensor([[0.5, 0.125, 0.4, 0.0]])
            ),  # ratios 1, 4, 0.5 (and inf off the mask)
            advantages=torch.tensor([[1.0, 1.0, 2.0, 5.0]]),
            action_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
            **extra,
        )

    x = inp()
    out = cispo(max_weight=2.0)(x)
    # w = min(ratio, 2) = [1, 2, 0.5]; loss = -w * A * log p:
    #   -1 * 1 * log 0.5 = 0.6931,  -2 * 1 * log 0.5 = 1.3863,  -0.5 * 2 * log 0.2 = 1.6094,  off the mask 0.
    assert out.per_token_loss.tolist()[0] == pytest.approx([0.693147, 1.386294, 1.609438, 0.0], abs=1e-5)
    out.per_token_loss.sum().backward()
    # d loss / d log p = -w * A = [-1, -2, -1, 0]: the token whose ratio (4) is capped keeps a gradient.
    assert x.logprobs.grad.tolist()[0] == pytest.approx([-1.0, -2.0, -1.0, 0.0], abs=1e-6)
    s = out.stats
    assert (float(s.num_tokens), float(s.clipped_high), float(s.clipped_low)) == (3.0, 1.0, 0.0)  # one weight capped
    assert (float(s.ratio_min), float(s.ratio_max), float(s.ratio_sum)) == pytest.approx((0.5, 4.0, 5.5), abs=1e-5)
    # PPO's clip (1 + 0.28) cuts that token's gradient instead: -A * clip(4) is constant in log p there.
    y = inp()
    PPOClipLoss(clip_low=0.2, clip_high=0.28)(y).per_token_loss.sum().backward()
    assert y.logprobs.grad.tolist()[0][1] == 0.0

    # The mismatch weights multiply w: v = [0.5, 1, 1] gives gradients [-0.5, -2, -1, 0].
    z = inp(is_weights=torch.tensor([[0.5, 1.0, 1.0, 9.0]]))
    cispo(max_weight=2.0)(z).per_token_loss.sum().backward()
    assert z.logprobs.grad.tolist()[0] == pytest.approx([-0.5, -2.0, -1.0, 0.0], abs=1e-6)
    # The entropy bonus: H = [1, 2, 0.5, 7], entropy_coef 0.1 takes 0.1 * H off each action token's loss.
    bonus = cispo(max_weight=2.0, entropy_coef=0.1)(inp(entropy=torch.tensor([[1.0, 2.0, 0.5, 7.0]])))
    assert bonus.per_token_loss.tolist()[0] == pytest.approx([0.593147, 1.186294, 1.559438, 0.0], abs=1e-5)


def test_the_example_advantage_and_loss_declare_and_refuse(example):
    import torch

    from trl_plugins.protocols import as_advantage, as_policy_loss

    rank, cispo = ADVANTAGES.get("rank"), POLICY_LOSSES.get("cispo")
    # Read by the run's own adapters: class attributes (rank), a ClassVar and a property over a setting (cispo).
    declared = as_advantage(rank(), "rank")
    assert (declared.needs_values, declared.needs_groups) == (False, True)
    plain, with_bonus = as_policy_loss(cispo(), "cispo"), as_policy_loss(cispo(entropy_coef=0.01), "cispo")
    assert (plain.needs_ref_logprobs, plain.needs_entropy, plain.supports_is_weights) == (False, False, True)
    assert with_bonus.needs_entropy and with_bonus.per_token_terms
    assert "needs_values" not in vars(rank()) and "needs_ref_logprobs" not in inspect.signature(cispo).parameters
    # Pickled copies equal the originals: a plain class by its attributes, a dataclass by ==.
    assert vars(pickle.loads(pickle.dumps(rank(scale=0.5)))) == {"scale": 0.5}
    assert pickle.loads(pickle.dumps(cispo(max_weight=3.0))) == cispo(max_weight=3.0)

    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match=r"rank: scale must be a finite number > 0"):
            rank(scale=bad)
    with pytest.raises(ValueError, match=r"cispo: max_weight must be a finite number >= 1"):
        cispo(max_weight=0.5)
    with pytest.raises(ValueError, match=r"cispo: entropy_coef must be a finite number >= 0"):
        cispo(entropy_coef=-0.1)
    with pytest.raises(ValueError, match=r"cispo with entropy_coef > 0 needs the per-token entropy"):
        cispo(entropy_coef=0.1)(
            PolicyLossInput(
                logprobs=torch.zeros(1, 2),
                behaviour_logprobs=torch.zeros(1, 2),
                advantages=torch.ones(1, 2),
                action_mask=torch.ones(1, 2),
            )
        )


class ConstantReward:
    def __call__(self, trajectory, example):
        return 1.0


def test_the_run_refuses_what_the_example_plugins_cannot_have(example, tmp_path):
    # The declarations take part in the run's checks, named by their entry-point names.
    from support.trainer import tiny_config
    from trl_plugins.run import resolve_run

    # rank's needs_values = False: critic settings are refused, since no critic would run.
    with pytest.raises(
        ValueError, match=r"\['critic_learning_rate'\] configure the critic, but advantage 'rank' runs none"
    ):
        resolve_run(
            tiny_config(tmp_path, advantage="rank", critic_learning_rate=1e-4),
            reward_components={"length": ConstantReward()},
        )
    # (needs_groups = True would refuse num_generations < 2, but TRL's GRPOConfig refuses that first, for every estimator.)
    # No reference-KL term in cispo: beta > 0 with the KL in the loss is refused when the config is built.
    with pytest.raises(
        ValueError,
        match=r"needs a policy loss that takes \['kl_coef', 'kl_estimator'.*policy_loss 'cispo' "
        r"does not",
    ):
        tiny_config(tmp_path, policy_loss="cispo", beta=0.1, kl_penalty="loss")


def test_the_packages_own_contract_tests_pass_on_the_installed_copy(example):
    # examples/trl-plugins-example/tests/test_contracts.py is what the package's authors run; it resolves the
    # names through the installed entry points, so it runs here with the installed copy on sys.path.
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_contract_tests", EXAMPLE / "tests" / "test_contracts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    assert [t.__name__ for t in tests] == [
        "test_calculator_keeps_the_tool_contract",
        "test_cispo_keeps_the_policy_loss_contract",
        "test_concise_keeps_the_reward_contract",
        "test_rank_keeps_the_advantage_contract",
    ]
    for test in tests:
        test()
    assert REWARDS.entry("concise").target is not None and TOOLS.entry("calculator").target is not None  # loaded
    assert ADVANTAGES.entry("rank").target is not None and POLICY_LOSSES.entry("cispo").target is not None


def test_the_contract_checks_catch_a_broken_copy_of_the_example(example):
    # Negative control: the same checks fail on the example's plugins broken the way an author might break them.
    from trl_plugins.contracts import ContractError, check_reward_contract, check_tool_contract
    from trl_plugins.tools.base import ToolOutput

    concise, calculator = REWARDS.get("concise"), TOOLS.get("calculator")

    class PerTurnConcise(concise):
        def __call__(self, trajectory, example):
            return [super(PerTurnConcise, self).__call__(trajectory, example)] * len(trajectory.turns)

    class RaisingCalculator(calculator):
        async def __call__(self, arguments):
            return ToolOutput(text=repr(self.evaluate(arguments["expression"])), ok=True)

    with pytest.raises(
        ContractError,
        match=r"rewards plugin PerTurnConcise on the trajectory stopped by final_answer: "
        r"returned \[0.0, 0.0\] \(list\), not a number",
    ):
        check_reward_contract(PerTurnConcise())
    with pytest.raises(
        ContractError,
        match=r"tools plugin RaisingCalculator: raised KeyError: 'expression' on arguments "
        r"\{\}. A tool never raises",
    ):
        check_tool_contract(RaisingCalculator(), arguments={"expression": "6 * 7"})

    # The advantage and the policy loss, broken: a setting kept only in a lambda, a loss that forgets the mask.
    from trl_plugins.contracts import check_advantage_contract, check_policy_loss_contract
    from trl_plugins.types import PolicyLossOutput

    rank, cispo = ADVANTAGES.get("rank"), POLICY_LOSSES.get("cispo")

    class LambdaRank(rank):
        def __init__(self, scale=1.0):
            super().__init__(scale)
            self.squash = lambda r: r  # another process could not receive it

    class UnmaskedCISPO(cispo):
        def __call__(self, inp):
            out = super().__call__(inp)
            return PolicyLossOutput(per_token_loss=out.per_token_loss - 0.1 * inp.logprobs, stats=out.stats)

    with pytest.raises(
        ContractError,
        match=r"advantages plugin LambdaRank: does not pickle .* Plugins must pickle to an "
        r"equal copy: a plugin may be sent to another process",
    ):
        check_advantage_contract(LambdaRank())
    with pytest.raises(ContractError, match=r"policy_losses plugin UnmaskedCISPO: non-zero loss off the action mask"):
        check_policy_loss_contract(UnmaskedCISPO())


class CalculatorScript:
    """A rollout plugin for the test below: the multi-turn engine on a scripted policy that calls the calculator once
    per trajectory and then answers (a tiny random model never calls a tool)."""

    token_budget = 1024
    answers = ("The answer is \\boxed{42}.",)
    """What the policy says after the tool's response: the one its sampling seed picks (per trajectory and turn)."""

    def __call__(self, request):
        from trl_plugins.rollout import MultiTurnRollout, RolloutRequest, ScriptedBackend

        tok = request.chat.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'

        def script(prompt, seed):
            said = tok.decode(prompt)
            body = call if "<tool_response>" not in said else self.answers[seed % len(self.answers)]
            return tok(body, add_special_tokens=False)["input_ids"] + [end]

        backend = ScriptedBackend(script, stop_token_ids=request.chat.stop_token_ids, with_seed=True)
        scripted = RolloutRequest(
            request.questions,
            request.group_size,
            backend,
            request.chat,
            request.tools,
            policy_step=request.policy_step,
            seed=request.seed,
        )
        return MultiTurnRollout(max_turns=3, max_trajectory_tokens=self.token_budget)(scripted)


def test_a_third_party_tool_declaring_capabilities_takes_part_in_every_decision(example, tmp_path, monkeypatch, caplog):
    # The example's calculator declares idempotent, start_up(), step_metrics() with step_metric_reductions() and
    # close(): each takes part in the decision it is for, as the built-in code interpreter's do.
    import json
    import logging

    from support.trainer import TokenReward, tiny_config, tiny_dataset
    from trl_plugins.protocols import Reduction
    from trl_plugins.rollout.metrics import reduce_rank_metrics
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    calculator = TOOLS.get("calculator")
    failures, closed = [1], []  # the first call fails the way infrastructure fails (the tool raises)
    evaluate = calculator.evaluate

    def flaky(self, expression):
        if failures:
            failures.pop()
            raise ConnectionError("the calculator's backend went away")
        return evaluate(self, expression)

    monkeypatch.setattr(calculator, "evaluate", flaky)
    monkeypatch.setattr(calculator, "close", lambda self: closed.append(self.name))
    # Answers of three lengths: TokenReward tells a group's samples apart, so the run updates (one that never does fails).
    config = tiny_config(
        tmp_path,
        tools=["calculator"],
        rollout="test_example_plugin:VaryingCalculatorScript",
        rollout_kwargs={},
        max_steps=2,
        system_prompt="Use the calculator tool.",
        final_answer_pattern=r"\\boxed\{",
    )
    with caplog.at_level(logging.INFO, logger="trl_plugins.run.build"):
        run = resolve_run(config, reward_components={"length": TokenReward()})
        said = run.start_tools()  # start_up(): said before any model loads
    assert said == {"calculator": "arithmetic parsed with ast (never eval-ed), results up to 4096 bits"}
    assert "tool 'calculator': arithmetic parsed with ast" in caplog.text
    tool = run.tools["calculator"]
    assert tool.idempotent and tool.reductions == {
        "calculator/calls": Reduction.SUM,
        "calculator/errors": Reduction.SUM,
    }
    tok = build_tokenizer("qwen2_5")
    trainer = MultiTurnGRPOTrainer(build_tiny_model(tok), train_dataset=tiny_dataset(), processing_class=tok, run=run)
    trainer.train()
    records = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    ]
    # idempotent: the failed call was run again, so no trajectory ended as environment_error; 2 steps x 4
    # trajectories, one call each, plus the retried one.
    assert all(r["rollout/stop/environment_error"] == 0.0 for r in records)
    assert [r["calculator/calls"] for r in records] == [5.0, 4.0] and all(r["calculator/errors"] == 0 for r in records)
    # step_metric_reductions(): over ranks the calls add up (an undeclared metric would be averaged).
    per_rank = [{"calculator/calls": 5.0, "other/calls": 5.0}, {"calculator/calls": 4.0, "other/calls": 4.0}]
    merged = reduce_rank_metrics(per_rank, {k: str(v) for k, v in tool.reductions.items()})
    assert merged["calculator/calls"] == 9.0 and merged["other/calls"] == 4.5
    assert closed == ["calculator"]  # close(): the run closed its tools when training ended
    # Negative control: without the declaration the same failure ends the trajectory, untrained.
    monkeypatch.setattr(calculator, "idempotent", False)
    failures.append(1)
    undeclared = resolve_run(config, reward_components={"length": TokenReward()})
    assert not undeclared.tools["calculator"].idempotent
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok), train_dataset=tiny_dataset(), processing_class=tok, run=undeclared
    )
    trainer.train()
    first = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    ][2]
    assert first["rollout/stop/environment_error"] > 0.0


class VaryingCalculatorScript(CalculatorScript):
    """:class:`CalculatorScript` answering at three lengths, so that ``concise`` tells the samples of a group apart."""

    answers = (
        "\\boxed{42}",
        "The answer is \\boxed{42}.",
        "Six times seven is forty-two, so the answer is \\boxed{42}.",
    )


def test_the_example_trains_with_all_four_of_its_plugins(example, tmp_path, monkeypatch):
    # A config names the example's tool, reward, advantage and policy loss by their entry-point names, as the recipe's
    # command line would; two steps on the tiny model, the calculator called by a scripted policy.
    import json

    import torch

    from support.trainer import tiny_config, tiny_dataset
    from trl_plugins.run import resolve_run
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    cispo = POLICY_LOSSES.get("cispo")
    saw_entropy = []
    cispo_call = cispo.__call__

    def recording(self, inp):
        saw_entropy.append(inp.entropy is not None)
        return cispo_call(self, inp)

    monkeypatch.setattr(cispo, "__call__", recording)
    config = tiny_config(
        tmp_path,
        tools=["calculator"],
        reward_components=["concise"],
        reward_component_kwargs={"concise": {"budget_tokens": 16}},
        advantage="rank",
        advantage_kwargs={"scale": 0.25},
        policy_loss="cispo",
        policy_loss_kwargs={"max_weight": 2.0, "entropy_coef": 0.01},
        rollout="test_example_plugin:VaryingCalculatorScript",
        rollout_kwargs={},
        max_steps=2,
        system_prompt="Use the calculator tool.",
        final_answer_pattern=r"\\boxed\{",
    )
    run = resolve_run(config)
    assert type(run.advantage.impl) is ADVANTAGES.get("rank") and run.advantage.impl.scale == 0.25
    assert type(run.policy_loss.impl) is cispo and run.policy_loss.needs_entropy  # the property, read once
    assert type(run.tools["calculator"].impl) is TOOLS.get("calculator")
    assert [(r.name, type(r.impl)) for r in run.rewards] == [("concise", REWARDS.get("concise"))]
    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = MultiTurnGRPOTrainer(model, train_dataset=tiny_dataset(), processing_class=tok, run=run)
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))

    records = [
        json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    ]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["calculator/calls"] == 4.0 and r["rollout/stop/final_answer"] == 1.0  # 4 trajectories, one call each
        assert r["reward/concise"] < 0  # every trajectory samples more than 16 tokens
        assert "train/entropy" in r  # needs_entropy: the trainer computed the entropy the loss asked for
    # concise scored each trajectory; rank gave each, in its group of 2, 0.25 * (wins - losses) / 1.
    trajs = trainer.last_batch.trajectories
    for t in trajs:
        (component,) = t.reward_components
        assert component.name == "concise" and component.value == -(t.num_action_tokens - 16) / 16
        (other,) = [o for o in trajs if o.group_id == t.group_id and o is not t]
        assert t.advantage == 0.25 * ((t.reward > other.reward) - (t.reward < other.reward))
    assert {t.advantage for t in trajs} == {-0.25, 0.25}  # the groups' answers differ in length: no tie
    # cispo computed every micro-batch's loss, with the entropy its needs_entropy asked for.
    assert saw_entropy and all(saw_entropy)
