"""One generic registry for every plugin seam.

A plugin registers itself where it is defined::

    from trl_plugins.registry import REWARDS

    @REWARDS.register("my_reward")
    class MyReward: ...

Third-party plugins arrive through one entry-point group per seam (``trl_plugins.<seam>``), e.g. in
the plugin's ``pyproject.toml``::

    [project.entry-points."trl_plugins.rewards"]
    my_reward = "my_pkg.rewards:MyReward"

Entry points are discovered lazily (the first time a name is not found among the built-ins, or when
:meth:`Registry.load_entry_points` is called at start-up) and imported only when used. A third-party
name that collides with a built-in, or two distributions claiming one name, is an error, never a
silent drop. A config may also name an object directly as ``"pkg.module:attr"``.

This module imports only the standard library, so the pure maths packages may register their
functions without depending on anything heavy.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, TypeVar

T = TypeVar("T")

__all__ = [
    "Registry",
    "RegistryError",
    "PluginEntry",
    "ROLLOUTS",
    "TOOLS",
    "REWARDS",
    "ADVANTAGES",
    "POLICY_LOSSES",
    "PACKERS",
    "ALL_REGISTRIES",
]


class RegistryError(LookupError):
    """A plugin name could not be resolved, or two plugins claim the same name."""


@dataclass
class PluginEntry:
    """One registered name.

    Attributes:
        name: The registry key.
        target: The registered object, or ``None`` while it is a lazy target not yet imported.
        lazy_target: ``"pkg.module:attr"`` still to import, or ``None``.
        origin: Where it was registered, ``"file:line"``, or ``"entry point <dist>"``.
        builtin: True for plugins shipped in ``trl_plugins``.
    """

    name: str
    target: Any
    lazy_target: str | None
    origin: str
    builtin: bool


def import_target(spec: str) -> Any:
    """Import ``"pkg.module:attr"`` (``attr`` may be dotted) and return the object.

    Raises:
        RegistryError: if the spec is malformed, the module cannot be imported or has no such attr.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise RegistryError(f"{spec!r} is not a valid import target; write it as 'package.module:attribute'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module {module_name!r} for target {spec!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(f"module {module_name!r} has no attribute {attr_path!r} (target {spec!r})") from exc
    return obj


def _caller_origin(depth: int) -> str:
    frame = inspect.stack()[depth]
    return f"{frame.filename}:{frame.lineno}"


def _object_origin(obj: Any) -> str | None:
    try:
        _, line = inspect.getsourcelines(obj)
        return f"{inspect.getsourcefile(obj)}:{line}"
    except (TypeError, OSError):
        return None


class Registry(Generic[T]):
    """A named collection of plugins for one seam.

    Args:
        seam: Human-readable seam name used in messages and in the entry-point group
            ``trl_plugins.<seam>``.
        builtin_modules: Modules that register the built-in plugins; imported on first lookup so
            that ``PACKERS.get("ffd")`` works without importing ``trl_plugins.packing`` first.
    """

    def __init__(self, seam: str, builtin_modules: Iterable[str] = ()) -> None:
        self.seam = seam
        self.entry_point_group = f"trl_plugins.{seam}"
        self._builtin_modules = tuple(builtin_modules)
        self._entries: dict[str, PluginEntry] = {}
        self._builtins_loaded = False
        self._entry_points_loaded = False
        self._lock = threading.RLock()

    # -- registration -----------------------------------------------------------------------

    def register(self, name: str, target: T | str | None = None) -> Callable[[T], T] | T | str:
        """Register ``target`` under ``name``; without ``target``, return a decorator.

        ``target`` may be an object or a lazy ``"pkg.module:attr"`` string imported on first use.
        A module inside ``trl_plugins`` registers built-ins; anything else registers third-party
        plugins.

        Raises:
            RegistryError: if ``name`` is already registered.
        """
        if target is not None:
            origin = _object_origin(target) if not isinstance(target, str) else None
            self._add(name, target, origin or _caller_origin(2))
            return target

        def decorator(obj: T) -> T:
            self._add(name, obj, _object_origin(obj) or _caller_origin(2))
            return obj

        return decorator

    def _add(self, name: str, target: Any, origin: str) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise RegistryError(f"invalid {self.seam} plugin name {name!r}: use a non-empty string without ':'")
        module = getattr(target, "__module__", "") or ""
        builtin = (
            isinstance(target, str)
            and target.startswith("trl_plugins.")
            or (not isinstance(target, str) and module.startswith("trl_plugins."))
        )
        if not builtin:
            self._load_builtins()  # a plugin that reuses a built-in name fails here, not later
        with self._lock:
            if name in self._entries:
                prev = self._entries[name]
                raise RegistryError(
                    f"{self.seam} plugin {name!r} is already registered (at {prev.origin}); "
                    f"the second registration is at {origin}. Pick a different name."
                )
            lazy = target if isinstance(target, str) else None
            self._entries[name] = PluginEntry(
                name=name,
                target=None if lazy else target,
                lazy_target=lazy,
                origin=origin,
                builtin=builtin,
            )

    # -- discovery --------------------------------------------------------------------------

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        with self._lock:
            if self._builtins_loaded:
                return
            self._builtins_loaded = True  # set first: built-in modules call register() on import
            try:
                for module in self._builtin_modules:
                    importlib.import_module(module)
            except BaseException:
                self._builtins_loaded = False
                raise

    def load_entry_points(self) -> list[str]:
        """Discover third-party plugins in the ``trl_plugins.<seam>`` entry-point group.

        Entry points are recorded as lazy targets (nothing is imported). Safe to call repeatedly.

        Returns:
            The names added by this call.

        Raises:
            RegistryError: if an entry point's name collides with a built-in or another plugin.
        """
        self._load_builtins()
        with self._lock:
            if self._entry_points_loaded:
                return []
            self._entry_points_loaded = True
            added = []
            for ep in importlib.metadata.entry_points(group=self.entry_point_group):
                dist = getattr(ep.dist, "name", None) or "unknown distribution"
                origin = f"entry point {ep.name} = {ep.value} (distribution {dist})"
                if ep.name in self._entries:
                    prev = self._entries[ep.name]
                    kind = "a built-in" if prev.builtin else "another plugin"
                    raise RegistryError(
                        f"{self.seam} plugin name {ep.name!r} from {origin} collides with {kind} "
                        f"registered at {prev.origin}. Built-in names cannot be replaced: rename "
                        f"the entry point in that distribution, or refer to it by its import path "
                        f"'{ep.value}'."
                    )
                self._entries[ep.name] = PluginEntry(
                    name=ep.name, target=None, lazy_target=ep.value, origin=origin, builtin=False
                )
                added.append(ep.name)
            return added

    # -- lookup -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        """All registered names, built-in and discovered, sorted."""
        self.load_entry_points()
        return sorted(self._entries)

    def entry(self, name: str) -> PluginEntry:
        """The :class:`PluginEntry` for ``name`` (see :meth:`get` for resolution rules)."""
        self._load_builtins()
        if name not in self._entries:
            self.load_entry_points()
        if name not in self._entries:
            raise RegistryError(self._unknown_message(name))
        return self._entries[name]

    def get(self, name: str) -> T:
        """Resolve ``name`` to the plugin object.

        ``name`` is a registered name (built-in or entry point) or a direct ``"pkg.module:attr"``
        import path.

        Raises:
            RegistryError: unknown name (with close matches), or a target that fails to import.
        """
        if ":" in name:
            return import_target(name)
        entry = self.entry(name)
        if entry.target is None:
            with self._lock:
                if entry.target is None:
                    entry.target = import_target(entry.lazy_target)  # type: ignore[arg-type]
        return entry.target

    def origin(self, name: str) -> str:
        """Where ``name`` was registered (``file:line`` or the entry point), for debugging."""
        return self.entry(name).origin

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.entry(name)
        except RegistryError:
            return False
        return True

    def _unknown_message(self, name: str) -> str:
        known = sorted(self._entries)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return (
            f"unknown {self.seam} plugin {name!r}.{hint} Known: {', '.join(known) or '(none)'}. "
            f"Third-party plugins register through the '{self.entry_point_group}' entry-point "
            f"group, or can be named directly as 'package.module:attribute'."
        )

    def __repr__(self) -> str:
        return f"Registry({self.seam!r}, {len(self._entries)} entries)"


ROLLOUTS: Registry[Any] = Registry(
    "rollouts",
    builtin_modules=(
        "trl_plugins.rollout.engine",
        "trl_plugins.rollout.endpoint.agent",
        "trl_plugins.environments.verifiers_env",
    ),
)
TOOLS: Registry[Any] = Registry(
    "tools", builtin_modules=("trl_plugins.tools.code_interpreter", "trl_plugins.tools.mcp.plugin")
)
REWARDS: Registry[Any] = Registry(
    "rewards",
    builtin_modules=(
        "trl_plugins.rewards.math",
        "trl_plugins.rewards.agent",
        "trl_plugins.rewards.reasoning_gym",
        "trl_plugins.rewards.judge",
        "trl_plugins.rewards.reward_model",
    ),
)
ADVANTAGES: Registry[Any] = Registry("advantages", builtin_modules=("trl_plugins.algos.advantages",))
POLICY_LOSSES: Registry[Any] = Registry(
    "policy_losses", builtin_modules=("trl_plugins.algos.losses", "trl_plugins.algos.span_losses")
)
PACKERS: Registry[Any] = Registry("packers", builtin_modules=("trl_plugins.packing",))

ALL_REGISTRIES: dict[str, Registry[Any]] = {
    r.seam: r for r in (ROLLOUTS, TOOLS, REWARDS, ADVANTAGES, POLICY_LOSSES, PACKERS)
}
