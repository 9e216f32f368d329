"""Analytic FLOPs of the project's decoder (``jaxrl_llm.models``), matmuls only.

A matmul of ``[m, k] x [k, n]`` costs ``2 m n k`` FLOPs (a multiply and an add per term). Per
token and layer, with D hidden, N query heads, K key/value heads, H head dim, F MLP width:

* projections: q ``2 D N H``, k and v ``2 D K H`` each, o ``2 N H D``;
* attention: scores ``q . k`` and the value mix ``p v`` cost ``2 N H`` each per (query, key)
  pair; a causal pass over its own S tokens has ``S (S + 1) / 2`` pairs a sequence (about half
  the square), a non-causal one ``S^2``, and S queries over a cache of ``kv_len`` slots
  ``S x kv_len`` (what the cache attention computes: every slot, masked);
* SwiGLU MLP: gate, up and down, ``2 D F`` each;
* unembedding: ``2 D V`` per scored position (once per sequence when decoding, ``S`` or
  ``S - 1`` for log-probs).

Norms, RoPE, softmax, SiLU and residual adds (``O(D)`` a token, not ``O(D^2)``) are left out,
as in the usual ``6N`` accounting (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B).
The embedding lookup is a gather (no FLOPs); a tied unembedding is still a matmul.
"""

from __future__ import annotations

from jaxrl_llm.models.architectures import param_count  # noqa: F401 (re-exported)
from jaxrl_llm.models.config import ModelConfig

REMAT_POLICIES = ("none", "layer")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def matmul_params_per_layer(config: ModelConfig) -> int:
    """Weights one token multiplies through in one layer: ``D(N H + 2 K H) + N H D + 3 D F``."""
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return d * (n * h + 2 * k * h) + n * h * d + 3 * d * f


def matmul_params(config: ModelConfig) -> int:
    """``N`` of the ``6N`` rule: ``L x matmul_params_per_layer + D V`` (the unembedding)."""
    return config.num_hidden_layers * matmul_params_per_layer(config) + (
        config.hidden_size * config.vocab_size
    )


def attention_pairs(seq: int, *, kv_len: int | None = None, causal: bool = True) -> int:
    """(query, key) pairs of one sequence.

    ``kv_len=None``: the S queries attend to this call's S keys, ``S (S + 1) / 2`` causal or
    ``S^2``. With ``kv_len`` (a cache of that many slots, this call's keys included):
    ``S x kv_len``, except ``kv_len == S`` with ``causal`` (the triangle again).
    """
    _check_positive("seq", seq)
    if kv_len is None or (causal and kv_len == seq):
        return seq * (seq + 1) // 2 if causal else seq * seq
    _check_positive("kv_len", kv_len)
    return seq * kv_len


def forward_flops_breakdown(
    config: ModelConfig,
    batch: int,
    seq: int,
    *,
    kv_len: int | None = None,
    causal: bool = True,
    logits_positions: int | None = None,
) -> dict[str, int]:
    """Matmul FLOPs of one forward pass, by part: ``projections, attention, mlp, unembed``.

    Args:
      config: the model.
      batch: sequences B.
      seq: tokens per sequence S in this call.
      kv_len: cache slots each query reads (decode / prefill with a cache), or None when the
        keys are this call's tokens (see ``attention_pairs``).
      causal: causal masking (counts the triangle rather than the square when keys are this
        call's tokens).
      logits_positions: positions a sequence unembeds (None: all S; 1 for decode; 0 for none).

    Raises:
      ValueError: non-positive sizes, or ``logits_positions`` outside ``[0, S]``.
    """
    _check_positive("batch", batch)
    _check_positive("seq", seq)
    if logits_positions is None:
        logits_positions = seq
    if (
        not isinstance(logits_positions, int)
        or isinstance(logits_positions, bool)
        or not 0 <= logits_positions <= seq
    ):
        raise ValueError(
            f"logits_positions must be an int in [0, seq={seq}], got {logits_positions!r}"
        )
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    tokens = batch * seq
    pairs = batch * attention_pairs(seq, kv_len=kv_len, causal=causal)
    return {
        "projections": layers * tokens * 2 * (d * n * h + 2 * d * k * h + n * h * d),
        "attention": layers * pairs * 4 * n * h,
        "mlp": layers * tokens * 6 * d * f,
        "unembed": batch * logits_positions * 2 * d * v,
    }


def forward_flops(
    config: ModelConfig,
    batch: int,
    seq: int,
    *,
    kv_len: int | None = None,
    causal: bool = True,
    logits_positions: int | None = None,
) -> int:
    """Matmul FLOPs of one forward pass (sum of ``forward_flops_breakdown``)."""
    return sum(
        forward_flops_breakdown(
            config,
            batch,
            seq,
            kv_len=kv_len,
            causal=causal,
            logits_positions=logits_positions,
        ).values()
    )


def train_flops(
    config: ModelConfig,
    batch: int,
    seq: int,
    *,
    remat: str = "none",
    causal: bool = True,
    logits_positions: int | None = None,
) -> int:
    """FLOPs of one training step: forward + backward (``2 x`` forward) + remat recompute.

    Backward costs two forwards (gradients with respect to activations and to weights, each a
    matmul of the forward's size). ``remat="layer"`` (``jax.checkpoint`` around each scanned
    layer) runs the layers' forward once more in the backward pass, less the MLP down
    projection (``2 D F`` a token and layer: its output only feeds the residual add, whose
    backward needs none of it, so JAX's remat drops it); the unembedding is not recomputed.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    parts = forward_flops_breakdown(
        config, batch, seq, causal=causal, logits_positions=logits_positions
    )
    forward = sum(parts.values())
    down = (
        config.num_hidden_layers * batch * seq * 2 * config.hidden_size * config.intermediate_size
    )
    recompute = forward - parts["unembed"] - down if remat == "layer" else 0
    return 3 * forward + recompute


def decode_flops(config: ModelConfig, batch: int, kv_len: int) -> int:
    """FLOPs of one decode step: one token per sequence over ``kv_len`` cache slots."""
    return forward_flops(config, batch, 1, kv_len=kv_len, logits_positions=1)


def model_flops_per_token(
    config: ModelConfig, seq: int | None = None, *, causal: bool = True
) -> float:
    """Training FLOPs per token for MFU: ``6 N`` plus, given ``seq``, the attention term.

    ``N = matmul_params(config)`` (Kaplan et al. 2020). The attention term is
    ``3 x 4 L N_heads H x`` the mean keys a query sees (``(S + 1) / 2`` causal, ``S`` not):
    PaLM's ``12 L H Q T`` (Chowdhery et al. 2022, App. B) with causal masking counted. Equals
    ``train_flops(config, B, S) / (B S)`` without remat with every position scored.
    """
    flops = 6.0 * matmul_params(config)
    if seq is not None:
        _check_positive("seq", seq)
        keys = (seq + 1) / 2 if causal else float(seq)
        heads = config.num_attention_heads * config.head_dim
        flops += 12.0 * config.num_hidden_layers * heads * keys
    return flops


__all__ = [
    "REMAT_POLICIES",
    "attention_pairs",
    "decode_flops",
    "forward_flops",
    "forward_flops_breakdown",
    "matmul_params",
    "matmul_params_per_layer",
    "model_flops_per_token",
    "param_count",
    "train_flops",
]
