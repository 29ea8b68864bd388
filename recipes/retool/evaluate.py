"""Held-out evaluation of a checkpoint with the run's own config: the recipe's before/after numbers and
``recipes/retool_eval.py``.

The rollout, tools, reward components and system prompt come from the training ``MultiTurnGRPOConfig``
(:func:`trl_plugins.evaluation.evaluate_policy` builds them through the registries); the held-out rows,
samples and temperature from ``ScriptArguments`` (``dataset_test_split``, ``eval_problems``,
``eval_samples``, ``eval_temperature``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from transformers import TrainerCallback

__all__ = ["EvalArguments", "check_eval_settings", "evaluate_checkpoint", "PeriodicHeldOut"]


@dataclass
class EvalArguments:
    """Options of ``recipes/retool_eval.py`` beyond the recipe's own arguments."""

    k: list[int] | None = field(default=None, metadata={"help": "pass@k values to report, each <= eval_samples (default: 1 and eval_samples)."})
    batch_questions: int = field(default=64, metadata={"help": "Questions per generation batch."})
    output_json: str | None = field(default=None, metadata={"help": "Write the numbers here as JSON."})
    show_samples: int = field(default=2, metadata={"help": "Print this many sample trajectories."})


def check_eval_settings(script_args: Any, training_args: Any, ks: Sequence[int] | None = None) -> list[int]:
    """The pass@k values to report (default 1 and ``eval_samples``); refuses settings that cannot work,
    before any model is built or loaded.

    Raises:
        SystemExit: greedy decoding with several samples, a k outside [1, eval_samples], or reward
            components without the ``correct`` one the evaluation counts by.
    """
    from trl_plugins.evaluation import check_success_component

    if script_args.eval_problems > 0:
        try:
            check_success_component(training_args)
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
    training_args: Any,
    *,
    ks: Sequence[int],
    batch_questions: int = 64,
    output_json: str | None = None,
    show_samples: int = 2,
    progress: bool = True,
) -> dict:
    """Evaluate ``model_path`` on the held-out split; prints samples and a summary line, returns the numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool.data import load_task_rows
    from trl_plugins.evaluation import evaluate_policy

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.to("cuda" if on_gpu else "cpu")
    split = script_args.dataset_test_split
    rows = load_task_rows(script_args.dataset_name, split, size=script_args.eval_problems, seed=script_args.task_seed,
                          dataset_config=script_args.dataset_config, prompt_column=script_args.prompt_column,
                          answer_column=script_args.answer_column)
    temperature = script_args.eval_temperature
    start = time.perf_counter()
    result, trajectories = evaluate_policy(
        model, tokenizer, rows, training_args, samples=script_args.eval_samples, temperature=temperature, ks=ks,
        seed=training_args.seed, batch_questions=batch_questions, progress=progress,
    )
    out = {"model": model_path, **result.to_dict(), "temperature": temperature, "wall_s": time.perf_counter() - start}
    out["pass_at_k"] = {str(k): v for k, v in out["pass_at_k"].items()}
    for traj in trajectories[:show_samples]:
        print(f"--- {traj.question_id} ({traj.stop_reason.value}, "
              + ", ".join(f"{c.name}={c.value:+g}" for c in traj.reward_components) + ")")
        for turn in traj.turns:
            print("  " + turn.text.replace("\n", "\n  "))
    print(f"{split}: {result.problems} problems x {result.samples} samples at temperature {temperature}: "
          f"accuracy {result.accuracy:.3f}, " + ", ".join(f"pass@{k} {v:.3f}" for k, v in result.pass_at_k.items())
          + f", tool-call rate {result.tool_call_rate:.3f}, tool calls/sample {result.tool_calls_mean:.2f}", flush=True)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


class PeriodicHeldOut(TrainerCallback):
    """A TrainerCallback: every ``every`` steps, a cheap held-out evaluation of the live policy, logged
    with the step (``heldout/accuracy``, ``heldout/accuracy_with_tool``, ``heldout/tool_call_rate``,
    ``heldout/truncated_frac``), so a run shows its held-out curve, not only the two end points.

    Runs in the training process on the prepared model: each rank evaluates an equal share of ``rows``
    (under ZeRO-3 the full weights are gathered once per share) and the counts are summed over ranks.
    The trajectories are sampled at ``temperature`` with seeds fixed per evaluation, so two runs
    compare on the same draws.
    """

    def __init__(self, trainer: Any, rows: Sequence[dict], *, every: int, samples: int, temperature: float) -> None:
        self.trainer, self.every, self.samples, self.temperature = trainer, every, samples, temperature
        world = trainer.accelerator.num_processes
        usable = len(rows) - len(rows) % world  # equal shares: every rank runs the same collectives
        self.rows = list(rows[trainer.accelerator.process_index:usable:world])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every and state.global_step % self.every == 0 and self.rows:
            self.trainer.record_metrics(self.evaluate(seed=args.seed + 7919))

    def evaluate(self, *, seed: int) -> dict[str, float]:
        """The held-out numbers of the current policy, summed over ranks."""
        from trl_plugins.evaluation import evaluate_policy

        trainer = self.trainer
        result, _ = evaluate_policy(
            trainer.model_wrapped, trainer.processing_class, self.rows, trainer.args, samples=self.samples,
            temperature=self.temperature, seed=seed, batch_questions=len(self.rows), accelerator=trainer.accelerator,
            backend=trainer.generation_backend(temperature=self.temperature), policy_step=trainer.state.global_step,
        )
        n = result.problems * result.samples
        with_tool = result.tool_call_rate * n
        sums = [n, result.accuracy * n, with_tool, (result.accuracy_with_tool or 0.0) * with_tool, result.truncated_frac * n]
        if trainer.accelerator.num_processes > 1:
            import torch

            sums = trainer.accelerator.reduce(torch.tensor(sums, dtype=torch.float64, device=trainer.accelerator.device),
                                              reduction="sum").tolist()
        n, correct, with_tool, correct_with_tool, truncated = sums
        out = {"heldout/accuracy": correct / n, "heldout/tool_call_rate": with_tool / n, "heldout/truncated_frac": truncated / n}
        if with_tool:
            out["heldout/accuracy_with_tool"] = correct_with_tool / with_tool
        return out
