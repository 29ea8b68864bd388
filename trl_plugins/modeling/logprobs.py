"""Forward passes shared by the rollout (replay check) and the trainer: per-token log-probs (with the chunked head,
:mod:`.chunked_head`, where the vocabulary is large), in every micro-batch layout."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from trl_plugins.modeling.chunked_head import (
    auto_chunk_size,
    chunkable,
    chunked_logprobs_and_entropy,
    head_gathered_once,
    hidden_states_instead_of_logits,
    output_head,
)
from trl_plugins.modeling.dropout import disable_dropout, dropout_probabilities

__all__ = [
    "full_logits_logprobs",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "selective_log_softmax",
    "micro_batch_logprobs",
    "micro_batch_logprobs_and_divergence",
    "hidden_rows",
    "scatter_chunked",
    "needed_positions",
    "scatter_positions",
    "model_inputs",
    "unpack",
    "PackedAttentionLeak",
    "check_packed_isolation",
    "SharedPrefixUnsupported",
    "shared_prefix_outputs",
    "take_positions",
    "gather_positions",
    "check_shared_prefix",
    "dropout_probabilities",
    "disable_dropout",
]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full log-softmax twice.

    Args:
        logits: ``(B, T, V)``.
        index: ``(B, T)`` token ids.

    Returns:
        ``(B, T)`` log-probs, in float32 at least.
    """
    logits = _at_least_float32(logits)
    picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``target_ids`` under ``model`` at temperature ``temperature``: ``(B, T)``.

    Position ``t`` scores ``target_ids[:, t]`` from ``input_ids[:, : t + 1]`` (the datum layout). The
    logits are divided by ``temperature`` first, matching behaviour log-probs taken from the
    temperature-scaled sampling distribution.
    """
    return token_logprobs_and_entropy(
        model, input_ids, attention_mask, target_ids, temperature=temperature, with_entropy=False
    )[0]


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    position_ids: torch.Tensor | None = None,
    needed: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` and, with ``with_entropy``, the entropy of the whole next-token
    distribution at each position, ``H_t = logsumexp(z) - sum softmax(z) z`` with ``z = logits / temperature``
    (the distribution the tokens were sampled from), both ``(B, T)``; the entropy carries the gradient.
    ``position_ids`` (with ``attention_mask=None``): packed sequences, see :func:`micro_batch_logprobs`.

    The forward stops at the final hidden states and the output projection runs ``chunk_size`` positions at a time
    (:mod:`.chunked_head`; None: :func:`~.chunked_head.auto_chunk_size`), only at the
    ``needed`` positions (``(B, T)`` bool; None: every position), the others 0. A model whose logits are more than
    its head's output (soft-capping, logit scaling) takes the full logits (:func:`~.chunked_head.chunkable`).
    """
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    if not chunkable(model):
        return full_logits_logprobs(
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits,
            target_ids,
            temperature,
            with_entropy,
        )
    with head_gathered_once(output_head(model)):  # ZeRO-3: one gather for the model's forward and the chunks
        with hidden_states_instead_of_logits(model) as head:
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        return scatter_chunked(
            head,
            hidden.flatten(0, -2),
            target_ids,
            needed,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
        )


def full_logits_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature != 1.0:
        logits = logits / temperature
    logp = selective_log_softmax(logits, target_ids)
    if not with_entropy:
        return logp, None
    z = _at_least_float32(logits)
    return logp, _entropy(z, torch.logsumexp(z, dim=-1))


