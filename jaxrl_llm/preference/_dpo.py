"""DPO and its variants: one small function per loss type, and weighted mixtures of them.

Notation (shared/SPEC_LOSSES.md): ``c = lp_θ(y_w) − lp_ref(y_w)``, ``ρ = lp_θ(y_l) − lp_ref(y_l)``
on summed completion log-probs, ``Δ = c − ρ``, ``z = βΔ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.nn import log_sigmoid, sigmoid

from jaxrl_llm._checks import check_choice, check_positive, check_rank, check_same_shape, f32
from jaxrl_llm.preference._sequence import check_label_smoothing

Array = jax.Array

#: The ``loss_type`` values :func:`dpo` accepts (one, or a weighted mixture of several).
LOSS_TYPES: tuple[str, ...] = (
    "sigmoid",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)

_SMOOTHED = ("sigmoid", "robust", "exo_pair")
_LENGTH_NORMALISED = ("ipo", "sigmoid_norm")
DPO_LOSS_KWARGS = ("loss_weights", "discopop_tau")
_DEFAULT_DISCOPOP_TAU = 0.05

# --------------------------------------------------------------------------------------------
# DPO loss types: one small function per row of the SPEC_LOSSES.md table.


class _Hyper(NamedTuple):
    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_len: Array | None  # [N] f32, already guarded with max(n, 1)
    rejected_len: Array | None


def _sigmoid(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def _hinge(c: Array, rho: Array, hp: _Hyper) -> Array:
    return jax.nn.relu(1.0 - hp.beta * (c - rho))


def _ipo(c: Array, rho: Array, hp: _Hyper) -> Array:
    return jnp.square(c / hp.chosen_len - rho / hp.rejected_len - 1.0 / (2.0 * hp.beta))


def _robust(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return (-(1.0 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def _exo_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    eps = hp.label_smoothing
    return sigmoid(z) * (log_sigmoid(z) - math.log1p(-eps)) + sigmoid(-z) * (
        log_sigmoid(-z) - math.log(eps)
    )


def _nca_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    bc, brho = hp.beta * c, hp.beta * rho
    return -log_sigmoid(bc) - 0.5 * log_sigmoid(-bc) - 0.5 * log_sigmoid(-brho)


def _bco_pair(c: Array, rho: Array, hp: _Hyper) -> Array:
    return -log_sigmoid(hp.beta * c) - log_sigmoid(-hp.beta * rho)


def _sppo_hard(c: Array, rho: Array, hp: _Hyper) -> Array:
    half_inv_beta = 1.0 / (2.0 * hp.beta)
    return jnp.square(c - half_inv_beta) + jnp.square(rho + half_inv_beta)


def _apo_zero(c: Array, rho: Array, hp: _Hyper) -> Array:
    # 1 − σ(x) written as σ(−x): exact in the tail where σ(x) rounds to 1.
    return sigmoid(-hp.beta * c) + sigmoid(hp.beta * rho)


def _apo_down(c: Array, rho: Array, hp: _Hyper) -> Array:
    return sigmoid(hp.beta * c) + sigmoid(-hp.beta * (c - rho))


def _discopop(c: Array, rho: Array, hp: _Hyper) -> Array:
    z = hp.beta * (c - rho)
    tau = hp.discopop_tau
    # μ·exp(−z) as exp(logσ(z/τ) − z): the naive product is 0·inf = NaN once z ≪ 0.
    return sigmoid(-z / tau) * -log_sigmoid(z) + jnp.exp(log_sigmoid(z / tau) - z)


def _sigmoid_norm(c: Array, rho: Array, hp: _Hyper) -> Array:
    return -log_sigmoid(hp.beta * (c / hp.chosen_len - rho / hp.rejected_len))


_DPO_LOSSES = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sigmoid_norm": _sigmoid_norm,
}


def _loss_types_and_weights(
    loss_type: str | Sequence[str], loss_weights: Sequence[float] | None
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    if not isinstance(loss_type, str | Sequence):
        raise ValueError(f"loss_type must be a str or a sequence of str, got {loss_type!r}")
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ValueError("loss_type must be a loss type or a non-empty sequence of them")
    for name in types:
        check_choice("loss_type", name, LOSS_TYPES)
    if loss_weights is None:
        return types, (1.0,) * len(types)
    weights = tuple(float(w) for w in loss_weights)
    if len(weights) != len(types):
        raise ValueError(
            f"loss_weights {weights} must have one weight per loss type {types} "
            f"(got {len(weights)} for {len(types)})"
        )
    for w in weights:
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"loss_weights must be finite and >= 0, got {weights}")
    return types, weights


def check_dpo_settings(
    types: Sequence[str], *, label_smoothing: float = 0.0, discopop_tau: float | None = None
) -> float:
    """Checks the hyper-parameters of the DPO ``types`` before anything is traced.

    Returns:
      The ``discopop`` temperature to use (``discopop_tau`` or its default 0.05).

    Raises:
      ValueError: ``label_smoothing`` outside [0, 0.5] or without effect on ``types``, ``robust``
        with ε ≥ 0.5, ``exo_pair`` with ε = 0, ``discopop_tau`` without ``discopop`` or ≤ 0.
    """
    _check_label_smoothing(label_smoothing, types)
    if discopop_tau is not None and "discopop" not in types:
        raise ValueError(f"discopop_tau has no effect on loss_type {types}")
    tau = _DEFAULT_DISCOPOP_TAU if discopop_tau is None else discopop_tau
    check_positive("discopop_tau", tau)
    return tau


def _check_label_smoothing(label_smoothing: float, types: Sequence[str]) -> None:
    check_label_smoothing(label_smoothing)
    if label_smoothing > 0 and not any(t in _SMOOTHED for t in types):
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect on loss_type {types}; "
            f"it applies to {_SMOOTHED}"
        )
    if "robust" in types and label_smoothing >= 0.5:
        raise ValueError(
            f"loss_type 'robust' divides by 1 − 2ε: label_smoothing must be < 0.5, "
            f"got {label_smoothing}"
        )
    if "exo_pair" in types and label_smoothing <= 0:
        raise ValueError(
            "loss_type 'exo_pair' takes log(ε): label_smoothing must be > 0 "
            "(TRL uses 1e-3 when unset)"
        )


def _guarded_length(name: str, length: Array | None, like: Array) -> Array | None:
    if length is None:
        return None
    check_same_shape(**{"chosen": like, name: length})
    return jnp.maximum(f32(length), 1.0)


def dpo(
    chosen: Array,
    rejected: Array,
    ref_chosen: Array,
    ref_rejected: Array,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_len: Array | None = None,
    rejected_len: Array | None = None,
    **loss_kwargs: Any,
) -> Array:
    """Per-pair DPO-family loss with ``c = chosen − ref_chosen``, ``ρ = rejected − ref_rejected``.

    With ``Δ = c − ρ``, ``z = βΔ``, ``ε = label_smoothing``, ``n`` = completion token counts
    (guarded with ``max(n, 1)``):

    - ``sigmoid``: ``−(1−ε)·logσ(z) − ε·logσ(−z)``. DPO (Rafailov 2023); ε > 0 is cDPO
      (Mitchell 2023).
    - ``hinge``: ``relu(1 − z)``. SLiC (Zhao 2023).
    - ``ipo``: ``(c/n_w − ρ/n_l − 1/(2β))²``. IPO (Azar 2023).
    - ``robust``: ``[−(1−ε)·logσ(z) + ε·logσ(−z)] / (1 − 2ε)``. rDPO (Chowdhury 2024).
    - ``exo_pair``: ``σ(z)·(logσ(z) − log(1−ε)) + σ(−z)·(logσ(−z) − log ε)``. EXO (Ji 2024).
    - ``nca_pair``: ``−logσ(βc) − ½·logσ(−βc) − ½·logσ(−βρ)``. NCA (Chen 2024).
    - ``bco_pair``: ``−logσ(βc) − logσ(−βρ)``. BCO (Jung 2024).
    - ``sppo_hard``: ``(c − 1/(2β))² + (ρ + 1/(2β))²``. SPPO (Wu 2024).
    - ``apo_zero``: ``(1 − σ(βc)) + σ(βρ)``. APO (D'Oosterlinck 2024).
    - ``apo_down``: ``σ(βc) + (1 − σ(z))``. APO (D'Oosterlinck 2024).
    - ``discopop``: ``(1 − μ)·(−logσ(z)) + μ·exp(−z)``, ``μ = σ(z/τ)``. DiscoPOP (Lu 2024).
    - ``sigmoid_norm``: ``−logσ(β·(c/n_w − ρ/n_l))``, DPO on length-normalised log ratios.

    ``bco_pair`` is the spec's form without BCO's running reward shift δ (TRL keeps a
    running mean of the rewards for it). ``discopop`` is unbounded above when ``τ ≥ 1``
    and ``z → −∞`` (its ``μ·exp(−z)`` term then grows without limit).

    A weighted mixture (MPO, Wang et al. 2024) is a sequence of loss types with
    ``loss_weights`` in ``loss_kwargs``:
    ``dpo(..., loss_type=("sigmoid", "bco_pair"), loss_weights=(0.8, 0.2))`` returns
    ``0.8·L_sigmoid + 0.2·L_bco_pair`` (weights default to 1 each).

    Args:
      chosen: ``[N]`` summed policy log-probs of the chosen completions (carry the gradient).
        Scalars (rank 0) are accepted too, so the function can be vmapped over pairs.
      rejected: ``[N]`` summed policy log-probs of the rejected completions.
      ref_chosen: ``[N]`` summed reference log-probs of the chosen completions.
      ref_rejected: ``[N]`` summed reference log-probs of the rejected completions.
      beta: ``β > 0``, the inverse temperature of the implicit reward.
      loss_type: one of :data:`LOSS_TYPES`, or a sequence of them (a mixture).
      label_smoothing: ``ε ∈ [0, 0.5]``, used by ``sigmoid``, ``robust`` (``ε < 0.5``) and
        ``exo_pair`` (``ε > 0``); a non-zero value with none of these is an error.
      chosen_len: ``[N]`` token counts of the chosen completions (``ipo``, ``sigmoid_norm``).
      rejected_len: ``[N]`` token counts of the rejected completions.
      **loss_kwargs: ``loss_weights`` (one non-negative float per loss type) and
        ``discopop_tau`` (``τ > 0``, default 0.05).

    Returns:
      ``[N]`` float32 per-pair losses.

    Raises:
      ValueError: on an unknown loss type or keyword, a bad hyper-parameter, mismatched shapes,
        or ``ipo`` / ``sigmoid_norm`` without ``chosen_len`` and ``rejected_len``.
    """
    unknown = sorted(set(loss_kwargs) - set(DPO_LOSS_KWARGS))
    if unknown:
        raise ValueError(f"unknown loss_kwargs {unknown}; dpo accepts {DPO_LOSS_KWARGS}")
    types, weights = _loss_types_and_weights(loss_type, loss_kwargs.get("loss_weights"))
    check_positive("beta", beta)
    tau = check_dpo_settings(
        types, label_smoothing=label_smoothing, discopop_tau=loss_kwargs.get("discopop_tau")
    )

    check_rank("chosen", chosen, (0, 1))
    check_same_shape(
        chosen=chosen, rejected=rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    needs_lengths = [t for t in types if t in _LENGTH_NORMALISED]
    if needs_lengths and (chosen_len is None or rejected_len is None):
        raise ValueError(
            f"loss_type {needs_lengths} normalises by completion length: pass chosen_len and "
            "rejected_len (token counts, e.g. sequence_lengths(mask))"
        )
    hp = _Hyper(
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=tau,
        chosen_len=_guarded_length("chosen_len", chosen_len, chosen),
        rejected_len=_guarded_length("rejected_len", rejected_len, chosen),
    )
    c = f32(chosen) - f32(ref_chosen)
    rho = f32(rejected) - f32(ref_rejected)
    return sum(w * _DPO_LOSSES[t](c, rho, hp) for t, w in zip(types, weights))
