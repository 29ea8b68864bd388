"""The code sandbox contains hostile code and behaves like a notebook cell.

The hostile corpus runs under every namespaced isolation this machine offers: bubblewrap and the
unshare fallback (named in every test id and recorded as the ``isolation`` property), in cold and warm
mode, so CI's plain ``python -m pytest`` covers both. Where cheap, a negative control shows the thing
the sandbox blocks does work from the test process itself. The last section holds the holes of
issue 12 (each failed on the sandbox before it), one test per hole.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from trl_plugins.tools import sandbox as sandbox_module
from trl_plugins.tools.sandbox import (
    ExecResult,
    Isolation,
    PythonSandbox,
    SandboxStats,
    detect_isolation,
    launcher,
    layout,
    pool,
    probing,
    runner,
)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1.0  # short: most hostile tests run into it
SLACK_S = 4.0  # kill + tear-down on a small shared machine; correctness bounds, not benchmarks
SECRET = "sk-trl-sandbox-" + uuid.uuid4().hex

try:
    STRONGEST: Isolation | None = detect_isolation()
    NO_ISOLATION_REASON = ""
except RuntimeError as e:  # pragma: no cover - machines without namespaces: rlimits only, asked for explicitly
    STRONGEST = Isolation.NONE if probing.probe(Isolation.NONE) is None else None
    NO_ISOLATION_REASON = str(e)

pytestmark = pytest.mark.skipif(STRONGEST is None, reason=f"no sandbox isolation works here: {NO_ISOLATION_REASON}")
NAMESPACED = STRONGEST in (Isolation.BWRAP, Isolation.UNSHARE)
requires_namespaces = pytest.mark.skipif(
    not NAMESPACED,
    reason="needs bwrap or unshare (apt-get install -y bubblewrap); isolation=none does not contain this",
)
requires_bwrap = pytest.mark.skipif(
    STRONGEST != Isolation.BWRAP, reason="bubblewrap is not available here (apt-get install -y bubblewrap)"
)
ALT_ISOLATIONS = [iso for iso in (Isolation.UNSHARE,) if STRONGEST not in (None, iso) and probing.probe(iso) is None]


def _sandbox(mode: str, isolation: Isolation | str | None = None, **kwargs) -> PythonSandbox:
    isolation = STRONGEST if isolation is None else isolation
    defaults = dict(
        timeout_s=TIMEOUT_S,
        memory_mb=256,
        max_output_chars=2000,
        max_concurrency=8,
        warm_imports=("math", "numpy"),
        disk_mb=16,
    )
    return PythonSandbox(mode=mode, isolation=isolation, **{**defaults, **kwargs})


ALL_NAMESPACED = [(iso, m) for iso in [STRONGEST, *ALT_ISOLATIONS] if iso is not None for m in ("cold", "warm")]


MODES = [
    (iso, m)
    for iso in [STRONGEST, *ALT_ISOLATIONS]
    if iso in (Isolation.BWRAP, Isolation.UNSHARE)
    for m in ("cold", "warm")
]
"""(isolation, mode) pairs for the tests that need a sandbox of their own."""
SYSCALL_NR = runner.SYSCALLS.get(os.uname().machine, {})


def _mode_id(p) -> str:
    return f"{p[1]}-{p[0]}"


@pytest.fixture(scope="module", params=ALL_NAMESPACED, ids=lambda p: f"{p[1]}-{p[0]}")
def sandbox(request):
    """Every isolation that works here (bwrap and the unshare fallback), in both modes: the hostile
    corpus runs under each."""
    isolation, mode = request.param
    sb = _sandbox(mode, isolation)
    yield sb
    sb.close()


@pytest.fixture(scope="module", params=ALL_NAMESPACED, ids=lambda p: f"{p[1]}-{p[0]}")
def patient_sandbox(request):
    """``sandbox`` with a 10 s time limit: for a limit that must be reached before the clock runs out, also on a
    loaded machine (under the suite's load a bomb growing 16 MB at a time ran into the 1 s limit before 256 MB)."""
    isolation, mode = request.param
    sb = _sandbox(mode, isolation, timeout_s=10.0)
    yield sb
    sb.close()


@pytest.fixture(scope="module", params=ALL_NAMESPACED, ids=lambda p: f"{p[1]}-{p[0]}")
def any_sandbox(request):
    """Every working namespaced isolation, both modes: for the checks that must hold in all of them."""
    isolation, mode = request.param
    sb = _sandbox(mode, isolation)
    yield sb
    sb.close()


@pytest.fixture(autouse=True)
def _record_isolation(record_property, request):
    for name in ("sandbox", "any_sandbox", "patient_sandbox"):
        if name in request.fixturenames:
            sb = request.getfixturevalue(name)
            record_property("isolation", sb.isolation.value)
            record_property("mode", sb.mode)
            return
    record_property("isolation", str(STRONGEST))


def _uid_pids(uid: int, pid_ns: str | None = None) -> set[int]:
    """Pids of ``uid``'s processes; only those in PID namespace ``pid_ns`` (``pid:[inode]``) when given."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            if pid_ns is not None and os.readlink(f"/proc/{entry}/ns/pid") != pid_ns:
                continue
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) == uid:
            pids.add(int(entry))
    return pids


def _pids_with_cmdline(fragment: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if fragment.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _eventually_none(fn, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        left = fn()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------
# What the sandbox runs under.
# ---------------------------------------------------------------------------------------------------


def test_reports_the_isolation_in_force(sandbox, record_property):
    result = sandbox.run("print('hi')")
    print(f"isolation in force: {sandbox.isolation.value} (mode={sandbox.mode})")
    assert sandbox.isolation in (STRONGEST, *ALT_ISOLATIONS)
    assert result.isolation == sandbox.isolation.value and result.mode == sandbox.mode


@requires_bwrap
def test_bwrap_is_preferred_when_it_works():
    assert probing.probe(Isolation.BWRAP) is None
    assert detect_isolation() == Isolation.BWRAP


def test_logs_the_isolation_once(monkeypatch, caplog):
    monkeypatch.setattr(probing, "_logged_isolations", set())
    with caplog.at_level(logging.INFO, logger=sandbox_module.__name__):
        _sandbox("cold").close()
        _sandbox("cold").close()
    messages = [r.getMessage() for r in caplog.records if "isolation=" in r.getMessage()]
    assert messages == [f"sandbox: running model code under isolation={STRONGEST.value}, mode=cold"]


def test_isolation_none_warns_what_is_missing(monkeypatch, caplog):
    # NONE may not be constructible here (root + interpreter under /root), so call the logger directly.
    monkeypatch.setattr(probing, "_logged_isolations", set())
    with caplog.at_level(logging.INFO, logger=sandbox_module.__name__):
        probing.log_isolation_once(Isolation.NONE, "cold")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "apt-get install -y bubblewrap" in warnings[0] and "NO filesystem" in warnings[0]


def test_isolation_none_refuses_clearly_when_it_cannot_drop_root():
    reason = probing.probe(Isolation.NONE)
    if reason is None:
        with _sandbox("cold", Isolation.NONE) as sb:
            assert sb.run("print(6 * 7)").stdout == "42\n"
        return
    with pytest.raises(RuntimeError, match="isolation 'none' does not work on this machine"):
        _sandbox("cold", Isolation.NONE)


@requires_namespaces
def test_code_runs_unprivileged(any_sandbox):
    result = any_sandbox.run(
        "import os\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(os.getuid(), os.getgid(), status['CapEff'].strip(), status['CapBnd'].strip(), status['NoNewPrivs'].strip())"
    )
    uid, gid, cap_eff, cap_bnd, nnp = result.stdout.split()
    if os.geteuid() == 0:
        assert (uid, gid) == ("65534", "65534")
    assert int(cap_eff, 16) == 0 and int(cap_bnd, 16) == 0 and nnp == "1"


# ---------------------------------------------------------------------------------------------------
# Notebook-cell semantics.
# ---------------------------------------------------------------------------------------------------


def test_stdout_on_success(sandbox):
    result = sandbox.run("print('hello')\nprint('world')")
    assert result == ExecResult(
        ok=True,
        stdout="hello\nworld\n",
        stderr="",
        exit_code=0,
        timed_out=False,
        latency_s=result.latency_s,
        output_truncated=False,
        isolation=sandbox.isolation.value,
        mode=sandbox.mode,
    )
    assert 0 < result.latency_s < 10


@pytest.mark.parametrize(
    ("code", "stdout"),
    [
        ("x = 2\nx + 3", "5\n"),  # last expression is printed
        ("'ab'", "'ab'\n"),  # as its repr, like Jupyter
        ("None", ""),  # None is not printed
        ("print(1)", "1\n"),  # print(...) returns None: printed once, not followed by "None"
        ("x = 1", ""),  # an assignment is not an expression
        ("import math\nmath.factorial(5)", "120\n"),
        ("import numpy as np\nnp.arange(4)", "array([0, 1, 2, 3])\n"),
    ],
)
def test_auto_prints_last_expression(sandbox, code, stdout):
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert result.stdout == stdout


def test_traceback_names_the_models_own_lines(sandbox):
    result = sandbox.run("def f(x):\n    return 1 / x\n\nprint('before')\nf(0)")
    assert not result.ok and result.exit_code == 1 and result.stdout == "before\n"
    assert 'File "<cell>", line 5, in <module>' in result.stderr
    assert 'File "<cell>", line 2, in f' in result.stderr
    assert "    return 1 / x" in result.stderr  # the source line is shown
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert not _runner_frames(result.stderr) and "<string>" not in result.stderr  # no runner frames


def test_syntax_error_is_reported_plainly(sandbox):
    result = sandbox.run("x = (1,\nprint(x)")
    assert not result.ok
    assert '"<cell>"' in result.stderr and "SyntaxError" in result.stderr
    assert not _runner_frames(result.stderr)


def _runner_frames(stderr: str) -> list[str]:
    """Traceback frames of the in-sandbox runner's own functions that leaked into ``stderr``."""
    from trl_plugins.tools.sandbox import runner

    with open(runner.__file__) as f:
        tree = ast.parse(f.read())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return [f", in {name}" for name in sorted(names) if f", in {name}\n" in stderr + "\n"]


def test_the_runner_frame_check_can_fail():
    assert _runner_frames('  File "<string>", line 9, in exec_cell\n    exec(code)\n') == [", in exec_cell"]


def test_sys_exit_sets_the_exit_code(sandbox):
    assert sandbox.run("import sys\nsys.exit(3)").exit_code == 3
    assert sandbox.run("import sys\nprint('x')\nsys.exit(0)").ok


def test_numpy_and_sympy_are_importable():
    with _sandbox("warm", timeout_s=20.0, warm_imports=("numpy", "sympy"), max_concurrency=1) as sb:
        result = sb.run("import numpy as np, sympy\nprint(int(np.arange(5).sum()), sympy.factorint(2**32 + 1))")
    assert result.stdout == "10 {641: 1, 6700417: 1}\n", result.stderr


def test_statelessness(sandbox):
    first = sandbox.run(
        "import builtins, math, os\n"
        "open('state.txt', 'w').write('1')\n"
        "open('/tmp/state.txt', 'w').write('1')\n"
        "os.makedirs('/dev/shm/state', exist_ok=True)\n"
        "builtins.LEAKED = 1\n"
        "math.LEAKED = 1  # math is preloaded in warm servers\n"
        "LEAKED_GLOBAL = 1\n"
        "print(sorted(os.listdir('.')))"
    )
    assert first.stdout == "['state.txt']\n", first.stderr
    second = sandbox.run(
        "import builtins, math, os\n"
        "print(os.path.exists('state.txt'), os.path.exists('/tmp/state.txt'), os.path.exists('/dev/shm/state'),\n"
        "      hasattr(builtins, 'LEAKED'), hasattr(math, 'LEAKED'), 'LEAKED_GLOBAL' in globals(), os.listdir('.'))"
    )
    assert second.stdout == "False False False False False False []\n", second.stderr


def test_warm_calls_do_not_repeat_random_state(sandbox):
    code = "import random, numpy as np\nprint(random.random(), np.random.rand())"
    outputs = {sandbox.run(code).stdout for _ in range(3)}
    assert len(outputs) == 3


# ---------------------------------------------------------------------------------------------------
# Time.
# ---------------------------------------------------------------------------------------------------

TIMEOUT_LINE = f"TimeoutError: execution exceeded {TIMEOUT_S} s wall-clock limit and was killed"


@pytest.mark.parametrize(
    "code",
    [
        "print('started')\nwhile True:\n    pass",
        "import time\nprint('started')\ntime.sleep(100)",
        # SIGTERM ignored, in the code's process and in a child of it: SIGKILL does not care.
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('started')\nwhile True:\n    time.sleep(0.01)",
    ],
    ids=["infinite-loop", "sleep", "sigterm-ignored"],
)
def test_timeouts_are_enforced_and_reported_plainly(sandbox, code):
    result = sandbox.run(code)
    assert result.timed_out and not result.ok and result.exit_code == -signal.SIGKILL
    assert result.stdout == "started\n"  # output before the kill is kept (unbuffered)
    assert result.stderr.splitlines()[-1] == TIMEOUT_LINE
    assert TIMEOUT_S <= result.latency_s < TIMEOUT_S + SLACK_S


@requires_namespaces
def test_child_ignoring_sigterm_does_not_outlive_the_timeout(any_sandbox):
    marker = f"{time.time() % 1000 + 2000:.6f}"
    result = any_sandbox.run(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep({marker})'])\n"
        "time.sleep(100)"
    )
    assert result.timed_out
    assert _eventually_none(lambda: _pids_with_cmdline(f"time.sleep({marker})")) == []


_CLONE_PARENT = (
    "import ctypes, os, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "r = libc.syscall({nr}, ctypes.c_long(0x8000 | 17), *[ctypes.c_long(0)] * 4)  # clone(CLONE_PARENT | SIGCHLD)\n"
    "if r == 0:\n"
    "    os.execv('/bin/sleep', ['sleep', '{marker}'])  # the sibling: a child of the code's parent\n"
    "print('clone ->', r > 0, flush=True)\n"
)


@requires_namespaces
@pytest.mark.skipif(not SYSCALL_NR, reason="no system call numbers for this machine")
@pytest.mark.parametrize("then", ["exits", "times-out"])
def test_a_sibling_cloned_with_clone_parent_neither_stalls_the_call_nor_outlives_it(sandbox, then):
    # Round four: a process the code clones with CLONE_PARENT is a child of the code's parent, which in warm mode
    # is the server; the server waited for the namespace's init and the init for that sibling to be reaped, each
    # for the other, until the host's deadline (61 s under a 1 s limit here), which returned no output.
    marker = f"{time.time() % 1000 + 4000:.6f}"
    code = _CLONE_PARENT.format(nr=SYSCALL_NR["clone"], marker=marker) + (
        "" if then == "exits" else "time.sleep(100)\n"
    )
    result = sandbox.run(code)
    assert result.stdout == "clone -> True\n", result
    if then == "exits":
        assert result.ok and result.latency_s < TIMEOUT_S + SLACK_S, result
    else:
        assert result.timed_out and result.stderr.splitlines()[-1] == TIMEOUT_LINE, result
        assert TIMEOUT_S <= result.latency_s < TIMEOUT_S + SLACK_S, result
    assert _eventually_none(lambda: _pids_with_cmdline(marker), 3.0) == []


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                pass
        found.append(p)
    return found


@requires_namespaces
@pytest.mark.parametrize("isolation", [iso for iso, m in MODES if m == "warm"], ids=str)
def test_a_warm_server_that_stops_answering_is_killed_at_the_limit_plus_grace_and_the_output_kept(
    isolation, monkeypatch
):
    # Round four: when the server did not answer, the host waited until timeout_s + 60 s and returned empty output
    # although it holds the output files. Now the host stops the server (and all it runs) KILL_GRACE_S after the
    # limit and returns what the code printed. The server is frozen (SIGSTOP) mid-call to reach that path.
    monkeypatch.setattr(pool, "KILL_GRACE_S", 0.5)
    marker = f"{time.time() % 1000 + 5000:.6f}"
    with _sandbox("warm", isolation, warm_imports=(), max_concurrency=1) as sb:
        sb.warm_up(1)
        server = sb._pool._idle[0]

        def freeze() -> None:
            time.sleep(0.3)
            for pid in _descendants(server.proc.pid):
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass

        threading.Thread(target=freeze, daemon=True).start()
        result = sb.run(
            f"import subprocess, time\nsubprocess.Popen(['/bin/sleep', '{marker}'])\n"
            "print('started', flush=True)\ntime.sleep(100)"
        )
        after = sb.run("print('a fresh server')")
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.stdout == "started\n", result
    assert result.stderr.splitlines()[-1] == TIMEOUT_LINE, result
    assert TIMEOUT_S + 0.5 <= result.latency_s < TIMEOUT_S + 0.5 + SLACK_S, result
    assert after.stdout == "a fresh server\n", after
    assert server.proc.poll() is not None
    assert _eventually_none(lambda: _pids_with_cmdline(marker), 3.0) == []


# ---------------------------------------------------------------------------------------------------
# Memory, processes, output, disk.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(4 * 1024**3)",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))",
        "import numpy as np\nnp.ones((50000, 50000))",
    ],
    ids=["one-big-allocation", "growing-list", "numpy"],
)
def test_memory_bombs_raise_memory_error(patient_sandbox, code):
    result = patient_sandbox.run(code)
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr.strip().splitlines()[-1]
    assert patient_sandbox.run("print('still usable')").stdout == "still usable\n"


