"""Contract tests over every registry entry, third-party ones included, through the same checks
plugin authors run (`trl_plugins.contracts`): shapes, finiteness, masked tokens get zero gradient, plans
are valid partitions, capabilities declared, plugins pickle. Each check is also shown to fail."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import ASSETS
from support.judges import scripted_judge as scripted_judge_module
from support.tools import EchoTool, MedianTool, RaisingTool, echo_schema
from trl_plugins.contracts import (
    ContractError,
    check_advantage_contract,
    check_packer_contract,
    check_policy_loss_contract,
    check_reward_contract,
    check_rollout_contract,
    check_tool_contract,
)
from trl_plugins.registry import ADVANTAGES, PACKERS, POLICY_LOSSES, REWARDS, ROLLOUTS, TOOLS
from trl_plugins.tools.base import ToolOutput
from trl_plugins.types import AdvantageOutput, PackPlan, PolicyLossOutput


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantage_plugins(name):
    check_advantage_contract(name)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_plugins(name):
    check_policy_loss_contract(name)


@pytest.mark.parametrize("name", PACKERS.names())
def test_packer_plugins(name):
    check_packer_contract(name)


@pytest.mark.parametrize("name", REWARDS.names())
def test_reward_plugins(name):
    # agent_reward scores with what the agent returned, else the row's reward: this row gives one.
    example = {"answer": "42", "prompt": "What is 6 * 7?", "reward": 0.5} if name == "agent_reward" else None
    if name == "reasoning_gym":  # scores reasoning-gym entries: a row with the entry's metadata (source_dataset)
        rg = pytest.importorskip("reasoning_gym")
        entry = rg.create_dataset("chain_sum", size=1, seed=0)[0]
        example = {
            "prompt": entry["question"],
            "answer": "42",
            "metadata": {**entry["metadata"], "source_dataset": "chain_sum"},
        }
    if name == "judge":  # calls an LLM judge: the scripted one on loopback (examples/judges/scripted_judge.py)
        scripted_judge = scripted_judge_module()
        server, _ = scripted_judge.serve(0)
        try:
            url = f"http://127.0.0.1:{server.server_port}/v1"
            check_reward_contract(name, {"base_url": url, "model": "scripted-judge", "cache_path": None})
        finally:
            server.shutdown()
        return
    if name == "reward_model":  # scores with a model: a tiny local one (tests/support/reward_model.py)
        import tempfile

        from support.reward_model import save_reward_model

        with tempfile.TemporaryDirectory() as folder:
            check_reward_contract(name, {"model": save_reward_model(folder)})
        return
    check_reward_contract(name, example=example)


async def echo_agent(client, row):
    """An OpenAI-SDK agent for the contract's scripted policy: it offers the echo tool and runs its calls."""
    schema = {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Echo the text.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    }
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        message = (
            (await client.chat.completions.create(model="m", messages=messages, tools=[schema])).choices[0].message
        )
        messages.append(message)
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": json.loads(call.function.arguments)["text"] + "\n"}
            )


@pytest.mark.parametrize("name", TOOLS.names())
def test_tool_plugins(name):
    kwargs = {"mode": "cold"} if name == "code_interpreter" else None  # cold: no pool of warm interpreters to start
    if name == "mcp":  # a real stdio server (tests/mcp_servers/toy.py), two of its tools
        kwargs = {
            "mcpServers": {
                "toy": {"command": sys.executable, "args": [str(Path(__file__).parent / "mcp_servers" / "toy.py")]}
            },
            "include": ["add", "greet"],
        }
    check_tool_contract(name, kwargs)


@pytest.mark.parametrize("name", ROLLOUTS.names())
def test_rollout_plugins(name):
    if name == "verifiers":
        pytest.skip(
            "needs a verifiers environment and its interpreter: tests/test_verifiers_env.py runs the contract "
            "on one (test_the_rollout_meets_the_rollout_contract)"
        )
    check_rollout_contract(name, {"agent": echo_agent} if name == "agent_endpoint" else None)


def test_third_party_plugins_meet_the_contract(isolated_registries, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "plugin_dist"))
    third_party = [n for n in PACKERS.names() if not PACKERS.entry(n).builtin]
    assert third_party == ["one_per_batch"]
    for name in third_party:
        check_packer_contract(name)


# -- negative controls: each check catches a broken plugin -----------------------------------------


@dataclasses.dataclass
class _LeakyLoss:
    needs_ref_logprobs = False
    needs_entropy = False

    def __call__(self, inp):
        loss = -(inp.logprobs * inp.advantages)  # no mask: gradient reaches masked tokens
        return PolicyLossOutput(per_token_loss=loss * inp.action_mask + 0 * loss.detach(), stats=None)


