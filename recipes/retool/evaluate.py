"""Held-out evaluation of a checkpoint with the run's own config: the recipe's before/after numbers and
``recipes/retool_eval.py``.

The rollout, tools, reward components and system prompt are the training run's (:class:`trl_plugins.run.Run`,
rebuilt from its spec in a child process); the held-out rows,
samples and temperature from ``ScriptArguments`` (``dataset_test_split`` or ``held_out_fraction``,
``eval_problems``, ``eval_samples``, ``eval_temperature``): the held-out rows never include a training row
(:func:`retool.data.load_task_rows`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from transformers import TrainerCallback

__all__ = ["EvalArguments", "check_eval_settings", "evaluate_checkpoint", "reusable_evaluation", "PeriodicHeldOut"]


@dataclass
class EvalArguments:
    """Options of ``recipes/retool_eval.py`` beyond the recipe's own arguments."""

    k: list[int] | None = field(
        default=None, metadata={"help": "pass@k values to report, each <= eval_samples (default: 1 and eval_samples)."}
    )
    batch_questions: int = field(default=64, metadata={"help": "Questions per generation batch."})
    output_json: str | None = field(default=None, metadata={"help": "Write the numbers here as JSON."})
    show_samples: int = field(default=2, metadata={"help": "Print this many sample trajectories."})


def check_eval_settings(
    script_args: Any, run: Any, ks: Sequence[int] | None = None, *, training: bool = True
) -> list[int]:
    """The pass@k values to report (default 1 and ``eval_samples``); refuses settings that cannot work,
    before any model is built or loaded. ``training``: called by the training recipe (else by
    ``retool_eval.py``, which has no ``--eval_problems 0`` way out).

    Raises:
        SystemExit: the held-out split named as the training split, greedy decoding with several
            samples, a k outside [1, eval_samples], or reward components without the one the evaluation
            counts by (``success_component``: ``correct``, or ``reasoning_gym`` for that task).
    """
    from trl_plugins.evaluation import check_success_component

    if (
        script_args.eval_problems > 0 or not training
    ) and script_args.dataset_test_split == script_args.dataset_train_split:
        split = script_args.dataset_test_split
        way_out = (
            "or skip the held-out evaluation with --eval_problems 0"
            if training
            else "or, for a dataset the checkpoint did not train on, set --dataset_train_split to another name"
        )
        raise SystemExit(
            f"dataset_test_split and dataset_train_split are both {split!r}: the held-out evaluation would score the "
            f"training rows. Name the held-out split with --dataset_test_split (a dataset without one holds out "
            f"--held_out_fraction of the training split), {way_out}."
        )
    if script_args.eval_problems > 0:
        try:
            check_success_component(run, script_args.success_component)
        except ValueError as exc:
            raise SystemExit(f"{exc} Or skip the held-out evaluation with --eval_problems 0.") from exc
    samples = script_args.eval_samples
    if script_args.eval_temperature == 0 and samples > 1:
        raise SystemExit("--eval_temperature 0 is greedy: every sample would be the same; use --eval_samples 1.")
    ks = sorted(set(ks)) if ks else sorted({1, samples})
    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise SystemExit(f"--k values must lie in [1, eval_samples={samples}], got {bad}.")
    return ks


