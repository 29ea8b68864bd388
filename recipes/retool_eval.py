"""Evaluate a ReTool checkpoint on a held-out split: pass@1, pass@k and tool-call statistics.

    # the embedded cold-start model (no arguments) or a trained checkpoint, sampled
    python recipes/retool_eval.py --model_name_or_path outputs/retool_ppo/final --samples 8 --k 1 8
    # greedy
    python recipes/retool_eval.py --model_name_or_path outputs/retool_ppo/final --temperature 0 --samples 1 --k 1
    # a Hub model on a Hub maths set
    python recipes/retool_eval.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset_name HuggingFaceH4/MATH-500 --split test --prompt_column problem --answer_column answer

It rolls out with the training rollout (same chat format, code-interpreter sandbox and budgets:
``--rollout_kwargs``) and scores with the ``correct`` reward (math-verify on the last ``\\boxed{}``),
so its accuracy is the training log's ``reward/correct`` on unseen problems. ``--output_json``
writes the numbers; ``--config`` takes a YAML of the same fields.
"""

import sys

from trl_plugins.eval_cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