@dataclasses.dataclass
class _UnmaskedLoss(_LeakyLoss):
    def __call__(self, inp):
        return PolicyLossOutput(per_token_loss=-(inp.logprobs * (inp.advantages + 1.0)), stats=None)


@dataclasses.dataclass
class _UndeclaredAdvantage:
    def __call__(self, inp):
        return AdvantageOutput(advantages=inp.rewards)


@dataclasses.dataclass
class _OffMaskAdvantage(_UndeclaredAdvantage):
    needs_values = False
    needs_groups = False

    def __call__(self, inp):
        return AdvantageOutput(advantages=torch.ones_like(inp.action_mask))


def _overfull(lengths, *, max_items, max_padded_tokens, world_size=1):
    return PackPlan([[list(range(len(lengths)))] for _ in range(world_size)])


class _NanReward:
    def __call__(self, trajectory, example):
        return float("nan")


class _MutatingReward:
    def __call__(self, trajectory, example):
        trajectory.advantage = 99.0
        return 1.0


class _StrReward:
    def __call__(self, trajectory, example):
        return "42"  # the extracted answer instead of a score


class _ListReward:
    def __call__(self, trajectory, example):
        return [1.0, 0.0]  # one score per turn instead of one per trajectory


class _BoolReward:
    def __call__(self, trajectory, example):
        return trajectory.stop_reason == "final_answer"


class _RaisesWithoutAnswer:
    def __call__(self, trajectory, example):
        return float(trajectory.turns[-1].text.split("\\boxed{")[1].split("}")[0])  # IndexError without a box


class _ExampleMutatingReward:
    def __call__(self, trajectory, example):
        example.pop("answer", None)
        return 0.0


class _NoisyReward:
    def __init__(self):
        self.calls = 0

    def __call__(self, trajectory, example):
        self.calls += 1
        return float(self.calls)


class _VagueSuccess:
    def __call__(self, trajectory, example):
        return 1.0

    def is_success(self, value):
        return "yes" if value > 0 else ""


class _NoSchemaTool:
    name = "schemaless"

    async def __call__(self, arguments):
        return ToolOutput(text="", ok=True)


class _MisnamedTool(RaisingTool):
    def schema(self):
        return echo_schema(name="other")


class _UndescribedTool(RaisingTool):
    def schema(self):
        schema = echo_schema()
        del schema["function"]["description"]
        return schema


class _StringTool(RaisingTool):
    async def __call__(self, arguments):
        return str(arguments.get("text"))


class _SyncTool(RaisingTool):
    def __call__(self, arguments):
        return ToolOutput(text="", ok=True)


class _AcceptsAnythingTool(RaisingTool):
    async def __call__(self, arguments):
        return ToolOutput(text=str(arguments), ok=True)


class _BlamesInfraTool(RaisingTool):
    async def __call__(self, arguments):
        if not isinstance(arguments.get("text"), str):
            return ToolOutput(text="", ok=False, infra_error="bad arguments")
        return ToolOutput(text=arguments["text"], ok=True)


class _CloseOnceTool(EchoTool):
    def __init__(self):
        self.closed = False

    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class _NoBudgetRollout:
    def __call__(self, request):
        raise AssertionError("never called")


@pytest.mark.parametrize(
    "check, plugin, message",
    [
        (check_policy_loss_contract, _UnmaskedLoss(), "non-zero loss off the action mask"),
        (
            check_advantage_contract,
            _UndeclaredAdvantage(),
            "_UndeclaredAdvantage: does not declare needs_values \\(a bool\\)",
        ),
        (check_advantage_contract, _OffMaskAdvantage(), "non-zero advantage off the action mask"),
        (check_packer_contract, _overfull, "items > 7"),
        (check_rollout_contract, _NoBudgetRollout(), "_NoBudgetRollout: does not declare token_budget"),
    ],
    ids=["loss-off-mask", "advantage-undeclared", "advantage-off-mask", "packer-limits", "rollout-no-budget"],
)
def test_each_contract_check_can_fail(check, plugin, message):
    with pytest.raises(ContractError, match=message):
        check(plugin)


