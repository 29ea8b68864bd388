"""Start a sandboxed MCP server: ``python -I -S sandbox_exec.py`` with the launch in ``$TRL_MCP_SANDBOX_LAUNCH``.

Run by path (standard library only) under the reaper, by :class:`trl_plugins.tools.mcp.isolation.SandboxedLaunch`,
which puts there the sandbox's command line (bubblewrap or ``unshare``, then the runner) and the descriptors it
reads, each at the number the command line names: ``data`` (a memfd holding those bytes, base64), ``dup`` (a copy
of one of ours: stderr) or ``path`` (a file opened for writing: a cgroup's ``tasks``). This script removes the
variable, puts every descriptor in place and executes the command, which keeps its stdin and stdout (the MCP
transport) and its parent (the reaper)."""

import base64
import fcntl
import json
import os
import sys

SETUP_FAILED = 126


def main() -> None:
    try:
        launch = json.loads(os.environ.pop("TRL_MCP_SANDBOX_LAUNCH"))
        targets = [item["fd"] for item in launch["fds"]]
        floor = max([*targets, 2]) + 1  # above every target: nothing placed below is overwritten by a later one
        placed = []
        for item in launch["fds"]:
            if "data" in item:
                fd = os.memfd_create("sandbox-launch")
                os.write(fd, base64.b64decode(item["data"]))
                os.lseek(fd, 0, os.SEEK_SET)
            elif "dup" in item:
                fd = os.dup(item["dup"])
            else:
                fd = os.open(item["path"], os.O_WRONLY | os.O_CLOEXEC)
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)
            os.close(fd)
            placed.append((item["fd"], high))
        for target, high in placed:
            os.dup2(high, target)  # inheritable
            os.close(high)
        os.chdir(launch["cwd"])
        os.execve(launch["argv"][0], launch["argv"], launch["env"])
    except BaseException as exc:  # noqa: BLE001 - reported as the server's failure to start
        sys.stderr.write(f"the sandboxed MCP server could not be launched: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
