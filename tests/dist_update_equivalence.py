"""Launched by tests/test_distributed.py under `accelerate launch` (2 processes, DDP or ZeRO-3 on CPU; 4 for two
sequence-parallel groups).

Rank r holds its own datums (3 on rank 0, 7 on rank 1, 1-4 turns each; 3, 1, 4, 2 on four ranks, so the ranks pack different
numbers of micro-batches; pairs share their prompt, as a group's trajectories do, one pair across the ranks). One `policy_update` with SGD must move the parameters exactly as one
plain-torch step on the one-batch loss over all 10 datums does. Rank 0 writes the relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import make_trajectory, tiny_qwen2  # noqa: E402
from support.settings import update_settings  # noqa: E402
from trl_plugins.algos import PPOClipLoss, aggregate, local_denominators  # noqa: E402
from trl_plugins.datum import build_datum, collate  # noqa: E402
from trl_plugins.modeling import token_logprobs  # noqa: E402
from trl_plugins.trainers.update import policy_update  # noqa: E402
from trl_plugins.types import StopReason  # noqa: E402

LR = 0.5


def all_datums(world: int) -> list[list]:
    rng = random.Random(7)
    counts = {1: [10], 2: [3, 7], 4: [3, 1, 4, 2]}[world]
    out, k = [], 0
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(8, 30))] for _ in range(sum(counts))]
    for c in counts:
        part = []
        for _ in range(c):
            # Every third one cut by the budget: its datum bootstraps (the critic's value pass forwards one token more).
            stop = StopReason.TOKEN_BUDGET if k % 3 == 0 else StopReason.FINAL_ANSWER
            traj = make_trajectory(
                rng,
                num_turns=rng.randint(1, 4),
                group_id=k // 2,
                sample_index=k % 2,
                stop_reason=stop,
                prompt=prompts[k // 2],
            )
            part.append(build_datum(traj, trajectory_index=k))
            k += 1
        out.append(part)
    return out


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """The test's reference policy: the starting model with fixed noise on every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


def critic_with_a_head() -> torch.nn.Module:
    """The test's critic: the tiny policy's backbone and a fixed random value head (so values vary)."""
    from trl_plugins.trainers.critic import build_critic

    critic = build_critic(tiny_qwen2())
    with torch.no_grad():
        critic.score.weight.copy_(
            0.3 * torch.randn(critic.score.weight.shape, generator=torch.Generator().manual_seed(3))
        )
    return critic


def noisy_old_values_and_returns(d) -> tuple[list[float], list[float]]:
    """Old values moved off the current ones (so the value clip binds on some tokens) and random returns."""
    gen = torch.Generator().manual_seed(d.trajectory_index)
    noise, returns = 0.1 * torch.randn(d.num_tokens, generator=gen), torch.randn(d.num_tokens, generator=gen)
    return [v + float(e) for v, e in zip(d.old_values, noise)], [
        float(x) if m else 0.0 for x, m in zip(returns, d.action_mask)
    ]