@pytest.mark.parametrize(
    "plugin, message",
    [
        (
            _NanReward(),
            r"rewards plugin _NanReward on the trajectory stopped by final_answer: returned nan; a reward must be finite",
        ),
        (
            _MutatingReward(),
            r"_MutatingReward on the trajectory stopped by final_answer: changed the trajectory it scored",
        ),
        (_StrReward(), r"_StrReward on the trajectory stopped by final_answer: returned '42' \(str\), not a number"),
        (
            _ListReward(),
            r"_ListReward on the trajectory stopped by final_answer: returned \[1.0, 0.0\] \(list\), not a number; "
            r"a component scores one trajectory with one float",
        ),
        (
            _BoolReward(),
            r"_BoolReward on the trajectory stopped by final_answer: returned True, a bool; return a float",
        ),
        (
            _RaisesWithoutAnswer(),
            r"_RaisesWithoutAnswer on the trajectory without an answer: raised IndexError: .* "
            r"The trainer would end the trajectory as verifier_error",
        ),
        (
            _ExampleMutatingReward(),
            r"_ExampleMutatingReward on the trajectory stopped by final_answer: changed the example",
        ),
        (
            _NoisyReward(),
            r"_NoisyReward on the trajectory stopped by final_answer: returned 1.0 and then 2.0 for the same "
            r"trajectory",
        ),
        (_VagueSuccess(), r"_VagueSuccess: is_success\(1.0\) returned 'yes', not a bool"),
    ],
    ids=[
        "nan",
        "mutates-trajectory",
        "str",
        "list",
        "bool",
        "raises-without-answer",
        "mutates-example",
        "nondeterministic",
        "is-success-not-bool",
    ],
)
def test_reward_contract_catches(plugin, message):
    with pytest.raises(ContractError, match=message):
        check_reward_contract(plugin)


class _PlainScaledAdvantage:
    """A plain callable class, not a dataclass (so no __eq__), declaring its capabilities as class attributes."""

    needs_values = False
    needs_groups = False

    def __init__(self, scale=2.0):
        self.scale = scale
        self.offsets = {"bias": torch.tensor([0.0])}  # nested state: compared value by value

    def __call__(self, inp):
        return AdvantageOutput(advantages=inp.rewards * self.scale + self.offsets["bias"])


class _PlainLoss:
    """A plain callable class policy loss; ``needs_entropy`` a property over its setting."""

    needs_ref_logprobs = False

    def __init__(self, entropy_coef=0.0):
        self.entropy_coef = entropy_coef

    @property
    def needs_entropy(self):
        return self.entropy_coef != 0.0

    def __call__(self, inp):
        on = inp.action_mask.bool()
        loss = -torch.where(on, inp.advantages, 0.0) * torch.where(on, inp.logprobs, 0.0)
        return PolicyLossOutput(per_token_loss=loss - self.entropy_coef * torch.where(on, inp.entropy, 0.0), stats=None)


class _ForgetfulAdvantage(_PlainScaledAdvantage):
    def __getstate__(self):  # leaves scale out: the copy in another process would compute with another scale
        return {k: v for k, v in vars(self).items() if k != "scale"}


class _LambdaAdvantage(_PlainScaledAdvantage):
    def __init__(self):
        super().__init__()
        self.transform = lambda r: r  # a lambda does not pickle


@dataclasses.dataclass
class _SeededLoss(_PlainLoss):
    """A dataclass whose == compares a random.Random, which compares by identity: never equal to its copy."""

    rng: object = dataclasses.field(default_factory=lambda: __import__("random").Random(0))
    entropy_coef: float = 0.0


def test_a_plain_callable_class_passes_the_pickled_copy_check():
    # No __eq__: the copy is compared by type and attributes (vars()), value by value, tensors by torch.equal.
    check_advantage_contract(_PlainScaledAdvantage(scale=3.0))
    check_policy_loss_contract(_PlainLoss())
    check_policy_loss_contract(_PlainLoss(entropy_coef=0.1))


@pytest.mark.parametrize(
    "check, plugin, message",
    [
        (
            check_advantage_contract,
            _ForgetfulAdvantage(),
            r"advantages plugin _ForgetfulAdvantage: its pickled copy has other "
            r"attributes: scale \(2.0 -> missing\). Plugins must pickle to an "
            r"equal copy: a plugin may be sent to another process .*\(a __getstate__ "
            r"must not drop one",
        ),
        (
            check_advantage_contract,
            _LambdaAdvantage(),
            r"advantages plugin _LambdaAdvantage: does not pickle \(.*lambda.*\). "
            r"Plugins must pickle to an equal copy: .* not a closure or a lambda",
        ),
        (
            check_policy_loss_contract,
            _SeededLoss(),
            r"policy_losses plugin _SeededLoss: does not compare equal \(==\) to "
            r"its pickled copy. Plugins must pickle to an equal copy: .*"
            r"field\(compare=False\)",
        ),
    ],
    ids=["getstate-drops-a-setting", "lambda-attribute", "dataclass-unequal-field"],
)
def test_the_pickled_copy_check_refuses_a_copy_that_differs(check, plugin, message):
    with pytest.raises(ContractError, match=message):
        check(plugin)