def test_fork_bomb_is_contained(sandbox):
    before = _uid_pids(sandbox_module.SANDBOX_UID)
    result = sandbox.run(
        "import os\n"
        "print(os.readlink('/proc/self/ns/pid'), flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass"
    )
    assert not result.ok
    assert result.latency_s < TIMEOUT_S + SLACK_S
    pid_ns = result.stdout.split("\n", 1)[0]
    assert pid_ns.startswith("pid:["), result.stdout[:200]
    if NAMESPACED:  # each call gets a PID namespace of its own, holding the bomb's processes and nothing else
        assert pid_ns != os.readlink("/proc/self/ns/pid")
    if os.geteuid() == 0:  # every sandbox process runs as this uid; all the bomb's must be gone
        # Only the bomb's namespace: other test workers run sandboxes under this uid at the same time.
        assert _eventually_none(lambda: _uid_pids(sandbox_module.SANDBOX_UID, pid_ns) - before) == set()
    assert sandbox.run("print('ok')").stdout == "ok\n"


def test_processes_are_capped(sandbox):
    result = sandbox.run(
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while n < 1000:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.strerror)"
    )
    n, reason = result.stdout.split(" ", 1)
    assert int(n) < sandbox_module.MAX_PROCESSES and "Resource temporarily unavailable" in reason


def test_stdout_flood_keeps_the_tail(sandbox):
    # Not a timeout test: 200k prints can take more than TIMEOUT_S on a busy machine (parallel workers).
    with _sandbox(sandbox.mode, sandbox.isolation, timeout_s=30.0) as sb:
        result = sb.run("for i in range(200000):\n    print(i)\nprint('END')")
    assert result.ok and result.output_truncated, result
    assert len(result.stdout) <= sandbox.max_output_chars
    assert result.stdout.startswith("[sandbox: output truncated") and result.stdout.endswith("199999\nEND\n")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_endless_output_flood_is_stopped(sandbox, stream):
    result = sandbox.run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)")
    assert not result.ok and result.output_truncated
    assert result.latency_s < TIMEOUT_S + SLACK_S
    text = getattr(result, stream)
    assert len(text) <= sandbox.max_output_chars + 200  # + the final status line
    assert "output limit was hit" in text


def test_binary_output_is_decoded_safely(sandbox):
    result = sandbox.run(
        "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)\nsys.stdout.flush()\nprint('after')"
    )
    assert result.ok and "\ufffd" in result.stdout and result.stdout.endswith("after\n")


@requires_namespaces
def test_disk_fill_is_stopped(sandbox):
    result = sandbox.run(
        "import os\n"
        "def fill(prefix, file_mb):\n"
        "    written = 0\n"
        "    try:\n"
        "        for i in range(1000):\n"
        "            with open(f'{prefix}{i}', 'wb') as f:\n"
        "                for _ in range(file_mb):\n"
        "                    f.write(b'\\0' * 2**20)\n"
        "                    written += 1\n"
        "    except OSError as e:\n"
        "        return f'{written} {e.strerror}'\n"
        "    return f'{written} not stopped'\n"
        "print(fill('one', 1000))  # a single file: RLIMIT_FSIZE\n"
        "for d in ('.', '/tmp', '/dev/shm'):\n"
        "    print(fill(d + '/many', 4))  # many files: the tmpfs size"
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "8 File too large", result.stderr
    for line in lines[1:]:
        written, reason = line.split(" ", 1)
        assert reason == "No space left on device" and int(written) <= 16


# ---------------------------------------------------------------------------------------------------
# Secrets, network, filesystem.
# ---------------------------------------------------------------------------------------------------

_SCAN_ENVIRONMENTS = (
    "import os\n"
    "seen = [f'{k}={v}' for k, v in os.environ.items()]\n"
    "for pid in os.listdir('/proc'):\n"
    "    for name in ('environ', 'cmdline'):\n"
    "        try:\n"
    "            seen.append(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace'))\n"
    "        except OSError:\n"
    "            pass\n"
    "print('\\n'.join(seen))"
)


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_environment_secrets_are_not_visible(monkeypatch, mode):
    for key in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY"):
        monkeypatch.setenv(key, SECRET)
    assert os.environ["HF_TOKEN"] == SECRET  # control: the parent does hold the secret
    with _sandbox(mode, warm_imports=(), max_concurrency=1, max_output_chars=10**6) as sb:  # after the secret was set
        result = sb.run(_SCAN_ENVIRONMENTS)
    assert result.ok, result.stderr
    assert "PATH=" in result.stdout  # the scan did read the environment
    assert SECRET not in result.stdout and "WANDB_API_KEY" not in result.stdout


@requires_namespaces
def test_netrc_and_home_files_are_not_readable(any_sandbox, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    netrc = home / ".netrc"
    netrc.write_text(f"machine api.wandb.ai login user password {SECRET}\n")
    netrc.chmod(0o644)  # world-readable on purpose: only the sandbox may keep it out of reach
    candidates = [str(netrc)]
    root_file = Path("/root") / f".netrc-trl-sandbox-test-{uuid.uuid4().hex}"
    if os.access("/root", os.W_OK):
        root_file.write_text(f"password {SECRET}\n")
        root_file.chmod(0o644)
        candidates.append(str(root_file))
    try:
        for path in candidates:
            assert SECRET in Path(path).read_text()  # control: readable from the host
        result = any_sandbox.run(
            "import os\n"
            f"for p in {candidates!r} + [os.path.expanduser('~/.netrc'), '/root/.netrc']:\n"
            "    try:\n"
            "        print(p, open(p).read())\n"
            "    except OSError as e:\n"
            "        print(p, type(e).__name__)"
        )
    finally:
        root_file.unlink(missing_ok=True)
    assert result.ok, result.stderr
    assert SECRET not in result.stdout
    assert result.stdout.count("FileNotFoundError") == len(candidates) + 2


@requires_namespaces
def test_network_is_unreachable_even_on_loopback(any_sandbox):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # control: reachable from here
            pass
        server.accept()[0].close()
        result = any_sandbox.run(
            "import socket\n"
            f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n"
            "    s = socket.socket()\n"
            "    s.settimeout(0.5)\n"
            "    print(host, s.connect_ex((host, port)) != 0)\n"
            "try:\n"
            "    socket.getaddrinfo('pypi.org', 443)\n"
            "    print('dns resolved')\n"
            "except OSError:\n"
            "    print('dns failed')"
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing from the sandbox arrived
    finally:
        server.close()
    assert result.stdout == "127.0.0.1 True\n1.1.1.1 True\n10.0.0.1 True\ndns failed\n", result.stderr


@requires_namespaces
def test_writes_outside_the_scratch_dir_do_not_reach_the_host(any_sandbox, tmp_path):
    tag = uuid.uuid4().hex
    targets = [
        tmp_path / "escape.txt",
        Path("/tmp") / f"escape-{tag}",
        Path("/var/tmp") / f"escape-{tag}",
        REPO / f".escape-{tag}",
        Path("/dev/shm") / f"escape-{tag}",
    ]
    for target in targets:  # control: the host can write each of these
        target.write_text("host")
        target.unlink()
    result = any_sandbox.run(
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('pwned')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, p)"
    )
    assert result.ok, result.stderr
    assert [t for t in targets if t.exists()] == []


@requires_namespaces
def test_double_forked_daemon_does_not_survive(any_sandbox):
    marker = f"{time.time() % 1000 + 1000:.6f}"
    result = any_sandbox.run(
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "time.sleep(0.3)\n"
        "running = any(b'" + marker + "' in open(f'/proc/{p}/cmdline', 'rb').read()\n"
        "              for p in os.listdir('/proc') if p.isdigit())\n"
        "print('daemon running:', running)"
    )
    assert result.stdout == "daemon running: True\n", result.stderr  # control: it did start
    assert _eventually_none(lambda: _pids_with_cmdline(marker)) == []


@requires_namespaces
@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.kill(os.getppid(), 9)",
        "import os\nos.killpg(os.getpgid(0), 9)",
        "import os\nos.kill(-1, 9)",
        "import subprocess\nsubprocess.run(['kill', '-9', '-1'])",
        "import os\nos.kill(1, 9)",
    ],
    ids=["kill-parent", "killpg-own-group", "kill-all", "shell-kill-all", "kill-pid-1"],
)
def test_killing_the_supervisor_fails_and_the_sandbox_stays_usable(sandbox, code):
    sandbox.run(code)  # whatever it reports, it must not take anything else down
    assert os.getpid() > 0  # we are still here
    assert sandbox.run("print('alive')").stdout == "alive\n"


_REACH_INIT = (
    "import ctypes, os, signal, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.ptrace.restype = ctypes.c_long\n"
    "libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]\n"
    "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
    "print('uid', os.getuid(), 'caps', int(status['CapEff'], 16), 'no_new_privs', status['NoNewPrivs'].strip())\n"
    "def reach(pid):\n"
    "    try:\n"
    "        mem = open(f'/proc/{pid}/mem', 'r+b', buffering=0)\n"
    "    except OSError as e:\n"
    "        wrote = type(e).__name__\n"
    "    else:\n"
    "        with mem:  # the same bytes back: a write that succeeds changes nothing\n"
    "            start = int(open(f'/proc/{pid}/maps').readline().split('-')[0], 16)\n"
    "            mem.seek(start)\n"
    "            data = mem.read(8)\n"
    "            mem.seek(start)\n"
    "            wrote = f'wrote {mem.write(data)}'\n"
    "    if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH\n"
    "        os.waitpid(pid, 0x40000000)  # __WALL: until it stops\n"
    "        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH\n"
    "        attached = 'attached'\n"
    "    else:\n"
    "        attached = os.strerror(ctypes.get_errno())\n"
    "    return wrote, attached\n"
    "print('init', *reach(1))\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    time.sleep(10)\n"
    "    os._exit(0)\n"
    "print('control', *reach(child))  # the checker can fail: the code's own child is reachable\n"
    "os.kill(child, signal.SIGKILL)\n"
)


def _check_init_unreachable(result: ExecResult, uid: int | None) -> None:
    lines = result.stdout.splitlines()
    assert result.ok and len(lines) == 3, result
    who, caps, no_new_privs = lines[0].split()[1::2]
    assert (caps, no_new_privs) == ("0", "1") and (uid is None or who == str(uid)), result
    assert lines[1] == "init PermissionError Operation not permitted", result  # "init wrote 8 attached" before
    assert lines[2] == "control wrote 8 attached", result


