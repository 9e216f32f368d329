"""jaxrl_llm.losses.masked against float64 NumPy and hand-checked edge cases."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses import masked


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 5))
    mask = (rng.random((3, 5)) > 0.4).astype(np.float64)
    mask[2] = 0.0  # an empty row
    return values, mask


def test_weighted_sum_and_mean_follow_verl(data):
    values, mask = data
    weights = mask * np.array([1.0, 0.5, 2.0, 1.0, 3.0])  # a weighted mask weighs
    got_sum = masked.masked_sum(jnp.asarray(values), jnp.asarray(weights))
    got_mean = masked.masked_mean(jnp.asarray(values), jnp.asarray(weights), axis=-1)
    np.testing.assert_allclose(got_sum, np.sum(values * weights), rtol=1e-6)
    want = np.sum(values * weights, -1) / (np.sum(weights, -1) + 1e-8)
    np.testing.assert_allclose(got_mean, want, rtol=1e-6, atol=1e-7)


def test_selected_sum_and_token_mean_count_entries_unweighted(data):
    values, mask = data
    weights = mask * 2.0
    np.testing.assert_allclose(
        masked.selected_sum(jnp.asarray(values), jnp.asarray(weights)),
        np.sum(values[mask > 0]),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        masked.token_mean(jnp.asarray(values), jnp.asarray(mask), jnp.asarray(20.0)),
        np.sum(values[mask > 0]) / 20.0,
        rtol=1e-6,
    )


def test_masked_garbage_never_leaks_and_empty_masks_are_finite():
    values = jnp.array([[1.0, jnp.inf, jnp.nan], [2.0, 3.0, -jnp.inf]])
    mask = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    assert float(masked.masked_sum(values, mask)) == 6.0
    assert float(masked.selected_sum(values, mask)) == 6.0
    assert float(masked.token_mean(values, mask, jnp.asarray(3))) == 2.0
    empty = jnp.zeros_like(mask)
    for out in (
        masked.masked_sum(values, empty),
        masked.masked_mean(values, empty),
        masked.selected_sum(values, empty),
        masked.token_mean(values, empty, jnp.asarray(0)),
        masked.extreme(values, empty, jnp.max, -jnp.inf),
    ):
        assert float(out) == 0.0
