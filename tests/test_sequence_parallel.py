"""Sequence parallelism's settings and its shards (the two-rank equality with one process: tests/test_distributed.py,
the ``sp*`` cases of tests/dist_update_equivalence.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from trl_plugins.run.parallelism import check_sequence_parallel, sequence_parallel_problems


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


def _qwen2_config(**kw):
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=kw.pop("heads", 4),
        num_key_value_heads=kw.pop("kv", 2),
        **kw,
    )
    config._attn_implementation = "sdpa"
    return config


# -- the settings: TRL's and accelerate's parallelism_config taken over, the rest refused -------------------------


def test_trls_parallelism_config_with_sp_size_sets_sequence_parallel_size_and_is_removed(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    config = _config(tmp_path, parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    # Removed, so that the HF Trainer's Accelerator neither shards the prompt dataloader nor runs Ulysses in every
    # forward (rollouts included): the update splits its own forwards.
    assert config.sequence_parallel_size == 2 and config.parallelism_config is None
    assert _config(tmp_path, sequence_parallel_size=2).sequence_parallel_size == 2
    assert _config(tmp_path).sequence_parallel_size == 1


@pytest.mark.parametrize(
    "given,match",
    [
        (dict(tp_size=2), r"parallelism_config sets \{'tp_size': 2\}.*only sequence parallelism"),
        (dict(cp_size=2), r"parallelism_config sets \{'cp_size': 2\}"),
        (dict(dp_shard_size=2, sp_size=2), r"parallelism_config sets \{'dp_shard_size': 2\}.*ZeRO-3"),
    ],
)
def test_other_parallelism_sizes_are_refused_naming_the_field(tmp_path, given, match):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=match):
        _config(tmp_path, parallelism_config=ParallelismConfig(**given))


def test_a_fixed_sequence_length_or_an_attention_in_the_sp_handler_is_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    for handler in (
        DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=False, sp_seq_length=128),
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    ):
        with pytest.raises(ValueError, match="pads each datum to a multiple of sp_size.*sp_attn_implementation"):
            _config(tmp_path, parallelism_config=ParallelismConfig(sp_size=2, sp_handler=handler))


def test_sp_size_and_sequence_parallel_size_that_disagree_are_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="sets sp_size=2 but sequence_parallel_size=4; set only one"):
        _config(tmp_path, sequence_parallel_size=4, parallelism_config=ParallelismConfig(sp_size=2))


def test_an_accelerate_configs_parallelism_config_is_taken_over_and_kept_from_the_accelerator(tmp_path, monkeypatch):
    # accelerate launch with a config's parallelism_config section: environment variables the Accelerator would read.
    import os

    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    config = _config(tmp_path)
    assert config.sequence_parallel_size == 2
    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"the accelerate config's parallelism_config sets \{'tp_size': 2\}"):
        _config(tmp_path)


@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_a_sequence_parallel_size_that_is_not_a_positive_int_is_refused(tmp_path, value):
    with pytest.raises(
        ValueError, match=re.escape(f"sequence_parallel_size={value!r} cannot run: it must be a positive")
    ):
        _config(tmp_path, sequence_parallel_size=value)


def test_shared_prefix_true_is_refused_and_auto_is_off(tmp_path):
    with pytest.raises(ValueError, match="shared_prefix=True forwards several datums per micro-batch"):
        _config(tmp_path, sequence_parallel_size=2, shared_prefix=True)
    config = _config(tmp_path, sequence_parallel_size=2)
    model = SimpleNamespace(config=_qwen2_config())
    assert config.resolve_shared_prefix(model) is False
    assert _config(tmp_path).resolve_shared_prefix(model) is True  # the same model without: on


def test_a_loss_whose_ratio_spans_a_datum_is_refused_when_the_run_is_built(tmp_path):
    from trl_plugins.run import resolve_run

    for loss in ("gspo", "turn_ppo"):
        config = _config(tmp_path, sequence_parallel_size=2, policy_loss=loss)
        with pytest.raises(ValueError, match=f"policy_loss '{loss}'.*does not declare token_local.*ppo_clip"):
            resolve_run(config)
    run = resolve_run(_config(tmp_path, sequence_parallel_size=2))  # ppo_clip declares it
    run.close()


def test_every_limit_of_ulysses_is_named_with_what_to_change():
    config = SimpleNamespace(sequence_parallel_size=4, shared_prefix=None)
    good = _qwen2_config(heads=8, kv=2)
    assert sequence_parallel_problems(config, good, world_size=8, deepspeed=True) == []
    assert (
        sequence_parallel_problems(
            SimpleNamespace(sequence_parallel_size=1), _qwen2_config(heads=3), world_size=3, deepspeed=False
        )
        == []
    )  # off: nothing to check
    cases = {
        "cannot form groups of 4": dict(world_size=6),
        "under DeepSpeed only": dict(deepspeed=False),
        "attention heads do not split over 4": dict(model_config=_qwen2_config(heads=6, kv=2)),
        "key/value heads and 4 ranks": dict(model_config=_qwen2_config(heads=12, kv=6)),
        "attention 'eager' needs a full attention mask": dict(attention="eager"),
        "'sliding_attention'] layers need more than causal attention": dict(
            model_config=_qwen2_config(heads=8, kv=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)
        ),
    }
    for text, given in cases.items():
        kwargs = {**dict(model_config=good, world_size=8, deepspeed=True), **given}
        problems = sequence_parallel_problems(config, kwargs.pop("model_config"), **kwargs)
        assert len(problems) == 1 and text in problems[0], (text, problems)
    # A sliding window with a flash kernel is the kernel's to apply (it takes the window); eager is refused anyway.
    windowed = _qwen2_config(heads=8, kv=2, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert sequence_parallel_problems(config, windowed, attention="flash_attention_2") == []
    with pytest.raises(ValueError, match="sequence_parallel_size=4 cannot run: .*cannot form groups.*DeepSpeed only"):
        check_sequence_parallel(config, good, world_size=2, deepspeed=False)


def test_a_third_party_loss_runs_split_only_when_it_declares_token_local():
    class PerToken:
        needs_ref_logprobs = needs_entropy = False
        token_local = True

    class PerSequence:
        needs_ref_logprobs = needs_entropy = False

    config = SimpleNamespace(sequence_parallel_size=2, shared_prefix=False)
    assert sequence_parallel_problems(config, policy_loss=PerToken()) == []
    assert "does not declare token_local" in sequence_parallel_problems(config, policy_loss=PerSequence())[0]


# -- the shards ---------------------------------------------------------------------------------------------------


def _one_datum_micro_batch(n: int, padded_to: int | None = None):
    import random

    from conftest import make_trajectory
    from trl_plugins.datum import build_datum, collate

    rng = random.Random(n)
    while True:
        datum = build_datum(make_trajectory(rng, num_turns=3), trajectory_index=0)
        if datum.num_tokens >= n:
            break
    datum.input_ids, datum.target_ids = datum.input_ids[:n], datum.target_ids[:n]
    for name in ("behaviour_logprobs", "advantages", "action_mask", "turn_ids"):
        setattr(datum, name, getattr(datum, name)[:n])
    datum.old_logprobs = [0.5 * i for i in range(n)]
    return collate([datum], [0], pad_token_id=0), datum


@pytest.mark.parametrize("n,size", [(17, 2), (16, 2), (13, 4), (1, 2)])
def test_the_shards_of_a_datum_put_together_are_the_datum_padded_to_a_multiple_of_the_group(n, size):
    from trl_plugins.trainers.sequence_parallel import SequenceParallel, shard_micro_batch

    mb, datum = _one_datum_micro_batch(n)
    shards = [
        shard_micro_batch(mb, SequenceParallel(size=size, rank=r, group_index=0, num_groups=1), pad_token_id=0)
        for r in range(size)
    ]
    length = -(-n // size)
    assert all(s.input_ids.shape == (1, length) for s in shards)  # every member's shard as long (Ulysses needs it)
    whole = lambda name: torch.cat([getattr(s, name) for s in shards], dim=1)[0]  # noqa: E731
    assert whole("input_ids")[:n].tolist() == datum.input_ids and whole("input_ids")[n:].eq(0).all()
    assert whole("target_ids")[:n].tolist() == datum.target_ids
    assert whole("position_ids").tolist() == list(range(length * size))  # positions of the whole row, not per shard
    assert whole("real").tolist() == [True] * n + [False] * (length * size - n)
    assert whole("action_mask")[:n].tolist() == datum.action_mask and not whole("action_mask")[n:].any()
    assert torch.allclose(whole("old_logprobs")[:n], torch.tensor(datum.old_logprobs))
    assert torch.allclose(whole("advantages")[:n], torch.tensor(datum.advantages))
    # The whole row's loss tokens on every shard (seq_mean_token_mean's per-row divisor), and any other tensor sharded.
    assert all(float(s.row_tokens) == sum(datum.action_mask) for s in shards)
    weights = torch.arange(n, dtype=torch.float32)[None, :]
    assert torch.cat([s.take(weights) for s in shards], dim=1)[0, :n].tolist() == list(range(n))


def test_a_micro_batch_of_two_datums_is_refused():
    from trl_plugins.datum import collate
    from trl_plugins.trainers.sequence_parallel import SequenceParallel, shard_micro_batch

    _, a = _one_datum_micro_batch(9)
    _, b = _one_datum_micro_batch(11)
    for padding_free in (False, True):
        mb = collate([a, b], [0, 1], pad_token_id=0, padding_free=padding_free)
        with pytest.raises(ValueError, match="holds one datum; this one holds 2"):
            shard_micro_batch(mb, SequenceParallel(size=2, rank=0, group_index=0, num_groups=1), pad_token_id=0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_the_shards_aggregated_sum_to_the_whole_rows(mode):
    # Each shard's share with the global denominators (and the whole row's token count) adds up to the row's loss; a
    # per-shard token count in seq_mean_token_mean would not (the negative control).
    from trl_plugins.algos import aggregate
    from trl_plugins.trainers.sequence_parallel import SequenceParallel, shard_micro_batch

    mb, _ = _one_datum_micro_batch(15)
    loss = torch.linspace(-1, 2, 15)[None, :]
    kw = dict(num_tokens=40.0, num_sequences=3.0, norm_length=64)
    whole = aggregate(loss, mb.action_mask, mode, **kw)
    parts, naive = [], []
    for r in range(2):
        s = shard_micro_batch(mb, SequenceParallel(size=2, rank=r, group_index=0, num_groups=1), pad_token_id=0)
        part_loss = s.take(loss)
        parts.append(aggregate(part_loss, s.action_mask, mode, row_tokens=s.row_tokens, **kw))
        naive.append(aggregate(part_loss, s.action_mask, mode, **kw))
    assert torch.allclose(sum(parts), whole, rtol=1e-6)
    assert torch.allclose(sum(naive), whole, rtol=1e-6) == (mode != "seq_mean_token_mean")


def test_pinned_ulysses_surface():
    # What trl_plugins/trainers/sequence_parallel.py builds on (DeepSpeed's Ulysses module, transformers' attention
    # interface, accelerate's recurrent-layer refusal); a change here must be looked at by hand.
    import inspect

    from accelerate import big_modeling
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    init = inspect.signature(UlyssesSPAttentionHF.__init__).parameters
    for name in (
        "attn",
        "batch_size",
        "attn_head_count",
        "attn_head_size",
        "kv_head_count",
        "num_hidden_layers",
        "process_group",
        "seq_length_is_variable",
    ):
        assert name in init, name
    assert list(inspect.signature(UlyssesSPAttentionHF.forward).parameters)[:6] == [
        "self",
        "module",
        "query",
        "key",
        "value",
        "attention_mask",
    ]
    forward = inspect.getsource(UlyssesSPAttentionHF.forward)
    # Positions gathered from every shard (the shards' position_ids are the whole row's), the core attention called
    # with the mask it was given (None from our redirect: causal over the gathered row).
    assert 'dist.all_gather(position_ids_list, kwargs["position_ids"]' in forward
    assert "self.attn(module, query_layer, key_layer, value_layer, attention_mask" in forward
    assert hasattr(big_modeling, "_refuse_recurrent_layers_under_sequence_parallelism")
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:  # the interface takes a replacement for a key and hands it to every model that looks the key up
        ALL_ATTENTION_FUNCTIONS["sdpa"] = len
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is len
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
