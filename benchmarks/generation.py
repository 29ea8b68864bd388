"""Generation throughput: generated tokens/s of the rollout backends on one model, side by side.

    python benchmarks/generation.py [--shape tiny|qwen2-0.36b|qwen2-1.5b] [--prompts 64] [--tokens 256]
                                    [--prompt-tokens 128] [--dtype float32|bfloat16] [--device cpu|cuda]

The model is built locally with random weights in the given shape (nothing is downloaded) and every
prompt generates exactly ``--tokens`` tokens (no stop token), so the rows measure the same work:
HF ``generate`` through ``HFGenerationBackend`` (per-row seeded sampling, behaviour log-probs),
transformers' continuous batching through ``ContinuousBatchingBackend`` (one request per prompt, the
same seeded sampling; ``--cb-config`` passes ``ContinuousBatchingConfig`` keys, on CPU a cache sized to
the work is the default) and, where vLLM is importable, vLLM's ``LLM.generate`` with token-id prompts, per-request seeds and
log-probs (as ``VLLMBackend`` calls it). On CPU use ``--shape tiny``; the GPU check runs the real shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time

import torch

SHAPES = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    ),
    "qwen2-0.36b": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960
    ),
}


def build(shape: str, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_plugins.tiny import build_tokenizer

    tok = build_tokenizer("qwen2_5")
    config = Qwen2Config(
        vocab_size=151936 if shape != "tiny" else len(tok),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval()
    return tok, model


def timed_generate(backend, prompts: list, tokens: int, device: str) -> tuple[list, float]:
    """A warm-up call (on a GPU: kernels, CUDA graphs), then the timed call: ``(samples, wall seconds)``."""
    backend.generate(prompts[:2], [4, 4], seeds=[0, 1])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = backend.generate(prompts, [tokens] * len(prompts), seeds=list(range(len(prompts))))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-cb", action="store_true", help="skip the continuous-batching row")
    ap.add_argument(
        "--cb-config",
        default=None,
        help="JSON of ContinuousBatchingConfig keys (default: sized to the "
        "work on CPU; TRL's max_memory_percent=0.5 on a GPU)",
    )
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tok, model = build(args.shape, dtype, args.device)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(100, min(len(tok), 5000), (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    no_stop = [len(tok) + 10**6]  # a token id that is never sampled: every row generates --tokens tokens
    rows = []

    from trl_plugins.rollout import HFGenerationBackend
    from trl_plugins.types import SamplingSettings

    hf = HFGenerationBackend(
        model, pad_token_id=tok.pad_token_id, stop_token_ids=no_stop, sampling=SamplingSettings(temperature=1.0)
    )
    out, wall = timed_generate(hf, prompts, args.tokens, args.device)
    rows.append(("HF generate (HFGenerationBackend)", sum(len(s.token_ids) for s in out), wall))

    if not args.skip_cb:
        import json

        from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend, continuous_batching_config

        if args.cb_config is not None:
            options = json.loads(args.cb_config)
        elif args.device.startswith("cuda"):
            options = {}
        else:  # transformers sizes the cache from GPU memory; on CPU give it what this work needs
            page = 32
            options = {
                "page_size": page,
                "max_batch_tokens": 2048,
                "num_blocks": 4 + args.prompts * -(-(args.prompt_tokens + args.tokens) // page),
            }
        cbb = ContinuousBatchingBackend(
            model,
            stop_token_ids=no_stop,
            sampling=SamplingSettings(temperature=1.0),
            config=continuous_batching_config(options),
        )
        with cbb.session():
            out, wall = timed_generate(cbb, prompts, args.tokens, args.device)
        cbb.close()
        rows.append(("continuous batching (CB backend)", sum(len(s.token_ids) for s in out), wall))

    if not args.skip_vllm and importlib.util.find_spec("vllm") is not None and args.device.startswith("cuda"):
        from vllm import LLM, SamplingParams

        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            tok.save_pretrained(path)
            del model, hf
            cbb = None
            torch.cuda.empty_cache()
            llm = LLM(
                model=path,
                dtype=args.dtype,
                gpu_memory_utilization=0.5,
                max_model_len=args.prompt_tokens + args.tokens + 16,
                logprobs_mode="processed_logprobs",
                seed=0,
                enable_prefix_caching=False,
            )
            sp = [
                SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=k)
                for k in range(len(prompts))
            ]
            llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp[:2], use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            rows.append(("vLLM LLM.generate (VLLMBackend)", sum(len(o.outputs[0].token_ids) for o in outs), wall))
    elif not args.skip_vllm:
        print("vLLM: not importable here (or no CUDA device); its row is skipped")

    print(
        f"shape {args.shape} ({params:.2f}B params, {args.dtype}, {args.device}), {args.prompts} prompts x "
        f"{args.prompt_tokens} prompt tokens -> {args.tokens} generated tokens each"
    )
    print(f"{'backend':<36} {'tokens':>8} {'wall s':>8} {'tokens/s':>10} {'vs HF':>7}")
    base = rows[0][1] / rows[0][2]
    for name, n, w in rows:
        print(f"{name:<36} {n:>8} {w:>8.2f} {n / w:>10.0f} {n / w / base:>6.2f}x")


if __name__ == "__main__":
    sys.exit(main())
