"""Weighted sums of reward functions and batch scoring with per-component values.

``compute_rewards`` is the one place rewards become an array: always ``float32`` (a reward
scattered into an integer array would silently truncate 0.5 to 0), and a reward function that
raises is reported with the completion that broke it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from jaxrl_llm.rewards.base import RewardError, RewardFn, RewardInput

_MAX_REPR = 500


class WeightedReward(NamedTuple):
    """One term of a combined reward: ``weight * fn(inp)``, reported under ``name``."""

    name: str
    fn: RewardFn
    weight: float


def reward_name(fn: RewardFn) -> str:
    """The name a reward is reported under: its ``name`` attribute, else its ``__name__``."""
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(fn, "__name__", type(fn).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) <= _MAX_REPR:
        return text
    return f"{text[:_MAX_REPR]}... ({len(text)} characters)"


def call_reward(
    fn: RewardFn, inp: RewardInput, *, name: str | None = None, row: int | None = None
) -> float:
    """``float(fn(inp))``, checked to be a finite real number.

    Raises:
      RewardError: chained to the original exception, naming the reward and showing the
        prompt, completion, example and token count it failed on; also when ``fn`` returns
        something that is not a finite real number.
    """
    name = reward_name(fn) if name is None else name
    where = f"reward {name!r}" + ("" if row is None else f" on row {row}")
    try:
        value = fn(inp)
    except RewardError:
        raise  # a nested combined reward already said which input broke it
    except Exception as err:
        raise RewardError(f"{where} raised {type(err).__name__}: {err}\n{_describe(inp)}") from err
    if not isinstance(value, numbers.Real | np.bool_) or not math.isfinite(float(value)):
        raise RewardError(
            f"{where} returned {value!r}, expected a finite real number\n{_describe(inp)}"
        )
    return float(value)


def _describe(inp: RewardInput) -> str:
    return (
        f"  prompt: {_short(inp.prompt)}\n  completion: {_short(inp.completion)}\n"
        f"  example: {_short(inp.example)}\n  completion_tokens: {inp.completion_tokens!r}"
    )


@dataclasses.dataclass(frozen=True)
class CombinedReward:
    """``r = Σ_k w_k · r_k(inp)``: a weighted sum of reward functions, itself a reward function.

    Attributes:
      terms: the ``WeightedReward`` terms, with distinct names.
    """

    name: ClassVar[str] = "combined"
    terms: tuple[WeightedReward, ...]

    def components(self, inp: RewardInput, *, row: int | None = None) -> dict[str, float]:
        """Each term's unweighted value on ``inp``."""
        return {t.name: call_reward(t.fn, inp, name=t.name, row=row) for t in self.terms}

    def total(self, components: dict[str, float]) -> float:
        """``Σ_k w_k · components[name_k]``."""
        return math.fsum(t.weight * components[t.name] for t in self.terms)

    def __call__(self, inp: RewardInput) -> float:
        return self.total(self.components(inp))


def _as_term(item: Any, position: int) -> WeightedReward:
    if isinstance(item, WeightedReward):
        name, fn, weight = item
    elif isinstance(item, tuple | list) and len(item) == 2:
        (fn, weight), name = item, None
    elif isinstance(item, tuple | list) and len(item) == 3:
        name, fn, weight = item
    else:
        raise ValueError(
            f"reward term {position} must be (fn, weight) or (name, fn, weight), got {item!r}"
        )
    if not callable(fn):
        raise ValueError(f"reward term {position}: {fn!r} is not callable")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, numbers.Real)
        or not math.isfinite(weight)
    ):
        raise ValueError(f"reward term {position}: weight must be a finite number, got {weight!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"reward term {position}: name must be a non-empty str, got {name!r}")
    return WeightedReward(name, fn, float(weight))


def combine_rewards(terms: Sequence[Any]) -> CombinedReward:
    """Combines reward functions into ``r = Σ_k w_k · r_k``.

    Args:
      terms: ``(fn, weight)`` or ``(name, fn, weight)`` items (or ``WeightedReward``). Unnamed
        terms are reported under ``reward_name(fn)``, suffixed ``_2``, ``_3``, ... when that
        name is taken. A weight of 0 keeps a term as a logged metric only.

    Returns:
      A ``CombinedReward``: call it on a ``RewardInput``, or pass it to ``compute_rewards``
      to get every component too.

    Raises:
      ValueError: on no terms, a non-callable, a non-finite weight or repeated explicit names.
    """
    parsed = [_as_term(item, i) for i, item in enumerate(terms)]
    if not parsed:
        raise ValueError("combine_rewards needs at least one (fn, weight) term")
    explicit = [t.name for t in parsed if t.name is not None]
    repeated = sorted({n for n in explicit if explicit.count(n) > 1})
    if repeated:
        raise ValueError(f"reward term names must be distinct, repeated: {repeated}")
    named, taken = [], set(explicit)
    for term in parsed:
        name = term.name
        if name is None:
            base = reward_name(term.fn)
            name, suffix = base, 2
            while name in taken:
                name, suffix = f"{base}_{suffix}", suffix + 1
            taken.add(name)
        named.append(term._replace(name=name))
    return CombinedReward(tuple(named))


def compute_rewards(
    reward_fn: RewardFn, inputs: Sequence[RewardInput]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Scores a batch of completions.

    Args:
      reward_fn: a reward function; a ``CombinedReward`` has each term evaluated once and
        reported separately.
      inputs: ``B`` ``RewardInput`` rows.

    Returns:
      ``(rewards, components)``: ``rewards`` is ``[B]`` float32; ``components`` maps each
      term name (for a plain function, its ``reward_name``) to its unweighted ``[B]`` float32
      values. Totals are summed in float64 before the cast.

    Raises:
      ValueError: if an input is not a ``RewardInput``.
      RewardError: if a reward function fails (see ``call_reward``).
    """
    for row, inp in enumerate(inputs):
        if not isinstance(inp, RewardInput):
            raise ValueError(f"inputs[{row}] must be a RewardInput, got {type(inp).__name__}")
    if isinstance(reward_fn, CombinedReward):
        rows = [reward_fn.components(inp, row=row) for row, inp in enumerate(inputs)]
        totals = [reward_fn.total(values) for values in rows]
        names = [t.name for t in reward_fn.terms]
    else:
        name = reward_name(reward_fn)
        totals = [call_reward(reward_fn, inp, name=name, row=r) for r, inp in enumerate(inputs)]
        rows, names = [{name: value} for value in totals], [name]
    components = {n: np.array([values[n] for values in rows], np.float32) for n in names}
    return np.array(totals, np.float64).astype(np.float32), components


def summarize_rewards(
    rewards: np.ndarray, components: dict[str, np.ndarray], *, prefix: str = "reward"
) -> dict[str, float]:
    """Scalar metrics: ``{prefix}/mean``, ``{prefix}/std`` and ``{prefix}/{name}`` means.

    An empty batch gives NaN means (there is nothing to average), never an error.
    """
    rewards = np.asarray(rewards, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        metrics = {
            f"{prefix}/mean": float(np.mean(rewards)) if rewards.size else math.nan,
            f"{prefix}/std": float(np.std(rewards)) if rewards.size else math.nan,
        }
        for name, values in components.items():
            values = np.asarray(values, np.float64)
            metrics[f"{prefix}/{name}"] = float(np.mean(values)) if values.size else math.nan
    return metrics
