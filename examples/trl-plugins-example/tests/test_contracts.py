"""This package's plugins through the contract checks trl-plugins ships (``trl_plugins.contracts``): each is called
the way the trainer or the rollout calls it, on data a run produces, and a broken contract fails with the plugin's
name and what is wrong.

Run after ``pip install -e .`` (the entry points are what make the names resolve): ``pytest tests``.
"""

from trl_plugins.contracts import (
    check_advantage_contract,
    check_policy_loss_contract,
    check_reward_contract,
    check_tool_contract,
)


def test_concise_keeps_the_reward_contract():
    check_reward_contract("concise")  # by its entry-point name, built with its defaults
    check_reward_contract("concise", {"budget_tokens": 4})  # a budget the sample trajectories exceed: the penalty path


def test_calculator_keeps_the_tool_contract():
    check_tool_contract("calculator", arguments={"expression": "6 * 7"})
    check_tool_contract("calculator", {"max_result_bits": 64}, arguments={"expression": "2 ** 10"})


def test_rank_keeps_the_advantage_contract():
    # A plain class (no dataclass, no __eq__): its pickled copy is compared by its attributes, scale included.
    check_advantage_contract("rank")
    check_advantage_contract("rank", {"scale": 0.5})  # with settings, as in advantage_kwargs


def test_cispo_keeps_the_policy_loss_contract():
    check_policy_loss_contract("cispo")  # needs_entropy False: no entropy term
    check_policy_loss_contract(
        "cispo", {"max_weight": 1.0, "entropy_coef": 0.01}
    )  # every ratio above 1 capped; bonus on
