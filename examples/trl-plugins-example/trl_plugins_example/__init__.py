"""A worked example of trl-plugins plugins shipped by another project.

The plugins are found through this distribution's entry points (see ``pyproject.toml``), not by
importing this package: ``concise`` (:class:`trl_plugins_example.rewards.ConciseReward`) is a reward
component, ``calculator`` (:class:`trl_plugins_example.tools.Calculator`) a tool, ``rank``
(:class:`trl_plugins_example.advantages.RankAdvantage`) an advantage estimator and ``cispo``
(:class:`trl_plugins_example.losses.CISPOLoss`) a policy loss. Nothing here calls ``*.register``: the entry
point already claims the name, and a second registration of it would be an error.
"""
