"""The built-in tool task: multiplication the tiny model cannot do in its head, with a
calculator tool.

``calculator(expr)`` evaluates integer/decimal arithmetic (``+ - * / // % **``, parentheses,
unary signs) by walking Python's AST: no names, calls or attributes, and bounded powers, so it
cannot run arbitrary code. :func:`calculator_env` serves it as the tool ``calc`` through
:class:`~jaxrl_llm.envs.tools.ToolEnv`; its demonstration is one call with the prompt's
expression, the tool's answer, and that answer restated.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from jaxrl_llm.envs.base import Message
from jaxrl_llm.envs.tools import ToolEnv, format_tool_call
from jaxrl_llm.rewards.base import RewardInput

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_LENGTH = 200


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > _MAX_EXPONENT):
            raise ValueError(f"exponents must be integers of at most {_MAX_EXPONENT}")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expr: str) -> str:
    """The exact value of an arithmetic expression: ``"123*456"`` → ``"56088"``, ``"1/4"`` →
    ``"0.25"``, ``"1/3"`` → ``"1/3"`` (a fraction when no finite decimal is exact).

    Raises:
      ValueError: anything but numbers, ``+ - * / // % **`` and parentheses; a division by
        zero; an exponent over 64 or not an integer; more than 200 characters.
    """
    if not isinstance(expr, str) or len(expr) > _MAX_LENGTH:
        raise ValueError(f"expr must be a string of at most {_MAX_LENGTH} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from err
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for p in (2, 5):
        while denominator % p == 0:
            denominator //= p
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    places = 0
    while (value * 10**places).denominator != 1:
        places += 1
    return f"{float(value):.{places}f}"


def _expression(prompt: str) -> str:
    return prompt.strip().rstrip("=?").strip()


def calculator_demonstration(example: Any) -> list[Message]:
    """A good episode: call ``calc`` on the prompt's expression, then state its result."""
    expr = _expression(example.prompt)
    result = calculator(expr)
    return [
        {"role": "assistant", "content": format_tool_call("calc", {"expr": expr})},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def calculator_env(
    reward_fn: Callable[[RewardInput], float], *, timeout_s: float = 1.0, **kwargs: Any
) -> ToolEnv:
    """The arithmetic task with the tool ``calc(expr)`` (``calculator``); ``kwargs`` go to
    ``ToolEnv`` (``system_prompt``, ``max_calls_per_turn``)."""
    return ToolEnv(
        {"calc": calculator},
        reward_fn,
        timeout_s=timeout_s,
        demonstrate=calculator_demonstration,
        **kwargs,
    )
