"""Long trajectories: peak memory and time of one update step, today's full-logits path against the chunked one.

    python benchmarks/long_context.py [--lengths 1024 2048 4096 8192 16384 32768] [--today-max 4096]
                                      [--chunk-size N] [--device cuda]

One update step (forward, the PPO-clip loss aggregated token_mean, backward) of one trajectory on a Qwen2 with
Qwen2.5's vocabulary (151,936) and a tiny body (hidden 64, 2 layers, fp32, untied), the first half of the trajectory
prompt and the second half action tokens. Each (path, length) runs in its own subprocess: an out-of-memory kill
ends that row only, and a process's peak RSS never goes down. "today" is the full-logits path (every position's
``(T, V)`` logits, scaled, log-softmaxed, entropy-free: trl_plugins.modeling with chunking off); it runs up to
``--today-max`` tokens and is extrapolated linearly beyond (a least-squares line through its measured peaks, stated
as such). "chunked" runs at every length. Peak is the child's peak RSS (ru_maxrss), the model included; time is the
step's wall time per token (a shared machine: compare the columns of one run). ``--device cuda``: the step on the GPU,
peak the GPU memory torch allocated (``torch.cuda.max_memory_allocated``), time after a synchronize
(``scripts/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VOCAB = 151_936


def child(path: str, length: int, chunk_size: int | None, device: str = "cpu") -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import trl_plugins.modeling.logprobs as modeling
    from trl_plugins.algos import PPOClipLoss
    from trl_plugins.algos.aggregation import aggregate
    from trl_plugins.datum import collate
    from trl_plugins.types import Datum, PolicyLossInput, TokenSource

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=max(length + 1, 2048),
        )
    ).train()
    model.config._attn_implementation = "sdpa"
    model.to(device)
    if path == "today":
        modeling.chunkable = lambda m: False  # the full-logits path, exactly as before chunking
    ids = torch.randint(3, VOCAB, (length + 1,)).tolist()
    half = length // 2
    mask = [0] * half + [1] * (length - half)
    datum = Datum(
        input_ids=ids[:-1],
        target_ids=ids[1:],
        behaviour_logprobs=[-5.0] * length,
        advantages=[1.0 if m else 0.0 for m in mask],
        action_mask=mask,
        sources=[TokenSource.ACTION if m else TokenSource.PROMPT for m in mask],
    )
    mb = collate([datum], [0], pad_token_id=0)
    loss_fn = PPOClipLoss()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logp, entropy = modeling.micro_batch_logprobs(model, mb, device, needed=mb.action_mask, chunk_size=chunk_size)
    action_mask = mb.action_mask.to(device)
    result = loss_fn(
        PolicyLossInput(
            logprobs=logp,
            behaviour_logprobs=mb.behaviour_logprobs.to(device),
            advantages=mb.advantages.to(device),
            action_mask=action_mask,
        )
    )
    aggregate(
        result.per_token_loss, action_mask, "token_mean", num_tokens=float(sum(mask)), num_sequences=1.0
    ).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {"peak_mb": peak, "s_per_token": seconds / length}


def run(path: str, length: int, chunk_size: int | None, device: str = "cpu") -> dict | None:
    cmd = [sys.executable, __file__, "--child", path, str(length), "--device", device] + (
        [] if chunk_size is None else ["--chunk-size", str(chunk_size)]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {path} at {length}: failed (exit {proc.returncode}) {proc.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line ``y = a + b x``: ``(a, b)``."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30) if n > 1 else 0.0
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--today-max", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda (peak GPU memory allocated)")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.chunk_size, args.device)))
        return
    rows: dict[tuple[str, int], dict] = {}
    for length in args.lengths:
        for path in ("today", "chunked"):
            if path == "today" and length > args.today_max:
                continue
            got = run(path, length, args.chunk_size, args.device)
            if got is not None:
                rows[(path, length)] = got
    today = sorted((n, r) for (p, n), r in rows.items() if p == "today")
    chunked = sorted((n, r) for (p, n), r in rows.items() if p == "chunked")
    if len(today) < 2 or len(chunked) < 2:
        sys.exit("need at least two lengths measured on each path")
    t_a, t_b = fit([n for n, _ in today], [r["peak_mb"] for _, r in today])
    c_a, c_b = fit([n for n, _ in chunked], [r["peak_mb"] for _, r in chunked])
    print(f"{'tokens':>7} {'today peak MB':>16} {'chunked peak MB':>16} {'today ms/tok':>13} {'chunked ms/tok':>15}")
    for length in args.lengths:
        t, c = rows.get(("today", length)), rows.get(("chunked", length))
        t_peak = f"{t['peak_mb']:.0f}" if t else f"~{t_a + t_b * length:.0f} (extrap.)"
        print(
            f"{length:>7} {t_peak:>16} {c['peak_mb'] if c else float('nan'):>16.0f} "
            f"{t['s_per_token'] * 1e3 if t else float('nan'):>13.3f} "
            f"{c['s_per_token'] * 1e3 if c else float('nan'):>15.3f}"
        )
    print(
        f"today: peak ~ {t_a:.0f} MB + {t_b * 1024:.1f} MB per 1K tokens (fit over {[n for n, _ in today]}); "
        f"chunked: {c_a:.0f} MB + {c_b * 1024:.1f} MB per 1K tokens (fit over {[n for n, _ in chunked]})"
    )
    at = 16384
    chunked_16k = rows[("chunked", at)]["peak_mb"] if ("chunked", at) in rows else c_a + c_b * at
    today_16k = rows[("today", at)]["peak_mb"] if ("today", at) in rows else t_a + t_b * at
    common = [n for n, _ in today if ("chunked", n) in rows]
    ref = 4096 if 4096 in common else max(common)
    print(f"peak at 16K: chunked / today = {chunked_16k / today_16k:.4f}")
    print(f"memory per added 1K tokens: chunked / today = {c_b / t_b:.4f}")
    print(
        f"time per token: chunked / today = "
        f"{rows[('chunked', ref)]['s_per_token'] / rows[('today', ref)]['s_per_token']:.3f}"
    )


if __name__ == "__main__":
    main()
