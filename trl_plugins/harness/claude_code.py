"""Claude Code as the agent harness of a trajectory: ``python -m trl_plugins.harness.claude_code`` is the ``command`` an
``agent_endpoint`` rollout runs per trajectory (the console script ``trl-plugins-claude-code``). It runs the stock
Claude Code CLI headless (``claude -p QUESTION --output-format stream-json --verbose``) against the endpoint, isolated:

- as the unprivileged user ``nobody`` (65534; a root caller drops to it before the sandbox starts, so the CLI's
  ``--permission-mode bypassPermissions``, which refuses root, runs), in bubblewrap's namespaces (user, mount, PID,
  network, IPC, UTS), of the host's files only the system's (:data:`SYSTEM_PATHS`) and the CLI's and the bridge
  interpreter's folders, read-only, a private ``/tmp``, and the trajectory's working directory the one place it
  writes: its ``HOME`` and ``CLAUDE_CONFIG_DIR`` are there, and
  its tools (``Bash``, ``Read``, ``Write``, ``Edit`` by default) act there;
- in a network namespace with only a loopback, where the endpoint's port is bridged in through a Unix socket in the
  working directory (:mod:`.bridge`): nothing else is reachable, on the host or beyond; ``WebFetch`` and ``WebSearch``
  are disallowed besides;
- with ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_AUTOUPDATER``, ``DISABLE_TELEMETRY`` and
  ``DISABLE_ERROR_REPORTING`` set and nothing else of the caller's environment; ``ANTHROPIC_MODEL`` and
  ``ANTHROPIC_DEFAULT_HAIKU_MODEL`` are the served name, so a request for the CLI's small model reaches the same
  session (and is trained) rather than leaving.

No memory limit is set beyond the machine's: the code sandbox's address-space limit would stop a JavaScript runtime
(the CLI reserves far more address space than it uses). The CLI comes from ``--claude``, ``$TRL_PLUGINS_CLAUDE``,
``claude`` on ``PATH``, or the binary the Claude Agent SDK's wheel bundles (the ``agents`` extra), in that order. Its
reward: 1.0 when the last ``\\boxed{}`` of its final result is the row's ``answer``, printed as the command's last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from trl_plugins.harness.bridge import UnixToTcp

__all__ = ["HarnessError", "find_claude", "isolated", "claude_argv", "main", "NOBODY", "QUIET"]

NOBODY = 65534
"""The uid and gid the harness runs as."""

QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
"""Set for every CLI the harness starts: no update checks, telemetry, error reports or other side traffic."""

TOOLS = "Bash,Read,Write,Edit"
"""Claude Code's tools the harness offers by default (``--tools``)."""


class HarnessError(RuntimeError):
    """The harness cannot run here (no bubblewrap, no CLI, a path the isolated user cannot read): what, and what to
    do."""


