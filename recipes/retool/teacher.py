"""The reserved teacher ``embedded-rl``: the run's task's embedded default after that task's RL recipe, built once and
cached, the default teacher of on-policy distillation (``recipes/retool_distill.yaml``).

``--teacher_model_name_or_path embedded-rl`` resolves when the arguments are parsed (:func:`retool.config.parse_args`),
before anything is built, to the model folder of a cache entry, ``<cache root>/teachers/<key>/model``; the key hashes
the student's embedded default (:meth:`~retool.default_model.EmbeddedSettings.key`) with what the build runs (the
recipe's arguments and the values of the config layers it reads). Only the embedded default may be its student: the
teacher shares its tokenizer because it is that model, trained further.

At start-up (:func:`retool.startup.start_up`) a run builds the entry when the cache lacks it
(:func:`ensure_embedded_teacher`); a dry run builds nothing and says whether it would (:func:`dry_run_line`). The
build is the recipe itself in a clean child, one process:

    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/retool_ppo.py \\
        --config recipes/retool_lookup.yaml --task lookup --task_seed 0 --seed 0 --report_to none --output_dir <temp>

(the task's RL config from :data:`TASK_RL_CONFIGS`; ``single_gpu.yaml`` where CUDA is available). Its ``final/``,
``summary.json`` and ``eval_after.json`` are copied into the entry with a checksummed manifest, checked and locked as
the embedded default's entries are (:mod:`retool.default_model`). A finished run of that command can be adopted
instead of building again:

    PYTHONPATH=recipes python -m retool.teacher_cli --config recipes/retool_distill.yaml \
        --from_run outputs/distill/teacher
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from retool.coldstart import TASKS
from retool.default_model import (
    MANIFEST,
    CacheError,
    EmbeddedSettings,
    build_lock,
    embedded_entry,
    file_sha256,
    verify_entry,
)
from retool.record import PROJECT_ROOT as ROOT  # the child runs the recipe from the checkout (config paths relative)

__all__ = [
    "EMBEDDED_RL",
    "TASK_RL_CONFIGS",
    "EmbeddedTeacher",
    "embedded_teacher",
    "ensure_embedded_teacher",
    "launch_command",
    "dry_run_line",
    "teacher_results",
]

EMBEDDED_RL = "embedded-rl"
"""The reserved value of ``teacher_model_name_or_path`` this module resolves."""

TEACHER_BUILD_VERSION = 1
"""Bump when the build changes what it produces for the same arguments and config values."""

TASK_RL_CONFIGS: dict[str, str | None] = {
    "arithmetic": None,  # the recipe's own YAML is the arithmetic task's RL recipe
    "lookup": "recipes/retool_lookup.yaml",
    "reasoning_gym": "recipes/retool_reasoning_gym.yaml",
}
"""Per task, the config file of its RL recipe (layered over ``recipes/retool_ppo.yaml``), relative to the checkout."""

assert set(TASK_RL_CONFIGS) == set(TASKS), "every task names its RL recipe"


@dataclass(frozen=True)
class EmbeddedTeacher:
    """What ``embedded-rl`` names for one run: its student (the run's embedded default), the recipe run that trains
    the teacher from it, and the cache entry that keeps the result."""

    student: EmbeddedSettings
    recipe_args: tuple[str, ...]
    """The recipe's arguments after ``retool_ppo.py``, less the output folder (the build's own)."""
    key: str
    """The entry's name: the student's key and what the build runs, hashed."""
    root: Path
    """The cache root (:func:`retool.default_model.cache_root`)."""

    @property
    def entry(self) -> Path:
        return self.root / "teachers" / self.key

    @property
    def model_dir(self) -> Path:
        """The teacher's model and tokenizer: the path ``embedded-rl`` resolves to."""
        return self.entry / "model"