def scatter_chunked(
    head: torch.nn.Module,
    rows: torch.Tensor,
    target_ids: torch.Tensor,
    needed: torch.Tensor | None,
    *,
    temperature: float,
    with_entropy: bool,
    chunk_size: int | None,
    row_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``target_ids`` at the ``needed`` positions from final hidden states, by
    :func:`~.chunked_head.chunked_logprobs_and_entropy`, scattered into ``target_ids``' shape (0 elsewhere): ``rows``
    ``(n, H)``; position ``(b, t)`` reads ``rows[row_index[b, t]]`` (default: the flat position itself)."""
    shape = target_ids.shape
    needed = (
        torch.ones(shape, dtype=torch.bool, device=rows.device) if needed is None else needed.to(rows.device).bool()
    )
    where, source, keep = needed_positions(needed, row_index, rows.device)
    size = chunk_size or auto_chunk_size(int(getattr(head, "out_features", 0) or head.weight.shape[0]))
    logp, entropy = chunked_logprobs_and_entropy(
        head,
        rows[source],
        target_ids.to(rows.device).reshape(-1)[where],
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_size=size,
        hooks_release=True,
    )
    keep = keep.to(logp.dtype)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return scatter_positions(values * keep, where, shape)

    return scatter(logp), None if entropy is None else scatter(entropy)


def needed_positions(
    needed: torch.Tensor, row_index: torch.Tensor | None, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(where, source, keep)`` for the ``needed`` positions of a ``(B, T)`` micro-batch: their flat indices, the
    hidden-state row that scores each (``row_index[b, t]``; default the flat position itself) and which of them are
    really needed (bool). A micro-batch with none takes its first position alone, to be zeroed by ``keep``: the
    graph (and every head parameter's gradient, 0) is kept."""
    flat = needed.reshape(-1).to(device).bool()
    chosen = flat
    if not bool(flat.any()):
        chosen = torch.zeros_like(flat)
        chosen[0] = True
    where = chosen.nonzero().squeeze(-1)
    source = where if row_index is None else row_index.to(device).reshape(-1)[where]
    return where, source, flat[where]


def scatter_positions(values: torch.Tensor, where: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-position ``values`` at the flat indices ``where`` (:func:`needed_positions`) of a ``shape`` tensor, 0
    elsewhere."""
    return values.new_zeros(shape.numel()).index_put((where,), values).reshape(shape)


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _entropy(z: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    # H = logsumexp(z) - sum softmax(z) z, per position, from the logits and their logsumexp.
    return log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


# -- padding-free micro-batches --------------------------------------------------------------------


def model_inputs(mb: Any, device: Any) -> dict[str, Any]:
    """The forward's inputs for a :class:`~trl_plugins.types.MicroBatch`: the padded ``(B, T)`` ids and mask,
    or padding-free the real tokens as one ``(1, N)`` row with their per-datum position ids and no 2-D mask
    (transformers then builds a block-diagonal causal mask from the restarting positions, or runs
    flash-attention's variable-length kernel)."""
    if mb.position_ids is None:
        return {"input_ids": mb.input_ids.to(device), "attention_mask": mb.attention_mask.to(device)}
    real = mb.attention_mask.bool()
    return {
        "input_ids": mb.input_ids[real][None, :].to(device),
        "attention_mask": None,
        "position_ids": mb.position_ids.to(device),
    }


def unpack(values: torch.Tensor, mb: Any) -> torch.Tensor:
    """Per-token ``values`` of a padding-free forward, ``(1, N)``, back in the micro-batch's ``(B, T)`` layout
    (0 on padding; differentiable); padded micro-batches' values are returned as they are."""
    if mb.position_ids is None:
        return values
    out = values.new_zeros(mb.attention_mask.shape)
    out[mb.attention_mask.to(values.device).bool()] = values.reshape(-1)
    return out


def micro_batch_logprobs(
    model: torch.nn.Module,
    mb: Any,
    device: Any,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    needed: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_and_entropy` of a micro-batch in any layout (padded, padding-free, shared-prefix),
    returned as ``(B, T)``; ``needed`` (``(B, T)``, e.g. the action mask; None: every real position) says where
    log-probs and entropies are computed, 0 elsewhere."""
    real = mb.attention_mask.bool()
    needed = real if needed is None else needed.bool() & real
    if mb.shared_prefix is not None:
        return _shared_prefix_logprobs(
            model, mb, device, temperature=temperature, with_entropy=with_entropy, needed=needed, chunk_size=chunk_size
        )
    inputs = model_inputs(mb, device)
    targets = mb.target_ids if mb.position_ids is None else mb.target_ids[real][None, :]
    logp, entropy = token_logprobs_and_entropy(
        model,
        inputs["input_ids"],
        inputs["attention_mask"],
        targets.to(device),
        temperature=temperature,
        with_entropy=with_entropy,
        position_ids=inputs.get("position_ids"),
        needed=needed if mb.position_ids is None else needed[real][None, :],
        chunk_size=chunk_size,
    )
    return unpack(logp, mb), None if entropy is None else unpack(entropy, mb)


def micro_batch_logprobs_and_divergence(
    model: torch.nn.Module,
    teacher: torch.nn.Module,
    mb: Any,
    device: Any,
    *,
    beta: float,
    temperature: float = 1.0,
    with_entropy: bool = False,
    needed: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`micro_batch_logprobs` and the generalised JSD between ``model``'s and ``teacher``'s next-token
    distributions at the ``needed`` positions, ``(B, T)``, 0 elsewhere, with gradient to ``model`` only: TRL's
    ``ChunkedDivergenceFunction`` (what ``DistillationTrainer``'s ``_chunked_divergence_loss`` runs) on both models'
    final hidden states and output heads, so neither ``(positions, vocabulary)`` logits exist in full; ``beta`` 0 is
    the forward KL(teacher || model), 1 the reverse KL, both logits divided by ``temperature``.

    ``model`` forwards ``mb`` in its layout (padded, padding-free or shared-prefix); the teacher, without gradient,
    the micro-batch's right-padded ``(B, T)`` rows (every real position scores the same in every layout; the teacher
    is not checked for the other two). Both must be :func:`~.chunked_head.chunkable` (logits = the head's output).
    """
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    real = mb.attention_mask.bool()
    needed = real if needed is None else needed.bool() & real
    with torch.no_grad(), hidden_states_instead_of_logits(teacher) as teacher_head:
        teacher_rows = teacher(
            input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device), use_cache=False
        ).logits.flatten(0, -2)
    with head_gathered_once(output_head(model)):
        with hidden_states_instead_of_logits(model) as head:
            rows, row_index = hidden_rows(model, mb, device)
        logp, entropy = scatter_chunked(
            head,
            rows,
            mb.target_ids,
            needed,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
            row_index=row_index,
        )
        where, source, keep = needed_positions(needed, row_index, rows.device)
        divergence, _ = ChunkedDivergenceFunction.apply(
            rows[source],
            head.weight,
            head.bias,
            teacher_rows[where],
            teacher_head.weight,
            teacher_head.bias,
            beta,
            temperature,
        )
    return logp, entropy, scatter_positions(divergence * keep.to(divergence.dtype), where, needed.shape)


def hidden_rows(model: torch.nn.Module, mb: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows (n, H), row_index)``: the final hidden states of a micro-batch's forward in its layout (inside
    :func:`~.chunked_head.hidden_states_instead_of_logits`), and the row that scores each ``(b, t)`` position (None:
    the flat position)."""
    if mb.shared_prefix is not None:
        return torch.cat(shared_prefix_outputs(model, mb.shared_prefix, device)), mb.shared_prefix.index
    rows = model(**model_inputs(mb, device), use_cache=False).logits.flatten(0, -2)
    if mb.position_ids is None:
        return rows, None
    real = mb.attention_mask.bool().reshape(-1)
    return rows, (real.cumsum(0) - 1).clamp(min=0).reshape(mb.attention_mask.shape)  # the packed row's order


def _output_gap(model: torch.nn.Module, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, Any]:
    """``(largest gap, tolerance, attention implementation)`` of a layout check: 1e-4 of the outputs' scale in fp32,
    5e-2 in half precision."""
    scale = 1.0 + float(want.float().abs().max())
    gap = float((got.float() - want.float()).abs().max())
    tolerance = (1e-4 if want.dtype == torch.float32 else 5e-2) * scale
    return gap, tolerance, getattr(getattr(model, "config", None), "_attn_implementation", None)


class PackedAttentionLeak(ValueError):
    """The model's attention does not keep packed sequences apart: padding-free micro-batches would mix datums."""


@torch.no_grad()
def check_packed_isolation(model: torch.nn.Module, device: Any, *, vocab_size: int, name: str = "the model") -> float:
    """Check that ``model`` attends within each packed sequence only; return the largest output gap found.

    Runs a 24-token and a 9-token sequence packed into one row (positions restarting) and the 9-token one on
    its own; the second's outputs (``.logits``: next-token logits, or a critic's values) must agree to 1e-4
    of their scale in fp32 (5e-2 in half precision). Every rank must call it (under ZeRO-3 a forward is a
    collective). Attention that ignores the positions' restarts (a model whose masking does not go through
    transformers' ``masking_utils``, a custom attention function) lets the second sequence see the first,
    and is refused.

    Raises:
        PackedAttentionLeak: the packed forward differs; the message says what to do.
    """
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(1, max(vocab_size, 2), (24,), generator=gen)
    second = torch.randint(1, max(vocab_size, 2), (9,), generator=gen)
    was_training = model.training
    model.eval()
    try:
        packed = model(
            input_ids=torch.cat([first, second])[None, :].to(device),
            attention_mask=None,
            use_cache=False,
            position_ids=torch.cat([torch.arange(24), torch.arange(9)])[None, :].to(device),
        ).logits[0, 24:]
        alone = model(input_ids=second[None, :].to(device), attention_mask=None, use_cache=False).logits[0]
    finally:
        model.train(was_training)
    gap, tolerance, impl = _output_gap(model, packed, alone)
    if not gap <= tolerance:
        raise PackedAttentionLeak(
            f"padding-free micro-batches: {name} (attention implementation {impl!r}) does not keep packed sequences "
            f"apart - a sequence packed after another gets outputs {gap:.3g} away from its own (tolerance "
            f"{tolerance:.3g}). Set padding_free=False (right-padded micro-batches), or load the model with an "
            f"attention implementation that honours packed position ids (sdpa, eager, flash_attention_2)."
        )
    return gap


# -- the shared-prefix layout ----------------------------------------------------------------------


class SharedPrefixUnsupported(ValueError):
    """The model cannot run the shared-prefix layout (its forward ignores the key/value states it is given, or keeps
    no gradient through them); the message says what to do."""


def _cache_layer_types() -> tuple[type, type]:
    from transformers.cache_utils import DynamicLayer

    class Captured(DynamicLayer):
        """Keeps the states of the forward it is given (the prefix's); stores nothing across calls, so the replay of
        an activation-checkpointed layer in the backward finds the same (it overwrites them with equal ones)."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            return key_states, value_states

        def get_seq_length(self) -> int:
            return 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length, 0

    class Prefixed(DynamicLayer):
        """The prefix's states in front of each forward's own, without storing the result: a pure function of its
        inputs, so activation checkpointing may replay it."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.is_initialized = keys, values, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return Captured, Prefixed


@contextlib.contextmanager
def _states_through_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    # transformers' activation-checkpointed layers drop a cache they are passed (a cache that stores would be written
    # twice by the backward's replay); ours store nothing, so each layer is told it may keep it, for these forwards.
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            vars(layer).pop("_can_checkpoint_with_cache", None)


def _reentrant_checkpointing(model: torch.nn.Module) -> bool:
    # A layer checkpointed with use_reentrant=True (transformers' partial of torch's checkpoint) runs its forward
    # without a graph: the states it computes would carry no gradient back from the branches. (Whether the states
    # require a gradient cannot tell: with adapters on some projections only, the first layer's keys need none.)
    from transformers.modeling_layers import GradientCheckpointingLayer

    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing and layer.training:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant", False):
                return True
    return False


def _first_forward_module(model: torch.nn.Module) -> torch.nn.Module:
    # Under DDP one forward per backward goes through the wrapper (it readies the gradient reduction); the prefix
    # forward runs on the module inside, its gradients reaching the same parameters in the same backward.
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def shared_prefix_outputs(model: torch.nn.Module, layout: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``.logits`` (next-token logits, or a critic's values) at every position of a micro-batch in the
    shared-prefix layout (:class:`~trl_plugins.types.SharedPrefixLayout`): the prefix forward's ``(K * P, ...)`` and
    the branch forward's ``(B * Tb, ...)``, the two parts of the flat positions ``layout.index`` points into (kept
    apart: concatenating the logits would copy the largest activation); :func:`take_positions` and
    :func:`gather_positions` put them in the datums' ``(B, T)`` layout.

    Two forwards: the prefixes, keeping their key/value states; the branches, each reading its prefix's states
    (gradients flow back into them) with a mask over its prefix columns and its own tokens, at positions continuing
    from its prefix (a sliding window applies by position, as in one sequence). Works under activation checkpointing
    (non-reentrant), DDP and DeepSpeed; every rank runs both forwards for every micro-batch.

    Raises:
        SharedPrefixUnsupported: the forward kept no states, or (training) no gradient through them.
    """
    from transformers.cache_utils import Cache

    captured_type, prefixed_type = _cache_layer_types()
    width = layout.prefix_ids.shape[1]
    with _states_through_checkpointing(model):
        captured = Cache(layer_class_to_replicate=captured_type)
        prefix = _first_forward_module(model)(
            input_ids=layout.prefix_ids.to(device),
            attention_mask=layout.prefix_mask.to(device),
            position_ids=layout.prefix_positions.to(device),
            cache=captured,
            use_cache=False,
        ).logits
        states = [(layer.keys, layer.values) for layer in captured.layers]
        if not states or any(k is None or k.shape[-2] != width for k, _ in states):
            raise SharedPrefixUnsupported(
                f"shared_prefix: {type(model).__name__}'s forward kept no key/value states of the prefix (it ignores "
                f"the cache it is passed). Set shared_prefix=False."
            )
        if torch.is_grad_enabled() and _reentrant_checkpointing(model):
            raise SharedPrefixUnsupported(
                "shared_prefix: the prefix's key/value states carry no gradient (reentrant activation checkpointing "
                "computes them without one, and the branches' gradient would never reach the prefix). Set "
                "activation_checkpointing_kwargs={'use_reentrant': False}, or shared_prefix=False."
            )
        rows = layout.row_prefix.to(device)
        reused = Cache(layers=[prefixed_type(k.index_select(0, rows), v.index_select(0, rows)) for k, v in states])
        branch = model(
            input_ids=layout.branch_ids.to(device),
            attention_mask=layout.branch_mask.to(device),
            position_ids=layout.branch_positions.to(device),
            cache=reused,
            use_cache=False,
        ).logits
    return prefix.flatten(0, 1), branch.flatten(0, 1)


def take_positions(parts: tuple[torch.Tensor, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """``cat(parts)[index]`` without concatenating: rows of the prefix part where ``index`` points below its length,
    of the branch part after it (differentiable; ``index`` of any shape, the rows' trailing dims kept)."""
    prefix, branch = parts
    index = index.to(prefix.device)
    n = prefix.shape[0]
    from_prefix = (index < n).reshape(index.shape + (1,) * (prefix.dim() - 1))
    return torch.where(from_prefix, prefix[index.clamp(max=n - 1)], branch[(index - n).clamp(min=0)])


def gather_positions(parts: tuple[torch.Tensor, torch.Tensor], mb: Any) -> torch.Tensor:
    """Per-position values of the two forwards (:func:`shared_prefix_outputs`, each part ``(n,)``) in the micro-batch's
    ``(B, T)`` layout, 0 on padding (differentiable)."""
    values = take_positions(parts, mb.shared_prefix.index)
    return torch.where(mb.attention_mask.to(values.device).bool(), values, torch.zeros_like(values))


def _shared_prefix_logprobs(
    model: torch.nn.Module,
    mb: Any,
    device: Any,
    *,
    temperature: float,
    with_entropy: bool,
    needed: torch.Tensor,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not chunkable(model):
        return _shared_prefix_full_logits(model, mb, device, temperature=temperature, with_entropy=with_entropy)
    with head_gathered_once(output_head(model)):  # ZeRO-3: one gather for both forwards and the chunks
        with hidden_states_instead_of_logits(model) as head:
            parts = shared_prefix_outputs(model, mb.shared_prefix, device)
        # A prefix's last position is read by each of its branches, each with its own target: the hidden row is taken
        # per datum position (the chunks run over those), so a chunk may end anywhere inside a branch.
        rows = torch.cat(parts)
        return scatter_chunked(
            head,
            rows,
            mb.target_ids,
            needed,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size,
            row_index=mb.shared_prefix.index,
        )


def _shared_prefix_full_logits(
    model: torch.nn.Module, mb: Any, device: Any, *, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    parts = shared_prefix_outputs(model, mb.shared_prefix, device)
    if temperature != 1.0:
        parts = tuple(p / temperature for p in parts)
    z = tuple(_at_least_float32(p) for p in parts)
    log_z = tuple(torch.logsumexp(p, dim=-1) for p in z)
    index, targets = mb.shared_prefix.index.to(device), mb.target_ids.to(device)
    # The target differs between branches at a prefix's last position, so the picked logit is gathered per datum
    # position (the normaliser, per forwarded position).
    n = z[0].shape[0]
    from_prefix = index < n
    picked = torch.where(from_prefix, z[0][index.clamp(max=n - 1), targets], z[1][(index - n).clamp(min=0), targets])
    real = mb.attention_mask.to(device).bool()
    logp = torch.where(real, picked - take_positions(log_z, index), torch.zeros_like(picked))
    if not with_entropy:
        return logp, None
    return logp, gather_positions(tuple(_entropy(p, lz) for p, lz in zip(z, log_z)), mb)


@torch.no_grad()
def check_shared_prefix(model: torch.nn.Module, device: Any, *, vocab_size: int, name: str = "the model") -> float:
    """Check that ``model`` gives the same outputs in the shared-prefix layout as forwarding each sequence whole;
    return the largest gap. Two trees (20 tokens shared by sequences 4 and 11 longer, 7 by sequences 3 and 6 longer,
    so one prefix is left-padded) and a sequence that shares nothing, against the same five right-padded; fp32 to 1e-4
    of their scale (5e-2 in half precision). Every rank must call it (a forward is a collective under ZeRO-3).

    Raises:
        SharedPrefixUnsupported: the outputs differ (attention that ignores the prefix's states or the positions
            it is given), or the forward kept no states.
    """
    from trl_plugins.datum import shared_prefix_layout

    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, max(vocab_size, 2), (n,), generator=gen).tolist()

    rows = []
    for shared, extra in ((tokens(20), (4, 11)), (tokens(7), (3, 6))):
        rows += [shared + tokens(n) for n in extra]
    rows.append(tokens(9))
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
    layout = shared_prefix_layout(rows, pad_token_id=0)
    was_training = model.training
    model.eval()
    try:
        whole = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        tree = take_positions(shared_prefix_outputs(model, layout, device), layout.index)
    finally:
        model.train(was_training)
    real = mask.to(device).bool()
    gap, tolerance, impl = _output_gap(model, tree[real], whole[real])
    if not gap <= tolerance:
        raise SharedPrefixUnsupported(
            f"shared_prefix: {name} (attention implementation {impl!r}) gives outputs {gap:.3g} away from forwarding "
            f"each sequence whole when a shared prefix is forwarded once (tolerance {tolerance:.3g}): its attention "
            f"does not read the prefix's key/value states with the mask and positions it is given. Set "
            f"shared_prefix=False, or load the model with sdpa or eager attention."
        )
    return gap
