"""The output projection applied in chunks of positions: log-probs at a target and entropies without ever holding the
vocabulary's logits for every token.

A causal LM's ``.logits`` are ``lm_head(final hidden states)``. :func:`hidden_states_instead_of_logits` runs the
model's own forward (through its wrapper: DDP, DeepSpeed, PEFT) with the output projection passing its input
through, so ``.logits`` is the ``(..., H)`` final hidden states; :func:`chunked_logprobs_and_entropy` then applies the
projection, the temperature, the log-softmax at the target and the entropy to ``chunk_size`` positions at a time,
each chunk's logits recomputed in the backward, so the peak is ``chunk_size x V`` rather than ``T x V``. Under
DeepSpeed ZeRO-3 the head's parameters (PEFT's adapters on it included) are gathered once for the forward
(:func:`head_gathered_once`) and once for the backward, whatever the number of chunks.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

import torch

__all__ = [
    "DEFAULT_LOGPROB_MEMORY_BYTES",
    "auto_chunk_size",
    "logprob_chunk_size",
    "output_head",
    "chunkable",
    "hidden_states_instead_of_logits",
    "head_gathered_once",
    "chunked_logprobs_and_entropy",
]

DEFAULT_LOGPROB_MEMORY_BYTES = 256 * 2**20
"""The memory one chunk's vocabulary-wide tensors may take when the chunk size is chosen automatically (256 MiB)."""

_FLOATS_PER_LOGIT = 4
"""float32 copies of a chunk's ``(chunk, V)`` logits alive at once: the scaled logits, their softmax, the product with
the logits and, in the backward, the logits' gradient."""

