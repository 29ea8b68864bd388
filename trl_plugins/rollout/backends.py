"""Generation backends: token ids in, sampled token ids and behaviour log-probs out.

One call contract: ``backend.generate(prompts, max_new_tokens, seeds=...) -> list[Sample]``, one sample
per prompt, each cut at its own ``max_new_tokens`` and at the first stop token (kept: a sampled stop
token is an action), each sampled with its own seed: what a row samples depends on its prompt, budget
and seed, not on the other rows of the call. ``backend.session()`` wraps a whole multi-turn rollout
(under ZeRO-3 the HF backend gathers the weights once there, so no per-turn collective depends on how
many turns a rank runs). ``max_concurrency`` says how the rollout engine feeds it: 1 (the default) is
one call at a time holding every turn that is ready (a batching sampler); more is one call per turn,
that many in flight (a server or continuous-batching sampler that batches requests itself), each call
made from a worker thread. A backend whose ``generate`` is a collective across ranks sets
``requires_lockstep`` and is refused by the multi-turn engine.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from trl_plugins.rollout.sampling import SeededSampling
from trl_plugins.rollout.stops import StopStrings
from trl_plugins.rollout.weights import weights_digest
from trl_plugins.types import LogprobSource, SamplingSettings

__all__ = [
    "Sample",
    "GenerationBackend",
    "BackendBase",
    "HFGenerationBackend",
    "VLLMBackend",
    "ScriptedBackend",
    "cut_sample",
    "cut_at_stop",
]


@dataclass
class Sample:
    """One sampled completion."""

    token_ids: list[int]
    """Sampled tokens, a final stop token included."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled token."""
    finished: bool
    """True when it ended on a stop token; False when cut at ``max_new_tokens``."""
    policy_step: int | None = None
    """The optimizer step of the weights that sampled it, when the backend's weights can change during a rollout
    (an asynchronous replica); None: the rollout's ``policy_step``."""


class GenerationBackend(Protocol):
    """What the rollout engine and the trainer need from a sampler (:class:`BackendBase` gives the defaults)."""

    sampling: SamplingSettings
    """The distribution turns are sampled from (recorded on every trajectory's policy version)."""
    logprob_source: LogprobSource
    """What its behaviour log-probs are (the trainer's own ``temperature_scaled``, or vLLM's ``processed``)."""
    max_concurrency: int
    """1: one call at a time holding every ready turn (a batching sampler); more: one call per turn, that many in
    flight (a server or continuous batching), each from a worker thread."""
    requires_lockstep: bool
    """``generate`` is a collective across ranks: the multi-turn engine refuses it (ranks take different turns)."""

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Context for a whole multi-turn rollout."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seeds: Sequence[int]
    ) -> list[Sample]:
        """Sample one completion per prompt, row ``i`` with ``seeds[i]``."""
        ...

    def with_sampling(self, sampling: SamplingSettings) -> "GenerationBackend":
        """The same sampler with other sampling settings (e.g. greedy evaluation)."""
        ...

    def sync_weights(self, policy_step: int) -> None:
        """Bring a sampler with weights of its own to the training weights of ``policy_step`` (a collective for
        vLLM: every rank calls it before each rollout); a no-op for samplers on the training model."""
        ...

    def close(self) -> None:
        """Release what the sampler holds between rollouts; idempotent."""
        ...

    def weights_digest(self) -> str | None:
        """:func:`~trl_plugins.rollout.weights.weights_digest` of the weights it samples with now (after
        ``sync_weights``); None when they cannot be read from this process (a vLLM engine or server, ZeRO-3)."""
        ...


class BackendBase:
    """The defaults of :class:`GenerationBackend`'s members: one call at a time, no lock-step, weights shared with
    the trainer (nothing to sync), nothing to close; ``with_sampling`` copies the backend. A sampler subclasses it
    and overrides what differs."""

    logprob_source = LogprobSource.TEMPERATURE_SCALED
    max_concurrency = 1
    requires_lockstep = False
    sampling: SamplingSettings = SamplingSettings()

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(None)

    def with_sampling(self, sampling: SamplingSettings) -> Any:
        other = copy.copy(self)
        other.sampling = sampling
        return other

    def sync_weights(self, policy_step: int) -> None:
        self._session_digest = None
        return None

    def close(self) -> None:
        return None

    def weights_digest(self) -> str | None:
        # A sampler on the training model holds it as .model; under ZeRO-3 its weights are readable only inside the
        # rollout's own gather, where the session took the digest (no gather of its own: a few ms of reads).
        return weights_digest(getattr(self, "model", None)) or getattr(self, "_session_digest", None)


