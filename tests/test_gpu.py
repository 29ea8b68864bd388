"""Checks that need a CUDA device (skipped without one; ``scripts/gpu_check.sh`` runs them): the HF backend's
per-row seeded sampling and behaviour log-probs on the GPU (and the continuous-batching backend's), a trainer step with the
model on the GPU, the padding-free and shared-prefix layouts, and the chunked output head against the full logits."""

from __future__ import annotations

import pytest
import torch

from conftest import code_schema
from trl_plugins.replay.rollout_check import replay_logprobs
from trl_plugins.rollout import ChatFormat, HFGenerationBackend
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.types import SamplingSettings, StopReason, Trajectory, Turn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [code_schema()])
    model = build_tiny_model(tok, hidden_size=64, num_layers=2).to("cuda")
    prompts = [
        chat.initial_prompt_ids([{"role": "user", "content": q}])
        for q in ("What is 2 + 2?", "Compute 17 * 3, then answer.")
    ]
    return tok, chat, model, prompts


def test_cuda_rows_sample_independently_of_their_batch_and_replay(setup):
    tok, chat, model, prompts = setup
    be = HFGenerationBackend(
        model,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=0.8, top_p=0.95),
    )
    alone = be.generate([prompts[0]], [32], seeds=[5])[0]
    batched = be.generate([prompts[1], prompts[0]], [32, 32], seeds=[6, 5])[1]
    assert batched.token_ids == alone.token_ids
    traj = Trajectory(
        turns=[Turn(prompts[0], alone.token_ids, alone.logprobs, truncated=not alone.finished)],
        stop_reason=StopReason.TURN_LENGTH if not alone.finished else StopReason.NO_TOOL_CALL,
    )
    report = replay_logprobs(model, [traj], pad_token_id=tok.pad_token_id, temperature=0.8)
    assert report.max_abs_diff < 1e-3


def test_cuda_continuous_batching_samples_what_hf_samples_and_replays(setup):
    # On the GPU the manager may capture CUDA graphs and batch asynchronously; the sampler and the log-prob
    # hand-off must hold there too (fp32: the same tokens as HF generate; log-probs replay).
    from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend, continuous_batching_config

    tok, chat, model, prompts = setup
    sampling = SamplingSettings(temperature=0.8, top_p=0.95)
    hf = HFGenerationBackend(
        model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling
    )
    cb = ContinuousBatchingBackend(
        model,
        stop_token_ids=chat.stop_token_ids,
        sampling=sampling,
        config=continuous_batching_config({"max_memory_percent": 0.2}),
    )
    want = hf.generate(prompts, [32, 32], seeds=[5, 6])
    with cb.session():
        got = cb.generate(prompts, [32, 32], seeds=[5, 6])
    cb.close()
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    trajs = [
        Trajectory(
            turns=[Turn(p, s.token_ids, s.logprobs, truncated=not s.finished)],
            stop_reason=StopReason.TURN_LENGTH if not s.finished else StopReason.NO_TOOL_CALL,
        )
        for p, s in zip(prompts, got)
    ]
    assert replay_logprobs(model, trajs, pad_token_id=tok.pad_token_id, temperature=0.8).max_abs_diff < 1e-3


