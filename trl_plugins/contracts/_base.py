"""What every contract check shares: the error, resolving a plugin by name or instance, the pickling check."""

from __future__ import annotations

import inspect
import pickle
import sys
from typing import Any, Mapping

__all__ = ["ContractError"]


class ContractError(AssertionError):
    """A plugin breaks its seam's contract; the message names the plugin and what is wrong."""


def resolve_plugin(registry: Any, plugin: Any, kwargs: Mapping[str, Any] | None) -> tuple[str, Any]:
    """``(label, instance)`` for a registry name / ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance."""
    if isinstance(plugin, str):
        target = registry.get(plugin)
        return f"{registry.seam} plugin {plugin!r}", target(**(kwargs or {})) if inspect.isclass(target) else target
    return f"{registry.seam} plugin {type(plugin).__name__}", plugin


def read_declarations(adapt: Any, plugin: Any, label: str) -> Any:
    """The plugin with its declarations read by the run's own adapter (:mod:`trl_plugins.protocols`): what the run
    refuses, the check refuses, with the same words."""
    from trl_plugins.protocols import PluginDeclarationError

    try:
        return adapt(plugin)
    except PluginDeclarationError as exc:
        raise ContractError(f"{label}: {exc.what}") from None


def check(ok: bool, label: str, what: str) -> None:
    if not ok:
        raise ContractError(f"{label}: {what}")


_WHY_PICKLE = (
    "Plugins must pickle to an equal copy: a plugin may be sent to another process (a child process, "
    "another rank) as its pickled copy, which must compute what the original computes"
)
_MISSING = object()


def _state(obj: Any) -> dict[str, Any]:
    """The attributes an instance carries: its ``__dict__`` and its ``__slots__`` that are set."""
    state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                state[name] = getattr(obj, name)
    return state


def _same(a: Any, b: Any, _seen: set[tuple[int, int]] | None = None) -> bool:
    """Whether ``b``, a pickled copy of ``a``, equals it: by ``==`` where the class defines equality, else (``==``
    would be identity) by type and attributes, recursively; tensors by ``torch.equal``, containers item by item."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    seen = set() if _seen is None else _seen
    if (id(a), id(b)) in seen:  # a cycle (an object that refers to itself) compared once
        return True
    seen.add((id(a), id(b)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], seen) for k in a)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if type(a).__eq__ is object.__eq__:
        return _same(_state(a), _state(b), seen)
    try:
        return bool(a == b)
    except Exception:  # an == that cannot say (an array-like result): not shown equal
        return False


def _shown(value: Any) -> str:
    return "missing" if value is _MISSING else f"{value!r:.60}"


def check_pickles(obj: Any, label: str, *, equal: bool = True) -> None:
    """``obj`` pickles and, with ``equal``, its pickled copy equals it (:func:`_same`); the message says why it must."""
    try:
        back = pickle.loads(pickle.dumps(obj))
    except Exception as exc:
        raise ContractError(
            f"{label}: does not pickle ({type(exc).__name__}: {exc}). {_WHY_PICKLE}. Use a callable "
            f"class with its settings as attributes, or a module-level function, not a closure or a "
            f"lambda."
        ) from exc
    if not equal or _same(obj, back):
        return
    if type(back) is not type(obj):
        raise ContractError(
            f"{label}: its pickled copy is a {type(back).__qualname__}, not a {type(obj).__qualname__}. {_WHY_PICKLE}."
        )
    if type(obj).__eq__ is not object.__eq__:
        raise ContractError(
            f"{label}: does not compare equal (==) to its pickled copy. {_WHY_PICKLE}. Its class defines "
            f"== (a dataclass compares its fields): every compared field must come back from pickle "
            f"equal (mark a counter or a cache field(compare=False))."
        )
    mine, theirs = _state(obj), _state(back)
    changed = [
        f"{k} ({_shown(mine.get(k, _MISSING))} -> {_shown(theirs.get(k, _MISSING))})"
        for k in sorted(mine.keys() | theirs.keys())
        if not _same(mine.get(k, _MISSING), theirs.get(k, _MISSING))
    ]
    raise ContractError(
        f"{label}: its pickled copy has other attributes: {', '.join(changed)}. {_WHY_PICKLE}. A class "
        f"without __eq__ is compared by its attributes (vars()): keep every setting an attribute that "
        f"pickles (a __getstate__ must not drop one), or define __eq__ over the settings when the "
        f"pickle leaves runtime state out on purpose."
    )


BATCH_ROWS, BATCH_WIDTH = 6, 9
"""Rows and width of the synthetic batches the algorithm checks feed a plugin."""
