"""The recipe's config files as layers (``recipes/retool_ppo.yaml`` first, then each ``--config``), read without
parsing them into the recipe's arguments: what :mod:`retool.config` parses and what :mod:`retool.teacher` reads of the
lookup recipe its teacher's build runs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["DEFAULT_CONFIG", "load_config_layers"]

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "retool_ppo.yaml"
"""The recipe's YAML: the lowest config layer (``--config none`` drops it)."""


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"cannot read the config {path}: {exc}") from exc
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SystemExit(f"the config {path} must hold a YAML mapping of field: value, got {type(values).__name__}.")
    return values


def load_config_layers(configs: Sequence[str]) -> list[tuple[str, dict]]:
    """``[(path, values), ...]`` lowest first: the recipe's YAML, then each of ``configs`` ('none' drops the
    layers named before it, the recipe's YAML included)."""
    paths: list[str] = [str(DEFAULT_CONFIG)]
    for value in configs:
        if value.lower() == "none":
            paths = []
        else:
            paths.append(value)
    return [(p, _read_yaml(p)) for p in paths]