@requires_namespaces
def test_the_calls_init_can_be_neither_written_nor_traced(any_sandbox):
    # Round four: a warm call's PID-namespace init was a `sleep` exec'd as the call's uid, dumpable again after
    # exec: the code opened /proc/1/mem read-write, wrote it and PTRACE_ATTACHed it (0), the init holding none of
    # the call's limits and one of its two filters. Cold mode refused both, as every mode must.
    _check_init_unreachable(any_sandbox.run(_REACH_INIT), None)


_AS_ROOT_INSIDE = {
    # The line that writes the code's uid/gid maps, and the same maps with uid and gid 0 inside: the code then runs
    # as root of its user namespace (capabilities dropped, no_new_privs), which the sandbox itself never does.
    "cold": (
        'check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")\n        write_id_maps(uid, gid)\n',
        'check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")\n        ',
    ),
    "warm": (
        '"unshare per-call namespaces",\n        )\n        write_id_maps(uid, gid)\n',
        '"unshare per-call namespaces",\n        )\n        ',
    ),
}
_ROOT_MAPS = (
    "[open(f'/proc/self/{n}', 'w').write(t) for n, t in (('uid_map', f'0 {uid} 1\\n'), "
    "('setgroups', 'deny\\n'), ('gid_map', f'0 {gid} 1\\n'))]\n"
)


@requires_namespaces
@pytest.mark.parametrize("isolation_mode", MODES, ids=_mode_id)
def test_the_calls_init_stays_unreachable_from_root_inside_the_namespace(isolation_mode, monkeypatch):
    # Round four: non-dumpable alone does not stop a process holding CAP_SYS_PTRACE in the init's user namespace, so
    # the same check as root of the code's user namespace, capabilities dropped and no_new_privs set.
    isolation, mode = isolation_mode
    old, new = _AS_ROOT_INSIDE[mode]
    source = launcher.runner_source()
    assert source.count(old) == 1  # the patch below still applies
    monkeypatch.setattr(launcher, "runner_source", lambda: source.replace(old, new + _ROOT_MAPS))
    with _sandbox(mode, isolation, warm_imports=(), max_concurrency=1) as sb:
        result = sb.run(_REACH_INIT)
    _check_init_unreachable(result, 0)


# ---------------------------------------------------------------------------------------------------
# Concurrency, statistics, lifecycle, validation.
# ---------------------------------------------------------------------------------------------------


def test_arun_calls_run_concurrently(sandbox):
    n, sleep_s = 8, 0.5
    sandbox.warm_up()  # server start-up is not what this measures

    async def main():
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[sandbox.arun(f"import time\ntime.sleep({sleep_s})\nprint({i})") for i in range(n)]
        )
        return results, time.perf_counter() - t0

    results, elapsed = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(n)]
    assert elapsed < 0.6 * n * sleep_s, f"{n} calls of {sleep_s} s took {elapsed:.2f} s: not concurrent"


def test_max_concurrency_is_respected():
    with _sandbox("cold", max_concurrency=2, warm_imports=()) as sb:

        async def main():
            t0 = time.perf_counter()
            await asyncio.gather(*[sb.arun("import time\ntime.sleep(0.3)") for _ in range(4)])
            return time.perf_counter() - t0

        elapsed = asyncio.run(main())
    assert elapsed >= 0.6  # 4 calls, 2 at a time: at least two rounds of 0.3 s


def test_step_stats_reset_while_totals_accumulate():
    with _sandbox("cold", warm_imports=()) as sb:
        sb.run("print(1)")
        sb.run("1 / 0")
        sb.run("while True: pass")
        step = sb.stats()
        assert (step.calls, step.successes, step.errors, step.timeouts) == (3, 1, 1, 1)
        assert 0 < step.latency_p50_s <= step.latency_p90_s <= step.latency_p99_s <= step.latency_max_s
        assert step.latency_max_s >= TIMEOUT_S  # the timed-out call
        sb.reset_step_stats()
        assert sb.stats() == SandboxStats(0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)
        sb.run("print(2)")
        assert (sb.stats().calls, sb.stats().successes) == (1, 1)
        total = sb.total_stats()
        assert (total.calls, total.successes, total.errors, total.timeouts) == (4, 2, 1, 1)
        metrics = total.to_metrics()
        assert metrics["sandbox/calls"] == 4.0 and set(metrics) == {
            "sandbox/calls",
            "sandbox/successes",
            "sandbox/errors",
            "sandbox/timeouts",
            "sandbox/latency_p50_s",
            "sandbox/latency_p90_s",
            "sandbox/latency_p99_s",
            "sandbox/latency_max_s",
        }


def test_percentiles_interpolate_linearly():
    # 5 sorted values, position (n-1)*q: p50 -> index 2 -> 3.0; p90 -> 3.6 -> 4 + 0.6*(10-4) = 7.6
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert sandbox_module._percentile(values, 0.5) == 3.0
    assert sandbox_module._percentile(values, 0.9) == pytest.approx(7.6)
    assert sandbox_module._percentile([], 0.5) == 0.0


@requires_namespaces
def test_a_dead_warm_server_is_reported_and_replaced():
    with _sandbox("warm", warm_imports=(), max_concurrency=1, timeout_s=10.0) as sb:
        sb.warm_up(1)
        victim = sb._pool._idle[0].proc.pid  # the server's bwrap/unshare process on the host
        threading.Timer(0.5, lambda: os.killpg(victim, signal.SIGKILL)).start()
        result = sb.run("import time\ntime.sleep(5)")
        assert result.exit_code is None and not result.ok and not result.timed_out
        assert "server died during this call" in result.stderr
        after = sb.run("print('fresh server')")
        assert after.stdout == "fresh server\n" and sb._pool._idle[0].proc.pid != victim


def test_close_and_context_manager():
    with _sandbox("warm", warm_imports=(), max_concurrency=1) as sb:
        assert sb.run("print(1)").ok
        server = sb._pool._idle[0]
    assert server.proc.poll() is not None  # the server was stopped
    with pytest.raises(RuntimeError, match="closed"):
        sb.run("print(1)")
    sb.close()  # idempotent


