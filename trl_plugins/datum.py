"""Trajectory -> training datum: one prefix-merged, right-shifted sample per multi-turn trajectory.

For turns with prompts ``P_i`` and completions ``C_i``, every later prompt must extend everything
before it, ``P_i = P_{i-1} + C_{i-1} + D_i`` (``D_i``: tool output and template glue), so the whole
episode is one sequence ``full = P_1 + C_1 + D_2 + C_2 + ...``. The datum is that sequence shifted
right once: ``input = full[:-1]``, ``target = full[1:]``, and every per-position array (behaviour
log-prob, advantage, action mask, provenance) is aligned with ``target``. Prompt, tool and glue tokens
stay in the context but carry zero advantage and a placeholder log-prob that the mask never reads.

Worked example (``tests/test_datum.py``): ``P1=[101,102,103]``, ``C1=[201,202,90]``,
``D2=[91,301,302,303,104]``, ``C2=[401,402]`` -> 13 tokens, 12 positions after the shift, 5 of them
loss positions.
"""

from __future__ import annotations

import enum
import math
from typing import Sequence

import torch

from trl_plugins.packing.prefix_trees import layout_trees, prefix_trees
from trl_plugins.types import (
    PLACEHOLDER_LOGPROB,
    Datum,
    MicroBatch,
    PrefixTree,
    SharedPrefixLayout,
    TokenSource,
    Trajectory,
    TrajectoryError,
)

__all__ = [
    "PrefixMismatch",
    "DatumError",
    "build_datums",
    "build_datum",
    "collate",
    "dummy_micro_batch",
    "shared_prefix_layout",
]


class PrefixMismatch(enum.StrEnum):
    """What to do when a later turn's prompt does not extend everything before it."""

    ERROR = "error"
    """Raise :class:`DatumError` naming the turn and the first differing position."""
    SPLIT = "split"
    """Start a new datum at that turn (each run of prefix-consistent turns becomes one datum)."""


class DatumError(ValueError):
    """A trajectory cannot be turned into a datum; the message says why and what to change."""


def _first_difference(prefix: Sequence[int], prompt: Sequence[int]) -> int:
    for k, (a, b) in enumerate(zip(prefix, prompt)):
        if a != b:
            return k
    return min(len(prefix), len(prompt))


def _to_datum(
    full: list[int],
    sources: list[TokenSource],
    logprobs: list[float],
    advantage: float,
    turn_of: list[int],
    *,
    trajectory_index: int,
    group_id: int,
    bootstrap_mask: int,
    turn_steps: list[int | None],
) -> Datum:
    target_sources = sources[1:]
    mask = [int(s == TokenSource.ACTION) for s in target_sources]
    known = all(step is not None for step in turn_steps)
    return Datum(
        turn_ids=[t if m else -1 for t, m in zip(turn_of[1:], mask)],
        behaviour_steps=[turn_steps[t] if m and t >= 0 else -1 for t, m in zip(turn_of[1:], mask)] if known else None,
        input_ids=full[:-1],
        target_ids=full[1:],
        behaviour_logprobs=[lp if m else PLACEHOLDER_LOGPROB for lp, m in zip(logprobs[1:], mask)],
        advantages=[advantage if m else 0.0 for m in mask],
        action_mask=mask,
        sources=target_sources,
        trajectory_index=trajectory_index,
        group_id=group_id,
        bootstrap_mask=bootstrap_mask,
    )


