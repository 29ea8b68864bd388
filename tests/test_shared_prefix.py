"""The shared-prefix layout: each prefix that datums share forwarded once, the branches reading its key/value states.

Log-probs, entropies, values and gradients equal the padded layout's (fp32, 1e-5) on several architectures (sliding
window included, and under activation checkpointing); the update equals the padded one for every aggregation mode
and micro-batching with the KL, entropy, importance-weight and critic terms on (two ranks: test_distributed.py); the
trees save the most tokens (against brute force); the packer seam keeps groups together and third-party packers work
as before; a model that ignores the states, or reentrant checkpointing, is refused.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import rel_err
from support.prefix import group_datums, small_model
from support.settings import update_settings
from trl_plugins.algos import PPOClipLoss
from trl_plugins.datum import collate, shared_prefix_layout
from trl_plugins.modeling import (
    SharedPrefixUnsupported,
    check_shared_prefix,
    micro_batch_logprobs,
    shared_prefix_outputs,
)
from trl_plugins.packing import (
    layout_trees,
    pack_for_ranks,
    prefix_lengths,
    prefix_trees,
    supports_prefix_trees,
    tree_area,
    tree_tokens,
)
from trl_plugins.types import PrefixTree

ARCHS = [
    "qwen2_eager",
    "qwen2_sdpa",
    "qwen2_sliding_sdpa",
    "qwen2_sliding_eager",
    "qwen2_hybrid",
    "llama",
    "mistral_sliding",
]


# -- the trees ----------------------------------------------------------------------------------------------------


def _brute_force_saving(seqs) -> int:
    # Every partition of the items into trees, each sharing its members' longest common prefix.
    def lcp(group):
        n = min(len(seqs[i]) for i in group)
        k = 0
        while k < n and len({seqs[i][k] for i in group}) == 1:
            k += 1
        return k

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for k in range(len(part)):
                yield part[:k] + [[first] + part[k]] + part[k + 1 :]
            yield [[first]] + part

    return max(sum((len(g) - 1) * lcp(g) for g in p if len(g) > 1) for p in partitions(list(range(len(seqs)))))


def test_prefix_trees_forward_the_fewest_tokens():
    rng = random.Random(0)
    for _ in range(60):
        # Few symbols, so that prefixes nest (a system prompt shared by all, a question by some, an opening by two).
        seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 7))] for _ in range(rng.randint(1, 6))]
        trees = prefix_trees(seqs)
        assert sorted(i for t in trees for i in t.members) == list(range(len(seqs)))
        for t in trees:
            assert all(seqs[i][: t.prefix_len] == seqs[t.members[0]][: t.prefix_len] for i in t.members)
            assert (t.prefix_len == 0) == (len(t.members) == 1) or t.prefix_len == 0
        lengths = [len(s) for s in seqs]
        assert sum(lengths) - tree_tokens(lengths, trees) == _brute_force_saving(seqs)
    assert prefix_trees([[1, 2, 3, 4], [1, 2, 3, 9], [7, 7]]) == [PrefixTree(3, (0, 1)), PrefixTree(0, (2,))]
    assert prefix_trees([]) == []


def test_the_layout_rebuilds_every_datum_from_its_prefix_and_branch():
    datums = group_datums()
    rows = [d.input_ids for d in datums]
    layout = shared_prefix_layout(rows, pad_token_id=0)
    ids = torch.cat([layout.prefix_ids.flatten(), layout.branch_ids.flatten()])
    positions = torch.cat([layout.prefix_positions.flatten(), layout.branch_positions.flatten()])
    for r, row in enumerate(rows):
        assert ids[layout.index[r, : len(row)]].tolist() == row
        assert positions[layout.index[r, : len(row)]].tolist() == list(range(len(row)))
    lengths = [len(r) for r in rows]
    trees = prefix_trees(rows)
    assert layout.num_tokens == tree_tokens(lengths, trees) < sum(lengths)
    assert layout.area == tree_area(lengths, trees)
    assert layout.prefix_ids.shape[0] == 3  # one prefix per group; the lone datum is a branch of its own


def test_a_long_datum_is_forwarded_whole_rather_than_widening_every_branch():
    # 8 datums sharing 50 tokens, 7 with 10-token branches and one with a 150-token branch: as a member of the tree it
    # pads all 8 branch rows to 150; forwarded whole (a prefix row of its own) it recomputes the 50 shared tokens.
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(50)]
    rows = [shared + [rng.randrange(3, 200) for _ in range(150 if k == 3 else 10)] for k in range(8)]
    lengths = [len(r) for r in rows]
    trees = prefix_trees(rows)
    assert trees == [PrefixTree(50, tuple(range(8)))]
    forwarded, used = layout_trees(lengths, trees)
    assert sorted((t.members, p) for t, p in zip(forwarded, used)) == [((0, 1, 2, 4, 5, 6, 7), 50), ((3,), 200)]
    layout = shared_prefix_layout(rows, pad_token_id=0)
    assert layout.area == tree_area(lengths, trees) == 2 * 200 + 8 * 10 < 50 + 8 * 150
    assert layout.num_tokens == 50 + 7 * 10 + 200
    assert_same_log_probs(rows)


def test_a_long_lone_datum_becomes_a_prefix_row_rather_than_widening_every_branch():
    # 8 datums sharing 200 tokens with 10-token branches, and one 210-token datum sharing nothing: as a branch it
    # would pad all 9 branch rows to 210; as a prefix row of its own (its first 200 tokens, the prefixes' width, its
    # last 10 a branch) it costs one row of the prefix forward.
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(200)]
    rows = [shared + [rng.randrange(3, 200) for _ in range(10)] for _ in range(8)] + [[1] * 210]
    lengths = [len(r) for r in rows]
    trees = prefix_trees(rows)
    assert prefix_lengths(lengths, trees) == [200, 200]
    layout = shared_prefix_layout(rows, pad_token_id=0)
    assert layout.prefix_ids.shape == (2, 200) and layout.branch_ids.shape == (9, 10)
    assert layout.area == tree_area(lengths, trees) == 2 * 200 + 9 * 10 < 1 * 200 + 9 * 210
    assert_same_log_probs(rows)


def test_a_prefix_longer_than_the_others_is_cut_where_its_rest_fits_the_branch_width():
    # Group A shares 100 tokens (30-token branches); group B is 4 identical 120-token trajectories (a solved task's
    # group): forwarding B's 120 shared tokens whole would widen every prefix row to 120; its last 20 fit the
    # 30-token branch width already paid for.
    rng = random.Random(2)
    head = [rng.randrange(3, 200) for _ in range(100)]
    rows = [head + [rng.randrange(3, 200) for _ in range(30)] for _ in range(4)]
    rows += [[7] * 120 for _ in range(4)]
    lengths = [len(r) for r in rows]
    trees = prefix_trees(rows)
    assert sorted(t.prefix_len for t in trees) == [100, 120]
    assert sorted(prefix_lengths(lengths, trees)) == [100, 100]
    layout = shared_prefix_layout(rows, pad_token_id=0)
    assert layout.area == tree_area(lengths, trees) == 2 * 100 + 8 * 30 < 2 * 120 + 8 * 30
    assert_same_log_probs(rows)


def assert_same_log_probs(rows):
    """The layout chosen for ``rows`` gives the padded layout's log-probs (a sliding-window model)."""
    model = small_model("qwen2_sliding_sdpa")
    padded, mine = collate_rows(rows), collate_rows(rows, shared_prefix=True)
    with torch.no_grad():
        a, b = micro_batch_logprobs(model, padded, "cpu")[0], micro_batch_logprobs(model, mine, "cpu")[0]
    assert (a - b)[padded.attention_mask.bool()].abs().max() < 1e-5


