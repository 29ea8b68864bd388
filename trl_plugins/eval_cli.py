"""Command line of ``recipes/retool_eval.py`` (also ``python -m trl_plugins.eval_cli``).

Evaluates a checkpoint on a held-out split with the training rollout: pass@1 (= mean accuracy over
samples), pass@k and tool-call statistics, greedy (``--temperature 0 --samples 1``) or sampled.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

from trl_plugins.embedded.coldstart import DEFAULT_SYSTEM_PROMPT

__all__ = ["EvalArguments", "main"]


@dataclass
class EvalArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Checkpoint (Hub name or local path); default: the embedded cold-start model."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset or local file/dir; default: the bundled arithmetic task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    split: str = field(default="test", metadata={"help": "Held-out split."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the question."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the reference answer."})
    num_problems: int = field(default=128, metadata={"help": "Problems to evaluate (the first N of the split, shuffled for Hub sets)."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the bundled task (and of Hub-set subsampling)."})
    samples: int = field(default=4, metadata={"help": "Samples per problem."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0 = greedy)."})
    k: list[int] = field(default_factory=lambda: [1, 4], metadata={"help": "pass@k values to report (each <= samples)."})
    system_prompt: str | None = field(default=DEFAULT_SYSTEM_PROMPT, metadata={"help": "System message."})
    rollout_kwargs: str = field(default='{"max_turns": 4, "max_tool_calls": 3, "max_assistant_tokens": 96, "max_trajectory_tokens": 1024, "max_tool_response_tokens": 128}', metadata={"help": "Rollout budgets (JSON)."})
    tool_kwargs: str = field(default="{}", metadata={"help": "Code-interpreter settings (JSON)."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    batch_questions: int = field(default=64, metadata={"help": "Questions per generation batch."})
    output_json: str | None = field(default=None, metadata={"help": "Write the numbers here as JSON."})
    show_samples: int = field(default=2, metadata={"help": "Print this many sample trajectories."})


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import TrlParser

    from trl_plugins.evaluation import evaluate_policy
    from trl_plugins.recipe_utils import load_task_rows
    from trl_plugins.rollout import MultiTurnRollout
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    parser = TrlParser(EvalArguments)
    (args,) = parser.parse_args_and_config(argv)
    if args.temperature == 0 and args.samples > 1:
        raise SystemExit("--temperature 0 is greedy: every sample would be the same; use --samples 1.")
    bad_k = [k for k in args.k if not 1 <= k <= args.samples]
    if bad_k:
        raise SystemExit(f"--k values must lie in [1, samples={args.samples}], got {bad_k}.")
    model_path = args.model_name_or_path
    if model_path is None:
        from trl_plugins.embedded.default import ensure_embedded_default

        model_path = str(ensure_embedded_default())
    import torch

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    on_gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.to("cuda" if on_gpu else "cpu")
    rows = load_task_rows(args.dataset_name, args.split, size=args.num_problems, seed=args.task_seed,
                          dataset_config=args.dataset_config, prompt_column=args.prompt_column,
                          answer_column=args.answer_column)
    tool = CodeInterpreter(**json.loads(args.tool_kwargs))
    start = time.perf_counter()
    try:
        result, trajectories = evaluate_policy(
            model, tokenizer, rows, tools={tool.name: tool}, rollout=MultiTurnRollout(**json.loads(args.rollout_kwargs)),
            samples=args.samples, temperature=args.temperature, ks=args.k, system_prompt=args.system_prompt,
            seed=args.seed, batch_questions=args.batch_questions, progress=True,
        )
    finally:
        tool.close()
    out = {"model": model_path, **result.to_dict(), "temperature": args.temperature, "wall_s": time.perf_counter() - start}
    out["pass_at_k"] = {str(k): v for k, v in out["pass_at_k"].items()}
    for traj in trajectories[: args.show_samples]:
        print(f"--- {traj.question_id} ({traj.stop_reason.value}, correct={traj.reward_components[0].value:+.0f})")
        for turn in traj.turns:
            print("  " + turn.text.replace("\n", "\n  "))
    print(f"{args.split}: {result.problems} problems x {result.samples} samples at temperature {args.temperature}: "
          f"accuracy {result.accuracy:.3f}, " + ", ".join(f"pass@{k} {v:.3f}" for k, v in result.pass_at_k.items())
          + f", tool-call rate {result.tool_call_rate:.3f}, tool calls/sample {result.tool_calls_mean:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
