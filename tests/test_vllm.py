"""vLLM generation through the fake vLLM of tests/fake_vllm.py: the backend (colocate and server),
TRL's own VLLMGeneration wiring in the trainer, weight pushes after each update, and sleep mode.

vLLM cannot be installed here; the fake replaces only the engine and the transport, so TRL's argument
mapping, ``sync_weights`` and parameter gathering run for real. ``scripts/gpu_check.sh`` runs real vLLM
where it is importable.
"""

from __future__ import annotations

import pytest
import torch

import fake_vllm as fake
from support.vllm import install_fake_vllm, same_weights, save_tiny_model, train_with_vllm
from trl_plugins.rollout import HFGenerationBackend, VLLMBackend
from trl_plugins.types import LogprobSource, SamplingSettings


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_model(tmp_path_factory)


@pytest.fixture()
def patched(monkeypatch):
    return install_fake_vllm(monkeypatch)


def _hf_reference(path, tok, chat, prompts, budgets, seeds, sampling):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return HFGenerationBackend(
        model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling
    ).generate(prompts, budgets, seeds=seeds)


def test_colocate_backend_is_token_in_token_out_with_processed_logprobs(saved, patched):
    path, tok, chat, prompts = saved
    sampling = SamplingSettings(temperature=0.9, top_k=50)
    llm = fake.FakeLLM(path, logprob_shift=-0.25)
    gen = type("Gen", (), {"mode": "colocate", "llm": llm, "enable_sleep_mode": False})()
    be = VLLMBackend(gen, stop_token_ids=chat.stop_token_ids, sampling=sampling)
    assert be.max_concurrency == 1 and be.logprob_source == LogprobSource.PROCESSED
    out = be.generate(prompts, [5, 30], seeds=[1, 2])
    ref = _hf_reference(path, tok, chat, prompts, [5, 30], [1, 2], sampling)
    for got, want, budget in zip(out, ref, [5, 30]):
        assert got.token_ids == want.token_ids and len(got.token_ids) <= budget  # budget and stop tokens as HF's
        assert got.finished == want.finished
        assert got.logprobs == pytest.approx([lp - 0.25 for lp in want.logprobs], abs=1e-5)  # vLLM's own log-probs
    assert llm.log == ["generate:2"]


def test_server_backend_sends_each_turn_as_its_own_request(saved):
    path, tok, chat, prompts = saved
    sampling = SamplingSettings(temperature=1.0)
    with fake.FakeVLLMServer(path) as server:
        client = fake.FakeVLLMClient(base_url=server.base_url)
        gen = type("Gen", (), {"mode": "server", "vllm_client": None})()
        with pytest.raises(ValueError, match="needs a VLLMClient on every rank"):
            VLLMBackend(gen, stop_token_ids=chat.stop_token_ids, sampling=sampling)
        be = VLLMBackend(gen, stop_token_ids=chat.stop_token_ids, sampling=sampling, client=client, max_concurrency=8)
        assert be.max_concurrency == 8
        out = be.generate([prompts[0]], [20], seeds=[7])
        ref = _hf_reference(path, tok, chat, [prompts[0]], [20], [7], sampling)
        assert out[0].token_ids == ref[0].token_ids
        assert out[0].logprobs == pytest.approx(ref[0].logprobs, abs=1e-5)
        assert client.stats()["requests"] == 1


def test_colocate_sleep_mode_wakes_for_the_rollout_and_needs_the_weights_pushed_again(saved, patched):
    path, tok, chat, prompts = saved
    llm = fake.FakeLLM(path)
    pushes = []

    class Gen:
        mode, enable_sleep_mode = "colocate", True
        _llm_weights_sleeping = False

        def __init__(self):
            self.llm = llm
            self.weights = {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}

        def sync_weights(self):  # what TRL's does in colocate mode: wake the weights, load them
            llm.wake_up(tags=["weights"])
            llm.engine.load_weights(self.weights.items())
            pushes.append(1)

    gen = Gen()
    be = VLLMBackend(gen, stop_token_ids=chat.stop_token_ids, sampling=SamplingSettings(temperature=0.0))
    be.sync_weights(0)
    with be.session():
        first = be.generate([prompts[0]], [8], seeds=[0])[0]
    assert llm.log[-2:] == ["generate:1", "sleep:2"] and gen._llm_weights_sleeping
    with pytest.raises(RuntimeError, match="call sync_weights"):  # level-2 sleep discarded the weights
        with be.session():
            pass
    be.sync_weights(0)  # same step, but the weights are asleep: pushed again
    with be.session():
        again = be.generate([prompts[0]], [8], seeds=[0])[0]
    assert len(pushes) == 2 and again.token_ids == first.token_ids
    assert all(torch.isfinite(torch.tensor(again.logprobs)))


@pytest.mark.parametrize("sleep", [False, True])
def test_trainer_colocate_generates_with_vllm_and_pushes_the_updated_weights(tmp_path, saved, patched, sleep):
    path = saved[0]
    trainer, seen = train_with_vllm(tmp_path, path, vllm_mode="colocate", vllm_enable_sleep_mode=sleep)
    llm = trainer.vllm_generation.llm
    assert all(t.policy_version.logprob_source == LogprobSource.PROCESSED for trajs in seen for t in trajs)
    assert [trajs[0].policy_version.step for trajs in seen] == [0, 1]
    gens = [e for e in llm.log if e.startswith("generate")]
    assert gens and all(int(e.split(":")[1]) >= 1 for e in gens)
    if sleep:
        # Each rollout: wake the KV cache, generate, sleep (level 2); the weights are pushed before each.
        assert llm.log[0] == "sleep:2" and llm.log.count("wake:kv_cache") == 2 and llm.log.count("sleep:2") == 3
    else:
        # After the last update no rollout ran, so vLLM holds step 1's weights: push them and compare.
        trainer.generation_backend().sync_weights(trainer.state.global_step)
        assert same_weights(llm.engine.model, trainer)
        from transformers import AutoModelForCausalLM

        initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert not same_weights(initial, trainer)  # negative control: training moved the weights


