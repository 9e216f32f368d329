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
from jaxrl_llm.preference._sequence import check_label_smoothing, token_mean_nll

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
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)

_SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
_NEEDS_CHOSEN_LEN = ("ipo", "sigmoid_norm", "sft")
_NEEDS_REJECTED_LEN = ("ipo", "sigmoid_norm")
#: Loss types whose value on one pair depends on the other pairs of the batch.
BATCH_COUPLED: tuple[str, ...] = ("aot", "aot_unpaired", "sft")
DPO_LOSS_KWARGS = ("loss_weights", "discopop_tau")
_DEFAULT_DISCOPOP_TAU = 0.05

# --------------------------------------------------------------------------------------------
# DPO loss types: one small function per row of the SPEC_LOSSES.md table.


class _Pair(NamedTuple):
    chosen: Array  # [N] f32 summed policy log-probs
    rejected: Array
    ref_chosen: Array
    ref_rejected: Array
    c: Array  # chosen − ref_chosen
    rho: Array  # rejected − ref_rejected


class _Hyper(NamedTuple):
    beta: float
    label_smoothing: float
    discopop_tau: float
    chosen_len: Array | None  # [N] f32 token counts, unguarded
    rejected_len: Array | None


def _per_token(score: Array, length: Array) -> Array:
    return score / jnp.maximum(length, 1.0)


def _smoothed_sigmoid(z: Array, eps: float) -> Array:
    return -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def _sorted_over_batch(x: Array) -> Array:
    # A scalar (one pair, e.g. under vmap) is its own sorted batch.
    return jnp.sort(x, axis=0) if x.ndim else x


def _sigmoid(p: _Pair, hp: _Hyper) -> Array:
    return _smoothed_sigmoid(hp.beta * (p.c - p.rho), hp.label_smoothing)


def _hinge(p: _Pair, hp: _Hyper) -> Array:
    return jax.nn.relu(1.0 - hp.beta * (p.c - p.rho))


def _ipo(p: _Pair, hp: _Hyper) -> Array:
    delta = _per_token(p.c, hp.chosen_len) - _per_token(p.rho, hp.rejected_len)
    return jnp.square(delta - 1.0 / (2.0 * hp.beta))


def _robust(p: _Pair, hp: _Hyper) -> Array:
    z = hp.beta * (p.c - p.rho)
    eps = hp.label_smoothing
    return (-(1.0 - eps) * log_sigmoid(z) + eps * log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def _exo_pair(p: _Pair, hp: _Hyper) -> Array:
    z = hp.beta * (p.c - p.rho)
    eps = hp.label_smoothing
    return sigmoid(z) * (log_sigmoid(z) - math.log1p(-eps)) + sigmoid(-z) * (
        log_sigmoid(-z) - math.log(eps)
    )


def _nca_pair(p: _Pair, hp: _Hyper) -> Array:
    bc, brho = hp.beta * p.c, hp.beta * p.rho
    return -log_sigmoid(bc) - 0.5 * log_sigmoid(-bc) - 0.5 * log_sigmoid(-brho)


def _bco_pair(p: _Pair, hp: _Hyper) -> Array:
    return -log_sigmoid(hp.beta * p.c) - log_sigmoid(-hp.beta * p.rho)


def _sppo_hard(p: _Pair, hp: _Hyper) -> Array:
    half_inv_beta = 1.0 / (2.0 * hp.beta)
    return jnp.square(p.c - half_inv_beta) + jnp.square(p.rho + half_inv_beta)


def _aot(p: _Pair, hp: _Hyper) -> Array:
    policy = _sorted_over_batch(p.chosen - p.rejected)
    reference = _sorted_over_batch(p.ref_chosen - p.ref_rejected)
    return _smoothed_sigmoid(hp.beta * (policy - reference), hp.label_smoothing)


def _aot_unpaired(p: _Pair, hp: _Hyper) -> Array:
    delta = _sorted_over_batch(p.c) - _sorted_over_batch(p.rho)
    return _smoothed_sigmoid(hp.beta * delta, hp.label_smoothing)


def _apo_zero(p: _Pair, hp: _Hyper) -> Array:
    # 1 − σ(x) written as σ(−x): exact in the tail where σ(x) rounds to 1.
    return sigmoid(-hp.beta * p.c) + sigmoid(hp.beta * p.rho)


def _apo_down(p: _Pair, hp: _Hyper) -> Array:
    return sigmoid(hp.beta * p.c) + sigmoid(-hp.beta * (p.c - p.rho))


def _discopop(p: _Pair, hp: _Hyper) -> Array:
    z = hp.beta * (p.c - p.rho)
    tau = hp.discopop_tau
    # μ·exp(−z) as exp(logσ(z/τ) − z): the naive product is 0·inf = NaN once z ≪ 0.
    return sigmoid(-z / tau) * -log_sigmoid(z) + jnp.exp(log_sigmoid(z / tau) - z)


def _sft(p: _Pair, hp: _Hyper) -> Array:
    return token_mean_nll(p.chosen, hp.chosen_len)


def _sigmoid_norm(p: _Pair, hp: _Hyper) -> Array:
    delta = _per_token(p.c, hp.chosen_len) - _per_token(p.rho, hp.rejected_len)
    return -log_sigmoid(hp.beta * delta)


_DPO_LOSSES = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "discopop": _discopop,
    "sft": _sft,
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
            "(TRL raises too; the EXO paper recommends 1e-3)"
        )


