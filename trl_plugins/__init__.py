"""trl-plugins: multi-turn, tool-calling RL for LLM agents on TRL, Accelerate and DeepSpeed.

The sub-packages are the seams of the system (see ``docs/architecture.md``): ``rollout``, ``tools``,
``datum``, ``algos``, ``packing``, ``rewards``, ``trainers``; ``types`` is the shared vocabulary and
``registry`` resolves plugins by name.
"""

__version__ = "0.1.0"
