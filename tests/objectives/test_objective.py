"""Tests of jaxrl_llm.objectives.objective: Objective, the presets, make()."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import Objective, make
from tests.objectives.helpers import policy_data, rollout_batch
from tests.reference import objectives as ref

# --------------------------------------------------------------------------------------
# Registry and make()
# --------------------------------------------------------------------------------------


def test_available_lists_the_spec_presets_in_order():
    assert objectives.available() == ref.PRESET_NAMES


@pytest.mark.parametrize("name", ref.PRESET_NAMES)
def test_preset_matches_spec_table(name):
    objective = make(name)
    assert isinstance(objective, Objective)
    for field, want in ref.config(name).items():
        got = getattr(objective, field)
        if isinstance(want, float):
            assert got == pytest.approx(want), field
        else:
            assert got == want, field


def test_make_applies_overrides_without_touching_the_preset():
    objective = make("grpo", kl_coef=0.1, clip_high=0.28, entropy_coef=0.01)
    assert (objective.kl_coef, objective.clip_high, objective.entropy_coef) == (0.1, 0.28, 0.01)
    assert objective.kl_kind == "k3"
    assert objective.aggregation == "seq-mean-token-mean"
    assert make("grpo").kl_coef == pytest.approx(0.04)
    assert make("grpo") == objectives.PRESETS["grpo"]


@pytest.mark.parametrize(
    "name, overrides, match",
    [
        ("no_such_preset", {}, "no_such_preset"),
        ("grpo", {"kl_cof": 0.1}, "kl_cof"),
        ("ppo", {"dual_clip": 1.0}, "dual_clip"),
        ("ppo", {"dual_clip": 0.5}, "dual_clip"),
        ("grpo", {"clip_low": None}, "clip_low"),
        ("grpo", {"clip_low": 1.0}, "clip_low"),
        ("grpo", {"aggregation": "token-avg"}, "aggregation"),
        ("grpo", {"surrogate": "trpo"}, "surrogate"),
        ("grpo", {"kl_kind": "k4"}, "kl_kind"),
        ("grpo", {"kl_placement": "advantage"}, "kl_placement"),
        ("grpo", {"advantage": "vtrace"}, "advantage"),
        ("grpo", {"ratio": "sequence"}, "ratio"),
        ("grpo", {"kl_coef": -0.1}, "kl_coef"),
        ("dr_grpo", {"norm_constant": 0.0}, "norm_constant"),
        ("gmpo", {"ratio": "gspo_token"}, "gmpo"),
    ],
)
def test_make_rejects_bad_input(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        make(name, **overrides)


def test_presets_are_hashable_jit_static_arguments():
    assert hash(make("grpo")) == hash(make("grpo"))
    assert make("grpo") != make("grpo", kl_coef=0.0)
    assert len({make(name) for name in objectives.available()}) == len(objectives.available())
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def loss(objective, lp, batch):
        traces.append(objective)
        return objectives.policy_loss(objective, lp, batch).loss

    data = policy_data(np.random.default_rng(1))
    batch = rollout_batch(data)
    lp = jnp.asarray(data["logprobs"])
    first = loss(make("dapo"), lp, batch)
    second = loss(make("dapo"), lp, batch)  # an equal, distinct instance: cache hit
    assert len(traces) == 1
    loss(make("dapo", clip_high=0.3), lp, batch)
    assert len(traces) == 2
    assert float(first) == float(second)


# --------------------------------------------------------------------------------------
# Objective.extra: user hyper-parameters, hashable
# --------------------------------------------------------------------------------------


def test_extra_accepts_a_dict_and_stays_hashable():
    objective = make("grpo", extra={"beta": [1, [2, 3]], "alpha": 0.5})
    assert objective.extra == (("alpha", 0.5), ("beta", (1, (2, 3))))
    assert objective.extra_dict == {"alpha": 0.5, "beta": (1, (2, 3))}
    # Insertion order and the dict / pairs spelling do not matter.
    same = dataclasses.replace(objective, extra=objective.extra[::-1])
    assert same == objective and hash(same) == hash(objective)
    assert make("grpo", extra={"alpha": 0.6}) != make("grpo", extra={"alpha": 0.5})
    assert make("grpo").extra == () and make("grpo").extra_dict == {}


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"table": {"a": 1}}, r"extra\['table'\]=\{'a': 1\} is not hashable"),
        ({1: 2.0}, "extra names must be non-empty strings"),
        ([("a", 1), ("a", 2)], "extra names must be unique"),
        ((1, 2), r"a mapping or \(name, value\) pairs"),
    ],
)
def test_extra_rejects_bad_input(extra, match):
    with pytest.raises(ValueError, match=match):
        make("grpo", extra=extra)
