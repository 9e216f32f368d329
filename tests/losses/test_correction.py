"""Tests of jaxrl_llm.losses.correction against float64 NumPy transcriptions of verl's
``verl/trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights`` +
``compute_is_metrics``, ``compute_rollout_rejection_mask`` + ``compute_rs_metrics``,
``compute_offpolicy_metrics``), written from verl's source with ``masked_mean = Σv·m/(Σm+1e-8)``.

Documented deviations the reference follows: log-ratios are clamped to ±20 inside ``k3_kl``
and ``ppl_ratio``; ``ess`` / ``ratio_fraction_*`` of the off-policy metrics are jaxrl_llm's own;
per-row statistics skip rows without a valid token (verl averages over every row, and never
gets an empty one; dynamic sampling's filler rows here are empty).
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.losses import correction

EPS, BOUND = 1e-8, 20.0
RTOL, ATOL = 2e-5, 1e-6
B, T = 6, 7
IS_LEVELS = ("token", "sequence")
LENGTHS = (7, 3, 0, 5, 1, 6)  # ragged; row 2 all-masked, row 4 one token


# -- float64 reference (verl semantics) ------------------------------------------------------------


def msum(v, m, axis=None):
    return np.sum(np.where(m > 0, v, 0.0) * m, axis=axis)


def mmean(v, m, axis=None):
    return msum(v, m, axis) / (np.sum(m, axis=axis) + EPS)


def _clear(stat, threshold, where):
    """f32 rounding must not flip a comparison: every decided value is clear of its bound."""
    close = np.abs(stat - threshold) < 1e-5 * max(1.0, abs(threshold))
    assert not np.any(close & where), f"test data sits on the threshold {threshold}"


def _clamped_std(stat, m, low, high):
    if m.sum() <= 1:
        return 0.0
    c = np.clip(stat, low, high)
    return math.sqrt(max(mmean(c**2, m) - mmean(c, m) ** 2, 0.0))


def ref_is_weights(log_ratio, mask, *, level="token", upper=2.0, lower=None, batch_normalize=False):
    lr, m = np.asarray(log_ratio, np.float64), np.asarray(mask, np.float64)
    valid = m > 0
    # per token: ρ_t; per sequence: Π_t ρ_t = exp(Σ_t m·log ρ_t) on every token of the row
    lr_metrics = lr if level == "token" else msum(lr, m, axis=-1)[:, None]
    raw = np.broadcast_to(np.exp(np.clip(lr_metrics, -BOUND, BOUND)), lr.shape) * m
    if lower is None:
        w = np.minimum(raw, upper)
    else:
        w = np.where((raw >= lower) & (raw <= upper), raw, 0.0)
        _clear(raw, lower, valid)
    _clear(raw, upper, valid)
    low = 1.0 / upper if lower is None else lower
    out = {"rollout_is_mean": mmean(w, m)}
    rows = m.sum(-1) > 0  # per-row statistics over the rows with a valid token
    if level == "sequence":
        row_log = lr_metrics[rows, 0]
        out["rollout_is_max"] = math.exp(min(row_log.max(), BOUND))
        out["rollout_is_min"] = math.exp(row_log.min())
        out["rollout_is_ratio_fraction_high"] = np.mean(row_log > math.log(upper))
        out["rollout_is_ratio_fraction_low"] = np.mean(row_log < math.log(low))
    else:
        out["rollout_is_ratio_fraction_high"] = mmean((raw > upper) * 1.0, m)
        out["rollout_is_ratio_fraction_low"] = mmean((raw < low) * 1.0, m)
        out["rollout_is_max"], out["rollout_is_min"] = w[valid].max(), w[valid].min()
    out["rollout_is_std"] = _clamped_std(w, m, 0.0, upper)
    c = np.clip(w, 0.0, upper)
    out["rollout_is_eff_sample_size"] = 1.0 / mmean((c / (mmean(c, m) + EPS)) ** 2, m)
    seq = mmean(w, m, axis=-1)[rows]
    out["rollout_is_seq_mean"] = seq.mean()
    out["rollout_is_seq_std"] = seq.std(ddof=1) if seq.size > 1 else 0.0
    out["rollout_is_seq_max"], out["rollout_is_seq_min"] = seq.max(), seq.min()
    out["rollout_is_seq_max_deviation"] = np.abs(seq - 1.0).max()
    raw_seq = mmean(raw, m, axis=-1)[rows]
    out["rollout_is_seq_fraction_high"] = np.mean(raw_seq > upper)
    out["rollout_is_seq_fraction_low"] = np.mean(raw_seq < low)
    if lower is not None:
        out["rollout_is_oob_ratio"] = mmean(((raw < lower) | (raw > upper)) * 1.0, m)
    if batch_normalize:  # token: mean over valid tokens; sequence: over non-empty rows
        rows = (m.sum(-1) > 0) * 1.0
        seq_mean = np.sum(mmean(w, m, axis=-1) * rows) / max(rows.sum(), 1e-8)
        mean = mmean(w, m) if level == "token" else seq_mean
        w = w / mean if mean > 1e-8 else w
        out["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return w, out


def ref_rejection(log_ratio, mask, criteria):
    lr, m = np.asarray(log_ratio, np.float64), np.asarray(mask, np.float64)
    r = np.clip(lr, -BOUND, BOUND)
    tokens = {"k1": -r, "k2": 0.5 * r**2, "k3": np.exp(r) - 1.0 - r}
    valid, seq_valid = m > 0, m.sum(-1) > 0
    combined = np.ones_like(m)
    out = {}
    for name, spec in criteria.items():
        k1 = name.endswith("k1")
        if k1:  # verl: one number u -> lower 1/u; bounds compared in log space
            lo, hi = (math.log(1.0 / spec), math.log(spec)) if np.isscalar(spec) else np.log(spec)
        else:
            lo, hi = 0.0, float(spec)
        stat = tokens[name[-2:]]
        if name.startswith("token"):
            per_seq, per_tok, decided, where = None, stat, stat, valid
        else:  # the row statistic on every token of the row
            top = np.where(valid, stat, -np.inf).max(-1)
            top = np.where(np.isneginf(top), 0.0, top)
            reduce = {"seq_sum": msum(stat, m, -1), "seq_mean": mmean(stat, m, -1), "seq_max": top}
            per_seq = reduce[name[:-3]]
            per_tok, decided, where = np.broadcast_to(per_seq[:, None], m.shape), per_seq, seq_valid
        keep = (decided >= lo) & (decided <= hi) if k1 else decided <= hi
        for bound in (lo, hi) if k1 else (hi,):
            _clear(decided, bound, where)
        keep = keep if per_seq is None else np.broadcast_to(keep[:, None], m.shape)
        # compute_rs_metrics: max / min / fractions over valid tokens, or over valid rows
        p = f"rollout_rs_{name}"
        sv = (mmean(per_tok, m, axis=-1) if per_seq is None else per_seq)[seq_valid]
        vals = per_tok[valid] if per_seq is None else sv
        out[f"{p}_mean"] = mmean(per_tok, m)
        out[f"{p}_max"], out[f"{p}_min"] = vals.max(), vals.min()
        out[f"{p}_fraction_high"] = np.mean(vals > hi)
        out[f"{p}_fraction_low"] = np.mean(vals < lo) if k1 else 0.0
        out[f"{p}_std"] = _clamped_std(per_tok, m, lo, hi)
        out[f"{p}_seq_mean"] = sv.mean()
        out[f"{p}_seq_std"] = sv.std(ddof=1) if sv.size > 1 else 0.0
        out[f"{p}_seq_max"], out[f"{p}_seq_min"] = sv.max(), sv.min()
        out[f"{p}_seq_max_deviation"] = np.abs(sv).max()
        out[f"{p}_seq_fraction_high"] = np.mean(sv > hi)
        if k1:
            out[f"{p}_seq_fraction_low"] = np.mean(sv < lo)
        keep_f = keep * 1.0
        combined = combined * keep_f
        seq_keep = (~(~keep & valid)).all(-1)
        out[f"{p}_masked_fraction"] = mmean(1.0 - keep_f, m)
        out[f"{p}_seq_masked_fraction"] = np.sum(~seq_keep & seq_valid) / seq_valid.sum()
    out["rollout_rs_masked_fraction"] = mmean(1.0 - combined, m)
    final_keep = (combined > 0.5) & valid
    out["rollout_rs_seq_masked_fraction"] = np.sum((~final_keep & valid).any(-1)) / seq_valid.sum()
    return m * combined, out


def ref_offpolicy(train, rollout, mask, threshold=2.0):
    old, roll, m = (np.asarray(x, np.float64) for x in (train, rollout, mask))
    rows = m.sum(-1) > 0  # per-row statistics over the rows with a valid token
    lp_train, lp_roll = mmean(old, m, axis=-1)[rows], mmean(roll, m, axis=-1)[rows]
    d = old - roll
    dc = np.clip(d, -BOUND, BOUND)  # verl: unclamped in k3_kl (documented)
    diff = lp_roll - lp_train
    rho = np.exp(dc)
    seq_log = np.clip(msum(d, m, axis=-1), -BOUND, BOUND)[rows]
    return {
        "training_ppl": np.mean(np.exp(-lp_train)),
        "training_log_ppl": np.mean(-lp_train),
        "kl": mmean(roll - old, m),
        "k3_kl": mmean(np.exp(dc) - dc - 1.0, m),
        "rollout_ppl": np.mean(np.exp(-lp_roll)),
        "rollout_log_ppl": np.mean(-lp_roll),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": np.abs(diff).mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": np.mean(np.exp(np.clip(diff, -BOUND, BOUND))),  # verl: unclamped
        "chi2_token": mmean(rho**2, m) - 1.0,
        "chi2_seq": np.mean(np.exp(2.0 * seq_log)) - 1.0,
        # jaxrl_llm's own, from the docstring
        "ess": 1.0 / mmean((rho / (mmean(rho, m) + EPS)) ** 2, m),
        "ratio_fraction_high": mmean((rho > threshold) * 1.0, m),
        "ratio_fraction_low": mmean((rho < 1.0 / threshold) * 1.0, m),
    }


# -- data and comparison ---------------------------------------------------------------------------


def data(seed=0):
    """``(log_ratio, mask, train, rollout)``; multiples of 2**-6 so f32 sums are exact."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(T)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.float32)
    lr = rng.normal(0.0, 0.6, (B, T))
    lr[0, 1], lr[0, 4], lr[3, 2] = 25.0, 21.5, -30.0  # beyond ±20
    lr[mask == 0] = rng.uniform(-50.0, 50.0, int((mask == 0).sum()))  # padding garbage
    lr = (np.round(lr * 64) / 64).astype(np.float32)
    rollout = (np.round(-rng.uniform(0.1, 3.0, (B, T)) * 64) / 64).astype(np.float32)
    return lr, mask, rollout + lr, rollout  # train - rollout == lr exactly


def assert_metrics(got, want, prefix=""):
    got = {k: float(v) for k, v in got.items()}
    want = {prefix + k: float(v) for k, v in want.items()}
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=RTOL, atol=ATOL, err_msg=key)


# (level, upper, lower): TIS and IcePop per token and per sequence
IS_CASES = [(lv, up, lo) for lv in IS_LEVELS for up, lo in ((2.0, None), (1.5, 0.7), (5.0, 0.2))]


@pytest.mark.parametrize("batch_normalize", [False, True], ids=["raw", "batch_norm"])
@pytest.mark.parametrize(("level", "upper", "lower"), IS_CASES)
def test_is_weights_match_verl(level, upper, lower, batch_normalize):
    lr, mask, _, _ = data()
    kwargs = dict(level=level, upper=upper, lower=lower, batch_normalize=batch_normalize)
    weights, metrics = correction.is_weights(jnp.asarray(lr), jnp.asarray(mask), **kwargs)
    want_w, want_m = ref_is_weights(lr, mask, **kwargs)
    chex.assert_shape(weights, (B, T))
    chex.assert_type(weights, jnp.float32)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(weights)[mask == 0] == 0.0)
    assert_metrics(metrics, want_m)
    # the data exercise the option: some valid weights truncated or zeroed, some left as they are
    raw, _ = ref_is_weights(lr, mask, level=level, upper=1e9)
    bounded, _ = ref_is_weights(lr, mask, level=level, upper=upper, lower=lower)
    valid = (mask > 0) & (raw > 1e-6)
    assert np.any(valid & (bounded != raw)) and np.any(valid & (bounded == raw))


