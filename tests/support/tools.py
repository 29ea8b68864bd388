"""Tools that keep or break the tool contract (tests/test_contracts.py), and one the trainer refuses at start-up."""

from __future__ import annotations

from trl_plugins.tools.base import ToolOutput


def echo_schema(name="raiser", **function):
    """The schema of an echo tool, named ``name``, with ``function``'s entries on top."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Echo the text.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            **function,
        },
    }


class RaisingTool:
    """An echo tool that raises KeyError on arguments without ``text``."""

    name = "raiser"

    def schema(self):
        return echo_schema()

    async def __call__(self, arguments):
        return ToolOutput(text=arguments["text"], ok=True)  # KeyError on arguments without "text"


class EchoTool(RaisingTool):
    """Keeps the contract: the base of the broken ones below."""

    async def __call__(self, arguments):
        if not isinstance(arguments.get("text"), str):
            return ToolOutput(text="Error: text must be a string", ok=False)
        return ToolOutput(text=arguments["text"], ok=True)

    def close(self):
        pass


class MedianTool(EchoTool):
    """An echo tool that declares a metric reduction nobody knows (``median``)."""

    def step_metrics(self):
        return {"echo/calls": 1.0}

    def step_metric_reductions(self):
        return {"echo/calls": "median"}
