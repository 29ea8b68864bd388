"""Contract checks for plugin authors: one per seam, the checks our own registry entries pass.

Nothing here downloads anything. A plugin package runs them in its own tests::

    from trl_plugins.contracts import check_reward_contract, check_tool_contract

    def test_my_reward():
        check_reward_contract("my_reward")          # a registry name, "pkg.mod:attr" or an instance

Each ``check_*`` raises :class:`ContractError` naming the plugin and what is wrong, and returns nothing when the
plugin meets its seam's contract. :func:`make_trajectory` and :func:`plan_violations` build and check fake data
for a plugin's own tests; :mod:`trl_plugins.tiny` builds tiny models and tokenizers locally.
"""

from trl_plugins.contracts._base import ContractError
from trl_plugins.contracts.algos import check_advantage_contract, check_packer_contract, check_policy_loss_contract
from trl_plugins.contracts.fakes import (
    make_compacting_trajectory,
    make_trajectory,
    plan_violations,
    tree_plan_violations,
)
from trl_plugins.contracts.rewards import check_reward_contract
from trl_plugins.contracts.rollout import check_rollout_contract
from trl_plugins.contracts.tools import check_tool_contract

__all__ = [
    "ContractError",
    "check_advantage_contract",
    "check_policy_loss_contract",
    "check_packer_contract",
    "check_reward_contract",
    "check_tool_contract",
    "check_rollout_contract",
    "make_trajectory",
    "make_compacting_trajectory",
    "plan_violations",
    "tree_plan_violations",
]