def embedded_teacher(script_args: Any, training_args: Any) -> EmbeddedTeacher:
    """The teacher ``embedded-rl`` names for this run (pure: nothing is read but the config files, nothing built).

    The build's arguments give the child the run's task, task seed and, where they differ from the task's defaults,
    the run's embedded settings (``--embedded``), so that its RL run starts from this run's embedded default.

    Raises:
        ValueError: the run's ``--embedded`` settings are refused (:func:`retool.default_model.embedded_settings_for`).
    """
    from retool.default_model import cache_root, embedded_settings_for
    from retool.layers import load_config_layers
    from retool.tasks import task_layer

    student = embedded_settings_for(script_args, training_args, log=lambda *_: None)
    config = TASK_RL_CONFIGS[student.task]
    args = [*(["--config", config] if config else []), "--task", student.task, "--task_seed", str(student.seed)]
    if student.task_kwargs:
        args += ["--task_kwargs", student.task_kwargs]
    defaults = asdict(
        EmbeddedSettings.from_json("{}", seed=student.seed, task=student.task, task_kwargs=student.task_kwargs)
    )
    overrides = {name: value for name, value in asdict(student).items() if value != defaults[name]}
    if overrides:
        args += ["--embedded", json.dumps(overrides, sort_keys=True)]
    args += ["--seed", "0", "--report_to", "none"]
    layers = [values for _, values in load_config_layers([str(ROOT / config)] if config else [])]
    blob = {
        "build_version": TEACHER_BUILD_VERSION,
        "student": student.key(),
        "recipe_args": args,
        "config_values": [*layers, task_layer(student.task)[1]],
    }
    key = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return EmbeddedTeacher(student=student, recipe_args=tuple(args), key=key, root=cache_root())


def launch_command(teacher: EmbeddedTeacher, output_dir: Path) -> list[str]:
    """The build's command: the recipe under ``accelerate launch``, one process (``cpu.yaml``, or ``single_gpu.yaml``
    where CUDA is available)."""
    import torch

    launcher = "single_gpu.yaml" if torch.cuda.is_available() else "cpu.yaml"
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / launcher),
        str(ROOT / "recipes" / "retool_ppo.py"),
        *teacher.recipe_args,
        "--output_dir",
        str(output_dir),
    ]


def _mismatch(summary: dict, teacher: EmbeddedTeacher) -> str | None:
    """How a finished run's ``summary.json`` differs from the build's run (None: it is one)."""
    config = summary.get("config") or {}
    script, training = config.get("script") or {}, config.get("training") or {}
    student = embedded_entry(teacher.student, teacher.root) / "model"
    config_file = TASK_RL_CONFIGS[teacher.student.task]
    files = ["retool_ppo.yaml", *([Path(config_file).name] if config_file else [])]
    checks = [
        (summary.get("stopped") is None and summary.get("trained_nothing") is None, "it stopped or trained nothing"),
        (summary.get("steps") == training.get("max_steps"), f"it ran {summary.get('steps')} steps, not max_steps"),
        (summary.get("after") is not None, "it has no held-out evaluation after RL"),
        (summary.get("model") == str(student), f"it trained {summary.get('model')}, not the student {student}"),
        (script.get("task") == teacher.student.task, f"its task is {script.get('task')!r}"),
        (script.get("task_seed") == teacher.student.seed, f"its task_seed is {script.get('task_seed')}"),
        (training.get("seed") == 0, f"its seed is {training.get('seed')}, not 0"),
        ([Path(f).name for f in config.get("files", [])] == files, f"its config files are not {files}"),
    ]
    return next((why for ok, why in checks if not ok), None)


def _store(teacher: EmbeddedTeacher, run_dir: Path, into: Path, *, log: Callable[[str], None]) -> None:
    """A finished build run's ``final/`` (as ``model/``), ``summary.json`` and ``eval_after.json`` (under ``run/``)
    copied into ``into`` with the manifest that checksums them.

    Raises:
        ValueError: ``run_dir`` is not a finished run of the build's command (the message says how it differs).
    """
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{run_dir} holds no finished run of the teacher's build: {exc}") from exc
    why = _mismatch(summary, teacher)
    if why is not None:
        raise ValueError(f"{run_dir} is not a run of the teacher's build ({' '.join(teacher.recipe_args)}): {why}.")
    shutil.copytree(run_dir / "final", into / "model")
    (into / "run").mkdir()
    for name in ("summary.json", "eval_after.json"):
        shutil.copy2(run_dir / name, into / "run" / name)
    after = summary["after"]
    manifest = {
        "build_version": TEACHER_BUILD_VERSION,
        "student": asdict(teacher.student),
        "student_key": teacher.student.key(),
        "recipe_args": list(teacher.recipe_args),
        "files": {str(p.relative_to(into)): file_sha256(p) for p in sorted(into.rglob("*")) if p.is_file()},
        "steps": summary["steps"],
        "after": {name: after.get(name) for name in ("accuracy", "accuracy_se", "tool_call_rate", "tool_calls_mean")},
        "build_seconds": round(summary["wall_s"], 1),
    }
    (into / MANIFEST).write_text(json.dumps(manifest, indent=2))
    log(
        f"[embedded teacher] stored {run_dir}'s model: held-out accuracy {after['accuracy']:.3f}, tool-call rate "
        f"{after['tool_call_rate']:.3f} after {summary['steps']} steps."
    )


