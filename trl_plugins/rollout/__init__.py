"""Multi-turn tool-call rollout plugins (registry: ``ROLLOUTS``). Built-ins arrive with the rollout issue."""
