"""The ``mcp`` tool plugin: every tool of the configured Model Context Protocol servers (docs/tools.md).

The SDK (``pip install -e ".[mcp]"``) is imported only when a server is connected."""

from trl_plugins.tools.mcp.config import ServerSpec, load_servers

__all__ = ["ServerSpec", "load_servers"]