def ensure_embedded_teacher(
    teacher: EmbeddedTeacher, *, log: Callable[[str], None] = print, from_run: str | Path | None = None
) -> Path:
    """Path of the teacher's model folder, building its cache entry when needed (or adopting ``from_run``, a finished
    run of the build's command, instead of running it).

    A corrupted or partial entry is reported through ``log`` and rebuilt; the entry appears whole or not at all, and
    a build holds a lock on its key (processes that ask at once build it once), as the embedded default's do.

    Raises:
        retool.launch.ChildProcessError: the recipe's run failed (its output, above, says why); nothing is cached.
        ValueError: the finished run is not one of the build's command (``from_run``, or a child that ran another).
    """
    entry, model_dir = teacher.entry, teacher.model_dir
    if from_run is None:
        with contextlib.suppress(CacheError):
            verify_entry(entry)  # the common case takes no lock (a read-only cache works)
            log(f"[embedded teacher] using the cached teacher at {model_dir}")
            return model_dir
    with build_lock(teacher.root, f"teacher-{teacher.key}", log, label="embedded teacher"):
        if from_run is None and entry.exists():  # checked again: it may have been built while we waited
            try:
                verify_entry(entry)
                log(f"[embedded teacher] using the cached teacher at {model_dir}")
                return model_dir
            except CacheError as exc:
                log(f"[embedded teacher] the cache entry {entry} is corrupted ({exc}); rebuilding it.")
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = entry.with_name(f"{entry.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            if from_run is None:
                with tempfile.TemporaryDirectory(prefix="trl-plugins-teacher-") as tmp:
                    _build(teacher, Path(tmp) / "run", log=log)
                    _store(teacher, Path(tmp) / "run", staging, log=log)
            else:
                _store(teacher, Path(from_run), staging, log=log)
            verify_entry(staging)
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def _build(teacher: EmbeddedTeacher, run_dir: Path, *, log: Callable[[str], None]) -> None:
    """The build's recipe run into ``run_dir``, in a clean child (:func:`retool.launch.child_env`: one process, whatever
    launch started the caller); its output goes to this process's.

    Raises:
        retool.launch.ChildProcessError: the run ended with a non-zero exit.
    """
    from retool.launch import ChildProcessError, child_env

    cmd = launch_command(teacher, run_dir)
    log(
        f"[embedded teacher] building the teacher into {teacher.entry} (once; cached after): the "
        f"{teacher.student.task} task's RL recipe from the embedded default, in a child (minutes; the lookup task's "
        f"100 steps took ~11 on 2 CPU cores):\n$ {' '.join(cmd)}"
    )
    code = subprocess.run(cmd, cwd=ROOT, env=child_env(), check=False).returncode
    if code != 0:
        raise ChildProcessError(
            f"building the embedded teacher failed: the recipe's run ended with exit {code}; its output is above."
        )


def dry_run_line(teacher: EmbeddedTeacher) -> str:
    """What a dry run says of the teacher: cached (its entry checked as :func:`ensure_embedded_teacher` checks it), or
    what the run would build first; nothing is built or written."""
    try:
        verify_entry(teacher.entry)
        return f"[embedded teacher] using the cached teacher at {teacher.model_dir} (checksums verified)"
    except CacheError as exc:
        why = "not in the cache" if not teacher.entry.exists() else f"the cache entry is unusable ({exc})"
        return (
            f"[embedded teacher] dry run: {why}; the run would first build it into {teacher.entry} (minutes: the "
            f"{teacher.student.task} task's RL recipe from the embedded default, in a child: retool_ppo.py "
            f"{' '.join(teacher.recipe_args)})."
        )


def teacher_results(model_dir: str | None) -> dict | None:
    """What an ``embedded-rl`` teacher's cache entry recorded of its build: ``model`` (the folder), ``steps`` and the
    held-out ``accuracy``, ``accuracy_se``, ``tool_call_rate`` and ``tool_calls_mean`` after them; None for any other
    teacher (or none)."""
    if model_dir is None:
        return None
    try:
        manifest = json.loads((Path(model_dir).parent / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if "recipe_args" not in manifest:  # an embedded default's entry, or another folder's manifest
        return None
    return {"model": str(model_dir), "steps": manifest["steps"], **manifest["after"]}
