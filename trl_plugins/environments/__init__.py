"""Environments no one here wrote, trained as they come: ``verifiers`` environments through the agent endpoint
(rollout plugin ``verifiers``; docs/environments.md)."""
