"""Claude Code as a harness (``python -m trl_plugins.harness.claude_code``, a command of ``agent_endpoint``): the real
CLI (the one the Claude Agent SDK's wheel bundles) against the real endpoint with a scripted policy, in its sandbox: as
``nobody``, writing only in the trajectory's working directory, in a network namespace where only the endpoint is
bridged in (a host listener that is not bridged cannot be reached; no test addresses anything but loopback)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from support.endpoint import endpoint_chat
from trl_plugins.rollout import RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.types import StopReason

harness = pytest.importorskip("trl_plugins.harness.claude_code")

ROOT = Path(__file__).resolve().parents[1]


def _cli() -> str | None:
    try:
        return harness.find_claude()
    except harness.HarnessError:
        return None


REQUIRED = "claude_code" in os.environ.get("TRL_PLUGINS_TEST_REQUIRE", "").split(",")
"""Set by .ci/run, which installs both: there a missing one fails these tests (with the harness's own message) rather
than skipping them."""
needs_harness = pytest.mark.skipif(
    not REQUIRED and (shutil.which("bwrap") is None or _cli() is None),
    reason="the Claude Code harness needs bubblewrap and the CLI (pip install -e '.[dev]' brings the CLI; .ci/run "
    "installs bubblewrap)",
)


class _Listener:
    """A host-side TCP listener on 127.0.0.1 that answers ``hello`` to each connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(b"hello")
            conn.close()

    def close(self) -> None:
        self.sock.close()


PROBE = """
import json, os, socket, sys
out = {"uid": os.getuid(), "home": os.environ.get("HOME")}
for name, port in (("bridged", int(sys.argv[1])), ("other", int(sys.argv[2]))):
    try:
        out[name] = socket.create_connection(("127.0.0.1", port), timeout=3).recv(5).decode()
    except OSError as exc:
        out[name] = type(exc).__name__
for name, path in (("root", "/root"), ("repository", sys.argv[3])):  # the caller's home, this checkout
    try:
        os.listdir(path)
        out[name] = "read"
    except OSError as exc:
        out[name] = type(exc).__name__
open("/tmp/inside.txt", "w").write("x")  # the sandbox's own /tmp
open("written.txt", "w").write("x")  # the working directory
print(json.dumps(out))
"""


@pytest.fixture
def open_dir():
    """A folder the harness's unprivileged user may enter (pytest's own are closed to others), removed after."""
    path = tempfile.mkdtemp(prefix="trl-harness-test-")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@needs_harness
def test_the_harness_sandbox_reaches_the_endpoint_and_nothing_else(open_dir):
    bridged, other = _Listener(), _Listener()
    workdir = open_dir / "trajectory"
    workdir.mkdir()
    try:
        args, kwargs, path = harness.isolated(
            str(workdir),
            [sys.executable if harness._open_to_all(sys.executable) else "/usr/bin/python3", "-I", "-c", PROBE]
            + [str(bridged.port), str(other.port), str(ROOT)],
            endpoint=("127.0.0.1", bridged.port),
            env={"HOME": str(workdir)},
        )
        host = harness.UnixToTcp(path, "127.0.0.1", bridged.port)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=60, **kwargs)
        finally:
            host.close()
    finally:
        bridged.close()
        other.close()
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["uid"] == harness.NOBODY and seen["home"] == str(workdir)
    assert seen["bridged"] == "hello"  # the endpoint's port, through the bridge
    assert seen["other"] == "ConnectionRefusedError"  # a host listener on 127.0.0.1 that is not bridged: not there
    assert seen["root"] == seen["repository"] == "FileNotFoundError"  # not shown at all: only the system's folders
    assert (workdir / "written.txt").exists() and not Path("/tmp/inside.txt").exists()


