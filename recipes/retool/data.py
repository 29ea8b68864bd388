"""The recipe's data: rows of the bundled task or of a Hub/local dataset, and what to hide from the sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_task_rows", "answer_paths", "hide_answers"]


def load_task_rows(
    dataset_name: str | None,
    split: str,
    *,
    size: int | None,
    seed: int = 0,
    dataset_config: str | None = None,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
) -> list[dict]:
    """Rows ``{"id", "prompt", "answer"}`` of a split: the bundled arithmetic task when ``dataset_name``
    is None, else a Hub dataset or a local path/file loaded with ``datasets.load_dataset``. A dotted
    column name reads a nested field (e.g. ``reward_model.ground_truth`` in DAPO-style sets).

    Raises:
        ValueError: a missing column or split, named with what exists.
    """
    if dataset_name is None:
        from retool.task import arithmetic_problems

        return arithmetic_problems(size or 1000, seed=seed, split=split)
    import datasets

    path = Path(dataset_name)
    if path.is_file():
        fmt = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(path.suffix)
        if fmt is None:
            raise ValueError(f"cannot read {path}: use a .jsonl, .json, .csv or .parquet file, or a dataset directory.")
        ds = datasets.load_dataset(fmt, data_files={split: str(path)}, split=split)
    else:
        try:
            ds = datasets.load_dataset(dataset_name, dataset_config, split=split)
        except ValueError as exc:
            raise ValueError(f"could not load split {split!r} of {dataset_name!r}: {exc}") from exc
    missing = [c for c in (prompt_column, answer_column) if c.split(".")[0] not in ds.column_names]
    if missing:
        raise ValueError(
            f"dataset {dataset_name!r} ({split}) has no column(s) {missing}; it has {ds.column_names}. "
            f"Set --prompt_column/--answer_column."
        )
    if size is not None and size < len(ds):
        ds = ds.shuffle(seed=seed).select(range(size))
    return [
        {"id": str(row.get("id", f"{split}-{i}")), "prompt": _field(row, prompt_column), "answer": str(_field(row, answer_column))}
        for i, row in enumerate(ds)
    ]


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

    candidates = [datasets.config.HF_DATASETS_CACHE, huggingface_hub.constants.HF_HUB_CACHE]
    if Path(dataset_name).exists():
        candidates.append(dataset_name)
    out: list[str] = []
    for p in candidates:
        resolved = str(Path(p).expanduser().resolve())
        if Path(resolved).exists() and resolved not in out:
            out.append(resolved)
    return out


def hide_answers(dataset_name: str | None, training_args: Any, say: Any = print) -> None:
    """Add the dataset's answer locations (:func:`answer_paths`) to the code interpreter's ``hidden_paths``.

    Model-written code must not read the reference answers. Changes ``training_args.tool_kwargs`` in
    place (training and evaluation then hide the same paths).
    """
    hide = answer_paths(dataset_name)
    if hide and "code_interpreter" in training_args.tools:
        tool_kw = training_args.tool_kwargs.setdefault("code_interpreter", {})
        tool_kw["hidden_paths"] = sorted({*tool_kw.get("hidden_paths", ()), *hide})
        say(f"Hidden from the sandbox (dataset files): {', '.join(tool_kw['hidden_paths'])}")
