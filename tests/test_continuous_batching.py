"""The continuous-batching backend (transformers' ``init_continuous_batching``): what the shared backend tests
in test_backends.py do not cover - it samples exactly what HF generate samples, it generates with the weights
of the current step even when its cache lives across rollouts, it leaves the trainer's RNG, mode and attention
alone, the TRL fields that select it are honoured or refused, and the one transformers internal it wraps is
pinned."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

from conftest import code_schema
from trl_plugins.replay.rollout_check import replay_logprobs
from trl_plugins.rollout import ChatFormat, HFGenerationBackend
from trl_plugins.rollout.continuous_batching import (
    CB_SAMPLE_SIGNATURE,
    ContinuousBatchingBackend,
    continuous_batching_config,
)
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.types import SamplingSettings, StopReason, Trajectory, Turn

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"page_size": 16, "num_blocks": 64, "max_batch_tokens": 256}


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [code_schema()])
    model = build_tiny_model(tok, hidden_size=64, num_layers=2)
    prompts = [
        chat.initial_prompt_ids([{"role": "user", "content": f"What is {a} * {b}? Use the tool, then answer."}])
        for a, b in [(2, 3), (17, 4), (123, 456), (9, 99), (5, 5), (31, 7)]
    ]
    return tok, chat, model, prompts


def cb(model, chat, sampling, **kwargs):
    return ContinuousBatchingBackend(
        model, stop_token_ids=chat.stop_token_ids, sampling=sampling, config=continuous_batching_config(SMALL), **kwargs
    )


@pytest.mark.parametrize(
    "sampling", [SamplingSettings(temperature=0.0), SamplingSettings(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01)]
)
def test_it_samples_exactly_what_hf_generate_samples(setup, sampling):
    # Same weights, same per-turn seeds: the same tokens (and log-probs to fp32 noise), whether a turn ends on
    # a stop token or at its budget. A token the long row samples is made a stop token, so both happen.
    tok, chat, model, prompts = setup
    budgets, seeds = [3, 8, 40, 13, 1, 25], [11, 12, 13, 14, 15, 16]
    probe = HFGenerationBackend(
        model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling
    ).generate(prompts, budgets, seeds=seeds)
    first_of_short = {s.token_ids[0] for s in probe[:2] + probe[4:5]}
    stop = next((t for t in probe[2].token_ids[3:] if t not in first_of_short), None)  # None: greedy repeats one token
    stops = sorted(set(chat.stop_token_ids) | ({stop} if stop is not None else set()))
    hf = HFGenerationBackend(model, pad_token_id=tok.pad_token_id, stop_token_ids=stops, sampling=sampling)
    cbb = ContinuousBatchingBackend(
        model, stop_token_ids=stops, sampling=sampling, config=continuous_batching_config(SMALL)
    )
    want = hf.generate(prompts, budgets, seeds=seeds)
    with cbb.session():
        got = cbb.generate(prompts, budgets, seeds=seeds)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finished for s in got] == [s.finished for s in want]
    if sampling.temperature > 0:
        assert {s.finished for s in got} == {True, False}  # both endings were exercised
    assert all(t in stops for s in got if s.finished for t in s.token_ids[-1:])
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5


def test_each_turn_is_its_own_request_and_many_run_at_once(setup):
    # The engine gives a per-request backend one turn per call from worker threads; the manager batches them.
    import concurrent.futures

    _, chat, model, prompts = setup
    be = cb(model, chat, SamplingSettings(temperature=1.0))
    assert be.max_concurrency > 1
    with be.session():
        alone = be.generate(prompts, [12] * 6, seeds=list(range(6)))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(be.generate, [p], [12], seeds=[k]) for k, p in enumerate(prompts)]
            threaded = [c.result()[0] for c in calls]
    assert [s.token_ids for s in threaded] == [s.token_ids for s in alone]


def _replay(model, tok, prompts, samples, temperature):
    trajs = [
        Trajectory(turns=[Turn(p, s.token_ids, s.logprobs)], stop_reason=StopReason.NO_TOOL_CALL)
        for p, s in zip(prompts, samples)
    ]
    return replay_logprobs(model, trajs, pad_token_id=tok.pad_token_id, temperature=temperature)


def test_a_kept_cache_never_serves_blocks_computed_with_old_weights(setup, monkeypatch):
    # keep_cache: the manager and its paged cache live across rollouts, and prefix sharing would hand the next
    # rollout key/value blocks of the previous weights. After an update, the log-probs must replay against the
    # new weights; the negative control keeps the cache's prefix ledger and is caught.
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    tok, chat, _, prompts = setup
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, seed=3)
    long_prompts = [p for p in prompts if len(p) > 2 * SMALL["page_size"]]
    assert long_prompts, "the prompts must span full cache pages for prefix sharing to apply"

    def run(keep_ledger: bool) -> float:
        be = cb(model, chat, SamplingSettings(temperature=1.0), keep_cache=True)
        with be.session():
            assert be._active.batch_processor.cache.use_prefix_sharing
            be.generate(long_prompts, [6] * len(long_prompts), seeds=[1] * len(long_prompts))
        with torch.no_grad():  # an "optimizer step"
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        if keep_ledger:
            monkeypatch.setattr(PagedAttentionCache, "reset", lambda self: self.free_all_requests(clear_ledgers=False))
        with be.session():
            after = be.generate(long_prompts, [6] * len(long_prompts), seeds=[2] * len(long_prompts))
        monkeypatch.undo()
        return _replay(model, tok, long_prompts, after, 1.0).max_abs_diff

    assert run(keep_ledger=False) < 1e-4
    assert run(keep_ledger=True) > 1e-3


def test_a_session_leaves_the_rng_the_mode_and_the_attention_as_they_were(setup):
    # Building the manager's batch processor calls torch.manual_seed; dropout and data order must not notice.
    tok, chat, _, prompts = setup
    model = build_tiny_model(tok, hidden_size=64, num_layers=2, attn_implementation="eager")
    model.train()
    be = cb(model, chat, SamplingSettings(temperature=1.0))
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    with be.session():
        assert not model.training and model.config._attn_implementation == "paged|eager"
        be.generate(prompts[:2], [5, 5], seeds=[0, 1])
    assert torch.equal(torch.rand(3), expected)
    assert model.training and model.config._attn_implementation == "eager"
    assert be._shared["manager"].batch_processor is None  # keep_cache=False: the cache was freed


def test_the_session_unwraps_a_prepared_model(setup):
    from accelerate import Accelerator

    tok, chat, _, prompts = setup
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(build_tiny_model(tok))
    be = ContinuousBatchingBackend(
        prepared,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=0.0),
        config=continuous_batching_config(SMALL),
        accelerator=accelerator,
    )
    with be.session():
        inside = be.generate([prompts[0]], [6], seeds=[0])[0]
    reference = HFGenerationBackend(
        build_tiny_model(tok),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=0.0),
    ).generate([prompts[0]], [6], seeds=[0])[0]
    assert inside.token_ids == reference.token_ids


def test_bad_settings_are_refused_with_what_to_do(setup):
    _, chat, model, _ = setup
    with pytest.raises(ValueError, match="repetition_penalty=1.2 is refused"):
        cb(model, chat, SamplingSettings(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="'seed' is refused"):
        continuous_batching_config({"seed": 3})
    with pytest.raises(ValueError, match="'return_logprobs' is refused"):
        continuous_batching_config({"return_logprobs": False})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_batch_tokenz'\]"):
        continuous_batching_config({"max_batch_tokenz": 64})
    with pytest.raises(ValueError, match="must be a JSON object"):
        continuous_batching_config("{max_batch_tokens: 64")
    config = continuous_batching_config('{"max_batch_tokens": 64}')
    assert config.max_batch_tokens == 64 and config.return_logprobs and config.max_memory_percent == 0.5
    assert continuous_batching_config({"max_memory_percent": 0.3}).max_memory_percent == 0.3


def _config(tmp_path, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        reward_components=["correct"],
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


def test_the_trl_fields_are_honoured_or_refused_at_start_up(tmp_path):
    on = _config(
        tmp_path,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"max_batch_tokens": 128},
        continuous_batching_keep_cache=True,
    )
    assert on.use_transformers_continuous_batching
    with pytest.warns(FutureWarning):
        assert _config(tmp_path, use_transformers_paged=True).use_transformers_continuous_batching  # TRL's alias
    refusals = [
        (
            dict(transformers_continuous_batching_config={"max_batch_tokens": 128}),
            "use_transformers_continuous_batching is off",
        ),
        (dict(continuous_batching_keep_cache=True), "use_transformers_continuous_batching is off"),
        (dict(use_transformers_continuous_batching=True, use_vllm=True), "pick one"),
        (dict(use_transformers_continuous_batching=True, repetition_penalty=1.1), "repetition_penalty=1.1 is refused"),
        (
            dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config={"seed": 1}),
            "'seed' is refused",
        ),
        (
            dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config={"nope": 1}),
            "unknown key",
        ),
    ]
    for overrides, message in refusals:
        with pytest.raises(ValueError, match=message):
            _config(tmp_path, **overrides)


def test_the_wrapped_transformers_internals_keep_their_shape():
    # The backend wraps ModelRunner._sample and reads a few attributes of the manager; a transformers upgrade
    # that changes them fails here, not in a silent mis-sampling.
    from transformers.generation.continuous_batching import continuous_api, model_runner, requests
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    assert str(inspect.signature(model_runner.ModelRunner._sample)) == CB_SAMPLE_SIGNATURE
    assert "output_ids[1, :tokens].copy_(logprobs.view(dtype=torch.int32))" in inspect.getsource(
        model_runner.ModelRunner._sample
    )
    assert {"fill_defaults", "prepare_tensor_args", "__call__"} <= set(
        ContinuousBatchingLogitsProcessor.__abstractmethods__
    )
    assert "tensors_required" in inspect.getsource(ContinuousBatchingLogitsProcessorList.__init__)
    assert "_retrieve_processors_kwargs" in vars(ContinuousBatchingLogitsProcessorList)
    assert "position_offset" in {f for f in requests.RequestState.__dataclass_fields__}
    manager = continuous_api.ContinuousBatchingManager
    for name in ("_create_batch_processor", "switch_to_cb_friendly_attn", "add_request", "get_result", "stop", "start"):
        assert callable(getattr(manager, name)), name
    assert "state.position_offset += query_length" in inspect.getsource(
        sys.modules[
            "transformers.generation.continuous_batching.input_outputs"
        ].ContinuousBatchingIOs.prepare_batch_tensors
    )


def _train(tmp_path, **overrides):
    import json

    from support.trainer import TokenReward, tiny_dataset
    from support.trainer import tiny_config as trainer_config
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    config = trainer_config(tmp_path, max_steps=3, learning_rate=2e-2, **overrides)
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        config,
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return trainer, [r for r in records if "reward/total" in r]


CB_RUN = dict(
    use_transformers_continuous_batching=True,
    continuous_batching_keep_cache=True,
    transformers_continuous_batching_config=SMALL,
)


def test_training_with_continuous_batching_is_training_with_hf_generate(tmp_path):
    # The same seeded sampler and the trainer's own log-probs: three steps (weights changing fast, the manager
    # and its cache kept between rollouts) give the same trajectories, rewards and weights as HF generate, and
    # every step's behaviour log-probs are the current weights' (the PPO ratio of the first update is 1).
    hf, hf_steps = _train(tmp_path / "hf")
    cbt, cb_steps = _train(tmp_path / "cb", **CB_RUN)
    assert len(cb_steps) == 3
    assert [r["reward/total"] for r in cb_steps] == pytest.approx([r["reward/total"] for r in hf_steps], abs=1e-6)
    assert [r["rollout/action_tokens_mean"] for r in cb_steps] == [r["rollout/action_tokens_mean"] for r in hf_steps]
    assert all(r["train/behaviour_logprob_gap"] < 1e-5 and r["train/ratio_max"] < 1.0001 for r in cb_steps), cb_steps
    diff = max((a - b).abs().max().item() for a, b in zip(hf.model.parameters(), cbt.model.parameters()))
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(build_tiny_model(build_tokenizer("qwen2_5")).parameters(), cbt.model.parameters())
    )
    assert moved > 1e-2  # it did train
    # The two samplers' log-probs differ by float rounding only (< 1e-5 above), which Adam's per-weight normalisation
    # can turn into ~1e-4 on a weight over three steps at lr 2e-2 (measured 1.2e-4 with two torch threads, less with
    # one): the weights agree to 1% of how far training moved them; a sampler that trained on other tokens or
    # log-probs would differ by the update itself.
    assert diff < 1e-2 * moved, (diff, moved)
    # The version fields, filled for both samplers: the kind, and the digest of the weights that sampled each batch.
    for trainer, kind in ((hf, "hf_generate"), (cbt, "continuous_batching")):
        v = trainer.last_batch.trajectories[0].policy_version
        assert trainer.run.version.sampler == kind and v.run_digest == trainer.run.version.digest
        assert v.weights_digest is not None and len(v.weights_digest) == 16


def test_training_negative_control_stale_prefix_blocks_are_caught(tmp_path, monkeypatch):
    # Keep the cache's prefix ledger across rollouts: from the second step on, turns reuse key/value blocks of
    # the previous weights, and the first update's ratio is no longer 1.
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    monkeypatch.setattr(PagedAttentionCache, "reset", lambda self: self.free_all_requests(clear_ledgers=False))
    _, steps = _train(tmp_path, **CB_RUN)
    assert steps[0]["train/behaviour_logprob_gap"] < 1e-5
    assert max(r["train/behaviour_logprob_gap"] for r in steps[1:]) > 1e-3


def test_a_lora_adapter_is_part_of_what_it_samples_from(setup):
    # A PEFT-wrapped policy: the manager runs the base model with the adapter's layers in it.
    from peft import LoraConfig, get_peft_model

    tok, chat, _, prompts = setup
    policy = get_peft_model(
        build_tiny_model(tok),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    sampling = SamplingSettings(temperature=1.0)
    hf = HFGenerationBackend(
        policy, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling
    )
    want = hf.generate(prompts, [12] * len(prompts), seeds=list(range(len(prompts))))
    with cb(policy, chat, sampling).session() as _:
        pass  # a session with no request starts and stops cleanly
    be = cb(policy, chat, sampling)
    with be.session():
        got = be.generate(prompts, [12] * len(prompts), seeds=list(range(len(prompts))))
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    with policy.disable_adapter():
        base = hf.generate(prompts, [12] * len(prompts), seeds=list(range(len(prompts))))
    assert [s.token_ids for s in base] != [s.token_ids for s in want]  # the adapter changes what is sampled


# -- the paged cache's size (issue 30.12) ---------------------------------------------------------------------------


def test_the_cache_is_sized_from_the_workload():
    from trl_plugins.rollout.continuous_batching import workload_cache_size

    # The embedded default: 64 trajectories (per_device_train_batch_size) of up to 1,024 tokens, pages of 256:
    # 64 * ceil(1024 / 256) = 256 blocks; a forward holds max(64, 1024) = 1024 tokens.
    assert workload_cache_size(64, 1024) == {"num_blocks": 256, "max_batch_tokens": 1024}
    # 3 trajectories of 100 tokens in pages of 16: 3 * ceil(100 / 16) = 3 * 7 = 21; max(3, 100) = 100 -> 128.
    assert workload_cache_size(3, 100, page_size=16) == {"num_blocks": 21, "max_batch_tokens": 128}
    # 512 trajectories of 20,000 tokens: 512 * ceil(20000 / 256) = 512 * 79 = 40,448; 20,000 -> at most 8,192.
    assert workload_cache_size(512, 20000) == {"num_blocks": 40448, "max_batch_tokens": 8192}
    # More trajectories than tokens: one decode token each, 300 -> 320.
    assert workload_cache_size(300, 10, page_size=16)["max_batch_tokens"] == 320
    with pytest.raises(ValueError, match="trajectories, tokens_per_trajectory and page_size >= 1"):
        workload_cache_size(0, 1024)


def test_what_the_user_sets_wins_over_the_workload_sizing():
    sized = continuous_batching_config(None, trajectories=64, tokens_per_trajectory=1024)
    assert (sized.num_blocks, sized.max_batch_tokens, sized.page_size) == (256, 1024, 256)
    mixed = continuous_batching_config({"max_batch_tokens": 512}, trajectories=64, tokens_per_trajectory=1024)
    assert (mixed.num_blocks, mixed.max_batch_tokens) == (256, 512)
    paged = continuous_batching_config({"page_size": 32}, trajectories=64, tokens_per_trajectory=1024)
    assert paged.num_blocks == 64 * 32  # 1024 / 32 pages each
    assert continuous_batching_config(SMALL, trajectories=64, tokens_per_trajectory=1024).num_blocks == 64
    # Without a workload, transformers' own (memory-sized) defaults stay: what the config check validates.
    bare = continuous_batching_config(None)
    assert bare.num_blocks is None and bare.max_batch_tokens is None


def _embedded_shape():
    # The embedded default's shape (~/.cache/trl-plugins/embedded/*/model/config.json), on the meta device.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=718,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=48,
        max_window_layers=0,
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def _memory(monkeypatch, total: int) -> None:
    # What transformers sees: `total` bytes on the CPU, none of it in use.
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import utils as cb_utils

    def breakdown():
        return torch.device("cpu"), total, 0, 0

    monkeypatch.setattr(cb_utils, "get_device_and_memory_breakdown", breakdown)
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown", breakdown)


def test_the_default_sizing_that_died_on_a_fresh_machine_is_caught_with_its_figures(monkeypatch):
    # Issue 30.12, by transformers' own accounting on the embedded default's shape: left to size itself, the first
    # rollout's cache fills max_memory_percent (0.5) of what transformers sees (here 10.16 GB -> 5.08 GB: 265 blocks,
    # 8,192 batch tokens); a later rollout rebuilds it from those memoized figures once training holds more memory
    # (3.70 GB allowed), and transformers raised the bare "Memory footprint 5076953088 is more than available memory
    # 3700285440" the issue quotes. 4.98 GB of it are attention masks: 2 masks x 4 bytes x 8192 x (265 * 256 + 8192).
    from trl_plugins.rollout.continuous_batching import cache_footprint, check_cache_fits

    model = _embedded_shape()
    _memory(monkeypatch, 10_160_000_000)
    first = cache_footprint(model, continuous_batching_config(None))
    assert (first.max_batch_tokens, first.num_blocks) == (8192, 265) and first.fits
    _memory(monkeypatch, 2 * 3_700_285_440)
    memoized = continuous_batching_config({"max_batch_tokens": 8192, "num_blocks": 265})
    again = cache_footprint(model, memoized)
    assert again.total == 5_076_953_088 and again.available == 3_700_285_440 and not again.fits
    assert again.masks == 2 * 4 * 8192 * (265 * 256 + 8192)
    with pytest.raises(
        MemoryError,
        match=r"5\.08 GB \(4\.98 GB attention masks.*allows 3\.70 GB on cpu.*"
        r"Set transformers_continuous_batching_config '\{\"max_batch_tokens\": 4096",
    ):
        check_cache_fits(model, memoized)
    # Sized from the workload (64 trajectories x 1,024 tokens): 0.63 GB, the same whatever the memory.
    sized = check_cache_fits(model, continuous_batching_config(None, trajectories=64, tokens_per_trajectory=1024))
    assert (sized.max_batch_tokens, sized.num_blocks) == (1024, 256)
    assert sized.masks == 2 * 4 * 1024 * (256 * 256 + 1024) and 0.6e9 < sized.total < 0.65e9


@pytest.mark.parametrize("options", [SMALL, {"max_batch_tokens": 512, "num_blocks": 40}, {}])
def test_the_footprint_is_the_one_transformers_checks(setup, monkeypatch, options):
    # Equivalence with transformers' own check at the threshold: with exactly the footprint allowed the cache is
    # built (and has the size reported); one byte less and transformers refuses it, and so do we.
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

    from trl_plugins.rollout.continuous_batching import cache_footprint

    _, _, model, _ = setup
    config = continuous_batching_config(options)
    _memory(monkeypatch, 600_000_000)
    footprint = cache_footprint(model, config)
    resolved = resolve_continuous_batching_config(model.config, config, None, True, model.device)

    def build():
        return cb_cache.PagedAttentionCache(
            model.config,
            resolved,
            model.device,
            DistributedHelper(None, 300.0),
            dtype=model.dtype,
            model_supports_logits_to_keep=model._supports_logits_to_keep(),
        )

    if not options:  # sized by transformers from the memory: fills it
        assert footprint.fits and footprint.total > 0.9 * footprint.available
        return
    _memory(monkeypatch, 2 * footprint.total)  # max_memory_percent 0.5: exactly the footprint allowed
    cache = build()
    assert (cache.max_batch_tokens, cache.num_blocks) == (footprint.max_batch_tokens, footprint.num_blocks)
    assert cache_footprint(model, config).fits
    _memory(monkeypatch, 2 * footprint.total - 2)
    with pytest.raises(MemoryError, match=f"Memory footprint {footprint.total} is more than available"):
        build()
    assert not cache_footprint(model, config).fits


def test_a_cache_that_cannot_fit_is_refused_before_transformers_builds_it(setup, monkeypatch):
    # At a rollout's start, with the figures and what to set, instead of transformers' bare MemoryError.
    _, chat, model, prompts = setup
    backend = cb(model, chat, SamplingSettings(temperature=0.0))
    _memory(monkeypatch, 1_000_000)
    with pytest.raises(
        MemoryError,
        match=r"the paged KV cache does not fit: max_batch_tokens=256, num_blocks=64.*"
        r"transformers allows 0\.00 GB.*generate with HF generate",
    ):
        backend.generate(prompts[:1], [4], seeds=[0])
    monkeypatch.undo()
    assert len(backend.generate(prompts[:1], [4], seeds=[0])[0].token_ids) == 4  # the same backend, memory back


def test_the_run_sizes_the_cache_of_training_and_of_evaluation_from_their_workloads(setup, tmp_path):
    from trl_plugins.run import SamplerKind, resolve_run
    from trl_plugins.run.sampler import make_backend

    _, chat, model, _ = setup
    run = resolve_run(
        _config(tmp_path, use_transformers_continuous_batching=True, rollout_kwargs={"max_trajectory_tokens": 300})
    )
    train = make_backend(
        SamplerKind.CONTINUOUS_BATCHING, run.config, chat, model=model, token_budget=run.rollout.token_budget
    )
    # per_device_train_batch_size 4 trajectories x ceil(300 / 256) = 2 blocks; max(4, 300) -> 320 batch tokens.
    assert (train.config.num_blocks, train.config.max_batch_tokens) == (8, 320)
    evaluation = make_backend(
        SamplerKind.CONTINUOUS_BATCHING,
        run.config,
        chat,
        model=model,
        token_budget=run.rollout.token_budget,
        trajectories=12 * 4,
    )
    assert (evaluation.config.num_blocks, evaluation.config.max_batch_tokens) == (96, 320)
    run.close()


def test_the_start_up_check_refuses_a_cache_that_will_not_fit_before_the_weights_load(setup, tmp_path, monkeypatch):
    from trl_plugins.run import resolve_run
    from trl_plugins.run.sampler import check_continuous_batching_memory

    tok, _, model, _ = setup
    model.save_pretrained(tmp_path / "model")
    run = resolve_run(
        _config(tmp_path, use_transformers_continuous_batching=True, rollout_kwargs={"max_trajectory_tokens": 300})
    )
    _memory(monkeypatch, 8_000_000_000)
    line = check_continuous_batching_memory(run, str(tmp_path / "model"))
    assert (
        line.startswith("continuous-batching cache 0.01 GB of the 4.00 GB")
        and "max_batch_tokens=320, num_blocks=8" in line
    )
    # 4 trajectories x 300 tokens fit anywhere; a user's 8,192-token batch over 4,096 blocks does not fit in 1 GB.
    big = resolve_run(
        _config(
            tmp_path,
            use_transformers_continuous_batching=True,
            transformers_continuous_batching_config={"max_batch_tokens": 8192, "num_blocks": 4096},
        )
    )
    _memory(monkeypatch, 1_000_000_000)
    with pytest.raises(
        ValueError,
        match=r"does not fit: max_batch_tokens=8192, num_blocks=4096.*with the model and its "
        r"training state \(~0\.00 GB, estimated\) loaded\. Set ",
    ):
        check_continuous_batching_memory(big, str(tmp_path / "model"))
    run.close()
    big.close()
