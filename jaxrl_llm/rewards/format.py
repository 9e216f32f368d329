"""Format reward: the completion follows a tag layout, ``<think>…</think><answer>…</answer>``."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import ClassVar

from jaxrl_llm.rewards.base import RewardInput

_TAG_NAME = re.compile(r"[A-Za-z_][\w:.-]*")


def _check_tags(tags: Sequence[str]) -> tuple[str, ...]:
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    if not tags:
        raise ValueError("format reward needs at least one tag")
    bad = [t for t in tags if not isinstance(t, str) or not _TAG_NAME.fullmatch(t)]
    if bad:
        raise ValueError(f"tag names must look like XML names (e.g. 'think'), got {bad!r}")
    if len(set(tags)) != len(tags):
        raise ValueError(f"tags must be distinct, got {tags!r}")
    return tags


@functools.lru_cache(maxsize=64)
def _layout(tags: tuple[str, ...]) -> re.Pattern:
    # Content may not open or close any configured tag, so repeated or nested blocks fail
    # instead of being swallowed by a lazy `.*?` stretched to the end of the text.
    any_tag = "|".join(re.escape(t) for t in tags)
    content = rf"(?:(?!</?(?:{any_tag})>).)*"
    blocks = r"\s*".join(rf"<{re.escape(t)}>{content}</{re.escape(t)}>" for t in tags)
    return re.compile(rf"\s*{blocks}\s*", re.DOTALL)


def matches_format(text: str, tags: Sequence[str] = ("think", "answer")) -> bool:
    """Whether ``text`` is exactly the tag blocks in order: ``<think>…</think><answer>…</answer>``.

    Only whitespace may surround or separate the blocks; each tag appears once, is closed, and
    no block contains another configured tag. Block contents may be empty.

    Raises:
      ValueError: on an empty, repeated or malformed tag name.
    """
    return _layout(_check_tags(tags)).fullmatch(text) is not None


@dataclasses.dataclass(frozen=True)
class FormatReward:
    """``r = reward`` if the completion matches the tag layout, else ``penalty``.

    The format reward of DeepSeek-R1 (DeepSeek-AI, 2025): the reasoning goes in ``<think>``
    and the final answer in ``<answer>``; see ``matches_format`` for the exact rule.

    Attributes:
      tags: tag names, in the order their blocks must appear.
      reward: reward of a well-formatted completion.
      penalty: reward of any other completion.
    """

    name: ClassVar[str] = "format"
    tags: tuple[str, ...] = ("think", "answer")
    reward: float = 1.0
    penalty: float = 0.0

    def __post_init__(self):
        # Configs give lists; a tuple keeps the instance hashable and the layout cacheable.
        object.__setattr__(self, "tags", _check_tags(self.tags))

    def __call__(self, inp: RewardInput) -> float:
        ok = _layout(self.tags).fullmatch(inp.completion) is not None
        return float(self.reward if ok else self.penalty)