def collate_rows(rows, shared_prefix=False):
    """Token rows as datums (every position a loss position), collated."""
    from trl_plugins.types import Datum, TokenSource

    datums = [
        Datum(
            input_ids=r[:-1],
            target_ids=r[1:],
            behaviour_logprobs=[0.0] * (len(r) - 1),
            advantages=[1.0] * (len(r) - 1),
            action_mask=[1] * (len(r) - 1),
            sources=[TokenSource.ACTION] * (len(r) - 1),
        )
        for r in rows
    ]
    return collate(datums, list(range(len(datums))), pad_token_id=0, shared_prefix=shared_prefix)


# -- equal outputs and gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_entropy_and_gradients_equal_the_padded_layout(arch):
    model = small_model(arch).train()
    datums = group_datums()
    idx = list(range(len(datums)))
    padded, shared = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, shared_prefix=True)
    assert (
        shared.num_forwarded_tokens < padded.num_forwarded_tokens
        and shared.num_padded_tokens < padded.num_padded_tokens
    )
    lp_a, ent_a = micro_batch_logprobs(model, padded, "cpu", temperature=0.7, with_entropy=True)
    lp_b, ent_b = micro_batch_logprobs(model, shared, "cpu", temperature=0.7, with_entropy=True)
    real = padded.attention_mask.bool()
    assert rel_err(lp_b[real], lp_a[real]) < 1e-5 and rel_err(ent_b[real], ent_a[real]) < 1e-5
    assert (lp_b - lp_a)[real].abs().max() < 1e-5
    assert lp_b[~real].abs().max() == 0 and ent_b[~real].abs().max() == 0
    params = list(model.parameters())
    grads_a = torch.autograd.grad((lp_a * padded.action_mask).sum() + 0.1 * ent_a[real].sum(), params)
    grads_b = torch.autograd.grad((lp_b * shared.action_mask).sum() + 0.1 * ent_b[real].sum(), params)
    assert max(rel_err(b, a) for a, b in zip(grads_a, grads_b)) < 1e-5
    assert check_shared_prefix(model, "cpu", vocab_size=200) < 1e-5


