"""``python -m trl_plugins.replay BATCH.json [--checkpoint DIR] [--tools] [--rewards] [--resample]`` (also
``trl-plugins-replay``): re-derive a saved batch and name the first difference (:func:`~trl_plugins.viewer.replay.replay_batch`).

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


def _run_from_checkpoint(folder: Path, tokenizer: Any) -> Any:
    import torch

    from trl_plugins.run import resolve_run

    args = folder / "training_args.bin"
    if not args.is_file():
        raise FileNotFoundError(f"{args}: missing; --tools and --rewards rebuild the run's plugins from the config the "
                                f"trainer saved there (give a checkpoint-N folder)")
    run = resolve_run(torch.load(args, weights_only=False))
    run.bind_tokenizer(tokenizer)
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    from trl_plugins.viewer.batch import ViewerError, load_batch
    from trl_plugins.viewer.replay import ReplayRefused, replay_batch

    parser = argparse.ArgumentParser(prog="python -m trl_plugins.replay", description=(
        "Re-derive a saved trajectory batch (tokens, log-probs, tool turns, rewards, datums) with the current code "
        "and name the first difference per trajectory."))
    parser.add_argument("batch", help="a saved batch, e.g. output_dir/trajectories/step-000010.json")
    parser.add_argument("--checkpoint", help="a checkpoint of the step that sampled the batch (checkpoint-N; the base "
                        "model for step 0): its log-probs are compared, its tokenizer is the current one")
    parser.add_argument("--tokenizer", help="the tokenizer folder to re-render with (default: the checkpoint's)")
    parser.add_argument("--tools", action="store_true", help="re-run the idempotent tool calls and compare their outputs")
    parser.add_argument("--rewards", action="store_true", help="recompute every reward component and re-derive each "
                        "trajectory's stop reason from its turns")
    parser.add_argument("--resample", action="store_true", help="regenerate each seeded turn with --checkpoint's weights "
                        "and the saved sampling settings and name the first token that differs (HF generate and "
                        "continuous-batching batches; a trajectory that lacks what it needs is named, with what)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest accepted log-prob difference (default: 1e-4 for fp32, 1e-2 for bf16/fp16 or vLLM)")
    parser.add_argument("--anyway", action="store_true", help="compare even when the tokenizer, the tool schemas, a "
                        "verifier's version or the checkpoint's step differ (the report says so; exit 1)")
    args = parser.parse_args(argv)
    if (args.tools or args.rewards) and not args.checkpoint:
        parser.error("--tools and --rewards rebuild the run's plugins from --checkpoint's training_args.bin: give it")
    if args.resample and not args.checkpoint:
        parser.error("--resample regenerates the turns with the weights that sampled them: give --checkpoint")
    if not args.checkpoint and not args.tokenizer:
        parser.error("give --checkpoint (its tokenizer and weights) or --tokenizer (re-render and rebuild only)")
    model = step = run = None
    try:
        batch = load_batch(args.batch)
        if args.checkpoint:
            model, tokenizer, step = load_checkpoint(args.checkpoint)
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        if args.tools or args.rewards:
            run = _run_from_checkpoint(Path(args.checkpoint), tokenizer)
        report = replay_batch(batch, tokenizer, model=model, model_step=step, run=run, tools=args.tools,
                              rewards=args.rewards, resample=args.resample, anyway=args.anyway, tolerance=args.tolerance)
    except (ViewerError, ReplayRefused, FileNotFoundError, ValueError, LookupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if run is not None:
            run.close()
    print(report.render())
    return 0 if report.ok else 1
