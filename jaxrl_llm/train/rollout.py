"""Host side of an RL step: tokenise prompts, sample, decode, score, assemble the batch.

Nothing here is traced: tokenising and rewards are Python; sampling calls the jitted sampler.
On several processes every process gathers the whole sampled batch (it is small: tokens and
log-probs), scores it identically, and later feeds only its own rows to the sharded step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm import sampling
from jaxrl_llm.rewards import RewardInput, compute_rewards, is_correct


def fetch(x: jax.Array) -> np.ndarray:
    """A global array as a host NumPy array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def encode_prompts(
    tokenizer, texts: Sequence[str], *, max_prompt_tokens: int, add_special_tokens: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``[N, P]`` int32 token ids and a bool mask.

    ``add_special_tokens=False`` for chat-templated text, which already holds its own BOS.

    Raises:
      ValueError: an empty prompt, or one longer than ``max_prompt_tokens`` (never truncated).
    """
    ids = [tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"] for text in texts]
    for text, row in zip(texts, ids):
        if not row:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        if len(row) > max_prompt_tokens:
            raise ValueError(
                f"prompt of {len(row)} tokens exceeds data.max_prompt_tokens="
                f"{max_prompt_tokens}: {text[:80]!r}..."
            )
    width = max(len(row) for row in ids)
    tokens = np.full((len(ids), width), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, row in enumerate(ids):
        tokens[i, width - len(row) :] = row
        mask[i, width - len(row) :] = True
    return tokens, mask


def encode_completions(
    tokenizer, texts: Sequence[str], *, max_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[N, max_tokens]`` completion ids ending in EOS (demonstrations)."""
    eos = tokenizer.eos_token_id
    tokens = np.full((len(texts), max_tokens), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(texts), max_tokens), bool)
    for i, text in enumerate(texts):
        row = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if len(row) > max_tokens:
            raise ValueError(f"demonstration {text!r} is longer than {max_tokens} tokens")
        tokens[i, : len(row)] = row
        mask[i, : len(row)] = True
    return tokens, mask


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def eos_ids(tokenizer, model_config) -> tuple[int, ...]:
    ids = set(model_config.eos_token_ids or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the tokenizer nor the model config defines an EOS token")
    return tuple(sorted(ids))


def decode_completions(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Completion texts (special tokens such as EOS dropped)."""
    return [
        tokenizer.decode(row[: int(m.sum())].tolist(), skip_special_tokens=True)
        for row, m in zip(tokens, mask)
    ]


class Samples(NamedTuple):
    """One sampled batch on the host; rows ``g*G … g*G+G-1`` answer prompt ``g``."""

    prompt_tokens: np.ndarray  # [N*G, P] int32, left-padded
    prompt_mask: np.ndarray  # [N*G, P] bool
    completion_tokens: np.ndarray  # [N*G, T] int32, right-padded
    completion_mask: np.ndarray  # [N*G, T] bool, includes EOS
    completions: list[str]  # N*G decoded texts
    rewards: np.ndarray  # [N*G] f32
    correct: np.ndarray  # [N*G] bool
    components: dict[str, np.ndarray]  # reward name -> [N*G]
    finished: np.ndarray  # [N*G] bool, ended with EOS within the length limit


def sample_and_score(
    params: Any,
    model_config,
    tokenizer,
    examples: Sequence[Any],
    prompts: Sequence[str],
    *,
    key: jax.Array,
    reward_fn: Callable[[RewardInput], float],
    group_size: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    temperature: float,
    add_special_tokens: bool = True,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    mesh: Any = None,
) -> Samples:
    """Samples ``group_size`` completions for each prompt and scores them."""
    prompt_tokens, prompt_mask = encode_prompts(
        tokenizer,
        prompts,
        max_prompt_tokens=max_prompt_tokens,
        add_special_tokens=add_special_tokens,
    )
    eos = eos_ids(tokenizer, model_config)
    completion = sampling.generate(
        params,
        model_config,
        prompt_tokens,
        prompt_mask,
        key=key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        eos_ids=eos,
        pad_id=pad_id(tokenizer),
        num_samples=group_size,
        mesh=mesh,
    )
    tokens, mask = fetch(completion.tokens), fetch(completion.mask)
    texts = decode_completions(tokenizer, tokens, mask)
    lengths = mask.sum(axis=1)
    last = tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)]
    finished = (lengths > 0) & np.isin(last, eos)
    row_examples = [ex for ex in examples for _ in range(group_size)]
    row_prompts = [p for p in prompts for _ in range(group_size)]
    inputs = [
        RewardInput(prompt=p, completion=c, example=ex, completion_tokens=int(n))
        for p, c, ex, n in zip(row_prompts, texts, row_examples, lengths)
    ]
    rewards, components = compute_rewards(reward_fn, inputs)
    correct = np.array([is_correct(c, ex) for c, ex in zip(texts, row_examples)], bool)
    return Samples(
        prompt_tokens=np.repeat(prompt_tokens, group_size, axis=0),
        prompt_mask=np.repeat(prompt_mask, group_size, axis=0),
        completion_tokens=tokens,
        completion_mask=mask,
        completions=texts,
        rewards=np.asarray(rewards, np.float32),
        correct=correct,
        components=components,
        finished=finished,
    )


def concat_samples(parts: Sequence[Samples]) -> Samples:
    """Row-wise concatenation (prompt widths padded on the left to the widest)."""
    width = max(p.prompt_tokens.shape[1] for p in parts)

    def left_pad(x: np.ndarray, fill) -> np.ndarray:
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=fill)

    return Samples(
        prompt_tokens=np.concatenate([left_pad(p.prompt_tokens, 0) for p in parts]),
        prompt_mask=np.concatenate([left_pad(p.prompt_mask, False) for p in parts]),
        completion_tokens=np.concatenate([p.completion_tokens for p in parts]),
        completion_mask=np.concatenate([p.completion_mask for p in parts]),
        completions=[c for p in parts for c in p.completions],
        rewards=np.concatenate([p.rewards for p in parts]),
        correct=np.concatenate([p.correct for p in parts]),
        components={
            k: np.concatenate([p.components[k] for p in parts]) for k in parts[0].components
        },
        finished=np.concatenate([p.finished for p in parts]),
    )


def select_groups(samples: Samples, groups: np.ndarray, group_size: int) -> Samples:
    """The rows of the given group indices, in that order."""
    rows = (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
    take = lambda x: x[rows]  # noqa: E731
    return Samples(
        prompt_tokens=take(samples.prompt_tokens),
        prompt_mask=take(samples.prompt_mask),
        completion_tokens=take(samples.completion_tokens),
        completion_mask=take(samples.completion_mask),
        completions=[samples.completions[r] for r in rows],
        rewards=take(samples.rewards),
        correct=take(samples.correct),
        components={k: take(v) for k, v in samples.components.items()},
        finished=take(samples.finished),
    )


def constant_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """``[N]`` bool: groups whose rewards are all equal (zero advantage under GRPO)."""
    grouped = rewards.reshape(-1, group_size)
    return grouped.max(axis=1) == grouped.min(axis=1)
