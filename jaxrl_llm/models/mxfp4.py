"""MXFP4 weights (OCP Microscaling, FP4 E2M1 values sharing an E8M0 scale per 32), as gpt-oss
checkpoints store their experts, dequantised in NumPy at load.

Format (the Open Compute Project's MX specification v1.0, and transformers'
``integrations/mxfp4.py``): a row of ``K`` values is cut into ``G = K / 32`` blocks; block ``g``
is 16 bytes ``blocks[..., g, :]`` holding two 4-bit codes each (value ``2i`` in the low
nibble, ``2i + 1`` in the high one) and one byte ``scales[..., g]``, a biased power of two::

    x[..., 32 g + 2 i]     = FP4[blocks[..., g, i] & 0xF] · 2^(scales[..., g] - 127)
    x[..., 32 g + 2 i + 1] = FP4[blocks[..., g, i] >> 4]  · 2^(scales[..., g] - 127)

with ``FP4`` the 16 E2M1 values ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (code ``c``: sign bit 3,
magnitude ``c & 7``).

A gpt-oss checkpoint names each quantised expert tensor ``<name>_blocks`` (``[E, out, G, 16]``
uint8) and ``<name>_scales`` (``[E, out, G]`` uint8); the tensor they stand for is
transformers' ``[E, in, out]`` (``in = 32 G``), i.e. the dequantised rows transposed
(``convert_moe_packed_tensors``). ``Mxfp4Tensor`` reads such a pair lazily as that tensor, so
the checkpoint loader treats it like any stored one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# E2M1 codes 0..15 (transformers' FP4_VALUES).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK_SIZE = 32  # values per scale
SCALE_BIAS = 127  # E8M0 exponent bias
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """MXFP4 ``(blocks, scales)`` -> values (see the module docstring for the formula).

    Args:
      blocks: ``[..., G, 16]`` uint8, two FP4 codes a byte (low nibble first).
      scales: ``[..., G]`` uint8, each block's biased exponent.
      dtype: the result's dtype (values are computed in float32, where every MXFP4 value with
        a scale below 255 is exact, then cast).

    Returns:
      ``[..., 32 G]`` values in ``dtype``.

    Raises:
      ValueError: not uint8, a last dim other than 16, or scales that do not match the
        blocks' leading dims.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.ndim < 1 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., G, {BLOCK_SIZE // 2}] with scales [..., G], got blocks "
            f"{blocks.shape} and scales {scales.shape}"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: low, high
    values = FP4_VALUES[codes].reshape(*scales.shape, BLOCK_SIZE)
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS
    out = np.ldexp(values, exponents).reshape(*scales.shape[:-1], -1)
    return out.astype(dtype, copy=False)


class Mxfp4Tensor:
    """A checkpoint's ``<name>_blocks`` / ``<name>_scales`` pair read as the ``[E, in, out]``
    tensor they stand for (transformers' dequantised layout), lazily.

    ``view[e, i, o]`` (three slices) reads only experts ``e`` and output rows ``o`` of the
    pair, dequantises them (``dequantize``) and returns ``[e, i, o]`` float32: the interface of
    a safetensors slice (``get_shape``, ``__getitem__``), so ``checkpoint``'s layouts read it as
    they read a stored tensor, one device shard at a time.
    """

    def __init__(self, blocks: Any, scales: Any, name: str = "tensor"):
        """``blocks`` / ``scales``: safetensors slices (or arrays) of the pair."""
        block_shape = tuple(blocks.get_shape()) if hasattr(blocks, "get_shape") else blocks.shape
        scale_shape = tuple(scales.get_shape()) if hasattr(scales, "get_shape") else scales.shape
        if (
            len(block_shape) != 4
            or block_shape[-1] != BLOCK_SIZE // 2
            or block_shape[:-1] != scale_shape
        ):
            raise ValueError(
                f"MXFP4 tensor {name!r}: {name}{BLOCKS_SUFFIX} must be [E, out, G, 16] and "
                f"{name}{SCALES_SUFFIX} [E, out, G], got {block_shape} and {scale_shape}"
            )
        for suffix, part in ((BLOCKS_SUFFIX, blocks), (SCALES_SUFFIX, scales)):
            kind = str(part.get_dtype() if hasattr(part, "get_dtype") else part.dtype).upper()
            if kind not in ("U8", "UINT8"):
                raise ValueError(f"MXFP4 tensor {name}{suffix} must be uint8, got {kind}")
        self._blocks, self._scales, self.name = blocks, scales, name
        experts, rows, groups = scale_shape
        self.shape = (experts, groups * BLOCK_SIZE, rows)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple[slice, slice, slice]) -> np.ndarray:
        experts, columns, rows = index
        blocks = np.asarray(self._blocks[experts, rows, :, :])
        scales = np.asarray(self._scales[experts, rows, :])
        return dequantize(blocks, scales).transpose(0, 2, 1)[:, columns]


__all__ = [
    "BLOCKS_SUFFIX",
    "BLOCK_SIZE",
    "FP4_VALUES",
    "SCALES_SUFFIX",
    "Mxfp4Tensor",
    "dequantize",
]