def check_generate_args(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], seeds: Sequence[int]) -> bool:
    """Check a ``generate`` call's arguments (one budget >= 1 and one seed per prompt); False when there are no
    prompts."""
    if not len(prompts) == len(max_new_tokens) == len(seeds):
        raise ValueError("need one max_new_tokens and one seed per prompt.")
    if not prompts:
        return False
    if min(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {min(max_new_tokens)}.")
    return True


@contextlib.contextmanager
def unwrapped_for_generation(model: torch.nn.Module, accelerator: Any) -> Iterator[torch.nn.Module]:
    """The model to generate with: ``model`` itself without an accelerator; else the unwrapped model, under
    ZeRO-3 with the full weights gathered for the whole block (as TRL's ``unwrap_model_for_generation``).

    Activation checkpointing is left as it is: the backends generate in eval mode under ``no_grad``, where
    transformers' layers never checkpoint. (TRL's ``unwrap_model_for_generation`` turns it off and back on
    through transformers' deprecated ``gradient_checkpointing_*`` names, three FutureWarnings per rollout,
    and re-enables it with default settings, dropping ``activation_checkpointing_kwargs``.)
    """
    if accelerator is None:
        yield model
        return
    from trl.distributed import DistributedBackend

    if not DistributedBackend(accelerator).is_zero3:
        yield accelerator.unwrap_model(model)
        return
    import deepspeed
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(model.parameters()):
        remove_hooks(model)
        try:
            yield accelerator.unwrap_model(model)
        finally:
            add_hooks(model)


def cut_sample(token_ids: Sequence[int], logprobs: Sequence[float], max_new_tokens: int, stop_ids: set[int]) -> Sample:
    """Cut a raw completion at its first stop token (kept) or at ``max_new_tokens``."""
    ids, lps = list(token_ids[:max_new_tokens]), list(logprobs[:max_new_tokens])
    for k, t in enumerate(ids):
        if t in stop_ids:
            return Sample(ids[: k + 1], lps[: k + 1], finished=True)
    return Sample(ids, lps, finished=False)


def cut_at_stop(sample: Sample, stop: StopStrings | None) -> Sample:
    """``sample`` ended at its first stop string (:class:`~trl_plugins.rollout.stops.StopStrings`), finished; as
    it is when no stop occurs."""
    at = stop.cut(sample.token_ids) if stop else None
    if at is None:
        return sample
    k = at[0] + 1
    return Sample(sample.token_ids[:k], sample.logprobs[:k], finished=True, policy_step=sample.policy_step)


class _RowStop:
    # Ends each row of an HF generate call at its first stop string (rows with none never end here).
    def __init__(self, start: int, stops: Sequence[StopStrings | None]) -> None:
        self.start, self.stops = start, stops

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = [bool(s) and s.hit(input_ids[r, self.start :].tolist()) for r, s in enumerate(self.stops)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _RowBudget:
    # Stops each row of an HF generate call at its own budget (rows finish independently).
    def __init__(self, start: int, budgets: torch.Tensor) -> None:
        self.start, self.budgets = start, budgets

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return (input_ids.shape[1] - self.start) >= self.budgets.to(input_ids.device)


class HFGenerationBackend(BackendBase):
    """Sample with Hugging Face ``generate`` on the training model.

        Rows are left-padded into one batch (split into chunks of ``max_batch_size``); behaviour log-probs
        are ``log_softmax(logits / temperature)`` of the sampled tokens, i.e. of the temperature-scaled
        distribution before top-p/top-k (``LogprobSource.TEMPERATURE_SCALED``). Each row samples with its own
    seed (:func:`~trl_plugins.rollout.sampling.seeded_gumbel`), so batching turns differently never changes what a turn
    samples.

        Args:
            model: The policy (possibly wrapped by Accelerate/DeepSpeed when ``accelerator`` is given).
            pad_token_id: Used for left padding.
            stop_token_ids: Tokens that end a turn (e.g. ``<|im_end|>``).
            sampling: Temperature, top-p, top-k, min-p, repetition penalty. ``temperature == 0`` is greedy.
            accelerator: When given, ``session()`` unwraps the model for generation and, under ZeRO-3,
                gathers the full weights once for the whole rollout (:func:`unwrapped_for_generation`).
            max_batch_size: Rows per ``generate`` call (``None``: all at once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        stop_token_ids: Sequence[int],
        sampling: SamplingSettings = SamplingSettings(),
        accelerator: Any = None,
        max_batch_size: int | None = None,
    ) -> None:
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}.")
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        self.sampling = sampling
        self.accelerator = accelerator
        self.max_batch_size = max_batch_size
        self._active: torch.nn.Module | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[torch.nn.Module]:
        """Unwrap (and under ZeRO-3 gather) the model once for a whole multi-turn rollout."""
        with unwrapped_for_generation(self.model, self.accelerator) as unwrapped:
            self._session_digest = weights_digest(unwrapped)  # readable here also under ZeRO-3 (gathered)
            self._active = unwrapped
            try:
                yield unwrapped
            finally:
                self._active = None

    def _generation_config(self, max_new_tokens: int) -> Any:
        from transformers import GenerationConfig

        # Decoding is greedy over scores that SeededSampling has already warped and noised (a sample).
        s = self.sampling
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            min_p=None,
            repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )

    stop_strings = True

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        *,
        seeds: Sequence[int],
        stop: Sequence[StopStrings | None] | None = None,
    ) -> list[Sample]:
        """As :meth:`GenerationBackend.generate`; ``stop[i]`` ends row ``i`` at its first stop string."""
        if not check_generate_args(prompts, max_new_tokens, seeds):
            return []
        stops = list(stop) if stop is not None else [None] * len(prompts)
        step = self.max_batch_size or len(prompts)
        out: list[Sample] = []
        for k in range(0, len(prompts), step):
            out += self._generate_chunk(
                prompts[k : k + step], max_new_tokens[k : k + step], seeds[k : k + step], stops[k : k + step]
            )
        return out

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        budgets: Sequence[int],
        seeds: Sequence[int],
        stops: Sequence[StopStrings | None],
    ) -> list[Sample]:
        from transformers import LogitsProcessorList, StoppingCriteriaList

        model = self._active if self._active is not None else self.model
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[r, width - len(p) :] = 1
        budget_t = torch.tensor(list(budgets), dtype=torch.long)
        was_training = model.training
        model.eval()
        processors = [] if self.sampling.temperature == 0 else [SeededSampling(self.sampling, seeds, width)]
        try:
            result = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(int(budget_t.max())),
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList(
                    [_RowBudget(width, budget_t)] + ([_RowStop(width, stops)] if any(stops) else [])
                ),
                # Inside a session the weights are whole on this rank (gathered under ZeRO-3): it generates on its own.
                # transformers' default under ZeRO-3 with several processes (synced_gpus) all-reduces a "finished" flag
                # every token, pairing unrelated generate calls of ranks that take different turns (a collective
                # mismatch, or a hang, as soon as their numbers of calls differ).
                **({"synced_gpus": False} if self._active is not None else {}),
            )
        finally:
            model.train(was_training)
        sampled = result.sequences[:, width:]
        logits = torch.stack(result.logits, dim=1).float()
        if self.sampling.temperature > 0:
            logits = logits / self.sampling.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        stop = set(self.stop_token_ids)
        return [
            cut_at_stop(cut_sample(sampled[r].tolist(), logprobs[r].tolist(), int(budgets[r]), stop), stops[r])
            for r in range(len(prompts))
        ]


@dataclass
class _SyncedStep:
    step: int | None = None
    """The policy step whose weights vLLM holds (None: never pushed)."""


class VLLMBackend(BackendBase):
    """Sample with vLLM through TRL's ``VLLMGeneration``: colocate (an engine in each training process) or server
    (``trl vllm-serve`` / ``vllm serve`` on other GPUs).

    Token-in, token-out: every turn goes to vLLM as its prompt's token ids with its own ``SamplingParams``
    (``max_tokens`` = the turn's budget, the turn's seed, ``stop_token_ids`` = the chat format's stop tokens,
    ``ignore_eos`` so only those stop it, as with HF generate), and the sampled ids come back with their
    log-probs. TRL starts vLLM with ``logprobs_mode="processed_logprobs"``, so these are the log-probs of the
    distribution actually sampled from, after temperature and top-p/top-k (``LogprobSource.PROCESSED``).

    Colocate mode takes one batched ``LLM.generate`` call at a time (``max_concurrency = 1``: the rollout
    engine hands it every turn that is ready). Server mode sends each turn as its own request from this rank
    (``max_concurrency`` requests in flight; the server batches them continuously), so no rank waits for
    another's turns. ``sync_weights(step)`` pushes the training weights to vLLM (TRL's ``sync_weights``:
    gathered under ZeRO-3, LoRA merged); every rank calls it before each rollout, as it is a collective.

    Args:
        vllm_generation: TRL's ``VLLMGeneration`` (the trainer's ``vllm_generation``).
        stop_token_ids: Tokens that end a turn.
        sampling: The sampling settings (recorded on trajectories).
        client: Server mode: this rank's ``VLLMClient`` (TRL builds one on the main process only; the others
            need their own to send their turns).
        max_concurrency: Server mode: requests in flight from this rank.
    """

    logprob_source = LogprobSource.PROCESSED

    def __init__(
        self,
        vllm_generation: Any,
        *,
        stop_token_ids: Sequence[int],
        sampling: SamplingSettings,
        client: Any = None,
        max_concurrency: int = 64,
    ) -> None:
        self.vllm = vllm_generation
        self.mode = vllm_generation.mode
        self._synced = _SyncedStep()  # shared by the copies with_sampling makes: one engine, one weights step
        self.stop_token_ids = list(stop_token_ids)
        self.sampling = sampling
        if self.mode == "server":
            # TRL builds its client on the main process only (the attribute is absent elsewhere).
            self.client = client if client is not None else getattr(vllm_generation, "vllm_client", None)
            if self.client is None:
                raise ValueError(
                    "vLLM server mode needs a VLLMClient on every rank to send that rank's turns; pass "
                    "client= (TRL's VLLMGeneration builds one on the main process only)."
                )
            if max_concurrency < 1:
                raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
            self.max_concurrency = max_concurrency
        elif self.mode == "colocate":
            self.client, self.max_concurrency = None, 1
        else:
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.mode!r}.")

    def sync_weights(self, policy_step: int) -> None:
        """Make vLLM generate with the training weights of ``policy_step`` (a collective: call it on every rank).

        Pushes them when the step changed since the last push, and in colocate sleep mode whenever vLLM
        discarded them (TRL sleeps at level 2 after each rollout and records it in ``_llm_weights_sleeping``).
        """
        sleeping = self.mode == "colocate" and self.vllm._llm_weights_sleeping
        if self._synced.step != policy_step or sleeping:
            self.vllm.sync_weights()
            if self.mode == "colocate":
                self.vllm._llm_weights_sleeping = False
            elif self.vllm.accelerator is not None:
                # The main process pushes; without a gather (DDP) the other ranks would return at once and send
                # turns to a server still half-way through the update.
                self.vllm.accelerator.wait_for_everyone()
            self._synced.step = policy_step

    @contextlib.contextmanager
    def session(self) -> Iterator[Any]:
        """Colocate with sleep mode: wake the KV cache for the rollout, then sleep (level 2) so training has the
        memory."""
        sleep = self.mode == "colocate" and self.vllm.enable_sleep_mode
        if sleep:
            if self.vllm._llm_weights_sleeping:
                raise RuntimeError("vLLM's weights are asleep: call sync_weights(step) before the rollout.")
            self.vllm.llm.wake_up(tags=["kv_cache"])
        try:
            yield self.vllm
        finally:
            if sleep:
                self.vllm.llm.sleep(level=2)
                self.vllm._llm_weights_sleeping = True

    def _params(self, max_tokens: int, seed: int) -> dict[str, Any]:
        s = self.sampling
        greedy = s.temperature == 0
        return {
            "n": 1,
            "temperature": s.temperature,
            "top_p": 1.0 if greedy else s.top_p,
            "top_k": 0 if greedy else s.top_k,
            "min_p": 0.0 if greedy else s.min_p,
            "repetition_penalty": s.repetition_penalty,
            "max_tokens": int(max_tokens),
            "logprobs": 0,
            "seed": int(seed),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": True,
        }

    stop_strings = True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        *,
        seeds: Sequence[int],
        stop: Sequence[StopStrings | None] | None = None,
    ) -> list[Sample]:
        """As :meth:`GenerationBackend.generate`; ``stop[i]`` goes to vLLM as row ``i``'s ``stop`` (its text kept in
        the output), and the sample is cut at the first token whose text holds one (as the endpoint matches it)."""
        if not check_generate_args(prompts, max_new_tokens, seeds):
            return []
        stops = list(stop) if stop is not None else [None] * len(prompts)
        params = [self._params(b, seed) for b, seed in zip(max_new_tokens, seeds)]
        for kw, s in zip(params, stops):
            if s:
                kw.update(stop=list(s.strings), include_stop_str_in_output=True)
        rows: list[tuple[list[int], list[float] | None]] = []
        if self.mode == "colocate":
            from trl.generation import vllm_generation as trl_vllm

            outputs = self.vllm.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts],
                sampling_params=[trl_vllm.SamplingParams(**kw) for kw in params],
                use_tqdm=False,
            )
            for out in outputs:
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                lps = (
                    None
                    if completion.logprobs is None
                    else [step[t].logprob for step, t in zip(completion.logprobs, ids)]
                )
                rows.append((ids, lps))
        else:
            for prompt, kw in zip(prompts, params):
                kw = dict(kw)
                core = {
                    k: kw.pop(k)
                    for k in (
                        "n",
                        "temperature",
                        "top_p",
                        "top_k",
                        "min_p",
                        "repetition_penalty",
                        "max_tokens",
                        "logprobs",
                    )
                }
                out = self.client.generate(prompts=[list(prompt)], **core, generation_kwargs=kw)
                lps = out.get("logprobs")
                rows.append((list(out["completion_ids"][0]), None if lps is None else [lp[0] for lp in lps[0]]))
        stop = set(self.stop_token_ids)
        samples = []
        for (ids, lps), budget, s in zip(rows, max_new_tokens, stops):
            if lps is None or any(lp is None for lp in lps):
                raise RuntimeError(
                    "vLLM returned no log-probs for a sampled token; the behaviour log-probs are needed "
                    "(TRL builds VLLMGeneration with logprobs=0, a server must allow --max-logprobs)."
                )
            samples.append(cut_at_stop(cut_sample(ids, lps, budget, stop), s))
        return samples


class ScriptedBackend(BackendBase):
    """A test double: completions come from ``script(prompt_ids)`` (or ``script(prompt_ids, seed)`` with
    ``with_seed=True``), log-probs are constant.

    Used by tests and ``benchmarks/rollout.py`` to drive the rollout engine with a deterministic
    tool-calling policy, without a model. A script that must vary between the samples of a group should
    read the seed (per trajectory and turn), not count its calls: the order of calls follows tool timing.
    """

    def __init__(
        self,
        script: Callable[..., list[int]],
        *,
        stop_token_ids: Sequence[int],
        logprob: float = -0.5,
        with_seed: bool = False,
    ) -> None:
        self.script, self.with_seed = script, with_seed
        self.stop_token_ids = list(stop_token_ids)
        self.logprob = logprob
        self.sampling = SamplingSettings()
        self.calls: list[int] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seeds: Sequence[int]
    ) -> list[Sample]:
        self.calls.append(len(prompts))
        stop = set(self.stop_token_ids)
        out = []
        for p, budget, seed in zip(prompts, max_new_tokens, seeds):
            ids = list(self.script(list(p), seed) if self.with_seed else self.script(list(p)))
            out.append(cut_sample(ids, [self.logprob] * len(ids), budget, stop))
        return out