def _backward_both_layouts(model, *, seed):
    """Backward the summed action log-probs of a group's datums through ``model`` under (non-reentrant) activation
    checkpointing in the shared-prefix layout, and through an unchanged copy in the padded one; returns the copy."""
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    datums = group_datums(seed=seed)
    idx = list(range(len(datums)))
    padded, shared = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, shared_prefix=True)
    (micro_batch_logprobs(reference, padded, "cpu")[0] * padded.action_mask).sum().backward()
    (micro_batch_logprobs(model, shared, "cpu")[0] * shared.action_mask).sum().backward()
    return reference


def test_gradients_flow_through_the_prefix_under_activation_checkpointing():
    # Checkpointed layers drop a cache they are passed unless told they may keep it; ours store nothing, so the
    # backward's replay is exact. A prefix that got no gradient from its branches would show here.
    model = small_model("qwen2_sliding_sdpa").train()
    reference = _backward_both_layouts(model, seed=3)
    assert max(rel_err(b.grad, a.grad) for a, b in zip(reference.parameters(), model.parameters())) < 1e-5
    assert not any("_can_checkpoint_with_cache" in vars(m) for m in model.modules())  # restored


def test_a_lora_adapter_on_the_queries_only_trains_through_the_prefix():
    # Adapters on q_proj alone: the first layer's keys and values need no gradient (nothing upstream trains), the
    # second layer's do; the adapters' gradients equal the padded layout's, under activation checkpointing.
    from peft import LoraConfig, get_peft_model

    base = small_model("qwen2_sliding_sdpa")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    model.train()
    reference = _backward_both_layouts(model, seed=4)
    trained = [(a, b) for a, b in zip(reference.parameters(), model.parameters()) if a.requires_grad]
    assert trained and all(b.grad is not None for _, b in trained)
    assert max(rel_err(b.grad, a.grad) for a, b in trained) < 1e-5


