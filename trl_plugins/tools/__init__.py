"""Tool plugins and the Python sandbox (registry: ``TOOLS``). Built-ins arrive with the rollout issue."""
