"""Rewards by name, so configs can list them: ``make_reward("format", tags=["think"])``.

Besides the registered names, a config may name any importable function as
``"package.module:function"`` (verl's ``custom_reward_function``): either a plain
``fn(prompt, completion, example, **kwargs) -> float`` or a ``fn(inp: RewardInput) -> float``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from jaxrl_llm import user_code
from jaxrl_llm.rewards.base import RewardFn, RewardInput
from jaxrl_llm.rewards.code import CodeExec
from jaxrl_llm.rewards.format import FormatReward
from jaxrl_llm.rewards.length import OverlongPenalty
from jaxrl_llm.rewards.math import MathMatch

REWARDS: dict[str, Any] = {
    "math_match": MathMatch,
    "format": FormatReward,
    "overlong": OverlongPenalty,
    "code_exec": CodeExec,
}


def _nearest(name: str, choices: list[str]) -> str | None:
    """A name the user probably meant: one containing ``name``, else the closest spelling."""
    containing = [c for c in choices if name and name in c]
    if containing:
        return containing[0]
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.0)
    return close[0] if close else None


def make_reward(name: str, **kwargs: Any) -> RewardFn:
    """Builds the reward registered as ``name`` with the given settings.

    Args:
      name: a key of ``REWARDS``, or ``"package.module:function"`` naming a user function.
      **kwargs: fields of that reward (e.g. ``max_length=..., buffer=...`` for ``overlong``);
        for a user function, keyword arguments bound to it.

    Returns:
      A reward function ``fn(RewardInput) -> float``.

    Raises:
      ValueError: on an unknown name (suggesting the nearest valid one), unknown / missing
        settings (listing the valid ones), or a user function that cannot be imported or
        takes neither ``(inp)`` nor ``(prompt, completion, example)``.
    """
    if isinstance(name, str) and ":" in name:
        return _import_reward(name, kwargs)
    if name not in REWARDS:
        close = _nearest(str(name), sorted(REWARDS))
        hint = f"; did you mean {close!r}?" if close else ""
        raise ValueError(f"unknown reward {name!r}{hint} (available: {sorted(REWARDS)})")
    factory = REWARDS[name]
    try:
        return factory(**kwargs)
    except TypeError as err:
        fields = (
            [f.name for f in dataclasses.fields(factory)]
            if dataclasses.is_dataclass(factory)
            else []
        )
        raise ValueError(f"bad settings for reward {name!r}: {err} (fields: {fields})") from err


class _UserReward:
    """A user function reported under its config name: ``fn(inp: RewardInput)``, or with
    ``plain`` a ``fn(prompt, completion, example)`` adapted to the ``RewardInput`` interface."""

    def __init__(self, name: str, fn: Callable[..., float], *, plain: bool):
        self.name, self.fn, self.plain = name, fn, plain

    def __call__(self, inp: RewardInput) -> float:
        return self.fn(inp.prompt, inp.completion, inp.example) if self.plain else self.fn(inp)

    def __repr__(self) -> str:
        return f"reward {self.name!r}"


def _import_reward(name: str, kwargs: dict[str, Any]) -> RewardFn:
    fn = user_code.import_object(name, f"reward {name!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable: {fn!r}")
    if kwargs:
        fn = functools.partial(fn, **kwargs)
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):  # a builtin without a signature: assume RewardInput
        params = [None]
    if len(params) in (1, 3):
        return _UserReward(name, fn, plain=len(params) == 3)
    raise ValueError(
        f"reward {name!r} must take (prompt, completion, example) or one RewardInput, "
        f"not {len(params)} required positional arguments"
    )
