"""A generation replica: a copy of the policy in a process of its own that rolls out while the trainer trains.

With ``async_rollouts`` and no separate generation server (HF generate or continuous batching on one machine) the
trainer cannot sample and update at once with one copy of the weights, and on a CPU a thread would share the
interpreter lock with the update. :class:`GenerationReplica` starts a child process (``spawn``) with its own copy of
the policy, the run's rollout plugin, tools and chat format, and a sampler of the run's kind on that copy. The parent
talks to it through two queues, in order:

- ``push_weights(step, state_dict)``: the weights after ``step`` optimizer steps (CPU tensors, passed through shared
  memory). The replica loads them before its next rollout and answers with its log-probs of the fixed probe sequence,
  so that the trainer can check that the push did what it says (:func:`probe_logprobs`);
- ``submit(key, rows, ...)``: roll out ``rows`` (as :func:`trl_plugins.pipeline.batch.rollout_rows`) with the newest
  weights it loaded; the trajectories record that step;
- ``result(key)``: wait for that rollout (in submission order), with the probe answers that came before it and the
  tools' step metrics of the rollout.

Rollouts run one after another, in submission order: the trainer decides how far ahead of its weights they may run
(``max_staleness``). The child dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and a parent check while idle), so
a killed trainer leaves no replica behind. Memory: a second copy of the policy's weights, plus one copy per push in
flight (shared memory, released once loaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from trl_plugins.run import RolloutParts

__all__ = [
    "BusyClock",
    "GenerationReplica",
    "ReplicaError",
    "ReplicaResult",
    "TimedSampler",
    "probe_logprobs",
    "probe_tokens",
    "sampler_figures",
]

logger = logging.getLogger(__name__)


class ReplicaError(RuntimeError):
    """The generation replica failed (its traceback is in the message) or exited."""


STOP_GRACE_S = 1.0
"""How long a failure of the generation replica waits for a stop request before it is raised: a SIGTERM sent to the
run's process group reaches the replica too, which dies of it at once, while the trainer's handler may run a moment
after the failure is seen."""


def stop_pending(cancelled: Callable[[], bool] | None) -> bool:
    """Whether ``cancelled()`` is true now or turns true within :data:`STOP_GRACE_S` (False at once without it)."""
    if cancelled is None:
        return False
    deadline = time.monotonic() + STOP_GRACE_S
    while not cancelled():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


class BusyClock:
    """The wall time during which at least one of the calls it times was running (calls that overlap count once):
    how long a sampler was busy. Thread-safe; with ``state`` (a ``multiprocessing.Array("d", 3)``) it is shared
    between processes: the replica's calls are timed in the child, and the trainer reads the clock in the parent at
    any moment (``time.monotonic`` is one clock for every process of a machine)."""

    def __init__(self, state: Any = None) -> None:
        self._state = [0.0, 0.0, 0.0] if state is None else state  # busy seconds, since, calls running
        self._lock = threading.Lock() if state is None else state.get_lock()

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        with self._lock:
            if self._state[2] == 0:
                self._state[1] = time.monotonic()
            self._state[2] += 1
        try:
            yield
        finally:
            with self._lock:
                self._state[2] -= 1
                if self._state[2] == 0:
                    self._state[0] += time.monotonic() - self._state[1]

    def reading(self) -> tuple[float, float]:
        """``(now, busy seconds so far)``."""
        with self._lock:
            now = time.monotonic()
            total, since, running = self._state[0], self._state[1], self._state[2]
        return now, total + (now - since if running else 0.0)


class TimedSampler:
    """A sampler whose generate calls are timed by a :class:`BusyClock` (everything else is the sampler's)."""

    def __init__(self, backend: Any, clock: BusyClock) -> None:
        self._backend, self._clock = backend, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
        with self._clock.timing():
            return self._backend.generate(*args, **kwargs)


def sampler_figures(before: tuple[float, float] | None, after: tuple[float, float]) -> dict[str, float]:
    """The sampler's ``timing/*`` figures between two :meth:`BusyClock.reading` s: its busy and idle seconds and its
    idle share of the interval (nothing before the first reading)."""
    if before is None or after[0] <= before[0]:
        return {}
    wall, busy = after[0] - before[0], max(after[1] - before[1], 0.0)
    idle = max(wall - busy, 0.0)
    return {"timing/sampler_busy_s": busy, "timing/sampler_idle_s": idle, "timing/sampler_idle_ratio": idle / wall}


@dataclasses.dataclass
class ReplicaResult:
    """One rollout of the replica."""

    result: Any
    """The :class:`~trl_plugins.rollout.RolloutResult`."""
    policy_step: int
    """The step of the weights it sampled with."""
    tool_metrics: dict[str, float]
    """The tools' ``step_metrics()`` after the rollout (the tools run in the replica)."""
    probes: dict[int, torch.Tensor]
    """Probe log-probs by pushed step, for the pushes the replica loaded before this rollout."""


def probe_tokens(vocab_size: int, length: int = 32, seed: int = 1234) -> torch.Tensor:
    """A fixed token sequence both sides score after each push (``(length,)`` ids in ``[0, vocab_size)``)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator)


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``model``'s log-probs of each next token of ``tokens`` (``(length - 1,)`` float32, on the CPU): the trainer's
    own log-prob function (:func:`trl_plugins.modeling.token_logprobs`) on one row."""
    from trl_plugins.modeling import token_logprobs

    ids = tokens.to(next(model.parameters()).device)[None]
    return token_logprobs(model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:])[0].float().cpu()


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model a replica copies: ``model`` itself, or a PEFT model's base (whose class and config build it)."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s state dict (what one push sends; the training weights are never shared).

    A PEFT model gives its base model's state with the active LoRA adapters merged in (``W + get_delta_weight``,
    computed aside: the training weights are not merged and unmerged in place, which would move them by rounding),
    under the base model's names, adapter-only weights left out: the replica runs the plain base model."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters and not module.merged:
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    key = f"{name}.base_layer.weight"
                    delta = module.get_delta_weight(adapter).detach()
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    prefix = getattr(model, "prefix", "lora_")
    out = {}
    for name, value in model.state_dict().items():
        if prefix in name or "original_module" in name:
            continue
        tensor = value.detach().to("cpu", copy=True)
        if name in deltas:
            tensor += deltas[name].to(device=tensor.device, dtype=tensor.dtype)
        out[
            name.removeprefix("base_model.model.").replace(".base_layer", "").replace("modules_to_save.default.", "")
        ] = tensor
    return out


