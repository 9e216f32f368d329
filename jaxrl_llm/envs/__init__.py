"""Multi-turn environments: the protocol (``base``), tool calling in the Hermes format
(``tools``), the built-in calculator task (``calculator``) and the token-in, token-out rollout
loop (``rollout``).

``make_env(name, reward_fn, **kwargs)`` builds the environment a config names: a key of
``ENVIRONMENTS`` or ``"package.module:factory"`` for your own ``factory(reward_fn=...,
**kwargs) -> Environment``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl_llm import user_code
from jaxrl_llm.envs.base import Environment, Episode, Message, StepResult, check_messages
from jaxrl_llm.envs.calculator import calculator, calculator_demonstration, calculator_env
from jaxrl_llm.envs.rollout import EpisodeLimits, Renderer, left_pad, run_episodes
from jaxrl_llm.envs.tools import ToolCall, ToolEnv, format_tool_call, parse_tool_calls, run_tool

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"calculator": calculator_env}


def make_env(name: str, reward_fn: Callable, **kwargs: Any) -> Environment:
    """The environment registered as ``name`` (or ``"package.module:factory"``), built with
    the task's ``reward_fn`` and ``kwargs``.

    Raises:
      ValueError: an unknown name (listing the registered ones), a factory that cannot be
        imported, bad settings, or a result that is not an ``Environment``.
    """
    if ":" in name:
        factory = user_code.import_object(name, f"env.name {name!r}")
    elif name in ENVIRONMENTS:
        factory = ENVIRONMENTS[name]
    else:
        raise ValueError(
            f"unknown environment {name!r} (available: {sorted(ENVIRONMENTS)}, or "
            "'package.module:factory')"
        )
    try:
        env = factory(reward_fn=reward_fn, **kwargs)
    except TypeError as err:
        raise ValueError(f"bad settings for environment {name!r}: {err}") from err
    if not isinstance(env, Environment):
        raise ValueError(f"environment {name!r} lacks reset / step / demonstration: {env!r}")
    return env


__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "Message",
    "Renderer",
    "StepResult",
    "ToolCall",
    "ToolEnv",
    "calculator",
    "calculator_demonstration",
    "calculator_env",
    "check_messages",
    "format_tool_call",
    "left_pad",
    "make_env",
    "parse_tool_calls",
    "run_episodes",
    "run_tool",
]
