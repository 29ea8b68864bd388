"""Asynchronous rollouts with bounded staleness (``async_rollouts``, ``max_staleness = k > 0``): the trainer's side.

The trainer's dataloader is read ``k`` batches ahead (:meth:`AsyncRollouts.take`, called by the HF loop's
``get_batch_samples``); each batch is handed to the generation replica (:mod:`~trl_plugins.trainers.replica`) as
soon as the weights it may use exist. At step ``s`` the trainer pushes the weights of step ``s``, queues the batches of
steps up to ``s + k``, and waits for step ``s``'s rollout, which the replica sampled with weights of step ``s - k`` or
later; while step ``s`` trains, the replica rolls out the next ones. Pacing, not discarding: a batch is never queued
before the weights it may use exist, so the replica waits instead of exceeding ``k``, and every batch the loader
yields is trained once, at the step the synchronous loop would train it (the dataloader's order and epochs are
unchanged).

Resume: a checkpoint holds the steps trained; the rows read ahead and in flight were not trained, so the resumed HF
loop (which skips the batches of the steps trained) reads and rolls them out again: each row is trained once per
epoch, after SIGTERM or kill -9 alike.

Tripwires (on by default, each configurable): after every push the replica's log-probs of a fixed probe sequence
must match the trainer's (``async_probe_tolerance``); with the decoupled objective, the step's mean log-prob gap
between the proximal and the behaviour policy (``async_max_logprob_gap``) and the importance weights' effective sample
size (``async_min_importance_ess``) have bounds (:func:`off_policy_figures`). Crossing one stops the run with a message
naming the check, the figure and the threshold.

With a vLLM server (``vllm_mode='server'``) there is no replica: :class:`ServerRollouts` runs the rollouts on threads
of the trainer's process against the server, and a push drains the requests in flight first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from trl_plugins.run import RolloutParts
from trl_plugins.trainers.replica import (
    BusyClock,
    GenerationReplica,
    ReplicaResult,
    StampedSampler,
    TimedSampler,
    cpu_state_dict,
    probe_logprobs,
    probe_tokens,
    sampler_figures,
    stop_pending,
)
from trl_plugins.types import Datum

__all__ = [
    "AsyncRollouts",
    "OffPolicyDrift",
    "ServerRollouts",
    "check_off_policy",
    "off_policy_figures",
    "probe_tolerance",
]


class OffPolicyDrift(RuntimeError):
    """A tripwire of the asynchronous path was crossed (the message names the check, the figure and the threshold)."""


def probe_tolerance(settings: Any, dtype: torch.dtype) -> float:
    """``settings.probe_tolerance`` (:class:`~trl_plugins.run.settings.AsyncRollouts`), or its default for ``dtype``:
    1e-3 for fp32 weights, 5e-2 for bf16/fp16."""
    if settings.probe_tolerance is not None:
        return float(settings.probe_tolerance)
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def off_policy_figures(datums: Sequence[Datum]) -> list[float]:
    """Sums over the action tokens of ``datums`` that carry old (proximal) log-probs, to be summed over ranks:
    ``[n, sum |d|, sum w, sum w^2]`` with ``d = old - behaviour`` and ``w = exp(d)`` (untruncated; the exponent
    clamped to +-20 as the importance weights' is)."""
    n = gap = w_sum = w_sq = 0.0
    for d in datums:
        if d.old_logprobs is None:
            continue
        mask = torch.tensor(d.action_mask, dtype=torch.bool)
        if not mask.any():
            continue
        old = torch.as_tensor(d.old_logprobs, dtype=torch.float64)[mask]
        behaviour = torch.tensor(d.behaviour_logprobs, dtype=torch.float64)[mask]
        diff = old - behaviour
        w = torch.exp(diff.clamp(-20.0, 20.0))
        n += float(mask.sum())
        gap += float(diff.abs().sum())
        w_sum += float(w.sum())
        w_sq += float((w * w).sum())
    return [n, gap, w_sum, w_sq]


class _ReadWriteLock:
    """Many generate calls at once (readers), or one weight push (the writer) once those in flight have finished;
    a waiting push holds new calls back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = self._waiting = False

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._waiting = True
            while self._writing or self._readers:
                self._cond.wait()
            self._waiting, self._writing = False, True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class _ServerView(StampedSampler):
    """The server backend as samplers of this process see it: each generate call runs between weight pushes (never
    across one, the push's read-write lock) and is stamped with the step the server then held; ``sync_weights`` is
    the producer's drained push."""

    def __init__(self, producer: "ServerRollouts", backend: Any, *, pushes: bool) -> None:
        # timed inside the push's lock: a call's wait for a push is not the server's work
        super().__init__(TimedSampler(backend, producer.clock), producer.lock.read, lambda: producer.pushed_step)
        self._producer, self._pushes = producer, pushes

    def with_sampling(self, sampling: Any) -> "_ServerView":
        return _ServerView(self._producer, self._backend.with_sampling(sampling), pushes=self._pushes)

    def sync_weights(self, policy_step: int) -> None:
        # A queued rollout samples with whatever weights the server holds (its turns say which); anything else in the
        # process (an evaluation) brings the server to its step through the drained push.
        if self._pushes and policy_step != self._producer.pushed_step:
            self._producer.push(policy_step)


class ServerRollouts:
    """vLLM server mode (the server keeps generating): rollouts run on threads of the trainer's process, every
    queued batch at once, their turns as requests to the server; a weight push waits for the requests in flight to
    finish and holds new ones back (so every turn is sampled by one version, stamped on it), then pushes through
    TRL (a collective: every rank at the same point of its step). After each push the server samples a probe
    continuation and the trainer scores it: the two log-probs must match.

    Args:
        backend: The run's ``VLLMBackend`` in server mode.
        parts: What the rollout needs (:meth:`Run.rollout_parts <trl_plugins.run.Run.rollout_parts>`).
    """

    def __init__(self, backend: Any, parts: RolloutParts) -> None:
        self.lock = _ReadWriteLock()
        self.parts = parts
        self._backend = backend
        self.pushed_step = -1
        self.probe_due = False
        settings = parts.config.features.async_rollouts  # streaming: every queued batch at once; else in turn
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.max_staleness + 1 if settings.streaming else 1, thread_name_prefix="async-rollout"
        )
        self._futures: dict[Any, concurrent.futures.Future] = {}
        self._starts: dict[Any, int] = {}
        self.dtype: torch.dtype | None = None
        """The trainer's weights' dtype, seen at the last probe (it sets the probe's tolerance)."""
        self._probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stop = threading.Event()
        self._full_weights: Callable[[], ContextManager[torch.nn.Module]] | None = None
        self.clock = BusyClock()
        """The time with at least one of this process's requests at the server (its generate calls)."""
        self.drain_s = 0.0
        """How long the last push waited for the requests in flight."""

    @property
    def sampler_clock(self) -> tuple[float, float]:
        """This process's :meth:`BusyClock.reading` of the server's work for it."""
        return self.clock.reading()

    def view(self, sampling: Any = None, *, pushes: bool = True) -> _ServerView:
        return _ServerView(
            self, self._backend if sampling is None else self._backend.with_sampling(sampling), pushes=pushes
        )

    def push(self, step: int, full_weights: Callable[[], ContextManager[torch.nn.Module]] | None = None) -> None:
        """Bring the server to the weights of ``step`` once the requests in flight have finished; then probe."""
        if full_weights is not None:
            self._full_weights = full_weights
        start = time.perf_counter()
        with self.lock.write():
            self.drain_s = time.perf_counter() - start  # the wait for the requests in flight
            if step != self.pushed_step:
                self._backend.sync_weights(step)
                self.pushed_step = step
            self.probe_due = self._full_weights is None
            if self._full_weights is not None:
                self._probe(step)

    def _probe(self, step: int) -> None:
        from trl_plugins.types import SamplingSettings

        prompt = self.parts.chat.initial_prompt_ids([{"role": "user", "content": "Probe: say something."}])
        (sample,) = self._backend.with_sampling(SamplingSettings(temperature=1.0)).generate(
            [prompt], [16], seeds=[1234]
        )
        with self._full_weights() as model:
            mine = probe_logprobs(model, torch.tensor(list(prompt) + list(sample.token_ids)))[len(prompt) - 1 :]
            self.dtype = next(model.parameters()).dtype
        self._probes[step] = (torch.tensor(sample.logprobs, dtype=torch.float32), mine)

    def submit(self, key: Any, rows: Sequence[dict], *, group_size: int, seed: int, id_offset: int = 0) -> None:
        from trl_plugins.pipeline.batch import rollout_rows

        start = self.pushed_step
        view = self.view(pushes=False)

        self._futures[key] = self._pool.submit(
            rollout_rows,
            self.parts,
            view,
            list(rows),
            group_size=group_size,
            seed=seed,
            policy_step=start,
            id_offset=id_offset,
            stop=self._stop,
        )
        self._starts[key] = start

    def result(self, key: Any, *, cancelled: Callable[[], bool] | None = None) -> ReplicaResult | None:
        future = self._futures[key]
        while True:
            try:
                result = future.result(timeout=0.2)
                break
            except concurrent.futures.TimeoutError:
                if cancelled is not None and cancelled():
                    return None
            except Exception:
                if stop_pending(cancelled):  # the server died of the same signal: the stop, not a failure
                    return None
                raise
        del self._futures[key]
        start = self._starts.pop(key)
        probes, self._probes = self._probes, {}
        return ReplicaResult(result, start, self.parts.step_metrics(), probes)  # what ran the rollout: tools, judges

    def close(self) -> None:
        self._stop.set()  # rollouts in flight end as cancelled
        self._pool.shutdown(wait=True, cancel_futures=True)


class AsyncRollouts:
    """The trainer's side of asynchronous rollouts on one rank.

    Args:
        settings: The run's :class:`~trl_plugins.run.settings.AsyncRollouts` (``config.features.async_rollouts``).
        parts: What the replica's rollout needs (:meth:`Run.rollout_parts <trl_plugins.run.Run.rollout_parts>`).
        sampler: The run's sampler kind.
        pad_token_id: HF generate's padding id.
        token_budget: The rollout's token budget.
    """

    def __init__(
        self,
        settings: Any,
        parts: RolloutParts,
        *,
        sampler: Any,
        pad_token_id: int | None,
        token_budget: int | None,
        server_backend: Any = None,
    ) -> None:
        self.settings, self.parts, self.sampler = settings, parts, sampler
        self.pad_token_id, self.token_budget = pad_token_id, token_budget
        self._server_backend = server_backend
        """vLLM server mode: rollouts on threads of this process against the server (no replica)."""
        self.producer: GenerationReplica | ServerRollouts | None = None
        """What rolls out: the replica process, or the server threads; None until the first step (and once closed)."""
        self._iterator: Iterator | None = None
        self._ahead: deque = deque()
        self.upcoming: list[Any] = []
        """The batches read ahead: those of the next steps, in order."""
        self._queued_up_to = -1
        self._trainer_probes: dict[int, torch.Tensor] = {}
        self._probe: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None
        self._sampler_reading: tuple[float, float] | None = None
        """The sampler's busy clock when the previous step's rollout was collected."""

    # -- the data, read ahead ------------------------------------------------------------------------

    def take(self, epoch_iterator: Iterator, num_batches: int, steps_left: int) -> list[Any]:
        """This step's batch from ``epoch_iterator``, after reading up to ``max_staleness`` more (not beyond
        ``steps_left`` steps, nor beyond the epoch). A new epoch's iterator starts a new read-ahead."""
        if num_batches != 1:
            raise ValueError(
                f"async_rollouts takes one batch per step, got {num_batches} (gradient_accumulation_steps stays 1)."
            )
        if epoch_iterator is not self._iterator:
            self._iterator, self._ahead = epoch_iterator, deque()
        want = 1 + max(0, min(self.settings.max_staleness, steps_left - 1))
        while len(self._ahead) < want:
            try:
                self._ahead.append(next(epoch_iterator))
            except StopIteration:
                break
        batch = [self._ahead.popleft()] if self._ahead else []
        self.upcoming = list(self._ahead)
        return batch

    # -- the rollout of a step -------------------------------------------------------------------------

    def roll_out(
        self,
        step: int,
        rows: list[dict],
        upcoming: Sequence[list[dict]],
        full_weights: Callable[[], ContextManager[torch.nn.Module]],
        *,
        group_size: int,
        seed: Callable[[int], int],
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[ReplicaResult | None, dict[str, float]]:
        """Step ``step``'s rollout of ``rows`` (None: ``cancelled`` while waiting), after pushing the weights of
        ``step`` and queueing ``upcoming`` (the rows of steps ``step + 1, ...``). ``full_weights()`` enters the
        unwrapped policy with its full weights (under ZeRO-3 gathered: a collective, so every rank calls this at the
        same point of the step); ``seed(s)`` is step ``s``'s rollout seed. Returns the replica's result and the
        step's ``async/*`` metrics.

        Raises:
            OffPolicyDrift: the replica's probe log-probs after a push differ from the trainer's beyond the tolerance.
            ReplicaError: the replica failed.
        """
        c = self.settings
        drain_s = 0.0
        if self._server_backend is not None:
            server = self._server()
            if server.pushed_step != step or server.probe_due:
                server.push(step, full_weights)
                drain_s = server.drain_s
            self._dtype = server.dtype
        elif self.producer is None:
            with full_weights() as model:
                self._probe = probe_tokens(model.config.vocab_size)
                self._dtype = next(model.parameters()).dtype
                self._trainer_probes[step] = probe_logprobs(model, self._probe)
                self.producer = GenerationReplica(
                    model,
                    policy_step=step,
                    parts=self.parts,
                    sampler=self.sampler,
                    pad_token_id=self.pad_token_id,
                    token_budget=self.token_budget,
                    probe=self._probe,
                    threads=c.replica_threads,
                    streaming=c.streaming,
                )
        elif self.producer.pushed_step != step:
            with full_weights() as model:
                self._trainer_probes[step] = probe_logprobs(model, self._probe)
                state = cpu_state_dict(model)
            self.producer.push_weights(step, state)
        # Queue each batch once, no further ahead than the weights just pushed allow.
        for offset, part in enumerate([rows, *upcoming][: c.max_staleness + 1]):
            key = step + offset
            if key > self._queued_up_to:
                self.producer.submit(key, part, group_size=group_size, seed=seed(key))
                self._queued_up_to = key
        start = time.perf_counter()
        result = self.producer.result(step, cancelled=cancelled)
        metrics = {
            # waiting for this step's rollout, and (vLLM server) for the requests in flight before the push
            "timing/trainer_idle_s": time.perf_counter() - start + drain_s,
            "async/queued_ahead": float(self._queued_up_to - step),
        }
        if self._server_backend is not None:
            metrics["timing/push_drain_s"] = drain_s
        if result is None:
            return None, metrics
        reading = self.producer.sampler_clock
        if reading is not None:
            metrics.update(sampler_figures(self._sampler_reading, reading))
            self._sampler_reading = reading
        metrics["async/probe_max_diff"] = self._check_probes(result.probes)
        return result, metrics

    def _server(self) -> ServerRollouts:
        """vLLM server mode's producer, made on first use (a step, or a sampler asked for before the first)."""
        if self.producer is None:
            self.producer = ServerRollouts(self._server_backend, self.parts)
        return self.producer

    def _check_probes(self, probes: dict[int, Any]) -> float:
        tolerance = probe_tolerance(self.settings, self._dtype)
        worst = 0.0
        for pushed, theirs in sorted(probes.items()):
            if isinstance(theirs, tuple):  # the server's probe: (its log-probs, the trainer's)
                theirs, mine = theirs
            else:
                mine = self._trainer_probes.pop(pushed)
            diff = float((mine - theirs).abs().max())
            worst = max(worst, diff)
            if tolerance >= 0 and not diff <= tolerance:
                raise OffPolicyDrift(
                    f"weight-push probe: after the push of step {pushed}'s weights, the generation replica's "
                    "log-probs of "
                    f"the fixed probe sequence differ from the trainer's by {diff:.3g} (max over {mine.numel()} "
                    "tokens), "
                    f"over async_probe_tolerance={tolerance:g}: the replica is not sampling with the weights it "
                    f"says it has (a weight sync that did nothing?). The run stops rather than train on them; if the "
                    f"gap is numerical (another dtype or kernel), raise async_probe_tolerance (a negative value turns "
                    f"the check off)."
                )
        return worst

    def generation_backend(self, sampling: Any) -> Any:
        """vLLM server mode: the backend anything else in this process samples with (e.g. a periodic evaluation),
        whose weight sync goes through the same drained push as the rollouts'. None: the trainer's own."""
        return None if self._server_backend is None else self._server().view(sampling)

    def close(self) -> None:
        """Stop the replica (rollouts in flight are abandoned; a resume rolls their rows out again)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self._ahead, self.upcoming, self._iterator = deque(), [], None
        self._queued_up_to, self._trainer_probes = -1, {}  # a later train() starts afresh
        self._sampler_reading = None


def check_off_policy(settings: Any, totals: Sequence[float]) -> dict[str, float]:
    """The decoupled objective's tripwires on the step's summed :func:`off_policy_figures` (all ranks): its
    ``async/*`` metrics, or :class:`OffPolicyDrift` naming the check crossed."""
    n, gap, w_sum, w_sq = totals
    if n == 0:
        return {}
    mean_gap = gap / n
    ess = (w_sum * w_sum) / (n * w_sq) if w_sq > 0 else 1.0
    limit = settings.max_logprob_gap
    if limit is not None and mean_gap > limit:
        raise OffPolicyDrift(
            f"log-prob gap: this step's mean |log pi_prox - log pi_behaviour| over {int(n)} trained tokens is "
            f"{mean_gap:.3g}, over async_max_logprob_gap={limit:g}: the weights that sampled them are too far from the "
            f"ones being trained (max_staleness={settings.max_staleness}) or the replica's log-probs are wrong. Lower "
            f"max_staleness or the learning rate, or raise async_max_logprob_gap (None turns the check off)."
        )
    floor = settings.min_importance_ess
    if floor is not None and ess < floor:
        raise OffPolicyDrift(
            f"importance-weight ESS: this step's effective sample size of pi_prox / pi_behaviour over {int(n)} trained "
            f"tokens is {ess:.3g}, under async_min_importance_ess={floor:g}: a few tokens carry the update. Lower "
            f"max_staleness or the learning rate, or lower async_min_importance_ess (None turns the check off)."
        )
    return {"async/logprob_gap": mean_gap, "async/importance_ess": ess}
