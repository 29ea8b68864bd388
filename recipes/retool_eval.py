"""Evaluate a ReTool checkpoint on a held-out split: pass@1, pass@k and tool-call statistics.

    # the embedded cold-start model (no arguments) or a trained checkpoint, sampled
    python recipes/retool_eval.py --model_name_or_path outputs/retool_ppo/final --eval_samples 8 --k 1 8
    # check the arguments only: every start-up check, then exit (no weights load, nothing is written)
    python recipes/retool_eval.py --model_name_or_path outputs/retool_ppo/final --dry_run true
    # greedy
    python recipes/retool_eval.py --model_name_or_path outputs/retool_ppo/final --eval_temperature 0 --eval_samples 1
    # a Hub model on a Hub maths set
    python recipes/retool_eval.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset_name HuggingFaceH4/MATH-500 --dataset_test_split test --prompt_column problem --answer_column answer
    # a run trained with a second tool and a custom reward (an installed plugin package's names, or module:attr)
    python recipes/retool_eval.py --model_name_or_path outputs/run/final --tools code_interpreter calculator \\
        --reward_components correct format concise --reward_component_weights 1.0 0.1 0.1

It takes the training recipe's own arguments (``recipes/retool_ppo.yaml``, any ``--config`` files layered over
it, then the command line), so it evaluates with the run's tools, rollout plugin and
budgets, reward components and system prompt, through the registries: a run trained with a custom tool
or rollout is evaluated with it. A sample is correct when the ``correct`` reward component says so
(math-verify on the last ``\\boxed{}``), so its accuracy is the training log's ``reward/correct`` on
unseen problems. The held-out rows are the run's (``dataset_test_split``, or the ``held_out_fraction``
carved out of the training split by the same hash; never a training row). Every accuracy and pass@k is
printed and written with ± one standard error clustered by problem. ``--output_json`` writes the numbers.

Plugins are named as in training: registry names (built-ins, and installed packages through their
``trl_plugins.*`` entry points) or a ``package.module:attribute`` import path; an unknown name or a bad
kwarg is refused before the model loads.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> dict:
    """Evaluate as the arguments say; returns the numbers (``--dry_run``: what would be evaluated, after the
    start-up checks; nothing loads, generates or is written)."""
    from retool.config import parse_args
    from retool.data import hide_answers, task_rows
    from retool.default_model import model_for_dry_run, model_path_or_default
    from retool.evaluate import EvalArguments, check_eval_settings, evaluate_checkpoint
    from retool.startup import check_chat_template, resolve

    eval_args, script_args, training_args = parse_args(argv, EvalArguments)
    dry_run = script_args.dry_run
    refuse_training_only_settings(script_args, training_args)
    hide_answers(script_args.dataset_name, training_args)  # model-written code must not read the reference answers
    run = resolve(script_args, training_args)  # every plugin built with its kwargs and checked, before a model loads
    try:
        ks = check_eval_settings(script_args, run, eval_args.k, training=False)
        try:  # the rows before any model: a missing split or column stops here
            rows = task_rows(script_args, "test", size=script_args.eval_problems, log=print, rollout=run.rollout)
        except ValueError as exc:
            raise SystemExit(str(exc)) from exc
        from transformers import AutoTokenizer

        if dry_run:  # the cached embedded default, or its tokenizer and config only: no weights
            with model_for_dry_run(script_args, training_args) as (model_path, stand_in):
                check_chat_template(AutoTokenizer.from_pretrained(model_path), run)
            return _dry_run_report(None if stand_in else model_path, script_args, eval_args, run, ks=ks, rows=rows)
        model_path = model_path_or_default(script_args, training_args)
        check_chat_template(AutoTokenizer.from_pretrained(model_path), run)
        return evaluate_checkpoint(
            model_path,
            script_args,
            run,
            ks=ks,
            rows=rows,
            batch_questions=eval_args.batch_questions,
            output_json=eval_args.output_json,
            show_samples=eval_args.show_samples,
        )
    finally:
        run.close()


def _dry_run_report(model_path, script_args, eval_args, run, *, ks, rows) -> dict:
    # What the evaluation would do, printed and returned; the checks above have passed.
    for name, line in run.start_tools().items():
        print(f"tool {name}: {line}")
    model = model_path or "the embedded default (its weights would be built first)"
    print(
        f"dry run: would evaluate {model} on {len(rows)} held-out problems x {script_args.eval_samples} samples at "
        f"temperature {script_args.eval_temperature:g}, pass@k for k in {ks}, generated with "
        f"{run.sampler.describe(run.config)}"
        + (f"; the numbers to {eval_args.output_json}" if eval_args.output_json else "")
    )
    print("dry run: every start-up check passed; nothing was loaded, evaluated or written.", flush=True)
    return {"dry_run": True, "model": model_path, "problems": len(rows), "samples": script_args.eval_samples, "ks": ks}


def refuse_training_only_settings(script_args, training_args) -> None:
    """Honour or refuse: settings that would do nothing here stop the evaluation before anything loads.

    The evaluation loads ``--model_name_or_path`` as it is (a LoRA run's ``final/`` is an adapter folder and
    loads with its base model) and generates with HF generate, or transformers' continuous batching when
    ``--use_transformers_continuous_batching`` is set; it trains nothing and starts no vLLM engine.

    Raises:
        SystemExit: ``--use_peft`` or ``--use_vllm`` was given.
    """
    if script_args.use_peft:
        raise SystemExit(
            "--use_peft trains a new LoRA adapter; retool_eval.py trains nothing. To evaluate a LoRA run, "
            "pass its adapter folder (e.g. --model_name_or_path outputs/retool_ppo/final): it loads with "
            "its base model. Drop --use_peft."
        )
    if training_args.use_vllm:
        raise SystemExit(
            "retool_eval.py generates with HF generate (or transformers' continuous batching with "
            "--use_transformers_continuous_batching true), not vLLM: drop --use_vllm."
        )


if __name__ == "__main__":
    main(sys.argv[1:])
