"""Sandbox benchmark: call latency cold vs warm, and concurrent vs serial throughput.

    python benchmarks/sandbox.py [--isolation auto] [--calls 40] [--n 8]

Latency (ms, p50/p90/p99/max over ``--calls`` calls; cold runs fewer import-heavy calls):
    trivial       ``print(1)``
    numpy+sympy   code that imports numpy and sympy and uses both (warm servers have them preloaded)

Throughput: ``--n`` calls of a 0.2 s sleep and of a short CPU task, run serially with ``run`` and
concurrently with ``arun`` + ``asyncio.gather``; ``speed-up`` = serial time / concurrent time. The
CPU task cannot scale past the number of cores. The machine is small and noisy, so compare the
ratios printed in the same run rather than absolute numbers across runs. Prints only; asserts nothing.

Local warm vs the service (docs/sandbox_service.md; skipped with ``--no-service`` or without uvicorn): a
server started on this machine (warm, ``--n`` calls at once) and a local warm sandbox run ``print(1)``
``--service-calls`` times each, ``--n`` at a time, in ``--rounds`` rounds alternating the two (this machine is
noisy). Printed: executions per second per core, p50/p99 of a call's latency under that load, and p50 of a call
made alone (the HTTP round trip's own cost).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import socket
import subprocess
import sys
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

        print(
            f"{'latency (ms)':<14}{'mode':<6}{'calls':>6}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'cold/warm p50':>15}"
        )
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


def start_server(isolation: str, n: int, token: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "trl_plugins.tools.sandbox.service",
        "--port",
        str(port),
        "--mode",
        "warm",
        "--isolation",
        isolation,
        "--max-concurrency",
        str(n),
        "--queue-size",
        str(4 * n),
        "--log-level",
        "warning",
        "--default-timeout-s",
        "30",
    ]  # the client's limits: the server warms that sandbox at start-up
    proc = subprocess.Popen(cmd, env={**os.environ, "TRL_SANDBOX_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the sandbox server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the sandbox server did not start within 60 s")


def loaded_round(sandbox, calls: int, n: int) -> tuple[float, list[float]]:
    """``calls`` calls of ``print(1)``, ``n`` at a time: wall time and each call's latency."""

    async def one(gate: asyncio.Semaphore) -> float:
        async with gate:
            t0 = time.perf_counter()
            result = await sandbox.arun(TRIVIAL)
            if not result.ok:
                raise RuntimeError(f"benchmark call failed: {result.stderr}")
            return time.perf_counter() - t0

    async def all_calls() -> list[float]:
        gate = asyncio.Semaphore(n)
        return await asyncio.gather(*[one(gate) for _ in range(calls)])

    t0 = time.perf_counter()
    lat = asyncio.run(all_calls())
    return time.perf_counter() - t0, lat


def local_vs_service(isolation: str, n: int, calls: int, rounds: int) -> None:
    try:
        import uvicorn  # noqa: F401

        from trl_plugins.tools.sandbox.remote import RemoteSandbox
    except ImportError:
        print("local warm vs service: skipped (pip install -e '.[server]' for uvicorn and starlette)")
        return
    token = secrets.token_urlsafe(32)
    proc, url = start_server(isolation, n, token)
    cores = os.cpu_count() or 1
    try:
        with (
            PythonSandbox(mode="warm", isolation=isolation, max_concurrency=n, timeout_s=30.0) as local,
            RemoteSandbox(url, token, timeout_s=30.0, max_concurrency=n) as remote,
        ):
            local.warm_up()
            remote.connect()
            sides = {"local warm": local, "service": remote}
            for sandbox in sides.values():  # unmeasured: every warm server started, connections open
                loaded_round(sandbox, 2 * n, n)
            wall = {k: 0.0 for k in sides}
            loaded = {k: [] for k in sides}
            alone = {k: [] for k in sides}
            for _ in range(rounds):  # alternate, so that both see the same noise
                for name, sandbox in sides.items():
                    seconds, lat = loaded_round(sandbox, calls, n)
                    wall[name] += seconds
                    loaded[name] += lat
                    alone[name] += latencies(sandbox, TRIVIAL, max(5, calls // 4))
            print(
                f"local warm vs service: print(1), {calls} calls x {rounds} rounds each, {n} at a time, "
                f"{cores} cores, server on this machine"
            )
            print(f"{'':<12}{'exec/s/core':>12}{'p50 ms':>9}{'p99 ms':>9}{'alone p50 ms':>14}")
            for name in sides:
                p50, _, p99, _ = percentiles(loaded[name])
                print(
                    f"{name:<12}{len(loaded[name]) / wall[name] / cores:>12.1f}{p50 * 1000:>9.1f}"
                    f"{p99 * 1000:>9.1f}{percentiles(alone[name])[0] * 1000:>14.1f}"
                )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "unshare", "none"])
    parser.add_argument("--calls", type=int, default=40, help="trivial calls per mode (warm runs twice as many)")
    parser.add_argument("--n", type=int, default=8, help="concurrent calls in the throughput test")
    parser.add_argument("--no-service", action="store_true", help="skip the local warm vs service comparison")
    parser.add_argument("--service-calls", type=int, default=80, help="calls per round and side in that comparison")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds in that comparison")
    parser.add_argument("--service-only", action="store_true", help="run only the local warm vs service comparison")
    args = parser.parse_args()
    if not args.service_only:
        main(args.isolation, args.calls, args.n)
        print()
    if not args.no_service:
        local_vs_service(args.isolation, args.n, args.service_calls, args.rounds)
