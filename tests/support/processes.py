"""This machine's processes as /proc shows them: parents, children, and whether one is still alive."""

from __future__ import annotations

from pathlib import Path


def own_children() -> set[int]:
    """The process ids whose parent is this process."""
    import os

    return set(children_of(os.getpid()))


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (-1 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def children_of(pid: int) -> list[int]:
    """The process ids whose parent is ``pid``."""
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and parent_pid(int(d.name)) == pid]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
