"""``python -m trl_plugins.replay BATCH.json [--checkpoint DIR] [--tools] [--rewards]``: re-derive a saved batch and
name the first difference (:mod:`trl_plugins.viewer.replay_cli`; docs/replay.md)."""

from trl_plugins.viewer.replay_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