def _length(name: str, length: Array | None, like: Array) -> Array | None:
    if length is None:
        return None
    check_same_shape(**{"chosen": like, name: length})
    return f32(length)


def _check_lengths(types: Sequence[str], chosen_len: Array | None, rejected_len: Array | None):
    missing = [
        (t, name)
        for t in types
        for name, given, needed in (
            ("chosen_len", chosen_len, _NEEDS_CHOSEN_LEN),
            ("rejected_len", rejected_len, _NEEDS_REJECTED_LEN),
        )
        if t in needed and given is None
    ]
    if missing:
        raise ValueError(
            f"loss_type {sorted({t for t, _ in missing})} needs completion token counts: pass "
            f"{sorted({n for _, n in missing})} (e.g. sequence_lengths(mask))"
        )


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
    (guarded with ``max(n, 1)`` where they divide one pair's score), ``S_ε(x) =
    −(1−ε)·logσ(x) − ε·logσ(−x)`` and ``sort`` an ascending sort over the ``N`` pairs:

    - ``sigmoid``: ``S_ε(z)``. DPO (Rafailov 2023); ε > 0 is cDPO (Mitchell 2023).
    - ``hinge``: ``relu(1 − z)``. SLiC (Zhao 2023).
    - ``ipo``: ``(c/n_w − ρ/n_l − 1/(2β))²``. IPO (Azar 2023).
    - ``robust``: ``[−(1−ε)·logσ(z) + ε·logσ(−z)] / (1 − 2ε)``. rDPO (Chowdhury 2024).
    - ``exo_pair``: ``σ(z)·(logσ(z) − log(1−ε)) + σ(−z)·(logσ(−z) − log ε)``. EXO (Ji 2024).
    - ``nca_pair``: ``−logσ(βc) − ½·logσ(−βc) − ½·logσ(−βρ)``. NCA (Chen 2024).
    - ``bco_pair``: ``−logσ(βc) − logσ(−βρ)``. BCO (Jung 2024).
    - ``sppo_hard``: ``(c − 1/(2β))² + (ρ + 1/(2β))²``. SPPO (Wu 2024).
    - ``aot``: ``S_ε(β·δ)``, ``δ = sort(lp_θ(y_w) − lp_θ(y_l)) − sort(lp_ref(y_w) − lp_ref(y_l))``.
      AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via
      Optimal Transport"): first-order stochastic dominance of the policy's chosen-over-rejected
      log ratios over the reference's, through their sorted (quantile) values.
    - ``aot_unpaired``: ``S_ε(β·δ)``, ``δ = sort(c) − sort(ρ)``. AOT, unpaired (Melnyk 2024).
    - ``apo_zero``: ``(1 − σ(βc)) + σ(βρ)``. APO (D'Oosterlinck 2024).
    - ``apo_down``: ``σ(βc) + (1 − σ(z))``. APO (D'Oosterlinck 2024).
    - ``discopop``: ``(1 − μ)·(−logσ(z)) + μ·exp(−z)``, ``μ = σ(z/τ)``. DiscoPOP (Lu 2024).
    - ``sft``: ``−Σ_j lp_θ(y_w^j) / max(Σ_j n_w^j, 1)`` on every pair: the token-mean NLL of
      all the batch's chosen tokens (:func:`token_mean_nll`), not a preference loss but the
      SFT term of mixtures: RPO (Pang 2024) is ``("sigmoid", "sft")``, MPO (Wang 2024)
      ``("sigmoid", "bco_pair", "sft")`` with weights ``(0.8, 0.2, 1.0)``.
    - ``sigmoid_norm``: ``−logσ(β·(c/n_w − ρ/n_l))``, DPO on length-normalised log ratios.

    Every type follows TRL 1.16's ``DPOTrainer`` (``f_divergence_type="reverse_kl"``,
    ``ld_alpha=None``, no WPO weighting), with two stated differences:

    - TRL 1.16 reads ``label_smoothing`` only in ``robust``, ``exo_pair``, ``aot`` and
      ``aot_unpaired``; its ``sigmoid`` ignores it. Here ``sigmoid`` with ε > 0 is cDPO, as the
      cDPO note defines it (and as TRL's CPOTrainer smooths its sigmoid loss); ε = 0 is TRL's.
      Where ε has no effect, a non-zero value is an error here (TRL ignores it silently).
    - ``robust`` with ε ≥ 0.5 is an error here (TRL only warns).

    ``bco_pair`` is, as in TRL 1.16, BCO's loss without a reward shift: the BCO paper shifts
    the rewards by ``δ``, a running mean of them, which older TRL releases kept and TRL 1.16's
    DPOTrainer no longer does (``−logσ(βc) − logσ(−βρ)``, no state). ``exo_pair`` takes ε from
    ``label_smoothing`` and needs ε > 0, as TRL 1.16 (which raises on ε = 0; the EXO paper
    recommends 1e-3). ``discopop`` is unbounded above when ``τ ≥ 1`` and ``z → −∞``.

    ``aot``, ``aot_unpaired`` and ``sft`` (:data:`BATCH_COUPLED`) couple the pairs of the
    batch: one pair's value depends on the others, so a vmap over pairs (which sees one pair
    at a time) or micro-batching changes them, as it does TRL's per-device micro-batches. The
    gradient of a sort goes to the pair whose value lands in each sorted slot (ties: the
    stable order).

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
      label_smoothing: ``ε ∈ [0, 0.5]``, used by ``sigmoid``, ``robust`` (``ε < 0.5``),
        ``exo_pair`` (``ε > 0``), ``aot`` and ``aot_unpaired``; a non-zero value with none of
        these is an error.
      chosen_len: ``[N]`` token counts of the chosen completions (``ipo``, ``sigmoid_norm``,
        ``sft``).
      rejected_len: ``[N]`` token counts of the rejected completions (``ipo``,
        ``sigmoid_norm``).
      **loss_kwargs: ``loss_weights`` (one non-negative float per loss type) and
        ``discopop_tau`` (``τ > 0``, default 0.05).

    Returns:
      ``[N]`` float32 per-pair losses.

    Raises:
      ValueError: on an unknown loss type or keyword, a bad hyper-parameter, mismatched shapes,
        or a loss type without the token counts it needs.
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
    _check_lengths(types, chosen_len, rejected_len)
    hp = _Hyper(
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=tau,
        chosen_len=_length("chosen_len", chosen_len, chosen),
        rejected_len=_length("rejected_len", rejected_len, chosen),
    )
    chosen, rejected = f32(chosen), f32(rejected)
    ref_chosen, ref_rejected = f32(ref_chosen), f32(ref_rejected)
    pair = _Pair(
        chosen, rejected, ref_chosen, ref_rejected, chosen - ref_chosen, rejected - ref_rejected
    )
    return sum(w * _DPO_LOSSES[t](pair, hp) for t, w in zip(types, weights))
