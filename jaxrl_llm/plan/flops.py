"""Analytic FLOPs of the project's decoder (``jaxrl_llm.models``), matmuls only.

A matmul of ``[m, k] x [k, n]`` costs ``2 m n k`` FLOPs (a multiply and an add per term). Per
token and layer, with D hidden, N query heads, K key/value heads, H head dim, F MLP width:

* projections: q ``2 D N H``, k and v ``2 D K H`` each, o ``2 N H D``;
* attention: scores ``q . k`` and the value mix ``p v`` cost ``2 N H`` each per (query, key)
  pair; a causal pass over its own S tokens has ``S (S + 1) / 2`` pairs a sequence (about half
  the square), a non-causal one ``S^2``, and S queries over a cache of ``kv_len`` slots
  ``S x kv_len`` (what the cache attention computes: every slot, masked);
* SwiGLU MLP: gate, up and down, ``2 D F`` each; a mixture of experts (``E`` experts of
  width ``F_e``, ``k`` a token) counts its **active** weights only: the router ``2 D E`` and
  the ``k`` experts a token is sent to, ``k x 3 x 2 D F_e`` (and a shared expert), so MFU,
  roofline and goodput are over the active parameters (``active_param_count``), as MoE
  papers report them; the weights a batch of tokens *reads* are more (``decode_weight_params``);
* unembedding: ``2 D V`` per scored position (once per sequence when decoding, ``S`` or
  ``S - 1`` for log-probs);
* LoRA adapters (``config.lora``: ``x W + (alpha / r) (x A) B`` on each targeted projection
  ``W: [in, out]``): ``2 r (in + out)`` per token and adapted weight, ``2 N_A`` a token in all
  (``N_A = adapter_params(config)``, the adapters' parameter count).

Norms, RoPE, softmax, SiLU and residual adds (``O(D)`` a token, not ``O(D^2)``) are left out,
as in the usual ``6N`` accounting (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, App. B).
The embedding lookup is a gather (no FLOPs); a tied unembedding is still a matmul.
"""

from __future__ import annotations

from jaxrl_llm.models.architectures import param_count  # noqa: F401 (re-exported)
from jaxrl_llm.models.config import ModelConfig

# ``model.remat``'s choices; "offload" recomputes as "layer" does (its saved layer inputs wait in
# host memory, not HBM), so its FLOPs are "layer"'s.
REMAT_POLICIES = ("none", "layer", "offload")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def mlp_params_per_layer(config: ModelConfig) -> int:
    """MLP weights one token multiplies through in one layer: ``3 D F`` (SwiGLU); for a
    mixture-of-experts layer its active ones, the router and the ``k`` experts it is sent to
    (and a shared expert with its gate): ``D E + k 3 D F_e (+ 3 D F_s + D)``."""
    d = config.hidden_size
    if not config.num_experts:
        return 3 * d * config.intermediate_size
    experts = config.num_experts_per_tok * 3 * d * config.moe_intermediate_size
    shared = config.shared_expert_intermediate_size
    return d * config.num_experts + experts + (3 * d * shared + d if shared else 0)


def expert_params_per_expert(config: ModelConfig) -> int:
    """Parameters of one routed expert in one layer: ``3 D F_e`` (gate, up, down), plus
    gpt-oss's expert biases ``2 F_e + D``; 0 for a dense model."""
    if not config.num_experts:
        return 0
    d, f = config.hidden_size, config.moe_intermediate_size
    return 3 * d * f + (2 * f + d if config.expert_biases else 0)


def routed_expert_params(config: ModelConfig) -> int:
    """``L E 3 D F_e`` (+ biases): every routed expert's parameters (``expert_w_*``,
    ``expert_b_*``; the router and a shared expert are not routed); 0 for a dense model."""
    return config.num_hidden_layers * config.num_experts * expert_params_per_expert(config)


def active_param_count(config: ModelConfig) -> int:
    """Parameters one token uses: ``param_count`` less the ``E - k`` routed experts of each
    layer it is not sent to, ``param_count - L (E - k) 3 D F_e`` (the router, a shared expert,
    attention and the embeddings are always active); ``param_count`` for a dense model."""
    unused = config.num_experts - config.num_experts_per_tok if config.num_experts else 0
    return param_count(config) - (
        config.num_hidden_layers * unused * expert_params_per_expert(config)
    )


def experts_touched(config: ModelConfig, tokens: float) -> float:
    """``E (1 - (1 - k / E)^n)``: the expected number of distinct experts of one layer that
    ``n`` tokens are routed to, if each token's ``k`` experts were uniform and independent
    (``k`` for one token, nearly ``E`` once ``n k >> E``); 0 for a dense model. Real routers
    are less uniform, so fewer are touched: this is an upper estimate of the weights read."""
    e, k = config.num_experts, config.num_experts_per_tok
    if not e:
        return 0.0
    if not tokens > 0:
        raise ValueError(f"tokens must be > 0, got {tokens!r}")
    return e * (1.0 - (1.0 - k / e) ** tokens)


def decode_weight_params(config: ModelConfig, tokens: float) -> float:
    """Matmul weights a forward over ``tokens`` tokens at once reads (a decode step's):
    ``matmul_params`` for a dense model; for a mixture of experts the ``k`` active experts of
    ``matmul_params`` become the ``experts_touched(tokens)`` experts the tokens reach:
    ``matmul_params + L (touched - k) 3 D F_e``."""
    if not config.num_experts:
        return float(matmul_params(config))
    extra = experts_touched(config, tokens) - config.num_experts_per_tok
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    return matmul_params(config) + config.num_hidden_layers * extra * per_expert


