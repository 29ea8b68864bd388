"""Generation backends on a tiny local model: HF generate and transformers' continuous batching run the same
tests (budgets, per-row seeds, batching independence, log-probs, replay). What only continuous batching needs
is in test_continuous_batching.py; the vLLM backend is tested in test_vllm.py."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import code_schema
from support.rollout import make_backend
from trl_plugins.replay.rollout_check import replay_logprobs
from trl_plugins.rollout import ChatFormat, HFGenerationBackend
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.types import LogprobSource, SamplingSettings, StopReason, Trajectory, Turn

SCHEMA = code_schema()


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [SCHEMA])
    model = build_tiny_model(tok, hidden_size=64, num_layers=2)
    prompts = [
        chat.initial_prompt_ids([{"role": "user", "content": "What is 2 + 2?"}]),
        chat.initial_prompt_ids([{"role": "user", "content": "What is 123 * 456 + 789? Use the tool, then answer."}]),
    ]
    return tok, chat, model, prompts


BACKENDS = ["hf", "continuous_batching"]


@pytest.mark.parametrize("kind", BACKENDS)
def test_rows_respect_their_own_budgets_and_seed(setup, kind):
    _, _, _, prompts = setup
    be = make_backend(kind, setup, temperature=1.0)
    rows, budgets = [prompts[0], prompts[1], prompts[0]], [3, 17, 40]
    out = be.generate(rows, budgets, seeds=[5, 6, 7])
    assert [len(s.token_ids) <= b for s, b in zip(out, budgets)] == [True] * 3
    assert all(
        len(s.token_ids) == len(s.logprobs) and all(math.isfinite(x) and x <= 0 for x in s.logprobs) for s in out
    )
    assert [s.finished or len(s.token_ids) == b for s, b in zip(out, budgets)] == [True] * 3
    again = be.generate(rows, budgets, seeds=[5, 6, 7])
    other = be.generate(rows, budgets, seeds=[8, 9, 10])
    assert [s.token_ids for s in again] == [s.token_ids for s in out]
    assert [s.token_ids for s in other] != [s.token_ids for s in out]
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        be.generate([prompts[0]], [0], seeds=[0])
    with pytest.raises(ValueError, match="one seed per prompt"):
        be.generate([prompts[0]], [3], seeds=[0, 1])


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)])
def test_a_row_samples_the_same_whatever_shares_its_batch(setup, sampling, kind):
    # Per-row seeds: the multi-turn engine batches whichever turns are ready, so a turn's sample must not
    # depend on its neighbours, its place in the batch or the batch's padding.
    _, _, _, prompts = setup
    be = make_backend(kind, setup, **sampling)
    alone = be.generate([prompts[0]], [24], seeds=[123])[0]
    for rows, seeds, at in [
        ([prompts[1], prompts[0]], [9, 123], 1),
        ([prompts[0], prompts[1], prompts[1]], [123, 4, 5], 0),
    ]:
        batched = be.generate(rows, [24] * len(rows), seeds=seeds)[at]
        assert batched.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-4
    # Negative control: the same row with another seed samples something else.
    assert be.generate([prompts[0]], [24], seeds=[124])[0].token_ids != alone.token_ids


def test_seeded_gumbel_samples_the_softmax_and_honours_top_k_top_p():
    from trl_plugins.rollout.sampling import SeededSampling, seeded_gumbel

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    picks = (torch.log_softmax(logits, -1)[None, :] + seeded_gumbel(seeds, 3, len(logits)).float()).argmax(-1)
    freq = torch.bincount(picks, minlength=len(logits)).double() / n
    expected = torch.softmax(logits.double(), -1)
    # Within 4 standard errors of a multinomial proportion, for every token.
    assert torch.all((freq - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-4), (freq, expected)
    # Another position gives other draws (the noise is not reused across positions).
    assert not torch.equal(seeded_gumbel(seeds[:50], 3, 6), seeded_gumbel(seeds[:50], 4, 6))
    # The processor applies temperature, then top-k: tokens outside the top 2 are never picked.
    proc = SeededSampling(SamplingSettings(temperature=0.5, top_k=2), seeds[:2000].tolist(), start=0)
    scores = proc(torch.zeros((2000, 0), dtype=torch.long), logits.expand(2000, -1).clone())
    chosen = set(scores.argmax(-1).tolist())
    assert chosen == {0, 1}
    frac0 = (scores.argmax(-1) == 0).double().mean().item()
    p0 = torch.softmax(logits[:2] / 0.5, -1)[0].item()  # renormalised over the top 2
    assert abs(frac0 - p0) < 4 * (p0 * (1 - p0) / 2000) ** 0.5


@pytest.mark.parametrize("kind", BACKENDS)
def test_greedy_a_row_decodes_the_same_beside_a_longer_prompt(setup, kind):
    # Greedy: a row decodes the same alone and beside a longer prompt (HF: left padding handled).
    _, _, _, prompts = setup
    be = make_backend(kind, setup, temperature=0.0)
    alone = be.generate([prompts[0]], [12], seeds=[0])[0]
    batched = be.generate([prompts[1], prompts[0]], [12, 12], seeds=[0, 0])[1]
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-4


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_replay_matches_stored_logprobs_over_multi_turn_trajectories(setup, sampling, kind):
    tok, chat, model, prompts = setup
    be = make_backend(kind, setup, **sampling)
    assert be.logprob_source == LogprobSource.TEMPERATURE_SCALED
    first = be.generate(prompts, [10, 14], seeds=[1] * 2)
    trajs = []
    for prompt, s in zip(prompts, first):
        turn = chat.tool_turn(s.token_ids, "Traceback: oops\n42")
        glue, sources = turn.ids, turn.sources
        second_prompt = prompt + s.token_ids + glue
        s2 = be.generate([second_prompt], [9], seeds=[2] * 1)[0]
        trajs.append(
            Trajectory(
                turns=[
                    Turn(prompt, s.token_ids, s.logprobs),
                    Turn(second_prompt, s2.token_ids, s2.logprobs, prompt_sources=sources, truncated=not s2.finished),
                ],
                stop_reason=StopReason.TURN_LENGTH if not s2.finished else StopReason.NO_TOOL_CALL,
            )
        )
    report = replay_logprobs(model, trajs, pad_token_id=tok.pad_token_id, temperature=be.sampling.temperature)
    assert report.num_tokens == sum(len(t.completion_ids) for tr in trajs for t in tr.turns)
    assert report.max_abs_diff < 1e-4
    # Negative control: replaying at the wrong temperature is caught.
    if be.sampling.temperature != 1.0:
        assert replay_logprobs(model, trajs, pad_token_id=tok.pad_token_id, temperature=1.0).max_abs_diff > 1e-2


def test_hf_session_unwraps_a_prepared_model(setup):
    # With an accelerator, session() goes through unwrapped_for_generation (which gathers
    # ZeRO-3 weights once for the whole rollout); here a 1-process CPU accelerator.
    from accelerate import Accelerator

    tok, chat, model, prompts = setup
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(build_tiny_model(tok))
    be = HFGenerationBackend(
        prepared,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=0.0),
        accelerator=accelerator,
    )
    with be.session() as unwrapped:
        inside = be.generate([prompts[0]], [6], seeds=[0])[0]
        assert be._active is unwrapped
    assert be._active is None
    reference = HFGenerationBackend(
        build_tiny_model(tok),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=0.0),
    ).generate([prompts[0]], [6], seeds=[0])[0]
    assert inside.token_ids == reference.token_ids


def test_hf_generate_in_a_session_never_syncs_ranks_per_token(setup, monkeypatch):
    # Under ZeRO-3 with several processes transformers defaults to synced_gpus (an all-reduce of a "finished" flag every
    # token): ranks that take different turns would pair unrelated generate calls (a collective mismatch, seen with
    # 2 processes and the agent endpoint). Inside a session the weights are whole on each rank: no syncing.
    import transformers.generation.utils as generation

    tok, chat, model, prompts = setup
    be = HFGenerationBackend(
        model,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=chat.stop_token_ids,
        sampling=SamplingSettings(temperature=1.0),
    )
    seen = []
    original = generation.GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("synced_gpus", "default"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(generation.GenerationMixin, "generate", spy)
    monkeypatch.setattr(generation, "is_deepspeed_zero3_enabled", lambda: True)  # what a ZeRO-3 launch looks like
    with be.session():
        be.generate([prompts[0]], [4], seeds=[0])
    be.generate([prompts[0]], [4], seeds=[0])  # outside a session: transformers decides (a partitioned model needs it)
    assert seen == [False, "default"]
