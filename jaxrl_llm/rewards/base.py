"""The reward-function interface shared by every verifier and shaping term.

A reward function is any callable ``fn(inp: RewardInput) -> float``. One argument (instead of
``(prompt, completion, example, *, num_tokens)``) keeps every signature identical, so terms
combine and register uniformly, and lets new fields arrive without breaking existing rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class RewardInput(NamedTuple):
    """Everything a reward function may look at for one completion.

    Attributes:
      prompt: the prompt text the policy saw (after any chat template).
      completion: the decoded completion text (special tokens skipped).
      example: the dataset record (``jaxrl_llm.data.Example``, or a mapping with ``"answer"``).
      completion_tokens: number of completion tokens, EOS included (the mask sum); length
        shaping counts in tokens, not characters. ``None`` when unknown.
    """

    prompt: str
    completion: str
    example: Any = None
    completion_tokens: int | None = None


RewardFn = Callable[[RewardInput], float]


class RewardError(RuntimeError):
    """A reward function failed on one completion; the message shows that completion."""


def reference_answer(example: Any) -> str:
    """The reference answer of an ``Example`` (``.answer``) or a mapping (``["answer"]``).

    Raises:
      ValueError: if the example has no string answer.
    """
    if isinstance(example, Mapping):
        answer = example.get("answer")
    else:
        answer = getattr(example, "answer", None)
    if not isinstance(answer, str):
        raise ValueError(
            f"example must carry a string reference answer (.answer or ['answer']), got "
            f"{type(example).__name__} with answer {answer!r}"
        )
    return answer