def matmul_params_per_layer(config: ModelConfig) -> int:
    """Weights one token multiplies through in one layer: ``D(N H + 2 K H) + N H D`` and the
    MLP's (``mlp_params_per_layer``: ``3 D F`` for a dense one)."""
    d = config.hidden_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return d * (n * h + 2 * k * h) + n * h * d + mlp_params_per_layer(config)


def matmul_params(config: ModelConfig) -> int:
    """``N`` of the ``6N`` rule: ``L x matmul_params_per_layer + D V`` (the unembedding)."""
    return config.num_hidden_layers * matmul_params_per_layer(config) + (
        config.hidden_size * config.vocab_size
    )


def adapter_params(config: ModelConfig) -> int:
    """``N_A = L sum_w r (in_w + out_w)``: the LoRA adapters' parameters (``A: [in, r]``,
    ``B: [r, out]`` per targeted weight and layer), also the adapter weights a token multiplies
    through; 0 without ``config.lora``."""
    if config.lora is None:
        return 0
    d, f = config.hidden_size, config.intermediate_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    dims = {  # target -> (in, out) of the weight it adapts, flattened
        "q": (d, n * h),
        "k": (d, k * h),
        "v": (d, k * h),
        "o": (n * h, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    per_layer = sum(config.lora.rank * sum(dims[t]) for t in config.lora.targets)
    return config.num_hidden_layers * per_layer


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
    """Matmul FLOPs of one forward pass, by part: ``projections, attention, mlp, unembed``
    and, for a LoRA model (``config.lora``), ``adapters`` (``2 N_A`` a token).

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
    d, v = config.hidden_size, config.vocab_size
    n, k, h = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    tokens = batch * seq
    pairs = batch * attention_pairs(seq, kv_len=kv_len, causal=causal)
    parts = {
        "projections": layers * tokens * 2 * (d * n * h + 2 * d * k * h + n * h * d),
        "attention": layers * pairs * 4 * n * h,
        "mlp": layers * tokens * 2 * mlp_params_per_layer(config),
        "unembed": batch * logits_positions * 2 * d * v,
    }
    if config.lora is not None:
        parts["adapters"] = tokens * 2 * adapter_params(config)
    return parts


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
    """FLOPs of one training step: forward + backward + remat recompute.

    Full training (``config.lora`` None): ``3 F`` with ``F`` the forward. The backward costs
    two forwards (gradients with respect to activations and to weights, each a matmul of the
    forward's size).

    LoRA (``config.lora`` set: the adapters trained, the base frozen, as ``train`` runs it):
    ``2 F_base + F_attn + 6 N_A B S``. With ``F_base`` the base model's forward (all parts
    but ``adapters``), ``F_attn`` its attention part and ``W = F_base - F_attn`` its weight
    matmuls (projections, MLP, unembedding): forward ``F_base + 2 N_A B S``; backward
    ``2 F_base - W + 4 N_A B S`` -- the activation gradients through every frozen matmul (``W``,
    attention ``2 F_attn``) but no gradient of a frozen weight (the ``W`` of full training's
    ``dW = x^T dy``), and through each adapter ``dX`` and ``dA`` (``2 r in``), ``du`` and
    ``dB`` (``2 r out``): twice its forward. The activation gradients are counted for every
    layer (layer 0's input gradient is not needed, but the scanned layers' carry computes it).

    ``remat="layer"`` (``jax.checkpoint`` around each scanned layer) runs the layers' forward
    once more in the backward pass, less the MLP down projection (``2 D F`` a token and layer:
    its output only feeds the residual add, whose backward needs none of it, so JAX's remat
    drops it; likewise the down adapter's ``(x A) B``, ``2 r D``); the unembedding is not
    recomputed. ``remat="offload"`` recomputes the same.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")
    parts = forward_flops_breakdown(
        config, batch, seq, causal=causal, logits_positions=logits_positions
    )
    forward = sum(parts.values())
    tokens_layers = config.num_hidden_layers * batch * seq
    # A mixture of experts weighs each expert's output by its routing weight (and a shared
    # expert's by its gate), whose gradients need those outputs: nothing is dropped there.
    width = 0 if config.num_experts else config.intermediate_size
    down = tokens_layers * 2 * config.hidden_size * width
    adapters = parts.get("adapters", 0)
    if adapters and "down" in config.lora.targets:
        down += tokens_layers * 2 * config.lora.rank * config.hidden_size
    recompute = forward - parts["unembed"] - down if remat != "none" else 0
    if config.lora is None:
        return 3 * forward + recompute
    base = forward - adapters
    frozen_weights = base - parts["attention"]
    return (base + adapters) + (2 * base - frozen_weights + 2 * adapters) + recompute


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
    "active_param_count",
    "adapter_params",
    "attention_pairs",
    "decode_flops",
    "decode_weight_params",
    "expert_params_per_expert",
    "experts_touched",
    "forward_flops",
    "forward_flops_breakdown",
    "matmul_params",
    "matmul_params_per_layer",
    "mlp_params_per_layer",
    "model_flops_per_token",
    "param_count",
    "routed_expert_params",
    "train_flops",
]
