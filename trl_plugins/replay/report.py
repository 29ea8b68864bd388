"""What a replay of a saved batch reports (:class:`ReplayReport`: the first :class:`Difference` per trajectory and
check), the tolerance it compares log-probs with, and the refusal when versions differ
(:mod:`trl_plugins.replay.saved_batch` runs the checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from trl_plugins.types import LogprobSource

__all__ = ["CHECKS", "Difference", "ReplayRefused", "ReplayReport", "default_tolerance"]

CHECKS = ("version", "rendering", "logprobs", "teacher", "resample", "tools", "rewards", "stop_reason", "datum")
"""The checks a replay reports, in the order it runs them."""


class ReplayRefused(ValueError):
    """The saved batch was made with another tokenizer, tool schemas or verifier: says what changed and how to go on."""


@dataclass
class Difference:
    """The first thing that differs in one check of one trajectory."""

    check: str
    """One of :data:`CHECKS`."""
    trajectory: int | None
    """Its index in the saved batch (None: the batch as a whole)."""
    what: str
    """What differs, in words."""
    turn: int | None = None
    """Assistant turn (0-based) the difference is in or before."""
    token: int | None = None
    """Token index in the trajectory's whole sequence."""
    saved: str | None = None
    """The saved side (a token's text, a value)."""
    current: str | None = None
    """The re-derived side."""

    def line(self) -> str:
        where = ", ".join(
            f"{k} {v}"
            for k, v in (("trajectory", self.trajectory), ("turn", self.turn), ("token", self.token))
            if v is not None
        )
        sides = "" if self.saved is None and self.current is None else f": saved {self.saved}, now {self.current}"
        return f"[{self.check}] {where + ': ' if where else ''}{self.what}{sides}"


@dataclass
class ReplayReport:
    """What a replay compared and found."""

    differences: list[Difference] = field(default_factory=list)
    """The first difference per trajectory and check."""
    compared: dict[str, int] = field(default_factory=dict)
    """Per check, how many trajectories it compared."""
    notes: list[str] = field(default_factory=list)
    """What was not compared, and why (skipped trajectories, a format-2 file's limits)."""
    ran_anyway: list[str] = field(default_factory=list)
    """The version differences the replay was told to run despite (``anyway``); empty when it found none."""
    logprobs: dict[str, float] | None = None
    """``max_abs_diff``, ``p99_abs_diff``, ``tolerance``, ``num_tokens``, ``beyond`` (None: not compared)."""
    teacher: dict[str, float] | None = None
    """The same figures for the teacher's log-probs (on-policy distillation; None: not compared)."""

    @property
    def ok(self) -> bool:
        """Everything compared equal (within tolerance), and no version difference was overridden."""
        return not self.differences and not self.ran_anyway

    def render(self) -> str:
        """The report as text: one line per check, then each difference."""
        label = "RAN DESPITE VERSION DIFFERENCES (--anyway): " if self.ran_anyway else ""
        lines = [f"{label}{d}" for d in self.ran_anyway]
        for check in CHECKS:
            if check in self.compared:
                found = [d for d in self.differences if d.check == check]
                lines.append(
                    f"{check}: {self.compared[check]} trajectories compared, "
                    + (f"{len(found)} differ" if found else "all equal")
                )
        for name, lp in (("logprobs", self.logprobs), ("teacher", self.teacher)):
            if lp is not None:
                lines.append(
                    f"{name}: max |saved - recomputed| {lp['max_abs_diff']:.3g}, p99 {lp['p99_abs_diff']:.3g} over "
                    f"{int(lp['num_tokens'])} action tokens; {int(lp['beyond'])} beyond the tolerance "
                    f"{lp['tolerance']:.3g}"
                )
        lines += [("  " + label if label else "  ") + d.line() for d in self.differences]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(
            "replay: "
            + (
                "everything compared equal"
                if self.ok
                else "DIFFERENCES FOUND"
                if self.differences
                else "equal, but only because version differences were overridden"
            )
        )
        return "\n".join(lines)


def default_tolerance(version: Mapping[str, Any] | None, logprob_source: str | None) -> float:
    """The largest log-prob difference a replay accepts: 1e-4 for fp32 weights sampled by the trainer's own
    forward (what CPU fp32 agrees to), 1e-2 for half precision or a vLLM sampler (``processed`` log-probs)."""
    dtype = (version or {}).get("dtype") or "float32"
    if logprob_source == str(LogprobSource.PROCESSED) or dtype not in ("float32", "float64"):
        return 1e-2
    return 1e-4


def token_text(tokenizer: Any, ids: Sequence[int], k: int) -> str | None:
    return None if k >= len(ids) else repr(tokenizer.decode([ids[k]], skip_special_tokens=False))


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if k == len(a) == len(b) else k
