"""pass@k, maj@k and mean@k of a policy on a run's held-out prompts, sampled through the run's
own sampler (``train.rl.context.RunContext``): shared by ``jaxrl-llm eval`` and the trainer's
``trainer.eval_k``.

Every prompt is sampled ``samples`` times at ``temperature``; a completion is correct by the
task's own check (``Samples.correct``), and its answer for maj@k is the final answer written
in it (``rewards.math.extract_answer``, compared by value: ``0.5`` and ``\\frac{1}{2}`` vote
together). Intervals are percentile bootstraps over the prompts (``estimators.summarize``).

The prompts are drawn ``batch_prompts`` at a time (what the sampler is known to hold: the
caller passes a rollout batch's worth), each batch with its own key folded from the seed (one
batch: the seed's key itself), under a progress bar with the time left when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm.evaluation.estimators import summarize


def final_answer(text: str) -> Any:
    """The comparable final answer of a completion (a ``Fraction`` or normalised text), or
    ``None`` when it states none: what maj@k votes with."""
    from jaxrl_llm.rewards.math import answer_value, extract_answer  # noqa: PLC0415

    found = extract_answer(text)
    return None if found is None else answer_value(found)


def sampled_report(
    context,
    params,
    examples: Sequence[Any],
    *,
    k: int,
    samples: int,
    temperature: float,
    seed: int = 0,
    resamples: int = 1000,
    mesh=None,
    batch_prompts: int | None = None,
    progress: bool = False,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``(summary, per_prompt)``: ``samples`` completions of each example at ``temperature``.

    Args:
      context: the run's ``RunContext`` (prompt formatting, sampler, reward, stop tokens).
      params: the policy parameters (on ``mesh``).
      examples: the prompts to evaluate (``data.Example``).
      k: the largest k reported; the summary holds ``pass@k``, ``mean@k``, ``maj@k`` for
        ``k`` in ``{1, k}``, each with ``_low`` / ``_high`` interval bounds, plus ``problems``
        and ``samples``.
      samples: completions a prompt (``>= k``; more samples lower the estimators' variance).
      temperature: sampling temperature (0: greedy, every sample of a prompt the same).
      seed: the sampling key and the bootstrap's seed.
      resamples: bootstrap resamples.
      mesh: the mesh ``params`` live on (default: the run's).
      batch_prompts: prompts drawn at a time (None: all at once); a multiple of the mesh's
        batch shards, as the sampler requires.
      progress: draw a progress bar over the prompts on stderr (when it is a terminal).

    Returns:
      The summary, and per prompt ``{prompt, correct, samples, answers}``.

    Raises:
      ValueError: ``samples < k``, ``k < 1``, ``batch_prompts < 1``, or no examples.
    """
    if k < 1 or samples < k:
        raise ValueError(f"need 1 <= k <= samples, got k={k}, samples={samples}")
    if not examples:
        raise ValueError("no prompts to evaluate")
    examples = list(examples)
    size = len(examples) if batch_prompts is None else batch_prompts
    if size < 1:
        raise ValueError(f"batch_prompts must be at least 1, got {batch_prompts}")
    starts = range(0, len(examples), size)
    key = jax.random.key(seed)
    correct, completions = [], []
    with _bar(len(examples), progress) as bar:
        for i, start in enumerate(starts):
            part = examples[start : start + size]
            drawn = context.sample(
                params,
                part,
                key if len(starts) == 1 else jax.random.fold_in(key, i),
                temperature=temperature,
                group_size=samples,
                mesh=mesh,
            )
            correct.append(np.asarray(drawn.correct, bool).reshape(len(part), samples))
            completions.extend(drawn.completions)
            bar.update(len(part))
    correct = np.concatenate(correct)
    answers = [
        [final_answer(completions[p * samples + j]) for j in range(samples)]
        for p in range(len(examples))
    ]
    summary = summarize(correct, ks=sorted({1, k}), answers=answers, resamples=resamples, seed=seed)
    summary |= {"temperature": temperature, "k": k}
    per_prompt = [
        {
            "prompt": examples[p].prompt,
            "correct": int(correct[p].sum()),
            "samples": samples,
            "answers": [None if a is None else str(a) for a in answers[p]],
        }
        for p in range(len(examples))
    ]
    return summary, per_prompt


def _bar(prompts: int, progress: bool):
    """A tqdm bar over the prompts drawn (rate and time left), erased when done; nothing
    unless ``progress`` and stderr is a terminal (tqdm's ``disable=None``)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(
        total=prompts,
        desc="evaluating",
        unit="prompt",
        disable=None if progress else True,
        leave=False,
        dynamic_ncols=True,
    )


__all__ = ["final_answer", "sampled_report"]