def _open_to_all(path: str) -> bool:
    """Whether an unprivileged user can reach and execute ``path``: every folder above it searchable by others."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)
    except OSError:
        return False


def find_claude(given: str | None = None) -> str:
    """The Claude Code CLI (module docstring's order).

    Raises:
        HarnessError: none found, or one the isolated user cannot run.
    """
    spec = importlib.util.find_spec("claude_agent_sdk")
    bundled = None
    if spec is not None and spec.origin:
        bundled = str(Path(spec.origin).parent / "_bundled" / "claude")
    for candidate in (given, os.environ.get("TRL_PLUGINS_CLAUDE"), shutil.which("claude"), bundled):
        if candidate and os.path.isfile(candidate):
            if not _open_to_all(candidate):
                raise HarnessError(
                    f"the Claude Code CLI {candidate} cannot be run by the unprivileged user the harness runs it as (a "
                    f"folder above it is closed to others): install it under a path others can read, or pass --claude."
                )
            return candidate
    raise HarnessError(
        "no Claude Code CLI: pip install 'trl-plugins[agents]' (the Claude Agent SDK's wheel bundles it), or npm "
        "install @anthropic-ai/claude-code and put claude on PATH, or pass --claude / set TRL_PLUGINS_CLAUDE."
    )


def _python_for_nobody() -> str:
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if candidate and _open_to_all(candidate):
            return candidate
    raise HarnessError(
        f"no Python interpreter the unprivileged user can run for the harness's bridge ({sys.executable} is under a "
        f"folder closed to others, and there is no /usr/bin/python3): install python3 from the system's packages."
    )


SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
"""What the sandbox shows of the host besides the programs it runs (read-only, where they exist): the system's programs,
libraries and configuration. Not ``/root``, ``/home``, ``/opt``, ``/var``, ``/work`` or the rest."""


def _shown(path: str) -> str:
    # The folder to show for a program: its installation's root (a Python's prefix, the CLI's folder).
    real = Path(os.path.realpath(path))
    return str(real.parent.parent if real.parent.name == "bin" else real.parent)


def isolated(
    workdir: str,
    argv: list[str],
    *,
    endpoint: tuple[str, int],
    env: dict[str, str],
    show: tuple[str, ...] = (),
) -> tuple[list[str], dict, str]:
    """The command line (and ``subprocess`` keywords) that runs ``argv`` isolated in ``workdir`` (module docstring),
    with ``endpoint``'s port, and no other, reachable on the namespace's loopback, and the host path of the bridge's
    Unix socket (in a short folder of its own, seen inside as ``/tmp/.bridge``: a socket's path has at most 107
    bytes), which the caller serves (``UnixToTcp(path, *endpoint)``) while it runs and removes after. Of the host's
    files only :data:`SYSTEM_PATHS`, the folders of ``argv[0]`` and of the bridge's interpreter, and ``show`` are
    visible, read-only.

    Raises:
        HarnessError: no bubblewrap, or a working directory the unprivileged user cannot reach.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise HarnessError(
            "the Claude Code harness runs the CLI in bubblewrap's namespaces and there is no bwrap here: install it "
            "(apt-get install bubblewrap); without it nothing keeps the CLI's tools off the network and the host."
        )
    python = _python_for_nobody()
    if os.geteuid() == 0 and not _open_to_all(str(Path(workdir).parent)):
        raise HarnessError(
            f"the working directory {workdir} is under a folder closed to others, where the harness's unprivileged "
            f"user cannot reach it: keep trajectories under a folder others may enter (--keep)."
        )
    outside = tempfile.mkdtemp(prefix="trl-bridge-")
    os.chmod(outside, 0o755)
    shutil.copyfile(Path(__file__).with_name("bridge.py"), os.path.join(outside, "bridge.py"))
    args = [bwrap]
    for path in SYSTEM_PATHS:
        if os.path.islink(path):  # a merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    programs = {_shown(p) for p in (argv[0], python, *show) if os.path.isabs(p)}
    for folder in sorted(programs):  # after the private /tmp, which would hide a checkout under /tmp
        if not any(folder == s or folder.startswith(s + "/") for s in SYSTEM_PATHS):
            args += ["--ro-bind", folder, folder]
    args += ["--ro-bind", outside, "/tmp/.bridge", "--bind", workdir, workdir]
    args += ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "harness"]
    args += ["--die-with-parent", "--new-session", "--chdir", workdir, "--clearenv"]
    for key, value in {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **env}.items():
        args += ["--setenv", key, value]
    args += ["--", python, "-I", "/tmp/.bridge/bridge.py", "--socket", "/tmp/.bridge/endpoint.sock"]
    args += ["--port", str(endpoint[1]), "--", *argv]
    kwargs: dict = {"cwd": "/"}
    if os.geteuid() == 0:  # drop to nobody before the sandbox starts: inside, as outside, it owns nothing else
        for root, dirs, files in os.walk(workdir):
            for name in (root, *(os.path.join(root, n) for n in dirs + files)):
                os.chown(name, NOBODY, NOBODY)
        kwargs.update(user=NOBODY, group=NOBODY, extra_groups=[])
    return args, kwargs, os.path.join(outside, "endpoint.sock")


