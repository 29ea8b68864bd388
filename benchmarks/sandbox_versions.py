"""Warm-call latency of two versions of the sandbox, measured alternately in one run.

    python benchmarks/sandbox_versions.py --baseline 9e27bcf [--rounds 8] [--calls 25] [--isolation auto]

The baseline's ``trl_plugins`` is taken from git (``git archive``) into a temporary folder; each version runs in
a worker process of its own (one warm ``PythonSandbox``, one server, ``warm_imports`` numpy and sympy as in
production), and the workers take turns: ``--rounds`` rounds of ``--calls`` calls each, so that the load of this
shared machine falls on both alike. Prints p50/p90/p99 per version and code, and the ratios (current / baseline).
Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODES = {
    "print(1)": "print(1)",
    "numpy+sympy": "import numpy as np\nimport sympy\nprint(int(np.arange(10).sum()), sympy.factorint(1001))",
}

WORKER = r"""
import json, sys, time
from trl_plugins.tools.sandbox import PythonSandbox
isolation = sys.argv[1]
with PythonSandbox(mode="warm", isolation=isolation, max_concurrency=1, timeout_s=10.0) as sb:
    sb.warm_up(1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = []
        for _ in range(req["calls"]):
            t0 = time.perf_counter()
            r = sb.run(req["code"])
            out.append(time.perf_counter() - t0)
            if not r.ok:
                raise SystemExit(f"call failed: {r.stderr}")
        print(json.dumps(out), flush=True)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def extract(rev: str, into: Path) -> Path:
    data = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "trl_plugins"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def start(root: Path, isolation: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, isolation],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )
    if not json.loads(proc.stdout.readline()).get("ready"):
        raise SystemExit(f"worker under {root} did not start")
    return proc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--baseline", default="9e27bcf", help="git revision to compare against (default: before round three)"
    )
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=25)
    p.add_argument("--isolation", default="auto")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandbox-baseline-") as tmp:
        roots = {"baseline": extract(args.baseline, Path(tmp)), "current": REPO}
        workers = {name: start(root, args.isolation) for name, root in roots.items()}
        times: dict[tuple[str, str], list[float]] = {(v, c): [] for v in workers for c in CODES}
        try:
            for r in range(args.rounds):
                order = list(workers) if r % 2 == 0 else list(reversed(workers))
                for code_name, code in CODES.items():
                    for version in order:
                        proc = workers[version]
                        proc.stdin.write(json.dumps({"code": code, "calls": args.calls}) + "\n")
                        proc.stdin.flush()
                        times[version, code_name] += json.loads(proc.stdout.readline())
        finally:
            for proc in workers.values():
                proc.stdin.close()
                proc.wait(timeout=60)
    print(
        f"warm call latency (ms), baseline {args.baseline} vs current, {args.rounds} alternating rounds x "
        f"{args.calls} calls, {os.cpu_count()} cores"
    )
    print(f"{'code':<14}{'version':<10}{'p50':>8}{'p90':>8}{'p99':>8}")
    for code_name in CODES:
        for version in workers:
            v = times[version, code_name]
            print(
                f"{code_name:<14}{version:<10}" + "".join(f"{1000 * percentile(v, q):8.1f}" for q in (0.5, 0.9, 0.99))
            )
        ratios = [
            percentile(times["current", code_name], q) / percentile(times["baseline", code_name], q)
            for q in (0.5, 0.9, 0.99)
        ]
        print(f"{code_name:<14}{'ratio':<10}" + "".join(f"{x:8.2f}" for x in ratios))


if __name__ == "__main__":
    main()
