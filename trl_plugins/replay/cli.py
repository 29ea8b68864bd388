"""``python -m trl_plugins.replay BATCH.json [--run DIR] [--checkpoint DIR] [--tools] [--rewards] [--resample]`` (also
``trl-plugins-replay``): re-derive a saved batch and name the first difference
(:func:`~trl_plugins.replay.saved_batch.replay_batch`).

The tokenizer and, for ``--tools``/``--rewards``, the run's plugins come from the run's output folder
(``output_dir/run_config/``, :mod:`trl_plugins.run.saved`): ``--run``, else the folder of a batch saved as
``output_dir/trajectories/step-N.json``; the weights (the log-prob check, ``--resample``) only from ``--checkpoint``;
``--teacher`` (on-policy distillation) re-derives the teacher's log-probs with the teacher the saved version names.

Exit status: 0 when everything compared equal within tolerance, 1 when something differs (or was compared only
because ``--anyway`` overrode a version difference), 2 when the replay refused or could not run (bad input, another
version, a checkpoint of another step), with what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from trl_plugins.run.saved import CONFIG_FILE, RUN_CONFIG_DIR

__all__ = ["main", "load_checkpoint"]


def _checkpoint_step(folder: Path) -> int:
    for name in ("checkpoint_complete.json", "trainer_state.json"):
        if (folder / name).is_file():
            return int(json.loads((folder / name).read_text())["global_step"])
    return 0  # a base model: the weights of step 0


def load_checkpoint(folder: str | os.PathLike) -> tuple[Any, Any, int]:
    """The model (an adapter checkpoint loaded onto its base), tokenizer and optimizer step of a checkpoint folder
    (``checkpoint-N``, a ``final`` folder or a base model: step 0 when no ``trainer_state.json`` says otherwise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint folder (give output_dir/checkpoint-N)")
    if (path / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, torch_dtype="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype="auto")
    return model, AutoTokenizer.from_pretrained(path), _checkpoint_step(path)


def _run_from_config(folder: Path, tokenizer: Any) -> Any:
    import torch

    from trl_plugins.run import resolve_run

    args = folder / CONFIG_FILE
    if not args.is_file():
        raise FileNotFoundError(
            f"{args}: missing; --tools and --rewards rebuild the run's plugins from the config the "
            f"trainer saved there (give a checkpoint-N folder)"
        )
    run = resolve_run(torch.load(args, weights_only=False))
    run.bind_tokenizer(tokenizer)
    return run


def _load_teacher(given: str, batch: Any, tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from trl_plugins.replay.saved_batch import ReplayRefused, teacher_identity

    named = teacher_identity(batch)
    path = given or (named[0] if named else None)
    if path is None:
        raise ReplayRefused(
            "--teacher: the saved batch names no teacher (its run distilled from none): replay without --teacher."
        )
    if path.startswith(("http://", "https://")):  # a server teacher: its client, checked as the trainer checks it
        from trl_plugins.trainers.teacher import render_sample
        from trl_plugins.trainers.teacher_server import ServerTeacher

        sample = render_sample(tokenizer, batch.get("tool_schemas") or [])
        return ServerTeacher.connect(path, tokenizer=tokenizer, sample=sample, timeout_s=120)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"--teacher: {path}: no such model folder (give --teacher DIR, the teacher's folder)")
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype="auto").eval()


def _output_dir_of(batch: Path) -> Path | None:
    """The run's output folder of a batch saved as ``output_dir/trajectories/step-N.json``; None elsewhere."""
    folder = batch.resolve().parent
    return folder.parent if folder.name == "trajectories" else None


def _saved_config(run_dir: Path) -> Path:
    folder = run_dir / RUN_CONFIG_DIR
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"{folder / CONFIG_FILE}: missing; the trainer saves the run's config and tokenizer "
            f"there when training starts (a run started before it did has none): give --checkpoint "
            f"output_dir/checkpoint-N"
        )
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    from trl_plugins.replay.saved_batch import ReplayRefused, replay_batch
    from trl_plugins.trainers.teacher_server import TeacherServerError
    from trl_plugins.viewer.batch import ViewerError, load_batch

    parser = argparse.ArgumentParser(
        prog="python -m trl_plugins.replay",
        description=(
            "Re-derive a saved trajectory batch (tokens, log-probs, tool turns, rewards, datums) with the current code "
            "and name the first difference per trajectory."
        ),
    )
    parser.add_argument("batch", help="a saved batch, e.g. output_dir/trajectories/step-000010.json")
    parser.add_argument(
        "--run",
        metavar="DIR",
        help="the run's output folder: its run_config/ (the config and "
        "tokenizer the trainer saved when training started) rebuilds the plugins for --tools and "
        "--rewards and gives the tokenizer (default: the folder of a batch saved as "
        "DIR/trajectories/step-N.json)",
    )
    parser.add_argument(
        "--checkpoint",
        help="a checkpoint of the step that sampled the batch (checkpoint-N; the base "
        "model for step 0): its log-probs are compared, its tokenizer is the current one, and without "
        "--run its training_args.bin rebuilds the plugins",
    )
    parser.add_argument(
        "--tokenizer", help="the tokenizer folder to re-render with (default: the checkpoint's, else the run's)"
    )
    parser.add_argument(
        "--tools", action="store_true", help="re-run the idempotent tool calls and compare their outputs"
    )
    parser.add_argument(
        "--rewards",
        action="store_true",
        help="recompute every reward component and re-derive each trajectory's stop reason from its turns",
    )
    parser.add_argument(
        "--resample",
        action="store_true",
        help="regenerate each seeded turn with --checkpoint's weights "
        "and the saved sampling settings and name the first token that differs (HF generate and "
        "continuous-batching batches; a trajectory that lacks what it needs is named, with what)",
    )
    parser.add_argument(
        "--teacher",
        nargs="?",
        const="",
        metavar="DIR",
        help="on-policy distillation: re-derive the teacher's log-probs of every action token and compare them with "
        "the saved ones; the teacher is the one the saved version names (its path), or DIR; its weights digest is "
        "checked against the saved one first",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest accepted log-prob difference (default: 1e-4 for fp32, 1e-2 for bf16/fp16 or vLLM)",
    )
    parser.add_argument(
        "--anyway",
        action="store_true",
        help="compare even when the tokenizer, the tool schemas, a "
        "verifier's version or the checkpoint's step differ (the report says so; exit 1)",
    )
    args = parser.parse_args(argv)
    if args.resample and not args.checkpoint:
        parser.error("--resample regenerates the turns with the weights that sampled them: give --checkpoint")
    plugins = args.tools or args.rewards
    # The run's own folder serves what needs its settings, not its weights: the plugins, and the tokenizer.
    wants_run = args.run is not None or (not args.checkpoint and (plugins or not args.tokenizer))
    run_dir = (Path(args.run) if args.run else _output_dir_of(Path(args.batch))) if wants_run else None
    if wants_run and run_dir is None:
        asked = " and ".join(flag for flag, on in (("--tools", args.tools), ("--rewards", args.rewards)) if on)
        need = (
            f"{asked} rebuild{'' if args.tools and args.rewards else 's'} the run's plugins from its saved config"
            if plugins
            else "the replay needs the run's tokenizer"
        )
        print(
            f"error: {need}, and {args.batch} is not in a run's output folder (output_dir/trajectories/step-N.json): "
            f"give --run OUTPUT_DIR or --checkpoint output_dir/checkpoint-N"
            f"{'' if plugins else ' or --tokenizer DIR'}",
            file=sys.stderr,
        )
        return 2
    model = step = run = None
    try:
        batch = load_batch(args.batch)
        saved = _saved_config(run_dir) if run_dir is not None else None
        if args.checkpoint:
            model, tokenizer, step = load_checkpoint(args.checkpoint)
        if args.tokenizer or not args.checkpoint:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or saved)
        if plugins:
            run = _run_from_config(saved or Path(args.checkpoint), tokenizer)
        teacher = None if args.teacher is None else _load_teacher(args.teacher, batch, tokenizer)
        report = replay_batch(
            batch,
            tokenizer,
            model=model,
            model_step=step,
            run=run,
            tools=args.tools,
            rewards=args.rewards,
            resample=args.resample,
            anyway=args.anyway,
            tolerance=args.tolerance,
            teacher=teacher,
        )
    except (ViewerError, ReplayRefused, TeacherServerError, FileNotFoundError, ValueError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if run is not None:
            run.close()
    print(report.render())
    return 0 if report.ok else 1
