"""The ReTool application on top of the trl_plugins library.

``task`` (the bundled arithmetic), ``coldstart`` + ``default_model`` (the embedded default: a tiny model
and tokenizer built locally, cold-started with SFT, cached), ``teacher`` (distillation's teacher ``embedded-rl``: the
embedded default after its task's RL recipe, built once and cached), ``config`` (the recipe's arguments),
``data`` (rows and answer hiding), ``evaluate`` (held-out evaluation), ``report`` (summary and plot) and
``launch`` (CPU defaults, W&B, clean child processes). The entry points are ``recipes/retool_ppo.py``,
``recipes/retool_eval.py`` and ``recipes/retool_seeds.py``.
"""