def critic_check(args, accelerator, parts, everything, deepspeed: bool, critics: list) -> None:
    """value_update on the ranks' datums == one plain-torch SGD step of the one-batch value loss."""
    from accelerate.utils import gather_object

    from trl_plugins.algos import clipped_value_loss
    from trl_plugins.trainers.critic import (
        critic_state_dict,
        critic_values,
        prepare_critic,
        rollout_values,
        value_update,
    )

    world, rank = accelerator.num_processes, accelerator.process_index
    config = update_settings(
        aggregation="token_mean",
        packer="ffd",
        max_items_per_micro_batch=2,
        max_padded_tokens_per_micro_batch=400,
        rebalance_ranks=False,
        norm_length=None,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=False,
        padding_free=False,
        shared_prefix=args.shared_prefix,
    )
    trained, reference, initial = critics
    critic, optimizer = prepare_critic(accelerator, trained, learning_rate=LR, optimizer_cls=torch.optim.SGD)
    mine = parts[rank]
    after = rollout_values(accelerator, critic, mine, config, pad_token_id=0)  # each rank, different micro-batch counts
    gathered = [x for part in gather_object([[(d.old_values, a) for d, a in zip(mine, after)]]) for x in part]
    for d in mine:
        d.old_values, d.returns = noisy_old_values_and_returns(d)
    result = value_update(
        accelerator, critic, optimizer, mine, config, vf_clip=0.05, vf_coef=0.7, max_grad_norm=None, pad_token_id=0
    )
    state = critic_state_dict(accelerator, critic)
    if accelerator.is_main_process:
        for d, (old, _) in zip(everything, gathered):
            d.old_values, d.returns = old, [0.0] * d.num_tokens
        mb = collate(everything, list(range(len(everything))), pad_token_id=0)
        with torch.no_grad():
            direct = critic_values(reference, mb.input_ids, mb.attention_mask)
        values_err = float(((mb.old_values - direct) * mb.attention_mask).abs().max())
        for d in everything:
            d.old_values, d.returns = noisy_old_values_and_returns(d)
        mb = collate(everything, list(range(len(everything))), pad_token_id=0)
        # The value after the last token: the critic on the whole sequence, read at its end.
        d0, (_, a0) = everything[0], gathered[0]
        assert d0.bootstrap_mask == 1 and all(
            a == 0.0 for d, (_, a) in zip(everything, gathered) if not d.bootstrap_mask
        )
        full = torch.tensor([d0.input_ids + d0.target_ids[-1:]])
        with torch.no_grad():
            after_err = abs(float(critic_values(reference, full, torch.ones_like(full))[0, -1]) - a0)
        n_tok, n_seq = local_denominators(mb.action_mask)
        values = critic_values(reference, mb.input_ids, mb.attention_mask)
        out = clipped_value_loss(values, mb.old_values, mb.returns, mb.action_mask, clip_range=0.05)
        loss = 0.7 * aggregate(out.per_token_loss, mb.action_mask, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
        loss.backward()
        torch.optim.SGD(reference.parameters(), lr=LR).step()
        before = initial.state_dict()
        num = den = 0.0
        for name, ref_param in reference.state_dict().items():
            num += float((state[name].float() - ref_param).pow(2).sum())
            den += float((ref_param - before[name]).pow(2).sum())
        report = {
            "world": world,
            "deepspeed": deepspeed,
            "rel_err": (num / max(den, 1e-30)) ** 0.5,
            "update_norm": den**0.5,
            "loss": result.loss,
            "ref_loss": float(loss),
            "values_err": values_err,
            "after_err": after_err,
            "clip_frac": result.clip_frac,
            "micro_batches": result.num_micro_batches,
        }
        Path(args.out).write_text(json.dumps(report))
        print(json.dumps(report))
    accelerator.wait_for_everyone()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rebalance", action="store_true")
    ap.add_argument("--aggregation", default="token_mean")
    ap.add_argument(
        "--aggregations",
        default=None,
        help="comma-separated aggregation modes: one update each, chained on the same engines (the report "
        "lists them under 'steps')",
    )
    ap.add_argument(
        "--critic",
        action="store_true",
        help="the critic's value_update (SGD) instead of the policy's: rollout values from the prepared "
        "critic on each rank, random returns, clipped value loss",
    )
    ap.add_argument(
        "--kl",
        action="store_true",
        help="reference KL (k3) + entropy bonus in the loss, reference log-probs from a prepared reference "
        "model; every third datum has advantage 0 and drop_zero_advantage is on",
    )
    ap.add_argument(
        "--mismatch",
        default=None,
        help="sampler/trainer mismatch correction in this ImportanceSamplingMode (bounds [0.8, 1.25] per token, "
        "[1/3, 3] per sequence, so that some but not all bind): each rank "
        "takes pi_old of its own datums with old_logprobs(), the noisy behaviour log-probs are the sampler's",
    )
    ap.add_argument(
        "--shared-prefix",
        action="store_true",
        help="the shared-prefix layout on the ranks (each pair's prompt forwarded once per micro-batch); the "
        "one-process reference stays the padded layout",
    )
    ap.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="sequence_parallel_size=2: both ranks one group, each datum's tokens split over them (sdpa "
        "attention through Ulysses) in the update; the one-process reference stays whole",
    )
    ap.add_argument(
        "--checkpointing",
        action="store_true",
        help="non-reentrant activation checkpointing on the trained policy (the backward recomputes each "
        "layer, Ulysses' all-to-alls included)",
    )
    ap.add_argument(
        "--chunked-head",
        action="store_true",
        help="ZeRO-3 with every parameter partitioned: the chunked head's log-probs, entropies and "
        "gradients (tied, untied, and a LoRA adapter on lm_head; one chunk and several) against one "
        "process's full logits, and the head's gathers per forward and backward counted",
    )
    return ap.parse_args(argv)


