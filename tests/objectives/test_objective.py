"""Tests of jaxrl_llm.objectives.objective: Objective, the presets, make()."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.objectives import Objective, make, pieces
from jaxrl_llm.objectives.objective import FLAT_NAMES
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
        got = objective.name if field == "name" else objective.value_of(field)
        if isinstance(want, float):
            assert got == pytest.approx(want), field
        else:
            assert got == want, field


def test_make_applies_overrides_without_touching_the_preset():
    objective = make("grpo", kl_coef=0.1, clip_high=0.28, entropy_coef=0.01)
    assert (objective.kl.coef, objective.surrogate.clip_high, objective.entropy.coef) == (
        0.1,
        0.28,
        0.01,
    )
    assert objective.kl.kind == "k3"
    assert objective.aggregation.mode == "seq-mean-token-mean"
    assert make("grpo").kl.coef == pytest.approx(0.04)
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
# Pieces: an objective is a composition; flat names route to the pieces
# --------------------------------------------------------------------------------------


def test_presets_are_compositions_of_pieces():
    grpo = make("grpo")
    assert grpo.kl == pieces.KLPenalty(kind="k3", coef=0.04)
    assert grpo.aggregation == pieces.Aggregation("seq-mean-token-mean")
    assert make("cispo").surrogate == pieces.Surrogate("cispo", clip_low=None, clip_high=4.0)
    assert make("ppo").advantage.name == "gae" and make("ppo").kl.in_reward


FLAT_VALUES = {
    "advantage": "rloo",
    "advantage_scale": "batch",
    "std_ddof": 0,
    "gamma": 0.9,
    "lam": 0.8,
    "reward_weights": [1.0, 2.0],
    "distill_coef": 0.5,
    "prime_beta": 0.1,
    "dynamic_sampling": True,
    "ratio": "gspo_token",
    "ratio_clamp": 10.0,
    "max_log_ratio": 5.0,
    "surrogate": "cispo",
    "clip_low": None,
    "clip_high": 3.0,
    "dual_clip": None,
    "tau_pos": 2.0,
    "tau_neg": 3.0,
    "ratio_cap": 4.0,
    "cov_fraction": 0.01,
    "cov_bounds": [0.5, 2.0],
    "kl_cov_coef": 0.2,
    "kl_kind": "k2",
    "kl_coef": 0.3,
    "kl_placement": "loss",
    "kl_straight_through": True,
    "kl_bias_correction": True,
    "entropy_coef": 0.01,
    "entropy_target": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_coef_bounds": [0.0, 0.5],
    "aggregation": "token-sum",
    "norm_constant": 7.0,
    "top_entropy_quantile": 0.2,
    "off_policy_mask_threshold": 0.5,
    "m2_threshold": 0.04,
    "value_clip": 0.3,
    "value_coef": 0.7,
    "distill_loss": "jsd",
    "jsd_beta": 0.25,
    "distill_top_k": 8,
    "distill_loss_coef": 2.0,
}


def test_every_flat_name_sets_its_piece_field():
    assert set(FLAT_VALUES) == set(FLAT_NAMES) - {"advantage_params", "surrogate_params"}
    objective = make("grpo", **FLAT_VALUES)
    for flat, value in FLAT_VALUES.items():
        piece, field = FLAT_NAMES[flat]
        got = getattr(getattr(objective, piece), field)
        assert got == (tuple(value) if isinstance(value, list) else value), flat
        assert objective.value_of(flat) == got
    with pytest.raises(ValueError, match="unknown Objective field 'kl_cof'"):
        objective.value_of("kl_cof")
    assert hash(objective) == hash(make("grpo", **FLAT_VALUES))


def test_pieces_replace_whole_or_in_part_and_conflicts_are_refused():
    objective = make("grpo", kl=pieces.KLPenalty("k1", 0.1, placement="reward"))
    assert objective.kl == pieces.KLPenalty("k1", 0.1, placement="reward")
    partly = make("grpo", kl={"coef": 0.5})  # a mapping updates the named fields only
    assert partly.kl == pieces.KLPenalty("k3", 0.5)
    assert make("grpo", surrogate=pieces.Surrogate("sapo")).surrogate.name == "sapo"
    with pytest.raises(ValueError, match="kl_coef is set twice"):
        make("grpo", kl={"coef": 0.5}, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"unknown kl field\(s\) \['beta'\]"):
        make("grpo", kl={"beta": 0.5})
    with pytest.raises(ValueError, match=r"unknown Objective field\(s\) \['clip_hihg'\]"):
        make("grpo", clip_hihg=0.3)
    with pytest.raises(ValueError, match="Objective.kl must be a KLPenalty"):
        Objective(kl=0.1)


def test_each_piece_checks_its_own_fields_with_the_flat_name():
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        pieces.KLPenalty("k3", -1.0)
    with pytest.raises(ValueError, match="clip_low must be in"):
        pieces.Surrogate(clip_low=1.5)
    with pytest.raises(ValueError, match="aggregation mode"):
        pieces.Aggregation("mean-of-everything")
    with pytest.raises(ValueError, match="entropy_coef_bounds"):
        pieces.Entropy(coef_bounds=(0.5, 0.1))
