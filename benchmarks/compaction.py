"""A harness that compacts its history: what the update forwards when its segments share their system-and-tools
prefix's forward, against forwarding every segment whole, beside the analytic ratio for the shape.

    python benchmarks/compaction.py [--system 2000] [--turn 200] [--summary 300] [--turns 12] [--every 3]
                                    [--trajectories 1 4]

The synthetic agent (``trl_plugins.contracts.make_compacting_trajectory``): a prefix of S tokens (system prompt and
tools), turns of T tokens (a reply of T/4, a tool output of 3T/4, none in a segment's first turn), and every
``--every`` turns the history after the prefix replaced by a summary of U tokens (a new segment). Each segment is a
datum with the trajectory's one advantage. One PPO update step (tiny Qwen2, fp32, CPU) of the trajectories' datums in
one micro-batch, in the padded layout and in the shared-prefix one: the real tokens each forwards, its wall time, and
the relative gap between the two updates' parameter changes. The analytic ratio is
``(sum of datum lengths - (segments - 1) S) / sum of datum lengths`` (the prefix forwarded once for all segments).
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from types import SimpleNamespace


def settings(shared: bool, max_tokens: int) -> SimpleNamespace:
    from trl_plugins.run.settings import Features, LongTrajectories

    return SimpleNamespace(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=64,
        max_padded_tokens_per_micro_batch=max_tokens,
        rebalance_ranks=False,
        norm_length=None,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=True,
        padding_free=False,
        shared_prefix=shared,
        features=Features(mismatch_correction=None, long_trajectories=LongTrajectories()),
    )


def measure(args: argparse.Namespace, n: int) -> dict:
    import torch
    from accelerate import Accelerator

    from trl_plugins.algos import PPOClipLoss
    from trl_plugins.contracts import make_compacting_trajectory
    from trl_plugins.datum import build_datums
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.trainers.update import policy_update

    rng = random.Random(0)
    system = [rng.randrange(3, 400) for _ in range(args.system)]
    shape = dict(
        question_len=args.question,
        turns=args.turns,
        every=args.every,
        summary_len=args.summary,
        completion_len=args.turn // 4,
        observation_len=args.turn - args.turn // 4,
        vocab=400,
    )
    trajectories = [
        make_compacting_trajectory(rng, system=system, group_id=g, advantage=(-1.0) ** g, **shape) for g in range(n)
    ]
    datums = [d for t in trajectories for d in build_datums(t, advantage=t.advantage)]
    total = sum(d.num_tokens for d in datums)
    torch.manual_seed(0)
    base = build_tiny_model(build_tokenizer(), seed=0).float()
    before = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    out: dict = {"trajectories": n, "segments": len(datums), "datum_tokens": total}
    moved = {}
    warm = Accelerator(cpu=True)  # the first update's one-off costs (layout check, kernels), outside the timings
    spare = copy.deepcopy(base)
    model, optimizer = warm.prepare(spare, torch.optim.SGD(spare.parameters(), lr=0.0))
    for shared in (False, True):
        policy_update(
            warm,
            model,
            optimizer,
            copy.deepcopy(datums[:2]),
            PPOClipLoss(),
            settings(shared, 10 * total),
            pad_token_id=0,
        )
    for shared in (False, True):
        accelerator = Accelerator(cpu=True)
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        start = time.perf_counter()
        result = policy_update(
            accelerator,
            model,
            optimizer,
            copy.deepcopy(datums),
            PPOClipLoss(),
            settings(shared, 10 * total),
            pad_token_id=0,
        )
        out[f"{'shared' if shared else 'padded'}_s"] = time.perf_counter() - start
        out[f"{'shared' if shared else 'padded'}_tokens"] = result.num_computed_tokens
        moved[shared] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before
    out["measured_ratio"] = out["shared_tokens"] / out["padded_tokens"]
    out["analytic_ratio"] = (total - (len(datums) - 1) * args.system) / total
    out["time_ratio"] = out["shared_s"] / out["padded_s"]
    out["update_rel_gap"] = float((moved[True] - moved[False]).norm() / moved[False].norm())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system", type=int, default=2000, help="S: the system-and-tools prefix's tokens")
    parser.add_argument("--turn", type=int, default=200, help="T: a turn's tokens (a reply and its tool output)")
    parser.add_argument("--summary", type=int, default=300, help="U: the summary's tokens")
    parser.add_argument("--question", type=int, default=100, help="the question's tokens (the first segment's)")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="turns between compactions")
    parser.add_argument("--trajectories", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    print(
        f"S={args.system} T={args.turn} U={args.summary} question={args.question} turns={args.turns} "
        f"compaction every {args.every} turns; one PPO update step, tiny Qwen2, fp32, CPU"
    )
    print(
        f"{'trajectories':>12s} {'segments':>8s} {'padded tok':>10s} {'shared tok':>10s} {'ratio':>6s} "
        f"{'analytic':>8s} {'padded s':>8s} {'shared s':>8s} {'time':>6s} {'update gap':>10s}"
    )
    for n in args.trajectories:
        r = measure(args, n)
        print(
            f"{r['trajectories']:>12d} {r['segments']:>8d} {r['padded_tokens']:>10d} {r['shared_tokens']:>10d} "
            f"{r['measured_ratio']:>6.3f} {r['analytic_ratio']:>8.3f} {r['padded_s']:>8.2f} {r['shared_s']:>8.2f} "
            f"{r['time_ratio']:>6.2f} {r['update_rel_gap']:>10.1e}"
        )


if __name__ == "__main__":
    main()
