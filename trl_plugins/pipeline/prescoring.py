"""Scoring while the rollout runs: the reward components that declare ``scores_during_rollout`` (a judge with a cache)
are called as each trajectory, or each whole group, ends, on threads of their own, so a judge's latency overlaps the
generation of the trajectories still running. What they compute lands in their cache; the scoring after the rollout
(:func:`~trl_plugins.pipeline.batch.score_trajectories`) reads it back. Used by
:func:`~trl_plugins.pipeline.batch.rollout_rows`, so wherever a rollout runs (the trainer, an async replica, the
threads of a vLLM server's rollouts)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Mapping, Sequence

from trl_plugins.protocols import RewardPlugin
from trl_plugins.types import Trajectory

__all__ = ["RolloutScorer"]

logger = logging.getLogger(__name__)


class RolloutScorer:
    """Calls each prescoring component's ``score_batch(..., during_rollout=True)`` as its unit ends: a trajectory
    (``"trajectory"``) or a group, once its ``group_size`` members have all ended (``"group"``). Trajectories the world
    failed are not scored; a group is judged on its other members."""

    def __init__(self, components: Sequence[RewardPlugin], rows: Sequence[Mapping[str, Any]], group_size: int) -> None:
        self.components, self.rows, self.group_size = list(components), rows, group_size
        workers = max(int(getattr(c.impl, "concurrency", 8)) for c in self.components)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="prescore")
        self._groups: dict[int, list[Trajectory]] = {}
        self._futures: list[Future] = []

    def finished(self, traj: Trajectory) -> None:
        """The rollout's ``on_finished``: submit what this trajectory completes; returns at once, never raises."""
        try:
            members = self._groups.setdefault(traj.group_id, [])
            members.append(traj)
            row = self.rows[traj.group_id]
            for c in self.components:
                if c.scores_during_rollout == "trajectory" and not traj.world_failure:
                    self._submit(c, [traj], [row])
                elif c.scores_during_rollout == "group" and len(members) == self.group_size:
                    scored = [t for t in members if not t.world_failure]
                    if scored:
                        self._submit(c, scored, [row] * len(scored))
        except Exception:  # noqa: BLE001 - scoring afterwards still happens: this only loses the overlap
            logger.exception("scoring a trajectory during the rollout failed to start; it is scored afterwards")

    def _submit(self, component: RewardPlugin, trajs: list[Trajectory], rows: list[Mapping[str, Any]]) -> None:
        self._futures.append(self._pool.submit(component.score_batch_fn, trajs, rows, during_rollout=True))

    def wait(self, stop: Any = None) -> bool:
        """Wait for every call submitted (each bounded by its component's own deadlines), or until ``stop`` (a
        ``threading.Event``: a stop request) is set, which abandons the calls left. Returns whether all finished."""
        for future in self._futures:
            while True:
                if stop is not None and stop.is_set():
                    self.abandon()
                    return False
                try:
                    future.result(timeout=0.05)
                except FutureTimeout:
                    continue
                except Exception:  # noqa: BLE001 - the scoring afterwards meets the same failure and reports it
                    logger.exception("a reward component raised while scoring during the rollout")
                break
        self._pool.shutdown(wait=True)
        return True

    def abandon(self) -> None:
        """The rollout failed or was cancelled: drop what has not started, without waiting."""
        self._pool.shutdown(wait=False, cancel_futures=True)
