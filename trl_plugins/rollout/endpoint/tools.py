"""The rollout request's tools offered to an agent through its session (docs/agents.md, "The run's tools").

``GET <base_url>/tools`` lists them as OpenAI function tools (the schemas to send as a request's ``tools``);
``POST <base_url>/tools/call`` with ``{"name", "arguments"}`` runs one as the built-in rollout runs it, in the
trajectory's own episode (a per-trajectory MCP server is this trajectory's; it is stopped when the agent's run
ends), and answers ``{"content", "ok"}``: the text the built-in rollout would show the model."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from trl_plugins.protocols import ToolPlugin, current_episode
from trl_plugins.rollout.endpoint.http import HttpError
from trl_plugins.rollout.endpoint.session import Session
from trl_plugins.tools.base import ToolOutput, valid_text
from trl_plugins.types import StopReason

__all__ = ["serve_tools", "end_tool_episode"]

logger = logging.getLogger(__name__)


def _listing(tools: Mapping[str, ToolPlugin]) -> dict[str, Any]:
    return {"object": "list", "data": [tool.schema() for tool in tools.values()]}


def _arguments(body: Any, tools: Mapping[str, ToolPlugin]) -> tuple[ToolPlugin, dict[str, Any]]:
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise HttpError(
            400,
            'POST tools/call takes {"name": <a tool of GET tools>, "arguments": {...} or its JSON '
            "text (as a tool call's function.arguments)}",
            param="name",
        )
    unknown = set(body) - {"name", "arguments", "tool_call_id"}
    if unknown:
        raise HttpError(
            400,
            f"POST tools/call takes name, arguments and tool_call_id; not {sorted(unknown)}",
            param=sorted(unknown)[0],
        )
    tool = tools.get(body["name"])
    if tool is None:
        raise HttpError(
            404,
            f"the run offers no tool {body['name']!r}; GET tools lists {sorted(tools)}",
            param="name",
            code="unknown_tool",
        )
    arguments = body.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as exc:
            raise HttpError(400, f"arguments is not JSON: {exc}", param="arguments") from None
    if not isinstance(arguments, dict):
        raise HttpError(400, f"arguments must be a JSON object, got {type(arguments).__name__}", param="arguments")
    return tool, arguments


async def serve_tools(method: str, route: str, body: Any, session: Session, tools: Mapping[str, ToolPlugin]) -> dict:
    """Answer ``GET tools`` or ``POST tools/call`` for ``session`` (``body``: the parsed request body, None for GET).

    A call runs with :data:`~trl_plugins.protocols.current_episode` set to the session's episode. Its result is an
    observation (``ok`` false for the tool's own error, e.g. ``isError`` or arguments breaking its schema); a tool
    that raises or reports an infrastructure failure ends the trajectory as ``environment_error`` (502).

    Raises:
        HttpError: an unknown route or tool, a malformed body, an ended trajectory, a failed tool."""
    if method == "GET" and route == "tools":
        return _listing(tools)
    if method != "POST" or route != "tools/call":
        raise HttpError(
            404,
            f"{method} /{route} is not served; the run's tools are GET tools and POST tools/call.",
            code="not_found",
        )
    tool, arguments = _arguments(body, tools)
    if session.ended:
        raise session._refuse_ended()
    session.episode_used = True
    token = current_episode.set(session.episode)
    try:
        out = await tool(arguments)
    except Exception as exc:  # noqa: BLE001 - the tool's failure, not the rollout's
        out = ToolOutput(text="", ok=False, infra_error=f"{type(exc).__name__}: {exc}")
    finally:
        current_episode.reset(token)
    if not isinstance(out, ToolOutput) or not isinstance(out.text, str):
        out = ToolOutput(text="", ok=False, infra_error=f"the tool returned {out!r:.60}, not a ToolOutput with text")
    if out.infra_error is not None:
        session.end(StopReason.ENVIRONMENT_ERROR, f"tool {tool.name!r}: {out.infra_error}")
        raise HttpError(502, str(session.traj.error), code="tool_failed", kind="server_error")
    if isinstance(body.get("tool_call_id"), str):  # the model's call: its record gets the tool's ok
        session.tool_ok[body["tool_call_id"]] = bool(out.ok)
    return {"content": valid_text(out.text), "ok": bool(out.ok)}


async def end_tool_episode(session: Session, tools: Mapping[str, ToolPlugin]) -> None:
    """The agent's run has ended: every tool's ``end_episode`` for the session's episode (stops its servers)."""
    if not session.episode_used:
        return
    for tool in tools.values():
        try:
            await tool.end_episode(session.episode)
        except Exception:  # noqa: BLE001 - a tool's cleanup must not end the rollout
            logger.exception("%s: end_episode failed", tool.label)