def test_reentrant_activation_checkpointing_is_refused():
    model = small_model("qwen2_sdpa").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    datums = group_datums()
    shared = collate(datums, list(range(len(datums))), pad_token_id=0, shared_prefix=True)
    with pytest.raises(SharedPrefixUnsupported, match="use_reentrant"):
        micro_batch_logprobs(model, shared, "cpu")
    with torch.no_grad():  # the no-gradient passes (old and reference log-probs, values) need no gradient
        micro_batch_logprobs(model, shared, "cpu")


def test_critic_values_and_their_gradient_equal_the_padded_layouts(tiny_model_factory):
    from trl_plugins.trainers.critic import build_critic, micro_batch_values

    critic = build_critic(tiny_model_factory(torch.float32))
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    datums = group_datums(seed=5)
    idx = list(range(len(datums)))
    padded, shared = collate(datums, idx, pad_token_id=0), collate(datums, idx, pad_token_id=0, shared_prefix=True)
    real = padded.attention_mask.bool()
    va, vb = micro_batch_values(critic, padded, "cpu"), micro_batch_values(critic, shared, "cpu")
    assert (va - vb)[real].abs().max() < 1e-5 and vb[~real].abs().max() == 0
    params = list(critic.parameters())
    ga = torch.autograd.grad((va * padded.action_mask).pow(2).sum(), params)
    gb = torch.autograd.grad((vb * shared.action_mask).pow(2).sum(), params)
    assert max(rel_err(b, a) for a, b in zip(ga, gb)) < 1e-5


class _DropsKwarg(torch.nn.Module):
    """A model whose forward drops one argument: ``cache`` (it keeps no states) or ``attention_mask`` (a branch then
    attends to its prefix's left padding)."""

    def __init__(self, inner, dropped):
        super().__init__()
        self.inner, self.dropped, self.config = inner, dropped, inner.config

    def forward(self, **kwargs):
        kwargs.pop(self.dropped, None)
        return self.inner(**kwargs)


@pytest.mark.parametrize(
    "dropped,message", [("cache", "kept no key/value states"), ("attention_mask", "away from forwarding")]
)
def test_a_model_that_ignores_the_prefix_states_or_positions_is_refused(dropped, message):
    # Negative controls: each breaks the layout, and the check run before the first update says so.
    model = _DropsKwarg(small_model("qwen2_sdpa"), dropped)
    with pytest.raises(SharedPrefixUnsupported, match=f"{message}.*shared_prefix=False"):
        check_shared_prefix(model, "cpu", vocab_size=200)


# -- the update -----------------------------------------------------------------------------------------------------


def _config(**overrides):
    base = dict(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=3,
        max_padded_tokens_per_micro_batch=400,
        rebalance_ranks=False,
        norm_length=64,
        temperature=0.9,
        max_grad_norm=None,
        drop_zero_advantage=True,
        padding_free=False,
        shared_prefix=False,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=0.8,
        vllm_importance_sampling_clip_max=1.25,
    )
    return update_settings(**{**base, **overrides})


