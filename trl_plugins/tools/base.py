"""The tool seam: what a tool is and what it returns.

A tool is a registered plugin (:data:`trl_plugins.registry.TOOLS`) constructed with its own settings.
It has a ``name``, a JSON schema in the OpenAI function format (what the chat template shows the
model), and an async call that receives the parsed arguments and returns a :class:`ToolOutput`.
Tools must not raise for bad model input: a wrong argument is an output the model should see.

Two kinds of failure, told apart by the result: the *model's* code or arguments failed (``ok=False``,
the text is what the model should learn from, e.g. a traceback), or the *tool itself* failed
(``infra_error`` set: the sandbox could not start or crashed, a plugin bug, the host ran out of
resources). The second is not the policy's fault: the trajectory ends with
``StopReason.ENVIRONMENT_ERROR`` and carries no training signal. A tool that raises is treated as the
second kind. A tool may declare ``idempotent = True`` (running a call twice is harmless); the rollout
then retries a call that failed for infrastructure reasons (``tool_retries``).

What a tool may declare besides (``idempotent``, ``start_up()``, ``step_metrics()``,
``step_metric_reductions()``, ``close()``) is in :mod:`trl_plugins.protocols`, with the :class:`Tool` Protocol itself.
A tool that holds resources (a sandbox pool, a connection, a server) defines ``close()`` (plain or
``async``): the trainer closes every tool at the end of training, on an exception and on an interrupt
(:func:`close_plugin`), and evaluation closes the tools it built. ``close()`` must be idempotent, and a
closed tool may start its resources again on its next call. Rollout and reward plugins get the same
lifecycle. :class:`ClosingTool` adds context-manager use (``with MyTool() as tool: ...``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from trl_plugins.protocols import Tool, close_plugin

__all__ = ["ToolOutput", "Tool", "ClosingTool", "close_plugin", "check_arguments", "schema_problem", "valid_text"]


@dataclass
class ToolOutput:
    """What a tool call returned."""

    text: str
    """Text fed back to the model as the tool message. Code points no tokenizer can encode (a lone surrogate) are
    replaced by U+FFFD before it is tokenised (:func:`valid_text`); a value that is not a ``str`` is the tool's own
    failure (the trajectory ends with ``environment_error``)."""
    ok: bool
    """True when the call succeeded."""
    timed_out: bool = False
    """True when the call hit its time limit."""
    latency_s: float = 0.0
    """Wall time of the call, seconds."""
    infra_error: str | None = None
    """Set when the tool itself failed (not the model's code): why. The trajectory ends with
    ``environment_error`` instead of showing ``text`` to the model."""


def valid_text(text: str) -> str:
    """``text`` as text every tokenizer can encode: a lone surrogate (``"\\ud800"``, which UTF-8 cannot encode and
    a tokenizer refuses) becomes U+FFFD, the replacement character, as ``errors="replace"`` would make it; a
    surrogate pair becomes the character it encodes. Anything else, NUL and control characters included, is valid
    Unicode and stays as it is. Pure; ``text`` itself is returned when it needs no change.

    Raises:
        TypeError: ``text`` is not a ``str``."""
    if not isinstance(text, str):
        raise TypeError(f"tool output must be a str, got {type(text).__name__} ({text!r:.60})")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class ClosingTool:
    """Mixin: ``close()`` (a no-op to override) and context-manager use, which closes on exit."""

    def close(self) -> None:
        """Release what the tool holds; idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        close_plugin(self)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(schema: dict[str, Any], arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's JSON schema, or None: required keys and primitive types first (their
    messages), then the whole schema as JSON Schema 2020-12 (``jsonschema``). A mismatch is the model's invalid
    call (``invalid_action``), never the tool's failure."""
    params = schema.get("function", schema).get("parameters", {})
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = params.get("properties", {})
    for key in params.get("required", []):
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if params.get("additionalProperties", True) is False:
                return f"unexpected argument {key!r}"
            continue
        expected = _JSON_TYPES.get(props[key].get("type", ""))
        if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            return f"argument {key!r} must be of type {props[key]['type']}, got {type(value).__name__}"
    return _json_schema_problem(params, arguments)


def _json_schema_problem(params: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """The first way ``arguments`` break the parameters as JSON Schema 2020-12 (nesting, enums, ``anyOf``,
    ``$defs``), or None; the primitive checks above have passed."""
    validator = _validator(json.dumps(params, sort_keys=True))
    error = next(iter(sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"arguments do not match the tool's schema{' at ' + repr(where) if where else ''}: {error.message}"


@functools.lru_cache(maxsize=256)
def _validator(params_json: str) -> Any:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(params_json))


def schema_problem(schema: Any, name: str) -> str | None:
    """Why ``schema`` is not an OpenAI function schema for the tool ``name``, or None. Cheap (no call of the tool):
    the run checks every tool's schema when it is built, the contract check too."""
    import json

    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        return f"schema() returned {schema!r:.200}; it must be {{'type': 'function', 'function': {{...}}}}"
    fn = schema["function"]
    if fn.get("name") != name:
        return (
            f"schema()['function']['name'] is {fn.get('name')!r}, but the tool's name is {name!r}. The model calls a "
            f"tool by the name its schema shows, and the rollout finds the tool by its own name, so every call "
            f"would find no tool: make the two the same"
        )
    if not isinstance(fn.get("description"), str) or not fn["description"].strip():
        return "schema()['function'] has no 'description': the model is told what the tool does only there"
    params = fn.get("parameters")
    if (
        not isinstance(params, dict)
        or params.get("type") != "object"
        or not isinstance(params.get("properties", {}), dict)
    ):
        return (
            "schema()['function']['parameters'] must be a JSON-schema object: {'type': 'object', 'properties': {...}}"
        )
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(required, list) or any(k not in props for k in required):
        return (
            f"schema()['function']['parameters']['required'] ({required!r}) must list keys of 'properties' "
            f"({sorted(props)})"
        )
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        return f"schema() is not JSON (the chat template renders it as JSON): {exc}"
    return None
