"""Sequence parallelism in the policy update: one datum's tokens split over the ranks of a sequence-parallel group
(DeepSpeed's Ulysses attention), everything else in the run unchanged.

``sequence_parallel_size = N`` (or TRL's ``parallelism_config`` with ``sp_size=N``, which the config takes over:
:meth:`~trl_plugins.run.config.MultiTurnGRPOConfig.take_over_parallelism_config`) groups consecutive ranks
``[g N, (g + 1) N)``. Each group trains the same micro-batches (one datum each, planned for ``world / N``
data-parallel groups), and rank ``r`` of a group forwards positions ``[r L, (r + 1) L)`` of the datum padded to
``N L`` tokens: its embeddings, MLPs and the chunked output head on its own ``L`` positions, the attention on all of
them for ``1 / N`` of the heads (Ulysses' two all-to-alls per layer). Its loss is its shard's share of the global
loss (the same global denominators; ``seq_mean_token_mean`` divides by the whole row's token count), so the
gradient summed over every rank is the one-process gradient; DeepSpeed averages it over all ranks and the update
multiplies by the world size, as without sequence parallelism.

Only the update's training forward and its backward (activation checkpointing's recompute included) run split: the
attention interface is redirected inside :func:`split_attention` alone. The no-gradient passes (old, reference and
proximal log-probs, the replay check), the critic's passes, the evaluation and the rollout run whole on each rank,
with their usual layouts and masks (DeepSpeed's own registration discards every attention mask, in eval mode too).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from trl_plugins.trainers.micro_batches import local_plan, plan_for_ranks
from trl_plugins.types import Datum

__all__ = [
    "SequenceParallel",
    "setup_sequence_parallel",
    "split_attention",
    "group_plan",
    "shard_micro_batch",
    "ShardedMicroBatch",
]


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in sequence parallelism."""

    size: int
    """Ranks per group (``sequence_parallel_size``)."""
    rank: int
    """This rank's place in its group: it forwards the datum's ``rank``-th shard."""
    group_index: int
    """Its group (a data-parallel rank of the update's plan, ``process_index // size``)."""
    num_groups: int
    """Groups (data-parallel ranks of the update's plan)."""


_GROUPS: dict[tuple[int, int], Any] = {}
"""The process groups made so far, by ``(world size, group size)``: this rank's group (made once per process)."""
_ROUTE = threading.local()
"""``split``: the attention goes through Ulysses (inside :func:`split_attention`); the attention interface each
redirected implementation had before it."""
_REDIRECTED: dict[str, Any] = {}
"""The attention implementations redirected so far, with their Ulysses module."""


