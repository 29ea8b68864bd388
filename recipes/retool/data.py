"""The recipe's data: rows of the bundled task or of a Hub/local dataset, and what to hide from the sandbox.

The held-out rows never overlap the training rows: they come from the dataset's own held-out split
(``dataset_test_split``) when it has one, else from a deterministic share of the training rows
(``held_out_fraction`` of its rows: those with the lowest hashes of the prompt text) that training then
leaves out; a single local file is always split that way. :func:`load_task_rows` says which, and refuses
what cannot be split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "load_task_rows",
    "task_rows",
    "rollout_rows",
    "prompt_hash",
    "held_out_mask",
    "answer_paths",
    "hide_answers",
]

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def prompt_hash(prompt: Any) -> float:
    """A prompt's place in [0, 1): the SHA-256 of its text (JSON for a list of messages), as a fraction."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def held_out_mask(prompts: Sequence[Any], fraction: float) -> list[bool]:
    """Which rows to hold out: the ``round(fraction * len(prompts))`` with the lowest :func:`prompt_hash`.

    Deterministic and independent of the row order, the seed and the sizes asked for; rows with the same
    prompt share a hash and fall on the same side (a tie at the boundary holds out its duplicates too).
    """
    hashes = [prompt_hash(p) for p in prompts]
    k = int(fraction * len(hashes) + 0.5)
    if k == 0:
        return [False] * len(hashes)
    threshold = sorted(hashes)[k - 1]
    return [h <= threshold for h in hashes]


