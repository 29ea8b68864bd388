"""How long ``weights_digest`` (the policy version's stated sample of the sampler's weights, taken after each sync)
takes on a randomly initialised Qwen2 of a chosen size, against hashing every weight byte.

    python benchmarks/weights_digest.py [--layers 24] [--hidden 896]
"""

from __future__ import annotations

import argparse
import hashlib
import time


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_plugins.rollout.weights import weights_digest

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    args = parser.parse_args()
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4 + args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    weights_digest(model)  # warm
    start = time.perf_counter()
    for _ in range(10):
        weights_digest(model)
    sample_ms = (time.perf_counter() - start) / 10 * 1e3
    start = time.perf_counter()
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().numpy().tobytes())
    full_ms = (time.perf_counter() - start) * 1e3
    tensors = len(list(model.parameters()))
    print(
        f"{n / 1e6:.0f}M parameters in {tensors} tensors: weights_digest {sample_ms:.2f} ms; sha256 of every weight "
        f"{full_ms:.0f} ms"
    )


if __name__ == "__main__":
    main()
