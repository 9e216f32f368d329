"""Prompt batches for the sampler: checking the left padding, bucketing the length.

Prompt lengths are bucketed (powers of two ``>= 4`` by default; extra columns are left padding)
so a stream of batches compiles a handful of programs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

MIN_BUCKET = 4


def bucket_length(length: int, buckets: Sequence[int] | None = None) -> int:
    """The padded prompt length: the smallest bucket ``>= length``.

    Default buckets are the powers of two ``>= 4`` (a 4-token prompt padded to 16 would cost
    a 32-token completion 33% more positions); custom ``buckets`` must contain a value
    ``>= length``.
    """
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    if buckets is None:
        return max(MIN_BUCKET, 1 << (length - 1).bit_length())
    fitting = [b for b in sorted(buckets) if b >= length]
    if not fitting:
        raise ValueError(f"prompt length {length} exceeds the largest bucket {max(buckets)}")
    return fitting[0]


def check_prompts(prompt_tokens: Any, prompt_mask: Any) -> None:
    """Raises ValueError unless the prompts are ``[B, P]`` integer tokens with a same-shape mask,
    left-padded with at least one real token per row (values checked when known on this host)."""
    if jnp.ndim(prompt_tokens) != 2:
        raise ValueError(f"prompt_tokens must be [B, P], got shape {jnp.shape(prompt_tokens)}")
    if jnp.shape(prompt_mask) != jnp.shape(prompt_tokens):
        raise ValueError(
            f"prompt_mask shape {jnp.shape(prompt_mask)} must equal prompt_tokens shape "
            f"{jnp.shape(prompt_tokens)}"
        )
    if not jnp.issubdtype(jnp.result_type(prompt_tokens), jnp.integer):
        raise ValueError(f"prompt_tokens must be integer, got {jnp.result_type(prompt_tokens)}")
    if isinstance(prompt_mask, jax.core.Tracer) or (
        isinstance(prompt_mask, jax.Array) and not prompt_mask.is_fully_addressable
    ):
        return  # values unknown here (traced, or spread over hosts of a pod)
    # The last column must be every row's last real token: left padding, no empty row.
    mask = np.asarray(prompt_mask).astype(bool)
    if not mask[:, -1].all():
        rows = np.flatnonzero(~mask[:, -1]).tolist()
        raise ValueError(
            f"prompts must be left-padded with at least one real token; rows {rows[:8]} have "
            "padding (mask 0) in the last column"
        )
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        rows = np.flatnonzero((np.diff(mask.astype(np.int8), axis=1) < 0).any(axis=1)).tolist()
        raise ValueError(f"prompts must be left-padded: rows {rows[:8]} have padding after a token")


def pad_prompts(
    prompt_tokens: Array,
    prompt_mask: Array,
    *,
    pad_id: int,
    buckets: Sequence[int] | None = None,
) -> tuple[Array, Array]:
    """Left-pads ``[B, P]`` prompts to ``[B, bucket_length(P)]`` (``pad_id``, mask 0).

    Positions come from ``cumsum(mask) - 1``, so the extra columns change nothing but the shape.
    """
    check_prompts(prompt_tokens, prompt_mask)
    length = jnp.shape(prompt_tokens)[1]
    extra = bucket_length(length, buckets) - length
    # NumPy on host arrays (the usual case: fresh from a tokenizer) avoids tiny device programs.
    xp = jnp if isinstance(prompt_tokens, jax.Array) else np
    tokens = xp.asarray(prompt_tokens).astype(np.int32)
    mask = xp.asarray(prompt_mask).astype(bool)
    if extra:
        tokens = xp.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
        mask = xp.pad(mask, ((0, 0), (extra, 0)))
    return tokens, mask