def load_task_rows(
    dataset_name: str | None,
    role: Literal["train", "test"],
    *,
    size: int | None,
    seed: int = 0,
    dataset_config: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    train_split: str = "train",
    test_split: str = "test",
    held_out_fraction: float = 0.1,
    log: Callable[[str], None] | None = None,
    task: str = "arithmetic",
    reasoning_gym: Any = None,
) -> list[dict]:
    """Rows ``{"id", "prompt", "answer"}`` for training (``role="train"``) or the held-out evaluation
    (``role="test"``): the bundled ``task`` (``arithmetic`` or ``lookup``; ``reasoning_gym``: the datasets of
    ``reasoning_gym``, a :class:`retool.reasoning_gym_task.ReasoningGymTask`) when ``dataset_name`` is None, else a Hub
    dataset or a
    local file/directory loaded with ``datasets.load_dataset``. A dotted column name reads a nested field
    (e.g. ``reward_model.ground_truth`` in DAPO-style sets).

    Which rows (the two roles never share a row):

    - the bundled task: its ``train_split`` / ``test_split`` (disjoint by construction);
    - reasoning-gym: disjoint seed ranges, de-duplicated by question
    (:func:`retool.reasoning_gym_task.reasoning_gym_problems`);
    - a dataset with a split named ``test_split``: that split, and ``train_split`` for training;
    - a dataset without it, or a single local file (one split): ``held_out_fraction`` of the rows of
      ``train_split`` (the whole file) are held out (:func:`held_out_mask`), the others train.

    ``size`` rows are then drawn (seeded shuffle) from the role's rows. ``log`` receives one line saying
    where the role's rows come from and, when carved, how many fall on each side.

    Raises:
        ValueError: a missing column or split, named with what exists; no held-out split and
            ``held_out_fraction`` 0; a carve that leaves the role no rows (too few rows).
    """
    if role not in ("train", "test"):
        raise ValueError(f"role must be 'train' or 'test', got {role!r}.")
    if dataset_name is None and task == "reasoning_gym":
        from retool.reasoning_gym_task import TRAIN_SEED_OFFSET, reasoning_gym_problems

        if reasoning_gym is None:
            raise ValueError(
                "task 'reasoning_gym' needs its datasets (ScriptArguments.reasoning_gym_task, from --task_kwargs)."
            )
        rows = reasoning_gym_problems(
            reasoning_gym, size or 1000, seed=seed, split="train" if role == "train" else "test"
        )
        if log:
            log(
                f"{'training' if role == 'train' else 'held-out'} rows: {len(rows)} reasoning-gym questions of "
                f"{reasoning_gym.describe()} ("
                + (
                    "seeds from task_seed, each question once"
                    if role == "test"
                    else f"seeds from task_seed + {TRAIN_SEED_OFFSET:,}, none of the "
                    f"{reasoning_gym.held_out_pool}-item held-out pool's questions"
                )
                + ")"
            )
        return rows
    if dataset_name is None:
        from retool.task import bundled_problems

        return bundled_problems(task, size or 1000, seed=seed, split=train_split if role == "train" else test_split)
    import datasets

    path = Path(dataset_name)
    if path.is_file():
        fmt = _FILE_FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(f"cannot read {path}: use a .jsonl, .json, .csv or .parquet file, or a dataset directory.")
        source, split = f"the file {dataset_name}", None
        carve = bool(held_out_fraction)
        if not held_out_fraction and role == "test":
            raise ValueError(
                f"{dataset_name} is a single file: it has no held-out split, and held_out_fraction is 0. Hold out a "
                f"share of its rows with --held_out_fraction 0.1 (training then leaves them out), or skip the "
                f"held-out evaluation with --eval_problems 0."
            )
    else:
        splits = datasets.get_dataset_split_names(dataset_name, dataset_config)
        has_test = test_split in splits
        split = test_split if role == "test" and has_test else train_split
        if split not in splits:
            setting = "--dataset_test_split" if split == test_split else "--dataset_train_split"
            raise ValueError(f"dataset {dataset_name!r} has no split {split!r}; it has {splits}. Set {setting}.")
        if not has_test and role == "test" and not held_out_fraction:
            raise ValueError(
                f"dataset {dataset_name!r} has no split {test_split!r} (it has {splits}) and held_out_fraction is 0. "
                f"Name its held-out split with --dataset_test_split, hold out a share of {train_split!r} with "
                f"--held_out_fraction 0.1 (training then leaves it out), or skip the held-out evaluation with "
                f"--eval_problems 0."
            )
        source = f"split {split!r} of {dataset_name}"
        carve = not has_test and bool(held_out_fraction)
    ds = (
        datasets.load_dataset(fmt, data_files=str(path), split="train")
        if split is None
        else datasets.load_dataset(dataset_name, dataset_config, split=split)
    )
    missing = [c for c in (prompt_column, answer_column) if c.split(".")[0] not in ds.column_names]
    if missing:
        raise ValueError(
            f"dataset {dataset_name!r} ({split or 'file'}) has no column(s) {missing}; it has {ds.column_names}. "
            f"Set --prompt_column/--answer_column."
        )
    if carve:
        held = held_out_mask([_field(row, prompt_column) for row in ds], held_out_fraction)
        keep = [i for i, h in enumerate(held) if h == (role == "test")]
        n_test = sum(held)
        if log:
            why = "a single file has no held-out split" if split is None else f"the dataset has no split {test_split!r}"
            log(
                f"held-out rows: {n_test} of the {len(ds)} rows of {source}, held_out_fraction={held_out_fraction} "
                "of them "
                f"chosen by a hash of the prompt ({why}); training uses the other {len(ds) - n_test}."
            )
        if not keep:
            side = "held out" if role == "test" else "left for training"
            raise ValueError(
                f"{source} has {len(ds)} rows and held_out_fraction={held_out_fraction} leaves none {side} "
                f"({n_test} held out, {len(ds) - n_test} for training): too few rows to split. Use more rows, "
                f"change --held_out_fraction, or skip the held-out evaluation with --eval_problems 0."
            )
        ds = ds.select(keep)
    elif log:
        if role == "test":
            log(f"held-out rows: {source} ({len(ds)} rows).")
        elif split is None or not has_test:
            log(f"training rows: all {len(ds)} rows of {source}; held_out_fraction is 0: none held out.")
        else:
            log(f"training rows: {source} ({len(ds)} rows); held-out rows: its split {test_split!r}.")
    if size is not None and size < len(ds):
        ds = ds.shuffle(seed=seed).select(range(size))
    label = role if carve or split is None else split
    return [
        {
            "id": str(row.get("id", f"{label}-{i}")),
            "prompt": _field(row, prompt_column),
            "answer": str(_field(row, answer_column)),
        }
        for i, row in enumerate(ds)
    ]


def task_rows(
    script_args: Any,
    role: Literal["train", "test"],
    *,
    size: int | None,
    log: Callable[[str], None] | None = None,
    rollout: Any = None,
) -> list[dict]:
    """:func:`load_task_rows` with the run's ``ScriptArguments``: the one call the recipe's training rows, its
    before/after and periodic evaluations and ``retool_eval.py`` share, so all of them split alike. A ``rollout``
    (the run's :class:`~trl_plugins.protocols.RolloutPlugin`) with a dataset of its own (``rows``: a verifiers
    environment's tasks) gives the rows instead (:func:`rollout_rows`)."""
    a = script_args
    if rollout is not None and rollout.rows_fn is not None:
        return rollout_rows(
            rollout.rows_fn(),
            role,
            size=size,
            seed=a.task_seed,
            held_out_fraction=a.held_out_fraction,
            source=rollout.label,
            log=log,
        )
    return load_task_rows(
        a.dataset_name,
        role,
        size=size,
        seed=a.task_seed,
        dataset_config=a.dataset_config,
        prompt_column=a.prompt_column,
        answer_column=a.answer_column,
        train_split=a.dataset_train_split,
        test_split=a.dataset_test_split,
        held_out_fraction=a.held_out_fraction,
        log=log,
        task=a.task,
        reasoning_gym=a.reasoning_gym_task,
    )