def test_a_trainer_step_on_the_gpu(tmp_path):
    from datasets import Dataset

    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    class LastToken:
        def __call__(self, trajectory, example):
            return (sum(trajectory.turns[-1].completion_ids) % 7) / 7.0

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    config = MultiTurnGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=5e-3,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
        reward_components=["r"],
        max_padded_tokens_per_micro_batch=4000,
        max_items_per_micro_batch=2,
    )
    rows = Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)])
    trainer = MultiTurnGRPOTrainer(
        model, config, train_dataset=rows, processing_class=tok, reward_components={"r": LastToken()}
    )
    trainer.train()
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert any(not torch.equal(a.cuda(), b.detach()) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_cuda_padding_free_log_probs_equal_the_padded_layout(attn):
    # On the GPU the packed row goes through sdpa's block-diagonal mask or flash-attention's varlen kernel.
    import importlib.util
    import random

    from conftest import make_trajectory
    from trl_plugins.datum import build_datum, collate
    from trl_plugins.modeling import check_packed_isolation, micro_batch_logprobs

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    tok = build_tokenizer("qwen2_5")
    dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
    model = build_tiny_model(tok, attn_implementation=attn).to("cuda", dtype=dtype)
    rng = random.Random(0)
    datums = [
        build_datum(
            make_trajectory(rng, num_turns=rng.randint(1, 3), vocab=len(tok)), advantage=1.0, trajectory_index=i
        )
        for i in range(6)
    ]
    idx = list(range(len(datums)))
    padded, packed = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, padding_free=True)
    with torch.no_grad():
        a = micro_batch_logprobs(model, padded, "cuda")[0]
        b = micro_batch_logprobs(model, packed, "cuda")[0]
    real = padded.attention_mask.bool().to("cuda")
    assert (a - b)[real].abs().max() < (1e-4 if dtype == torch.float32 else 5e-2)
    check_packed_isolation(model, "cuda", vocab_size=len(tok))


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_cuda_shared_prefix_log_probs_and_gradients_equal_the_padded_layout(attn):
    # The shared-prefix layout on the GPU: the prefixes' key/value states read by the branches (sdpa's masked kernel,
    # or flash-attention's padded path), log-probs and gradients against the padded layout's.
    import importlib.util
    import random

    from conftest import make_trajectory
    from trl_plugins.datum import build_datum, collate
    from trl_plugins.modeling import check_shared_prefix, micro_batch_logprobs

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    tok = build_tokenizer("qwen2_5")
    dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
    model = build_tiny_model(tok, attn_implementation=attn, sliding_window=16).to("cuda", dtype=dtype).train()
    rng = random.Random(0)
    datums = []
    for g in range(3):
        prompt = [rng.randrange(3, len(tok)) for _ in range(40)]
        datums += [
            build_datum(
                make_trajectory(rng, num_turns=rng.randint(1, 3), vocab=len(tok), prompt=prompt),
                advantage=1.0,
                trajectory_index=len(datums),
            )
            for _ in range(4)
        ]
    idx = list(range(len(datums)))
    padded, shared = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, shared_prefix=True)
    a = micro_batch_logprobs(model, padded, "cuda")[0]
    b = micro_batch_logprobs(model, shared, "cuda")[0]
    real = padded.attention_mask.bool().to("cuda")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (a - b)[real].abs().max() < tol
    params = list(model.parameters())
    ga = torch.autograd.grad((a * padded.action_mask.cuda()).sum(), params)
    gb = torch.autograd.grad((b * shared.action_mask.cuda()).sum(), params)
    assert max(float((x - y).norm() / y.norm().clamp(min=1e-30)) for x, y in zip(gb, ga)) < (
        1e-4 if dtype == torch.float32 else 5e-2
    )
    check_shared_prefix(model, "cuda", vocab_size=len(tok))


@pytest.mark.parametrize(
    "attn,dtype", [("sdpa", torch.float32), ("sdpa", torch.bfloat16), ("flash_attention_2", torch.bfloat16)]
)
def test_cuda_chunked_head_equals_the_full_logits(attn, dtype):
    # The chunked output head on the GPU (tests/test_chunked_head.py on the CPU): log-probs, entropies and gradients at
    # the action positions against the model's own full logits, chunks of 5 positions.
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    errors = chunked_head_errors("cuda", attn, dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert max(errors.values()) < tol, errors


def chunked_head_errors(device: str, attn: str, dtype: torch.dtype) -> dict[str, float]:
    """The chunked head's largest gaps from the full logits on ``device``: log-probs and entropies (absolute, at the
    action positions) and gradients (relative, the worst parameter)."""
    import random

    from conftest import make_trajectory
    from trl_plugins.datum import build_datum, collate
    from trl_plugins.modeling import full_logits_logprobs, micro_batch_logprobs

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok, attn_implementation=attn).to(device, dtype=dtype).train()
    rng = random.Random(0)
    datums = [
        build_datum(
            make_trajectory(rng, num_turns=rng.randint(1, 3), vocab=len(tok)), advantage=1.0, trajectory_index=i
        )
        for i in range(4)
    ]
    mb = collate(datums, list(range(len(datums))), pad_token_id=0)
    act = mb.action_mask.bool().to(device)
    logits = model(
        input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device), use_cache=False
    ).logits
    ref_lp, ref_ent = full_logits_logprobs(logits, mb.target_ids.to(device), 0.7, True)
    lp, ent = micro_batch_logprobs(
        model, mb, device, temperature=0.7, with_entropy=True, needed=mb.action_mask, chunk_size=5
    )
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.linspace(-1, 1, act.numel(), device=device).reshape(act.shape)
    ga = torch.autograd.grad((ref_lp.float() * weights)[act].sum() + 0.1 * ref_ent.float()[act].sum(), params)
    gb = torch.autograd.grad((lp.float() * weights)[act].sum() + 0.1 * ent.float()[act].sum(), params)
    lp, ent, ref_lp, ref_ent = (t.detach() for t in (lp, ent, ref_lp, ref_ent))
    return {
        "logp": float((lp.float() - ref_lp.float())[act].abs().max()),
        "entropy": float((ent.float() - ref_ent.float())[act].abs().max()),
        "grad": max(float((x - y).float().norm() / y.float().norm().clamp(min=1e-30)) for x, y in zip(gb, ga)),
    }