def build_datums(
    traj: Trajectory,
    *,
    advantage: float | None = None,
    max_context_tokens: int | None = None,
    on_prefix_mismatch: PrefixMismatch | str = PrefixMismatch.ERROR,
    trajectory_index: int = 0,
) -> list[Datum]:
    """Build the datum(s) of one trajectory.

    Args:
        traj: A finished trajectory (see :func:`trl_plugins.rollout.validate.validate_trajectory`).
        advantage: Scalar advantage put on every action position; defaults to ``traj.advantage``.
        max_context_tokens: Training context limit on the shifted length ``len(full) - 1``.
        on_prefix_mismatch: ``"error"`` (default) or ``"split"`` into several datums. A turn marked
            ``segment_start`` (its producer rendered the conversation afresh) starts a new datum either way.
        trajectory_index: Stored on the datum to find its trajectory again.

    Returns:
        One datum per segment (:attr:`~trl_plugins.types.Trajectory.num_segments`), or one per prefix-consistent run
        of turns with ``on_prefix_mismatch="split"``.

    Raises:
        DatumError: no advantage; an empty first prompt; a later prompt that does not extend what
            came before (names the turn and position); a datum longer than ``max_context_tokens``
            (names the limit and the rollout budget to lower).
    """
    mode = PrefixMismatch(on_prefix_mismatch)
    adv = traj.advantage if advantage is None else advantage
    if adv is None or not math.isfinite(adv):
        raise DatumError(
            f"trajectory {trajectory_index} (question {traj.question_id!r}) has advantage {adv}; "
            f"compute advantages before building datums, or pass advantage= explicitly."
        )
    if not traj.turns:
        raise DatumError(f"trajectory {trajectory_index} has no turns.")
    if not traj.turns[0].prompt_ids:
        raise DatumError(
            f"trajectory {trajectory_index}, turn 0 has an empty prompt: the first sampled token "
            f"would have no context to be scored from."
        )

    segments: list[tuple[list[int], list[TokenSource], list[float], list[int]]] = []
    full: list[int] = []
    sources: list[TokenSource] = []
    logprobs: list[float] = []
    turn_of: list[int] = []  # per token of full: the turn whose completion it is, -1 for prompt tokens
    for i, turn in enumerate(traj.turns):
        prompt = turn.prompt_ids
        if i > 0 and turn.segment_start:  # the producer declared a fresh rendering: a datum of its own
            segments.append((full, sources, logprobs, turn_of))
            full, sources, logprobs, turn_of = [], [], [], []
        elif i > 0 and (len(prompt) < len(full) or prompt[: len(full)] != full):
            k = _first_difference(full, prompt)
            if mode == PrefixMismatch.ERROR:
                got = prompt[k] if k < len(prompt) else "<end of prompt>"
                want = full[k] if k < len(full) else "<end>"
                raise DatumError(
                    f"trajectory {trajectory_index} (question {traj.question_id!r}), turn {i}: the "
                    f"prompt does not extend the previous turns (first difference at token {k}: "
                    f"expected {want}, got {got}; prompt length {len(prompt)}, history length "
                    f"{len(full)}). The history was re-tokenised or the chat template rewrote it "
                    f"(e.g. stripped reasoning). Build the next prompt from the sampled tokens, or "
                    f"pass on_prefix_mismatch='split' to train each consistent run separately."
                )
            segments.append((full, sources, logprobs, turn_of))
            full, sources, logprobs, turn_of = [], [], [], []
        new = prompt[len(full) :]
        if turn.prompt_sources is not None:
            new_sources = list(turn.prompt_sources)
        else:
            default = TokenSource.PROMPT if not full else TokenSource.OBSERVATION
            new_sources = [default] * len(new)
        if len(new_sources) != len(new):
            raise TrajectoryError(
                f"trajectory {trajectory_index}, turn {i}: prompt_sources has {len(new_sources)} "
                f"entries for {len(new)} new prompt tokens."
            )
        full = full + list(new) + list(turn.completion_ids)
        turn_of = turn_of + [-1] * len(new) + [i] * len(turn.completion_ids)
        sources = sources + new_sources + turn.sources()
        logprobs = logprobs + [math.nan] * len(new) + list(turn.completion_logprobs)
    segments.append((full, sources, logprobs, turn_of))

    datums = []
    for s, (seg_full, seg_sources, seg_logprobs, seg_turns) in enumerate(segments):
        last = s == len(segments) - 1
        bootstrap = int(traj.truncated) if last else 1
        datum = _to_datum(
            seg_full,
            seg_sources,
            seg_logprobs,
            float(adv),
            seg_turns,
            trajectory_index=trajectory_index,
            group_id=traj.group_id,
            bootstrap_mask=bootstrap,
            turn_steps=traj.turn_policy_steps(),
        )
        if max_context_tokens is not None and datum.num_tokens > max_context_tokens:
            raise DatumError(
                f"trajectory {trajectory_index} (question {traj.question_id!r}) makes a datum of "
                f"{datum.num_tokens} tokens (after the shift), over the training context limit "
                f"max_context_tokens={max_context_tokens}. Lower the rollout's trajectory token "
                f"budget (max_trajectory_tokens) to at most {max_context_tokens + 1}, or raise "
                f"max_context_tokens."
            )
        datums.append(datum)
    return datums


