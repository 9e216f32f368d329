"""The built-in tool task: multiplication the tiny model cannot do in its head, with a
calculator tool.

``calculator(expr)`` evaluates integer/decimal arithmetic (``+ - * / // % **``, parentheses,
unary signs) by walking Python's AST: no names, calls or attributes, and bounded powers, so it
cannot run arbitrary code. :func:`calculator_env` serves it as the tool ``calc`` through
:class:`~jaxrl_llm.envs.tools.ToolEnv`; its demonstration is one call with the prompt's
expression, the tool's answer, and that answer restated.

With ``direct_rate`` > 0 the demonstrations come from a teacher who can multiply in its head:
it answers that share of the problems at once, the right product without calling the tool
(``direct_demonstration``; a fresh draw at each demonstration, from the environment's own
seeded stream). The student cannot multiply in its head, so imitating those answers fails:
the SFT warm-up leaves a policy whose greedy first move is to answer directly (wrong), while
tool calls stay among its samples, and RL on the task's reward teaches it to reach for the
tool (``configs/tool_calculator.yaml``).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

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


def direct_demonstration(example: Any) -> list[Message]:
    """A teacher's episode without the tool: the prompt's value stated at once."""
    return [{"role": "assistant", "content": calculator(_expression(example.prompt))}]


def check_direct_rate(direct_rate: Any) -> float:
    """``direct_rate`` as a float in [0, 1].

    Raises:
      ValueError: anything else.
    """
    if isinstance(direct_rate, bool) or not isinstance(direct_rate, int | float | np.floating):
        raise ValueError(f"env.kwargs.direct_rate must be a number in [0, 1], got {direct_rate!r}")
    if not 0.0 <= direct_rate <= 1.0:
        raise ValueError(f"env.kwargs.direct_rate must be a number in [0, 1], got {direct_rate!r}")
    return float(direct_rate)


def mixed_demonstrations(direct_rate: float, seed: int = 0) -> Callable[[Any], list[Message]]:
    """``demonstrate(example)``: ``direct_demonstration`` with probability ``direct_rate``,
    else ``calculator_demonstration``; each call one draw of a stream seeded by ``seed``.

    Raises:
      ValueError: ``direct_rate`` outside [0, 1] (``check_direct_rate``) or a ``seed`` that is
        not a non-negative int.
    """
    direct_rate = check_direct_rate(direct_rate)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"env.kwargs.demo_seed must be a non-negative int, got {seed!r}")
    if direct_rate == 0.0:
        return calculator_demonstration
    rng = np.random.default_rng([seed, 15])

    def demonstrate(example: Any) -> list[Message]:
        if rng.random() < direct_rate:
            return direct_demonstration(example)
        return calculator_demonstration(example)

    return demonstrate


def calculator_env(
    reward_fn: Callable[[RewardInput], float],
    *,
    timeout_s: float = 1.0,
    direct_rate: float = 0.0,
    demo_seed: int = 0,
    **kwargs: Any,
) -> ToolEnv:
    """The arithmetic task with the tool ``calc(expr)`` (``calculator``); ``kwargs`` go to
    ``ToolEnv`` (``system_prompt``, ``max_calls_per_turn``).

    ``direct_rate``: the share of the warm-up's demonstrations answered without the tool
    (``mixed_demonstrations``, drawn from a stream seeded by ``demo_seed``); 0 = every
    demonstration calls the tool.

    Raises:
      ValueError: a ``direct_rate`` outside [0, 1] or a bad ``demo_seed``.
    """
    return ToolEnv(
        {"calc": calculator},
        reward_fn,
        timeout_s=timeout_s,
        demonstrate=mixed_demonstrations(direct_rate, demo_seed),
        **kwargs,
    )
