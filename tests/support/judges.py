"""The scripted judge (examples/judges/scripted_judge.py, an example script rather than a package), imported."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

FOLDER = str(Path(__file__).resolve().parents[2] / "examples" / "judges")


def scripted_judge() -> ModuleType:
    """The scripted judge's module (``serve(port)`` starts one on 127.0.0.1; ``_state`` holds its faults and counters,
    shared by every server this process starts)."""
    sys.path.insert(0, FOLDER)
    try:
        import scripted_judge as module
    finally:
        sys.path.remove(FOLDER)
    return module