def claude_argv(claude: str, question: str, options: argparse.Namespace) -> list[str]:
    """The CLI's headless command line: stream-json output, the served model, permissions bypassed (it is sandboxed),
    the harness's system prompt and tools, no settings files, no web tools."""
    return [
        claude,
        "-p",
        question,
        "--output-format",
        "stream-json",
        "--verbose",
        "--model",
        options.model,
        "--permission-mode",
        "bypassPermissions",
        *(["--system-prompt", options.system_prompt] if options.system_prompt else []),
        "--tools",
        options.tools,
        "--disallowedTools",
        "WebFetch,WebSearch",
        "--setting-sources",
        "",
        "--max-turns",
        str(options.max_turns),
    ]


def score(text: str, row: dict) -> float:
    """1.0 when the last ``\\boxed{}`` of ``text`` is the row's answer."""
    answers = re.findall(r"\\boxed\{([^{}]*)\}", text or "")
    return float(bool(answers) and answers[-1].strip() == str(row.get("answer", "")).strip())


def _options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trl_plugins.harness.claude_code", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--claude", help="the CLI (default: $TRL_PLUGINS_CLAUDE, claude on PATH, the SDK's bundled one)"
    )
    parser.add_argument("--model", default="policy", help="the model name the CLI asks for (any: the policy serves)")
    parser.add_argument(
        "--system-prompt", default="", help="replaces Claude Code's own (default: the stock prompt, kept)"
    )
    parser.add_argument("--tools", default=TOOLS, help="Claude Code's built-in tools offered (comma-separated)")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--keep", help="keep each trajectory's working directory under this folder (for inspection)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command agent: the row as JSON on stdin, the endpoint in ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``;
    prints the reward as its last line."""
    options = _options(argv)
    row = json.load(sys.stdin)
    base, key = os.environ.get("ANTHROPIC_BASE_URL"), os.environ.get("ANTHROPIC_API_KEY")
    if not base or not key:
        raise HarnessError("ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY are unset: run this as an agent_endpoint command.")
    url = urllib.parse.urlsplit(base)
    if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
        raise HarnessError(f"ANTHROPIC_BASE_URL={base!r}: the harness bridges a loopback endpoint with a port only.")
    claude = find_claude(options.claude)
    parent = options.keep or None
    if parent:
        os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="claude-code-", dir=parent)
    os.chmod(workdir, 0o755)
    env = {
        **QUIET,
        "HOME": workdir,
        "CLAUDE_CONFIG_DIR": os.path.join(workdir, ".claude"),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": options.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": options.model,
    }
    try:
        question = str(row["prompt"])
        args, kwargs, path = isolated(
            workdir, claude_argv(claude, question, options), endpoint=(url.hostname, url.port), env=env
        )
        host = UnixToTcp(path, "127.0.0.1", url.port)
        try:
            done = subprocess.run(args, capture_output=True, text=True, **kwargs)
        finally:
            host.close()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    finally:
        if not parent:
            shutil.rmtree(workdir, ignore_errors=True)
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    result = next((e for e in reversed(events) if isinstance(e, dict) and e.get("type") == "result"), None)
    if result is None:
        sys.stderr.write(done.stderr[-2000:])
        raise HarnessError(f"Claude Code exited {done.returncode} without a result (its stderr is above).")
    text = str(result.get("result") or "")
    if result.get("is_error") and "this trajectory has ended" in text:  # a budget (turns, tokens) ended it
        print(json.dumps({"reward": 0.0}))
        return 0
    if result.get("is_error"):
        raise HarnessError(f"Claude Code ended with an error: {text[:500]}")
    print(json.dumps({"reward": score(text, row)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