def rollout_rows(
    rows: Sequence[dict],
    role: Literal["train", "test"],
    *,
    size: int | None,
    seed: int,
    held_out_fraction: float,
    source: str,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """The rows of a rollout's own dataset for ``role``: ``held_out_fraction`` of them held out by a hash of the prompt
    (:func:`held_out_mask`; a row without a prompt by its task's data), the others trained on; then ``size`` of the
    role's rows drawn with a seeded shuffle.

    Raises:
        ValueError: no rows; a held-out role with ``held_out_fraction`` 0; a split that leaves the role none.
    """
    if not rows:
        raise ValueError(f"{source} has no rows.")
    if role == "test" and not held_out_fraction:
        raise ValueError(
            f"{source} has one set of rows and held_out_fraction is 0: hold out a share with "
            f"--held_out_fraction 0.1 (training then leaves it out), or skip the held-out evaluation with "
            f"--eval_problems 0."
        )
    held = held_out_mask([row.get("prompt") or row.get("task") or row.get("id") for row in rows], held_out_fraction)
    keep = [dict(row) for row, h in zip(rows, held) if h == (role == "test")]
    if not keep:
        side = "held out" if role == "test" else "left for training"
        raise ValueError(
            f"{source} has {len(rows)} rows and held_out_fraction={held_out_fraction} leaves none {side}: "
            f"change --held_out_fraction, or skip the held-out evaluation with --eval_problems 0."
        )
    if log:
        log(
            f"rows: the {len(rows)} of {source}; {sum(held)} held out (held_out_fraction={held_out_fraction}, chosen "
            "by a "
            f"hash of the prompt), {len(rows) - sum(held)} for training."
        )
    if size is not None and size < len(keep):
        order = sorted(
            range(len(keep)), key=lambda i: hashlib.sha256(f"{seed}/{keep[i].get('id')}/{i}".encode()).digest()
        )
        keep = [keep[i] for i in sorted(order[:size])]
    return keep


def _field(row: dict, column: str) -> Any:
    """``row[column]``; a dotted name reads a nested field (``reward_model.ground_truth``)."""
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"row has no field {column!r} (stopped at {part!r}); set --prompt_column/--answer_column.")
        value = value[part]
    return value


def answer_paths(dataset_name: str | None) -> list[str]:
    """Host paths where a dataset's reference answers may lie, to hide from model-written code.

    The Hugging Face datasets and hub caches, and ``dataset_name`` itself when it is a local path.
    The bundled task (``None``) is generated in memory: nothing to hide.
    """
    if dataset_name is None:
        return []
    import datasets.config
    import huggingface_hub.constants

    caches = [datasets.config.HF_DATASETS_CACHE, huggingface_hub.constants.HF_HUB_CACHE]
    for cache in caches:
        # Created now (as loading the dataset would): the sandbox can hide only what exists when it starts, and the
        # run's tools start before the rows load.
        Path(cache).expanduser().mkdir(parents=True, exist_ok=True)
    candidates = caches + ([dataset_name] if Path(dataset_name).exists() else [])
    out: list[str] = []
    for p in candidates:
        resolved = str(Path(p).expanduser().resolve())
        if Path(resolved).exists() and resolved not in out:
            out.append(resolved)
    return out


def hide_answers(dataset_name: str | None, training_args: Any, say: Any = print) -> None:
    """Add the dataset's answer locations (:func:`answer_paths`) to the code interpreter's ``hidden_paths``.

    Model-written code must not read the reference answers. Changes ``training_args.tool_kwargs`` in
    place, before the run is resolved (the tools are built with it; training and evaluation then hide the same
    paths).
    """
    hide = answer_paths(dataset_name)
    if hide and "code_interpreter" in training_args.tools:
        tool_kw = training_args.tool_kwargs.setdefault("code_interpreter", {})
        if tool_kw.get("backend") == "remote":
            # What the code can read is the server's business (a client may not set hidden_paths): say so.
            say(
                f"The sandbox server decides what model code can read: if it runs where these dataset files are, "
                f"start it with --hidden-path for each of {', '.join(hide)}"
            )
            return
        tool_kw["hidden_paths"] = sorted({*tool_kw.get("hidden_paths", ()), *hide})
        say(f"Hidden from the sandbox (dataset files): {', '.join(tool_kw['hidden_paths'])}")
