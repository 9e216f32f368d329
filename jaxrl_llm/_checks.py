"""Trace-time validation for the loss layer.

Every check runs on static shapes and Python values while tracing, so it costs nothing
inside a compiled step; each raises ``ValueError`` naming the offending shapes or values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def check_rank(name: str, x: Array, ranks: int | Iterable[int]) -> None:
    """Raises if ``x.ndim`` is not one of ``ranks``."""
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if jnp.ndim(x) not in allowed:
        want = " or ".join(str(r) for r in allowed)
        raise ValueError(f"{name} must have rank {want}, got shape {jnp.shape(x)}")


def check_shape(name: str, x: Array, shape: Sequence[int]) -> None:
    """Raises if ``x.shape != shape``."""
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(jnp.shape(x))}")


def check_same_shape(**arrays: Array | None) -> None:
    """Raises if the given (non-None) arrays do not all share one shape."""
    items = [(k, tuple(jnp.shape(v))) for k, v in arrays.items() if v is not None]
    if len({s for _, s in items}) > 1:
        desc = ", ".join(f"{k}{s}" for k, s in items)
        raise ValueError(f"shape mismatch: {desc} must all have the same shape")


def check_batch_time(name: str, x: Array, mask: Array) -> None:
    """Raises unless ``x`` is ``[B, T]`` with the shape of ``mask``."""
    check_rank("mask", mask, 2)
    if tuple(jnp.shape(x)) != tuple(jnp.shape(mask)):
        raise ValueError(
            f"{name} shape {tuple(jnp.shape(x))} does not match mask shape "
            f"{tuple(jnp.shape(mask))} (both must be [B, T])"
        )


def check_advantages(advantages: Array, mask_or_shape: Array | Sequence[int]) -> None:
    """Raises unless advantages are ``[B]`` or ``[B, T]`` matching a ``[B, T]`` shape."""
    shape = (
        tuple(mask_or_shape)
        if isinstance(mask_or_shape, tuple | list)
        else tuple(jnp.shape(mask_or_shape))
    )
    adv_shape = tuple(jnp.shape(advantages))
    if adv_shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must have shape [B]={shape[:1]} or [B, T]={shape}, got {adv_shape}"
        )


def check_group_size(batch_size: int, group_size: int) -> None:
    """Raises unless ``group_size`` is a positive integer dividing ``batch_size``."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if batch_size % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the batch size B={batch_size}; "
            "rows must be prompts x group size with groups contiguous"
        )


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """Raises if ``value`` is not one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {choices}")


def check_non_negative(name: str, value: float | None) -> None:
    """Raises if a (static) hyper-parameter is negative."""
    if value is not None and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_positive(name: str, value: float | None) -> None:
    """Raises if a (static) hyper-parameter is not > 0."""
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def check_clip_bounds(clip_low: float | None, clip_high: float | None) -> None:
    """PPO-style bounds: ``0 <= clip_low < 1`` (ratio stays positive), ``clip_high >= 0``."""
    if clip_low is not None and not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    check_non_negative("clip_high", clip_high)


def f32(x: Array) -> Array:
    """Upcasts to float32 (loss math is always f32, whatever the input dtype)."""
    return jnp.asarray(x, dtype=jnp.float32)


def as_mask(mask: Array) -> Array:
    """A bool or float mask as float32 0/1."""
    return jnp.asarray(mask, dtype=jnp.float32)
