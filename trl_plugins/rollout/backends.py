"""Generation backends: token ids in, sampled token ids and behaviour log-probs out.

One call contract: ``backend.generate(prompts, max_new_tokens, seed=...) -> list[Sample]``, one sample
per prompt, each cut at its own ``max_new_tokens`` and at the first stop token (kept: a sampled stop
token is an action). ``backend.session()`` wraps a whole multi-turn rollout (under ZeRO-3 the HF
backend gathers the weights once there, so no per-turn collective depends on how many turns a rank
runs). ``requires_lockstep`` says whether ``generate`` itself is a collective that every rank must
call the same number of times (vLLM server mode gathers prompts across ranks).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from trl_plugins.types import LogprobSource, SamplingSettings

__all__ = ["Sample", "GenerationBackend", "HFGenerationBackend", "VLLMBackend", "ScriptedBackend", "cut_sample"]


@dataclass
class Sample:
    """One sampled completion."""

    token_ids: list[int]
    """Sampled tokens, a final stop token included."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled token."""
    finished: bool
    """True when it ended on a stop token; False when cut at ``max_new_tokens``."""


class GenerationBackend(Protocol):
    """What the rollout engine needs from a sampler."""

    sampling: SamplingSettings
    logprob_source: LogprobSource
    requires_lockstep: bool

    def session(self) -> contextlib.AbstractContextManager[Any]:
        """Context for a whole multi-turn rollout."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seed: int) -> list[Sample]:
        """Sample one completion per prompt."""
        ...


def cut_sample(token_ids: Sequence[int], logprobs: Sequence[float], max_new_tokens: int, stop_ids: set[int]) -> Sample:
    """Cut a raw completion at its first stop token (kept) or at ``max_new_tokens``."""
    ids, lps = list(token_ids[:max_new_tokens]), list(logprobs[:max_new_tokens])
    for k, t in enumerate(ids):
        if t in stop_ids:
            return Sample(ids[: k + 1], lps[: k + 1], finished=True)
    return Sample(ids, lps, finished=False)


class _RowBudget:
    # Stops each row of an HF generate call at its own budget (rows finish independently).
    def __init__(self, start: int, budgets: torch.Tensor) -> None:
        self.start, self.budgets = start, budgets

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return (input_ids.shape[1] - self.start) >= self.budgets.to(input_ids.device)


class HFGenerationBackend:
    """Sample with Hugging Face ``generate`` on the training model.

    Rows are left-padded into one batch (split into chunks of ``max_batch_size``); behaviour log-probs
    are ``log_softmax(logits / temperature)`` of the sampled tokens, i.e. of the temperature-scaled
    distribution before top-p/top-k (``LogprobSource.TEMPERATURE_SCALED``). Sampling is seeded per call.

    Args:
        model: The policy (possibly wrapped by Accelerate/DeepSpeed when ``accelerator`` is given).
        pad_token_id: Used for left padding.
        stop_token_ids: Tokens that end a turn (e.g. ``<|im_end|>``).
        sampling: Temperature, top-p, top-k, min-p, repetition penalty. ``temperature == 0`` is greedy.
        accelerator: When given, ``session()`` unwraps the model for generation and, under ZeRO-3,
            gathers the full weights once for the whole rollout (TRL's ``unwrap_model_for_generation``).
        max_batch_size: Rows per ``generate`` call (``None``: all at once).
    """

    logprob_source = LogprobSource.TEMPERATURE_SCALED
    requires_lockstep = False

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
        if self.accelerator is None:
            ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(self.model)
        else:
            from trl.models.utils import unwrap_model_for_generation

            ctx = unwrap_model_for_generation(self.model, self.accelerator, gather_deepspeed3_params=True)
        with ctx as unwrapped:
            self._active = unwrapped
            try:
                yield unwrapped
            finally:
                self._active = None

    def _generation_config(self, max_new_tokens: int) -> Any:
        from transformers import GenerationConfig

        s = self.sampling
        greedy = s.temperature == 0
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else s.temperature,
            top_p=None if greedy or s.top_p >= 1.0 else s.top_p,
            top_k=None if greedy or s.top_k <= 0 else s.top_k,
            min_p=None if greedy or s.min_p <= 0 else s.min_p,
            repetition_penalty=None if s.repetition_penalty == 1.0 else s.repetition_penalty,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seed: int) -> list[Sample]:
        if len(prompts) != len(max_new_tokens):
            raise ValueError("need one max_new_tokens per prompt.")
        if not prompts:
            return []
        if min(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {min(max_new_tokens)}.")
        step = self.max_batch_size or len(prompts)
        out: list[Sample] = []
        for k in range(0, len(prompts), step):
            out += self._generate_chunk(prompts[k : k + step], max_new_tokens[k : k + step], seed=seed + k)
        return out

    def _generate_chunk(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], *, seed: int) -> list[Sample]:
        from transformers import StoppingCriteriaList

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
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                result = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=self._generation_config(int(budget_t.max())),
                    stopping_criteria=StoppingCriteriaList([_RowBudget(width, budget_t)]),
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
            cut_sample(sampled[r].tolist(), logprobs[r].tolist(), int(budgets[r]), stop) for r in range(len(prompts))
        ]


class VLLMBackend:
    """Sample with vLLM through TRL's ``VLLMGeneration`` (colocate or server mode).

    TRL starts vLLM with ``logprobs_mode="processed_logprobs"``: behaviour log-probs are those of the
    distribution actually sampled from, after temperature and top-p/top-k (``LogprobSource.PROCESSED``).
    In server mode ``generate`` gathers prompts from every rank, so it is a collective: the rollout
    calls it the same number of times on every rank (``requires_lockstep``).

    Args:
        vllm_generation: A ``trl.generation.vllm_generation.VLLMGeneration`` (or an object with the same
            ``generate(prompts, images, num_generations)`` method and ``max_completion_length`` /
            ``generation_kwargs`` attributes).
        stop_token_ids: Tokens that end a turn.
        sampling: The sampling settings the ``VLLMGeneration`` was built with (recorded on trajectories).
    """

    logprob_source = LogprobSource.PROCESSED

    def __init__(self, vllm_generation: Any, *, stop_token_ids: Sequence[int], sampling: SamplingSettings) -> None:
        self.vllm = vllm_generation
        self.stop_token_ids = list(stop_token_ids)
        self.sampling = sampling
        self.requires_lockstep = getattr(vllm_generation, "mode", "colocate") == "server"

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(self.vllm)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seed: int) -> list[Sample]:
        if len(prompts) != len(max_new_tokens):
            raise ValueError("need one max_new_tokens per prompt.")
        if not prompts and not self.requires_lockstep:
            return []
        self.vllm.max_completion_length = max(max_new_tokens, default=1)
        self.vllm.generation_kwargs = {**(self.vllm.generation_kwargs or {}), "seed": seed}
        _, completion_ids, logprobs, _ = self.vllm.generate([list(p) for p in prompts], None, 1)
        if logprobs is None:
            raise RuntimeError(
                "vLLM returned no log-probs; build VLLMGeneration with logprobs=0 so behaviour log-probs are kept."
            )
        stop = set(self.stop_token_ids)
        return [
            cut_sample(ids, [lp[0] for lp in lps], budget, stop)
            for ids, lps, budget in zip(completion_ids, logprobs, max_new_tokens)
        ]


class ScriptedBackend:
    """A test double: completions come from ``script(prompt_ids, turn_index)``, log-probs are constant.

    Used by tests and ``benchmarks/rollout.py`` to drive the rollout engine with a deterministic
    tool-calling policy, without a model.
    """

    logprob_source = LogprobSource.TEMPERATURE_SCALED
    requires_lockstep = False

    def __init__(self, script: Callable[[list[int]], list[int]], *, stop_token_ids: Sequence[int], logprob: float = -0.5) -> None:
        self.script = script
        self.stop_token_ids = list(stop_token_ids)
        self.logprob = logprob
        self.sampling = SamplingSettings()
        self.calls: list[int] = []

    def session(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(None)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, seed: int) -> list[Sample]:
        self.calls.append(len(prompts))
        stop = set(self.stop_token_ids)
        out = []
        for p, budget in zip(prompts, max_new_tokens):
            ids = list(self.script(list(p)))
            out.append(cut_sample(ids, [self.logprob] * len(ids), budget, stop))
        return out
