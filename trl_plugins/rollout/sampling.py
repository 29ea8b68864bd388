"""Seeded sampling shared by the samplers that run on the training model (HF generate, continuous batching): a
turn's token is ``argmax(log_softmax(warped logits) + Gumbel noise)``, the noise a pure function of (the turn's seed,
the token's position, the vocabulary entry), so what a row samples does not depend on what shares its batch or
device, and both samplers draw the same tokens from the same distribution."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from trl_plugins.types import SamplingSettings

__all__ = ["seeded_row_keys", "gumbel_from_keys", "seeded_gumbel"]

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # PCG-style integer hash of values in [0, 2**32), in int64 arithmetic (no product reaches 2**63).
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return ((word >> 22) ^ word) & _MASK32


def seeded_row_keys(seeds: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """One 32-bit key per row from its seed and the index of the token being sampled (0 = first sampled token)."""
    seeds = seeds.to(torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=seeds.device)
    return _hash32(_hash32(_hash32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)) ^ (positions & _MASK32))


def gumbel_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``(len(keys), vocab_size)``, a pure function of (row key, token)."""
    keys = keys.to(torch.int64)
    cols = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _hash32(_hash32(keys[:, None] ^ cols[None, :]) ^ keys[:, None])
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32
    return -torch.log(-torch.log(uniform))


def seeded_gumbel(seeds: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise of shape ``(len(seeds), vocab_size)``, a pure function of (row seed, position, token).

    ``argmax(log_softmax(z) + noise)`` is a sample from ``softmax(z)`` (the Gumbel-max trick), so a row's
    sample depends on its own seed and position only, whatever else shares its batch or device. Every backend
    that samples itself (HF generate, continuous batching) uses this noise, so they draw the same tokens from
    the same distribution.
    """
    return gumbel_from_keys(seeded_row_keys(seeds, position), vocab_size)


class Warp:
    # The distribution a turn samples from: temperature, then top-k / top-p / min-p (transformers' own warpers).
    def __init__(self, sampling: SamplingSettings) -> None:
        from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.temperature = sampling.temperature
        self.warpers: list[Any] = []
        if sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
        if sampling.min_p > 0:
            self.warpers.append(MinPLogitsWarper(min_p=sampling.min_p))

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        return scores


class SeededSampling:
    # An HF logits processor that turns greedy decoding into sampling with per-row seeds: the warped scores
    # (Warp), then Gumbel noise; generate's argmax is the sample.
    def __init__(self, sampling: SamplingSettings, seeds: Sequence[int], start: int) -> None:
        self.warp, self.start = Warp(sampling), start
        self.seeds = torch.tensor([int(s) for s in seeds], dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = self.warp(input_ids, scores)
        noise = seeded_gumbel(self.seeds.to(scores.device), input_ids.shape[1] - self.start, scores.shape[-1])
        return torch.log_softmax(scores, dim=-1) + noise.to(scores.dtype)
