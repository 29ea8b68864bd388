"""Contract tests over every registry entry, third-party ones included, through the same checks
plugin authors run (`trl_plugins.testing`): shapes, finiteness, masked tokens get zero gradient, plans
are valid partitions, capabilities declared, plugins pickle. Each check is also shown to fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import ASSETS
from trl_plugins.registry import ADVANTAGES, PACKERS, POLICY_LOSSES, REWARDS, ROLLOUTS, TOOLS
from trl_plugins.testing import (
    ContractError,
    check_advantage_contract,
    check_packer_contract,
    check_policy_loss_contract,
    check_reward_contract,
    check_rollout_contract,
    check_tool_contract,
)
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
    check_reward_contract(name)


@pytest.mark.parametrize("name", TOOLS.names())
def test_tool_plugins(name):
    kwargs = {"mode": "cold"} if name == "code_interpreter" else None  # cold: no pool of warm interpreters to start
    check_tool_contract(name, kwargs)


@pytest.mark.parametrize("name", ROLLOUTS.names())
def test_rollout_plugins(name):
    check_rollout_contract(name)


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


class _RaisingTool:
    name = "raiser"

    def schema(self):
        return {"type": "function", "function": {"name": "raiser", "parameters": {"type": "object", "properties": {}}}}

    async def __call__(self, arguments):
        if arguments:
            raise KeyError("bad input")
        return ToolOutput(text="", ok=True)


class _NoBudgetRollout:
    def __call__(self, request):
        raise AssertionError("never called")


@pytest.mark.parametrize(
    "check, plugin, message",
    [
        (check_policy_loss_contract, _UnmaskedLoss(), "non-zero loss off the action mask"),
        (check_advantage_contract, _UndeclaredAdvantage(), "must declare needs_values"),
        (check_advantage_contract, _OffMaskAdvantage(), "non-zero advantage off the action mask"),
        (check_packer_contract, _overfull, "items > 7"),
        (check_reward_contract, _NanReward(), "returned nan"),
        (check_reward_contract, _MutatingReward(), "changed the trajectory"),
        (check_tool_contract, _RaisingTool(), "bad input"),
        (check_rollout_contract, _NoBudgetRollout(), "token_budget must be"),
    ],
    ids=["loss-off-mask", "advantage-undeclared", "advantage-off-mask", "packer-limits", "reward-nan",
         "reward-mutates", "tool-raises", "rollout-no-budget"],
)
def test_each_contract_check_can_fail(check, plugin, message):
    with pytest.raises((ContractError, KeyError), match=message):
        check(plugin)