_NOT_A_PLAIN_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose ``.logits`` are not ``lm_head(hidden)`` alone (Gemma 2/3's soft-capping, Cohere's and
Granite's scaling): those keep the full-logits path."""


def auto_chunk_size(vocab_size: int, memory_bytes: int = DEFAULT_LOGPROB_MEMORY_BYTES) -> int:
    """Positions per chunk so that a chunk's vocabulary-wide float32 tensors fit ``memory_bytes``: at least 16.
    Qwen2.5's vocabulary (151,936) and the default 256 MiB give 110 positions."""
    return max(16, int(memory_bytes) // (max(int(vocab_size), 1) * 4 * _FLOATS_PER_LOGIT))


def logprob_chunk_size(
    model: torch.nn.Module, size: int | None = None, memory_bytes: int = DEFAULT_LOGPROB_MEMORY_BYTES
) -> int:
    """``size`` when given, else the chunk size :func:`auto_chunk_size` picks for the model's vocabulary (its output
    head's, through any wrapper) and ``memory_bytes``."""
    if size:
        return int(size)
    inner = _unwrapped(model)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    head = output_head(model)
    vocab = getattr(head, "out_features", None) or vocab or 1
    return auto_chunk_size(int(vocab), memory_bytes)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP, DeepSpeed's engine
        model = model.module
    return model


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that maps final hidden states to logits (``lm_head``; PEFT's wrapper of it when adapters sit on
    it), or None where the model names none."""
    inner = _unwrapped(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def chunkable(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its output head applied to the final hidden states and nothing else: not where
    the config transforms them after the head (soft-capping, scaling), nor where someone's forward hooks sit on the
    head (they would meet the hidden states the chunks pass through; DeepSpeed ZeRO-3's own hooks are the ones a
    partitioned head holds, and the chunks run them)."""
    head = output_head(model)
    if head is None:
        return False
    if (head._forward_hooks or head._forward_pre_hooks) and not _zero3_params(head):
        return False
    config = getattr(_unwrapped(model), "config", None)
    for sub in (config, getattr(config, "text_config", None)):
        for key in _NOT_A_PLAIN_HEAD:
            value = getattr(sub, key, None)
            if value not in (None, 1, 1.0):
                return False
    return True


_PASSING = threading.local()
"""Per thread: the heads whose forward passes its input through in this thread (their ``id``s)."""
_INSTALLED: dict[int, int] = {}
"""Per head (``id``): how many threads are inside :func:`hidden_states_instead_of_logits` for it."""
_INSTALL_LOCK = threading.Lock()


_OWN_FORWARD: dict[int, Any] = {}
"""Per head (``id``) with a pass-through installed: the instance ``forward`` it had before (a hook's), if any."""


def _thread_passthrough(head: torch.nn.Module) -> Any:
    original = head.forward  # bound: the class's, or an instance attribute a hook library set

    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if id(head) in getattr(_PASSING, "heads", ()):
            return hidden
        return original(hidden, *args, **kwargs)

    return forward


@contextlib.contextmanager
def hidden_states_instead_of_logits(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within, in this thread: ``model(...).logits`` is the final hidden states (the head's forward passes its input
    through; the module's hooks, DeepSpeed's among them, still run). Yields the head, whose call outside applies it
    as usual. Another thread calling the model meanwhile (a replica generating while it probes pushed weights) gets
    the logits: the pass-through is this thread's only."""
    head = output_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)")
    key = id(head)
    with _INSTALL_LOCK:
        if not _INSTALLED.get(key):
            _OWN_FORWARD[key] = head.__dict__.get("forward")
            head.forward = _thread_passthrough(head)
        _INSTALLED[key] = _INSTALLED.get(key, 0) + 1
    mine = getattr(_PASSING, "heads", frozenset())
    _PASSING.heads = mine | {key}
    try:
        yield head
    finally:
        _PASSING.heads = mine
        with _INSTALL_LOCK:
            _INSTALLED[key] -= 1
            if not _INSTALLED[key]:
                del _INSTALLED[key]
                own = _OWN_FORWARD.pop(key)
                if own is None:
                    del head.forward
                else:
                    head.forward = own


def _chunk(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # The head's forward, not its module hooks: ZeRO-3's gather and release are the chunks' own (head_gathered_once,
    # _HeadChunks); a head with submodules still runs theirs.
    z = head.forward(hidden)
    if temperature != 1.0:
        z = z / temperature
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    log_z = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    return logp, log_z - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


# -- DeepSpeed ZeRO-3: the head's partitioned parameters, gathered once per forward and once per backward ----------

_HOLDS = itertools.count(1)


def _zero3_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if hasattr(p, "ds_id")]  # partitioned by DeepSpeed ZeRO-3


def _gather(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """All-gather (one collective) those of ``params`` that are partitioned now; returns them."""
    if not params:  # no ZeRO-3 (DeepSpeed is not even imported)
        return []
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather(param_list=missing)
    return missing


def _release(params: list[torch.nn.Parameter]) -> None:
    """Partition again those of ``params`` that are gathered, not persistent and held by no module."""
    if not params:
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    done = [
        p
        for p in params
        if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist and not p.ds_active_sub_modules
    ]
    if done:
        done[0].partition(param_list=done)


@contextlib.contextmanager
def _held(params: list[torch.nn.Parameter]) -> Iterator[None]:
    # ZeRO-3: a holder no module is: DeepSpeed's hooks release a parameter only when no module holds it
    # (ds_active_sub_modules), so theirs leave these gathered.
    key = -next(_HOLDS)  # modules' ds_ids count up from 0
    for p in params:
        p.ds_active_sub_modules.add(key)
    try:
        yield
    finally:
        for p in params:
            p.ds_active_sub_modules.discard(key)


@contextlib.contextmanager
def head_gathered_once(head: torch.nn.Module) -> Iterator[None]:
    """Within, under DeepSpeed ZeRO-3: the head's parameters, once gathered (by the module hooks of the model's
    forward: the head's, or the input embedding's where they are tied), stay gathered; on leaving, those that were
    partitioned on entering are partitioned again (a block that holds the full weights, as generation's, keeps
    them). Elsewhere a no-op. DeepSpeed's hooks release a parameter only when no module holds it
    (``ds_active_sub_modules``): this context holds it under a key no module has, so the chunks after the model's
    forward find it gathered instead of gathering it once more."""
    params = _zero3_params(head)
    if not params:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    try:
        with _held(params):
            yield
    finally:
        _release(partitioned)


def _self_contained(head: torch.nn.Module) -> bool:
    # A head without submodules (nn.Linear; tied or not): its forward uses its own parameters only, so calling it
    # without its module hooks (DeepSpeed's gather and release among them) computes the same thing.
    return next(head.children(), None) is None


def _random(head: torch.nn.Module) -> bool:
    # A dropout that draws (PEFT's lora_dropout in training): the backward's recompute must draw the same masks.
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in head.modules())


def _rng_states(device: torch.device) -> tuple[Any, Any]:
    accelerator = getattr(torch, device.type, None) if device.type != "cpu" else None
    return torch.get_rng_state(), (accelerator.get_rng_state(device) if accelerator is not None else None)


@contextlib.contextmanager
def _replayed_rng(states: tuple[Any, Any] | None, device: torch.device) -> Iterator[None]:
    if states is None:
        yield
        return
    devices = [device] if states[1] is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(states[0])
        if devices:
            getattr(torch, device.type).set_rng_state(states[1], device)
        yield


class _HeadChunks(torch.autograd.Function):
    """The chunks' log-probs and entropies, ``(N,)`` each, with the head's parameters as inputs: the forward keeps
    only ``hidden`` and ``targets``; the backward recomputes each chunk's logits and sums its parameters' gradients,
    so each parameter gets one gradient per micro-batch (one reduce hook under DDP or ZeRO-3) and, under ZeRO-3, one
    gather for all the backward's chunks. A head without submodules runs its ``forward`` (not its module hooks);
    another (PEFT's adapters on ``lm_head``) runs its ``forward``, whose submodules' hooks find their parameters held
    gathered, with the forward's random state replayed for the recompute (an adapter's dropout)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, temperature, with_entropy, chunk_size, release_token, *params):
        ctx.save_for_backward(hidden, targets)
        ctx.head, ctx.temperature, ctx.with_entropy, ctx.chunk_size = head, temperature, with_entropy, chunk_size
        ctx.release_token = release_token
        ctx.rng = _rng_states(hidden.device) if _random(head) else None
        logps, entropies = [], []
        for start in range(0, hidden.shape[0], chunk_size):
            lp, ent = _chunk(
                head, hidden[start : start + chunk_size], targets[start : start + chunk_size], temperature, with_entropy
            )
            logps.append(lp)
            entropies.append(ent)
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, targets = ctx.saved_tensors
        head = ctx.head
        params = [p for p, needs in zip(head.parameters(), ctx.needs_input_grad[7:]) if needs]
        want_hidden = ctx.needs_input_grad[0]
        partitioned = _zero3_params(head)
        _gather(partitioned)
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None
        grad_params = [None] * len(params)
        with _held(partitioned), _replayed_rng(ctx.rng, hidden.device):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                end = start + ctx.chunk_size
                h = hidden[start:end].detach().requires_grad_(want_hidden)
                with torch.enable_grad():
                    lp, ent = _chunk(head, h, targets[start:end], ctx.temperature, ctx.with_entropy)
                outputs, grads = [lp], [grad_logp[start:end]]
                if ctx.with_entropy and grad_entropy is not None:
                    outputs.append(ent)
                    grads.append(grad_entropy[start:end])
                inputs = ([h] if want_hidden else []) + params
                got = list(torch.autograd.grad(outputs, inputs, grads, allow_unused=True))
                if want_hidden:
                    grad_hidden[start:end] = got.pop(0)
                for k, g in enumerate(got):
                    if g is not None:
                        grad_params[k] = g if grad_params[k] is None else grad_params[k].add_(g)
        token = ctx.release_token
        grad_params = iter(grad_params)
        return (
            grad_hidden,
            None,
            None,
            None,
            None,
            None,
            None if token is None else torch.zeros_like(token),
            *[next(grad_params) if needs else None for needs in ctx.needs_input_grad[7:]],
        )


class _ReleaseAfterBackward(torch.autograd.Function):
    """ZeRO-3: passes a scalar token to :class:`_HeadChunks`; its backward, which the chunks' backward makes ready at
    the same time as their parameters' gradient accumulation, runs after it (torch runs ``AccumulateGrad`` nodes
    first, and DeepSpeed's reduce hooks with them) and partitions the head's parameters again. Releasing inside the
    chunks' backward would partition them before their gradients reached them."""

    @staticmethod
    def forward(ctx, token, params):
        ctx.params = params
        return token.view_as(token)

    @staticmethod
    def backward(ctx, grad):
        _release(ctx.params)
        return grad, None


def chunked_logprobs_and_entropy(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_size: int,
    hooks_release: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and (``with_entropy``) entropies from ``(N, H)`` final hidden states, ``(N,)`` each,
    ``chunk_size`` rows at a time; only the hidden rows and the two ``(N,)`` results are kept for the backward, which
    recomputes each chunk's logits.

    The chunks run as one autograd function: under DeepSpeed ZeRO-3 the head's parameters (its adapters' too) are
    gathered once for the forward's chunks (inside :func:`head_gathered_once`: the gather of the model's forward) and
    once for the backward's, whose gradient reaches each parameter once. ``hooks_release``: ``hidden`` came out of the
    head's own call (:func:`hidden_states_instead_of_logits`), whose ZeRO-3 backward hooks then find the parameters
    gathered and release them (a head without submodules: its hooks hold its parameters); otherwise they are
    partitioned again once their gradients have accumulated (:class:`_ReleaseAfterBackward`)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if not hidden.shape[0]:
        empty = hidden.new_zeros(
            (0,), dtype=torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
        )
        return empty, (empty if with_entropy else None)
    params = list(head.parameters())
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    partitioned = _zero3_params(head)
    with head_gathered_once(head):
        _gather(partitioned)  # normally gathered already; the autograd function records full shapes
        if grad:
            token = None
            if partitioned and not (hooks_release and hidden.requires_grad and _self_contained(head)):
                # No module hook will release them after the backward (the head's own, with its parameters, does).
                token = _ReleaseAfterBackward.apply(
                    torch.zeros((), device=hidden.device, requires_grad=True), partitioned
                )
            logp, entropy = _HeadChunks.apply(
                hidden, targets, head, temperature, with_entropy, chunk_size, token, *params
            )
        else:
            with torch.no_grad():
                logp, entropy = _HeadChunks.forward(
                    _NoContext(), hidden, targets, head, temperature, with_entropy, chunk_size, None
                )
    return logp, (entropy if with_entropy else None)


class _NoContext:
    """Stands in for an autograd context where no gradient is taken."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass
