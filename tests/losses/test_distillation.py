"""``distillation.generalized_jsd`` against a float64 NumPy transcription of GKD's Eq. 1 (both
ends: forward and reverse KL; the mixture in between; temperature; the teacher's top-k), its
edge cases (identical distributions give 0, masked NaN padding gives 0 and no NaN gradient),
and its gradient against central differences of the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses import distillation

B, T, V = 3, 4, 7


def _log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_jsd(student, teacher, beta, temperature=1.0, top_k=None):
    """Eq. 1 of arXiv:2306.13649 in float64: β KL(P‖M) + (1−β) KL(Q‖M), M = βP + (1−β)Q;
    at the ends (where Eq. 1 is 0) the limits TRL takes: β=0 KL(P‖Q), β=1 KL(Q‖P)."""
    s = _log_softmax(np.asarray(student, np.float64) / temperature)
    t = _log_softmax(np.asarray(teacher, np.float64) / temperature)
    if top_k is not None:
        ids = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
        s = _log_softmax(np.take_along_axis(s, ids, -1))
        t = _log_softmax(np.take_along_axis(t, ids, -1))
    p, q = np.exp(t), np.exp(s)
    if beta in (0.0, 1.0):
        a, b = (p, q) if beta == 0.0 else (q, p)
        return np.where(a > 0, a * (np.log(a) - np.log(b)), 0.0).sum(-1)
    m = beta * p + (1 - beta) * q
    kl_pm = np.where(p > 0, p * (np.log(p) - np.log(m)), 0.0).sum(-1)
    kl_qm = np.where(q > 0, q * (np.log(q) - np.log(m)), 0.0).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


@pytest.fixture
def logits(rng):
    return rng.normal(0, 2, (B, T, V)), rng.normal(0, 2, (B, T, V))


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_the_float64_reference(logits, beta, temperature):
    student, teacher = logits
    got = distillation.generalized_jsd(student, teacher, beta=beta, temperature=temperature)
    want = reference_jsd(student, teacher, beta, temperature)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_the_ends_are_the_forward_and_reverse_kl(logits):
    student, teacher = logits
    p = np.exp(_log_softmax(teacher))
    q = np.exp(_log_softmax(student))
    forward = (p * (np.log(p) - np.log(q))).sum(-1)  # KL(teacher ‖ student)
    reverse = (q * (np.log(q) - np.log(p))).sum(-1)
    np.testing.assert_allclose(
        distillation.generalized_jsd(student, teacher, beta=0.0), forward, rtol=1e-5
    )
    np.testing.assert_allclose(
        distillation.generalized_jsd(student, teacher, beta=1.0), reverse, rtol=1e-5
    )


@pytest.mark.parametrize("top_k", [1, 3, V])
def test_top_k_renormalises_over_the_teachers_top_tokens(logits, top_k):
    student, teacher = logits
    got = distillation.generalized_jsd(student, teacher, beta=0.5, top_k=top_k)
    np.testing.assert_allclose(
        np.asarray(got), reference_jsd(student, teacher, 0.5, top_k=top_k), atol=1e-6
    )
    if top_k == 1:  # one token renormalised is certain on both sides
        np.testing.assert_allclose(np.asarray(got), 0.0, atol=1e-7)


def test_identical_distributions_give_zero_and_padding_never_leaks(logits):
    student, _ = logits
    np.testing.assert_allclose(
        distillation.generalized_jsd(student, student + 3.0, beta=0.5), 0.0, atol=1e-6
    )
    mask = np.ones((B, T))
    mask[1, 2:] = 0
    padded = student.copy()
    padded[mask == 0] = np.nan

    def total(x):
        return distillation.generalized_jsd(x, jnp.zeros_like(x), mask, beta=0.5).sum()

    value, grad = jax.value_and_grad(total)(jnp.asarray(padded, jnp.float32))
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[mask == 0] == 0.0)


def test_gradient_matches_central_differences_of_the_reference(logits):
    student, teacher = logits
    student, teacher = student[0, 0], teacher[0, 0]
    grad = jax.grad(
        lambda s: distillation.generalized_jsd(s, jnp.asarray(teacher, jnp.float32), beta=0.3)
    )(jnp.asarray(student, jnp.float32))
    eps = 1e-5
    numeric = np.array(
        [
            (
                reference_jsd(student + eps * np.eye(V)[v], teacher, 0.3)
                - reference_jsd(student - eps * np.eye(V)[v], teacher, 0.3)
            )
            / (2 * eps)
            for v in range(V)
        ]
    )
    np.testing.assert_allclose(np.asarray(grad), numeric, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 1.5}, r"beta must be in \[0, 1\]"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_k": V + 1}, r"top_k must be in \[1, 7\]"),
        ({"mask": np.ones((B, T + 1))}, "mask shape"),
    ],
)
def test_bad_arguments_are_named(logits, kwargs, message):
    student, teacher = logits
    with pytest.raises(ValueError, match=message):
        distillation.generalized_jsd(student, teacher, **kwargs)


# --- The top-k form: log-probs gathered at the teacher's top-k tokens ---------------------


def _gathered(student, teacher, top_k, temperature=1.0):
    """Both log-softmaxes (float64) at the teacher's ``top_k`` ids: what the teacher's forward
    stores and the update's forward gathers (``logprobs``' ``top_k`` / ``gather_ids``)."""
    s = _log_softmax(np.asarray(student, np.float64) / temperature)
    t = _log_softmax(np.asarray(teacher, np.float64) / temperature)
    ids = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
    return np.take_along_axis(s, ids, -1), np.take_along_axis(t, ids, -1), ids


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [1, 3, V])
def test_top_k_form_matches_the_float64_reference(logits, beta, top_k):
    """Gathered log-probs (full-vocabulary normalised: they sum below 1 over k < V) give
    GKD's divergence of the distributions renormalised over the teacher's top-k."""
    student, teacher = logits
    s, t, _ = _gathered(student, teacher, top_k, temperature=0.7)
    got = distillation.top_k_generalized_jsd(s, t, beta=beta)
    want = reference_jsd(student, teacher, beta, temperature=0.7, top_k=top_k)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(got),
        np.asarray(
            distillation.generalized_jsd(student, teacher, beta=beta, temperature=0.7, top_k=top_k)
        ),
        rtol=1e-5,
        atol=1e-6,
    )
    if top_k == 1:
        np.testing.assert_array_equal(np.asarray(got), 0.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_gradient_wrt_the_student_logits_matches_central_differences(logits, beta):
    """``d JSD / d z_student`` through the gather (zero off the teacher's top-k tokens)
    against central differences of the float64 reference (the teacher's ids fixed)."""
    top_k, temperature = 3, 0.8
    student, teacher = logits[0][0, 0], logits[1][0, 0]
    _, t, ids = _gathered(student, teacher, top_k, temperature)

    def ours(z):
        s = jax.nn.log_softmax(z / temperature)[jnp.asarray(ids)]
        return distillation.top_k_generalized_jsd(s, jnp.asarray(t, jnp.float32), beta=beta)

    grad = np.asarray(jax.grad(ours)(jnp.asarray(student, jnp.float32)))
    eps = 1e-6
    numeric = np.array(
        [
            (
                reference_jsd(student + eps * np.eye(V)[v], teacher, beta, temperature, top_k)
                - reference_jsd(student - eps * np.eye(V)[v], teacher, beta, temperature, top_k)
            )
            / (2 * eps)
            for v in range(V)
        ]
    )
    np.testing.assert_allclose(grad, numeric, atol=2e-5)
    off = np.setdiff1d(np.arange(V), ids)
    # Renormalised: the rest of V is out (up to rounding of the cancelled logsumexp).
    np.testing.assert_allclose(grad[off], 0.0, atol=1e-6)


def test_top_k_form_is_invariant_to_a_per_position_shift(logits, rng):
    """Renormalisation over the k tokens: log-probs under the full vocabulary, raw logits or
    anything shifted per position give one value."""
    student, teacher = logits
    s, t, _ = _gathered(student, teacher, 4)
    shift = rng.normal(0, 3, (B, T, 1))
    np.testing.assert_allclose(
        np.asarray(distillation.top_k_generalized_jsd(s + shift, t - 2 * shift, beta=0.3)),
        np.asarray(distillation.top_k_generalized_jsd(s, t, beta=0.3)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_top_k_form_with_empty_masks_and_nan_padding_gives_zero_and_no_nan(logits):
    student, teacher = logits
    s, t, _ = _gathered(student, teacher, 3)
    mask = np.ones((B, T))
    mask[0] = 0  # an empty row
    mask[2, 1:] = 0
    s[mask == 0], t[mask == 0] = np.nan, np.nan

    def total(x, m):
        return distillation.top_k_generalized_jsd(x, t, m, beta=0.5).sum()

    for m in (mask, np.zeros((B, T))):  # every position masked too
        value, grad = jax.value_and_grad(total)(jnp.asarray(s, jnp.float32), m)
        assert np.isfinite(value) and np.all(np.isfinite(grad))
        assert np.all(np.asarray(grad)[m == 0] == 0.0)
    value, grad = jax.value_and_grad(total)(jnp.asarray(s, jnp.float32), np.zeros((B, T)))
    assert float(value) == 0.0


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (((B, T, 3), (B, T, 4)), {}, "shape mismatch"),
        (((B, T, 3), (B, T, 3)), {"beta": -0.1}, r"beta must be in \[0, 1\]"),
        (((B, T, 3), (B, T, 3)), {"mask": np.ones((B, T, 3))}, "mask shape"),
        (((B, T, 0), (B, T, 0)), {}, "k >= 1"),
    ],
)
def test_top_k_form_names_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        distillation.top_k_generalized_jsd(*(np.zeros(shape) for shape in args), **kwargs)