def test_reward_contract_runs_the_trainers_own_rule():
    # The trainer stores what reward_value accepts and marks verifier_error what it refuses: the same rule.
    import random

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.pipeline.batch import score_trajectories
    from trl_plugins.protocols import as_reward

    trajs = [make_trajectory(random.Random(0), num_turns=1) for _ in range(3)]
    assert score_trajectories([as_reward(_StrReward(), "s")], trajs[:1], [{"answer": "42"}]) == {"s": 1}
    assert trajs[0].stop_reason == "verifier_error" and "returned '42' (str), not a number" in trajs[0].error
    score_trajectories([as_reward(_BoolReward(), "b")], trajs[1:2], [{"answer": "42"}])
    assert "a bool; return a float" in trajs[1].error
    assert score_trajectories([as_reward(_NoisyReward(), "n", 2.0)], trajs[2:], [{"answer": "42"}]) == {}
    assert [(c.name, c.value, c.weight) for c in trajs[2].reward_components] == [("n", 1.0, 2.0)]


def test_reward_contract_takes_the_authors_trajectories_and_example():
    import random

    from trl_plugins.contracts import make_trajectory

    traj = make_trajectory(random.Random(0), num_turns=1)
    traj.turns[-1].text = "\\boxed{3}"
    check_reward_contract("correct", {"answer_key": "solution"}, example={"solution": "3"}, trajectories=[traj])
    with pytest.raises(
        ContractError,
        match=r"rewards plugin 'correct' on the trajectory number 0 .*raised KeyError: "
        r".*needs the reference answer in column 'solution'",
    ):
        check_reward_contract("correct", {"answer_key": "solution"}, example={"answer": "3"}, trajectories=[traj])
    check_reward_contract(_NoisyReward(), deterministic=False)  # a sampled judge opts out of determinism only


@pytest.mark.parametrize(
    "plugin, message",
    [
        (RaisingTool(), r"tools plugin RaisingTool: raised KeyError: 'text' on arguments \{\}. A tool never raises"),
        (_NoSchemaTool(), r"tools plugin _NoSchemaTool: is not a tool: it needs a name, a schema\(\) method"),
        (
            _MisnamedTool(),
            r"_MisnamedTool: schema\(\)\['function'\]\['name'\] is 'other', but the tool's name is 'raiser'",
        ),
        (_UndescribedTool(), r"_UndescribedTool: schema\(\)\['function'\] has no 'description'"),
        (_StringTool(), r"_StringTool: returned '1' for arguments \{'text': '1'\}, not a ToolOutput"),
        (_SyncTool(), r"_SyncTool: __call__ must be async"),
        (
            _AcceptsAnythingTool(),
            r"_AcceptsAnythingTool: returned ok=True, infra_error=None for arguments \{\} that break "
            r"its schema \(missing required argument 'text'\)",
        ),
        (_BlamesInfraTool(), r"_BlamesInfraTool: returned ok=False, infra_error='bad arguments' for arguments \{\}"),
        (_CloseOnceTool(), r"_CloseOnceTool: close\(\) raised RuntimeError: already closed \(it must be idempotent\)"),
        (MedianTool(), r"MedianTool: step_metric_reductions\(\) returned \{'echo/calls': 'median'\}"),
    ],
    ids=[
        "raises-on-bad-arguments",
        "no-schema",
        "schema-misnamed",
        "no-description",
        "returns-str",
        "not-async",
        "ok-on-bad-arguments",
        "infra-error-on-bad-arguments",
        "close-not-idempotent",
        "unknown-reduction",
    ],
)
def test_tool_contract_catches(plugin, message):
    with pytest.raises(ContractError, match=message):
        check_tool_contract(plugin)


def test_tool_contract_checks_the_authors_arguments_against_the_schema():
    tool = EchoTool()
    check_tool_contract(tool, arguments={"text": "hello"})
    with pytest.raises(
        ContractError,
        match=r"the arguments \{'text': 5\} do not fit the schema \(argument 'text' must be "
        r"of type string, got int\): the rollout would refuse such a call",
    ):
        check_tool_contract(tool, arguments={"text": 5})