def build_datum(traj: Trajectory, **kwargs) -> Datum:
    """The single datum of a prefix-consistent trajectory of one segment (``on_prefix_mismatch="error"``).

    Raises:
        DatumError: as :func:`build_datums`, and for a trajectory of several segments (use :func:`build_datums`).
    """
    kwargs["on_prefix_mismatch"] = PrefixMismatch.ERROR
    datums = build_datums(traj, **kwargs)
    if len(datums) > 1:
        raise DatumError(
            f"trajectory {kwargs.get('trajectory_index', 0)} (question {traj.question_id!r}) has "
            f"{len(datums)} segments (turns marked segment_start); build_datums gives one datum each."
        )
    return datums[0]


def shared_prefix_layout(
    rows: Sequence[Sequence[int]], *, pad_token_id: int, trees: Sequence[PrefixTree] | None = None
) -> SharedPrefixLayout:
    """The :class:`~trl_plugins.types.SharedPrefixLayout` of a micro-batch whose datums read ``rows`` (their
    ``input_ids``, in row order): each prefix that ``trees`` share (default: :func:`~trl_plugins.packing.prefix_trees`
    of the rows, the fewest tokens) forwarded once, every row's remaining tokens as its branch; a datum that shares
    nothing is a branch or a prefix row of its own, and a datum whose branch would widen all the others is forwarded
    whole, whichever gives the smaller area (:func:`~trl_plugins.packing.prefix_trees.layout_trees`)."""
    # As forwarded: a lone datum a branch or a prefix row of its own, a datum whose branch would widen every row
    # forwarded whole (layout_trees).
    trees, used = layout_trees([len(r) for r in rows], prefix_trees(rows) if trees is None else trees)
    shared = [(t, n) for t, n in zip(trees, used) if n > 0]
    width = max((n for _, n in shared), default=1)  # one 1-token placeholder row when no prefix is forwarded
    branch = max(1, max(len(rows[r]) - n for t, n in zip(trees, used) for r in t.members))
    k_rows, b_rows, longest = max(len(shared), 1), len(rows), max(len(r) for r in rows)
    prefix_ids = torch.full((k_rows, width), pad_token_id, dtype=torch.long)
    prefix_mask = torch.zeros((k_rows, width), dtype=torch.long)
    prefix_positions = torch.zeros((k_rows, width), dtype=torch.long)
    if not shared:
        prefix_mask[0, -1] = 1  # the placeholder attends to itself (a fully masked row can give NaN)
    branch_ids = torch.full((b_rows, branch), pad_token_id, dtype=torch.long)
    branch_mask = torch.zeros((b_rows, width + branch), dtype=torch.long)
    branch_positions = torch.zeros((b_rows, branch), dtype=torch.long)
    row_prefix = torch.zeros(b_rows, dtype=torch.long)
    index = torch.zeros((b_rows, longest), dtype=torch.long)
    prefix_of = {}
    for k, (tree, n) in enumerate(shared):
        prefix_ids[k, width - n :] = torch.tensor(rows[tree.members[0]][:n], dtype=torch.long)
        prefix_mask[k, width - n :] = 1
        prefix_positions[k, width - n :] = torch.arange(n)
        prefix_of.update({r: k for r in tree.members})
    flat_branch = k_rows * width
    for tree, n in zip(trees, used):
        for r in tree.members:
            own = rows[r][n:]
            branch_ids[r, : len(own)] = torch.tensor(own, dtype=torch.long)
            branch_mask[r, width : width + len(own)] = 1
            branch_positions[r] = n + torch.arange(branch)
            if n:
                k = prefix_of[r]
                row_prefix[r] = k
                branch_mask[r, :width] = prefix_mask[k]
                index[r, :n] = k * width + width - n + torch.arange(n)
            index[r, n : len(rows[r])] = flat_branch + r * branch + torch.arange(len(own))
    return SharedPrefixLayout(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        prefix_positions=prefix_positions,
        branch_ids=branch_ids,
        branch_mask=branch_mask,
        branch_positions=branch_positions,
        row_prefix=row_prefix,
        index=index,
    )


