"""Layering: the maths packages (`algos/`, `packing/`) import nothing but torch, numpy, the standard
library and our own `types`/`registry` (and themselves). Frameworks stay in the trainer glue."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import trl_plugins

PACKAGE_ROOT = Path(trl_plugins.__file__).parent
PURE_PACKAGES = ("algos", "packing")
ALLOWED_THIRD_PARTY = {"torch", "numpy"}
ALLOWED_OWN = {"trl_plugins.types", "trl_plugins.registry"}
FORBIDDEN = {"trl", "transformers", "accelerate", "deepspeed", "peft", "wandb", "datasets"}


def disallowed_imports(source: str, package: str) -> list[str]:
    """Imported modules that the pure package ``trl_plugins.<package>`` may not depend on."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: inside the package by construction
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names and top not in FORBIDDEN:
                continue
            if top in ALLOWED_THIRD_PARTY or name.startswith(f"trl_plugins.{package}"):
                continue
            if any(name == own or name.startswith(own + ".") for own in ALLOWED_OWN):
                continue
            bad.append(name)
    return bad


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_pure_packages_import_no_frameworks(package):
    files = sorted((PACKAGE_ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    offenders = {str(f.relative_to(PACKAGE_ROOT)): disallowed_imports(f.read_text(), package) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_checker_catches_framework_imports():
    # Negative control.
    src = "import torch\nfrom transformers import AutoModel\nimport accelerate.utils\nfrom trl_plugins.trainers import x\n"
    assert disallowed_imports(src, "algos") == ["transformers", "accelerate.utils", "trl_plugins.trainers"]
    assert disallowed_imports("from trl.trainer import grpo_trainer\nimport deepspeed", "packing") == ["trl.trainer", "deepspeed"]


def test_registry_and_types_import_no_frameworks():
    # The pure packages may import these two, so they must stay free of frameworks themselves.
    for module in ("registry.py", "types.py"):
        assert disallowed_imports((PACKAGE_ROOT / module).read_text(), "types") == []
