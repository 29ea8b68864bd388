"""The cheap checks a run makes of its plugins at start-up, before any model loads: each plugin's own contract check
run on a pickled copy (rewards on fake trajectories and a real dataset row, the advantage estimator and the policy
loss on synthetic batches), and what the system prompt tells the model about the tools.

A reward that returns NaN, an estimator that returns the wrong shape, a loss with gradient off the mask: each is
caught here in about a second, instead of after the model loaded and a step ran. A plugin whose check is expensive
(a remote or model judge) or not deterministic is switched off by name (``skip_startup_checks``); the banner says so.
"""

from __future__ import annotations

import pickle
import re
import time
from typing import Any, Mapping, Sequence

from trl_plugins.run.plugins import SettingError, nearest

__all__ = ["checkable_plugins", "check_skip_names", "startup_checks", "prompt_warnings"]


def checkable_plugins(config: Any) -> list[str]:
    """The names ``skip_startup_checks`` may hold: the configured reward components, advantage and policy loss."""
    return [*config.reward_components, config.advantage, config.policy_loss]


def check_skip_names(config: Any) -> None:
    """Every name in ``skip_startup_checks`` is a plugin the run checks at start-up (or ``"all"``).

    Raises:
        SettingError: naming the unknown name, the accepted ones and the nearest.
    """
    accepted = checkable_plugins(config)
    for name in config.skip_startup_checks:
        if name != "all" and name not in accepted:
            raise SettingError(
                "skip_startup_checks",
                f"{name!r} is no plugin this run checks at start-up; it checks "
                f"{accepted} (or 'all').{nearest(name, accepted)}",
            )


def _copy(plugin: Any, label: str) -> Any:
    """A pickled copy of the plugin itself, so the check's calls (and its ``close()``) leave the run's instance
    untouched."""
    try:
        return pickle.loads(pickle.dumps(plugin.impl))
    except Exception as exc:  # noqa: BLE001 - said as the contract check says it
        raise SettingError(
            label,
            f"does not pickle ({type(exc).__name__}: {exc}); plugins must pickle to an equal "
            f"copy (docs/plugins.md, 'Why plugins pickle').",
        ) from None


def startup_checks(run: Any, example: Mapping[str, Any] | None = None) -> list[str]:
    """Run each reward component's, the advantage estimator's and the policy loss's contract check
    (:mod:`trl_plugins.contracts`) on pickled copies, except those named in ``skip_startup_checks``; returns the
    lines the banner prints (what was checked, in how long, and what was skipped).

    Args:
        example: A dataset row, for the reward components (default: the contract's own ``6 * 7`` row). Give the
            first training row: a component reads the columns it needs from it.

    Raises:
        SettingError: a plugin failed its check; the message is the check's, with how to switch the check off.
    """
    from trl_plugins.contracts import (
        ContractError,
        check_advantage_contract,
        check_policy_loss_contract,
        check_reward_contract,
    )

    c = run.config
    skip = set(c.skip_startup_checks)
    everything = "all" in skip
    jobs = [
        (r.name, f"reward component {r.name!r}", r, lambda p: check_reward_contract(p, example=example))
        for r in run.rewards
    ]
    jobs.append((c.advantage, f"advantage {c.advantage!r}", run.advantage, check_advantage_contract))
    jobs.append((c.policy_loss, f"policy_loss {c.policy_loss!r}", run.policy_loss, check_policy_loss_contract))
    checked, skipped = [], []
    start = time.perf_counter()
    for name, label, plugin, check in jobs:
        if everything or name in skip:
            skipped.append(name)
            continue
        try:
            check(_copy(plugin, label))
        except ContractError as exc:
            raise SettingError(
                label,
                f"failed its start-up contract check: {exc} (pass --skip_startup_checks {name} "
                f"to start without this check, e.g. for a remote or sampled judge).",
            ) from None
        except Exception as exc:  # noqa: BLE001 - a plugin that raises where the check calls it, named
            raise SettingError(
                label,
                f"raised {type(exc).__name__}: {exc} in its start-up contract check (pass "
                f"--skip_startup_checks {name} to start without it).",
            ) from exc
        checked.append(name)
    lines = []
    if checked:
        lines.append(f"passed their contract checks ({time.perf_counter() - start:.1f} s): {', '.join(checked)}")
    if skipped:
        lines.append(f"not checked (skip_startup_checks): {', '.join(skipped)}")
    return lines


_ARGUMENT_SHOWN = re.compile(r'"([A-Za-z_][A-Za-z0-9_]*)"\s*:')
"""An argument name as a prompt shows it in a JSON call: ``"name":``."""
_ENVELOPE = {"name", "arguments", "type", "function", "parameters", "properties", "required", "description"}
"""Keys of the tool-call and schema envelopes themselves, not a tool's arguments."""


def _names(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(word)}(?![\w])", text) is not None


def prompt_warnings(system_prompt: str | None, tools: Mapping[str, Any]) -> list[str]:
    """What the system prompt gets wrong about the tools (``tools`` by the name the model calls them): a tool it
    does not name as a word (a longer name that contains it does not count), and argument names it shows
    in a JSON call (``"arg":``) that are no argument of any tool's schema (the model would make calls the rollout
    refuses
    as ``invalid_action``). Empty when nothing is wrong."""
    prompt = system_prompt or ""
    out = []
    properties: dict[str, Sequence[str]] = {}
    for name, tool in tools.items():
        params = tool.schema()["function"].get("parameters", {})
        properties[name] = list(params.get("properties", {}))
        if not _names(prompt, name):
            out.append(
                f"system_prompt does not mention the tool {name!r}; only its schema reaches the model, which "
                f"may never call it (docs/plugins.md, 'Tools and the system prompt')"
            )
    known = {arg for args in properties.values() for arg in args}
    shown = set(_ARGUMENT_SHOWN.findall(prompt)) - _ENVELOPE
    foreign = sorted(shown - known)
    if foreign and tools:
        takes = "; ".join(f"{name} takes {args}" for name, args in properties.items())
        out.append(
            f"system_prompt shows argument(s) {foreign} that no tool's schema has ({takes}); a model that "
            f"follows the prompt writes calls the rollout refuses as invalid_action"
        )
    return out
