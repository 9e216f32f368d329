"""The environment protocol of multi-turn RL: ``reset(example) -> messages`` and
``step(episode, completion) -> StepResult``.

An episode starts from the messages ``reset`` returns (the prompt, as chat messages). Each
turn the policy writes one assistant message; the environment answers with ``step``: the
messages to append (tool results, feedback) or ``None``, a reward for that turn, and whether
the episode is over. The rollout loop (``envs.rollout``) works on token ids: the policy's own
sampled tokens are kept as they were drawn (never re-tokenised), the environment's messages are
rendered and tokenised once and appended with loss mask 0, and the episode's reward is the sum
of its turns' rewards (give every turn 0 but the last for a per-episode reward).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol, runtime_checkable

Message = dict[str, str]  # {"role": "user" | "assistant" | "tool" | "system", "content": str}


class StepResult(NamedTuple):
    """What the environment answers to one assistant turn.

    Attributes:
      messages: messages appended to the conversation before the policy's next turn (e.g.
        ``[{"role": "tool", "content": "56088"}]``); ``None`` or empty when there is nothing to
        say (then the episode must be ``done``).
      reward: this turn's reward; the episode's reward is the sum over its turns.
      done: the episode is over (the answer was given, or the environment stops it).
      info: anything to report (counted into the rollout's metrics when numeric).
    """

    messages: list[Message] | None
    reward: float
    done: bool
    info: dict[str, Any] = {}


@dataclasses.dataclass
class Episode:
    """One episode's state, owned by the rollout loop and handed to ``Environment.step``.

    Attributes:
      example: the dataset record the episode started from (``data.Example``).
      messages: the conversation so far (``reset``'s messages, then alternating assistant
        turns and the environment's messages), as text.
      turn: the number of assistant turns taken (1 during the first ``step``).
      rewards: the rewards of the turns so far.
      data: scratch space for the environment (e.g. how many tool calls it served).
    """

    example: Any
    messages: list[Message]
    turn: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def final_text(self) -> str:
        """The last assistant message (what accuracy is checked on), or ``""``."""
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return message["content"]
        return ""


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task. ``reset`` and ``step`` run on the host, one episode at a time."""

    def reset(self, example: Any) -> list[Message]:
        """The opening messages of an episode on ``example`` (at least one user message)."""
        ...

    def step(self, episode: Episode, completion: str) -> StepResult:
        """The environment's answer to the assistant's latest turn ``completion`` (its decoded
        text; ``episode.messages`` already ends with it)."""
        ...

    def demonstration(self, example: Any) -> list[Message]:
        """The assistant and environment messages of a good episode on ``example`` (after
        ``reset``'s), for the SFT warm-up; environments without demonstrations raise
        ``NotImplementedError``."""
        ...


def check_messages(messages: Any, where: str) -> list[Message]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with string values.

    Raises:
      ValueError: naming ``where`` and the first malformed message.
    """
    if not isinstance(messages, list | tuple):
        raise ValueError(f"{where} must return a list of messages, got {type(messages).__name__}")
    for message in messages:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: every message needs string 'role' and 'content', got {message!r}"
            )
    return list(messages)
