"""The contract check of tools, called as the rollout calls them and shown to the model by the chat format."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any, Mapping

from trl_plugins.contracts._base import ContractError, check, check_pickles, read_declarations, resolve_plugin
from trl_plugins.protocols import Tool, as_tool
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import schema_problem

__all__ = ["check_tool_contract"]


_SAMPLE_VALUES = {"string": "1", "integer": 1, "number": 1.0, "boolean": True, "object": {}, "array": []}
_WRONG_VALUES = {"string": 1, "integer": "1", "number": "1", "boolean": "yes", "object": "{}", "array": "[]"}


def check_tool_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    arguments: Mapping[str, Any] | None = None,
    concurrent_calls: int = 4,
) -> None:
    """A tool, called as the rollout calls it.

    Asserts: a non-empty ``name``; an OpenAI function schema naming it, with a description and an object
    of parameters whose required keys are among its properties, that the trainer's chat format renders
    to the model and whose call, written as the model writes it, parses back to ``arguments`` (else the
    rollout would refuse every such call as ``invalid_action``); an ``async __call__`` that returns a
    :class:`~trl_plugins.tools.base.ToolOutput` (``text`` a str, ``ok`` a bool) without raising, with no
    ``infra_error`` for ``arguments`` (run alone and ``concurrent_calls`` at once on one event loop, as
    the rollout does) and ``ok=False`` without ``infra_error`` for arguments the schema refuses (missing,
    unexpected or mistyped: the model's mistake, which it should see); ``idempotent`` a bool if
    declared; ``start_up()`` a str and ``step_metrics()`` ``{name: float}`` and
    ``step_metric_reductions()`` ``{name: "sum" | "max" | "min" | "mean"}`` if defined; a ``close()``
    that can be called twice, after which the tool works again; and that it pickles. The tool is closed
    at the end.

    Args:
        plugin: A registry name, ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance.
        arguments: Valid arguments (default: one value of the schema's type per required parameter).
        concurrent_calls: Calls run at once (0: none).

    Raises:
        ContractError: naming the plugin and what is wrong.
    """
    from trl_plugins.aio import run_async
    from trl_plugins.protocols import is_tool_set
    from trl_plugins.registry import TOOLS
    from trl_plugins.tools.base import ToolOutput, check_arguments, close_plugin

    label, tool = resolve_plugin(TOOLS, plugin, kwargs)
    if is_tool_set(tool):  # a tool set (mcp): each member is a tool of the run
        try:
            members = tool.member_tools()
            check(members, label, "member_tools() listed no tool")
            for member in members:
                check_tool_contract(member, arguments=arguments, concurrent_calls=concurrent_calls)
        finally:
            close_plugin(tool)
        return

    async def call(args: dict, times: int = 1) -> list[Any]:
        return list(await asyncio.gather(*(tool(dict(args)) for _ in range(times))))

    def run(args: dict, times: int = 1) -> list[ToolOutput]:
        try:
            outs = run_async(call(args, times))
        except Exception as exc:
            raise ContractError(
                f"{label}: raised {type(exc).__name__}: {exc} on arguments {args}. A tool never raises: the model's "
                f"mistakes are ToolOutput(text='Error: ...', ok=False), the tool's own failures "
                f"ToolOutput(infra_error=..., ok=False); the rollout counts an exception as the latter."
            ) from exc
        for out in outs:
            check(
                isinstance(out, ToolOutput) and isinstance(out.text, str) and isinstance(out.ok, bool),
                label,
                f"returned {out!r:.200} for arguments {args}, not a ToolOutput(text: str, ok: bool, ...)",
            )
        return outs

    try:
        check(
            isinstance(tool, Tool),
            label,
            "is not a tool: it needs a name, a schema() method (the model is told the "
            "tool exists only through it) and an async __call__(arguments)",
        )
        declared = read_declarations(as_tool, tool, label)  # the run's own reading: name, idempotent, reductions
        name = declared.name
        label = f"{label} (name {name!r})" if isinstance(plugin, str) and plugin != name else label
        schema = tool.schema()
        problem = schema_problem(schema, name)
        check(problem is None, label, str(problem))
        check(inspect.iscoroutinefunction(type(tool).__call__), label, "__call__ must be async (the rollout awaits it)")
        params = schema["function"]["parameters"]
        props = params.get("properties", {})
        if arguments is None:
            arguments = {k: _SAMPLE_VALUES.get(props[k].get("type"), "1") for k in params.get("required", [])}
        arguments = dict(arguments)
        why = check_arguments(schema, arguments)
        check(
            why is None,
            label,
            f"the arguments {arguments} do not fit the schema ({why}): the rollout would refuse "
            f"such a call as invalid_action before the tool runs",
        )
        _check_renders_and_parses(label, schema, arguments)
        if declared.start_up_fn is not None:
            said = declared.start_up_fn()
            check(
                isinstance(said, str),
                label,
                f"start_up() returned {said!r:.100}; it returns what the trainer logs (a str)",
            )

        for out in run(arguments) + (run(arguments, concurrent_calls) if concurrent_calls else []):
            check(
                out.infra_error is None,
                label,
                f"failed itself on the valid arguments {arguments}: infra_error={out.infra_error!r}",
            )
        bad = [{}, {**arguments, "unexpected_argument": "1"}]
        bad += [{**arguments, k: _WRONG_VALUES.get(props[k].get("type"), None)} for k in params.get("required", [])]
        for args in bad:
            why = check_arguments(schema, args)
            if why is None:  # valid after all (no required keys, extra keys allowed)
                continue
            (out,) = run(args)
            check(
                not out.ok and out.infra_error is None,
                label,
                f"returned ok={out.ok}, infra_error={out.infra_error!r} for arguments {args} that break its schema "
                f"({why}); the model's mistake is ToolOutput(text='Error: ...', ok=False) so that it sees it, "
                f"not an infra_error (which ends the trajectory untrained)",
            )

        if declared.step_metrics_fn is not None:
            metrics = declared.step_metrics_fn()
            check(
                isinstance(metrics, dict)
                and all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    for k, v in metrics.items()
                ),
                label,
                f"step_metrics() returned {metrics!r:.200}; it must return {{name: float}}",
            )
        check_pickles(tool, label, equal=False)

        if declared.closes:
            try:
                close_plugin(tool)
                close_plugin(tool)
            except Exception as exc:
                raise ContractError(
                    f"{label}: close() raised {type(exc).__name__}: {exc} (it must be idempotent)"
                ) from exc
            (out,) = run(arguments)
            check(
                out.infra_error is None,
                label,
                f"does not work after close(): infra_error={out.infra_error!r}; a closed tool starts its resources "
                f"again on its next call",
            )
    except BaseException:
        with contextlib.suppress(Exception):  # the contract error is the news, not a second failure closing
            close_plugin(tool)
        raise
    close_plugin(tool)


def _check_renders_and_parses(label: str, schema: dict, arguments: dict) -> None:
    """The trainer's chat format shows ``schema`` to the model, and a call written as the model writes it
    parses back to ``arguments`` (a Qwen2.5 template on a tiny tokenizer)."""
    import json

    from trl_plugins.rollout import ChatFormat, TurnKind
    from trl_plugins.rollout.chat import ChatTemplateError

    name = schema["function"]["name"]
    tok = build_tokenizer("qwen2_5")
    try:
        chat = ChatFormat(tok, [schema])
    except ChatTemplateError as exc:
        raise ContractError(f"{label}: the chat format refuses its schema: {exc}") from exc
    prompt = chat.initial_prompt_ids([{"role": "user", "content": "question"}])
    check(name in tok.decode(prompt), label, "its schema does not reach the prompt the model sees")
    body = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    completion = tok(body, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    parsed = chat.parse(prompt, completion)
    check(
        parsed.kind == TurnKind.TOOL_CALL and parsed.tool_name == name and parsed.arguments == arguments,
        label,
        f"a call of it with {arguments}, as the model writes it, parses as {parsed.kind} "
        f"({parsed.tool_name!r}, {parsed.arguments!r}, error {parsed.error!r}), not as that call",
    )
