"""Length shaping: DAPO's soft overlong punishment, counted in completion tokens."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jaxrl_llm.rewards.base import RewardInput


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_lengths(max_tokens, buffer_tokens) -> None:
    _check_count("max_tokens", max_tokens, 1)
    _check_count("buffer_tokens", buffer_tokens, 0)
    if buffer_tokens > max_tokens:
        raise ValueError(
            f"buffer_tokens ({buffer_tokens}) must not exceed max_tokens ({max_tokens})"
        )


def overlong_penalty(num_tokens: int, *, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO soft overlong punishment of a completion of ``|y|`` tokens.

    ``R(y) = 0`` if ``|y| <= L_max - L_cache``;
    ``R(y) = ((L_max - L_cache) - |y|) / L_cache`` if ``L_max - L_cache < |y| <= L_max``;
    ``R(y) = -1`` if ``|y| > L_max``
    (Yu et al., 2025, "DAPO", eq. 13). The penalty falls linearly from 0 to -1 across the
    buffer, reaching -1 at ``|y| = L_max``; ``L_cache = 0`` is a hard cut beyond ``L_max``.

    Args:
      num_tokens: ``|y|``, completion tokens (EOS included).
      max_tokens: ``L_max``.
      buffer_tokens: ``L_cache``, the soft-penalty zone before ``L_max``,
        ``0 <= L_cache <= L_max``.

    Returns:
      The penalty in ``[-1, 0]``.

    Raises:
      ValueError: on a negative token count or inconsistent lengths.
    """
    _check_lengths(max_tokens, buffer_tokens)
    num_tokens = _check_count("num_tokens", num_tokens, 0)
    if num_tokens > max_tokens:
        return -1.0
    over = num_tokens - (max_tokens - buffer_tokens)
    # over > 0 implies buffer_tokens > 0, so the division is safe.
    return 0.0 if over <= 0 else -over / buffer_tokens


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """``overlong_penalty(inp.completion_tokens, max_tokens=..., buffer_tokens=...)`` as a reward.

    Attributes:
      max_tokens: ``L_max`` in tokens (usually the sampler's ``max_new_tokens``).
      buffer_tokens: ``L_cache`` in tokens.
    """

    name: ClassVar[str] = "overlong"
    max_tokens: int
    buffer_tokens: int

    def __post_init__(self):
        _check_lengths(self.max_tokens, self.buffer_tokens)

    def __call__(self, inp: RewardInput) -> float:
        if inp.completion_tokens is None:
            raise ValueError("the overlong penalty needs RewardInput.completion_tokens")
        return overlong_penalty(
            inp.completion_tokens, max_tokens=self.max_tokens, buffer_tokens=self.buffer_tokens
        )
