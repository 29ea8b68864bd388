"""This package's plugins through the contract checks trl-plugins ships (``trl_plugins.contracts``): the
reward and the tool are called the way the trainer and the rollout call them, on trajectories and
arguments a run produces, and a broken contract fails with the plugin's name and what is wrong.

Run after ``pip install -e .`` (the entry points are what make the names resolve): ``pytest tests``.
"""

from trl_plugins.contracts import check_reward_contract, check_tool_contract


def test_concise_keeps_the_reward_contract():
    check_reward_contract("concise")  # by its entry-point name, built with its defaults
    check_reward_contract("concise", {"budget_tokens": 4})  # a budget the sample trajectories exceed: the penalty path


def test_calculator_keeps_the_tool_contract():
    check_tool_contract("calculator", arguments={"expression": "6 * 7"})
    check_tool_contract("calculator", {"max_result_bits": 64}, arguments={"expression": "2 ** 10"})
