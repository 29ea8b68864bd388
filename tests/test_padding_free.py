"""Padding-free micro-batches: the datums of a micro-batch concatenated into one sequence, attention kept
within each datum. Log-probs, entropy, values, the loss and the update equal the padded layout's (fp32,
1e-5); a leak across datums is caught (negative control); the packers budget tokens."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import make_trajectory, rel_err
from support.settings import update_settings
from trl_plugins.algos import PPOClipLoss
from trl_plugins.contracts import plan_violations
from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import PackedAttentionLeak, check_packed_isolation, micro_batch_logprobs
from trl_plugins.packing import PackingError, micro_batch_cost, pack_for_ranks
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.trainers.update import policy_update


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _datums(seed=7, n=9):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        adv = rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5)
        out.append(build_datum(make_trajectory(rng, num_turns=rng.randint(1, 3)), advantage=adv, trajectory_index=i))
    return out


def _model(sliding_window=None, attn="eager"):
    # conftest's tiny Qwen2 (vocab 200), optionally with sliding-window attention in every layer.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    extra = (
        {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0} if sliding_window else {}
    )
    config = Qwen2Config(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn
    return model.eval()


@pytest.fixture(params=[(None, "eager"), (None, "sdpa"), (6, "sdpa")], ids=["eager", "sdpa", "sdpa_sliding_window"])
def model(request):
    return _model(*request.param)


def test_log_probs_entropy_and_gradients_equal_the_padded_layout(model):
    datums = _datums()
    idx = list(range(len(datums)))
    padded = collate(datums, idx, pad_token_id=0)
    packed = collate(datums, idx, pad_token_id=0, padding_free=True)
    assert packed.num_padded_tokens == sum(d.num_tokens for d in datums) < padded.num_padded_tokens
    lp_a, ent_a = micro_batch_logprobs(model, padded, "cpu", temperature=0.7, with_entropy=True)
    lp_b, ent_b = micro_batch_logprobs(model, packed, "cpu", temperature=0.7, with_entropy=True)
    real = padded.attention_mask.bool()
    assert (lp_a - lp_b)[real].abs().max() < 1e-5 and (ent_a - ent_b)[real].abs().max() < 1e-5
    assert lp_b[~real].abs().max() == 0  # padding positions hold 0, as in the padded layout
    grads_a = torch.autograd.grad((lp_a * padded.action_mask).sum() + ent_a[real].sum(), list(model.parameters()))
    grads_b = torch.autograd.grad((lp_b * packed.action_mask).sum() + ent_b[real].sum(), list(model.parameters()))
    assert max(rel_err(a, b) for a, b in zip(grads_a, grads_b)) < 1e-5


def _update(model, datums, padding_free, **overrides):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    config = update_settings(
        aggregation="seq_mean_token_mean",
        packer="optimal",
        max_items_per_micro_batch=3,
        max_padded_tokens_per_micro_batch=400,
        rebalance_ranks=False,
        norm_length=None,
        temperature=0.9,
        max_grad_norm=None,
        drop_zero_advantage=False,
        padding_free=padding_free,
        **overrides,
    )
    return policy_update(accelerator, model, optimizer, datums, PPOClipLoss(), config, pad_token_id=0)


def test_the_update_equals_the_padded_layouts_update(model):
    # Same datums, same loss (a per-sequence aggregation, so rows must stay sequences), one SGD step each way.
    datums = _datums()
    with torch.no_grad():
        mb = collate(datums, list(range(len(datums))), pad_token_id=0)
        lp, _ = micro_batch_logprobs(model, mb, "cpu", temperature=0.9)
    for row, d in enumerate(datums):
        d.behaviour_logprobs = [float(x) - 0.1 if m else 0.0 for x, m in zip(lp[row, : d.num_tokens], d.action_mask)]
    padded_model, packed_model = copy.deepcopy(model), copy.deepcopy(model)
    before = _flat(model)
    a = _update(padded_model, datums, False)
    b = _update(packed_model, datums, True)
    assert abs(a.loss - b.loss) < 1e-5
    assert b.num_padded_tokens == b.num_input_tokens == a.num_input_tokens < a.num_padded_tokens
    assert rel_err(_flat(packed_model) - before, _flat(padded_model) - before) < 1e-5
    sa, sb = a.stats.summary(), b.stats.summary()
    assert all(abs(sa[k] - sb[k]) < 1e-5 for k in sa), (sa, sb)


def test_critic_values_equal_the_padded_layouts(tiny_model_factory):
    from trl_plugins.trainers.critic import build_critic, micro_batch_values

    critic = build_critic(tiny_model_factory(torch.float32))
    datums = _datums(seed=3)
    idx = list(range(len(datums)))
    padded, packed = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, padding_free=True)
    real = padded.attention_mask.bool()
    with torch.no_grad():
        va, vb = micro_batch_values(critic, padded, "cpu"), micro_batch_values(critic, packed, "cpu")
    assert (va - vb)[real].abs().max() < 1e-5
    assert check_packed_isolation(critic, "cpu", vocab_size=critic.config.vocab_size) < 1e-5


def test_negative_control_a_leak_across_datums_is_caught(tiny_model_factory, monkeypatch):
    # Attention that does not see the positions restart (here: transformers told there is no packing) lets a
    # datum attend to the one before it. The log-probs then differ, and the start-up check refuses the model.
    import transformers.masking_utils as masking_utils

    model = tiny_model_factory(torch.float32)
    datums = _datums()
    idx = list(range(len(datums)))
    padded, packed = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, padding_free=True)
    real = padded.attention_mask.bool()
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with torch.no_grad():
        leaked = (micro_batch_logprobs(model, padded, "cpu")[0] - micro_batch_logprobs(model, packed, "cpu")[0])[real]
    assert leaked.abs().max() > 1e-2
    with pytest.raises(PackedAttentionLeak, match="does not keep packed sequences apart.*padding_free=False"):
        check_packed_isolation(model, "cpu", vocab_size=model.config.vocab_size)
    with pytest.raises(PackedAttentionLeak, match="the policy"):
        _update(copy.deepcopy(model), datums, True)


@pytest.mark.parametrize("strategy", ["ffd", "optimal", "balanced"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_packers_budget_tokens_when_padding_free(strategy, world_size):
    rng = random.Random(world_size)
    for _ in range(20):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(1, 60))]
        plan = pack_for_ranks(
            lengths, strategy=strategy, max_items=7, max_padded_tokens=1500, world_size=world_size, padding_free=True
        )
        # A valid partition; each micro-batch within 7 items and 1500 tokens (its padded area may be larger).
        problems = [p for p in plan_violations(plan, lengths, 7, 10**9, world_size)]
        assert not problems, problems
        assert all(micro_batch_cost(lengths, mb, padding_free=True) <= 1500 for rank in plan.ranks for mb in rank)
        # Fewest micro-batches: within the first-fit-decreasing bound of the lower bound on one rank.
        if world_size == 1:
            bound = max(-(-sum(lengths) // 1500), -(-len(lengths) // 7))
            assert plan.num_micro_batches <= 11 * bound // 9 + 1
    # The balanced packer spreads tokens: its slowest rank is never worse than spreading the global packing.
    lengths = [rng.randint(1, 500) for _ in range(90)]
    per_rank = [
        sum(micro_batch_cost(lengths, mb, padding_free=True) for mb in rank)
        for rank in pack_for_ranks(
            lengths, strategy="balanced", max_items=7, max_padded_tokens=1500, world_size=3, padding_free=True
        ).ranks
    ]
    assert max(per_rank) <= sum(lengths) / 3 * 1.05


def test_a_packer_without_the_capability_is_refused(tmp_path, isolated_registries):
    from trl_plugins.registry import PACKERS
    from trl_plugins.trainers import MultiTurnGRPOConfig

    @PACKERS.register("area_only")
    def area_only(lengths, *, max_items, max_padded_tokens, world_size=1):
        return pack_for_ranks(
            lengths, strategy="ffd", max_items=max_items, max_padded_tokens=max_padded_tokens, world_size=world_size
        )

    with pytest.raises(PackingError, match="'area_only' budgets padded area only"):
        pack_for_ranks([3, 4], strategy="area_only", max_items=2, max_padded_tokens=10, world_size=1, padding_free=True)
    kwargs = dict(
        output_dir=str(tmp_path),
        reward_components=["correct"],
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        save_strategy="no",
        packer="area_only",
    )
    with pytest.raises(ValueError, match="padding_free=True, but packer 'area_only'"):
        MultiTurnGRPOConfig(**kwargs, padding_free=True)
    assert MultiTurnGRPOConfig(**kwargs).padding_free is None  # auto: resolved to False for this packer


def test_training_steps_are_the_same_in_every_layout(tmp_path):
    # The trainer end to end (rollout, datums, packing, update): two steps padding-free, two padded and two in the
    # shared-prefix layout give the same losses and weights (SGD: Adam would amplify float noise in near-zero
    # gradients); the padding-free run's forward processes exactly the real tokens, the shared-prefix run's computes
    # fewer (each group's prompt once per micro-batch).
    import json

    from datasets import Dataset

    from support.trainer import TokenReward, tiny_config
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    questions = ["What is 1 + 1?", "Add 12 and 30, then multiply by 7. " * 3, "What is 2 * 3?", "Compute 5 - 9 " * 6]
    rows = Dataset.from_list([{"prompt": q, "answer": "0"} for q in questions])

    runs = {}
    for layout, (padding_free, shared_prefix) in {
        "free": (True, False),
        "padded": (False, False),
        "shared": (False, None),
    }.items():  # None: auto, on for sdpa
        tok = build_tokenizer("qwen2_5")
        out = tmp_path / layout
        trainer = MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(
                out,
                padding_free=padding_free,
                shared_prefix=shared_prefix,
                learning_rate=0.5,
                max_items_per_micro_batch=4,
                optim="sgd",
            ),
            train_dataset=rows,
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )
        assert trainer.args.shared_prefix is (layout == "shared")
        trainer.train()
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[layout] = (trainer, [r for r in steps if "reward/total" in r])
    padded, padded_steps = runs["padded"]
    for layout in ("free", "shared"):
        trainer, steps = runs[layout]
        assert [r["train/policy_loss"] for r in steps] == pytest.approx(
            [r["train/policy_loss"] for r in padded_steps], abs=1e-6
        )
        assert [r["reward/total"] for r in steps] == [r["reward/total"] for r in padded_steps]
        assert (
            max((a - b).abs().max().item() for a, b in zip(trainer.model.parameters(), padded.model.parameters()))
            < 1e-5
        )
    assert all(
        r["train/forward_tokens"] == r["train/input_tokens"] == r["train/computed_tokens"] for r in runs["free"][1]
    )
    assert all(r["train/forward_tokens"] > r["train/input_tokens"] == r["train/computed_tokens"] for r in padded_steps)
    assert all(r["train/computed_tokens"] < r["train/input_tokens"] for r in runs["shared"][1])


def test_auto_is_on_for_flash_attention_and_off_for_dense_masks(tmp_path, isolated_registries):
    # sdpa/eager build a dense block-diagonal mask whose cost grows with the square of the packed length
    # (measured slower than padding on CPU); flash-attention's variable-length kernel attends per datum.
    from trl_plugins.registry import PACKERS
    from trl_plugins.trainers import MultiTurnGRPOConfig

    def config(**overrides):
        return MultiTurnGRPOConfig(
            output_dir=str(tmp_path),
            reward_components=["correct"],
            use_cpu=True,
            bf16=False,
            report_to=[],
            per_device_train_batch_size=4,
            num_generations=2,
            save_strategy="no",
            **overrides,
        )

    def model_with(impl):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))

    assert config().padding_free is None
    for impl, expected in [("flash_attention_2", True), ("flash_attention_3", True), ("sdpa", False), ("eager", False)]:
        assert config().resolve_padding_free(model_with(impl)) is expected, impl
    assert config(padding_free=True).resolve_padding_free(model_with("sdpa")) is True  # an explicit choice is kept

    @PACKERS.register("area_only2")
    def area_only2(lengths, *, max_items, max_padded_tokens, world_size=1):
        return pack_for_ranks(
            lengths, strategy="ffd", max_items=max_items, max_padded_tokens=max_padded_tokens, world_size=world_size
        )

    assert config(packer="area_only2").resolve_padding_free(model_with("flash_attention_2")) is False
