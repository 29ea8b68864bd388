"""How the recipe runs on a machine: CPU defaults, W&B's environment, and work in a clean child process.

A child process gets objects, not argv: :func:`run_in_child` pickles a function and its arguments
(dataclasses the parent already validated) to a file, runs them in a fresh interpreter that has left
any distributed launch (one process, no DeepSpeed, every core), and returns the pickled result.

    python -m retool.launch <job.pkl> <result.pkl>     # what run_in_child runs; not for users
    python -m retool.launch --spare <module> ...      # what prepare_child starts; not for users

A fresh interpreter spends seconds importing torch, transformers and TRL before its work starts (~6 s of a 2-core
machine's time per evaluation). :func:`prepare_child` starts the next child ahead, while the parent does something
else: it imports them and waits, unused, for one job; :func:`run_in_child` then hands it its job. It is the same
clean interpreter with the same environment (given with the job; a spare started with an environment that differs
in more than what is read at use, :data:`READ_AT_USE`, is discarded).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = [
    "available_cpus",
    "child_env",
    "run_in_child",
    "prepare_child",
    "cpu_defaults",
    "wandb_mode",
    "configure_wandb",
    "claim_output_dir",
    "ChildProcessError",
]

RECIPES_DIR = Path(__file__).resolve().parent.parent
"""The folder that holds the ``retool`` package (put on the child's ``PYTHONPATH``)."""


class ChildProcessError(RuntimeError):
    """Work run with :func:`run_in_child` failed; the message carries the child's own error."""


def available_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def child_env() -> dict[str, str]:
    """The caller's environment without what makes a child join a distributed launch.

    The child runs alone (the launch's other processes wait for it), so it gets every available core:
    ``accelerate launch`` sets ``OMP_NUM_THREADS=1`` on machines where it counts one physical core.
    ``PYTHONPATH`` starts with the recipes folder, so the child imports the same ``retool`` package.
    """
    drop_prefixes = ("ACCELERATE_", "DEEPSPEED_", "FSDP_")
    drop = {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "CUDA_VISIBLE_DEVICES_FOR_LAUNCH",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(drop_prefixes)}
    env["OMP_NUM_THREADS"] = str(available_cpus())
    env["PYTHONPATH"] = os.pathsep.join([str(RECIPES_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_in_child(fn: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a clean child interpreter (see :func:`child_env`); returns its result.

    ``fn`` and the arguments must pickle (module-level functions, dataclasses); the child imports from this
    process's ``sys.path`` too, so a plugin module this process could import (``--tools my_mod:MyTool``) is
    found there. The child's output goes to this process's stdout/stderr.

    Raises:
        ChildProcessError: the child failed; the message names ``what`` and the child's own error
            (``ValueError: ...``), or its exit status when it died without one (killed, out of memory).
    """
    with tempfile.TemporaryDirectory(prefix="trl-plugins-child-") as tmp:
        job, result = Path(tmp) / "job.pkl", Path(tmp) / "result.pkl"
        job.write_bytes(pickle.dumps((list(sys.path), pickle.dumps((fn, args, kwargs)))))
        spare = _take_spare()
        if spare is not None:  # started ahead by prepare_child: it has imported and waits for this job
            spare.stdin.write(json.dumps([str(job), str(result), child_env()]) + "\n")
            spare.stdin.close()
            returncode = spare.wait()
        else:
            returncode = subprocess.run(
                [sys.executable, "-m", "retool.launch", str(job), str(result)], env=child_env(), check=False
            ).returncode
        outcome = pickle.loads(result.read_bytes()) if result.is_file() else None
        if returncode == 0 and outcome is not None and outcome[0] == "ok":
            return outcome[1]
        if outcome is not None and outcome[0] == "error":
            raise ChildProcessError(
                f"{what} failed in its child process: {outcome[1]} (the child's traceback is above)."
            )
        status = f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
        raise ChildProcessError(
            f"{what} failed: its child process ended ({status}) without a result or an error; its output is above."
        )


PRELOAD = ("torch", "transformers", "trl", "trl_plugins.trainers", "retool.evaluate", "retool.default_model")
"""What a spare child imports while it waits: what the recipe's child jobs (the evaluation, the embedded default's
build) import first."""

READ_AT_USE = frozenset({"WANDB_SERVICE", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "PYTORCH_NVML_BASED_CUDA_CHECK"})
"""Variables the run sets after a spare started (W&B's settings and wandb.init's service socket; the NVML check
accelerate asks of torch) that are read when used, not at import: a spare is handed the job's environment with its job,
so these may
differ; any other difference discards the spare."""

_spare: tuple[subprocess.Popen, dict[str, str]] | None = None
"""The one spare child (:func:`prepare_child`) and the environment it was started with."""


def prepare_child(preload: Sequence[str] = PRELOAD) -> None:
    """Start the interpreter of the next :func:`run_in_child` now: it imports ``preload`` and waits for its job, so
    the job does not wait for the imports. At most one spare at a time (a call while one waits does nothing); an
    unused spare ends when this process ends (its stdin closes)."""
    global _spare
    if _spare is not None and _spare[0].poll() is None:
        return
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retool.launch", "--spare", *preload], env=env, stdin=subprocess.PIPE, text=True
    )
    _spare = (proc, env)


def _take_spare() -> subprocess.Popen | None:
    """The spare child for a job, if one is alive and was started with the environment a child gets now (else it is
    ended and None)."""
    global _spare
    if _spare is None:
        return None
    proc, env = _spare
    _spare = None
    now = child_env()
    changed = {k for k in set(env) | set(now) if env.get(k) != now.get(k)}
    if proc.poll() is None and changed <= READ_AT_USE:
        return proc
    _end(proc)
    return None


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()  # it leaves on an empty line; kill it if it does not, e.g. still importing
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@atexit.register
def _end_spare() -> None:
    global _spare
    if _spare is not None:
        _end(_spare[0])
        _spare = None


def _spare_main(preload: Sequence[str]) -> int:
    import signal

    # Ctrl-C reaches the whole process group: the parent decides what stops, and an unused spare leaves when the
    # parent does. Its job runs with Python's own handler again, as a child started for it would.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the job imports what it needs and reports its own errors
            pass
    line = sys.stdin.readline()
    if not line.strip():  # the parent ended without a job for it
        return 0
    job_path, result_path, env = json.loads(line)
    os.environ.clear()
    os.environ.update(env)  # the environment a child started now would get (it differs at most in READ_AT_USE)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return _child_main(job_path, result_path)


def _child_main(job_path: str, result_path: str) -> int:
    parent_path, payload = pickle.loads(Path(job_path).read_bytes())
    sys.path.extend(p for p in parent_path if p not in sys.path)
    try:
        fn, args, kwargs = pickle.loads(payload)
        out = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - report anything: the parent names it in its own error
        traceback.print_exc()
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        Path(result_path).write_bytes(pickle.dumps(("error", message)))
        return 1
    Path(result_path).write_bytes(pickle.dumps(("ok", out)))
    return 0


def _flag_given(argv: Sequence[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def cpu_defaults(argv: list[str], config_values: dict | None = None) -> list[str]:
    """Arguments to add on a machine without CUDA so that the trainer runs on the CPU correctly.

    Adds ``--bf16 false`` (bf16 autocast on CPU shifts log-probs by ~1e-3) and, for a distributed
    launch, what makes its process group work on CPU: ``--ddp_backend gloo`` under DeepSpeed, else
    ``--use_cpu true`` (without it a 2-process CPU launch trains two independent models). Anything
    the user set on the command line or in the YAML wins.
    """
    import torch

    if torch.cuda.is_available():
        return []
    given = set(config_values or {})
    extra: list[str] = []
    if not _flag_given(argv, "bf16") and "bf16" not in given:
        extra += ["--bf16", "false"]
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed:
        if not _flag_given(argv, "ddp_backend") and "ddp_backend" not in given:
            extra += ["--ddp_backend", "gloo"]
    elif not _flag_given(argv, "use_cpu") and "use_cpu" not in given:
        extra += ["--use_cpu", "true"]
    return extra


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def wandb_mode(report_to: Sequence[str]) -> str | None:
    """The W&B mode the run would use (None when W&B is not used): ``WANDB_MODE`` when set, else offline without an
    API key, else online. Sets nothing (a dry run's banner says it; :func:`configure_wandb` sets it)."""
    if "wandb" not in (report_to or []):
        return None
    if "WANDB_MODE" in os.environ:
        return os.environ["WANDB_MODE"]
    return "online" if _has_wandb_key() else "offline"


def configure_wandb(report_to: Sequence[str], output_dir: str, project: str | None) -> str | None:
    """Set W&B's environment for the run; returns the mode in force (None when W&B is not used).

    Offline when no API key is configured and ``WANDB_MODE`` is unset (:func:`wandb_mode`); run files go under
    ``<output_dir>/wandb`` unless ``WANDB_DIR`` is set.
    """
    mode = wandb_mode(report_to)
    if mode is None:
        return None
    if mode == "offline":
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", os.path.abspath(output_dir))
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    if project:
        os.environ.setdefault("WANDB_PROJECT", project)
    return mode


if __name__ == "__main__":
    sys.exit(_spare_main(sys.argv[2:]) if sys.argv[1:2] == ["--spare"] else _child_main(sys.argv[1], sys.argv[2]))


def claim_output_dir(
    path: str | os.PathLike,
    *,
    resume: Any,
    overwrite: bool,
    move: bool = True,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> None:
    """Make ``path`` this run's output folder, refusing to mix two runs in it.

    A run appends to ``metrics.jsonl`` and writes checkpoints, evaluations and a plot there, so a second run
    into a folder an earlier one filled would interleave their steps. An empty or missing folder is fine;
    resuming (``resume`` set) continues in it; ``overwrite`` moves what is there to
    ``previous-<time>/`` inside it (nothing is deleted; only where ``move``: the main process). Call it on
    every rank, before anything is built, so that every rank stops on a refusal. ``dry_run``: check only; the
    refusal is the same, and ``log`` says what ``overwrite`` would move (nothing is moved or made).

    Raises:
        SystemExit: ``path`` holds files and neither ``resume`` nor ``overwrite`` was given.
    """
    import time

    out = Path(path)
    entries = sorted(p for p in out.iterdir() if not p.name.startswith("previous-")) if out.is_dir() else []
    if not entries or resume:
        return
    if not overwrite:
        shown = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise SystemExit(
            f"output_dir {out} already holds files of an earlier run ({shown}); a second run would mix "
            f"its steps into them. Resume it with --resume_from_checkpoint true (or a checkpoint path), "
            f"start afresh with --overwrite_output_dir true (the old files move to {out}/previous-<time>/, "
            f"nothing is deleted), or choose another --output_dir."
        )
    if not move:  # another rank: the main process moves them
        return
    aside = out / time.strftime("previous-%Y%m%d-%H%M%S")
    if dry_run:
        log(
            f"dry run: --overwrite_output_dir would move the earlier run's {len(entries)} file(s) to {aside}; "
            f"nothing was moved"
        )
        return
    aside.mkdir()
    for entry in entries:
        entry.rename(aside / entry.name)
    log(f"--overwrite_output_dir: the earlier run's {len(entries)} file(s) moved to {aside}")
