"""A worked example of trl-plugins plugins shipped by another project.

The plugins are found through this distribution's entry points (see ``pyproject.toml``), not by
importing this package: ``concise`` (:class:`trl_plugins_example.rewards.ConciseReward`) is a reward
component and ``calculator`` (:class:`trl_plugins_example.tools.Calculator`) is a tool. Nothing here
calls ``REWARDS.register``/``TOOLS.register``: the entry point already claims the name, and a second
registration of it would be an error.
"""