def _prepared(model, accelerator, lr=0.5):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return accelerator.prepare(model, optimizer)


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("max_items", [2, 32], ids=["micro-batched", "one-micro-batch"])
def test_the_update_equals_the_padded_layouts(aggregation, max_items):
    # Reference KL, entropy bonus and importance weights on (the reference and old log-probs taken in each layout by
    # the passes that fill them); micro-batches of 2 rows cut the groups, of 32 hold them all.
    from accelerate import Accelerator

    from trl_plugins.trainers.update import old_logprobs, policy_update, reference_logprobs

    base = small_model("qwen2_sliding_sdpa")
    ref_model = small_model("qwen2_sliding_sdpa")
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    datums = group_datums(seed=11)
    with torch.no_grad():
        mb = collate(datums, list(range(len(datums))), pad_token_id=0)
        lp, _ = micro_batch_logprobs(base, mb, "cpu", temperature=0.9)
    gen = torch.Generator().manual_seed(1)
    for row, d in enumerate(datums):
        noisy = lp[row, : d.num_tokens] + 0.2 * torch.randn(d.num_tokens, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]
    datums[1].advantages = [0.0] * datums[1].num_tokens  # dropped from the forward, kept in the denominators
    results, moved, filled = {}, {}, {}
    before = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    for shared in (False, True):
        config = _config(aggregation=aggregation, max_items_per_micro_batch=max_items, shared_prefix=shared)
        mine = copy.deepcopy(datums)
        accelerator = Accelerator(cpu=True)
        model, optimizer = _prepared(copy.deepcopy(base), accelerator)
        reference_logprobs(
            accelerator,
            accelerator.prepare_model(copy.deepcopy(ref_model), evaluation_mode=True),
            mine,
            config,
            pad_token_id=0,
        )
        old_logprobs(accelerator, model, mine, config, pad_token_id=0)
        filled[shared] = [(d.ref_logprobs, d.old_logprobs) for d in mine]
        results[shared] = policy_update(
            accelerator, model, optimizer, mine, PPOClipLoss(kl_coef=0.3, entropy_coef=0.05), config, pad_token_id=0
        )
        moved[shared] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before
    a, b = results[False], results[True]
    for (ref_a, old_a), (ref_b, old_b) in zip(filled[False], filled[True]):
        assert max(abs(x - y) for x, y in zip(ref_a + old_a, ref_b + old_b)) < 1e-5
    assert moved[False].norm() > 1e-3 and rel_err(moved[True], moved[False]) < 1e-5
    assert abs(a.loss - b.loss) < 1e-5 * max(1.0, abs(a.loss))
    assert abs(a.entropy - b.entropy) < 1e-5 and abs(a.reference["kl_k3"] - b.reference["kl_k3"]) < 1e-6
    assert a.mismatch is not None and a.mismatch == pytest.approx(b.mismatch, abs=1e-6)
    assert b.num_input_tokens == a.num_input_tokens == a.num_computed_tokens > b.num_computed_tokens
    assert b.num_padded_tokens < a.num_padded_tokens


def test_a_compacting_harness_segments_share_one_advantage_and_their_prefix_forward():
    # A harness that compacts every 3 turns (issue 65): its rewrites are sibling segments of one trajectory, each a
    # datum with the trajectory's one outcome advantage, and segments that begin with the same system-and-tools prefix
    # forward it once in the update (here the two trajectories' 8 segments share it), with the padded update's result.
    from accelerate import Accelerator

    from trl_plugins.contracts import make_compacting_trajectory
    from trl_plugins.datum import build_datums
    from trl_plugins.trainers.update import policy_update

    rng = random.Random(3)
    system = [rng.randrange(3, 200) for _ in range(40)]
    shape = dict(question_len=6, turns=12, every=3, summary_len=10, completion_len=5, observation_len=8)
    trajectories = [
        make_compacting_trajectory(rng, system=system, group_id=g, advantage=a, **shape)
        for g, a in enumerate((0.8, -0.5))
    ]
    per = [build_datums(t, advantage=t.advantage) for t in trajectories]
    datums = [d for mine in per for d in mine]
    assert [t.num_segments for t in trajectories] == [4, 4] and len(datums) == 8
    for t, mine in zip(trajectories, per):  # one outcome advantage on every action token of every segment, 0 elsewhere
        assert {a for d in mine for a, m in zip(d.advantages, d.action_mask) if m} == {t.advantage}
        assert {a for d in mine for a, m in zip(d.advantages, d.action_mask) if not m} == {0.0}
    base = small_model("qwen2_sliding_sdpa")
    with torch.no_grad():
        lp, _ = micro_batch_logprobs(base, collate(datums, list(range(8)), pad_token_id=0), "cpu", temperature=0.9)
    gen = torch.Generator().manual_seed(2)
    for row, d in enumerate(datums):
        noisy = lp[row, : d.num_tokens] + 0.2 * torch.randn(d.num_tokens, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]
    results, moved = {}, {}
    before = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    for shared in (False, True):
        config = _config(shared_prefix=shared, max_items_per_micro_batch=8, max_padded_tokens_per_micro_batch=4000)
        accelerator = Accelerator(cpu=True)
        model, optimizer = _prepared(copy.deepcopy(base), accelerator)
        results[shared] = policy_update(
            accelerator, model, optimizer, copy.deepcopy(datums), PPOClipLoss(), config, pad_token_id=0
        )
        moved[shared] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before
    a, b = results[False], results[True]
    assert moved[False].norm() > 1e-3 and rel_err(moved[True], moved[False]) < 1e-5
    assert abs(a.loss - b.loss) < 1e-5 * max(1.0, abs(a.loss))
    # The system prefix forwarded once for the 8 segments, not 8 times: the tokens the analytic count gives.
    total = sum(d.num_tokens for d in datums)
    assert a.num_computed_tokens == total and b.num_computed_tokens == total - 7 * len(system)