def _usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or ``taskset``'s share), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 2


class GenerationReplica:
    """The parent's handle on a generation replica process.

    Args:
        model: The policy (unwrapped); its class, config and current weights build the replica's copy (a PEFT
            model's base class and config, with the adapters merged into the weights: :func:`cpu_state_dict`).
        policy_step: The optimizer step of ``model``'s current weights.
        parts: What the rollout needs (:meth:`Run.rollout_parts <trl_plugins.run.Run.rollout_parts>`; pickled).
        sampler: The run's :class:`~trl_plugins.run.sampler.SamplerKind` (HF generate or continuous batching).
        pad_token_id: HF generate's padding id.
        token_budget: The rollout's token budget (sizes a continuous-batching cache).
        probe: The probe tokens (:func:`probe_tokens`).
        threads: torch threads in the replica (None: half the cores this process may run on, at least 1).
        streaming: Roll out every queued batch at once (each in a thread of its own, their generate calls one at a
            time, weights loaded between calls and each turn stamped with the step it was sampled by), so that a
            batch's trajectories start while the one before finishes its stragglers. False: one batch after another,
            weights loaded between batches.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        policy_step: int,
        parts: RolloutParts,
        sampler: Any,
        pad_token_id: int | None,
        token_budget: int | None,
        probe: torch.Tensor,
        threads: int | None = None,
        streaming: bool = False,
    ) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._jobs = ctx.Queue()
        self._results = ctx.Queue()
        self._clock = BusyClock(ctx.Array("d", 3))  # the replica times its generate calls; the trainer reads it
        base = base_model(model)
        init = dict(
            model_class=type(base),
            model_config=base.config,
            generation_config=getattr(base, "generation_config", None),
            dtype=next(base.parameters()).dtype,
            state=cpu_state_dict(model),
            policy_step=policy_step,
            parts=parts,
            sampler=sampler,
            pad_token_id=pad_token_id,
            token_budget=token_budget,
            probe=probe,
            threads=threads or max(1, _usable_cpus() // 2),
            parent=os.getpid(),
            streaming=streaming,
            clock=self._clock._state,
        )
        self._process = ctx.Process(
            target=_serve, args=(self._jobs, self._results, init), daemon=True, name="trl-plugins-replica"
        )
        with _main_not_rerun():
            self._process.start()
        self._pending: list[Any] = []
        self._done: dict[Any, ReplicaResult] = {}
        self._probes: dict[int, torch.Tensor] = {}
        self.pushed_step = policy_step
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def sampler_clock(self) -> tuple[float, float]:
        """The replica's sampler's :meth:`BusyClock.reading`, now."""
        return self._clock.reading()

    def push_weights(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """Send the weights of ``step`` (a CPU state dict of its own: :func:`cpu_state_dict`)."""
        self._jobs.put(("weights", step, dict(state)))
        self.pushed_step = step

    def submit(
        self, key: Any, rows: Sequence[Mapping[str, Any]], *, group_size: int, seed: int, id_offset: int = 0
    ) -> None:
        """Queue a rollout of ``rows`` (each ``group_size`` times), answered by :meth:`result` with ``key``."""
        self._jobs.put(("rollout", key, [dict(r) for r in rows], group_size, seed, id_offset))
        self._pending.append(key)

    @property
    def pending(self) -> list[Any]:
        """Keys submitted and not yet collected, oldest first."""
        return list(self._pending)

    def result(self, key: Any, *, cancelled: Callable[[], bool] | None = None) -> ReplicaResult | None:
        """Wait for the rollout ``key`` (the oldest pending one; with ``streaming`` later ones may finish first and are
        kept). None: ``cancelled()`` turned true while waiting (the rollout is then abandoned: close the replica), or
        the replica failed while a stop was pending or within :data:`STOP_GRACE_S` after (it died of the same signal,
        or left an answer half-shared): the stop, not a failure.

        Raises:
            ReplicaError: the replica failed or exited, and no stop was asked for.
        """
        if not self._pending or self._pending[0] != key:
            raise ValueError(f"rollout {key!r} is not the oldest pending one (pending: {self._pending}).")
        while key not in self._done:
            try:
                message = self._results.get(timeout=0.2)
            except queue.Empty:
                if cancelled is not None and cancelled():
                    return None
                if not self._process.is_alive():
                    if stop_pending(cancelled):
                        return None
                    raise ReplicaError(
                        f"the generation replica (pid {self._process.pid}) {self._how_it_ended()} "
                        f"without an error message."
                    ) from None
                continue
            except Exception as exc:  # noqa: BLE001 - an answer it left half-shared: its tensors' owner is gone
                if stop_pending(cancelled):
                    return None
                raise ReplicaError(
                    f"reading the generation replica's answer failed ({type(exc).__name__}: {exc}); the "
                    f"replica (pid {self._process.pid}) {self._how_it_ended()}."
                ) from exc
            kind = message[0]
            if kind == "error":
                self.close()
                if stop_pending(cancelled):
                    logger.info(
                        "the generation replica failed while a stop was pending (the stop stands): %s",
                        message[1].strip().splitlines()[-1:],
                    )
                    return None
                raise ReplicaError(f"the generation replica failed:\n{message[1]}")
            if kind == "probe":
                self._probes[message[1]] = message[2]
                continue
            _, got, result, step, tool_metrics = message
            if got not in self._pending:
                raise ReplicaError(f"the generation replica answered {got!r}, which is not pending ({self._pending}).")
            self._done[got] = ReplicaResult(result, step, tool_metrics, {})
        self._pending.pop(0)
        answer = self._done.pop(key)
        answer.probes, self._probes = self._probes, {}
        return answer

    def _how_it_ended(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "still runs"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exited with code {code}"

    def close(self, timeout: float = 5.0) -> None:
        """Stop the replica (rollouts in flight are abandoned) and wait for it to exit; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._jobs.put(("stop",))
        except (OSError, ValueError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        for q in (self._jobs, self._results):
            q.cancel_join_thread()
            q.close()


@contextlib.contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Start a ``spawn`` child without re-running the parent's ``__main__`` (multiprocessing runs the main script
    again in the child unless it is guarded by ``if __name__ == "__main__"``, which a user's training script may not be;
    the replica needs nothing from it). Objects sent to it must then be importable, not defined in ``__main__``."""
    main = sys.modules.get("__main__")
    saved = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__
    }
    try:
        for name in saved:
            if name == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[name]
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class StampedSampler:
    """A sampler whose weights can change during a rollout, as the rollout sees it: each generate call runs under
    ``guard()`` (weights are never loaded during one) and its samples are stamped with ``step()``, the step of the
    weights then held (the engine records it as the turn's ``policy_step``). Everything else is the sampler's; to time
    the calls and not the wait for the guard, hand it a :class:`TimedSampler`."""

    def __init__(self, backend: Any, guard: Callable[[], ContextManager[Any]], step: Callable[[], int]) -> None:
        self._backend, self._guard, self._step = backend, guard, step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def generate(self, prompts: Any, max_new_tokens: Any, *, seeds: Any) -> list[Any]:
        with self._guard():
            step = self._step()
            samples = self._backend.generate(prompts, max_new_tokens, seeds=seeds)
        for sample in samples:
            sample.policy_step = step
        return samples


class _ReplicaSampler(StampedSampler):
    """The replica's sampler with streaming: one generate call at a time (weights are loaded under the same lock)."""

    def __init__(self, backend: Any, lock: threading.Lock, version: list[int]) -> None:
        super().__init__(backend, lambda: lock, lambda: version[0])

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # The replica's model is a plain module (nothing to unwrap or gather); concurrent rollouts must not share the
        # inner backend's per-session state.
        yield None


def _serve(jobs: Any, results: Any, init: dict[str, Any]) -> None:
    """The replica's loop (in the child process)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when to stop (Ctrl-C reaches the group)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parts = None
    try:
        torch.set_num_threads(init["threads"])
        from trl_plugins.pipeline.batch import rollout_rows
        from trl_plugins.run.sampler import make_backend

        model = init["model_class"](init["model_config"])
        if init["generation_config"] is not None:
            model.generation_config = init["generation_config"]
        model.to(init["dtype"])
        model.load_state_dict(init["state"])
        model.eval()
        version = [init["policy_step"]]
        parts: RolloutParts = init["parts"]
        for tool in parts.tools.values():
            tool.start_up()
        backend = make_backend(
            init["sampler"],
            parts.config,
            parts.chat,
            model=model,
            pad_token_id=init["pad_token_id"],
            token_budget=init["token_budget"],
        )
        lock = threading.Lock()
        backend = TimedSampler(backend, BusyClock(init["clock"]))  # inside the streaming lock: its wait is not sampling
        if init["streaming"]:
            backend = _ReplicaSampler(backend, lock, version)
        probe = init["probe"]
        results.put(("probe", version[0], probe_logprobs(model, probe)))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        results.put(("error", traceback.format_exc()))
        return

    def roll_out(key: Any, rows: Any, group_size: int, seed: int, id_offset: int) -> None:
        start = version[0]  # the trajectories' version; with streaming later turns may be newer (stamped per call)
        try:
            result = rollout_rows(
                parts, backend, rows, group_size=group_size, seed=seed, policy_step=start, id_offset=id_offset
            )
            results.put(("rollout", key, result, start, parts.step_metrics()))  # what ran here: tools, judges
        except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
            results.put(("error", traceback.format_exc()))

    try:
        while True:
            try:
                message = jobs.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != init["parent"]:
                    return
                continue
            if message[0] == "stop":
                return
            if message[0] == "weights":
                _, step, state = message
                with lock:
                    model.load_state_dict(state)
                    version[0] = step
                del state
                results.put(("probe", step, probe_logprobs(model, probe)))
                continue
            _, key, rows, group_size, seed, id_offset = message
            if init["streaming"]:
                threading.Thread(
                    target=roll_out, args=(key, rows, group_size, seed, id_offset), daemon=True, name=f"rollout-{key}"
                ).start()
            else:
                roll_out(key, rows, group_size, seed, id_offset)
    except BaseException:  # noqa: BLE001
        results.put(("error", traceback.format_exc()))
    finally:
        for tool in parts.tools.values():
            try:
                tool.close()
            except Exception:  # noqa: BLE001 - the replica is exiting
                logger.exception("closing tool %s in the replica failed", getattr(tool, "label", tool))
