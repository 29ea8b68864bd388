"""The shared-prefix layout against the padded one: tokens the update computes per real token, its time, its memory.

    python benchmarks/shared_prefix.py [--part main|sweep|both] [--steps 8] [--repeats 5]

``main``: the main command's workload. ``recipes/retool_ppo.py`` on the embedded default (built on first use and
cached; group size 8, the ReTool system prompt and tool schema) runs ``--steps`` steps twice, ``--shared_prefix
false`` then ``true``, each in its own process with no evaluation; per step after the first: the real tokens of the
step's datums, the tokens the update's forwards computed (each shared prefix once) and processed (padding
included), the update's forward/backward time, the old-log-prob pass's time where it runs, and the step's peak RSS.
The rollouts are the model's own, so the two runs see different (similar) batches: read the per-token ratios.

``sweep``: the update alone on synthetic groups, the embedded default's model shape (hidden 64, 2 layers, vocab
1,100, sliding window 48, sdpa), group sizes 4, 8, 16, a short (60-token) and a long (235-token) prompt, branches of
20-110 tokens, 64 trajectories per step in micro-batches of at most 32 rows: ``policy_update`` (forward, backward,
SGD step) timed ``--repeats`` times with the layouts alternating in one process, the medians kept; the peak RSS of one
update per layout, each in its own process. Wall-clock on a shared machine: read the ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# -- main: the main command's workload ------------------------------------------------------------------------------


def run_recipe(shared: bool, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            str(ROOT / "recipes" / "retool_ppo.py"),
            "--max_steps",
            str(steps),
            "--eval_problems",
            "0",
            "--report_to",
            "none",
            "--plot",
            "false",
            "--save_strategy",
            "no",
            "--output_dir",
            out,
            "--shared_prefix",
            str(shared).lower(),
            "--viewer_steps",
            "0",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        metrics = Path(out) / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.exists():
            sys.exit(f"the recipe failed (shared_prefix={shared}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "train/input_tokens" in r]


def main_part(args) -> None:
    rows = {}
    for shared in (False, True):
        steps = run_recipe(shared, args.steps)[1:]  # the first step builds caches

        def mean(key: str) -> float:
            return statistics.fmean(r.get(key, 0.0) for r in steps)

        rows["ours prefix" if shared else "ours"] = {
            "real": mean("train/input_tokens"),
            "computed": mean("train/computed_tokens"),
            "processed": mean("train/forward_tokens"),
            "fwd_bwd_s": mean("timing/forward_backward_s"),
            "old_lp_s": mean("timing/old_logprobs_s"),
            "peak_rss_mb": max(r["memory/peak_rss_mb"] for r in steps),
            "steps": len(steps),
        }
    print(
        f"main command's workload: recipes/retool_ppo.py on the embedded default (group 8), {args.steps} steps per "
        f"layout, means over steps 2-{args.steps}"
    )
    header = (
        f"{'layout':<12} {'real tok':>9} {'computed':>9} {'/ real':>7} {'processed':>10} {'/ real':>7} "
        f"{'fwd+bwd s':>10} {'old lp s':>9} {'peak RSS MB':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(
            f"{name:<12} {r['real']:>9.0f} {r['computed']:>9.0f} {r['computed'] / r['real']:>7.3f} {r['processed']:>10.0f} "
            f"{r['processed'] / r['real']:>7.3f} {r['fwd_bwd_s']:>10.3f} {r['old_lp_s']:>9.3f} {r['peak_rss_mb']:>12.0f}"
        )
    a, b = rows["ours"], rows["ours prefix"]
    per_token = (b["fwd_bwd_s"] / b["real"]) / (a["fwd_bwd_s"] / a["real"])
    print(
        f"ours prefix / ours: computed per real token {b['computed'] / b['real'] / (a['computed'] / a['real']):.2f}x, "
        f"update time per real token {per_token:.2f}x, peak RSS {b['peak_rss_mb'] / a['peak_rss_mb']:.2f}x"
    )


# -- sweep: the update alone --------------------------------------------------------------------------------------


def _workload(group: int, prompt: int, trajectories: int = 64, vocab: int = 1100, seed: int = 0):
    import random

    from trl_plugins.contracts import make_trajectory
    from trl_plugins.datum import build_datum

    rng = random.Random(seed)
    datums = []
    for g in range(trajectories // group):
        shared = [rng.randrange(3, vocab) for _ in range(prompt)]
        for _ in range(group):
            # 1-3 turns of 1-14 sampled tokens and 3-12 observation tokens each, on top of the prompt: 20-110 tokens.
            traj = make_trajectory(rng, num_turns=rng.randint(2, 6), prompt=shared, group_id=g, vocab=vocab)
            datums.append(build_datum(traj, advantage=rng.uniform(-1, 1), trajectory_index=len(datums)))
    return datums


def _model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=1100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=48,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def _update_once(model, datums, shared: bool):
    import copy
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    from trl_plugins.algos import PPOClipLoss
    from trl_plugins.trainers.update import policy_update

    config = SimpleNamespace(
        aggregation="token_mean",
        packer="optimal",
        max_items_per_micro_batch=32,
        max_padded_tokens_per_micro_batch=64_000,
        rebalance_ranks=False,
        norm_length=None,
        temperature=1.0,
        max_grad_norm=None,
        drop_zero_advantage=False,
        padding_free=False,
        shared_prefix=shared,
    )
    accelerator = Accelerator(cpu=True)
    trained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=1e-3)
    trained, optimizer = accelerator.prepare(trained, optimizer)
    start = time.perf_counter()
    result = policy_update(accelerator, trained, optimizer, datums, PPOClipLoss(), config, pad_token_id=0)
    return time.perf_counter() - start, result


def sweep_child(args) -> None:
    # ``--layout both``: the timing, the two layouts alternating in this process (one warm-up each, then ``repeats``
    # rounds), medians; one layout: a single update, for that layout's peak RSS in a process of its own.
    import torch

    torch.set_num_threads(1)
    datums = _workload(args.group, args.prompt)
    model = _model()
    for d in datums:
        d.behaviour_logprobs = [-1.0 if m else 0.0 for m in d.action_mask]
    layouts = ["unshared", "prefix"] if args.layout == "both" else [args.layout]
    times: dict[str, list[float]] = {layout: [] for layout in layouts}
    out = {}
    for round_ in range(args.repeats + 1 if args.layout == "both" else 1):
        for layout in layouts:
            seconds, result = _update_once(model, datums, layout == "prefix")
            if round_ or args.layout != "both":
                times[layout].append(seconds)
            out[layout] = {
                "real": result.num_input_tokens,
                "computed": result.num_computed_tokens,
                "processed": result.num_padded_tokens,
            }
    for layout in layouts:
        out[layout]["s"] = statistics.median(times[layout])
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def _child(layout: str, group: int, prompt: int, repeats: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--layout",
        layout,
        "--group",
        str(group),
        "--prompt",
        str(prompt),
        "--repeats",
        str(repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{layout} g={group} p={prompt} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def sweep_part(args) -> None:
    print(
        f"update alone (policy_update: forward, backward, SGD step), 64 trajectories, micro-batches <= 32 rows, the "
        f"embedded default's model shape, 1 thread; median of {args.repeats}, the layouts alternating in one process; "
        f"peak RSS of one update, each layout in its own process"
    )
    header = (
        f"{'group':>5} {'prompt':>6} {'layout':<12} {'real tok':>9} {'computed':>9} {'/ real':>7} {'processed':>10} "
        f"{'/ real':>7} {'update s':>9} {'time x':>7} {'peak RSS MB':>12} {'RSS x':>6}"
    )
    print(header)
    print("-" * len(header))
    for prompt in (60, 235):
        for group in (4, 8, 16):
            timed = _child("both", group, prompt, args.repeats)
            rss = {layout: _child(layout, group, prompt, 1)["rss_mb"] for layout in ("unshared", "prefix")}
            base = timed["unshared"]
            for layout in ("unshared", "prefix"):
                r = timed[layout]
                name = "ours prefix" if layout == "prefix" else "ours"
                print(
                    f"{group:>5} {prompt:>6} {name:<12} {r['real']:>9} {r['computed']:>9} {r['computed'] / r['real']:>7.3f} "
                    f"{r['processed']:>10} {r['processed'] / r['real']:>7.3f} {r['s']:>9.3f} {r['s'] / base['s']:>7.2f} "
                    f"{rss[layout]:>12.0f} {rss[layout] / rss['unshared']:>6.2f}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["main", "sweep", "both"], default="both")
    ap.add_argument("--steps", type=int, default=8, help="main: recipe steps per layout (means leave out the first)")
    ap.add_argument("--repeats", type=int, default=5, help="sweep: timed updates per layout and workload")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=["unshared", "prefix", "both"], help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sweep_child(args)
        return
    if args.part in ("sweep", "both"):
        sweep_part(args)
    if args.part in ("main", "both"):
        main_part(args)


if __name__ == "__main__":
    main()
