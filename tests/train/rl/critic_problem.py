"""The tiny Llama that PPO's critic and the learned reward model are built on in the tests
(``heads.init_scalar_params``; PPO's policy too), and ragged rows for it to score."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.types import Sequences
from tests.train import step_problem

# step_problem's 2-layer Llama (hidden 32, untied) with a 24-token vocabulary.
CONFIG = dataclasses.replace(step_problem.CONFIG, vocab_size=24, max_position_embeddings=64)


def ragged_rows(
    rng: np.random.Generator, rows: int = 8, prompt: int = 6, length: int = 10, *, empty_row=None
) -> Sequences:
    """Left-padded prompts of 1 to ``prompt`` tokens and right-padded completions of
    long-tailed lengths (geometric(0.3), at most ``length``; row ``empty_row`` empty), as the
    sampler returns them: token ids in ``[1, V)`` of ``CONFIG``, 0 on padding; bool masks.

    Drawn in the order prompt lengths, completion lengths, prompt tokens, completion tokens.
    """
    prompt_mask = np.arange(prompt)[None] >= (prompt - rng.integers(1, prompt + 1, rows))[:, None]
    lengths = np.minimum(rng.geometric(0.3, rows), length)
    if empty_row is not None:
        lengths[empty_row] = 0
    completion_mask = np.arange(length)[None] < lengths[:, None]
    return Sequences(
        np.where(prompt_mask, rng.integers(1, CONFIG.vocab_size, (rows, prompt)), 0),
        prompt_mask,
        np.where(completion_mask, rng.integers(1, CONFIG.vocab_size, (rows, length)), 0),
        completion_mask,
    )
