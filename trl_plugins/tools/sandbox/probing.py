"""Which sandbox isolation works on this machine: each mode probed by running code under it, the fixes that
apply where none does, and the once-per-process messages about what is in force (see docs/sandbox.md)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

from trl_plugins.tools.sandbox.launcher import (
    PROGRAM_ENV,
    SANDBOX_UID,
    Isolation,
    Launcher,
    Limits,
    resolve_program,
    run_cold,
)
from trl_plugins.tools.sandbox.runner import SYSCALLS

logger = logging.getLogger(__name__)

_PROBE_LIMITS = Limits(timeout_s=20.0, memory_mb=512, max_output_chars=4000, disk_mb=16)


INSTALL_BWRAP = "apt-get install -y bubblewrap (Debian, Ubuntu), dnf install -y bubblewrap (Fedora, RHEL)"
"""How to install bubblewrap, in the messages that ask for it."""


def probe(isolation: Isolation, program: str | None = None) -> str | None:
    """None if ``isolation`` works on this machine (launched through ``program``, default: resolved
    with :func:`resolve_program`), else why not (with what to do about it). The launch is tried once per
    process and program; a missing program is looked for again at each call (``PATH`` and the
    ``TRL_SANDBOX_*`` variables may change)."""
    if isolation != Isolation.NONE:
        program = program or resolve_program(isolation)
        if program is None:
            where = (
                f"${PROGRAM_ENV[isolation.value]} is set but names no executable"
                if os.environ.get(PROGRAM_ENV[isolation.value]) is not None
                else "not found on PATH"
            )
            install = f"install bubblewrap: {INSTALL_BWRAP}" if isolation == Isolation.BWRAP else "install util-linux"
            return f"{isolation.value} {where} ({install})"
        if isolation == Isolation.UNSHARE and os.uname().machine not in SYSCALLS:
            return f"the unshare mode knows no system call numbers for {os.uname().machine}"
    return _probe_launch(isolation, program)


@functools.cache
def _probe_launch(isolation: Isolation, program: str | None) -> str | None:
    try:
        raw = run_cold(Launcher.create(isolation, program=program), _PROBE_LIMITS, "print(6 * 7)")
    except (OSError, RuntimeError) as e:
        raw = {"error": f"{type(e).__name__}: {e}"}
    if raw.get("error"):
        reason = raw["error"]
    elif raw["exit_code"] == 0 and raw["stdout"] == "42\n":
        return None
    else:
        tail = raw["stderr"].strip().splitlines()
        reason = f"probe exited with {raw['exit_code']}: {tail[-1] if tail else 'no output'}"
    if isolation == Isolation.NONE and os.geteuid() == 0:
        reason += (
            f" (as root, 'none' runs the code as uid {SANDBOX_UID}, which must be able to read "
            f"the interpreter {os.path.realpath(sys.executable)}; use bwrap/unshare instead)"
        )
    if isolation == Isolation.BWRAP:
        reason += f" (bwrap needs user namespaces or root; check `{program} --ro-bind / / true`)"
    if isolation != Isolation.NONE:
        fixes = namespace_fixes(read_sysctl, os.geteuid() == 0, resolve_program(Isolation.BWRAP))
        if fixes:
            reason += " (likely: " + "; ".join(fixes) + ")"
    return reason


def read_sysctl(name: str) -> str | None:
    """The value of sysctl ``name`` (``kernel.x`` reads ``/proc/sys/kernel/x``), or None where it does not exist."""
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return None


def namespace_fixes(sysctl, as_root: bool, bwrap: str | None) -> list[str]:
    """The known fixes that apply where no namespaced isolation starts: each names its cause and what to do.

    Args:
        sysctl: ``name -> value or None`` (:func:`read_sysctl`; a fake in tests).
        as_root: whether the sandbox runs as root (AppArmor's and Debian's restrictions spare root).
        bwrap: where bubblewrap is, or None.

    Returns:
        One sentence per cause found (empty: none of the known causes is in force here).
    """
    fixes = []
    if not as_root and sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        profile = bwrap or "/usr/bin/bwrap"
        fixes.append(
            "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns=1, "
            "the default since Ubuntu 23.10): give bubblewrap an AppArmor profile that allows them, e.g. "
            f"/etc/apparmor.d/bwrap holding `abi <abi/4.0>, include <tunables/global> profile bwrap {profile} "
            "flags=(unconfined) { userns, }`, loaded with `apparmor_parser -r /etc/apparmor.d/bwrap`; or lift the "
            "restriction machine-wide: `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (kept across "
            "reboots in /etc/sysctl.d/); or run as root"
        )
    if not as_root and sysctl("kernel.unprivileged_userns_clone") == "0":
        fixes.append(
            "unprivileged user namespaces are switched off (kernel.unprivileged_userns_clone=0, Debian's "
            "older kernels): `sysctl -w kernel.unprivileged_userns_clone=1`, or run as root"
        )
    if sysctl("user.max_user_namespaces") == "0":
        fixes.append(
            "no user namespace may be made (user.max_user_namespaces=0): `sysctl -w user.max_user_namespaces=15000`"
        )
    if bwrap is None:
        fixes.append(f"bubblewrap is not installed: {INSTALL_BWRAP}")
    return fixes


def detect_isolation() -> Isolation:
    """The strongest namespaced :class:`Isolation` that works on this machine (probed once per process).

    Each candidate is probed by actually running ``print(6 * 7)`` under it. ``none`` is never chosen
    here: running model code without isolation must be asked for explicitly (``isolation="none"``).

    Returns:
        ``BWRAP`` if bubblewrap works, else ``UNSHARE``.

    Raises:
        RuntimeError: neither works (the message says why each failed and what to do).
    """
    reasons = {}
    for isolation in (Isolation.BWRAP, Isolation.UNSHARE):
        reason = probe(isolation, resolve_program(isolation))
        if reason is None:
            if isolation == Isolation.UNSHARE:
                warn_fallback_once(reasons[Isolation.BWRAP])
            return isolation
        reasons[isolation] = reason
    fixes = namespace_fixes(read_sysctl, os.geteuid() == 0, resolve_program(Isolation.BWRAP))
    raise RuntimeError(
        "no sandbox isolation works here: "
        + "; ".join(f"{k.value}: {v}" for k, v in reasons.items())
        + (
            ". What applies here: " + "; ".join(fixes)
            if fixes
            else ". None of the known causes (AppArmor's or Debian's restriction of user namespaces, "
            "user.max_user_namespaces=0, no bubblewrap) is in force; in a container, its seccomp profile or missing "
            "privileges may refuse namespaces (Docker: --security-opt seccomp=unconfined), or run as root"
        )
        + ". To run model code WITHOUT isolation (rlimits, cgroups and seccomp only: it can read the host's files, "
        "reach its network and signal its processes), pass isolation='none' explicitly."
    )


_logged_isolations: set[tuple[Isolation, str]] = set()
_log_lock = threading.Lock()

_fallback_warned = False


def warn_fallback_once(reason: str) -> None:
    """One WARNING per process: ``auto`` fell back from bubblewrap to unshare, why, and what that changes."""
    global _fallback_warned
    with _log_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    logger.warning(
        "sandbox: bubblewrap does not work here, falling back to isolation=unshare. Why: %s. What differs: no cgroup "
        "namespace (the code sees the host's cgroup path in /proc/self/cgroup) and the file tree is built by this "
        "project's runner (runner.setup_unshare_fs), not by bubblewrap; PID, network, IPC, UTS, mount and user "
        "namespaces, limits and the seccomp filter are the same (docs/sandbox.md). For bubblewrap: %s.",
        reason,
        INSTALL_BWRAP,
    )


def log_isolation_once(isolation: Isolation, mode: str) -> None:
    """Log the isolation in force once per (isolation, mode); warn once what ``none`` lacks."""
    with _log_lock:
        if (isolation, mode) in _logged_isolations:
            return
        _logged_isolations.add((isolation, mode))
        warn = isolation == Isolation.NONE and (Isolation.NONE, "") not in _logged_isolations
        _logged_isolations.add((isolation, ""))
    logger.info("sandbox: running model code under isolation=%s, mode=%s", isolation.value, mode)
    if warn:
        missing = "; ".join(
            f"{i.value}: {r}" for i in (Isolation.BWRAP, Isolation.UNSHARE) if (r := probe(i, resolve_program(i)))
        )
        logger.warning(
            "sandbox: isolation=none gives NO filesystem, network or process isolation (only rlimits): "
            "model code can read files, open sockets and leave processes behind. %s. "
            "Install bubblewrap (apt-get install -y bubblewrap) and make sure user namespaces or root are available.",
            f"Missing: {missing}" if missing else "bwrap/unshare work here but isolation='none' was requested",
        )