def test_the_critic_update_equals_the_padded_layouts(tiny_model_factory):
    from accelerate import Accelerator

    from trl_plugins.trainers.critic import build_critic, prepare_critic, rollout_values, value_update

    datums = group_datums(seed=13)
    base = build_critic(tiny_model_factory(torch.float32))
    with torch.no_grad():
        base.score.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
    out = {}
    for shared in (False, True):
        mine = copy.deepcopy(datums)
        accelerator = Accelerator(cpu=True)
        critic, optimizer = prepare_critic(
            accelerator, copy.deepcopy(base), learning_rate=0.5, optimizer_cls=torch.optim.SGD
        )
        config = _config(max_items_per_micro_batch=2, shared_prefix=shared)
        rollout_values(accelerator, critic, mine, config, pad_token_id=0)
        values = [list(d.old_values) for d in mine]
        gen = torch.Generator().manual_seed(2)
        for d in mine:  # old values moved off the current ones, so that the value clip binds on some tokens
            d.returns = [
                float(x) if m else 0.0 for x, m in zip(torch.randn(d.num_tokens, generator=gen), d.action_mask)
            ]
            d.old_values = [v + 0.1 * float(e) for v, e in zip(d.old_values, torch.randn(d.num_tokens, generator=gen))]
        result = value_update(
            accelerator, critic, optimizer, mine, config, vf_clip=0.05, vf_coef=0.7, max_grad_norm=None, pad_token_id=0
        )
        out[shared] = (values, result, torch.cat([p.detach().reshape(-1) for p in critic.parameters()]))
    (values_a, res_a, after_a), (values_b, res_b, after_b) = out[False], out[True]
    assert max(abs(x - y) for va, vb in zip(values_a, values_b) for x, y in zip(va, vb)) < 1e-5
    start = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    assert rel_err(after_b - start, after_a - start) < 1e-5 and abs(res_a.loss - res_b.loss) < 1e-6
    assert 0 < res_a.clip_frac == pytest.approx(res_b.clip_frac)


# -- the packer seam ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ffd", "optimal", "balanced"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_packers_keep_each_tree_together_within_the_limits(strategy, world_size):
    datums = group_datums(seed=world_size, groups=6, size=4, extra=3)
    lengths = [d.num_tokens for d in datums]
    trees = prefix_trees([d.input_ids for d in datums])
    budget = 4 * max(lengths)
    plan = pack_for_ranks(
        lengths, strategy=strategy, max_items=5, max_padded_tokens=budget, world_size=world_size, prefix_trees=trees
    )
    assert plan.world_size == world_size and len({len(r) for r in plan.ranks}) == 1
    assert sorted(i for r in plan.ranks for mb in r for i in mb) == list(range(len(lengths)))
    home = {i: (r, k) for r, rank in enumerate(plan.ranks) for k, mb in enumerate(rank) for i in mb}
    for mb in (mb for rank in plan.ranks for mb in rank if mb):
        assert len(mb) <= 5
        assert shared_prefix_layout([datums[i].input_ids for i in mb], pad_token_id=0).area <= budget
    for tree in trees:  # a group of 4 fits a micro-batch of 5 rows: it is never cut
        assert len({home[i] for i in tree.members}) == 1, tree
    # The plan shares as the trees do: each micro-batch computes what its trees, as forwarded, say.
    for mb in (mb for rank in plan.ranks for mb in rank if mb):
        rows = [datums[i].input_ids for i in mb]
        forwarded, _ = layout_trees([len(r) for r in rows], prefix_trees(rows))
        assert shared_prefix_layout(rows, pad_token_id=0).num_tokens == tree_tokens([len(r) for r in rows], forwarded)
    computed = sum(
        shared_prefix_layout([datums[i].input_ids for i in mb], pad_token_id=0).num_tokens
        for rank in plan.ranks
        for mb in rank
        if mb
    )
    assert computed < sum(lengths)


