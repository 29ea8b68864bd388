"""The one micro-batch loop every pass over datums runs: the policy update, the critic's update, and the no-gradient
passes (reference and old log-probs, the critic's values).

A pass packs this rank's datums into micro-batches (the configured packer and limits), pads the list with
zero-weight dummies to the largest count over the ranks (one all-reduce: under ZeRO-3 every forward is a
collective, so every rank runs as many), and collates each in turn (:func:`micro_batches`). A gradient pass adds
a :class:`GradientSync`: gradients accumulate over the micro-batches and are synchronised once, on the last
(DDP ``no_sync`` before it; DeepSpeed's accumulation boundary set explicitly, since ``accelerator.backward``
would otherwise step the engine after every micro-batch).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from trl_plugins.datum import collate, dummy_micro_batch
from trl_plugins.modeling import check_packed_isolation, check_shared_prefix
from trl_plugins.modeling.logprobs import SharedPrefixUnsupported
from trl_plugins.packing import pack_for_ranks, prefix_trees, supports_prefix_trees
from trl_plugins.trainers.ranks import is_deepspeed, reduce_over_ranks
from trl_plugins.types import Datum, MicroBatch

logger = logging.getLogger(__name__)

__all__ = [
    "MicroBatchStep",
    "micro_batches",
    "local_plan",
    "plan_for_ranks",
    "pack_limits",
    "shared_prefix_on",
    "GradientSync",
    "ensure_layout_checked",
    "forward_no_grad",
]


def shared_prefix_on(config: Any) -> bool:
    """Whether micro-batches take the shared-prefix layout: ``config.shared_prefix`` once settled (a config without
    the field, e.g. a caller's namespace that predates it, keeps the padded layout)."""
    return bool(getattr(config, "shared_prefix", False))


def pack_limits(config: Any) -> dict[str, Any]:
    """The packer's limits from the run's config: rows and padded area (tokens, padding-free) per micro-batch."""
    return {
        "max_items": config.max_items_per_micro_batch,
        "max_padded_tokens": config.max_padded_tokens_per_micro_batch,
        "padding_free": bool(config.padding_free),
    }


def plan_for_ranks(datums: Sequence[Datum], config: Any, world_size: int) -> list[list[list[int]]]:
    """Micro-batches of ``datums`` (indices) for ``world_size`` ranks, planned by the configured packer; in the
    shared-prefix layout a packer that takes them is given the datums' prefix trees (the datums that begin alike)."""
    wanted = shared_prefix_on(config) and supports_prefix_trees(config.packer)
    trees = prefix_trees([d.input_ids for d in datums]) if wanted else None
    plan = pack_for_ranks(
        [d.num_tokens for d in datums],
        strategy=config.packer,
        world_size=world_size,
        prefix_trees=trees,
        **pack_limits(config),
    )
    return [[list(mb) for mb in rank] for rank in plan.ranks]


def local_plan(datums: Sequence[Datum], config: Any) -> list[list[int]]:
    """This rank's micro-batches of ``datums`` (indices), planned by the configured packer on this rank alone."""
    return plan_for_ranks(datums, config, 1)[0]


@dataclass
class MicroBatchStep:
    """One micro-batch of a pass."""

    index: int
    """Its place in the pass (the same on every rank)."""
    datum_indices: list[int]
    """The datums it holds (empty: a dummy)."""
    batch: MicroBatch
    """Collated (a zero-weight dummy when ``datum_indices`` is empty)."""
    last: bool
    """The pass's last micro-batch: where a gradient pass synchronises."""


def micro_batches(
    accelerator: Any,
    datums: Sequence[Datum],
    batches: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    padding_free: bool,
    shared_prefix: bool = False,
    with_ref: bool = False,
    with_values: bool = False,
) -> Iterator[MicroBatchStep]:
    """This rank's ``batches`` of ``datums``, collated, then dummies up to the most micro-batches any rank has.

    A collective (one all-reduce, before the first step): every rank iterates it to the end, in step.
    ``shared_prefix``: the shared-prefix layout (dummies too: its two forwards run on every micro-batch).
    ``with_ref``/``with_values`` give the dummies the reference log-probs / critic fields the real ones carry.
    """
    (steps,) = reduce_over_ranks(accelerator, [len(batches)], "max")
    steps = int(steps)
    padded = [list(b) for b in batches] + [[] for _ in range(steps - len(batches))]
    for k, idx in enumerate(padded):
        mb = (
            collate(datums, idx, pad_token_id=pad_token_id, padding_free=padding_free, shared_prefix=shared_prefix)
            if idx
            else dummy_micro_batch(
                pad_token_id=pad_token_id, with_ref=with_ref, with_values=with_values, shared_prefix=shared_prefix
            )
        )
        yield MicroBatchStep(k, idx, mb, last=k == steps - 1)


class GradientSync:
    """How one model accumulates gradients over a pass's micro-batches and synchronises them once.

    ``engine=False``: a model Accelerate prepared (the policy): ``accelerator.backward``, with DeepSpeed's
    ``sync_gradients`` flag set per micro-batch. ``engine=True``: a model with an optimizer of its own (the
    critic): a DeepSpeed engine's ``set_gradient_accumulation_boundary``/``backward``, or DDP's ``no_sync`` and a
    plain ``backward``.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, *, engine: bool = False) -> None:
        self.accelerator, self.model, self.engine = accelerator, model, engine
        self.deepspeed = is_deepspeed(accelerator)
        self.world = accelerator.num_processes

    def context(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward (``last``: gradients synchronise in it)."""
        if self.deepspeed:
            if self.engine:
                self.model.set_gradient_accumulation_boundary(last)
            else:
                self.accelerator.sync_gradients = last
            return contextlib.nullcontext()
        if last or self.world == 1:
            return contextlib.nullcontext()
        return self.model.no_sync() if self.engine else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate ``loss``'s gradient (already normalised by the global denominators: no rescaling here)."""
        if self.deepspeed:
            if self.engine:
                self.model.backward(loss, scale_wrt_gas=False)
            else:
                self.accelerator.backward(loss, scale_wrt_gas=False)
        elif self.engine:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def finish(self) -> None:
        """After the pass: leave Accelerate's flag as the HF loop expects it."""
        if self.deepspeed and not self.engine:
            self.accelerator.sync_gradients = True


_PACKING_CHECKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
"""Models whose attention was found to keep packed datums apart (checked once per model)."""
_SHARING_CHECKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
"""Models found to give the same outputs in the shared-prefix layout (checked once per model)."""


def ensure_layout_checked(accelerator: Any, model: torch.nn.Module, config: Any, *, name: str = "the policy") -> None:
    """Check once per model that its forward honours the micro-batch layout: with padding-free micro-batches that its
    attention keeps packed datums apart (:func:`~trl_plugins.modeling.check_packed_isolation`), in the shared-prefix
    layout that its outputs equal the padded layout's (:func:`~trl_plugins.modeling.check_shared_prefix`). Every rank
    must call it (a forward)."""
    layout = [
        (config.padding_free, _PACKING_CHECKED, check_packed_isolation),
        (shared_prefix_on(config), _SHARING_CHECKED, check_shared_prefix),
    ]
    inner = accelerator.unwrap_model(model) if accelerator is not None else model
    for on, checked, check in layout:
        if on and inner not in checked:
            try:
                check(model, accelerator.device, vocab_size=int(inner.config.vocab_size), name=name)
            except SharedPrefixUnsupported as err:
                if not getattr(config, "_shared_prefix_auto", False):
                    raise
                # auto chose it from the attention implementation; this forward cannot run it (transformers 5.17's
                # Qwen2 keeps no passed prefix): every rank finds the same and trains in the padded layout
                config.shared_prefix = False
                reason = str(err).removeprefix("shared_prefix: ").removesuffix(" Set shared_prefix=False.")
                logger.warning("shared_prefix (auto) is off, the padded layout trains: %s", reason)
                continue
            checked.add(inner)


@torch.no_grad()
def forward_no_grad(
    accelerator: Any,
    model: torch.nn.Module,
    datums: Sequence[Datum],
    config: Any,
    forward: Callable[[torch.nn.Module, MicroBatch, Any], torch.Tensor],
    *,
    pad_token_id: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    name: str = "the model",
) -> list[tuple[list[int], torch.Tensor]]:
    """One no-gradient, eval-mode pass of ``model`` over ``datums``, packed like the update; every rank must call it.

    Args:
        forward: ``forward(model, micro_batch, device) -> (B, T)`` (any layout: :mod:`trl_plugins.modeling`).
        context: A factory of the context the pass runs in (e.g. PEFT adapters off).

    Returns:
        ``(datum indices, (B, T) float output on the CPU)`` per real micro-batch, rows in index order.
    """
    out = []
    was_training = model.training
    model.eval()
    try:
        with context() if context is not None else contextlib.nullcontext():
            ensure_layout_checked(accelerator, model, config, name=name)
            for step in micro_batches(
                accelerator,
                datums,
                local_plan(datums, config),
                pad_token_id=pad_token_id,
                padding_free=bool(config.padding_free),
                shared_prefix=shared_prefix_on(config),
            ):
                result = forward(model, step.batch, accelerator.device)
                if step.datum_indices:
                    out.append((step.datum_indices, result.float().cpu()))
    finally:
        model.train(was_training)
    return out
