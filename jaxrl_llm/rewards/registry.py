"""Rewards by name, so configs can list them: ``make_reward("format", tags=["think"])``."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from jaxrl_llm.rewards.base import RewardFn
from jaxrl_llm.rewards.format import FormatReward
from jaxrl_llm.rewards.length import OverlongPenalty
from jaxrl_llm.rewards.math import MathMatch

REWARDS: dict[str, Any] = {
    "math_match": MathMatch,
    "format": FormatReward,
    "overlong": OverlongPenalty,
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
      name: a key of ``REWARDS``.
      **kwargs: fields of that reward (e.g. ``max_length=..., buffer=...`` for ``overlong``).

    Returns:
      A reward function ``fn(RewardInput) -> float``.

    Raises:
      ValueError: on an unknown name (suggesting the nearest valid one) or unknown / missing
        settings (listing the valid ones).
    """
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
