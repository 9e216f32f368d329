"""Fixtures of the jaxrl_llm.objectives tests."""

from __future__ import annotations

import pytest

from jaxrl_llm import objectives


@pytest.fixture
def restore_registries():
    """Leaves the registries as it found them: unregisters what a test added and re-registers
    any built-in it overrode."""
    surrogates = dict(objectives.SURROGATES)
    estimators = dict(objectives.ESTIMATORS)
    ratios = dict(objectives.RATIOS)
    yield
    for name in set(objectives.SURROGATES) - set(surrogates):
        objectives.unregister_surrogate(name)
    for name in set(objectives.ESTIMATORS) - set(estimators):
        objectives.unregister_estimator(name)
    for name in set(objectives.RATIOS) - set(ratios):
        objectives.unregister_ratio(name)
    for name, spec in surrogates.items():
        if objectives.SURROGATES.get(name) is not spec:
            objectives.register_surrogate(name, **spec._asdict(), override=True)
    for name, spec in estimators.items():
        if objectives.ESTIMATORS.get(name) is not spec:
            objectives.register_estimator(name, **spec._asdict(), override=True)
    for name, fn in ratios.items():
        if objectives.RATIOS.get(name) is not fn:
            objectives.register_ratio(name, fn, override=True)
