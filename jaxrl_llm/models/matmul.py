"""Dense products of activations with weights, with a hand-written backward on CPU.

``dense(x, w, contract)`` is ``jnp.tensordot(x, w, contract)``: the last ``contract`` axes of
``x [..., C...]`` against the first ``contract`` axes of ``w [C..., O...]``, giving
``[..., O...]``. On TPU and GPU it is exactly that (autodiff's backward). On CPU its backward is
written as two 2-D matrix products, ``dx = g W^T`` and ``dW = X^T g`` over the flattened rows:
XLA:CPU compiles autodiff's version of a SwiGLU MLP backward with the gate's elementwise
gradient fused into a transposing copy that reads four arrays column-wise (29 of the 130 ms of a
60M model's MLP forward + backward, B=8, S=160); with the 2-D products the same MLP takes 72 ms
(PyTorch eager: 63 ms). ``benchmarks/bench_train_step.py`` measures the whole step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxrl_llm.parallel.mesh import current_platform

Array = jax.Array


def dense(x: Array, w: Array, contract: int = 1, *, preferred_element_type=None) -> Array:
    """``tensordot(x, w, contract)`` (see the module docstring); the CPU backward is 2-D GEMMs.

    Args:
      x: ``[..., C_1, ..., C_contract]`` activations.
      w: ``[C_1, ..., C_contract, O...]`` weights.
      contract: how many trailing axes of ``x`` meet the leading axes of ``w``.
      preferred_element_type: the product's accumulation and output dtype (e.g. f32 logits
        from bf16 inputs); None: the inputs' promoted dtype. Gradients come back in the
        inputs' dtypes.

    Returns:
      ``[..., O...]``.
    """
    if x.shape[x.ndim - contract :] != w.shape[:contract]:
        raise ValueError(
            f"dense: the last {contract} axes of x {tuple(x.shape)} must equal the first "
            f"{contract} of w {tuple(w.shape)}"
        )
    out_dtype = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    if current_platform()[0] != "cpu":
        return _product(x, w, contract, out_dtype)
    return _dense_2d_backward(x, w, contract, out_dtype)


def _product(x: Array, w: Array, contract: int, out_dtype) -> Array:
    return jnp.tensordot(x, w, contract, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense_2d_backward(x: Array, w: Array, contract: int, out_dtype) -> Array:
    return _product(x, w, contract, out_dtype)


def _forward(x: Array, w: Array, contract: int, out_dtype) -> tuple[Array, tuple[Array, Array]]:
    return _product(x, w, contract, out_dtype), (x, w)


def _backward(
    contract: int, out_dtype, residuals: tuple[Array, Array], g: Array
) -> tuple[Array, Array]:
    del out_dtype  # the cotangent is brought to the inputs' dtype for the two products
    x, w = residuals
    inner = math.prod(w.shape[:contract])
    rows = math.prod(x.shape[: x.ndim - contract])
    x2, w2 = x.reshape(rows, inner), w.reshape(inner, -1)
    g2 = g.reshape(rows, w2.shape[1]).astype(jnp.result_type(x, w))
    dx = (g2 @ w2.T).astype(x.dtype).reshape(x.shape)
    dw = (x2.T @ g2).astype(w.dtype).reshape(w.shape)
    return dx, dw


_dense_2d_backward.defvjp(_forward, _backward)
