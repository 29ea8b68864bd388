"""Packing benchmark: micro-batches, padding overhead, rank imbalance and time per call.

    python benchmarks/packing.py [--world-size 4] [--sizes 100 1000 10000]

For three length distributions (long-tailed multi-turn-like, bimodal, uniform) it compares our
packers with fixed-size batching as TRL's GRPOTrainer does it: micro-batches of
``per_device_train_batch_size`` rows, each padded to the longest row of the whole batch.

Columns:
    mb/rank     micro-batches every rank runs (forward/backward passes per step)
    pad/sum     total padded area / sum of lengths (1.00 = no padding)
    imbalance   slowest rank's padded area / mean rank area (1.00 = perfectly balanced)
    slowest/LB  slowest rank's padded area / lower bound max(sum/world, longest) (1.00 = optimal)
    ms/call     wall time of one packing call (best of 3)
"""

from __future__ import annotations

import argparse
import math
import random
import time

from trl_plugins.packing import pack_for_ranks

MAX_CONTEXT = 8192


def long_tailed(rng: random.Random, n: int) -> list[int]:
    # Multi-turn agent trajectories: most finish in one or two turns, a few run many turns and long.
    out = []
    for _ in range(n):
        turns = min(1 + int(rng.expovariate(0.6)), 12)
        tokens = 300 + sum(int(rng.lognormvariate(5.3, 0.7)) for _ in range(turns))
        out.append(min(tokens, MAX_CONTEXT))
    return out


def bimodal(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(200, 800) if rng.random() < 0.7 else rng.randint(5000, MAX_CONTEXT) for _ in range(n)]


def uniform(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(64, MAX_CONTEXT) for _ in range(n)]


def fixed_size_like_trl(lengths: list[int], world_size: int, batch_size: int) -> tuple[int, int, list[int]]:
    # Each rank holds ~n/world rows; every micro-batch is padded to the longest row of the batch.
    longest = max(lengths)
    rows = [len(lengths[r::world_size]) for r in range(world_size)]
    mbs = max(math.ceil(n / batch_size) for n in rows)
    areas = [n * longest for n in rows]
    return mbs, sum(areas), areas


def timed(fn, repeats: int = 3):
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--max-items", type=int, default=32)
    ap.add_argument("--max-padded-tokens", type=int, default=64_000)
    ap.add_argument("--trl-batch-size", type=int, default=8, help="per_device_train_batch_size for the TRL column")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    print(
        f"world_size={args.world_size} max_items={args.max_items} max_padded_tokens={args.max_padded_tokens} "
        f"trl_batch_size={args.trl_batch_size}"
    )
    header = f"{'distribution':<12} {'n':>6} {'packer':<14} {'mb/rank':>8} {'pad/sum':>8} {'imbalance':>10} {'slowest/LB':>11} {'ms/call':>9}"
    print(header)
    print("-" * len(header))
    for dist in (long_tailed, bimodal, uniform):
        for n in args.sizes:
            lengths = dist(random.Random(args.seed), n)
            total = sum(lengths)
            lower = max(total / args.world_size, max(lengths))
            rows = []
            (mbs, area, areas), secs = timed(lambda: fixed_size_like_trl(lengths, args.world_size, args.trl_batch_size))
            rows.append(("trl-fixed", mbs, area, areas, secs))
            for strategy in ("ffd", "optimal", "balanced"):
                plan, secs = timed(
                    lambda: pack_for_ranks(
                        lengths,
                        strategy=strategy,
                        max_items=args.max_items,
                        max_padded_tokens=args.max_padded_tokens,
                        world_size=args.world_size,
                    )
                )
                areas = plan.rank_padded_area(lengths)
                rows.append((strategy, plan.num_micro_batches, sum(areas), areas, secs))
            for name, mbs, area, areas, secs in rows:
                mean = sum(areas) / len(areas)
                print(
                    f"{dist.__name__:<12} {n:>6} {name:<14} {mbs:>8} {area / total:>8.2f} "
                    f"{max(areas) / mean:>10.3f} {max(areas) / lower:>11.3f} {secs * 1e3:>9.2f}"
                )
        print()


if __name__ == "__main__":
    main()
