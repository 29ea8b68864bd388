"""The generic registry: registration, errors, lazy targets, entry-point discovery, collisions."""

from __future__ import annotations

import pickle

import pytest

from conftest import ASSETS
from trl_plugins.registry import ADVANTAGES, PACKERS, POLICY_LOSSES, REWARDS, Registry, RegistryError


def test_decorator_registration_and_origin():
    reg = Registry("widgets")

    @reg.register("square")
    def square(x):
        return x * x

    assert reg.get("square") is square
    assert reg.get("square")(3) == 9
    assert reg.names() == ["square"]
    # file:line of the decorated definition (co_firstlineno is the decorator's line).
    assert reg.origin("square") == f"{__file__}:{square.__code__.co_firstlineno}"
    assert "square" in reg and "cube" not in reg


def test_duplicate_name_is_an_error_naming_both_places():
    reg = Registry("widgets")
    reg.register("a", lambda: 1)
    with pytest.raises(RegistryError, match=r"'a' is already registered \(at .*test_registry.py:\d+\)"):
        reg.register("a", lambda: 2)


def test_unknown_name_suggests_close_matches():
    reg = Registry("widgets")
    reg.register("token_mean", object())
    reg.register("seq_mean", object())
    with pytest.raises(RegistryError, match=r"Did you mean 'token_mean'\?"):
        reg.get("tokn_mean")
    with pytest.raises(RegistryError, match=r"unknown widgets plugin 'zzz'\. Known: seq_mean, token_mean"):
        reg.get("zzz")


def test_builtin_lookup_suggests_real_names():
    with pytest.raises(RegistryError, match="Did you mean 'optimal'"):
        PACKERS.get("optimla")


def test_lazy_target_is_imported_on_first_use():
    reg = Registry("widgets")
    reg.register("sqrt", "math:sqrt")
    entry = reg.entry("sqrt")
    assert entry.target is None and entry.lazy_target == "math:sqrt"
    import math

    assert reg.get("sqrt") is math.sqrt
    assert entry.target is math.sqrt


def test_direct_import_path_and_bad_paths():
    import collections

    assert REWARDS.get("collections:OrderedDict") is collections.OrderedDict
    assert REWARDS.get("os.path:join.__name__") == "join"
    with pytest.raises(RegistryError, match="cannot import module 'no_such_pkg_xyz.mod' for target"):
        REWARDS.get("no_such_pkg_xyz.mod:thing")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        REWARDS.get("math:nope")
    with pytest.raises(RegistryError, match="not a valid import target"):
        REWARDS.get(":x")


def test_invalid_names_rejected():
    reg = Registry("widgets")
    with pytest.raises(RegistryError, match="invalid widgets plugin name"):
        reg.register("a:b", object())
    with pytest.raises(RegistryError, match="invalid widgets plugin name"):
        reg.register("", object())


def test_every_seam_has_builtins_registered_where_defined():
    assert {"ffd", "optimal", "balanced"} <= set(PACKERS.names())
    assert {"group", "dr_grpo", "rloo", "gae"} <= set(ADVANTAGES.names())
    assert "ppo_clip" in POLICY_LOSSES.names()
    assert PACKERS.entry("ffd").builtin
    assert "trl_plugins/packing/packers.py:" in PACKERS.origin("ffd")
    assert "trl_plugins/algos/losses.py:" in POLICY_LOSSES.origin("ppo_clip")


def test_third_party_entry_points_are_discovered_lazily(isolated_registries, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "plugin_dist"))
    assert "length_penalty" in REWARDS.names()
    entry = REWARDS.entry("length_penalty")
    assert not entry.builtin and entry.target is None  # found, not imported yet
    assert "distribution trl-plugins-example" in entry.origin
    cls = REWARDS.get("length_penalty")
    assert cls(coef=0.5)(4) == -2.0
    # The third-party packer obeys the packer contract and is usable by name.
    from trl_plugins.packing import pack

    assert pack([3, 1, 2], strategy="one_per_batch", max_items=8, max_padded_tokens=100) == [[0], [1], [2]]
    # Picklable by reference, as plugins must be.
    assert pickle.loads(pickle.dumps(cls(coef=0.25))) == cls(coef=0.25)


def test_entry_point_reusing_a_builtin_name_is_an_error(isolated_registries, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "plugin_dist"))
    monkeypatch.syspath_prepend(str(ASSETS / "plugin_collision"))
    with pytest.raises(
        RegistryError, match=r"'ffd' from entry point .*trl-plugins-colliding.* collides with a built-in"
    ):
        PACKERS.load_entry_points()
    # The built-in stays what it was.
    from trl_plugins.packing.packers import ffd

    assert PACKERS.get("ffd") is ffd


def test_in_process_registration_of_a_builtin_name_is_an_error(isolated_registries):
    with pytest.raises(RegistryError, match="'optimal' is already registered"):
        PACKERS.register("optimal", lambda *a, **k: None)
