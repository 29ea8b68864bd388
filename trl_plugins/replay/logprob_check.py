"""The replay's re-derivation of log-probs (the policy's behaviour log-probs, a teacher's, and a server teacher's top
tokens) from a saved batch's datums, compared with what was saved: :func:`check_logprobs`."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from trl_plugins.modeling import token_logprobs
from trl_plugins.replay.report import Difference, ReplayReport, token_text
from trl_plugins.types import SamplingSettings, Trajectory

__all__ = ["check_logprobs", "check_top", "nan_for_none", "turn_of"]


def nan_for_none(x: Any) -> float:
    """A saved float (None where JSON could not hold a NaN or an infinity) as a float."""
    return float("nan") if x is None else float(x)


def turn_of(traj: Trajectory, position: int) -> int:
    """The assistant turn (0-based) a token position of the trajectory's whole sequence is in or before."""
    return next((t for t in range(len(traj.turns) - 1, -1, -1) if len(traj.turns[t].prompt_ids) <= position), 0)


@torch.no_grad()
def check_logprobs(
    model: Any,
    tok: Any,
    entries: list[tuple[int, Mapping, Trajectory]],
    tolerance: float,
    report: ReplayReport,
    *,
    saved_field: str = "behaviour_logprobs",
    check: str = "logprobs",
) -> None:
    local = isinstance(model, torch.nn.Module)  # else a server teacher's client (temperature 1, whole sequences)
    was_training = model.training if local else False
    if local:
        model.eval()
    device = next(model.parameters()).device if local else "cpu"
    diffs = []
    try:
        for i, entry, traj in entries:
            d = entry["datum"]
            sampling = traj.policy_version.sampling if traj.policy_version else SamplingSettings()
            ids = torch.tensor([d["input_ids"]], device=device)
            if not local:
                saved_top = d.get("teacher_top") if check == "teacher" else None
                k = max((len(t) for t in saved_top or []), default=0)
                ((asked, top),) = model.sequence_top_logprobs([list(d["input_ids"]) + [d["target_ids"][-1]]], top_k=k)
                lp = torch.tensor(asked, dtype=torch.float64)
                if k:
                    check_top(saved_top, top, d["action_mask"], tolerance, i, entry, traj, tok, report)
            else:
                lp = (
                    token_logprobs(
                        model,
                        ids,
                        torch.ones_like(ids),
                        torch.tensor([d["target_ids"]], device=device),
                        temperature=sampling.temperature or 1.0,
                    )[0]
                    .double()
                    .cpu()
                )
            saved = torch.tensor([nan_for_none(x) for x in d[saved_field]], dtype=torch.float64)
            mask = torch.tensor(d["action_mask"], dtype=torch.bool)
            gap = (lp - saved).abs()
            gap[~mask] = 0.0
            diffs.append(gap[mask])
            beyond = torch.nonzero(gap > tolerance).flatten()
            whose = "the teacher's " if check == "teacher" else ""
            if len(beyond):
                j = int(beyond[0])
                report.differences.append(
                    Difference(
                        check,
                        i,
                        f"{whose}log-prob of action token {token_text(tok, entry['tokens']['ids'], j + 1)} differs by "
                        f"{float(gap[j]):.3g} (> {tolerance:.3g}; {len(beyond)} such tokens)",
                        turn_of(traj, j + 1),
                        j + 1,
                        f"{float(saved[j]):.6f}",
                        f"{float(lp[j]):.6f}",
                    )
                )
    finally:
        if local:
            model.train(was_training)
    every = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    figures = {
        "max_abs_diff": float(every.max()) if len(every) else 0.0,
        "p99_abs_diff": float(torch.quantile(every, 0.99)) if len(every) else 0.0,
        "tolerance": tolerance,
        "num_tokens": float(len(every)),
        "beyond": float((every > tolerance).sum()),
    }
    setattr(report, "teacher" if check == "teacher" else "logprobs", figures)


def check_top(
    saved: list,
    now: list,
    mask: list,
    tolerance: float,
    i: int,
    entry: Mapping,
    traj: Trajectory,
    tok: Any,
    report: Any,
) -> None:
    """A server teacher's top tokens (``Datum.teacher_top``, for the ``jsd`` loss) against what it answers now: at
    each action token the same ids in the same order, each log-prob within ``tolerance``; the first that is not is a
    difference of the ``teacher`` check."""
    for j, on in enumerate(mask):
        if not on:
            continue
        want = [(int(a), float(b)) for a, b in saved[j]]
        got = [(int(a), float(b)) for a, b in now[j][: len(want)]]
        ids_differ = [a for a, _ in want] != [a for a, _ in got]
        gap = 0.0 if ids_differ else max((abs(a - b) for (_, a), (_, b) in zip(want, got)), default=0.0)
        if ids_differ or gap > tolerance:
            what = "tokens" if ids_differ else f"log-probs (by {gap:.3g} > {tolerance:.3g})"
            report.differences.append(
                Difference(
                    "teacher",
                    i,
                    f"the teacher's top {len(want)} {what} after action token "
                    f"{token_text(tok, entry['tokens']['ids'], j + 1)} differ",
                    turn_of(traj, j + 1),
                    j + 1,
                    str([a for a, _ in want]),
                    str([a for a, _ in got]),
                )
            )
            return
