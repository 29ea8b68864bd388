"""The ``calculator`` tool: arithmetic on one expression, parsed with :mod:`ast` and never ``eval``-ed.

Only numbers, ``+ - * / // % **`` and parentheses are accepted; a name, a call, an attribute, a string
or anything else is refused before anything runs. Integers are exact, so ``2 ** 100`` is not rounded.
"""

from __future__ import annotations

import ast
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from trl_plugins.tools.base import ToolOutput, check_arguments

__all__ = ["Calculator", "CalculatorError"]

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "use only numbers, + - * / // % ** and parentheses"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute; the message is shown to the model."""


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Attribute):
        return f"attribute access ({node.attr!r})"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return f"a {type(node).__name__} expression"


@dataclass
class Calculator:
    """Evaluates one arithmetic expression per call.

    The model gets the value (``"14"``, ``"0.25"``) on success, and ``"Error: ..."`` with ``ok=False``
    for a refused or malformed expression, a division by zero or a result over the size limit. The
    tool never raises for bad model input.
    """

    max_expression_chars: int = 500
    """Longest expression accepted."""
    max_result_bits: int = 4096
    """Largest integer magnitude (in bits, about 1233 decimal digits) of any intermediate result;
    bounds the work a call like ``9 ** 9 ** 9`` can ask for."""
    name: str = "calculator"
    """Name the model calls the tool by."""
    idempotent: ClassVar[bool] = True
    """Declared capability: a pure function of its arguments, so a call that failed for infrastructure reasons (the
    tool raised) may be run again; the rollout retries it (``tool_retries``)."""
    _calls: int = field(default=0, init=False, repr=False, compare=False)
    _errors: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for field_name in ("max_expression_chars", "max_result_bits"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}.")

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": (
                    "Evaluate one arithmetic expression and return its value. Integers are exact. "
                    "Allowed: numbers, + - * / // % ** and parentheses; no names or functions."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "The expression, e.g. 2 * (3 + 4)."}
                    },
                    "required": ["expression"],
                },
            },
        }

    async def __call__(self, arguments: dict[str, Any]) -> ToolOutput:
        start = time.perf_counter()
        self._calls += 1
        problem = check_arguments(self.schema(), arguments)
        try:
            if problem is not None:
                raise CalculatorError(problem)
            value = self.evaluate(arguments["expression"])
        except CalculatorError as exc:
            self._errors += 1
            return ToolOutput(text=f"Error: {exc}", ok=False, latency_s=time.perf_counter() - start)
        return ToolOutput(text=repr(value), ok=True, latency_s=time.perf_counter() - start)

    def start_up(self) -> str:
        """Declared capability: what the run says about the tool before any model loads (nothing to start here)."""
        return f"arithmetic parsed with ast (never eval-ed), results up to {self.max_result_bits} bits"

    def step_metrics(self) -> dict[str, float]:
        """Declared capability: this rank's calls and refused expressions since the last step (then reset)."""
        metrics = {f"{self.name}/calls": float(self._calls), f"{self.name}/errors": float(self._errors)}
        self._calls = self._errors = 0
        return metrics

    def step_metric_reductions(self) -> dict[str, str]:
        """Declared capability: both are counts, summed over the ranks (undeclared metrics are averaged)."""
        return {f"{self.name}/calls": "sum", f"{self.name}/errors": "sum"}

    def evaluate(self, expression: str) -> int | float:
        """The value of ``expression``.

        Raises:
            CalculatorError: a refused construct, a syntax error, a division by zero, a result that is
                not a finite real number or exceeds ``max_result_bits``.
        """
        if len(expression) > self.max_expression_chars:
            raise CalculatorError(
                f"the expression has {len(expression)} characters; the limit is {self.max_expression_chars}."
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            detail = "" if exc.msg == "invalid syntax" else f" ({exc.msg})"
            raise CalculatorError(f"invalid syntax{detail}; {_ALLOWED}.") from None
        except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
            raise CalculatorError(f"cannot parse the expression ({type(exc).__name__}); {_ALLOWED}.") from None
        try:
            return self._eval(tree.body)
        except ZeroDivisionError:
            raise CalculatorError("division by zero.") from None
        except OverflowError:
            raise CalculatorError("the result is too large.") from None
        except RecursionError:
            raise CalculatorError("the expression is nested too deeply.") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._checked(_UNARY[type(node.op)](self._eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._checked(_BINARY[type(node.op)](left, right))
        raise CalculatorError(f"{_describe(node)} is not allowed; {_ALLOWED}.")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        # |base| ** exponent has at least exponent * (bit_length - 1) bits: refuse before computing it.
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            if exponent * (abs(base).bit_length() - 1) > self.max_result_bits:
                raise CalculatorError(f"the result would exceed {self.max_result_bits} bits.")

    def _checked(self, value: Any) -> int | float:
        if isinstance(value, int):
            if value.bit_length() > self.max_result_bits:
                raise CalculatorError(f"the result would exceed {self.max_result_bits} bits.")
            return value
        if isinstance(value, float):
            if not math.isfinite(value):
                raise CalculatorError("the result is too large.")
            return value
        raise CalculatorError("the result is not a real number (e.g. a fractional power of a negative number).")

    def close(self) -> None:
        """Nothing to release: the calculator holds no processes or files."""
