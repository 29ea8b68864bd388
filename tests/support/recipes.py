"""The repository root and the ReTool recipe script imported as a module."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def recipe_module():
    """The recipe script ``recipes/retool_ppo.py`` imported as a module."""
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import retool_ppo
    finally:
        sys.path.pop(0)
    return retool_ppo
