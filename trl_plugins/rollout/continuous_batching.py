"""A generation backend on transformers' continuous batching (``model.init_continuous_batching``).

Each turn is its own request (token ids in; sampled ids and behaviour log-probs out; its own budget and stop
tokens), so the rollout engine submits a trajectory's next turn as soon as its tool result is in, while other
trajectories keep generating: the manager batches whatever requests are live at each forward, over a paged
KV cache. It needs no extra dependency (it ships with transformers) and pays off on a GPU; on a CPU with a
tiny model HF ``generate`` is as fast or faster (``benchmarks/generation.py``).

What this module adds to the manager, and why:

- **Per-turn seeds.** The manager samples with ``torch.multinomial`` on torch's global generator (and seeds
  that generator when it builds its batch processor), so what a turn samples would depend on which requests
  shared its forward. :class:`_SeededCBSampler` is a continuous-batching logits processor that samples each
  row by Gumbel-max with the same keyed noise as :class:`~trl_plugins.rollout.backends.HFGenerationBackend`
  (:func:`~trl_plugins.rollout.sampling.seeded_row_keys` of the turn's seed and the index of the token in the
  turn), and returns scores whose argmax is that sample; the manager decodes greedily. Same weights, same
  seeds: the same tokens as the HF backend. The global generator is restored after the manager seeds it.
- **Behaviour log-probs of the temperature-scaled distribution** (``LogprobSource.TEMPERATURE_SCALED``, as the
  HF backend and the trainer compute them): the processor keeps ``log_softmax(logits / T)`` of each sampled
  token, and a wrapper around the model runner's ``_sample`` writes them where the manager stores log-probs
  (the one override of transformers' internals here; ``tests/test_continuous_batching.py`` pins its signature).
- **Fresh weights every rollout.** The manager may live across steps (``keep_cache``), but its prefix cache
  would hand a new rollout key/value blocks computed with the previous weights; the cache's ledgers are
  cleared at the start of every session.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
from typing import Any, Iterator, Sequence

import torch

from trl_plugins.rollout.backends import (
    BackendBase,
    Sample,
    check_generate_args,
    cut_at_stop,
    cut_sample,
    unwrapped_for_generation,
)
from trl_plugins.rollout.cb_cache import (
    CacheFootprint,
    cache_footprint,
    check_cache_fits,
    continuous_batching_config,
    workload_cache_size,
)
from trl_plugins.rollout.sampling import Warp, gumbel_from_keys, seeded_row_keys
from trl_plugins.rollout.stops import StopStrings
from trl_plugins.rollout.weights import weights_digest
from trl_plugins.types import SamplingSettings

__all__ = [
    "ContinuousBatchingBackend",
    "continuous_batching_config",
    "workload_cache_size",
    "CacheFootprint",
    "cache_footprint",
    "check_cache_fits",
    "CB_SAMPLE_SIGNATURE",
]

# The private method wrapped here: ModelRunner._sample(self, scores, output_ids) (transformers 5.24).
CB_SAMPLE_SIGNATURE = "(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None"


def _cb_processor_base() -> type:
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    return ContinuousBatchingLogitsProcessor


def _to_int32(key: int) -> int:
    return key - (1 << 32) if key >= (1 << 31) else key


class _SeededCBSampler:
    """Samples each row of a continuous-batching forward with its own seed; see the module docstring.

    ``rows`` maps a request id to ``(seed, prompt length)``; ``prepare_tensor_args`` turns each row into its
    32-bit noise key (the token's index in the turn is the request's sequence length minus its prompt), which
    travels with the batch; ``__call__`` samples and keeps the log-probs in ``self.logprobs`` for
    ``_sample``, which runs right after it on the same forward.
    """

    supported_kwargs: dict[str, type] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, sampling: SamplingSettings) -> None:
        self.use(sampling)
        self.rows: dict[str, tuple[int, int]] = {}
        self.logprobs: torch.Tensor | None = None

    def use(self, sampling: SamplingSettings) -> None:
        """Sample with ``sampling`` from now on (a manager kept between rollouts serves several settings)."""
        self.sampling = sampling
        self.warp = None if sampling.temperature == 0 else Warp(sampling)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        seeds, positions = [], []
        for future in requests_with_new_token:
            state = future.state
            seed, prompt_len = self.rows.get(
                state.request_id, (0, 0)
            )  # a row cancelled at a stop string: its last forward
            seeds.append(seed)
            positions.append(state.position_offset - prompt_len)  # 0 for the turn's first sampled token
        if not seeds:
            return torch.zeros(0, dtype=torch.int32)
        keys = seeded_row_keys(torch.tensor(seeds, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64))
        return torch.tensor([_to_int32(int(k)) for k in keys], dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        logits = scores.float()
        if self.warp is None:
            logp = torch.log_softmax(logits, dim=-1)
            chosen = logits.argmax(dim=-1, keepdim=True)
        else:
            logp = torch.log_softmax(logits / self.sampling.temperature, dim=-1)
            keys = tensor_arg[: logits.shape[0]].to(torch.int64) & 0xFFFFFFFF
            noise = gumbel_from_keys(keys, logits.shape[-1]).to(logits.dtype)
            chosen = (torch.log_softmax(self.warp(None, logits), dim=-1) + noise).argmax(dim=-1, keepdim=True)
        self.logprobs = logp.gather(-1, chosen).squeeze(-1)
        return torch.full_like(logits, float("-inf")).scatter(-1, chosen, 0.0)


_SeededCBSamplerCls: type | None = None


def _sampler_class() -> type:
    # A subclass of transformers' ContinuousBatchingLogitsProcessor (its list recognises processors by type),
    # built on first use so importing this module does not import the continuous-batching package.
    global _SeededCBSamplerCls
    if _SeededCBSamplerCls is None:
        _SeededCBSamplerCls = type("SeededCBSampler", (_SeededCBSampler, _cb_processor_base()), {})
    return _SeededCBSamplerCls


class ContinuousBatchingBackend(BackendBase):
    """Sample with transformers' continuous batching on the training model, one request per turn.

    Args:
        model: The policy (possibly wrapped by Accelerate/DeepSpeed when ``accelerator`` is given).
        stop_token_ids: Tokens that end a turn (kept: a sampled stop token is an action).
        sampling: Temperature, top-p, top-k, min-p. ``temperature == 0`` is greedy. A repetition penalty is
            refused: the manager's logits processors see only the last token, not the sequence.
        config: A ``ContinuousBatchingConfig`` (see :func:`continuous_batching_config`); ``None``: defaults.
        accelerator: When given, ``session()`` unwraps the model and, under ZeRO-3, gathers the full weights
            once for the whole rollout (:func:`~trl_plugins.rollout.backends.unwrapped_for_generation`), as the HF
            backend does.
        keep_cache: Keep the manager's paged KV cache (and on a GPU its captured CUDA graphs) allocated
            between rollouts: faster rollouts, less memory for training. Off: it is freed after each rollout.
        max_concurrency: Turns in flight from the rollout engine (each its own request).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        stop_token_ids: Sequence[int],
        sampling: SamplingSettings = SamplingSettings(),
        config: Any = None,
        accelerator: Any = None,
        keep_cache: bool = False,
        max_concurrency: int = 256,
    ) -> None:
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}.")
        if sampling.repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={sampling.repetition_penalty} is refused with continuous batching: its "
                "logits processors see only the last token of each sequence. Use repetition_penalty=1.0, "
                "or generate with HF generate (drop use_transformers_continuous_batching)."
            )
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
        self.model = model
        self.stop_token_ids = list(stop_token_ids)
        self.sampling = sampling
        self.config = config if config is not None else continuous_batching_config(None)
        self.accelerator = accelerator
        self.keep_cache = keep_cache
        self.max_concurrency = max_concurrency
        self._shared: dict[str, Any] = {"manager": None, "sampler": None, "model": None, "lock": threading.Lock()}
        self._ids = itertools.count()
        self._futures: dict[str, Any] = {}
        self._stops: dict[str, StopStrings] = {}
        """The stop strings of live requests that have them (streamed, cancelled at the first)."""
        self._pump = threading.Lock()
        self._active: Any = None
        """The running manager, inside ``session()``."""

    # -- the manager -------------------------------------------------------------------------------

    def _manager_for(self, model: torch.nn.Module) -> Any:
        shared = self._shared
        if shared["manager"] is not None and shared["model"] is model:
            return shared["manager"]
        from transformers import GenerationConfig

        # Greedy decoding over scores the sampler has already turned into its sample; no other processor.
        generation_config = GenerationConfig(do_sample=False, eos_token_id=self.stop_token_ids, max_new_tokens=1)
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=copy.deepcopy(self.config)
        )
        processors = manager.logit_processor
        ours = [p for p in processors.logits_processor if isinstance(p, _SeededCBSampler)]
        if ours:  # a manager a backend kept on this model (keep_cache): its sampler comes with it
            sampler = ours[0]
        else:
            if len(processors.logits_processor):
                raise RuntimeError(
                    f"continuous batching built logits processors {processors.logits_processor} from a "
                    "greedy generation config; this backend expects none (its sampler must be the only one)."
                )
            sampler = _sampler_class()(self.sampling)
            processors.logits_processor.append(sampler)
            processors.tensors_required += 1
            processors.do_processing = True
            processors._retrieve_processors_kwargs()
        shared.update(manager=manager, sampler=sampler, model=model)
        return manager

    def _start(self, manager: Any) -> None:
        self.close()  # the previous rollout's manager may still be stopping in the background
        with torch.random.fork_rng(devices=[manager.model.device] if manager.model.device.type == "cuda" else []):
            # Building the batch processor calls torch.manual_seed (the manager's TP seed): keep the trainer's RNG.
            manager.batch_processor = manager._create_batch_processor()
        cache = manager.batch_processor.cache
        cache.reset()  # no prefix block computed with earlier weights may be reused
        runner = manager.batch_processor.model_runner
        if self._shared.get("patched_runner") is not runner:  # a new batch processor brings a new runner
            sampler, original = self._shared["sampler"], runner._sample

            def _sample(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
                original(scores, output_ids)
                logprobs = sampler.logprobs
                output_ids[1, : logprobs.shape[0]].copy_(logprobs.view(dtype=torch.int32))

            runner._sample = _sample
            self._shared["patched_runner"] = runner
        manager.switch_to_cb_friendly_attn(manager.model, manager.continuous_batching_config.auto_switch_to_flash)
        with torch.inference_mode():
            manager.start()

    def _stop(self, manager: Any, *, hard: bool = False) -> None:
        manager.stop(block=False, keep_for_next_session=self.keep_cache, hard_stop=hard)
        manager._wake_up_loop.set()  # the idle loop would otherwise sleep out its 0.1 s poll before it sees the stop
        manager.join(time.perf_counter())  # blocks until the generation thread has exited
        if not self.keep_cache:
            manager.batch_processor = None

    @contextlib.contextmanager
    def session(self) -> Iterator[torch.nn.Module]:
        """Unwrap (and under ZeRO-3 gather) the model, start the manager for the rollout, stop it after."""
        with unwrapped_for_generation(self.model, self.accelerator) as unwrapped, self._shared["lock"]:
            self._session_digest = weights_digest(unwrapped)  # readable here also under ZeRO-3 (gathered)
            was_training = unwrapped.training
            manager = self._manager_for(unwrapped)
            self.close()  # the previous rollout's background stop frees its cache first
            if getattr(manager, "batch_processor", None) is None:  # the cache is built now: refuse one that cannot
                check_cache_fits(manager.model, manager.continuous_batching_config)  # fit, saying why, before a step
            unwrapped.eval()
            self._shared["sampler"].use(self.sampling)
            self._start(manager)
            self._active = manager
            clean = False
            try:
                yield unwrapped
                clean = True
            finally:
                self._active = None
                if clean and manager._original_attn_impl is None:
                    # Every request has finished and the training model's attention was left as it is: stop in
                    # the background (stop() ends with a gc.collect of ~0.2 s), off the step's critical path.
                    stopping = threading.Thread(target=self._stop, args=(manager,), name="trl_plugins-cb-stop")
                    stopping.start()
                    self._shared["stopping"] = stopping
                else:  # stop before the weights are released (ZeRO-3) or the attention is given back
                    self._stop(manager, hard=not clean)
                unwrapped.train(was_training)
                for rid in list(self._futures):
                    fut = self._futures.pop(rid)
                    if not fut.done():
                        fut.set_exception(
                            RuntimeError("the continuous-batching session ended before this turn finished")
                        )

    def close(self) -> None:
        """Wait for a background stop to finish (tests, the end of a run)."""
        stopping = self._shared.pop("stopping", None)
        if stopping is not None:
            stopping.join()

    # -- requests ----------------------------------------------------------------------------------

    def _wait(self, manager: Any, fut: Any) -> Any:
        # Whichever waiting thread holds the pump takes finished requests off the manager's queue and hands
        # each to its own future.
        while not fut.done():
            if not self._pump.acquire(timeout=0.01):
                continue
            try:
                if fut.done():
                    break
                out = manager.get_result(timeout=0.05)
                if out is not None:
                    waiting = self._futures.get(out.request_id)
                    if waiting is None or waiting.done():
                        continue  # answered already (a streamed request's steps after its stop)
                    if not out.is_finished():
                        stop = self._stops.get(out.request_id)
                        if stop is None or not stop.hit(out.generated_tokens):
                            continue  # a streamed step of a request with stop strings that holds none yet
                        manager.cancel_request(out.request_id)  # at a stop string: this step is its output
                    del self._futures[out.request_id]
                    waiting.set_result(out)
                elif not manager.is_running():
                    error = manager.background_thread_status.fatal_error
                    raise RuntimeError(
                        f"the continuous-batching generation loop stopped ({error!r}); see its log above."
                    )
            finally:
                self._pump.release()
        return fut.result()

    stop_strings = True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        *,
        seeds: Sequence[int],
        stop: Sequence[StopStrings | None] | None = None,
    ) -> list[Sample]:
        """As :meth:`GenerationBackend.generate`. A row with stop strings (``stop[i]``) is streamed: the first step
        whose tokens hold one cancels the request (the manager has no stop strings) and is its sample."""
        import concurrent.futures

        if not check_generate_args(prompts, max_new_tokens, seeds):
            return []
        manager = self._active
        if manager is None:
            with self.session():
                return self.generate(prompts, max_new_tokens, seeds=seeds, stop=stop)
        sampler = self._shared["sampler"]
        stops = list(stop) if stop is not None else [None] * len(prompts)
        pending = []
        for prompt, budget, seed, row_stop in zip(prompts, max_new_tokens, seeds, stops):
            rid = f"trl_plugins-{next(self._ids)}"
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._futures[rid] = fut
            sampler.rows[rid] = (int(seed), len(prompt))
            if row_stop is not None:
                self._stops[rid] = row_stop
            added = manager.add_request(
                list(prompt),
                request_id=rid,
                max_new_tokens=int(budget),
                eos_token_id=self.stop_token_ids,
                streaming=row_stop is not None,
            )
            if added is None:
                raise RuntimeError("the continuous-batching manager refused a request (it is stopping); see its log.")
            pending.append((rid, fut, int(budget)))
        stop = set(self.stop_token_ids)
        samples = []
        try:
            for rid, fut, budget in pending:
                out = self._wait(manager, fut)
                if out.error is not None:
                    raise RuntimeError(f"continuous batching failed request {rid}: {out.error}")
                if len(out.logprobs) != len(out.generated_tokens):
                    raise RuntimeError(
                        f"continuous batching returned {len(out.logprobs)} log-probs for "
                        f"{len(out.generated_tokens)} tokens (request {rid})."
                    )
                samples.append(
                    cut_at_stop(cut_sample(out.generated_tokens, out.logprobs, budget, stop), self._stops.get(rid))
                )
        finally:
            for rid, _, _ in pending:
                sampler.rows.pop(rid, None)
                self._stops.pop(rid, None)
                self._futures.pop(rid, None)
        return samples