def evaluate_checkpoint(
    model_path: str,
    script_args: Any,
    run: Any,
    *,
    ks: Sequence[int],
    rows: Sequence[dict] | None = None,
    batch_questions: int = 64,
    output_json: str | None = None,
    show_samples: int = 2,
    progress: bool = True,
) -> dict:
    """Evaluate ``model_path`` on the held-out rows; prints samples and a summary line, returns the numbers.

    ``run``: the run (``retool_eval.py``'s, resolved in this process) or its :class:`~trl_plugins.run.RunSpec`
    (the recipe's child process: the run is rebuilt from it, nothing checked again, and closed at the end).
    ``rows``: the held-out rows (the recipe passes those it loaded); default: ``eval_problems`` of them
    loaded here (:func:`retool.data.task_rows`, which says where they come from). Every accuracy and pass@k
    comes with its standard error clustered by problem (``*_se``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.data import task_rows
    from trl_plugins.evaluation import evaluate_policy
    from trl_plugins.run import RunSpec, build_run

    if rows is None:
        rows = task_rows(script_args, "test", size=script_args.eval_problems, log=print)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.to("cuda" if on_gpu else "cpu")
    temperature = script_args.eval_temperature
    start = time.perf_counter()
    owned = isinstance(run, RunSpec)
    if owned:
        run = build_run(run)
    try:
        result, trajectories = evaluate_policy(
            model,
            tokenizer,
            rows,
            run,
            samples=script_args.eval_samples,
            temperature=temperature,
            ks=ks,
            seed=run.config.seed,
            batch_questions=batch_questions,
            progress=progress,
            success_component=script_args.success_component,
        )
    finally:
        if owned:
            run.close()
    out = {"model": model_path, **result.to_dict(), "temperature": temperature, "wall_s": time.perf_counter() - start}
    out["pass_at_k"] = {str(k): v for k, v in out["pass_at_k"].items()}
    out["pass_at_k_se"] = {str(k): v for k, v in out["pass_at_k_se"].items()}
    for traj in trajectories[:show_samples]:
        print(
            f"--- {traj.question_id} ({traj.stop_reason.value}, "
            + ", ".join(f"{c.name}={c.value:+g}" for c in traj.reward_components)
            + ")"
        )
        for turn in traj.turns:
            print("  " + turn.text.replace("\n", "\n  "))

    by_tool = result.tool_calls_by_tool

    def pm(value: float, se: float | None) -> str:
        return f"{value:.3f}" + ("" if se is None else f" ± {se:.3f}")

    print(
        f"held-out: {result.problems} problems x {result.samples} samples at temperature {temperature}: "
        f"accuracy {pm(result.accuracy, result.accuracy_se)}, "
        + ", ".join(f"pass@{k} {pm(v, result.pass_at_k_se.get(k))}" for k, v in result.pass_at_k.items())
        + f", tool-call rate {result.tool_call_rate:.3f}, tool calls/sample {result.tool_calls_mean:.2f}"
        + (f" ({', '.join(f'{name} {v:.2f}' for name, v in by_tool.items())})" if len(by_tool) > 1 else "")
        + ("" if result.tool_calls_per_solved is None else f", tool calls/solved {result.tool_calls_per_solved:.2f}")
        + (
            ""
            if result.recovery_rate is None
            else f", recovery after a failed call {result.recovery_rate:.3f} (of {result.failed_call_frac:.3f} of "
            "samples)"
        )
        + " (± one standard error, clustered by problem)",
        flush=True,
    )
    if output_json:
        with open(output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def reusable_evaluation(
    path: Any, *, model: str, rows: Sequence[dict], samples: int, temperature: float
) -> dict | None:
    """The evaluation saved at ``path`` when it evaluated ``model`` on exactly ``rows`` (their ids) with ``samples``
    samples at ``temperature``; else None (no file, unreadable, or anything different: evaluate again).

    A resumed run's starting model is the one its first start evaluated: this saves re-running the "before"
    evaluation (minutes to hours on a real model) without ever reusing numbers of another setting.
    """
    from pathlib import Path

    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    same = (
        isinstance(saved, dict)
        and saved.get("model") == model
        and saved.get("samples") == samples
        and saved.get("temperature") == temperature
        and set(saved.get("correct_by_problem") or ()) == {str(r["id"]) for r in rows}
    )
    return saved if same else None


class PeriodicHeldOut(TrainerCallback):
    """A TrainerCallback: every ``every`` steps, a cheap held-out evaluation of the live policy, logged
    with the step (``heldout/accuracy`` and its standard error clustered by problem ``heldout/accuracy_se``,
    ``heldout/accuracy_with_tool``, ``heldout/tool_call_rate``, ``heldout/truncated_frac``), so a run shows
    its held-out curve, not only the two end points.

    Runs in the training process on the prepared model: each rank evaluates an equal share of ``rows``
    (under ZeRO-3 the full weights are gathered once per share) and the counts are summed over ranks.
    The trajectories are sampled at ``temperature`` with seeds fixed per evaluation, so two runs
    compare on the same draws.
    """

    def __init__(
        self,
        trainer: Any,
        rows: Sequence[dict],
        *,
        every: int,
        samples: int,
        temperature: float,
        success_component: str = "correct",
    ) -> None:
        self.trainer, self.every, self.samples, self.temperature = trainer, every, samples, temperature
        self.success_component = success_component
        world = trainer.accelerator.num_processes
        usable = len(rows) - len(rows) % world  # equal shares: every rank runs the same collectives
        self.rows = list(rows[trainer.accelerator.process_index : usable : world])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every and state.global_step % self.every == 0 and self.rows:
            self.trainer.record_metrics(self.evaluate(seed=args.seed + 7919))

    def evaluate(self, *, seed: int) -> dict[str, float]:
        """The held-out numbers of the current policy, summed over ranks."""
        from trl_plugins.evaluation import evaluate_policy
        from trl_plugins.trainers.ranks import reduce_over_ranks

        trainer = self.trainer
        result, _ = evaluate_policy(
            trainer.model_wrapped,
            trainer.processing_class,
            self.rows,
            trainer.run,
            samples=self.samples,
            temperature=self.temperature,
            seed=seed,
            batch_questions=len(self.rows),
            accelerator=trainer.accelerator,
            backend=trainer.generation_backend(temperature=self.temperature),
            policy_step=trainer.state.global_step,
            success_component=self.success_component,
        )
        n = result.problems * result.samples
        with_tool = result.tool_call_rate * n
        # Per-problem accuracies (each rank has its own problems) for the standard error clustered by problem.
        per_problem = [c / m for c, m in result.correct_by_problem.values()]
        sums = [
            n,
            result.accuracy * n,
            with_tool,
            (result.accuracy_with_tool or 0.0) * with_tool,
            result.truncated_frac * n,
            len(per_problem),
            sum(per_problem),
            sum(a * a for a in per_problem),
        ]
        sums = reduce_over_ranks(trainer.accelerator, sums, "sum")
        n, correct, with_tool, correct_with_tool, truncated, problems, acc_sum, acc_sq = sums
        out = {
            "heldout/accuracy": correct / n,
            "heldout/tool_call_rate": with_tool / n,
            "heldout/truncated_frac": truncated / n,
        }
        if problems >= 2:  # sd of the per-problem accuracies / sqrt(problems) (equal samples per problem)
            out["heldout/accuracy_se"] = math.sqrt(max(acc_sq - acc_sum**2 / problems, 0.0) / (problems - 1) / problems)
        if with_tool:
            out["heldout/accuracy_with_tool"] = correct_with_tool / with_tool
        return out