CHUNKED_HEAD_PASSES = {
    "chunks-of-7": (7, False),
    "one-chunk": (10_000, False),
    "shared-prefix-chunks-of-7": (7, True),
    "full": (None, False),
}
"""The chunked-head case's passes, ``(chunk size, shared-prefix layout)``: the chunked head in chunks of 7 positions,
in one chunk, in chunks of 7 in the shared-prefix layout (two forwards), and the full logits (the model's lm_head)."""


def tiny_tied_qwen2() -> torch.nn.Module:
    """tiny_qwen2 with its output projection tied to the input embedding (as the embedded default's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=200,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
    )
    model.config._attn_implementation = "eager"
    return model.eval()


def tiny_lora_head_qwen2() -> torch.nn.Module:
    """tiny_qwen2 with a LoRA adapter on lm_head (PEFT's wrapper: a head with submodules), its lora_B non-zero."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2()
    torch.manual_seed(1)  # the adapter's init: the same for the reference and the ranks
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False))


HEAD_MODELS = {"untied": tiny_qwen2, "tied": tiny_tied_qwen2, "lora-head": tiny_lora_head_qwen2}
"""The chunked-head case's models, by the report's key."""


def count_gathers(module: torch.nn.Module, target: torch.nn.Parameter, phase: list[str]):
    """Counts, per ``phase[0]``, the ZeRO-3 all-gathers that fetch ``target`` (each parameter's ``all_gather`` and
    ``all_gather_coalesced``, the two entries DeepSpeed's hooks and ``GatheredParameters`` go through)."""
    import collections

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    counts = collections.Counter()
    for param in module.parameters():
        for name in ("all_gather", "all_gather_coalesced"):

            def wrapped(*a, _original=getattr(param, name), _name=name, _self=param, **k):
                params = k.get("param_list") if _name == "all_gather" else (a[0] if a else k.get("params"))
                if any(q is target and q.ds_status == ZeroParamStatus.NOT_AVAILABLE for q in (params or [_self])):
                    counts[phase[0]] += 1
                return _original(*a, **k)

            setattr(param, name, wrapped)
    return counts