def _script(chat):
    """Claude Code's turns, scripted: Bash runs Python and shows who and where it is, Write leaves a file, then the
    answer."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    shown = "env | grep -E '^(HOME|CLAUDE_CONFIG_DIR|ANTHROPIC_BASE_URL|CLAUDE_CODE_DISABLE|DISABLE_)' | sort"
    calls = [
        ("Bash", {"command": f"python3 -c 'print(6 + 1)'; id -u; {shown}", "description": "compute"}),
        ("Write", {"file_path": "notes/answer.txt", "content": "7\n"}),
    ]

    def script(prompt: list[int]) -> list[int]:
        done = tok.decode(prompt).count("<tool_response>")
        if done < len(calls):
            name, arguments = calls[done]
            body = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        else:
            body = "The answer is \\boxed{7}."
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


@needs_harness
def test_claude_code_runs_a_trajectory_in_its_sandbox_against_the_endpoint(open_dir, monkeypatch):
    chat = endpoint_chat()
    seen: list[tuple[str, dict]] = []
    serve = AgentEndpointRollout._serve

    async def spy(self, http, *args, **kwargs):
        seen.append((http.path.split("/v1/", 1)[-1], http.json() if http.method == "POST" else {}))
        return await serve(self, http, *args, **kwargs)

    monkeypatch.setattr(AgentEndpointRollout, "_serve", spy)
    kept = open_dir / "trajectories"
    question = RolloutQuestion(
        "q0",
        chat.initial_prompt_ids([{"role": "user", "content": "What is 6 + 1?"}]),
        0,
        row={"prompt": "What is 6 + 1?", "answer": "7"},
    )
    request = RolloutRequest([question], 1, _script(chat), chat, {}, policy_step=2, seed=5)
    rollout = AgentEndpointRollout(
        command=[sys.executable, "-m", "trl_plugins.harness.claude_code", "--keep", str(kept)]
        + ["--system-prompt", "You solve maths problems with the Bash tool."],
        max_trajectory_tokens=12_000,
        max_tool_response_tokens=400,
        agent_time_limit_s=120,
    )
    (traj,) = rollout(request).trajectories
    assert traj.error is None and traj.stop_reason == StopReason.FINAL_ANSWER
    assert {c.name: c.value for c in traj.reward_components}["agent_return"] == 1.0
    assert len(traj.turns) == 3 and traj.num_segments == 1  # each request continues the previous one's tokens
    assert [c.name for t in traj.turns for c in t.tool_calls] == ["Bash", "Write"]
    # Every request is the CLI's streamed Messages request; none for another model or purpose.
    assert [route for route, _ in seen] == ["messages?beta=true"] * 3 and all(body["stream"] for _, body in seen)
    assert [t["name"] for t in seen[0][1]["tools"]] == ["Bash", "Edit", "Read", "DeferredToolPlaceholder", "Write"]
    system = "".join(b["text"] for b in seen[0][1]["system"])
    assert system.endswith("You solve maths problems with the Bash tool.") and "WebFetch" not in system
    # What the Bash tool saw, as the model read it: Python ran, as nobody, with the harness's environment only.
    (workdir,) = kept.iterdir()
    output = chat.tokenizer.decode(traj.turns[1].prompt_ids).rsplit("<tool_response>", 1)[1]
    lines = set(output.split("</tool_response>")[0].split())
    assert {"7", str(harness.NOBODY), f"HOME={workdir}", f"CLAUDE_CONFIG_DIR={workdir}/.claude"} <= lines
    assert {f"{k}=1" for k in harness.QUIET} <= lines
    # Its files: the Write tool's and the CLI's own (its config, its session), all in the working directory.
    assert (workdir / "notes" / "answer.txt").read_text() == "7\n" and (workdir / ".claude").is_dir()
    assert all(p.stat().st_uid == harness.NOBODY for p in workdir.rglob("*") if os.geteuid() == 0)


def test_without_bubblewrap_or_a_cli_the_harness_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(harness.shutil, "which", lambda *a, **k: None)
    with pytest.raises(harness.HarnessError, match="apt-get install bubblewrap"):
        harness.isolated(str(tmp_path), ["true"], endpoint=("127.0.0.1", 1), env={})
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("TRL_PLUGINS_CLAUDE", raising=False)
    with pytest.raises(harness.HarnessError, match=r"no Claude Code CLI: pip install 'trl-plugins\[agents\]'"):
        harness.find_claude()