def test_trainer_colocate_with_lora_pushes_the_merged_weights(tmp_path, saved, patched):
    # TRL's sync_weights merges the adapter into the base weights it pushes (and unmerges after).
    from peft import LoraConfig

    path = saved[0]
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, seen = train_with_vllm(tmp_path, path, peft_config=lora, vllm_mode="colocate")
    # The version records the adapter set and the sampler, and every trajectory refers to it; vLLM's weights are
    # in the engine, so no weights digest is claimed (docs/replay.md).
    version = trainer.run.version
    assert version.sampler == "vllm_colocate" and [(a.kind, a.rank, a.targets) for a in version.adapters] == [
        ("LORA", 4, ("q_proj", "v_proj"))
    ]
    assert all(
        t.policy_version.run_digest == version.digest and t.policy_version.weights_digest is None
        for trajs in seen
        for t in trajs
    )
    engine = trainer.vllm_generation.llm.engine.model
    trainer.generation_backend().sync_weights(trainer.state.global_step)
    with torch.no_grad():
        trainer.model.merge_adapter()
        merged = {
            n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
            for n, p in trainer.model.named_parameters()
            if ".lora_" not in n
        }
        trainer.model.unmerge_adapter()
    theirs = dict(engine.named_parameters())
    assert merged.keys() >= theirs.keys()
    assert all(torch.allclose(theirs[n], merged[n], atol=1e-6) for n in theirs)
    base = dict(trainer.model.named_parameters())["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.allclose(theirs["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter's update is in


def test_trainer_server_mode_sends_turns_from_the_rank_and_pushes_weights(tmp_path, saved, patched):
    path = saved[0]
    with fake.FakeVLLMServer(path) as server:
        trainer, seen = train_with_vllm(
            tmp_path, path, vllm_mode="server", vllm_server_base_url=server.base_url, vllm_max_concurrent_requests=3
        )
        turns = sum(len(t.turns) for trajs in seen for t in trajs)
        assert server.engine.requests == turns  # one request per turn
        version = trainer.run.version  # the version fields, filled for a server sampler
        assert (
            version.sampler == "vllm_server"
            and version.packages["trl"]
            and all(
                t.policy_version.run_digest == version.digest
                and t.policy_version.weights_digest is None
                and t.turns[0].seed is not None
                for trajs in seen
                for t in trajs
            )
        )
        assert trainer.generation_backend().max_concurrency == 3
        trainer.generation_backend().sync_weights(trainer.state.global_step)
        assert same_weights(server.engine.model, trainer)


def test_vllm_settings_that_cannot_work_are_refused_before_any_model_loads(tmp_path):
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], reward_components=["correct"], use_vllm=True)
    for bad, match in [
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size"),
        ({"vllm_structured_outputs_regex": "a+"}, "vllm_structured_outputs_regex"),
        ({"vllm_mode": "remote"}, "vllm_mode"),
        ({"vllm_max_concurrent_requests": 0}, "vllm_max_concurrent_requests"),
    ]:
        with pytest.raises(ValueError, match=match):
            MultiTurnGRPOConfig(**base, **bad)
    # vLLM is not installed here: refused before the model loads ("no-such-model" is never looked up)...
    with pytest.raises(ValueError, match="vLLM is not installed here"):
        MultiTurnGRPOTrainer("no-such-model", MultiTurnGRPOConfig(**base))


def test_a_vllm_context_shorter_than_a_trajectory_is_refused_before_any_model_loads(tmp_path, patched):
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], reward_components=["correct"], use_vllm=True)
    from trl_plugins.run import resolve_run

    # The engine's context must hold a whole trajectory: the rollout's budget is known once its plugin is built,
    # when the run is resolved, before any model loads ...
    config = MultiTurnGRPOConfig(**base, vllm_max_model_length=512, rollout_kwargs={"max_trajectory_tokens": 600})
    with pytest.raises(ValueError, match="vllm_max_model_length=512 is shorter than the rollout's token budget of 600"):
        resolve_run(config)
    # ... which the trainer does from a config it is given ("no-such-model" is never looked up).
    with pytest.raises(ValueError, match="vllm_max_model_length=512 is shorter than the rollout's token budget of 600"):
        MultiTurnGRPOTrainer("no-such-model", config)
    resolve_run(MultiTurnGRPOConfig(**base, vllm_max_model_length=600, rollout_kwargs={"max_trajectory_tokens": 600}))


def test_vllm_logprobs_that_differ_from_the_trainers_are_corrected(tmp_path, saved, patched):
    # The fake engine reports every log-prob 0.4 nats low (a known sampler/trainer mismatch): the update takes
    # pi_old from the trainer's forward, and TRL's default sequence_mask (C = 3) masks every trajectory whose
    # sequence weight exp(0.4 x 12 tokens) is far above 3.
    import json

    patched(logprob_shift=-0.4)
    trainer, seen = train_with_vllm(tmp_path, saved[0], vllm_mode="colocate", max_steps=1)
    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][0]
    assert record["train/is_logprob_gap"] == pytest.approx(0.4, abs=1e-3)
    assert record["train/is_masked_frac"] == 1.0
    assert all(t.policy_version.logprob_source == LogprobSource.PROCESSED for t in seen[0])
