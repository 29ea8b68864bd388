"""``python -m trl_plugins.viewer``: see :func:`trl_plugins.viewer.cli.main`."""

from trl_plugins.viewer.cli import main

raise SystemExit(main())