def test_run_rejects_non_strings(sandbox):
    with pytest.raises(TypeError, match="code must be a str"):
        sandbox.run(b"print(1)")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a number >= 0.01"),
        ({"timeout_s": "5"}, "timeout_s must be a number"),
        ({"timeout_s": float("inf")}, "timeout_s must be a number"),
        ({"memory_mb": 8}, "memory_mb must be an integer >= 32"),
        ({"memory_mb": 512.0}, "memory_mb must be an integer"),
        ({"max_output_chars": 10}, "max_output_chars must be an integer >= 256"),
        ({"max_concurrency": 0}, "max_concurrency must be an integer >= 1"),
        ({"max_concurrency": True}, "max_concurrency must be an integer"),
        ({"disk_mb": 0}, "disk_mb must be an integer >= 1"),
        ({"mode": "hot"}, "mode must be 'cold'"),
        ({"isolation": "docker"}, "isolation must be 'auto' or one of 'bwrap', 'unshare', 'none'"),
        ({"warm_imports": "numpy"}, "warm_imports must be a sequence of module names"),
        ({"warm_imports": ("numpy-2",)}, "invalid module names"),
        ({"extra_hidden_paths": ("relative/path",)}, "extra_hidden_paths must be a sequence of absolute paths"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        PythonSandbox(**kwargs)


def test_explicit_isolation_that_does_not_work_is_an_error(monkeypatch):
    monkeypatch.setattr(probing, "probe", lambda iso, program=None: "bwrap not found on PATH (install bubblewrap: ...)")
    with pytest.raises(RuntimeError, match="isolation 'bwrap' does not work on this machine: bwrap not found"):
        PythonSandbox(isolation="bwrap")


@requires_namespaces
@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_interpreter_living_under_tmp_stays_visible(tmp_path_factory, mode):
    # A clone or virtualenv under /tmp (CI may clone there): the sandbox's private /tmp must not hide
    # the interpreter that runs the code. Regression: every call failed there before.
    import subprocess
    import sys

    venv = Path(tempfile.mkdtemp(prefix="sandbox-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        repo = Path(__file__).resolve().parents[1]
        script = (
            "from trl_plugins.tools.sandbox import PythonSandbox\n"
            f"with PythonSandbox(mode={mode!r}, warm_imports=('math',), max_concurrency=1) as s:\n"
            "    r = s.run('import sys, math; print(sys.prefix, math.factorial(5))')\n"
            "    print(r.isolation, r.ok, r.stdout.strip(), r.stderr.strip()[-300:])\n"
        )
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(repo)},
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        isolation, ok, prefix, result = out.stdout.split()[:4]
        assert (ok, prefix, result) == ("True", str(venv), "120"), out.stdout
        assert isolation == STRONGEST.value
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def _non_stdlib_imports(source: str) -> list[str]:
    """Modules ``source`` imports that are not in the standard library (a relative import shows as dots)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return [name for name in names if name.split(".")[0] not in sys.stdlib_module_names]


def test_the_runner_imports_only_the_standard_library():
    # The runner is shipped as text to a fresh interpreter inside the sandbox, where it is no
    # submodule of anything and our package may be hidden; a third-party import would slow (or
    # break) every call. So: the standard library only.
    source = Path(runner.__file__).read_text()
    assert launcher.runner_source() == source  # what is checked is what is shipped
    assert _non_stdlib_imports(source) == []
    # Negative control: the checker flags third-party, own-package, nested and relative imports.
    hostile = "import os, torch\nfrom trl_plugins import x\nimport numpy.linalg\nfrom . import y\ndef f():\n    import sympy\n"
    assert _non_stdlib_imports(hostile) == ["torch", "trl_plugins", "numpy.linalg", ".", "sympy"]


# ---------------------------------------------------------------------------------------------------
# Round two (issue 12): what an adversarial review found. Each runs in every namespaced isolation
# this machine offers (bwrap and, hidden bwrap or not, unshare), cold and warm.
# ---------------------------------------------------------------------------------------------------


def _pids_in_pid_ns(pid_ns: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == pid_ns:
                    found.append(int(entry))
            except OSError:
                pass
    return found


@requires_namespaces
def test_nothing_outlives_its_call(any_sandbox):
    # Hole 1: the code leaves the process group that is killed (setsid) and outlives the timeout;
    # under unshare the parent-death signal was lost with the uid switch, so it kept running.
    marker = f"{time.time() % 1000 + 3000:.6f}"
    result = any_sandbox.run(
        "import os, time\n"
        "print(os.readlink('/proc/self/ns/pid'), flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "try:\n"
        "    os.setsid()  # warm calls already lead a session of their own\n"
        "except OSError:\n"
        "    pass\n"
        "time.sleep(30)"
    )
    assert result.timed_out, result
    pid_ns = result.stdout.split()[0]
    assert pid_ns.startswith("pid:[") and pid_ns != os.readlink("/proc/self/ns/pid")
    assert _eventually_none(lambda: _pids_with_cmdline(marker), 3.0) == []
    assert _eventually_none(lambda: _pids_in_pid_ns(pid_ns), 3.0) == []


@requires_namespaces
def test_no_pty_is_shared_with_the_host_or_another_call(any_sandbox):
    # Hole 2: under unshare the host's /dev/pts was visible: a pty left by one call (or the host's)
    # could be opened by another call. Every sandbox (and every warm call) has a devpts of its own.
    host_master, host_slave = os.openpty()
    host_pts = os.ttyname(host_slave)
    assert os.path.exists(host_pts)  # control: the host's pty is in the host's /dev/pts
    list_pts = (
        "import os, time\n"
        "PRE"
        "seen = sorted(e for e in os.listdir('/dev/pts') if e.isdigit() and '/dev/pts/' + e not in mine)\n"
        "opened = []\n"
        f"for p in sorted({{{host_pts!r}}} - mine) + ['/dev/pts/' + e for e in seen]:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_RDWR | os.O_NOCTTY))\n"
        "        opened.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('seen', seen, 'opened', opened)\n"
        "POST"
    )
    holder = list_pts.replace("PRE", "m, s = os.openpty()\nmine = {os.ttyname(s)}\n").replace(
        "POST", "time.sleep(0.6)\n"
    )  # < TIMEOUT_S
    looker = list_pts.replace("PRE", "time.sleep(0.3)\nmine = set()\n").replace("POST", "")

    async def both():
        return await asyncio.gather(any_sandbox.arun(holder), any_sandbox.arun(looker))

    try:
        results = asyncio.run(both())
    finally:
        os.close(host_master)
        os.close(host_slave)
    for result in results:
        assert result.ok and result.stdout == "seen [] opened []\n", result


def _keyctl_code(action: str) -> str:
    nr = SYSCALL_NR
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "def call(*args):\n"
        "    r = libc.syscall(*args)\n"
        "    return r if r >= 0 else 'errno %d' % ctypes.get_errno()\n"
        "def read(serial):\n"
        "    buf = ctypes.create_string_buffer(256)\n"
        f"    n = call({nr.get('keyctl', 0)}, 11, ctypes.c_long(serial), buf, 256)  # KEYCTL_READ\n"
        "    return buf.raw[:n].decode(errors='replace') if isinstance(n, int) else n\n"
        "def add(desc, payload):\n"
        f"    serial = call({nr.get('add_key', 0)}, b'user', desc.encode(), payload.encode(), len(payload), ctypes.c_long(-3))\n"
        "    if isinstance(serial, int):\n"
        f"        call({nr.get('keyctl', 0)}, 5, ctypes.c_long(serial), ctypes.c_uint(0x3f3f3f3f))  # SETPERM: all for all\n"
        "    return serial\n" + action
    )


@requires_namespaces
@pytest.mark.skipif(not SYSCALL_NR, reason="no system call numbers for this machine")
@pytest.mark.parametrize("isolation_mode", MODES, ids=_mode_id)
def test_kernel_keyrings_are_closed(isolation_mode):
    # Hole 3: the session keyring is inherited: the code read the trainer's keys, and a key one call
    # added was read by the next call. The keyring system calls are denied.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    payload = SECRET.encode()
    host_key = libc.syscall(
        SYSCALL_NR["add_key"],
        b"user",
        f"trl-sandbox-{uuid.uuid4().hex}".encode(),
        payload,
        len(payload),
        ctypes.c_long(-3),
    )  # KEY_SPEC_SESSION_KEYRING
    if host_key < 0:
        pytest.skip(f"the kernel keyring is not usable here (errno {ctypes.get_errno()})")
    isolation, mode = isolation_mode
    try:
        buf = ctypes.create_string_buffer(256)
        assert libc.syscall(SYSCALL_NR["keyctl"], 11, ctypes.c_long(host_key), buf, 256) == len(payload)  # control
        with _sandbox(mode, isolation, warm_imports=(), max_concurrency=1) as sb:
            stolen = sb.run(_keyctl_code(f"print(read({host_key}))"))
            planted = sb.run(_keyctl_code(f"print(add('trl-sandbox-plant', 'planted-{SECRET}'))"))
            serial = planted.stdout.strip()
            found = sb.run(_keyctl_code(f"print(read({serial if serial.isdigit() else 0}))"))
    finally:
        libc.syscall(SYSCALL_NR["keyctl"], 3, ctypes.c_long(host_key))  # KEYCTL_REVOKE
    assert stolen.ok and SECRET not in stolen.stdout, stolen
    assert planted.ok and found.ok and SECRET not in found.stdout, (planted, found)
    assert stolen.stdout == planted.stdout == "errno 1\n", (stolen, planted)  # EPERM from the seccomp filter


_MEMFD_BOMB = (
    "import os\n"
    "chunk = b'x' * (8 << 20)\n"
    "fds = []\n"
    "for i in range(40):\n"
    "    try:\n"
    "        fd = os.memfd_create('hoard')\n"
    "        os.write(fd, chunk)\n"
    "    except OSError as e:\n"
    "        print('refused', type(e).__name__, flush=True)\n"
    "        break\n"
    "    fds.append(fd)\n"
    "    print('held', 8 * len(fds), flush=True)\n"
)


def _held_mb(stdout: str) -> int:
    held = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("held ")]
    return max(held, default=0)


@requires_namespaces
@pytest.mark.skipif(launcher.cgroup_roots() is None, reason="no per-call cgroup here (the fallback is tested below)")
@pytest.mark.parametrize("isolation_mode", MODES, ids=_mode_id)
def test_memory_is_bounded_per_call_shared_memory_and_processes_included(isolation_mode):
    # Hole 4: RLIMIT_AS is per process and misses memory that is not mapped: 40 memfd buffers of
    # 8 MB held 320 MB under memory_mb=64, and 63 children of 60 MB ran under memory_mb=256.
    isolation, mode = isolation_mode
    budget = launcher.CGROUP_HEADROOM_MB
    with _sandbox(mode, isolation, warm_imports=(), max_concurrency=1, memory_mb=64, timeout_s=10.0) as sb:
        hoard = sb.run(_MEMFD_BOMB)
        assert sb.run("print('still usable')").stdout == "still usable\n"
    assert 0 < _held_mb(hoard.stdout) <= 64 + budget, hoard  # 320 MB without a per-call limit
    # The kernel either OOM-kills the hoarder (reported as such) or fails its write.
    assert "memory limit of 64 MB" in hoard.stderr or "refused OSError" in hoard.stdout, hoard
    children = (
        "import os, select, time\n"
        "r, w = os.pipe()\n"
        "pids = []\n"
        "for i in range(20):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (60 << 20)  # touched: resident, not just mapped\n"
        "        os.write(w, os.getpid().to_bytes(4, 'little'))\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "got, wait = b'', 10.0\n"  # the first report may be slow on a loaded machine; then 2 s of silence ends it
        "while len(got) < 80 and select.select([r], [], [], wait)[0]:\n"
        "    got, wait = got + os.read(r, 80), 2.0\n"
        "holding = [int.from_bytes(got[i:i + 4], 'little') for i in range(0, len(got), 4)]\n"
        "alive = [p for p in holding if os.waitpid(p, os.WNOHANG) == (0, 0)]\n"
        "print('alive', len(alive), 'reported', len(holding), flush=True)\n"
    )
    with _sandbox(mode, isolation, warm_imports=(), max_concurrency=1, memory_mb=256, timeout_s=30.0) as sb:
        many = sb.run(children)
    assert many.stdout.startswith("alive "), many
    alive = int(many.stdout.split()[1])
    assert alive * 60 <= 256 + budget, (
        many.stdout
    )  # children that hold their 60 MB: 5 at most, 20 without a per-call limit
    assert int(many.stdout.split()[3]) >= 1, many.stdout  # control: some did allocate


@requires_namespaces
@pytest.mark.parametrize("isolation_mode", MODES, ids=_mode_id)
def test_without_cgroups_unmapped_shared_memory_is_refused(isolation_mode, monkeypatch):
    # Hole 4, the fallback where no cgroup can be made: memfd and System V segments, which RLIMIT_AS
    # does not see, are refused by the seccomp filter; /tmp and /dev/shm are size-limited tmpfs.
    monkeypatch.setattr(launcher, "cgroup_roots", lambda: None)
    isolation, mode = isolation_mode
    with _sandbox(mode, isolation, warm_imports=(), max_concurrency=1, memory_mb=64) as sb:
        hoard = sb.run(_MEMFD_BOMB)
        shm = sb.run(
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.shmget(0, 8 << 20, 0o1600), ctypes.get_errno())"
        )  # IPC_PRIVATE, IPC_CREAT
    assert hoard.ok and hoard.stdout == "refused PermissionError\n", hoard
    assert shm.ok and shm.stdout == "-1 1\n", shm
    assert sb._launcher.cgroups is None and "per process" in sb.describe()


@requires_namespaces
def test_only_the_interpreter_and_system_libraries_are_shown(any_sandbox, tmp_path):
    # Hole 5: world-writable host folders (a unix socket in /var/tmp reached a host process) and the
    # host's code trees were visible. Now: only the interpreter, its libraries and site-packages.
    sock_dir = Path(tempfile.mkdtemp(prefix="trl-sandbox-sock-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    sock_path = sock_dir / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(sock_path))
        os.chmod(sock_dir, 0o777)
        os.chmod(sock_path, 0o777)
        server.listen(1)
        server.setblocking(False)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(sock_path))  # control: a host process can reach it
        probe.close()
        server.accept()[0].close()
        this_file = Path(__file__).resolve()
        result = any_sandbox.run(
            "import os, socket\n"
            "print(sorted(os.listdir('/')))\n"
            f"print(os.path.exists({str(this_file)!r}), os.path.exists({str(sock_dir)!r}))\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"print(s.connect_ex({str(sock_path)!r}) != 0)"
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing from the sandbox arrived
    finally:
        server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert result.ok, result
    top, hidden, refused = result.stdout.splitlines()
    allowed = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp", "home"}
    allowed |= {Path(p).parts[1] for p in layout.interpreter_paths()}
    assert set(ast.literal_eval(top)) <= allowed, top
    assert (hidden, refused) == ("False False", "True")


@requires_namespaces
def test_file_locks_are_no_channel(any_sandbox):
    # Hole 5: flock on a file two parties can both read is a one-bit channel between concurrent calls.
    # The interpreter is such a file, and must stay readable: locks are denied instead.
    import fcntl

    target = os.path.realpath(sys.executable)
    with open(target, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with open(target, "rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # control: the lock is visible to others
        result = any_sandbox.run(
            "import fcntl\n"
            f"f = open({target!r}, 'rb')\n"
            "for name, lock in (('flock', fcntl.flock), ('lockf', fcntl.lockf)):\n"
            "    try:\n"
            "        lock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
            "        print(name, 'taken')\n"
            "    except OSError as e:\n"
            "        print(name, type(e).__name__)"
        )
    assert result.stdout == "flock PermissionError\nlockf PermissionError\n", result


@requires_bwrap
def test_bwrap_is_launched_from_where_it_was_found(tmp_path, monkeypatch):
    # Hole 6: bwrap was looked up on the host's PATH but launched through the sandbox's PATH, so a
    # bwrap outside the standard folders was probed and then not used. A wrapper that logs its use:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "used.log"
    real = shutil.which("bwrap")
    (bin_dir / "bwrap").write_text(f'#!/bin/sh\necho used >> {log}\nexec {real} "$@"\n')
    (bin_dir / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("TRL_SANDBOX_BWRAP", raising=False)
    with _sandbox("cold", "auto", warm_imports=()) as sb:
        assert sb.isolation == Isolation.BWRAP
        log.unlink(missing_ok=True)
        assert sb.run("print(6 * 7)").stdout == "42\n"
    assert log.read_text() == "used\n"


def _fallback_warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "falling back" in r.getMessage()]


def _check_fallback_warning(warnings: list[str], reason: str) -> None:
    # One record, naming the fallback, why, what differs and how to get bubblewrap.
    assert len(warnings) == 1, warnings
    for part in (
        "falling back to isolation=unshare",
        reason,
        "no cgroup namespace",
        "/proc/self/cgroup",
        "file tree is built by this project",
        "apt-get install -y bubblewrap",
    ):
        assert part in warnings[0], (part, warnings[0])


@requires_namespaces
def test_hiding_bwrap_falls_back_to_unshare(monkeypatch, caplog):
    # How CI runs the unshare fallback besides bwrap: TRL_SANDBOX_BWRAP="" hides bubblewrap. Round four: the
    # fallback was logged at INFO only; now one WARNING per process says why and what differs. (This test failed
    # where bwrap is not installed: the probe's cached "not found on PATH" answered for the variable.)
    if probing.probe(Isolation.UNSHARE, launcher.resolve_program(Isolation.UNSHARE)) is not None:
        pytest.skip("unshare does not work here")
    monkeypatch.setenv("TRL_SANDBOX_BWRAP", "")
    monkeypatch.setattr(probing, "_fallback_warned", False, raising=False)
    assert launcher.resolve_program(Isolation.BWRAP) is None
    with caplog.at_level(logging.INFO, logger=sandbox_module.__name__):
        assert detect_isolation() == Isolation.UNSHARE
        assert detect_isolation() == Isolation.UNSHARE  # once per process
    _check_fallback_warning(_fallback_warnings(caplog.records), "TRL_SANDBOX_BWRAP is set but names no executable")
    with pytest.raises(RuntimeError, match="TRL_SANDBOX_BWRAP is set but names no executable"):
        PythonSandbox(isolation="bwrap")
    with _sandbox("cold", "auto", warm_imports=()) as sb:
        assert sb.isolation == Isolation.UNSHARE and sb.run("print(1)").ok


@requires_namespaces
def test_without_bwrap_on_path_the_fallback_warns_once(monkeypatch, caplog, tmp_path):
    # Round four: a fresh machine without bubblewrap (here: a PATH holding only unshare) fell back silently.
    unshare = launcher.resolve_program(Isolation.UNSHARE)
    if unshare is None or probing.probe(Isolation.UNSHARE, unshare) is not None:
        pytest.skip("unshare does not work here")
    (tmp_path / "unshare").symlink_to(unshare)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TRL_SANDBOX_BWRAP", raising=False)
    monkeypatch.setattr(probing, "_fallback_warned", False, raising=False)
    with caplog.at_level(logging.INFO, logger=sandbox_module.__name__):
        assert detect_isolation() == Isolation.UNSHARE
        assert detect_isolation() == Isolation.UNSHARE
    _check_fallback_warning(_fallback_warnings(caplog.records), "bwrap not found on PATH")


@pytest.mark.parametrize(
    "sysctls,as_root,bwrap,expected",
    [
        # Ubuntu 23.10+ as a user: AppArmor's restriction; the sysctl and a profile for bwrap both apply.
        (
            {"kernel.apparmor_restrict_unprivileged_userns": "1"},
            False,
            "/usr/bin/bwrap",
            ["sysctl -w kernel.apparmor_restrict_unprivileged_userns=0", "AppArmor profile", "/usr/bin/bwrap"],
        ),
        # The same machine as root: AppArmor does not restrict root, so that fix does not apply.
        (
            {"kernel.apparmor_restrict_unprivileged_userns": "1", "user.max_user_namespaces": "0"},
            True,
            "/usr/bin/bwrap",
            ["sysctl -w user.max_user_namespaces="],
        ),
        (
            {"kernel.unprivileged_userns_clone": "0"},
            False,
            None,
            ["sysctl -w kernel.unprivileged_userns_clone=1", "apt-get install -y bubblewrap"],
        ),
    ],
    ids=["apparmor-user", "root-no-namespaces", "debian-userns-clone"],
)
def test_the_refusal_names_the_fix_that_applies(sysctls, as_root, bwrap, expected):
    fixes = probing.namespace_fixes(sysctls.get, as_root, bwrap)
    text = " ".join(fixes)
    for part in expected:
        assert part in text, (part, fixes)
    if as_root:
        assert "apparmor" not in text.lower(), fixes
    assert probing.namespace_fixes({}.get, True, "/usr/bin/bwrap") == []  # nothing known is in the way: no fix


def test_auto_refusal_says_which_known_fix_applies(monkeypatch):
    # Round four: with neither bwrap nor unshare working the refusal said only "make user namespaces available".
    monkeypatch.setattr(probing, "probe", lambda isolation, program=None: f"{isolation.value} is broken in this test")
    monkeypatch.setattr(probing, "read_sysctl", {"kernel.apparmor_restrict_unprivileged_userns": "1"}.get)
    monkeypatch.setattr(probing.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError) as refused:
        detect_isolation()
    assert "kernel.apparmor_restrict_unprivileged_userns=1" in str(refused.value)
    assert "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0" in str(refused.value)
    assert "pass isolation='none' explicitly" in str(refused.value)


def test_auto_refuses_to_run_without_isolation(monkeypatch, caplog):
    # Hole 7: with neither bwrap nor unshare usable, "auto" chose no isolation with only a warning.
    def fake_probe(isolation, program=None):
        return None if isolation == Isolation.NONE else f"{isolation.value} is broken in this test"

    monkeypatch.setattr(probing, "probe", fake_probe)
    with pytest.raises(RuntimeError, match="pass isolation='none' explicitly"):
        PythonSandbox(isolation="auto")
    monkeypatch.setattr(probing, "_logged_isolations", set())
    with caplog.at_level(logging.INFO, logger=sandbox_module.__name__):
        sb = PythonSandbox(isolation="none", mode="cold")  # asked for explicitly: allowed, with a warning
    sb.close()
    assert sb.isolation == Isolation.NONE
    assert any(r.levelno == logging.WARNING and "NO filesystem" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("isolation", [iso for iso, m in MODES if m == "warm"], ids=str)
def test_warm_calls_reseed_every_rng(isolation):
    # Hole 8: the RNGs a warm server's imports created (sympy's own, here) started every call in the
    # same state. The hash seed of a forked server cannot change (docs/sandbox.md); cold calls differ.
    code = "import random, sympy.core.random as sr, numpy as np\nprint(sr.rng.random(), sr._assumptions_rng.random(), random.random(), np.random.rand())"
    with _sandbox("warm", isolation, warm_imports=("numpy.random", "sympy"), max_concurrency=1, timeout_s=20.0) as sb:
        outputs = [sb.run(code).stdout.split() for _ in range(3)]
    assert all(len(o) == 4 for o in outputs), outputs
    for column in zip(*outputs):
        assert len(set(column)) == 3, outputs


@requires_namespaces
def test_unencodable_output_is_escaped_in_both_modes(any_sandbox):
    # Hole 8: a lone surrogate was an UnicodeEncodeError in cold mode and escaped in warm mode.
    result = any_sandbox.run("import sys\nprint('a\\ud800b')\nprint('c\\udcffd', file=sys.stderr)\nprint('end')")
    assert result.ok, result
    assert result.stdout == "a\\ud800b\nend\n" and result.stderr == "c\\udcffd\n"


@pytest.mark.parametrize("isolation,mode", MODES, ids=lambda p: str(p))
def test_an_interpreter_in_a_virtualenv_under_tmp_still_runs(tmp_path, isolation, mode):
    # CI makes its virtualenv inside a fresh clone, which may sit under /tmp: the sandbox's /tmp is a private
    # tmpfs, and the interpreter's folders are bound into it afterwards, with parents the sandbox user can
    # traverse (bwrap would create them 0700 and the runner could not start).
    # Round three: hidden paths inside such an interpreter prefix (reference answers next to the venv) were not
    # hidden under bwrap (covered before the private /tmp and the re-bind, so underneath them) and made every
    # call fail under unshare. A hidden folder and a hidden file, both.
    import subprocess
    import venv

    home = Path(tempfile.mkdtemp(prefix="trl-sandbox-venv-", dir="/tmp"))
    try:
        prefix = home / "deep" / "venv"
        venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(prefix)
        (prefix / "answers").mkdir()
        (prefix / "answers" / "ref.txt").write_text(SECRET)
        (prefix / "key.txt").write_text(SECRET)
        python = prefix / "bin" / "python"
        site = [p for p in sys.path if p.endswith("site-packages")]
        code = (
            "import sys, os\n"
            "def read(p):\n"
            "    try:\n"
            "        return open(p).read() or 'empty'\n"
            "    except OSError as e:\n"
            "        return type(e).__name__\n"
            "print(sys.prefix, 6 * 7, read(sys.prefix + '/answers/ref.txt'), read(sys.prefix + '/key.txt'))"
        )
        script = (
            "from trl_plugins.tools.sandbox import PythonSandbox\n"
            f"with PythonSandbox(mode={mode!r}, isolation={str(isolation)!r}, timeout_s=10.0, warm_imports=(),\n"
            f"                   extra_hidden_paths=({str(prefix / 'answers')!r}, {str(prefix / 'key.txt')!r})) as sb:\n"
            f"    r = sb.run({code!r})\n"
            "print('RESULT', r.ok, r.stdout.strip(), r.stderr[-500:])\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *site])}
        proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        # A hidden folder is an empty one; a hidden file is /dev/null bound nodev, so it cannot be opened, in every
        # mode (under unshare it read as an empty file, where bubblewrap's nodev root refused it).
        assert f"RESULT True {prefix} 42 FileNotFoundError PermissionError" in proc.stdout, (
            proc.stdout[-2000:] + proc.stderr[-2000:]
        )
        assert SECRET not in proc.stdout
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# Round three (issue 29): warm calls that share nothing, a narrower kernel surface, hidden paths
# wherever the interpreter lives, one exit-status convention. Every namespaced isolation, cold and warm.
# ---------------------------------------------------------------------------------------------------

_MEMORY_SCAN = (
    "def scan(pairs):\n"
    "    # Occurrences of a + b in this process's readable memory, for each (a, b): the two halves are\n"
    "    # never adjacent in this code, so a hit is memory this call did not write.\n"
    "    hits = dict.fromkeys(pairs, 0)\n"
    "    with open('/proc/self/maps') as f:\n"
    "        regions = [line.split() for line in f.read().splitlines()]\n"
    "    with open('/proc/self/mem', 'rb', 0) as mem:\n"
    "        for fields in regions:\n"
    "            if fields[1][0] != 'r' or fields[-1] in ('[vvar]', '[vsyscall]', '[vvar_vclock]'):\n"
    "                continue\n"
    "            lo, hi = (int(x, 16) for x in fields[0].split('-'))\n"
    "            for start in range(lo, hi, 1 << 22):\n"
    "                try:\n"
    "                    mem.seek(start)\n"
    "                    data = mem.read(min(hi, start + (1 << 22) + 64) - start)\n"
    "                except (OSError, ValueError, OverflowError):\n"
    "                    break\n"
    "                for key, (a, b) in pairs.items():\n"
    "                    i = data.find(a)\n"
    "                    while i >= 0:\n"
    "                        if i < (1 << 22) and data[i + len(a):i + len(a) + len(b)] == b:\n"
    "                            hits[key] += 1\n"
    "                        i = data.find(a, i + 1)\n"
    "    return hits\n"
)


@requires_namespaces
@pytest.mark.parametrize("isolation_mode", MODES, ids=_mode_id)
def test_no_call_finds_an_earlier_calls_code_or_output_in_its_memory(isolation_mode):
    # Round three: a warm server read each request (the code) and each result (the output) into its own heap
    # and forked the next call from it; the next call read both back from /proc/self/mem, two calls later.
    isolation, mode = isolation_mode
    code_a, code_b, out_a, out_b, ctl_a, ctl_b = (uuid.uuid4().hex[:12] for _ in range(6))
    padding = (
        "# " + "x" * 2000 + "\n"
    )  # model code and output of a few KB: freed to the C heap, not to pymalloc's pools
    first = (
        f"secret = '{code_a}{code_b}'  # the code itself\n{padding}"
        f"print('{out_a}' + '{out_b}' + '.' * 1500)  # only the output has both halves\n"
    )
    probe = _MEMORY_SCAN + (
        f"control = '{ctl_a}' + '{ctl_b}'  # made by this call: must be found\n"
        f"pairs = {{'code': (b'{code_a}', b'{code_b}'), 'output': (b'{out_a}', b'{out_b}'), 'control': (b'{ctl_a}', b'{ctl_b}')}}\n"
        "hits = scan(pairs)\n"
        "print(hits['code'], hits['output'], hits['control'] > 0)\n"
    )
    with _sandbox(mode, isolation, warm_imports=("math",), max_concurrency=1, timeout_s=30.0) as sb:
        assert sb.run(first).stdout == f"{out_a}{out_b}{'.' * 1500}\n"
        sb.run("print(sum(range(10)))")  # a call in between: the leak was found two calls back
        result = sb.run(probe)
    assert result.ok, result
    assert result.stdout == "0 0 True\n", result  # "3 2 True" (code, output) in warm mode before


_SYSCALL_CODE = (
    "import ctypes, errno, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def call(nr, *args):\n"
    "    ctypes.set_errno(0)\n"
    "    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])\n"
    "    if ret == 0 and nr == {clone}:\n"
    "        os._exit(0)  # a clone that worked: the child leaves at once\n"
    "    return 'ok' if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))\n"
)


@requires_namespaces
@pytest.mark.skipif(not SYSCALL_NR, reason="no system call numbers for this machine")
def test_file_change_notifications_are_no_channel(any_sandbox, tmp_path):
    # Round three: inotify, unprivileged fanotify and fcntl(F_NOTIFY) counted another call's (and the trainer's)
    # opens of a shared read-only file exactly. All three are refused.
    nr = runner.SYSCALLS[os.uname().machine]
    code = _SYSCALL_CODE.format(clone=nr["clone"]) + (
        "import fcntl\n"
        f"print('inotify_init1', call({nr['inotify_init1']}, 0))\n"
        f"print('inotify_add_watch', call({nr['inotify_add_watch']}, 3, b'/usr', 0xfff))\n"
        f"print('fanotify_init', call({nr['fanotify_init']}, 0x200, 0))  # FAN_CLASS_NOTIF | FAN_REPORT_FID\n"
        "fd = os.open('/usr', os.O_RDONLY)\n"
        "try:\n"
        "    fcntl.fcntl(fd, 1026, 0x1)  # F_NOTIFY, DN_ACCESS\n"
        "    print('F_NOTIFY ok')\n"
        "except OSError as e:\n"
        "    print('F_NOTIFY', errno.errorcode[e.errno])\n"
    )
    result = any_sandbox.run(code)
    assert result.ok, result
    assert result.stdout.split("\n")[:4] == [
        "inotify_init1 EPERM",
        "inotify_add_watch EPERM",
        "fanotify_init EPERM",
        "F_NOTIFY EPERM",
    ], result
    # Control: the same calls work for the test process (fanotify needs a recent kernel or privilege).
    import ctypes
    import fcntl

    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    assert fd >= 0
    os.close(fd)
    dir_fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.fcntl(dir_fd, 1026, 0x1)
    finally:
        os.close(dir_fd)


@requires_namespaces
@pytest.mark.skipif(not SYSCALL_NR, reason="no system call numbers for this machine")
def test_kernel_surface_and_nested_namespaces_are_refused(any_sandbox):
    # Round three: io_uring, user-mode userfaultfd, perf_event_open, bpf and nested user namespaces (with network,
    # mount and time namespaces inside) were reachable. Threads and processes must still work: clone3 is refused
    # with ENOSYS, so the C library falls back to clone, whose flags the filter reads.
    nr = runner.SYSCALLS[os.uname().machine]
    code = _SYSCALL_CODE.format(clone=nr["clone"]) + (
        "params = ctypes.create_string_buffer(120)\n"
        f"print('io_uring_setup', call({nr['io_uring_setup']}, 4, params))\n"
        f"print('userfaultfd', call({nr['userfaultfd']}, 1))  # UFFD_USER_MODE_ONLY\n"
        "attr = ctypes.create_string_buffer(128)\n"
        "attr[4] = 128  # size; type 1 (software), config 0 (cpu clock)\n"
        "attr[0] = 1\n"
        f"print('perf_event_open', call({nr['perf_event_open']}, attr, 0, -1, -1, 0))\n"
        f"print('bpf', call({nr['bpf']}, 0, ctypes.create_string_buffer(64), 64))\n"
        f"print('unshare user', call({nr['unshare']}, 0x10000000))\n"
        f"print('unshare user+net+mount', call({nr['unshare']}, 0x10000000 | 0x40000000 | 0x20000))\n"
        f"print('unshare time', call({nr['unshare']}, 0x80))\n"
        f"print('clone user', call({nr['clone']}, 0x10000000 | 17, 0, 0, 0, 0))\n"
        f"print('clone3', call({nr['clone3']}, 0, 0))\n"
        f"print('setns', call({nr['setns']}, 0, 0))\n"
        "import subprocess, threading\n"
        "box = []\n"
        "t = threading.Thread(target=box.append, args=('thread ok',))\n"
        "t.start(); t.join()\n"
        "print(box[0])\n"
        "print('subprocess', subprocess.run(['/bin/sh', '-c', 'echo $((6 * 7))'], capture_output=True, text=True).stdout.strip())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(7)\n"
        "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    result = any_sandbox.run(code)
    assert result.ok, result
    assert result.stdout.splitlines() == [
        "io_uring_setup EPERM",
        "userfaultfd EPERM",
        "perf_event_open EPERM",
        "bpf EPERM",
        "unshare user EPERM",
        "unshare user+net+mount EPERM",
        "unshare time EPERM",
        "clone user EPERM",
        "clone3 ENOSYS",
        "setns EPERM",
        "thread ok",
        "subprocess 42",
        "fork 7",
    ], result


@requires_namespaces
def test_a_denied_operation_says_so_after_the_traceback(any_sandbox):
    # Round three: what the filter refuses is a plain EPERM to the code; when it ends the cell, a line says why.
    result = any_sandbox.run("import fcntl, os\nfcntl.flock(os.open('/usr', os.O_RDONLY), fcntl.LOCK_SH)")
    assert result.exit_code == 1 and "PermissionError: [Errno 1] Operation not permitted" in result.stderr, result
    assert result.stderr.endswith(runner.DENIED_NOTE + "\n"), result
    other = any_sandbox.run("open('/nonexistent/x')")  # any other OSError: no such line
    assert "FileNotFoundError" in other.stderr and runner.DENIED_NOTE not in other.stderr, other


@requires_namespaces
def test_signal_deaths_read_the_same_in_every_mode(any_sandbox):
    # Round three: a signal death read as exit 128 + N with an empty stderr under bwrap cold, and as -N elsewhere;
    # and an exit status of 137 must not read as a signal.
    killed = any_sandbox.run(
        "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\nprint('after')"
    )
    segv = any_sandbox.run("import ctypes\nctypes.string_at(0)")
    exited = any_sandbox.run("import sys\nsys.exit(137)")
    assert (killed.exit_code, killed.stdout, killed.timed_out) == (-signal.SIGKILL, "before\n", False), killed
    assert "ProcessKilled: the process was terminated by SIGKILL" in killed.stderr, killed
    assert segv.exit_code == -signal.SIGSEGV and "terminated by SIGSEGV" in segv.stderr, segv
    assert exited.exit_code == 137 and "ProcessKilled" not in exited.stderr, exited


@requires_namespaces
def test_the_code_is_not_pid_1_so_signals_to_itself_work(any_sandbox):
    # Round three: the code ran as PID 1 of its namespace in some modes, where signals without a handler are
    # ignored: signal.alarm() never fired and kill(self) did nothing.
    alarm = any_sandbox.run(
        "import signal, time\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\ntime.sleep(0.6)\nprint('alarm ignored')"
    )
    term = any_sandbox.run(
        "import os, signal\nprint(os.getpid() != 1, flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\nprint('term ignored')"
    )
    assert alarm.exit_code == -signal.SIGALRM and alarm.stdout == "", alarm
    assert term.exit_code == -signal.SIGTERM and term.stdout == "True\n", term


@requires_namespaces
def test_many_threads_start_within_the_memory_limit(patient_sandbox):
    # Round three: glibc gives each new thread a malloc arena of its own, reserving 64 MB of address space that
    # RLIMIT_AS counts, until none is left for thread stacks: only ~15 threads started at 1 GB (16 of 4 MB at
    # this sandbox's 256 MB). One arena serves them all.
    code = (
        "import threading\n"
        "threading.stack_size(4 << 20)  # 48 stacks: 192 MB of the 256\n"
        "go, held, errors = threading.Event(), [], []\n"
        "def work():\n"
        "    held.append([bytearray(20000) for _ in range(8)])  # malloc'd in this thread\n"
        "    go.wait()\n"
        "threads = []\n"
        "for _ in range(48):\n"
        "    t = threading.Thread(target=work)\n"
        "    try:\n"
        "        t.start()\n"
        "    except Exception as e:\n"
        "        errors.append(type(e).__name__)\n"
        "        break\n"
        "    threads.append(t)\n"
        "go.set()\n"
        "for t in threads:\n"
        "    t.join()\n"
        "print(len(threads), len(held), errors)\n"
    )
    result = patient_sandbox.run(code)
    assert result.stdout == "48 48 []\n", result


@requires_namespaces
def test_the_runners_configuration_is_not_on_any_command_line(any_sandbox):
    # Round three: the runner's configuration (where hidden paths are, the layout, descriptors) was its
    # command line, readable in /proc/self/cmdline, and bwrap's arguments in the init's.
    code = (
        "import os\n"
        "lines = []\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
        "                lines.append(f.read())\n"
        "        except OSError:\n"
        "            pass\n"
        "print(len(lines) > 0, any(b'\"memory_bytes\":' in c or b'--setenv' in c for c in lines))\n"
    )
    result = any_sandbox.run(code)
    assert result.stdout == "True False\n", result


@pytest.mark.parametrize("isolation", [iso for iso, m in MODES if m == "warm"], ids=str)
def test_without_an_init_program_a_fork_of_the_server_is_the_init(isolation, monkeypatch):
    # A warm call's PID namespace gets `sleep` as its init (cheap: no copy of the server); where there is none the
    # init is a fork of the server, which reports the code's wait status itself. Same behaviour either way.
    monkeypatch.setattr(launcher, "init_program", lambda: None)
    with _sandbox("warm", isolation, warm_imports=(), max_concurrency=1) as sb:
        init = sb.run("print(open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0].decode())")
        alarm = sb.run(
            "import signal, time\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\ntime.sleep(0.6)\nprint('alarm ignored')"
        )
        segv = sb.run("import ctypes\nctypes.string_at(0)")
        exited = sb.run("import sys\nsys.exit(3)")
        reach = sb.run(_REACH_INIT)
    assert init.ok and "sleep" not in init.stdout and init.stdout.strip(), init  # the server's interpreter
    _check_init_unreachable(reach, None)  # non-dumpable, without capabilities: as unreachable as the exec-only sleep
    assert alarm.exit_code == -signal.SIGALRM and alarm.stdout == "", alarm
    assert segv.exit_code == -signal.SIGSEGV and exited.exit_code == 3, (segv, exited)