def test_a_packer_that_does_not_declare_prefix_trees_is_called_as_before(isolated_registries):
    # The old contract is the fallback: a third-party packer gets lengths alone, and sharing is found within each of
    # its micro-batches (here one per group, by its own rule).
    from trl_plugins.registry import PACKERS

    calls = []

    def by_fours(lengths, *, max_items, max_padded_tokens, world_size=1):
        from trl_plugins.types import PackPlan

        calls.append(len(lengths))
        return PackPlan(ranks=[[list(range(k, min(k + 4, len(lengths)))) for k in range(0, len(lengths), 4)]])

    PACKERS.register("test_by_fours")(by_fours)
    assert not supports_prefix_trees("test_by_fours")
    datums = group_datums(groups=3, size=4, extra=0)
    trees = prefix_trees([d.input_ids for d in datums])
    plan = pack_for_ranks(
        [d.num_tokens for d in datums],
        strategy="test_by_fours",
        max_items=8,
        max_padded_tokens=10_000,
        world_size=1,
        prefix_trees=trees,
    )
    assert calls == [12] and plan.ranks[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    mb = collate(datums, plan.ranks[0][0], pad_token_id=0, shared_prefix=True)
    assert mb.num_forwarded_tokens < sum(datums[i].num_tokens for i in plan.ranks[0][0])


def test_the_packer_contract_checks_what_supports_prefix_trees_promises(isolated_registries):
    # A packer that declares the capability but packs by length alone splits trees that fit one micro-batch: the
    # public contract check says so. The built-ins pass it (tests/test_contracts.py runs it on every packer).
    from trl_plugins.contracts import ContractError, check_packer_contract

    def by_length(lengths, *, max_items, max_padded_tokens, world_size=1, prefix_trees=None):
        return pack_for_ranks(
            lengths, strategy="ffd", max_items=max_items, max_padded_tokens=max_padded_tokens, world_size=world_size
        )

    by_length.supports_prefix_trees = True
    with pytest.raises(ContractError, match="fits one micro-batch but was split|shared-prefix area"):
        check_packer_contract(by_length)
    for name in ("ffd", "optimal", "balanced"):
        check_packer_contract(name)


def test_bad_trees_are_refused_naming_the_problem():
    from trl_plugins.packing import PackingError

    with pytest.raises(PackingError, match="partition"):
        pack_for_ranks(
            [3, 4], strategy="ffd", max_items=4, max_padded_tokens=100, world_size=1, prefix_trees=[PrefixTree(0, (0,))]
        )
    with pytest.raises(PackingError, match="longer than one of its members"):
        pack_for_ranks(
            [3, 4],
            strategy="ffd",
            max_items=4,
            max_padded_tokens=100,
            world_size=1,
            prefix_trees=[PrefixTree(4, (0, 1))],
        )
    with pytest.raises(PackingError, match="two layouts"):
        pack_for_ranks(
            [3, 4],
            strategy="ffd",
            max_items=4,
            max_padded_tokens=100,
            world_size=1,
            padding_free=True,
            prefix_trees=[PrefixTree(0, (0,)), PrefixTree(0, (1,))],
        )


# -- the setting ---------------------------------------------------------------------------------------------------


def _grpo(tmp_path, **kwargs):
    from support.trainer import tiny_config

    return tiny_config(tmp_path, **kwargs)


def test_auto_turns_on_where_it_pays_and_explicit_values_are_honoured_or_refused(tmp_path):
    model = small_model("qwen2_sdpa")
    assert _grpo(tmp_path).resolve_shared_prefix(model) is True  # sdpa, padded, non-reentrant checkpointing
    eager = small_model("qwen2_eager")
    assert _grpo(tmp_path).resolve_shared_prefix(eager) is True
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    assert _grpo(tmp_path).resolve_shared_prefix(flash) is False
    free = _grpo(tmp_path, padding_free=True)
    assert free.resolve_shared_prefix(model) is False
    reentrant = _grpo(tmp_path, activation_checkpointing_kwargs={"use_reentrant": True})
    assert reentrant.resolve_shared_prefix(model) is False
    assert _grpo(tmp_path, shared_prefix=False).resolve_shared_prefix(model) is False
    with pytest.raises(ValueError, match="two layouts"):
        _grpo(tmp_path, shared_prefix=True, padding_free=True)
    with pytest.raises(ValueError, match="use_reentrant"):
        _grpo(tmp_path, shared_prefix=True, activation_checkpointing_kwargs={"use_reentrant": True})
    # shared_prefix=True on flash-attention: padding_free's auto gives way (both on would fail at the first collate).
    asked = _grpo(tmp_path, shared_prefix=True)
    assert asked.resolve_padding_free(flash) is False and asked.resolve_shared_prefix(flash) is True
    assert _grpo(tmp_path).resolve_padding_free(flash) is True
    later = _grpo(tmp_path, shared_prefix=True)
    later.gradient_checkpointing_kwargs = {"use_reentrant": True}  # what TRL does for PEFT under ZeRO-3
    with pytest.raises(ValueError, match="use_reentrant"):
        later.resolve_shared_prefix(model)


def test_every_micro_batch_runs_both_forwards_dummies_included():
    # Under ZeRO-3 a forward is a collective: a rank with a dummy micro-batch must run as many as one with a group.
    from trl_plugins.datum import dummy_micro_batch

    calls = []
    model = small_model("qwen2_sdpa")
    model.register_forward_hook(lambda *a: calls.append(1))
    for mb in (
        dummy_micro_batch(pad_token_id=0, shared_prefix=True),
        collate(group_datums(), [0, 1, 2], pad_token_id=0, shared_prefix=True),
        collate(group_datums(), [0, 3, 9], pad_token_id=0, shared_prefix=True),
    ):  # nothing shared
        calls.clear()
        shared_prefix_outputs(model, mb.shared_prefix, "cpu")
        assert len(calls) == 2
    with torch.no_grad():
        lp, _ = micro_batch_logprobs(model, dummy_micro_batch(pad_token_id=0, shared_prefix=True), "cpu")
    assert torch.isfinite(lp).all()


def test_auto_turns_the_layout_off_where_the_models_forward_cannot_run_it_and_an_explicit_true_is_refused(caplog):
    # transformers 5.17's Qwen2 (vLLM's interpreter) keeps no key/value states of a passed prefix: auto, chosen from the
    # attention implementation, falls back to the padded layout with one warning; shared_prefix=True stays an error.
    import types

    from trl_plugins.trainers.micro_batches import ensure_layout_checked

    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, device="cpu")
    auto = types.SimpleNamespace(padding_free=False, shared_prefix=True, _shared_prefix_auto=True)
    model = _DropsKwarg(small_model("qwen2_sdpa"), "cache")
    with caplog.at_level("WARNING", logger="trl_plugins.trainers.micro_batches"):
        ensure_layout_checked(accelerator, model, auto)
    assert auto.shared_prefix is False
    assert "shared_prefix (auto) is off" in caplog.text and "kept no key/value states" in caplog.text
    explicit = types.SimpleNamespace(padding_free=False, shared_prefix=True)
    with pytest.raises(SharedPrefixUnsupported, match="kept no key/value states"):
        ensure_layout_checked(accelerator, _DropsKwarg(small_model("qwen2_sdpa"), "cache"), explicit)
