"""What a sandbox shows of the host: the interpreter's folders, the system libraries, the init program of a warm
call's PID namespace, and the hidden paths inside them (see docs/sandbox.md, "Isolation")."""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
from collections.abc import Sequence

from trl_plugins.tools.sandbox.runner import PRIVATE_TMPFS, under

logger = logging.getLogger(__name__)

SYSTEM_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
)
"""Host paths shown read-only in bwrap/unshare modes besides the interpreter's own (system libraries
and tools; symbolic links stay links). Nothing else of the host is visible."""

INIT_PROGRAMS = ("/usr/bin/sleep", "/bin/sleep")
"""Candidates for the init of a warm call's PID namespace (shown in every sandbox: ``/usr`` is), started from an
exec-only copy (``runner.exec_only_copy``); without one, a fork of the server is the init (about 4 ms more per
call, measured by benchmarks/sandbox_versions.py)."""


def init_program() -> str | None:
    """The init program of warm calls, or None for the forked init: also where ``fs.suid_dumpable`` is 1, under
    which an exec-only copy would stay dumpable, so reachable from the call."""
    try:
        with open("/proc/sys/fs/suid_dumpable") as f:
            if f.read().strip() == "1":
                return None
    except OSError:
        pass
    return next((p for p in INIT_PROGRAMS if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def interpreter_paths() -> list[str]:
    # What the sandboxed interpreter must still see when its ancestors are hidden.
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.realpath(sys.executable)}
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            paths.add(sysconfig.get_path(key, vars=scheme_vars or None))
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    out: list[str] = []
    for p in real:  # drop paths inside an already kept one
        if not any(under(p, q) for q in out):
            out.append(p)
    return out


def layout_for(
    extra_hidden: Sequence[str], extra_shown: Sequence[str] = ()
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """What the sandbox shows: ``(ops, late)``. ``ops`` in order: ``("symlink", target, path)``,
    ``("ro-bind", path)``, ``("cover", path)`` (an extra hidden path inside a shown one); ``late``:
    interpreter paths under ``/tmp`` or ``/dev/shm``, bound after those private tmpfs are mounted.
    ``extra_shown``: existing host paths shown read-only besides the system's and the interpreter's (a sandboxed
    MCP server's own files); the hidden paths inside them stay hidden."""
    interpreter = interpreter_paths()
    ops: list[tuple[str, ...]] = []
    shown: list[str] = []
    for p in SYSTEM_PATHS:
        if os.path.islink(p):
            ops.append(("symlink", os.readlink(p), p))
        elif os.path.exists(p):
            shown.append(p)
    for p in [*interpreter, *(os.path.realpath(q) for q in extra_shown if os.path.exists(q))]:
        if not any(under(p, q) for q in shown):
            shown = [q for q in shown if not under(q, p)] + [p]
    shown.sort()
    late = tuple(p for p in shown if any(under(p, t) for t in PRIVATE_TMPFS))
    ops += [("ro-bind", p) for p in shown if p not in late]
    covered: list[str] = []
    for h in dict.fromkeys(os.path.realpath(p) for p in extra_hidden):
        if not os.path.lexists(h) or not any(under(h, q) for q in shown) or any(under(h, c) for c in covered):
            continue
        if any(under(k, h) for k in interpreter):
            logger.warning("sandbox: not hiding %s because the interpreter lives there", h)
            continue
        covered.append(h)
        ops.append(("cover", h))
    return tuple(ops), late