def chunked_head_check(args, accelerator) -> None:
    """Both ranks take the same micro-batch, so the ranks' averaged gradient is one process's."""
    from deepspeed.utils import safe_get_full_grad

    from trl_plugins.modeling import full_logits_logprobs, micro_batch_logprobs

    datums = [d for p in all_datums(1) for d in p][:4]
    mb = collate(datums, list(range(len(datums))), pad_token_id=0)
    shared_mb = collate(datums, list(range(len(datums))), pad_token_id=0, shared_prefix=True)
    assert shared_mb.shared_prefix is not None
    act = mb.action_mask.bool()
    weights = torch.linspace(-1, 1, act.numel()).reshape(act.shape)
    zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
    report = {"n_action": int(act.sum())}
    for kind, build in HEAD_MODELS.items():
        reference, model = build(), build()
        logits = reference(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        ref_lp, ref_ent = full_logits_logprobs(logits, mb.target_ids, 0.7, True)
        ((ref_lp * weights)[act].sum() + 0.1 * ref_ent[act].sum()).backward()
        previous = zero.get("stage3_param_persistence_threshold")
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, the head's too
        try:
            model, _ = accelerator.prepare(
                model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
            )
        finally:
            if previous is None:
                del zero["stage3_param_persistence_threshold"]
            else:
                zero["stage3_param_persistence_threshold"] = previous
        inner = model.module.get_base_model() if kind == "lora-head" else model.module
        # The head's weight (the adapter's base layer's), and the parameter whose gradient is checked for size: the
        # head's, or the adapter's lora_A where only the adapter trains.
        head = inner.lm_head.base_layer.weight if kind == "lora-head" else inner.lm_head.weight
        trained = inner.lm_head.lora_A["default"].weight if kind == "lora-head" else head
        assert hasattr(head, "ds_id") and head.ds_persist is False
        assert (head is inner.model.embed_tokens.weight) == (kind == "tied")
        head_name = next(n for n, p in model.module.named_parameters() if p is trained)  # tied: the embedding's name
        phase = ["forward"]
        counts = count_gathers(model.module, head, phase)
        adapter_counts = count_gathers(model.module, trained, phase) if trained is not head else counts
        out = {}
        for mode, (size, shared) in CHUNKED_HEAD_PASSES.items():
            counts.clear()
            adapter_counts.clear()
            phase[0] = "forward"
            if size is None:
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
                lp, ent = full_logits_logprobs(logits, mb.target_ids, 0.7, True)
            else:
                lp, ent = micro_batch_logprobs(
                    model,
                    shared_mb if shared else mb,
                    accelerator.device,
                    temperature=0.7,
                    with_entropy=True,
                    needed=mb.action_mask,
                    chunk_size=size,
                )
            phase[0] = "backward"
            model.backward((lp * weights)[act].sum() + 0.1 * ent[act].sum())  # the engine's: no optimizer step
            phase[0] = "after"
            grads = {n: safe_get_full_grad(p) for n, p in model.module.named_parameters() if p.requires_grad}
            model.optimizer.zero_grad()
            ref = dict(reference.named_parameters())
            out[mode] = {
                "forward_gathers": counts["forward"],
                "backward_gathers": counts["backward"],
                "adapter_forward_gathers": adapter_counts["forward"],
                "adapter_backward_gathers": adapter_counts["backward"],
                "lp_err": float((lp[act] - ref_lp[act]).norm() / ref_lp[act].norm()),
                "ent_err": float((ent[act] - ref_ent[act]).norm() / ref_ent[act].norm()),
                "grad_err": max(float((grads[n] - ref[n].grad).norm() / ref[n].grad.norm()) for n in grads),
                "head_grad_norm": float(grads[head_name].norm()),
            }
        report[kind] = out
        accelerator.free_memory()
    if accelerator.is_main_process:
        report["world"] = accelerator.num_processes
        Path(args.out).write_text(json.dumps(report))
        print(json.dumps(report))
    accelerator.wait_for_everyone()


def main() -> None:
    """One case (the arguments above), or ``--cases FILE``: a JSON list of argument lists, run one after the other
    on one Accelerator in this launch (its start-up is paid once). A case that fails writes
    ``<its --out>.error.rank<R>`` and ends the launch."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cases = json.loads(Path(sys.argv[2]).read_text()) if sys.argv[1:2] == ["--cases"] else [sys.argv[1:]]
    cases = [parse(argv) for argv in cases]
    import gc  # what the launch imported lives as long as it: out of the collector's reach (accelerate's free_memory)

    gc.collect()
    gc.freeze()
    # Built before the Accelerator: once DeepSpeed ZeRO-3 is configured, transformers builds models partitioned.
    critics = {id(a): [critic_with_a_head() for _ in range(3)] for a in cases if a.critic}
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:
        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        # The shared JSON says "auto" for the HF Trainer; a raw loop has no dataloader to fill it in.
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
        ds.pop("train_batch_size", None)
    else:
        accelerator = Accelerator(cpu=True)
    for args in cases:
        try:
            run_case(args, accelerator, deepspeed, critics.get(id(args), []))
            # Release what the case prepared: accelerate steps the first DeepSpeed engine it wrapped otherwise.
            accelerator.free_memory()
        except BaseException:  # noqa: BLE001 - reported to the test, then the launch ends
            import traceback

            Path(f"{args.out}.error.rank{accelerator.process_index}").write_text(traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # avoids a rare gloo-thread abort at interpreter exit (see ENVIRONMENT notes)


def run_case(args: argparse.Namespace, accelerator, deepspeed: bool, critics: list) -> None:
    """One update (or, with ``--critic``, one critic update) on the ranks against a one-process plain-torch step;
    rank 0 writes the report to ``args.out``."""
    if args.chunked_head:
        chunked_head_check(args, accelerator)
        return
    world = accelerator.num_processes
    parts = all_datums(world)
    everything = [d for p in parts for d in p]
    # Behaviour log-probs near the model's own, so the clip is active on some tokens.
    reference = tiny_qwen2()
    if args.sequence_parallel:
        reference.config._attn_implementation = "sdpa"  # Ulysses refuses eager (tests/test_sequence_parallel.py)
    with torch.no_grad():
        mb = collate(everything, list(range(len(everything))), pad_token_id=0)
        lp = token_logprobs(reference, mb.input_ids, mb.attention_mask, mb.target_ids)
    gen = torch.Generator().manual_seed(1)
    for row, d in enumerate(everything):
        noisy = lp[row, : d.num_tokens] + 0.3 * torch.randn(d.num_tokens, generator=gen)
        d.behaviour_logprobs = [float(x) if m else 0.0 for x, m in zip(noisy, d.action_mask)]

    if args.kl:
        for k, d in enumerate(everything):
            if k % 3 == 0:
                d.advantages = [0.0] * d.num_tokens
    if args.critic:
        critic_check(args, accelerator, parts, everything, deepspeed, critics)
        return
    loss_fn = PPOClipLoss(kl_coef=0.3, entropy_coef=0.05) if args.kl else PPOClipLoss()
    model = tiny_qwen2()
    if args.sequence_parallel:
        model.config._attn_implementation = "sdpa"
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_model = None
    if args.kl:
        from trl.models.utils import prepare_deepspeed

        ref_model = perturbed(tiny_qwen2())
        ref_model = (
            prepare_deepspeed(ref_model, accelerator)
            if deepspeed
            else accelerator.prepare_model(ref_model, evaluation_mode=True)
        )
    # --aggregations chains several updates on the same engines: each is checked against one plain-torch step from
    # the reference's weights after the previous one (which matched the ranks' to the tolerance).
    aggregations = args.aggregations.split(",") if args.aggregations else [args.aggregation]
    reports = [
        one_update(
            args,
            accelerator,
            deepspeed,
            parts,
            everything,
            model,
            optimizer,
            ref_model,
            reference,
            loss_fn,
            aggregation,
        )
        for aggregation in aggregations
    ]
    if accelerator.is_main_process:
        report = reports[0] if not args.aggregations else {**reports[0], "steps": reports}
        Path(args.out).write_text(json.dumps(report))
        print(json.dumps(report))
    accelerator.wait_for_everyone()


def one_update(
    args,
    accelerator,
    deepspeed: bool,
    parts,
    everything,
    model,
    optimizer,
    ref_model,
    reference,
    loss_fn,
    aggregation: str,
) -> dict | None:
    """One update of ``model`` on the ranks' datums with ``aggregation`` against one plain-torch SGD step of
    ``reference`` (rank 0, which it steps too); rank 0 returns the report."""
    world, rank = accelerator.num_processes, accelerator.process_index
    # The fields of MultiTurnGRPOConfig that policy_update reads, stated for this test.
    bounds = (0.8, 1.25) if (args.mismatch or "").startswith("token") else (1 / 3, 3.0)
    config = update_settings(
        aggregation=aggregation,
        packer="balanced" if args.rebalance else "ffd",
        max_items_per_micro_batch=2,
        max_padded_tokens_per_micro_batch=400,
        rebalance_ranks=args.rebalance,
        norm_length=64,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=args.kl,
        vllm_importance_sampling_mode=args.mismatch,
        vllm_importance_sampling_clip_min=bounds[0],
        vllm_importance_sampling_clip_max=bounds[1],
        padding_free=False,
        shared_prefix=args.shared_prefix,
        sequence_parallel_size=2 if args.sequence_parallel else 1,
    )
    sp = None
    if args.sequence_parallel:
        from trl_plugins.trainers.sequence_parallel import setup_sequence_parallel

        sp = setup_sequence_parallel(accelerator, accelerator.unwrap_model(model), config, policy_loss=loss_fn)
    if args.kl:
        from trl_plugins.trainers.update import reference_logprobs

        # Each rank scores its own datums (ranks run different numbers of micro-batches: dummies under ZeRO-3).
        reference_logprobs(accelerator, ref_model, parts[rank], config, pad_token_id=0)
    if args.mismatch:
        from trl_plugins.trainers.update import old_logprobs

        # Each rank its own datums, before the update (ranks run different numbers of forwards: dummies).
        old_logprobs(accelerator, model, parts[rank], config, pad_token_id=0)
    start = None
    if args.aggregations:  # the ranks' weights before this update (a collective under ZeRO-3; copies, not views)
        start = {k: v.detach().clone() for k, v in (accelerator.get_state_dict(model) or {}).items()}
    result = policy_update(
        accelerator, model, optimizer, parts[rank], loss_fn, config, pad_token_id=0, sequence_parallel=sp
    )
    state = accelerator.get_state_dict(model)
    if start is None:
        start = (
            {k: v.detach().clone() for k, v in reference.state_dict().items()} if accelerator.is_main_process else None
        )
    if args.mismatch:
        from accelerate.utils import gather_object

        gathered_old = [lp for part in gather_object([[d.old_logprobs for d in parts[rank]]]) for lp in part]
    if args.kl:
        from accelerate.utils import gather_object

        gathered = [lp for part in gather_object([[d.ref_logprobs for d in parts[rank]]]) for lp in part]

    if accelerator.is_main_process:
        # One plain-torch step on the one-batch loss over every datum.
        from trl_plugins.modeling import token_logprobs_and_entropy
        from trl_plugins.types import PolicyLossInput

        ref_lp, ref_err = None, 0.0
        for d in everything:  # rank 0's own datums carry its old log-probs
            d.old_logprobs = None
        if args.kl:
            for d in everything:
                d.ref_logprobs = None
            with torch.no_grad():
                full = collate(everything, list(range(len(everything))), pad_token_id=0)
                ref_lp = token_logprobs(perturbed(tiny_qwen2()), full.input_ids, full.attention_mask, full.target_ids)
            # The reference log-probs the ranks computed (with dummies, under ZeRO-3 sharded) are the one-process ones.
            for d, lp in zip(everything, gathered):
                d.ref_logprobs = lp
            ranks_lp = collate(everything, list(range(len(everything))), pad_token_id=0).ref_logprobs
            ref_err = float(((ranks_lp - ref_lp) * full.action_mask).abs().max())
            for d in everything:
                d.ref_logprobs = None
        mb = collate(everything, list(range(len(everything))), pad_token_id=0)
        n_tok, n_seq = local_denominators(mb.action_mask)
        logp, entropy = token_logprobs_and_entropy(reference, mb.input_ids, mb.attention_mask, mb.target_ids)
        anchor, is_w, old_err = mb.behaviour_logprobs, None, 0.0
        if args.mismatch:
            from trl_plugins.algos import importance_weights

            # pi_old in one process is the starting model itself; the ranks' must match it.
            anchor = logp.detach()
            for d, lp in zip(everything, gathered_old):
                d.old_logprobs = lp
            old_err = float(
                (
                    (collate(everything, list(range(len(everything))), pad_token_id=0).old_logprobs - anchor)
                    * mb.action_mask
                )
                .abs()
                .max()
            )
            for d in everything:
                d.old_logprobs = None
            is_w = importance_weights(
                anchor, mb.behaviour_logprobs, mb.action_mask, args.mismatch, clip_min=bounds[0], clip_max=bounds[1]
            ).weights
        out = loss_fn(
            PolicyLossInput(
                logp, anchor, mb.advantages, mb.action_mask, ref_logprobs=ref_lp, entropy=entropy, is_weights=is_w
            )
        )
        loss = aggregate(
            out.per_token_loss, mb.action_mask, aggregation, num_tokens=n_tok, num_sequences=n_seq, norm_length=64
        )
        loss.backward()
        before = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        ref_opt.step()
        reference.zero_grad(set_to_none=True)
        ref_state = reference.state_dict()
        num = den = moved = 0.0
        for name, ref_param in ref_state.items():
            # The ranks' step against the reference's (from where each stood: a chained update starts from weights
            # that matched to the tolerance, not bit for bit).
            got, ref_step = state[name].float() - start[name].float(), ref_param - before[name]
            num += float((got - ref_step).pow(2).sum())
            den += float(ref_step.pow(2).sum())
            moved += float(got.pow(2).sum())
        return {
            "aggregation": aggregation,
            "world": world,
            "deepspeed": deepspeed,
            "rebalance": args.rebalance,
            # Error of the update relative to the size of the update itself.
            "rel_err": (num / max(den, 1e-30)) ** 0.5,
            "update_norm": den**0.5,
            "moved_norm": moved**0.5,
            "loss": result.loss,
            "ref_loss": float(loss),
            "micro_batches": result.num_micro_batches,
            "dummies": result.num_dummies,
            "loss_tokens": result.num_loss_tokens,
            "forwarded": result.num_forwarded,
            "computed_tokens": result.num_computed_tokens,
            "input_tokens": result.num_input_tokens,
            "ref_err": ref_err,
            "kl_k3": result.reference["kl_k3"] if result.reference else None,
            "entropy": result.entropy,
            "old_err": old_err,
            "mismatch": result.mismatch,
            "padded_tokens": result.num_padded_tokens,
            "sequence_parallel": sp is not None,
            "clip_frac": (result.stats.summary()["clip_frac_low"] + result.stats.summary()["clip_frac_high"])
            if result.stats
            else 0.0,
        }
    return None


if __name__ == "__main__":
    main()
