"""The continuous-batching manager's configuration and paged cache: what this project sets, how big the cache is
for a run's workload, and whether it fits before transformers builds it.

transformers sizes an unset cache to fill ``max_memory_percent`` of the memory it sees at the first rollout and
remembers those figures, so a later rollout (the cache is rebuilt every rollout by default) could ask for more than
training has left; :func:`workload_cache_size` sizes it from the run instead, and :func:`check_cache_fits` checks it
with transformers' own accounting (docs/rollout.md).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["continuous_batching_config", "workload_cache_size", "CacheFootprint", "cache_footprint", "check_cache_fits"]

# ContinuousBatchingConfig fields this backend sets itself, with the reason a user value is refused.
_OWNED = {
    "return_logprobs": "the backend always returns the behaviour log-probs the loss needs",
    "seed": "each turn samples with its own seed, derived from --seed (the manager's seed would only reseed "
    "torch's global generator)",
    "per_request_processors": "sampling settings come from temperature/top_p/top_k/min_p",
    "drop_unsupported_processors": "the backend installs its own sampler",
}


def workload_cache_size(trajectories: int, tokens_per_trajectory: int, page_size: int = 256) -> dict[str, int]:
    """The paged cache a rollout needs: ``num_blocks`` and ``max_batch_tokens`` for ``trajectories`` in flight, each up
    to ``tokens_per_trajectory`` tokens (the rollout's token budget), in pages of ``page_size`` tokens.

    - ``num_blocks = trajectories * ceil(tokens_per_trajectory / page_size)``: every trajectory of the rollout at its
      full budget at once (each has one turn in flight, whose request holds the whole trajectory so far).
    - ``max_batch_tokens = max(trajectories, tokens_per_trajectory)``, rounded up to a multiple of 64 and at most
      8,192 (transformers' default): one forward holds a decode token of every trajectory, or the prefill of a
      whole trajectory.

    Left unset, transformers sizes both from the memory it sees when the cache is built: 8,192 batch tokens and
    whatever cache fits in ``max_memory_percent`` of it. On a CPU the attention masks, ``max_batch_tokens x (cache
    tokens + max_batch_tokens)`` floats each, took ~5 GB for a tiny model; and a rollout that rebuilds the cache
    (``keep_cache`` off) reuses the first sizing, which no longer fits once training holds more memory.
    """
    if trajectories < 1 or tokens_per_trajectory < 1 or page_size < 1:
        raise ValueError(
            f"need trajectories, tokens_per_trajectory and page_size >= 1, got {trajectories}, "
            f"{tokens_per_trajectory} and {page_size}."
        )
    num_blocks = trajectories * -(-tokens_per_trajectory // page_size)
    max_batch_tokens = min(8192, -(-max(trajectories, tokens_per_trajectory) // 64) * 64)
    return {"num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens}


def continuous_batching_config(
    options: Mapping[str, Any] | str | None,
    *,
    trajectories: int | None = None,
    tokens_per_trajectory: int | None = None,
) -> Any:
    """A ``ContinuousBatchingConfig`` from TRL's ``transformers_continuous_batching_config`` (a dict, or a JSON
    string from the command line), checked before any model loads.

    ``max_memory_percent`` defaults to 0.5, as in TRL: the paged cache may take that share of the memory free when
    it is built, and training needs the rest. With ``trajectories`` and ``tokens_per_trajectory`` (the rollout's
    workload), ``num_blocks`` and ``max_batch_tokens`` not given in ``options`` are sized from it
    (:func:`workload_cache_size`) instead of from the memory transformers sees.
    """
    import json

    from transformers.generation import ContinuousBatchingConfig

    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"transformers_continuous_batching_config must be a JSON object, got {options!r}: {exc}"
            ) from None
    options = dict(options or {})
    refused = sorted(set(options) & set(_OWNED))
    if refused:
        raise ValueError(
            "transformers_continuous_batching_config: "
            + "; ".join(f"{k!r} is refused ({_OWNED[k]})" for k in refused)
            + ". Remove it."
        )
    fields = set(inspect.signature(ContinuousBatchingConfig).parameters)
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(
            f"transformers_continuous_batching_config: unknown key(s) {unknown}; "
            f"ContinuousBatchingConfig takes {sorted(fields - set(_OWNED))}."
        )
    options.setdefault("max_memory_percent", 0.5)
    if trajectories is not None and tokens_per_trajectory is not None:
        page_size = options.get("page_size") or options.get("block_size") or ContinuousBatchingConfig.page_size
        for key, value in workload_cache_size(trajectories, tokens_per_trajectory, page_size).items():
            if options.get(key) is None:
                options[key] = value
    try:
        return ContinuousBatchingConfig(**options, return_logprobs=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"transformers_continuous_batching_config {options}: {exc}") from None


@dataclass(frozen=True)
class CacheFootprint:
    """What transformers will allocate for a paged cache, and what it allows (bytes), by its own accounting
    (``PagedAttentionMemoryHandler``)."""

    max_batch_tokens: int
    num_blocks: int
    """As asked (``None`` in the config: what transformers would size from ``available``)."""
    page_size: int
    cache: int
    """The KV cache and the per-cache-token tensors it entails (cache reads, read indices)."""
    batch: int
    """Tensors that scale with ``max_batch_tokens`` (inputs, outputs, the largest activation peak)."""
    masks: int
    """The attention masks, ``max_batch_tokens x (cache tokens + max_batch_tokens)`` each (none with flash
    attention)."""
    fixed: int
    """Trash sectors, and the LM-head rows when the model slices its logits."""
    available: int
    """``max_memory_percent`` of the memory transformers sees (on a CPU: the process's NUMA node) minus what is in
    use."""
    seen: int
    """The memory transformers sees, before ``max_memory_percent``."""
    device: str

    @property
    def total(self) -> int:
        return self.cache + self.batch + self.masks + self.fixed

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def describe(self) -> str:
        """One line of figures: what is asked and what is allowed."""
        gb = 1e9
        return (
            f"max_batch_tokens={self.max_batch_tokens}, num_blocks={self.num_blocks}, page_size={self.page_size}: "
            f"{self.total / gb:.2f} GB ({self.masks / gb:.2f} GB attention masks, {self.cache / gb:.2f} GB KV cache, "
            f"{(self.batch + self.fixed) / gb:.2f} GB batch tensors); transformers allows {self.available / gb:.2f} GB "
            f"on {self.device} (max_memory_percent of the {self.seen / gb:.2f} GB it sees free there)"
        )


def _memory_handler(
    text_config: Any,
    cb_config: Any,
    dtype: torch.dtype,
    supports_logits_to_keep: bool,
    device: torch.device,
    in_use: int | None,
) -> Any:
    # PagedAttentionCache.__init__'s geometry (transformers 5.24), without allocating the cache; the handler is the
    # one the cache sizes and checks itself with. Pinned by tests/test_continuous_batching.py.
    from math import lcm

    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config
    from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown

    cb_config = resolve_continuous_batching_config(text_config, cb_config, None, True, device)
    heads = cb_cache.find_num_key_value_heads(text_config)
    groups = cb_cache.group_layers_by_attn_type(text_config)
    allocators = [
        cb_cache.ATTN_TYPE_TO_ALLOCATOR[kind](
            index=i,
            layer_indices=layers,
            num_key_value_heads=heads,
            config=text_config,
            cache_dtype=dtype,
            page_size=cb_config.page_size,
            allow_block_sharing=cb_config.allow_block_sharing,
        )
        for i, (kind, layers) in enumerate(groups.items())
    ]
    bytes_per_sector = lcm(*(a.bytes_per_block for a in allocators), 128)
    tokens_per_sector = max((bytes_per_sector // a.bytes_per_block) * a.tokens_per_page for a in allocators)
    bytes_per_block = text_config.num_hidden_layers * cb_cache.FullAttentionCacheAllocator.get_bytes_per_page(
        heads, cb_cache.find_head_dim(text_config), dtype, cb_config.page_size
    )

    class _Handler(cb_cache.PagedAttentionMemoryHandler):  # type: ignore[misc]
        seen_free = 0

        def get_available_memory(self) -> int:
            _, total, reserved, allocated = get_device_and_memory_breakdown()
            self.seen_free = total - (max(allocated, reserved) if in_use is None else in_use)
            return int(self.seen_free * self.cb_config.max_memory_percent)

        def _check_footprint(self, max_batch_tokens: int, num_sectors: int) -> tuple[int, int]:
            return max_batch_tokens, num_sectors  # the figures, not transformers' bare MemoryError

    return _Handler(
        config=text_config,
        cb_config=cb_config,
        dtype=dtype,
        bytes_per_sector=bytes_per_sector,
        tokens_per_sector=tokens_per_sector,
        bytes_per_block=bytes_per_block,
        attn_types=list(groups),
        model_supports_logits_to_keep=supports_logits_to_keep,
    )


def _switches_to_flash(model: Any, cb_config: Any, device: torch.device) -> bool:
    # ContinuousBatchingManager.switch_to_cb_friendly_attn's choice (transformers 5.24).
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available
    from transformers.utils.generic import is_flash_attention_requested

    if is_flash_attention_requested(model.config) or device.type not in ("cuda", "xpu"):
        return False
    return bool(
        cb_config.auto_switch_to_flash
        and getattr(model, "_supports_flash_attn", False)
        and (is_flash_attn_3_available(kernels_fallback_ok=True) or is_flash_attn_2_available(kernels_fallback_ok=True))
    )


def check_cache_fits(
    model: Any, cb_config: Any, *, in_use: int | None = None, error: type[Exception] = MemoryError, when: str = ""
) -> CacheFootprint:
    """The footprint of ``model``'s paged cache under ``cb_config`` (:func:`cache_footprint`), or ``error`` saying what
    it needs, what transformers allows, and settings that fit.

    Args:
        in_use: As for :func:`cache_footprint` (``None``: what is in use now).
        when: Said after the figures (e.g. how ``in_use`` was estimated).
    """
    import json

    footprint = cache_footprint(model, cb_config, in_use=in_use)
    if footprint.fits:
        return footprint
    suggestion = None
    tokens, blocks = footprint.max_batch_tokens, footprint.num_blocks
    candidates = [(m, blocks) for m in (tokens // 2**k for k in range(1, 8)) if m >= 64]
    candidates += [(64, b) for b in (blocks // 2**k for k in range(1, 12)) if b >= 1]
    for m, b in candidates:
        trial = copy.deepcopy(cb_config)
        trial.max_batch_tokens, trial.num_blocks = m, b
        smaller = cache_footprint(model, trial, in_use=in_use)
        if smaller.fits:
            suggestion = (
                f"transformers_continuous_batching_config "
                f"'{json.dumps({'max_batch_tokens': m, 'num_blocks': b, 'page_size': footprint.page_size})}' "
                f"({smaller.total / 1e9:.2f} GB, fits)"
            )
            break
    raise error(
        f"continuous batching: the paged KV cache does not fit: {footprint.describe()}{when}. "
        + (f"Set {suggestion}, or lower " if suggestion else "Lower ")
        + f"per_device_train_batch_size or the rollout's max_trajectory_tokens (the cache is sized for them when "
        f"num_blocks and max_batch_tokens are unset), raise max_memory_percent (now {cb_config.max_memory_percent}) "
        f"in transformers_continuous_batching_config, or generate with HF generate (drop "
        f"use_transformers_continuous_batching)."
    )


def cache_footprint(model: Any, cb_config: Any, *, in_use: int | None = None) -> CacheFootprint:
    """What transformers will allocate for ``model``'s paged cache under ``cb_config``, by its own accounting, and the
    memory it will allow: ``max_memory_percent`` of the memory it sees free (on a CPU, the process's NUMA node minus
    its resident memory; on a GPU, the free memory).

    Args:
        model: The model (its config, dtype, device and attention implementation count; a model on the meta device
            will do, for a check before the weights load: it is taken to be on the GPU if there is one).
        in_use: Bytes to count as in use instead of what is in use now (e.g. now plus the training state to come).
    """
    if model.device.type == "meta":  # where it will be: where transformers measures the memory
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = model.device
    supports = getattr(model, "_supports_logits_to_keep", None)
    text_config = copy.deepcopy(model.config.get_text_config())
    if _switches_to_flash(model, cb_config, device):  # the manager will (flash attention needs no masks)
        text_config._attn_implementation = "paged|flash_attention_2"
    handler = _memory_handler(
        text_config, copy.deepcopy(cb_config), model.dtype, callable(supports) and supports(), device, in_use
    )
    tokens, sectors = handler.infer_max_batch_tokens_and_num_sectors()  # as PagedAttentionCache sizes itself
    return CacheFootprint(
        max_batch_tokens=tokens,
        num_blocks=sectors * handler.bytes_per_sector // handler.bytes_per_block,
        page_size=handler.cb_config.page_size,
        cache=sectors * handler.bytes_per_cache_sector,
        batch=tokens * handler.bytes_per_batch_token,
        masks=handler.attention_mask_bytes(tokens, sectors),
        fixed=handler.fixed_overhead_bytes,
        available=handler.available_memory,
        seen=handler.seen_free,
        device=str(device),
    )