def collate(
    datums: Sequence[Datum],
    indices: Sequence[int],
    *,
    pad_token_id: int,
    padding_free: bool = False,
    shared_prefix: bool = False,
) -> MicroBatch:
    """Right-pad ``datums[i] for i in indices`` into a :class:`MicroBatch`; with ``padding_free`` also give it
    the position ids of the datums concatenated (the model then sees no padding; see :class:`MicroBatch`); with
    ``shared_prefix`` its :func:`shared_prefix_layout` (each prefix its datums share forwarded once).

    Raises:
        ValueError: if ``indices`` is empty (use :func:`dummy_micro_batch`), or both layouts are asked for.
    """
    if not indices:
        raise ValueError("cannot collate an empty micro-batch; use dummy_micro_batch() instead.")
    if padding_free and shared_prefix:
        raise ValueError("padding_free and shared_prefix are two layouts of a micro-batch; ask for one.")
    rows = [datums[i] for i in indices]
    width = max(d.num_tokens for d in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    target_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    action_mask = torch.zeros(shape, dtype=torch.float32)
    optional = {}
    with_turns = all(d.turn_ids is not None for d in rows)
    turn_ids = torch.full(shape, -1, dtype=torch.long) if with_turns else None
    for name in ("ref_logprobs", "old_logprobs", "old_values", "returns"):
        present = [getattr(d, name) is not None for d in rows]
        if any(present) and not all(present):
            raise ValueError(f"some datums of the micro-batch carry {name} and some do not; fill all or none.")
        optional[name] = torch.zeros(shape, dtype=torch.float32) if all(present) else None
    for r, d in enumerate(rows):
        n = d.num_tokens
        input_ids[r, :n] = torch.tensor(d.input_ids, dtype=torch.long)
        target_ids[r, :n] = torch.tensor(d.target_ids, dtype=torch.long)
        attention_mask[r, :n] = 1
        behaviour[r, :n] = torch.tensor(d.behaviour_logprobs, dtype=torch.float32)
        advantages[r, :n] = torch.tensor(d.advantages, dtype=torch.float32)
        action_mask[r, :n] = torch.tensor(d.action_mask, dtype=torch.float32)
        if turn_ids is not None:
            turn_ids[r, :n] = torch.tensor(d.turn_ids, dtype=torch.long)
        for name, tensor in optional.items():
            if tensor is not None:
                tensor[r, :n] = torch.tensor(getattr(d, name), dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        target_ids=target_ids,
        behaviour_logprobs=behaviour,
        advantages=advantages,
        action_mask=action_mask,
        datum_indices=list(indices),
        position_ids=torch.cat([torch.arange(d.num_tokens) for d in rows])[None, :] if padding_free else None,
        turn_ids=turn_ids,
        shared_prefix=shared_prefix_layout([d.input_ids for d in rows], pad_token_id=pad_token_id)
        if shared_prefix
        else None,
        **optional,
    )


def dummy_micro_batch(
    *, pad_token_id: int, with_ref: bool = False, with_values: bool = False, shared_prefix: bool = False
) -> MicroBatch:
    """A one-token, zero-weight micro-batch for ranks that have fewer real ones than the others.

    It has one attended token (a fully masked row can give NaN attention) and an all-zero action
    mask, so its loss and gradient are exactly zero while its forward/backward still take part in
    every collective (``shared_prefix``: in that layout, whose two forwards every micro-batch runs).
    """
    one = torch.full((1, 1), pad_token_id, dtype=torch.long)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    return MicroBatch(
        input_ids=one,
        attention_mask=torch.ones_like(one),
        target_ids=one.clone(),
        behaviour_logprobs=zeros.clone(),
        advantages=zeros.clone(),
        action_mask=zeros.clone(),
        datum_indices=[],
        ref_logprobs=zeros.clone() if with_ref else None,
        old_values=zeros.clone() if with_values else None,
        returns=zeros.clone() if with_values else None,
        turn_ids=torch.full_like(one, -1),
        weight=0.0,
        shared_prefix=shared_prefix_layout([[pad_token_id]], pad_token_id=pad_token_id) if shared_prefix else None,
    )
