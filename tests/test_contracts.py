"""Contract tests over every registry entry, third-party ones included: shapes, finiteness,
masked tokens get zero gradient, plans are valid partitions, plugins pickle."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from conftest import ASSETS
from test_packing import plan_violations
from trl_plugins.registry import ADVANTAGES, PACKERS, POLICY_LOSSES
from trl_plugins.types import AdvantageInput, AdvantageOutput, PolicyLossInput, PolicyLossOutput

N, T_LEN = 6, 9


def _advantage_input() -> AdvantageInput:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(N, T_LEN, generator=g) < 0.6).float()
    mask[:, -1] = 1
    return AdvantageInput(
        rewards=torch.randn(N, generator=g),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        action_mask=mask,
        values=torch.randn(N, T_LEN, generator=g),
        bootstrap_mask=torch.tensor([0, 1, 0, 0, 1, 0]),
        bootstrap_values=torch.randn(N, generator=g),
        token_rewards=torch.zeros(N, T_LEN),
    )


def check_advantage_contract(name: str) -> None:
    est = ADVANTAGES.get(name)()
    inp = _advantage_input()
    out = est(inp)
    assert isinstance(out, AdvantageOutput)
    assert out.advantages.shape in {(N,), (N, T_LEN)}, name
    assert torch.isfinite(out.advantages).all(), name
    if out.advantages.dim() == 2:
        assert (out.advantages[inp.action_mask == 0] == 0).all(), f"{name}: advantage off the action mask"
    assert pickle.loads(pickle.dumps(est)) == est


def check_policy_loss_contract(name: str) -> None:
    loss_fn = POLICY_LOSSES.get(name)()
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(N, T_LEN, generator=g) < 0.5).float()
    logp = (-torch.rand(N, T_LEN, generator=g) * 3).requires_grad_(True)
    inp = PolicyLossInput(
        logprobs=logp,
        behaviour_logprobs=logp.detach() + 0.3 * torch.randn(N, T_LEN, generator=g),
        advantages=torch.randn(N, T_LEN, generator=g) * mask,
        action_mask=mask,
        ref_logprobs=logp.detach() + 0.1,
        entropy=torch.rand(N, T_LEN, generator=g),
    )
    out = loss_fn(inp)
    assert isinstance(out, PolicyLossOutput)
    assert out.per_token_loss.shape == (N, T_LEN) and torch.isfinite(out.per_token_loss).all()
    assert (out.per_token_loss[mask == 0] == 0).all()
    out.per_token_loss.sum().backward()
    assert (logp.grad[mask == 0] == 0).all(), f"{name}: masked tokens receive gradient"
    assert logp.grad[mask == 1].abs().sum() > 0
    assert pickle.loads(pickle.dumps(loss_fn)) == loss_fn


def check_packer_contract(name: str) -> None:
    packer = PACKERS.get(name)
    rng = random.Random(2)
    for world_size in (1, 3):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(0, 60))]
        plan = packer(lengths, max_items=7, max_padded_tokens=1500, world_size=world_size)
        assert plan_violations(plan, lengths, 7, 1500, world_size) == [], name
    assert pickle.loads(pickle.dumps(packer)) is packer


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_advantage_plugins(name):
    check_advantage_contract(name)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_policy_loss_plugins(name):
    check_policy_loss_contract(name)


@pytest.mark.parametrize("name", PACKERS.names())
def test_packer_plugins(name):
    check_packer_contract(name)


def test_third_party_plugins_meet_the_contract(isolated_registries, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "plugin_dist"))
    third_party = [n for n in PACKERS.names() if not PACKERS.entry(n).builtin]
    assert third_party == ["one_per_batch"]
    for name in third_party:
        check_packer_contract(name)