CRITERIA_CASES = [
    {"token_k1": 2.0},  # a single number u: [1/u, u]
    {"token_k1": (0.6, 1.8)},
    {"token_k2": 0.1},
    {"token_k3": 0.1},
    {"seq_sum_k1": 3.0},
    {"seq_sum_k1": (0.25, 2.0)},
    {"seq_sum_k2": 1.0},
    {"seq_sum_k3": 1.5},
    {"seq_mean_k1": 1.5},
    {"seq_mean_k2": 0.2},
    {"seq_mean_k3": 0.2},
    {"seq_max_k2": 0.35},
    {"seq_max_k3": 0.3},
    {"token_k1": (0.6, 1.8), "seq_mean_k3": 0.2},
    {"token_k2": 0.3, "seq_sum_k1": 3.0, "seq_max_k3": 1.0},
    {"seq_mean_k2": 0.2, "token_k3": 0.2, "seq_sum_k3": 2.0, "seq_mean_k1": (0.7, 1.3)},
]


@pytest.mark.parametrize("criteria", CRITERIA_CASES, ids=lambda c: "+".join(c))
def test_rejection_mask_matches_verl(criteria):
    lr, mask, _, _ = data()
    kept, metrics = correction.rejection_mask(jnp.asarray(lr), jnp.asarray(mask), criteria=criteria)
    want_kept, want_m = ref_rejection(lr, mask, criteria)
    chex.assert_shape(kept, (B, T))
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    assert 0 < want_kept.sum() < mask.sum(), "the case should keep some tokens and drop some"
    assert_metrics(metrics, want_m)


def test_k1_single_number_is_the_reciprocal_band():
    lr, mask, _, _ = data()
    for name in ("token_k1", "seq_sum_k1", "seq_mean_k1"):
        a, ma = correction.rejection_mask(lr, mask, criteria={name: 2.0})
        b, mb = correction.rejection_mask(lr, mask, criteria={name: [0.5, 2.0]})
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert_metrics(ma, {k: float(v) for k, v in mb.items()})
    parsed = correction.parse_criteria({"token_k1": 4, "seq_max_k2": 1})
    assert parsed == (("token_k1", (0.25, 4.0)), ("seq_max_k2", (0.0, 1.0)))


@pytest.mark.parametrize("threshold", [2.0, 1.3])
def test_offpolicy_metrics_match_verl(threshold):
    _, mask, train, rollout = data(1)
    got = correction.offpolicy_metrics(train, rollout, mask, threshold=threshold)
    assert_metrics(got, ref_offpolicy(train, rollout, mask, threshold))


@pytest.mark.parametrize(
    "spec",
    [
        {"mode": "decoupled", "is_level": "token", "is_upper": 2.0},
        dict(is_level="sequence", is_upper=5.0, is_lower=0.2, batch_normalize=True)
        | {"rejection": {"token_k1": (0.6, 1.8), "seq_max_k2": 0.3}},
        {"mode": "bypass", "is_level": None, "rejection": {"seq_mean_k3": 0.1}},
    ],
    ids=["tis", "icepop_seq_rs", "rs_only"],
)
def test_apply_is_compute_rollout_correction_and_rejection_mask(spec):
    _, mask, train, rollout = data()
    c = correction.Correction.of(spec)
    weights, kept, metrics = correction.apply(c, train, rollout, mask)
    lr = train.astype(np.float64) - rollout
    want = {}
    if c.is_level is None:
        assert weights is None
    else:
        kw = dict(level=c.is_level, upper=c.is_upper, lower=c.is_lower)
        want_w, m = ref_is_weights(lr, mask, batch_normalize=c.batch_normalize, **kw)
        np.testing.assert_allclose(np.asarray(weights), want_w, rtol=RTOL, atol=ATOL)
        want.update(m)
    want_kept = mask
    if c.rejection:
        want_kept, m = ref_rejection(lr, mask, dict(spec["rejection"]))
        want.update(m)
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    want.update(ref_offpolicy(train, rollout, mask, c.is_upper))
    assert_metrics(metrics, want, prefix="rollout_corr/")


# -- hand-checked cases ----------------------------------------------------------------------------

# Row 0: ratios 3, 1, 1/4 (3 tokens); row 1: ratios 1.5, 0.8 and a padded position.
HAND_LR = np.log(np.array([[3.0, 1.0, 0.25], [1.5, 0.8, 100.0]], np.float32)).astype(np.float32)
HAND_MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)


@pytest.mark.parametrize(
    ("kwargs", "want"),
    [
        # TIS, C = 2: min(ρ, 2) -> 3 truncated to 2.
        ({}, [[2.0, 1.0, 0.25], [1.5, 0.8, 0.0]]),
        # IcePop [0.5, 2]: 3 and 1/4 leave the band and get 0.
        ({"lower": 0.5}, [[0.0, 1.0, 0.0], [1.5, 0.8, 0.0]]),
        # Sequence: Π ρ = 3·1·0.25 = 0.75 on row 0, 1.5·0.8 = 1.2 on row 1.
        ({"level": "sequence"}, [[0.75] * 3, [1.2, 1.2, 0.0]]),
        # Batch normalised TIS: mean over 5 tokens (2+1+.25+1.5+.8)/5 = 1.11.
        ({"batch_normalize": 1}, np.array([[2.0, 1.0, 0.25], [1.5, 0.8, 0.0]]) / 1.11),
        # Sequence, batch normalised over rows: (0.75 + 1.2)/2 = 0.975.
        (
            {"level": "sequence", "batch_normalize": 1},
            np.array([[0.75] * 3, [1.2, 1.2, 0]]) / 0.975,
        ),
    ],
)
def test_is_weights_hand_case(kwargs, want):
    weights, metrics = correction.is_weights(HAND_LR, HAND_MASK, **kwargs)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6, atol=1e-6)
    if kwargs == {}:
        # one of 5 tokens above 2 (ρ = 3), one below 1/2 (ρ = 1/4)
        np.testing.assert_allclose(float(metrics["rollout_is_ratio_fraction_high"]), 0.2)
        np.testing.assert_allclose(float(metrics["rollout_is_ratio_fraction_low"]), 0.2)
        np.testing.assert_allclose(float(metrics["rollout_is_mean"]), 1.11, rtol=1e-6)


@pytest.mark.parametrize(
    ("criteria", "want", "token_frac", "seq_frac"),
    [
        # |log ρ| <= log 2: row 0 drops ρ = 3 and ρ = 1/4; row 1 keeps 1.5 and 0.8.
        ({"token_k1": 2.0}, [[0, 1, 0], [1, 1, 0]], 2 / 5, 1 / 2),
        # Σ k1 = -log Πρ: row 0 -log 0.75 = 0.288 > log 1.25 = 0.223 (dropped),
        # row 1 -log 1.2 = -0.182 in [-0.223, 0.223] (kept).
        ({"seq_sum_k1": 1.25}, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
        # max k2: row 0 ½ log²4 = 0.961 > 0.5 (dropped), row 1 ½ log²1.5 = 0.082 (kept).
        ({"seq_max_k2": 0.5}, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
        # mean k2: row 0 (0.603 + 0 + 0.961)/3 = 0.521, row 1 (0.082 + 0.025)/2 = 0.054.
        ({"seq_mean_k2": 0.06}, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
        ({"seq_mean_k2": 0.05}, [[0, 0, 0], [0, 0, 0]], 1.0, 1.0),
        # both must pass: token_k1 keeps row 0's middle token, seq_mean_k2 drops row 0.
        ({"token_k1": 2.0, "seq_mean_k2": 0.06}, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
    ],
)
def test_rejection_hand_case(criteria, want, token_frac, seq_frac):
    kept, metrics = correction.rejection_mask(HAND_LR, HAND_MASK, criteria=criteria)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(want, np.float32))
    np.testing.assert_allclose(float(metrics["rollout_rs_masked_fraction"]), token_frac, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rollout_rs_seq_masked_fraction"]), seq_frac)


def _all_masked():
    lr, mask = jnp.asarray(HAND_LR), jnp.zeros((2, 3))
    weights, m1 = correction.is_weights(lr, mask, lower=0.5, batch_normalize=True)
    kept, m2 = correction.rejection_mask(lr, mask, criteria={"token_k1": 2.0, "seq_max_k3": 1})
    return weights, kept, {**m1, **m2, **correction.offpolicy_metrics(lr, lr, mask)}


ESS_KEYS = ("rollout_is_eff_sample_size", "ess")


def test_all_masked_batch_gives_zeros_and_finite_metrics():
    # verl raises on an all-masked batch; a jitted function returns zeros instead.
    weights, kept, metrics = _all_masked()
    assert not np.any(np.asarray(weights)) and not np.any(np.asarray(kept))
    chex.assert_tree_all_finite({k: v for k, v in metrics.items() if k not in ESS_KEYS})


def test_all_masked_batch_ess_is_finite():
    chex.assert_tree_all_finite({k: _all_masked()[2][k] for k in ESS_KEYS})


def _every_metric(lr, mask, train, rollout):
    out = {}
    for level in IS_LEVELS:
        _, m = correction.is_weights(lr, mask, level=level, upper=1.5, lower=0.7)
        out.update({f"{level}/{k}": v for k, v in m.items()})
    _, m = correction.rejection_mask(lr, mask, criteria={"token_k1": 2.0, "seq_mean_k3": 0.2})
    out.update(m)
    out.update(correction.offpolicy_metrics(train, rollout, mask))
    return {k: float(v) for k, v in out.items()}


def test_rows_without_a_valid_token_change_no_metric():
    """A dynamic-sampling filler row (completion mask all 0) is not data: every metric is
    what the batch without it gives (verl would count it in its per-row averages)."""
    lr, mask, train, rollout = data()
    keep = mask.sum(-1) > 0
    without = _every_metric(lr[keep], mask[keep], train[keep], rollout[keep])
    filler = np.zeros((2, T), np.float32)
    garbage = np.full((2, T), 3.0, np.float32)  # padding values must not matter either
    with_rows = _every_metric(
        *(
            np.concatenate([x, g])
            for x, g in ((lr, garbage), (mask, filler), (train, garbage), (rollout, filler))
        )
    )
    assert set(with_rows) == set(without)
    for key, value in without.items():
        np.testing.assert_allclose(with_rows[key], value, rtol=1e-6, atol=1e-7, err_msg=key)


def test_sequence_metrics_beside_an_empty_row_by_hand():
    """One row with Σ log ρ = −0.5 beside an empty one, sequence TIS at 2: ρ = e^−0.5 =
    0.6065 is every per-row statistic (verl's averages over both rows would give a max of
    1, a min of 0, a max deviation of 1 and a low fraction of 0.5)."""
    lr = np.array([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [0, 0, 0]], np.float32)
    _, m = correction.is_weights(lr, mask, level="sequence", upper=2.0)
    rho = math.exp(-0.5)
    for key, want in (
        ("rollout_is_max", rho),
        ("rollout_is_min", rho),
        ("rollout_is_seq_mean", rho),
        ("rollout_is_seq_max", rho),
        ("rollout_is_seq_min", rho),
        ("rollout_is_seq_max_deviation", 1.0 - rho),
        ("rollout_is_seq_fraction_low", 0.0),  # 0.6065 > 1/2
        ("rollout_is_seq_std", 0.0),  # one row
    ):
        np.testing.assert_allclose(float(m[key]), want, rtol=1e-6, err_msg=key)


# -- gradients, jit, errors ------------------------------------------------------------------------


@pytest.mark.parametrize(("level", "lower", "norm"), [("token", None, 0), ("sequence", 0.2, 1)])
def test_weights_carry_no_gradient(level, lower, norm):
    lr, mask, train, rollout = data()
    kw, lr = dict(level=level, upper=5.0, lower=lower, batch_normalize=norm), np.clip(lr, -3, 3)
    # d/dx Σ w(x)·x = w only when w is a constant
    grad = jax.grad(lambda x: jnp.sum(correction.is_weights(x, mask, **kw)[0] * x))(lr)
    np.testing.assert_allclose(grad, correction.is_weights(lr, mask, **kw)[0], rtol=1e-6)
    spec = correction.Correction(is_level=level, is_upper=5.0, is_lower=lower, batch_normalize=norm)
    g = jax.grad(lambda t: jnp.sum(correction.apply(spec, t, rollout, mask)[0]))(jnp.asarray(train))
    assert not np.any(np.asarray(g))


def test_jit_with_static_kwargs_matches_eager():
    lr, mask, train, rollout = data()
    jit_is = jax.jit(correction.is_weights, static_argnames=("level", "upper", "lower"))
    for kwargs in ({"level": "sequence", "upper": 5.0, "lower": 0.2}, {"upper": 1.5}):
        got, got_m = jit_is(lr, mask, **kwargs)
        want, want_m = correction.is_weights(lr, mask, **kwargs)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
        assert_metrics(got_m, {k: float(v) for k, v in want_m.items()})
    criteria = {"token_k1": (0.6, 1.8), "seq_mean_k3": 0.05}
    jit_rs = jax.jit(functools.partial(correction.rejection_mask, criteria=criteria))
    np.testing.assert_array_equal(jit_rs(lr, mask)[0], ref_rejection(lr, mask, criteria)[0])
    spec = correction.Correction(is_level="token", rejection={"seq_max_k2": 0.3})
    jit_apply = jax.jit(correction.apply, static_argnums=0)  # Correction is hashable
    want = correction.apply(spec, train, rollout, mask)
    chex.assert_trees_all_close(jit_apply(spec, train, rollout, mask), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "seq"}, "unknown IS level"),
        ({"upper": 0.0}, "IS bounds need 0 < lower <= upper"),
        ({"upper": 2.0, "lower": 3.0}, "lower=3.0, upper=2.0"),
        ({"lower": 0.0}, "lower=0.0"),
    ],
)
def test_bad_is_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        correction.is_weights(HAND_LR, HAND_MASK, **kwargs)


@pytest.mark.parametrize(
    ("criteria", "match"),
    [
        ({"token_k4": 1.0}, "unknown rejection criterion"),
        ({"binary_kl": 1.0}, "unknown rejection criterion"),  # post-v0.9 verl, omitted
        ({"seq_max_k1": 2.0}, "unknown rejection criterion"),  # not in verl either
        ({}, "non-empty mapping"),
        ({"token_k1": (2.0, 0.5)}, "0 < lower <= upper"),
        ({"seq_sum_k1": -2.0}, "0 < lower <= upper"),
        ({"token_k1": (0.5, 1, 2)}, "ratio band or one number"),
        ({"token_k2": (0.1, 0.2)}, "one positive upper bound"),
        ({"seq_sum_k3": -1.0}, "one positive upper bound"),
        ({"seq_max_k2": True}, "one positive upper bound"),
    ],
)
def test_bad_criteria_raise(criteria, match):
    with pytest.raises(ValueError, match=match):
        correction.rejection_mask(HAND_LR, HAND_MASK, criteria=criteria)


def test_bad_shapes_raise():
    x, m = HAND_LR, HAND_MASK
    for call in (
        lambda: correction.is_weights(x[:, :2], m),
        lambda: correction.rejection_mask(x[:1], m, criteria={"token_k2": 1.0}),
        lambda: correction.offpolicy_metrics(x, x[:, :2], m[:, :2]),
    ):
        with pytest.raises(ValueError, match="does not match mask shape"):
            call()
    with pytest.raises(ValueError, match="rank 2"):
        correction.is_weights(x, m[0])
    with pytest.raises(ValueError, match="threshold must be > 0"):
        correction.offpolicy_metrics(x, x, m, threshold=0.0)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"is_levle": "token"}, r"unknown rollout_correction key\(s\) \['is_levle'\]"),
        ({"is_level": None}, "does nothing"),
        ({"mode": "hybrid"}, "unknown rollout_correction.mode"),
        ({"is_level": "seq"}, "unknown rollout_correction.is_level"),
        ({"is_upper": -1.0}, "IS bounds need 0 < lower <= upper"),
        ({"is_lower": 3.0}, "lower=3.0"),
        ({"rejection": {"token_k9": 1.0}}, "unknown rejection criterion"),
        ("token", "must be a mapping"),
    ],
)
def test_bad_correction_specs_raise(value, match):
    with pytest.raises(ValueError, match=match):
        correction.Correction.of(value)
    with pytest.raises(ValueError, match=match):
        objectives.make("grpo", rollout_correction=value)


