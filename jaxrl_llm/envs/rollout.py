"""Multi-turn rollouts, token in, token out: episodes of an ``Environment`` sampled in turns.

Every turn samples one assistant message for each unfinished episode, batched: the episode's
context so far (opening prompt, its own sampled tokens, the environment's tokens) is the
prompt of one row of ``sampling.generate`` (all rows in one program, finished episodes padded
with a copy, so each turn's shape is the same). The sampled ids are kept as drawn; only the
environment's messages are rendered and tokenised (:class:`Renderer`), once. The result is a
``Samples`` whose completion is the whole episode after the opening prompt: ``completion_mask``
covers every token the model attends to, ``loss_mask`` only the sampled ones (the environment's
tokens get loss mask 0), and ``logprobs`` are the sampler's (0 on environment tokens).

Budgets: ``max_turns`` assistant turns and ``max_tokens`` completion tokens an episode
(sampled and environment tokens together: the training sequence length), and at most
``max_turn_tokens`` a turn (a turn cut there still goes to the environment, which answers what
it got). An episode ends when the environment says ``done``, after its last turn, or when the
environment's answer would leave no room for another turn (its tokens are then not appended);
its reward is the sum of its turns' rewards, and it counts as ``finished`` only when the
environment ended it after a turn that ended with EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm import sampling
from jaxrl_llm.envs.base import Environment, Episode, Message, check_messages
from jaxrl_llm.parallel import fetch

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class Renderer:
    """Messages → token ids, with the tokenizer's chat template or as plain text.

    With ``chat_template``: the opening is the template with the generation prompt; the
    environment's messages after an assistant turn are the template's text for them (and the
    next generation prompt), found as the difference between rendering a fixed conversation
    with and without them (what verl's multi-turn rollout does). Without: the opening is the
    user message's text (``add_special_tokens`` as single-turn prompts), a ``tool`` message is
    ``<tool_response>{content}</tool_response>`` and any other message its content.
    An assistant message is its content's tokens and the first stop id (EOS).
    """

    def __init__(self, tokenizer: Any, *, chat_template: bool, eos_id: int):
        self.tokenizer, self.chat_template, self.eos_id = tokenizer, chat_template, eos_id

    def _ids(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def opening(self, messages: list[Message]) -> tuple[str, list[int]]:
        """``(text, ids)`` of an episode's opening messages, ending where the policy writes."""
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return text, self._ids(text)
        text = "".join(m["content"] for m in messages if m["role"] != "system")
        return text, self._ids(text, special=True)

    def environment(self, messages: list[Message]) -> list[int]:
        """The ids of the environment's messages after an assistant turn."""
        if self.chat_template:
            render = self.tokenizer.apply_chat_template
            before = render(_BASE, tokenize=False)
            after = render([*_BASE, *messages], tokenize=False, add_generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat template renders a conversation's prefix differently")
            return self._ids(after[len(before) :])
        return self._ids(
            "".join(
                f"<tool_response>{m['content']}</tool_response>"
                if m["role"] == "tool"
                else m["content"]
                for m in messages
            )
        )

    def assistant(self, content: str) -> list[int]:
        return [*self._ids(content), self.eos_id]

    def episode(self, messages: list[Message]) -> tuple[list[int], list[bool]]:
        """``(ids, trained)`` of messages after the opening (a demonstration): assistant
        messages trained, runs of environment messages not."""
        ids: list[int] = []
        trained: list[bool] = []
        pending: list[Message] = []
        for message in [*messages, None]:
            if message is not None and message["role"] != "assistant":
                pending.append(message)
                continue
            if pending:
                env_ids = self.environment(pending)
                ids, trained, pending = ids + env_ids, trained + [False] * len(env_ids), []
            if message is not None:
                own = self.assistant(message["content"])
                ids, trained = ids + own, trained + [True] * len(own)
        return ids, trained


def left_pad(rows: Sequence[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """``[N, max len]`` int32 ids left-padded with ``pad``, and their bool mask."""
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        tokens[i, width - len(row) :], mask[i, width - len(row) :] = row, True
    return tokens, mask


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """An episode's budgets (see module).

    Attributes:
      max_turns: assistant turns an episode.
      max_tokens: completion tokens an episode (the sampled and the environment's), T.
      max_turn_tokens: sampled tokens a turn (None: what is left of ``max_tokens``).
    """

    max_turns: int
    max_tokens: int
    max_turn_tokens: int | None = None


def run_episodes(
    params: Any,
    model_config: Any,
    renderer: Renderer,
    env: Environment,
    examples: Sequence[Any],
    *,
    key: jax.Array,
    group_size: int,
    limits: EpisodeLimits,
    stop_ids: Sequence[int],
    pad_id: int,
    mesh: Any = None,
    **sampling_options: Any,
) -> dict[str, Any]:
    """``group_size`` episodes of ``env`` per example (see module).

    Returns:
      A dict with ``prompts`` / ``prompt_ids`` (the openings, per episode), ``tokens``,
      ``mask`` (attended), ``loss_mask`` (sampled), ``logprobs`` (``[E, max_tokens]``),
      ``rewards`` (``[E]``, summed over turns), ``finished`` (ended by the environment after
      an EOS), ``turns``, ``episodes`` (the ``Episode`` objects) and ``info`` (per-episode
      sums of the environment's numeric info).

    Raises:
      ValueError: ``reset`` / ``step`` returning malformed messages, or an episode not done
        that has nothing to append.
    """
    max_turns, max_tokens = limits.max_turns, limits.max_tokens
    max_turn_tokens = limits.max_turn_tokens
    eos = tuple(stop_ids)
    episodes, prompts, prompt_ids = [], [], []
    for example in examples:
        opening = check_messages(env.reset(example), "Environment.reset")
        text, ids = renderer.opening(opening)
        for _ in range(group_size):
            episodes.append(Episode(example, [dict(m) for m in opening]))
            prompts.append(text)
            prompt_ids.append(ids)
    count = len(episodes)
    tokens: list[list[int]] = [[] for _ in range(count)]
    trained: list[list[bool]] = [[] for _ in range(count)]
    logprobs: list[list[float]] = [[] for _ in range(count)]
    finished = np.zeros(count, bool)
    info: dict[str, np.ndarray] = {}
    active = list(range(count))
    for turn in range(max_turns):
        if not active:
            break
        room = max(max_tokens - len(tokens[i]) for i in active)
        budget = room if max_turn_tokens is None else min(room, max_turn_tokens)
        rows = active + [active[0]] * (count - len(active))
        context, context_mask = left_pad([prompt_ids[i] + tokens[i] for i in rows], pad_id)
        out = sampling.generate(
            params,
            model_config,
            context,
            context_mask,
            key=jax.random.fold_in(key, turn),
            max_new_tokens=budget,
            sampling=sampling.SamplingOptions(eos_ids=eos, pad_id=pad_id, **sampling_options),
            mesh=mesh,
        )
        new_tokens, new_mask, new_logprobs = (
            fetch(out.tokens),
            fetch(out.mask),
            fetch(out.logprobs),
        )
        still = []
        for row, i in enumerate(active):
            n = min(int(new_mask[row].sum()), max_tokens - len(tokens[i]))
            own = new_tokens[row, :n].tolist()
            tokens[i] += own
            trained[i] += [True] * n
            logprobs[i] += new_logprobs[row, :n].tolist()
            episode = episodes[i]
            text = renderer.tokenizer.decode(own, skip_special_tokens=True)
            episode.turn += 1
            episode.messages.append({"role": "assistant", "content": text})
            result = env.step(episode, text)
            episode.rewards.append(float(result.reward))
            for name, value in (result.info or {}).items():
                if isinstance(value, int | float | bool | np.number):
                    info.setdefault(name, np.zeros(count, np.float64))[i] += float(value)
            ended_turn = n > 0 and own[-1] in eos
            if result.done:
                finished[i] = ended_turn
                continue
            messages = check_messages(result.messages or [], "Environment.step")
            if not messages:
                raise ValueError(
                    "Environment.step returned done=False with no messages: the policy would "
                    "write twice in a row"
                )
            env_ids = renderer.environment(messages)
            if turn == max_turns - 1 or len(tokens[i]) + len(env_ids) >= max_tokens:
                continue  # out of turns, or no room left for another one
            episode.messages.extend(dict(m) for m in messages)
            tokens[i] += env_ids
            trained[i] += [False] * len(env_ids)
            logprobs[i] += [0.0] * len(env_ids)
            still.append(i)
        active = still
    out_tokens = np.full((count, max_tokens), pad_id, np.int32)
    mask = np.zeros((count, max_tokens), bool)
    loss_mask = np.zeros((count, max_tokens), bool)
    out_logprobs = np.zeros((count, max_tokens), np.float32)
    for i in range(count):
        n = len(tokens[i])
        out_tokens[i, :n], mask[i, :n] = tokens[i], True
        loss_mask[i, :n], out_logprobs[i, :n] = trained[i], logprobs[i]
    return {
        "prompts": prompts,
        "prompt_ids": prompt_ids,
        "tokens": out_tokens,
        "mask": mask,
        "loss_mask": loss_mask,
        "logprobs": out_logprobs,
        "rewards": np.array([sum(e.rewards) for e in episodes], np.float32),
        "finished": finished,
        "turns": np.array([e.turn for e in episodes], np.int32),
        "episodes": episodes,
        "info": info,
    }
