"""Drawing the SFT warm-up's demonstration of an example among its alternatives.

An example may hold several demonstrations with their probabilities (``extra["demonstrations"]``
and ``extra["demonstration_weights"]``, e.g. a teacher who slips on some share of its worked
answers, ``data.carry_slips``): the warm-up draws one afresh each time it draws the example, so
the student learns the teacher's distribution of answers rather than one frozen draw per prompt.
Any other example has its one demonstration (``data.demonstration``).
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl_llm.data.arithmetic import demonstration
from jaxrl_llm.data.datasets import Example


def demonstration_choices(example: Example) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
    """``(texts, probabilities)`` of an example's alternative demonstrations, or None when it
    has one (no ``extra["demonstrations"]``).

    Raises:
      ValueError: ``demonstrations`` not a non-empty sequence of non-empty strings, or
        ``demonstration_weights`` missing, of another length, negative, or not summing to 1.
    """
    texts = example.extra.get("demonstrations")
    if texts is None:
        return None
    where = f"example {example.prompt!r}"
    if (
        isinstance(texts, str)
        or not isinstance(texts, list | tuple)
        or not texts
        or not all(isinstance(t, str) and t for t in texts)
    ):
        raise ValueError(f"{where}: demonstrations must be non-empty strings, got {texts!r}")
    weights = example.extra.get("demonstration_weights")
    if not isinstance(weights, list | tuple) or len(weights) != len(texts):
        raise ValueError(
            f"{where}: demonstration_weights must be {len(texts)} probabilities, got {weights!r}"
        )
    if not all(
        isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 for w in weights
    ) or not math.isclose(sum(weights), 1.0, abs_tol=1e-9):
        raise ValueError(
            f"{where}: demonstration_weights must be non-negative and sum to 1, got {weights!r}"
        )
    return tuple(texts), tuple(float(w) for w in weights)


def draw_demonstration(example: Example, rng: np.random.Generator) -> str:
    """One demonstration of ``example``: text ``i`` of ``extra["demonstrations"]`` with
    probability ``extra["demonstration_weights"][i]`` (one ``rng.random()`` per call), or its
    one demonstration (``data.demonstration``; ``rng`` untouched) when it has no alternatives.

    Raises:
      ValueError: malformed alternatives (``demonstration_choices``) or no usable demonstration.
    """
    choices = demonstration_choices(example)
    if choices is None:
        return demonstration(example)
    texts, weights = choices
    u = rng.random()
    cumulative = np.cumsum(weights)
    return texts[min(int(np.searchsorted(cumulative, u, side="right")), len(texts) - 1)]
