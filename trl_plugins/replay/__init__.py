"""Replaying what was trained, to find where it differs from what the code now produces.

- :mod:`.cli`: ``python -m trl_plugins.replay BATCH.json`` (and the ``trl-plugins-replay`` console script): a saved
  batch re-derived and the first difference named (docs/replay.md).
- :mod:`.saved_batch`: that re-derivation (rendering, log-probs, the seeded turns drawn again, tool calls, rewards,
  stop reasons, datums) against a checkpoint or the run's own folder; :mod:`.report`: what it reports and refuses.
- :mod:`.rollout_check`: the check of a fresh rollout, in training and in tests: its behaviour log-probs and its
  rendering recomputed by the trainer's own forward and chat template (``replay_logprobs``, ``replay_rendering``).
"""