def _group(size: int) -> Any:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    key = (world, size)
    if key not in _GROUPS:
        mine = None
        for g in range(world // size):  # every rank makes every group, in the same order
            group = torch.distributed.new_group(list(range(g * size, (g + 1) * size)))
            if g == rank // size:
                mine = group
        _GROUPS[key] = mine
    return _GROUPS[key]


def setup_sequence_parallel(
    accelerator: Any, model: torch.nn.Module, config: Any, *, policy_loss: Any = None
) -> SequenceParallel | None:
    """Check and set up ``config.sequence_parallel_size`` for ``model`` (the unwrapped policy); every rank must call
    it (it makes the process groups). None when it is 1.

    The model's attention implementation (``sdpa``, flash attention) is redirected to DeepSpeed's
    ``UlyssesSPAttentionHF`` inside :func:`split_attention` only, and to the implementation it had everywhere else.

    Raises:
        ValueError: :func:`check_sequence_parallel` found a problem (every rank alike), or the model has recurrent
            layers (accelerate's check: their state would not cross the shards).
    """
    size = config.features.long_trajectories.sequence_parallel_size
    if size == 1:
        return None
    from trl_plugins.run.parallelism import check_sequence_parallel
    from trl_plugins.trainers.ranks import is_deepspeed

    check_sequence_parallel(
        config,
        model.config,
        world_size=accelerator.num_processes,
        deepspeed=is_deepspeed(accelerator),
        policy_loss=policy_loss,
    )
    from accelerate.big_modeling import _refuse_recurrent_layers_under_sequence_parallelism

    _refuse_recurrent_layers_under_sequence_parallelism(model)
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
    impl = model.config._attn_implementation
    text = model.config.get_text_config()
    if impl not in _REDIRECTED:
        original = ALL_ATTENTION_FUNCTIONS[impl]
        ulysses = UlyssesSPAttentionHF(
            attn=original,
            batch_size=1,
            attn_head_count=text.num_attention_heads,
            attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            kv_head_count=text.num_key_value_heads or text.num_attention_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=_group(size),
            seq_length_is_variable=True,
        )
        ulysses.core_attn_implementation = impl

        def attention(
            module: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            if getattr(_ROUTE, "split", False):
                # One datum per shard row, in order: causal attention over the gathered sequence is its own (the mask
                # transformers built is for the local shard, and Ulysses attends by position).
                return ulysses(module, query, key, value, None, *args, **kwargs)
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[impl] = attention
        _REDIRECTED[impl] = ulysses
    elif _REDIRECTED[impl].world_size != size:
        raise ValueError(
            f"this process already splits {impl!r} attention over {_REDIRECTED[impl].world_size} ranks; "
            f"one sequence_parallel_size per process."
        )
    world = accelerator.num_processes
    return SequenceParallel(
        size=size,
        rank=accelerator.process_index % size,
        group_index=accelerator.process_index // size,
        num_groups=world // size,
    )


@contextlib.contextmanager
def split_attention() -> Iterator[None]:
    """Inside it the redirected attention runs Ulysses (a collective over the group: every member enters it for the
    same forward and backward)."""
    before = getattr(_ROUTE, "split", False)
    _ROUTE.split = True
    try:
        yield
    finally:
        _ROUTE.split = before


class _OneDatumPerMicroBatch:
    """The run's config as the sequence-parallel plan reads it: one datum per micro-batch, the padded layout."""

    max_items_per_micro_batch = 1
    shared_prefix = False

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def group_plan(datums: Sequence[Datum], config: Any, sp: SequenceParallel) -> tuple[list[Datum], list[list[int]]]:
    """``(the datums, this group's micro-batches)``, the same on every member of a group: one datum per micro-batch,
    planned by the configured packer and budget over the group members' datums (with ``rebalance_ranks``: over
    every rank's, for ``sp.num_groups`` data-parallel ranks). A collective (one gather)."""
    from accelerate.utils import gather_object

    parts = gather_object([list(datums)])
    one = _OneDatumPerMicroBatch(config)
    if config.rebalance_ranks:
        everything = [d for part in parts for d in part]
        return everything, plan_for_ranks(everything, one, sp.num_groups)[sp.group_index]
    first = sp.group_index * sp.size
    mine = [d for part in parts[first : first + sp.size] for d in part]
    return mine, local_plan(mine, one)


@dataclass
class ShardedMicroBatch:
    """One rank's shard of a one-datum micro-batch: the forward's inputs and every per-token tensor of the loss, all
    ``(1, L)``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    real: torch.Tensor
    """Positions of the datum (False on the padding that makes the row ``size * L`` long)."""
    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    turn_ids: torch.Tensor | None
    row_tokens: torch.Tensor
    """The whole row's loss tokens, ``(1,)`` (what ``seq_mean_token_mean`` divides a row by)."""
    take: Callable[[torch.Tensor], torch.Tensor]
    """This shard of another ``(B, T)`` tensor of the micro-batch (e.g. importance weights taken on the whole row)."""

    def logprobs(
        self, model: torch.nn.Module, device: Any, *, temperature: float, with_entropy: bool, chunk_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shard's log-probs (and entropies), ``(1, L)``, at its action positions: the forward of its positions,
        inside :func:`split_attention` (every member of the group at once)."""
        from trl_plugins.modeling import token_logprobs_and_entropy

        return token_logprobs_and_entropy(
            model,
            self.input_ids.to(device),
            None,
            self.target_ids.to(device),
            temperature=temperature,
            with_entropy=with_entropy,
            position_ids=self.position_ids.to(device),
            needed=(self.action_mask.bool() & self.real).to(device),
            chunk_size=chunk_size,
        )


def shard_micro_batch(mb: Any, sp: SequenceParallel, *, pad_token_id: int) -> ShardedMicroBatch:
    """Rank ``sp.rank``'s shard of ``mb`` (one datum, padded or padding-free: the same row), padded at its end to a
    multiple of ``sp.size`` so every member's shard is as long.

    Raises:
        ValueError: ``mb`` holds more than one datum.
    """
    real = mb.attention_mask.bool()
    if int(real.any(dim=1).sum()) > 1:
        raise ValueError(
            f"a sequence-parallel micro-batch holds one datum; this one holds {int(real.any(dim=1).sum())}."
        )
    n = int(real.sum())
    length = -(-max(n, 1) // sp.size)
    start, end = sp.rank * length, (sp.rank + 1) * length

    def take(x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        values = x.cpu()[real]  # the datum's positions, in order (either layout keeps (B, T) tensors)
        out = torch.full((length * sp.size,), fill, dtype=values.dtype)
        out[:n] = values
        return out[start:end][None, :]

    def maybe(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else take(x)

    return ShardedMicroBatch(
        input_ids=take(mb.input_ids, pad_token_id),
        position_ids=torch.arange(start, end)[None, :],
        target_ids=take(mb.target_ids, pad_token_id),
        real=take(real.to(torch.long)).bool(),
        action_mask=take(mb.action_mask),
        behaviour_logprobs=take(mb.behaviour_logprobs),
        advantages=take(mb.advantages),
        ref_logprobs=maybe(mb.ref_logprobs),
        old_logprobs=maybe(mb.old_logprobs),
        turn_ids=maybe(mb.turn_ids),
        row_tokens=mb.action_mask.to(torch.float32).sum().reshape(1),
        take=take,
    )
