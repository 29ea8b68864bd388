"""Reward-component plugins (registry: ``REWARDS``). Built-ins arrive with the recipe issue."""
