"""pass@k, maj@k and mean@k over ``n`` sampled completions per problem, with bootstrap
confidence intervals over the problems.

* **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): the
  probability that at least one of ``k`` completions drawn without replacement from the ``n``
  sampled is correct, estimated without bias from ``c`` correct among ``n``:
  ``1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``
  (no large binomials). Drawing exactly ``k`` and reporting "any correct" is biased low for the
  same budget; this is the estimator Codex, DeepSeek and Qwen report.
* **mean@k**: the mean correctness of the first ``k`` completions (avg@k).
* **maj@k** (self-consistency, Wang et al. 2023): the most frequent final answer among the
  first ``k`` completions is correct; completions with no answer do not vote, ties go to the
  answer seen first, and a problem with no answer at all scores 0.

Every metric is a per-problem value; the reported figure is their mean, and
``bootstrap_interval`` resamples problems (not completions) for its interval.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


def _check_k(n: int, k: int) -> None:
    if not isinstance(k, int | np.integer) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} completions sampled per problem")


def pass_at_k(correct: Any, k: int) -> np.ndarray:
    """Unbiased pass@k of each problem.

    Args:
      correct: ``[P, n]`` bool (or 0/1): completion ``j`` of problem ``p`` is correct.
      k: completions per attempt, ``1 <= k <= n``.

    Returns:
      ``[P]`` float64 in ``[0, 1]``: ``1 - C(n - c_p, k) / C(n, k)``.

    Raises:
      ValueError: ``correct`` is not 2-D, or ``k`` is not in ``[1, n]``.
    """
    correct = _as_matrix(correct)
    n = correct.shape[1]
    _check_k(n, k)
    out = np.empty(correct.shape[0], np.float64)
    for p, c in enumerate(correct.sum(axis=1)):
        if n - c < k:
            out[p] = 1.0  # every k-subset holds a correct completion
        else:
            out[p] = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64))
    return out


def mean_at_k(correct: Any, k: int) -> np.ndarray:
    """``[P]`` mean correctness of each problem's first ``k`` completions."""
    correct = _as_matrix(correct)
    _check_k(correct.shape[1], k)
    return correct[:, :k].mean(axis=1, dtype=np.float64)


def majority_at_k(answers: Sequence[Sequence[Hashable | None]], correct: Any, k: int) -> np.ndarray:
    """``[P]`` 1.0 where the majority answer of the first ``k`` completions is correct.

    Args:
      answers: ``P`` rows of ``n`` normalised final answers (None: no answer, no vote).
      correct: ``[P, n]`` bool, the correctness of each completion (a completion whose answer
        equals the majority answer has the majority's correctness).
      k: completions voting, ``1 <= k <= n``.
    """
    correct = _as_matrix(correct)
    if len(answers) != correct.shape[0] or any(len(a) != correct.shape[1] for a in answers):
        raise ValueError(
            f"answers must be {correct.shape[0]} rows of {correct.shape[1]} (the shape of "
            f"correct), got {len(answers)} rows of lengths {sorted({len(a) for a in answers})}"
        )
    _check_k(correct.shape[1], k)
    out = np.zeros(correct.shape[0], np.float64)
    for p, row in enumerate(answers):
        votes: dict[Hashable, int] = {}
        first: dict[Hashable, int] = {}
        for j, answer in enumerate(row[:k]):
            if answer is None:
                continue
            votes[answer] = votes.get(answer, 0) + 1
            first.setdefault(answer, j)
        if votes:
            winner = max(votes, key=lambda a: (votes[a], -first[a]))
            out[p] = float(correct[p, first[winner]])
    return out


def bootstrap_interval(
    values: Any, *, confidence: float = 0.95, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(values)`` resampling the problems.

    ``resamples`` means of ``P`` problems drawn with replacement (NumPy ``default_rng(seed)``:
    reproducible); the interval is their ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
    quantiles.
    """
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {values.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(resamples, values.size))
    means = values[idx].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def summarize(
    correct: Any,
    *,
    ks: Sequence[int],
    answers: Sequence[Sequence[Hashable | None]] | None = None,
    confidence: float = 0.95,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """``pass@k``, ``mean@k`` (and ``maj@k`` with ``answers``) for each ``k``, each with its
    bootstrap interval as ``<name>_low`` / ``<name>_high``, plus ``problems`` and ``samples``."""
    correct = _as_matrix(correct)
    out: dict[str, float] = {"problems": correct.shape[0], "samples": correct.shape[1]}
    for k in ks:
        per_problem = {"pass": pass_at_k(correct, k), "mean": mean_at_k(correct, k)}
        if answers is not None:
            per_problem["maj"] = majority_at_k(answers, correct, k)
        for name, values in per_problem.items():
            key = f"{name}@{k}"
            out[key] = float(values.mean())
            out[f"{key}_low"], out[f"{key}_high"] = bootstrap_interval(
                values, confidence=confidence, resamples=resamples, seed=seed
            )
    return out


def _as_matrix(correct: Any) -> np.ndarray:
    correct = np.asarray(correct)
    if correct.ndim != 2 or correct.shape[1] == 0:
        raise ValueError(
            f"correct must be [problems, samples] with at least one sample, got shape "
            f"{correct.shape}"
        )
    if correct.dtype != bool and not np.isin(correct, (0, 1)).all():
        raise ValueError("correct must be bool or 0/1")
    return correct.astype(bool)
