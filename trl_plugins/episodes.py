"""Episodes of the tool seam: which trajectory a tool call belongs to (:data:`current_episode`), and the context a
rollout runs each trajectory's turns in (:func:`tool_episode`), so a tool that keeps state per trajectory can key it
and free it (``end_episode``)."""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from typing import Any

__all__ = ["current_episode", "tool_episode"]

current_episode: ContextVar[Any] = ContextVar("trl_plugins_current_episode", default=None)
"""The trajectory a tool call belongs to (a key unique in the process), set by the rollout around each trajectory's
turns; None outside one. A tool that keeps state per trajectory keys it by this and frees it in ``end_episode``."""


@contextlib.asynccontextmanager
async def tool_episode(tools: Any) -> Any:
    """Run a trajectory's turns as one episode of ``tools`` (ToolPlugins): :data:`current_episode` set to a new key
    inside, and every tool's ``end_episode(key)`` awaited on the way out, however the trajectory ended."""
    key = object()
    token = current_episode.set(key)
    try:
        yield key
    finally:
        current_episode.reset(token)
        for tool in tools:
            try:
                await tool.end_episode(key)
            except Exception:  # noqa: BLE001 - a tool's cleanup must not end the rollout
                logging.getLogger(__name__).exception("%s: end_episode failed", tool.label)
