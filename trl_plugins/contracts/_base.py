"""What every contract check shares: the error, resolving a plugin by name or instance, the pickling check."""

from __future__ import annotations

import inspect
import pickle
from typing import Any, Mapping

__all__ = ["ContractError"]


class ContractError(AssertionError):
    """A plugin breaks its seam's contract; the message names the plugin and what is wrong."""


def _resolve(registry: Any, plugin: Any, kwargs: Mapping[str, Any] | None) -> tuple[str, Any]:
    """``(label, instance)`` for a registry name / ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance."""
    if isinstance(plugin, str):
        target = registry.get(plugin)
        return f"{registry.seam} plugin {plugin!r}", target(**(kwargs or {})) if inspect.isclass(target) else target
    return f"{registry.seam} plugin {type(plugin).__name__}", plugin


def _declared(adapt: Any, plugin: Any, label: str) -> Any:
    """The plugin with its declarations read by the run's own adapter (:mod:`trl_plugins.protocols`): what the run
    refuses, the check refuses, with the same words."""
    from trl_plugins.protocols import PluginDeclarationError

    try:
        return adapt(plugin)
    except PluginDeclarationError as exc:
        raise ContractError(f"{label}: {exc.what}") from None


def _check(ok: bool, label: str, what: str) -> None:
    if not ok:
        raise ContractError(f"{label}: {what}")


def _pickles(obj: Any, label: str, *, equal: bool = True) -> None:
    try:
        back = pickle.loads(pickle.dumps(obj))
    except Exception as exc:  # the trainer may ship plugins to other processes
        raise ContractError(f"{label}: does not pickle ({type(exc).__name__}: {exc}); use a callable class, not a closure.") from exc
    if equal:
        _check(back == obj, label, "does not compare equal to its pickled copy")


_N, _T = 6, 9
"""Rows and width of the synthetic batches the algorithm checks feed a plugin."""
