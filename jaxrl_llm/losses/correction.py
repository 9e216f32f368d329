"""Rollout correction: the sampler/trainer mismatch as pure, jit-able functions over ``[B, T]``.

The policy that sampled a batch (the rollout engine: other kernels, bf16, an older version of
the weights in an asynchronous loop) is not exactly the policy the trainer scores it with.
With ``log_ratio = log π_train(y_t) − log π_rollout(y_t)`` on the sampled tokens ``y``:

- :func:`is_weights` — truncated importance sampling (TIS; Yao et al., 2025, "Your efficient
  RL framework secretly brings you off-policy RL training") ``w = min(ρ, C)`` or, with a lower
  bound, IcePop's band (Ling team, 2025) that zeroes ``ρ ∉ [lower, upper]``; per token
  (``ρ_t``) or per sequence (``Π_t ρ_t``).
- :func:`rejection_mask` — hard trust-region masks from divergence estimators per token or per
  sequence (Liu, Li et al., 2025, "When Speed Kills Stability: Demystifying RL Collapse from
  the Training-Inference Mismatch").
- :func:`offpolicy_metrics` — KL (k1, k3), χ², perplexities and their log difference, ESS.

Every function matches verl's ``rollout_corr_helper`` (its current ``compute_*`` functions),
option and metric names included: exponentials take log-ratios clamped to ±20, masked means
divide by ``Σm + 1e-8``, weights carry no gradient, padding counts for nothing (even -inf or
NaN); all-masked inputs give zeros (verl raises; a jitted function cannot).

:class:`Correction` is the objective-level setting (``objectives.make(...,
rollout_correction={...})``): ``mode="decoupled"`` multiplies the surrogate by the IS weights
of the trainer's old log-probs against the rollout's (three policies: rollout, old, current);
``mode="bypass"`` takes the rollout log-probs as the old policy (no old-log-prob forward) and
measures the current policy against them. :func:`apply` is verl's
``compute_rollout_correction_and_rejection_mask``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import _checks
from jaxrl_llm.losses import masked as ms

Array = jax.Array

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
MODES = ("decoupled", "bypass")
TOKEN_CRITERIA = ("token_k1", "token_k2", "token_k3")
_SEQ = tuple(f"seq_{stat}_k{n}" for stat in ("sum", "mean") for n in (1, 2, 3))
CRITERIA = (*TOKEN_CRITERIA, *_SEQ, "seq_max_k2", "seq_max_k3")


def _inputs(log_ratio: Array, mask: Array) -> tuple[Array, Array]:
    """f32 inputs, padding set to 0 (so -inf or NaN there reaches no value or gradient)."""
    mask = _checks.as_mask(mask)
    _checks.check_rank("mask", mask, 2)
    _checks.check_batch_time("log_ratio", log_ratio, mask)
    return jnp.where(mask > 0, _checks.f32(log_ratio), 0.0), mask


# -- importance weights --------------------------------------------------------------------------


def check_is_bounds(upper: float, lower: float | None) -> None:
    if not upper > 0 or lower is not None and not 0 < lower <= upper:
        raise ValueError(f"IS bounds need 0 < lower <= upper, got lower={lower!r}, upper={upper!r}")


def is_weights(
    log_ratio: Array,
    mask: Array,
    *,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """Truncated (TIS) or band-masked (IcePop) importance weights ``π_train / π_rollout``.

    ``level="token"``: ``ρ_t = exp(clip(log_ratio_t, ±20))``; ``level="sequence"``: every token
    of a row gets ``exp(clip(Σ_t m_t·log_ratio_t, ±20))`` (unbiased, high variance). Then
    ``w = min(ρ, upper)`` (TIS) or, with ``lower``, ``w = ρ·[lower ≤ ρ ≤ upper]`` (IcePop);
    ``w = 0`` on padding; no gradient. ``batch_normalize`` divides by the mean weight (over
    valid tokens, or over non-empty rows at sequence level) when it exceeds 1e-8.

    Args:
      log_ratio: ``[B, T]`` ``log π_train − log π_rollout``.
      mask: ``[B, T]`` valid tokens.
      level: ``"token"`` or ``"sequence"``.
      upper: truncation (TIS) or upper band edge (IcePop), > 0.
      lower: IcePop's lower band edge in ``(0, upper]``; None = TIS.
      batch_normalize: rescale to mean 1 over the batch given.

    Returns:
      ``(weights [B, T] f32, metrics)``; metrics as verl's ``rollout_is_*``: mean, max, min,
      std, eff_sample_size, ratio_fraction_high / _low, seq_mean / _std / _max / _min /
      _max_deviation / _fraction_high / _fraction_low, oob_ratio (IcePop), batch_norm_factor;
      the per-row ones over the rows with a valid token (verl: every row; see
      ``offpolicy_metrics``).

    Raises:
      ValueError: a bad level or bound, or shapes that differ.
    """
    _checks.check_choice("IS level", level, IS_LEVELS)
    check_is_bounds(upper, lower)
    log_ratio, mask = _inputs(log_ratio, mask)
    if level == "token":
        log_for_metrics = log_ratio
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = ms.masked_sum(log_ratio, mask, axis=-1)[:, None]
        raw = jnp.broadcast_to(
            jnp.exp(jnp.clip(log_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape
        )
    raw = raw * mask
    if lower is None:
        weights = jnp.minimum(raw, upper)
    else:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _is_metrics(weights, raw, log_for_metrics, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = ms.masked_mean(
            ((raw < lower) | (raw > upper)) * 1.0, mask
        )
    weights = jax.lax.stop_gradient(weights)
    if batch_normalize:
        if level == "token":
            mean = ms.masked_mean(weights, mask)
        else:
            rows = jnp.sum(mask, axis=-1) > 0
            mean = ms.row_mean(ms.masked_mean(weights, mask, axis=-1), rows)
        ok = mean > ms.EPS
        weights = jnp.where(ok, weights / jnp.where(ok, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return weights, metrics


def _is_metrics(weights, raw, log_for_metrics, mask, level, upper, lower) -> dict[str, Array]:
    """verl's ``compute_is_metrics``: statistics of the applied and the raw weights."""
    low = 1.0 / upper if lower is None else lower
    rows = jnp.any(mask > 0, axis=-1)  # per-row statistics skip rows without a valid token
    m: dict[str, Array] = {"rollout_is_mean": ms.masked_mean(weights, mask)}
    if level == "sequence":
        seq_log = log_for_metrics[:, 0]
        m["rollout_is_max"] = jnp.exp(
            jnp.minimum(ms.extreme(seq_log, rows, jnp.max, -jnp.inf), SAFETY_BOUND)
        )
        m["rollout_is_min"] = jnp.exp(ms.extreme(seq_log, rows, jnp.min, jnp.inf))
        m["rollout_is_ratio_fraction_high"] = ms.row_mean(seq_log > math.log(upper), rows)
        m["rollout_is_ratio_fraction_low"] = ms.row_mean(seq_log < math.log(low), rows)
    else:
        m["rollout_is_ratio_fraction_high"] = ms.masked_mean((raw > upper) * 1.0, mask)
        m["rollout_is_ratio_fraction_low"] = ms.masked_mean((raw < low) * 1.0, mask)
        m["rollout_is_max"] = ms.extreme(weights, mask, jnp.max, -jnp.inf)
        m["rollout_is_min"] = ms.extreme(weights, mask, jnp.min, jnp.inf)
    m["rollout_is_std"] = ms.clamped_std(weights, mask, 0.0, upper)
    clamped = jnp.clip(weights, 0.0, upper)
    normalized = clamped / (ms.masked_mean(clamped, mask) + ms.EPS)
    m["rollout_is_eff_sample_size"] = ms.inverse(ms.masked_mean(normalized**2, mask))
    seq = ms.masked_mean(weights, mask, axis=-1)
    m["rollout_is_seq_mean"] = ms.row_mean(seq, rows)
    m["rollout_is_seq_std"] = ms.std(seq, rows)
    m["rollout_is_seq_max"] = ms.extreme(seq, rows, jnp.max, -jnp.inf)
    m["rollout_is_seq_min"] = ms.extreme(seq, rows, jnp.min, jnp.inf)
    m["rollout_is_seq_max_deviation"] = ms.extreme(jnp.abs(seq - 1.0), rows, jnp.max, -jnp.inf)
    raw_seq = ms.masked_mean(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = ms.row_mean(raw_seq > upper, rows)
    m["rollout_is_seq_fraction_low"] = ms.row_mean(raw_seq < low, rows)
    return m


# -- rejection -----------------------------------------------------------------------------------


def parse_criteria(criteria: Mapping[str, Any]) -> tuple[tuple[str, tuple[float, float]], ...]:
    """``{name: threshold}`` -> ``((name, (lower, upper)), ...)`` in the given order.

    ``*_k1`` criteria bound the ratio ``π_rollout / π_train`` to ``[lower, upper]`` (a pair; a
    single number ``u`` means ``[1/u, u]``); the others take one upper bound on the divergence
    (lower reported as 0).

    Raises:
      ValueError: an unknown name, an empty mapping, or a bound that is not positive.
    """
    if not isinstance(criteria, Mapping) or not criteria:
        raise ValueError(
            f"rejection criteria must be a non-empty mapping {{name: threshold}}, got "
            f"{criteria!r}; names: {CRITERIA}"
        )
    out = []
    for name, spec in criteria.items():
        _checks.check_choice("rejection criterion", name, CRITERIA)
        if name.endswith("k1"):
            if isinstance(spec, int | float) and not isinstance(spec, bool):
                spec = (1.0 / spec if spec > 0 else spec, spec)
            if not (isinstance(spec, list | tuple) and len(spec) == 2):
                raise ValueError(
                    f"rejection criterion {name}: a (lower, upper) ratio band or one number, "
                    f"got {spec!r}"
                )
            lower, upper = (float(v) for v in spec)
            if not 0 < lower <= upper:
                raise ValueError(f"rejection criterion {name}: need 0 < lower <= upper, got {spec}")
        else:
            if isinstance(spec, bool) or not isinstance(spec, int | float) or not spec > 0:
                raise ValueError(
                    f"rejection criterion {name}: one positive upper bound, got {spec!r}"
                )
            lower, upper = 0.0, float(spec)
        out.append((name, (lower, upper)))
    return tuple(out)


def rejection_mask(
    log_ratio: Array, mask: Array, *, criteria: Mapping[str, Any]
) -> tuple[Array, dict[str, Array]]:
    """A hard trust region: ``mask`` with the tokens (or whole rows) of failed criteria zeroed.

    With ``r = clip(log_ratio, ±20)``, the per-token divergences are ``k1 = −r``,
    ``k2 = r²/2``, ``k3 = e^r − 1 − r`` (Schulman's estimators of ``KL(π_rollout‖π_train)``).
    ``token_kN`` tests each token; ``seq_sum_kN`` / ``seq_mean_kN`` / ``seq_max_kN`` test the
    row's masked sum / mean / max and keep or drop the whole row. k1 criteria keep
    ``log(lower) ≤ stat ≤ log(upper)``, the others ``stat ≤ upper``. Every criterion must pass.

    Args:
      log_ratio: ``[B, T]`` ``log π_train − log π_rollout``.
      mask: ``[B, T]`` valid tokens.
      criteria: ``{name: threshold}`` (:func:`parse_criteria`), names as verl's ``rollout_rs``.

    Returns:
      ``(mask [B, T] f32, metrics)``; per criterion ``rollout_rs_{name}_``: mean, max, min,
      std, fraction_high / _low, seq_mean / _std / _max / _min / _max_deviation /
      _fraction_high (/ _fraction_low for k1), masked_fraction, seq_masked_fraction; and
      ``rollout_rs_masked_fraction`` / ``rollout_rs_seq_masked_fraction`` for all together.
    """
    parsed = parse_criteria(criteria)
    log_ratio, mask = _inputs(log_ratio, mask)
    r = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -r, "k2": 0.5 * r**2, "k3": jnp.expm1(r) - r}
    valid_rows = jnp.sum(mask, axis=-1) > 0
    valid = mask > 0
    keep_all = jnp.ones_like(mask)
    metrics: dict[str, Array] = {}
    for name, (lower, upper) in parsed:
        k1 = name.endswith("k1")
        low, high = (math.log(lower), math.log(upper)) if k1 else (0.0, upper)
        stat = per_token[name[-2:]]
        if name in TOKEN_CRITERIA:
            seq_stat = None
            keep = (stat >= low) & (stat <= high) if k1 else stat <= high
        else:
            if name.startswith("seq_sum"):
                seq_stat = ms.masked_sum(stat, mask, axis=-1)
            elif name.startswith("seq_mean"):
                seq_stat = ms.masked_mean(stat, mask, axis=-1)
            else:
                seq_stat = jnp.max(jnp.where(valid, stat, -jnp.inf), axis=-1)
                seq_stat = jnp.where(valid_rows, seq_stat, 0.0)  # an empty row: 0
            seq_keep = (seq_stat >= low) & (seq_stat <= high) if k1 else seq_stat <= high
            keep = jnp.broadcast_to(seq_keep[:, None], mask.shape)
            stat = jnp.broadcast_to(seq_stat[:, None], mask.shape)
        metrics.update(_rs_metrics(name, stat, seq_stat, mask, valid_rows, low, high, k1))
        keep = keep.astype(jnp.float32)
        keep_all = keep_all * keep
        prefix = f"rollout_rs_{name}"
        metrics[f"{prefix}_masked_fraction"] = ms.masked_mean(1.0 - keep, mask)
        row_kept = jnp.all(~((keep == 0) & valid), axis=-1)
        metrics[f"{prefix}_seq_masked_fraction"] = ms.row_mean(~row_kept, valid_rows)
    metrics["rollout_rs_masked_fraction"] = ms.masked_mean(1.0 - keep_all, mask)
    dropped = (keep_all <= 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = ms.row_mean(jnp.any(dropped, axis=-1), valid_rows)
    return mask * keep_all, metrics


def _rs_metrics(name, stat, seq_stat, mask, valid_rows, low, high, k1) -> dict[str, Array]:
    """verl's ``compute_rs_metrics`` for one criterion."""
    p = f"rollout_rs_{name}"
    seq = ms.masked_mean(stat, mask, axis=-1) if seq_stat is None else seq_stat
    m: dict[str, Array] = {f"{p}_mean": ms.masked_mean(stat, mask)}
    token_max = ms.extreme(stat, mask, jnp.max, -jnp.inf)
    token_min = ms.extreme(stat, mask, jnp.min, jnp.inf)
    rows_max = ms.extreme(seq, valid_rows, jnp.max, -jnp.inf)
    rows_min = ms.extreme(seq, valid_rows, jnp.min, jnp.inf)
    any_rows = jnp.any(valid_rows)
    seq_high = ms.row_mean(seq > high, valid_rows)
    seq_low = ms.row_mean(seq < low, valid_rows)
    if seq_stat is None:  # a token criterion: token statistics
        m[f"{p}_max"], m[f"{p}_min"] = token_max, token_min
        m[f"{p}_fraction_high"] = ms.masked_mean((stat > high) * 1.0, mask)
        m[f"{p}_fraction_low"] = ms.masked_mean((stat < low) * 1.0, mask) if k1 else jnp.float32(0)
    else:
        m[f"{p}_max"] = jnp.where(any_rows, rows_max, token_max)
        m[f"{p}_min"] = jnp.where(any_rows, rows_min, token_min)
        m[f"{p}_fraction_high"] = seq_high
        m[f"{p}_fraction_low"] = seq_low if k1 else jnp.float32(0)
    m[f"{p}_std"] = ms.clamped_std(stat, mask, low, high)
    m[f"{p}_seq_mean"] = ms.row_mean(seq, valid_rows)
    m[f"{p}_seq_std"] = ms.std(seq, valid_rows)
    m[f"{p}_seq_max"] = rows_max
    m[f"{p}_seq_min"] = rows_min
    m[f"{p}_seq_max_deviation"] = ms.extreme(jnp.abs(seq), valid_rows, jnp.max, -jnp.inf)
    m[f"{p}_seq_fraction_high"] = seq_high
    if k1:
        m[f"{p}_seq_fraction_low"] = seq_low
    return m


# -- diagnostics ---------------------------------------------------------------------------------


def offpolicy_metrics(
    train_logprobs: Array, rollout_logprobs: Array, mask: Array, *, threshold: float = 2.0
) -> dict[str, Array]:
    """How far the rollout policy is from the trainer's, on the sampled tokens.

    With ``d = log π_train − log π_rollout`` and per-row means ``ℓ_train``, ``ℓ_rollout`` of
    the log-probs: ``kl = E[−d]`` (k1 of ``KL(π_rollout‖π_train)``), ``k3_kl = E[e^d − 1 − d]``,
    ``training_ppl = mean_rows exp(−ℓ_train)`` (``rollout_ppl`` likewise) and their logs,
    ``log_ppl_diff = mean(ℓ_rollout − ℓ_train)`` (and its abs / max / min), ``ppl_ratio =
    mean exp(ℓ_rollout − ℓ_train)``, ``chi2_token = E[ρ²] − 1``, ``chi2_seq = mean_rows
    (Πρ)² − 1`` (verl's ``compute_offpolicy_metrics``); beyond verl: ``ess`` (the effective
    sample size fraction ``1 / E[(ρ/Eρ)²]`` of the raw token ratios) and
    ``ratio_fraction_high`` / ``_low`` (tokens with ``ρ > threshold`` / ``ρ < 1/threshold``).
    ``E`` is the mean over valid tokens, ``mean_rows`` (and max / min) over the rows with at
    least one (verl: every row; it never gets an empty one, dynamic sampling's filler rows
    here are); with none at all the perplexities are 1 and the rest 0. ``d`` is clamped to
    ±20 inside every exponential.
    """
    rollout, mask = _inputs(rollout_logprobs, mask)
    _checks.check_batch_time("train_logprobs", train_logprobs, mask)
    train = jnp.where(mask > 0, _checks.f32(train_logprobs), 0.0)
    _checks.check_positive("threshold", threshold)
    d = train - rollout
    clipped = jnp.clip(d, -SAFETY_BOUND, SAFETY_BOUND)
    rho = jnp.exp(clipped)
    lp_train = ms.masked_mean(train, mask, axis=-1)
    lp_rollout = ms.masked_mean(rollout, mask, axis=-1)
    diff = lp_rollout - lp_train
    seq_log = jnp.clip(ms.masked_sum(d, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    rows = jnp.any(mask > 0, axis=-1)  # per-row statistics skip rows without a valid token
    return {
        "training_ppl": ms.row_mean(jnp.exp(-lp_train), rows, empty=1.0),
        "training_log_ppl": ms.row_mean(-lp_train, rows),
        "kl": ms.masked_mean(rollout - train, mask),
        "k3_kl": ms.masked_mean(jnp.expm1(clipped) - clipped, mask),
        "rollout_ppl": ms.row_mean(jnp.exp(-lp_rollout), rows, empty=1.0),
        "rollout_log_ppl": ms.row_mean(-lp_rollout, rows),
        "log_ppl_diff": ms.row_mean(diff, rows),
        "log_ppl_abs_diff": ms.row_mean(jnp.abs(diff), rows),
        "log_ppl_diff_max": ms.extreme(diff, rows, jnp.max, -jnp.inf),
        "log_ppl_diff_min": ms.extreme(diff, rows, jnp.min, jnp.inf),
        "ppl_ratio": ms.row_mean(
            jnp.exp(jnp.clip(diff, -SAFETY_BOUND, SAFETY_BOUND)), rows, empty=1.0
        ),
        "chi2_token": ms.masked_mean(rho**2, mask) - 1.0,
        "chi2_seq": ms.row_mean(jnp.expm1(2.0 * seq_log), rows),
        "ess": ms.inverse(ms.masked_mean((rho / (ms.masked_mean(rho, mask) + ms.EPS)) ** 2, mask)),
        "ratio_fraction_high": ms.masked_mean((rho > threshold) * 1.0, mask),
        "ratio_fraction_low": ms.masked_mean((rho < 1.0 / threshold) * 1.0, mask),
    }


# -- the objective-level setting -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Correction:
    """Rollout correction of an objective (hashable: it is part of the jit-static objective).

    Attributes:
      mode: ``"decoupled"`` (IS weights of the trainer's old log-probs against the rollout's
        multiply the surrogate; needs the old-log-prob forward) or ``"bypass"`` (the rollout
        log-probs are the old policy; the current policy is measured against them, and IS
        weights apply only to ratio-free surrogates such as ``reinforce``, whose ratio would
        otherwise count them twice — verl's ``bypass_mode``).
      is_level: ``"token"``, ``"sequence"`` or None (no IS weights, rejection only).
      is_upper: TIS truncation / IcePop upper edge.
      is_lower: IcePop lower edge; None = TIS.
      batch_normalize: rescale the weights to mean 1 over the batch (the micro-batch, when
        computed inside the loss).
      rejection: ``((criterion, (lower, upper)), ...)`` (:func:`parse_criteria`; a mapping is
        accepted and converted).
    """

    mode: str = "decoupled"
    is_level: str | None = "token"
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rejection: Any = ()

    def __post_init__(self):
        _checks.check_choice("rollout_correction.mode", self.mode, MODES)
        _checks.check_choice("rollout_correction.is_level", self.is_level, (*IS_LEVELS, None))
        check_is_bounds(self.is_upper, self.is_lower)
        rejection = () if self.rejection is None else self.rejection
        if not isinstance(rejection, Mapping):  # pairs, e.g. parse_criteria's own output
            if not all(isinstance(p, list | tuple) and len(p) == 2 for p in rejection):
                raise ValueError(
                    f"rollout_correction.rejection must be {{criterion: threshold}}, got "
                    f"{self.rejection!r}"
                )
            rejection = {name: _unparsed(name, spec) for name, spec in rejection}
        object.__setattr__(self, "rejection", parse_criteria(rejection) if rejection else ())
        if self.is_level is None and not self.rejection and self.mode == "decoupled":
            raise ValueError(
                "rollout_correction does nothing: set is_level (token|sequence) or rejection "
                "criteria, or mode=bypass"
            )

    def weights(self, log_ratio: Array, mask: Array) -> tuple[Array, dict[str, Array]]:
        """:func:`is_weights` with this setting's level, bounds and normalisation."""
        return is_weights(
            log_ratio,
            mask,
            level=self.is_level,
            upper=self.is_upper,
            lower=self.is_lower,
            batch_normalize=self.batch_normalize,
        )

    @property
    def criteria(self) -> dict[str, Any]:
        """:attr:`rejection` as :func:`rejection_mask` takes it."""
        return {name: _unparsed(name, spec) for name, spec in self.rejection}

    @classmethod
    def of(cls, value: Correction | Mapping[str, Any] | None) -> Correction | None:
        """A ``Correction`` from itself, a mapping of its fields, or None."""
        if value is None or isinstance(value, Correction):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"rollout_correction must be a mapping, got {value!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"unknown rollout_correction key(s) {unknown}; valid keys: {sorted(fields)}"
            )
        return cls(**value)


def _unparsed(name: str, spec: Any) -> Any:
    """A criterion's threshold as given, from :func:`parse_criteria`'s ``(0, upper)`` too."""
    parsed = isinstance(spec, tuple | list) and len(spec) == 2 and spec[0] == 0.0
    return spec[1] if parsed and not name.endswith("k1") else spec


def apply(
    spec: Correction, train_logprobs: Array, rollout_logprobs: Array, mask: Array
) -> tuple[Array | None, Array, dict[str, Array]]:
    """IS weights, the rejection mask and every metric for one batch (prefix ``rollout_corr/``).

    Returns:
      ``(weights [B, T] or None when spec.is_level is None, mask [B, T] f32, metrics)``.
    """
    train = jax.lax.stop_gradient(_checks.f32(train_logprobs))
    rollout, mask = _inputs(rollout_logprobs, mask)
    log_ratio = train - rollout
    metrics: dict[str, Array] = {}
    weights = None
    if spec.is_level is not None:
        weights, m = spec.weights(log_ratio, mask)
        metrics.update(m)
    kept = mask
    if spec.rejection:
        kept, m = rejection_mask(log_ratio, mask, criteria=spec.criteria)
        metrics.update(m)
    metrics.update(offpolicy_metrics(train, rollout, mask, threshold=spec.is_upper))
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