def test_correction_spec_normalises_and_hashes():
    c = correction.Correction.of({"rejection": {"token_k1": 2.0, "seq_mean_k3": 0.1}})
    assert c.rejection == (("token_k1", (0.5, 2.0)), ("seq_mean_k3", (0.0, 0.1)))
    assert hash(c) == hash(correction.Correction(rejection=c.rejection))
    assert correction.Correction.of(None) is None and correction.Correction.of(c) is c
    # bypass with neither weights nor rejection is valid: the rollout is the old policy
    assert correction.Correction.of({"mode": "bypass", "is_level": None}).rejection == ()
    made = objectives.make("grpo", rollout_correction={"is_level": "sequence"})
    assert made.correction == correction.Correction(is_level="sequence")


def test_padding_never_reaches_values_or_gradients():
    # -inf on both sides of a padded position gives NaN log-ratios there: masked out, they
    # must leave the weights (0 on padding), the metrics and the gradient finite.
    lr = jnp.array([[0.1, jnp.nan], [-jnp.inf, 0.2]])
    mask = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    weights, metrics = correction.is_weights(lr, mask)
    np.testing.assert_allclose(weights, [[np.exp(0.1), 0.0], [0.0, np.exp(0.2)]], rtol=1e-6)
    chex.assert_tree_all_finite(metrics)
    kept, metrics = correction.rejection_mask(lr, mask, criteria={"seq_mean_k3": 1.0})
    np.testing.assert_array_equal(kept, mask)
    chex.assert_tree_all_finite(metrics)
    grad = jax.grad(lambda x: jnp.sum(correction.is_weights(x, mask)[0] * x))(lr)
    chex.assert_tree_all_finite(grad)


def test_rejection_spec_forms():
    assert correction.Correction(rejection=None).rejection == ()
    with pytest.raises(ValueError, match="rejection must be"):
        correction.Correction(rejection=["token_k1"])
