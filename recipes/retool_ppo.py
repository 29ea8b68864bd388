"""ReTool PPO: multi-turn code-interpreter RL with outcome rewards and group-relative advantages.

The model solves maths by writing Python in ``<tool_call>`` blocks; a local sandbox runs it and its
output comes back as a tool message; the last ``\\boxed{}`` is the answer. Rewards are named
components (``correct`` via math-verify, ``format``, optional ``tool_use`` and ``overlong``), the
advantage is group-relative (GRPO-style) and the loss is PPO with the asymmetric ratio clip
[0.8, 1.28], token-mean over each step's whole batch, exact under any micro-batching.

Launch (the YAML next to this file holds the defaults; a ``--config my.yaml`` of your own layers over it and
needs only the keys it changes; the command line wins over both; ``--help`` lists every field):

    # CPU, no network: the embedded default (tiny Qwen2 + bundled arithmetic + cold-start SFT, cached)
    accelerate launch recipes/retool_ppo.py

    # check a config without training: every start-up check and the banner, then exit 0 or with the refusal
    # (seconds; nothing is written, moved, built or loaded)
    accelerate launch recipes/retool_ppo.py --config my.yaml --dry_run true

    # one GPU, a real model and a DAPO-style maths set
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \\
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --dataset_name BytedTsinghua-SIA/DAPO-Math-17k \\
        --prompt_column prompt --answer_column reward_model.ground_truth --eval_problems 0 --held_out_fraction 0 --bf16
        true

    # several GPUs (DDP) / DeepSpeed ZeRO-3 (see accelerate_configs/ for ZeRO-2 and CPU offload)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/retool_ppo.py --model_name_or_path ...
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/retool_ppo.py --model_name_or_path ...

    # two CPU processes under ZeRO-3 (what the smoke test runs)
    accelerate launch --config_file accelerate_configs/cpu_zero3.yaml recipes/retool_ppo.py --max_steps 2

    # a LoRA adapter instead of full fine-tuning (TRL's ModelConfig fields; final/ holds the adapter)
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --use_peft --lora_r 16 --lora_alpha 32 \
        --lora_target_modules all-linear --learning_rate 1e-5 --bf16 true

How this differs from the ReTool paper (Feng et al., 2025): the paper cold-starts Qwen2.5-32B on
curated code-integrated traces and trains with PPO in verl (a critic, token-level rewards); here the
advantage is group-relative with no critic (as in GRPO/DAPO), generation is HF ``generate`` (a vLLM
backend exists for GPUs), the sandbox is a local isolated interpreter, and the embedded default
replaces the cold-start data with synthetic arithmetic transcripts for a tiny model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from retool.config import ScriptArguments, parse_args


def main(script_args: ScriptArguments, training_args) -> int:
    from retool.data import hide_answers
    from retool.startup import resolve, start_up

    start = time.perf_counter()
    # Before anything is built or loaded, the run is resolved once: every setting checked, every plugin built with
    # its kwargs, the sampler picked, the tools started (the sandbox's isolation is probed). The trainer, the
    # periodic evaluation and (from its pickled spec) the before/after evaluation all use this run.
    # Model-written code must not read the reference answers: the dataset's location is a tool setting, so hidden first.
    hide_answers(script_args.dataset_name, training_args, say=print if _main_process() else (lambda *a, **k: None))
    run = resolve(script_args, training_args)
    try:
        # Every start-up check in order (retool.startup.start_up), the banner among them; a dry run stops after them.
        checked = start_up(script_args, training_args, run, dry_run=script_args.dry_run)
        if script_args.dry_run:
            return 0
        return _train(script_args, training_args, run, checked, start=start)
    finally:
        run.close()


def _main_process() -> bool:
    # Before the process group exists: the launcher's rank (0 without a launcher).
    return int(os.environ.get("RANK", "0")) == 0


def _train(script_args: ScriptArguments, training_args, run, checked, *, start: float) -> int:
    from transformers import AutoModelForCausalLM

    from retool.evaluate import PeriodicHeldOut, evaluate_checkpoint, reusable_evaluation
    from retool.launch import ChildProcessError, prepare_child, run_in_child
    from retool.report import format_summary
    from trl_plugins.run.lora import model_init_kwargs
    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.interrupts import TrainingInterrupted

    state, say, ks, resume = checked.state, checked.say, checked.ks, checked.resume
    train_rows, heldout_rows = checked.train_rows, checked.heldout_rows
    model_path, tokenizer = checked.model_path, checked.tokenizer
    main_process = state.is_main_process
    evaluate = script_args.eval_problems > 0

    from datasets import Dataset

    train_dataset = Dataset.from_list(train_rows)
    out_dir = Path(training_args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def held_out(checkpoint: str, name: str) -> dict:
        # In a clean child process: the evaluation never meets ZeRO-3's partitioned parameters.
        try:
            return run_in_child(
                evaluate_checkpoint,
                checkpoint,
                script_args,
                run.spec,
                ks=ks,
                rows=heldout_rows,
                output_json=str(out_dir / name),
                what=f"the held-out evaluation of {checkpoint}",
            )
        except ChildProcessError as exc:  # the child's own error, not a traceback of the parent's plumbing
            raise SystemExit(str(exc)) from None

    before = None
    if evaluate and main_process:
        # A resumed run reuses the evaluation its first start made of the same starting model on the same problems.
        before = (
            reusable_evaluation(
                out_dir / "eval_before.json",
                model=model_path,
                rows=heldout_rows,
                samples=script_args.eval_samples,
                temperature=script_args.eval_temperature,
                success_component=script_args.success_component,
            )
            if training_args.resume_from_checkpoint
            else None
        )
        if before is not None:
            say(
                f"Held-out evaluation of the starting model: reused from {out_dir / 'eval_before.json'} (resumed run; "
                f"same model, problems, samples and temperature)"
            )
        else:
            say(
                f"Held-out evaluation of the starting model ({script_args.eval_problems} problems x "
                f"{script_args.eval_samples} samples)..."
            )
            before = held_out(model_path, "eval_before.json")
            prepare_child()  # the evaluation after RL's interpreter imports while the run trains
    state.wait_for_everyone()

    model = AutoModelForCausalLM.from_pretrained(model_path, **model_init_kwargs(script_args, training_args))
    # With --use_peft, TRL wraps the policy in the run's LoRA adapter: only the adapter trains and checkpoints hold it.
    trainer = MultiTurnGRPOTrainer(model, train_dataset=train_dataset, processing_class=tokenizer, run=run)
    if evaluate and script_args.eval_every_steps > 0:
        # The first of the held-out rows (a seeded draw: the same ones a separate load of that size gives).
        periodic = PeriodicHeldOut(
            trainer,
            heldout_rows[: script_args.eval_every_problems],
            every=script_args.eval_every_steps,
            samples=script_args.eval_samples,
            temperature=script_args.eval_temperature,
            success_component=script_args.success_component,
        )
        trainer.add_callback(periodic)
    try:
        # A run that went to its end without one policy update is saved, evaluated and summarised as any, then exits 1.
        trained_nothing = _train_to_its_end(trainer, resume)
    except BaseException as exc:  # a stopped run still leaves its record: summary.json (with why) and the plot
        if main_process:
            try:
                _write_summary(
                    out_dir,
                    script_args,
                    training_args,
                    trainer,
                    model_path=model_path,
                    before=before,
                    after=None,
                    start=start,
                    stopped=exc,
                )
            except Exception as also:  # noqa: BLE001 - the stop is the news; say why its record is missing
                print(
                    f"summary.json of the stopped run could not be written: {type(also).__name__}: {also}",
                    file=sys.stderr,
                )
        if isinstance(exc, TrainingInterrupted):  # SIGINT / SIGTERM: a complete checkpoint is written, tools closed
            say(str(exc))
            sys.stdout.flush()
            raise SystemExit(exc.exit_code) from None
        raise
    final_dir = out_dir / "final"
    trainer.save_model(str(final_dir))
    if main_process:
        tokenizer.save_pretrained(str(final_dir))
        trainer.create_model_card(model_name=out_dir.name, model_path=str(final_dir))  # output_dir/README.md
        shutil.copy(out_dir / "README.md", final_dir / "README.md")
    state.wait_for_everyone()

    after = None
    if evaluate and main_process:
        say("Held-out evaluation after RL...")
        after = held_out(str(final_dir), "eval_after.json")
    if main_process:
        paths = _write_summary(
            out_dir,
            script_args,
            training_args,
            trainer,
            model_path=model_path,
            before=before,
            after=after,
            start=start,
            trained_nothing=trained_nothing,
        )
        print(
            format_summary(
                before,
                after,
                steps=trainer.state.global_step,
                wall_s=time.perf_counter() - start,
                paths={"checkpoint": str(final_dir), **paths},
            ),
            flush=True,
        )
    state.wait_for_everyone()
    if trained_nothing is not None:
        print(f"The run trained nothing: {trained_nothing}", file=sys.stderr, flush=True)
        return 1
    return 0


def _train_to_its_end(trainer, resume):
    """Train; the :class:`~trl_plugins.trainers.NoPolicyUpdate` of a run that went to its end without one policy update
    (None: it updated). A run stopped earlier for it (``max_steps_without_update``) raises as any stopped run."""
    from trl_plugins.trainers import NoPolicyUpdate

    try:
        trainer.train(resume_from_checkpoint=resume)
    except NoPolicyUpdate as exc:
        if not exc.finished:
            raise
        return exc
    return None


def _write_summary(
    out_dir: Path,
    script_args: ScriptArguments,
    training_args,
    trainer,
    *,
    model_path: str,
    before: dict | None,
    after: dict | None,
    start: float,
    stopped: BaseException | None = None,
    trained_nothing: BaseException | None = None,
) -> dict:
    """The plot, the W&B summary and ``summary.json``: also for a run that stopped (``stopped``: why, recorded
    in ``summary.json["stopped"]``) or that went to its end without a policy update (``trained_nothing``: why, in
    ``summary.json["trained_nothing"]``). Returns the paths written, for the closing summary."""
    from retool.record import run_record
    from retool.report import accuracy_gain, plot_run, read_metrics

    metrics = read_metrics(out_dir / "metrics.jsonl") if (out_dir / "metrics.jsonl").is_file() else []
    plot_path = None
    if script_args.plot and metrics:
        plot_path = str(
            plot_run(
                metrics,
                out_dir / "retool_ppo.png",
                before=before,
                after=after,
                reward_components=trainer.reward_names(),
            )
        )
    wandb_dir = None
    try:
        import wandb

        if wandb.run is not None:
            if before and after:
                wandb.run.summary.update(
                    {
                        "heldout/accuracy_before": before["accuracy"],
                        "heldout/accuracy_after": after["accuracy"],
                        "heldout/tool_call_rate_before": before["tool_call_rate"],
                        "heldout/tool_call_rate_after": after["tool_call_rate"],
                    }
                )
            wandb_dir = wandb.run.dir.removesuffix("/files")
            wandb.finish(exit_code=0 if stopped is None and trained_nothing is None else 1)
    except ImportError:
        pass
    summary = {
        "before": before,
        "after": after,
        "gain": accuracy_gain(before, after) if before and after else None,
        "steps": trainer.state.global_step,
        "wall_s": time.perf_counter() - start,
        "model": model_path,
        "stopped": None
        if stopped is None
        else {"at_step": trainer.state.global_step, "why": f"{type(stopped).__name__}: {stopped}"},
        "trained_nothing": None if trained_nothing is None else str(trained_nothing),
        **run_record(script_args, training_args, trainer.run),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if stopped is not None:
        print(
            f"The run stopped at step {trainer.state.global_step} ({type(stopped).__name__}); what it did is in "
            f"{out_dir / 'metrics.jsonl'} and {out_dir / 'summary.json'}.",
            flush=True,
        )
    return {
        "metrics": str(out_dir / "metrics.jsonl"),
        "plot": plot_path,
        "summary": str(out_dir / "summary.json"),
        "wandb": wandb_dir,
    }


if __name__ == "__main__":
    script_args, training_args = parse_args(sys.argv[1:])
    code = main(script_args, training_args)
    sys.stdout.flush()
    sys.stderr.flush()
    # A gloo thread can abort the interpreter at exit after a ZeRO-3 run on CPU; everything is written.
    os._exit(code)
