"""``python -m trl_plugins.replay``: see :func:`trl_plugins.replay.cli.main`."""

from trl_plugins.replay.cli import main

raise SystemExit(main())
