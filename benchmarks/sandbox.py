"""Sandbox benchmark: call latency cold vs warm, and concurrent vs serial throughput.

    python benchmarks/sandbox.py [--isolation auto] [--calls 40] [--n 8]

Latency (ms, p50/p90/p99/max over ``--calls`` calls; cold runs fewer import-heavy calls):
    trivial       ``print(1)``
    numpy+sympy   code that imports numpy and sympy and uses both (warm servers have them preloaded)

Throughput: ``--n`` calls of a 0.2 s sleep and of a short CPU task, run serially with ``run`` and
concurrently with ``arun`` + ``asyncio.gather``; ``speed-up`` = serial time / concurrent time. The
CPU task cannot scale past the number of cores. The machine is small and noisy, so compare the
ratios printed in the same run rather than absolute numbers across runs. Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from trl_plugins.tools.sandbox import PythonSandbox, detect_isolation

TRIVIAL = "print(1)"
IMPORTS = "import numpy as np\nimport sympy\nprint(int(np.arange(10).sum()), sympy.factorint(1001))"
SLEEP = "import time\ntime.sleep(0.2)"
CPU = "s = 0\nfor i in range(300_000):\n    s += i * i\nprint(s)"


def percentiles(values: list[float]) -> tuple[float, float, float, float]:
    ordered = sorted(values)

    def q(p: float) -> float:
        pos = (len(ordered) - 1) * p
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return q(0.5), q(0.9), q(0.99), ordered[-1]


def latencies(sandbox: PythonSandbox, code: str, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = sandbox.run(code)
        out.append(time.perf_counter() - t0)
        if not result.ok:
            raise RuntimeError(f"benchmark call failed: {result.stderr}")
    return out


def serial_vs_concurrent(sandbox: PythonSandbox, code: str, n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    for _ in range(n):
        sandbox.run(code)
    serial = time.perf_counter() - t0

    async def gather() -> None:
        await asyncio.gather(*[sandbox.arun(code) for _ in range(n)])

    t0 = time.perf_counter()
    asyncio.run(gather())
    return serial, time.perf_counter() - t0


def main(isolation: str, calls: int, n: int) -> None:
    resolved = detect_isolation() if isolation == "auto" else isolation
    print(f"isolation={resolved}  cpus={os.cpu_count()}  calls={calls}  n={n}\n")
    common = dict(timeout_s=30.0, isolation=isolation, max_concurrency=n)
    with PythonSandbox(mode="cold", **common) as cold, PythonSandbox(mode="warm", **common) as warm:
        t0 = time.perf_counter()
        warm.warm_up()
        print(f"warm pool start-up: {n} servers in {time.perf_counter() - t0:.2f} s (numpy, sympy preloaded)\n")
        warm.run(TRIVIAL)
        cold.run(TRIVIAL)

        print(f"{'latency (ms)':<14}{'mode':<6}{'calls':>6}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'cold/warm p50':>15}")
        for name, code, cold_calls in (("trivial", TRIVIAL, calls), ("numpy+sympy", IMPORTS, max(5, calls // 4))):
            rows = {"cold": latencies(cold, code, cold_calls), "warm": latencies(warm, code, calls * 2)}
            p50 = {}
            for mode, values in rows.items():
                stats = [v * 1000 for v in percentiles(values)]
                p50[mode] = stats[0]
                ratio = f"{p50['cold'] / p50['warm']:.1f}x" if mode == "warm" else ""
                print(f"{name:<14}{mode:<6}{len(values):>6}" + "".join(f"{s:>9.1f}" for s in stats) + f"{ratio:>15}")
        print()

        print(f"{'throughput':<14}{'mode':<6}{'n':>4}{'serial s':>10}{'concurrent s':>14}{'speed-up':>10}")
        for name, code in (("sleep 0.2 s", SLEEP), ("cpu task", CPU)):
            for mode, sandbox in (("cold", cold), ("warm", warm)):
                serial, concurrent = serial_vs_concurrent(sandbox, code, n)
                print(f"{name:<14}{mode:<6}{n:>4}{serial:>10.2f}{concurrent:>14.2f}{serial / concurrent:>9.1f}x")
        print()
        for mode, sandbox in (("cold", cold), ("warm", warm)):
            total = sandbox.total_stats()
            print(f"{mode}: {total.calls} calls, {total.errors} errors, {total.timeouts} timeouts")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "unshare", "none"])
    parser.add_argument("--calls", type=int, default=40, help="trivial calls per mode (warm runs twice as many)")
    parser.add_argument("--n", type=int, default=8, help="concurrent calls in the throughput test")
    args = parser.parse_args()
    main(args.isolation, args.calls, args.n)
