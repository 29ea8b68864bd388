"""Run an agent command so that no process it starts outlives it: ``python -I -S reaper.py PARENT_PID -- COMMAND...``.

The agent endpoint starts every ``command:`` agent through this script (standard library only, so that it starts in a
few tens of milliseconds without the project on its path). It makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``: unprivileged, Linux 3.4+), so every process the command starts stays below it
whatever it does (a new session, a double fork: an orphan is re-parented here, not to init), then runs the command as
its child. When the command's own process exits, or this script gets SIGTERM (the endpoint at the agent's time limit
or a stop; the kernel when the rollout's thread dies, through ``PR_SET_PDEATHSIG``), it SIGKILLs every process below
it, reaps them and exits with the command's status (a command killed by a signal: killed by the same signal). What a
process outside this tree does (one started for the agent by another service) is out of its reach.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SETUP_FAILED = 126
"""Exit status when the command could not be set up (this script's message is on stderr)."""


class _Stop(Exception):
    """A signal asked for the command and everything below it to go."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def _below(root: int) -> list[int]:
    """Every process whose chain of parents reaches ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])  # the field after the state, past the command's name
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found:
                found.append(pid)
                todo.append(pid)
    return found


def _kill_everything_below() -> None:
    """SIGKILL every process below this one and reap them, until none is left (an orphan of any depth is re-parented
    here, so none is left exactly when this process has no child)."""
    me = os.getpid()
    while True:
        for pid in _below(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)  # the kill is on its way (or something forked meanwhile: the next round takes it)


def _exit_as(status: int | None) -> None:
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: already the default
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if status is not None else 128 + signal.SIGTERM)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: reaper.py PARENT_PID -- COMMAND...\n")
        os._exit(SETUP_FAILED)
    parent, command = int(argv[0]), argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    status = None
    try:
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (AttributeError, OSError):  # not Linux
            prctl = None
        if (
            prctl is None
            or prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
            or prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0
        ):
            why = os.strerror(ctypes.get_errno()) if prctl is not None else "no prctl on this system"
            sys.stderr.write(
                f"the agent endpoint cannot run the command under a subreaper (prctl: {why}; Linux 3.4 or "
                f"later needed)\n"
            )
            os._exit(SETUP_FAILED)
        if os.getppid() != parent:  # the rollout died before the death signal was armed
            os._exit(SETUP_FAILED)
        child = os.fork()
        if child == 0:
            try:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(sig, signal.SIG_DFL)  # as subprocess's restore_signals: the command starts clean
                os.execvp(command[0], command)
            except BaseException as exc:  # noqa: BLE001 - reported as the command's failure
                os.write(2, f"the agent command {command[0]!r} could not be started: {exc}\n".encode(errors="replace"))
            os._exit(127)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the command's output is its own: this process holds none of its pipes
            os.dup2(devnull, fd)
        while True:
            pid, st = os.waitpid(-1, 0)  # orphans of the command are reaped here as they end
            if pid == child:
                status = st
                break
    except _Stop:
        pass
    while True:
        try:
            _kill_everything_below()
            break
        except _Stop:  # asked again while at it: go on
            continue
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
