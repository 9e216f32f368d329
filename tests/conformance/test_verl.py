r"""Conformance with verl's own loss code (``verl.trainer.ppo.core_algos``, verl 0.9.1).

Every advantage estimator, policy loss, KL penalty, aggregation mode and the value loss that
jaxrl_llm shares with verl is run on both sides with the same inputs: verl in float64 torch,
ours in float32 JAX, so the tolerances are f32-level. Where shared/SPEC_LOSSES.md makes a
different choice than verl, the agreement is tested where the two agree and the documented
difference is asserted (each marked ``DIFFERENCE``).

verl is optional: the module is skipped unless verl 0.9.1 and the few light packages its loss
module imports at module level are installed (``JAXRL_REQUIRE_VERL=1`` turns the skip into a
failure, so CI cannot skip silently)::

    pip install --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.4.0 \
        codetiming==1.4.0 cloudpickle==3.1.3 orjson==3.13.0

(``--no-deps``: verl's own requirements pull in Ray, wandb, hydra, peft and ~70 other packages
and downgrade transformers to <5.11; pyvers pins packaging<26. Those seven wheels are exactly
what the loss code imports beyond numpy, PyYAML, packaging, torch and transformers, which the
``test`` extras bring. ``pip check`` then lists verl's unmet requirements: expected.)

Ray is imported by ``verl/__init__.py`` (through ``verl.protocol``) but never used by the loss
code; when it is not installed a stub stands in for the duration of the import only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.losses import advantages as adv
from jaxrl_llm.losses import aggregation, kl, ratios, surrogates, value
from jaxrl_llm.losses.aggregation import MODES
from jaxrl_llm.types import RolloutBatch

VERL_VERSION = "0.9.1"
INSTALL = (
    f"pip install --no-deps verl=={VERL_VERSION} tensordict==0.10.0 pyvers==0.1.0 "
    "omegaconf==2.4.0 codetiming==1.4.0 cloudpickle==3.1.3 orjson==3.13.0"
)


def _unavailable(reason):
    """Skips the module, or fails it when ``JAXRL_REQUIRE_VERL=1`` (CI must not skip)."""
    message = f"{reason}; install verl's loss code with: {INSTALL}"
    if os.environ.get("JAXRL_REQUIRE_VERL") == "1":
        pytest.fail(f"JAXRL_REQUIRE_VERL=1 but {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def _session_state():
    handlers = [h for h in logging.root.handlers if type(h).__module__ != "_pytest.logging"]
    return dict(os.environ), handlers, logging.root.level


def _import_core_algos(before):
    stub = None
    if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
        stub = types.ModuleType("ray")
        stub.ObjectRef = type("ObjectRef", (), {})  # the only attribute read at import time
        sys.modules["ray"] = stub
    try:
        try:
            module, missing = importlib.import_module("verl.trainer.ppo.core_algos"), None
        except ImportError as error:
            module, missing = None, str(error)
        if module is None:
            _unavailable(f"verl's loss code is not importable ({missing})")
        version = importlib.metadata.version("verl")
        if version != VERL_VERSION:  # the DIFFERENCE tests pin one release's behaviour
            _unavailable(f"verl {version} is installed, these tests are written for {VERL_VERSION}")
        return module
    finally:
        if stub is not None and sys.modules.get("ray") is stub:
            del sys.modules["ray"]  # nothing else in the session may mistake the stub for Ray
        # Importing verl calls logging.basicConfig (a root stderr handler) and sets a few
        # environment variables for its subprocesses: the rest of the session must not inherit
        # them, as the module is imported at collection, before every other test.
        environ, handlers, level = before
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        for handler in logging.root.handlers[:]:
            if type(handler).__module__ != "_pytest.logging" and handler not in handlers:
                logging.root.removeHandler(handler)
        logging.root.setLevel(level)


_STATE_BEFORE_VERL = _session_state()
core_algos = _import_core_algos(_STATE_BEFORE_VERL)
import torch  # noqa: E402  (verl's loss code imports it, so it is there)
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

B, T = 8, 7
RTOL, ATOL = 1e-5, 1e-5  # f32 (ours) against f64 (verl) on the same f32 inputs


# ----------------------------------------------------------------------------- helpers


def _t(x, *, grad=False):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=grad)


def _np(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def _close(ours, theirs, *, rtol=RTOL, atol=ATOL, msg=""):
    np.testing.assert_allclose(np.float64(ours), _np(theirs), rtol=rtol, atol=atol, err_msg=msg)


def _mask(rng, *, holes=False, empty_rows=()):
    """``[B, T]`` f32 0/1, right-padded with random lengths (row 0 full); ``holes`` punches
    masked positions inside rows (multi-turn observation tokens) but keeps rows non-empty."""
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    if holes:
        mask &= rng.random((B, T)) > 0.3
        mask[:, 0] = True
    mask[list(empty_rows)] = False
    return mask.astype(np.float32)


def _index(group_size):
    return np.repeat(np.arange(B // group_size), group_size)


def _outcome_token_rewards(rewards, mask):
    """verl's layout of an outcome reward: on the last valid token (column 0 of empty rows)."""
    token_rewards = np.zeros(mask.shape, np.float32)
    last = np.where(mask.any(axis=1), mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
    token_rewards[np.arange(len(rewards)), last] = rewards
    return token_rewards


def _rewards(rng, kind, group_size):
    groups = B // group_size
    if kind == "gaussian":
        rewards = rng.normal(size=(groups, group_size))
    else:  # 0/1: the last group mixed, then an all-correct and an all-wrong group if room
        rewards = rng.integers(0, 2, size=(groups, group_size)).astype(np.float64)
        rewards[-1, 0], rewards[-1, -1] = 0.0, 1.0
        if groups >= 2:
            rewards[0] = 1.0
        if groups >= 3:
            rewards[1] = 0.0
    return rewards.reshape(-1).astype(np.float32)


def _actor_config(**kwargs):
    kwargs.setdefault("global_batch_info", {})
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **kwargs)


def _verl_policy_loss(name, config, lp, old, advantages, mask, mode):
    """verl's registered policy loss: ``(loss, d loss / d log_prob, metrics)``."""
    log_prob = _t(lp, grad=True)
    token_adv = (
        np.broadcast_to(advantages[:, None], lp.shape) if advantages.ndim == 1 else advantages
    )
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        _t(old), log_prob, _t(token_adv), _t(mask), mode, config
    )
    loss.backward()
    return loss, log_prob.grad, metrics


def _ours(fn, lp):
    """``(value, gradient)`` of a scalar JAX loss of the log-probs, and its aux."""
    (loss, aux), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(lp))
    return loss, grad, aux


def _policy_batch(rng, *, adv_rank, extreme=True, empty_rows=(3,)):
    """f32 ``(lp, old, advantages, mask)``; ``extreme`` puts |Δ| = 25 on a few tokens (beyond
    the ±20 ratio clamp, the dual clip and every clip range) and a whole row at Δ = +12."""
    lp = rng.uniform(-8.0, -0.01, (B, T))
    old = lp + rng.normal(0.0, 0.3, (B, T))
    if extreme:
        old[0, :3] = lp[0, :3] + np.array([25.0, -25.0, 1.5])
        old[2] = lp[2] - 12.0
    shape = (B,) if adv_rank == 1 else (B, T)
    advantages = rng.normal(size=shape)
    advantages[1] = 0.0
    mask = _mask(rng, empty_rows=empty_rows)
    return tuple(x.astype(np.float32) for x in (lp, old, advantages)) + (mask,)


def _token_mean(x, mask):
    return aggregation.aggregate(x, mask, "token-mean")


def test_importing_verl_leaves_the_session_alone():
    """The rest of the suite runs after this module's import: no root logging handler, level
    or environment variable of verl's may leak into it."""
    environ, handlers, level = _STATE_BEFORE_VERL
    assert "verl.trainer.ppo.core_algos" in sys.modules
    ours = [h for h in logging.root.handlers if type(h).__module__ != "_pytest.logging"]
    assert (ours, logging.root.level) == (handlers, level)
    changed = {k: v for k, v in os.environ.items() if environ.get(k) != v}
    assert changed.keys() <= {"PYTEST_CURRENT_TEST"}
    assert set(environ) <= set(os.environ)


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("kind", ["gaussian", "binary"])
@pytest.mark.parametrize("norm_by_std", [True, False], ids=["grpo", "dr_grpo"])
def test_grpo_matches_verl(rng, group_size, kind, norm_by_std):
    rewards = _rewards(rng, kind, group_size)
    mask = _mask(rng)
    ours = adv.grpo(rewards, group_size=group_size, scale="group" if norm_by_std else "none")
    token_rewards, index = _t(_outcome_token_rewards(rewards, mask)), _index(group_size)
    for fn in (
        core_algos.compute_grpo_outcome_advantage,
        core_algos.compute_grpo_vectorized_outcome_advantage,
    ):
        theirs, _ = fn(token_rewards, _t(mask), index, 1e-6, norm_by_std)
        _close(ours[:, None] * mask, theirs, msg=fn.__name__)


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("kind", ["gaussian", "binary"])
def test_rloo_matches_verl(rng, group_size, kind):
    rewards = _rewards(rng, kind, group_size)
    mask = _mask(rng)
    ours = adv.rloo(rewards, group_size=group_size)[:, None] * mask
    token_rewards, index = _t(_outcome_token_rewards(rewards, mask)), _index(group_size)
    for fn in (
        core_algos.compute_rloo_outcome_advantage,
        core_algos.compute_rloo_vectorized_outcome_advantage,
    ):
        _close(ours, fn(token_rewards, _t(mask), index)[0], msg=fn.__name__)


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("kind", ["gaussian", "binary"])
def test_opo_matches_verl(rng, group_size, kind):
    rewards = _rewards(rng, kind, group_size)
    mask = _mask(rng)
    ours = adv.opo(rewards, mask, group_size=group_size)[:, None] * mask
    theirs, _ = core_algos.compute_opo_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)), _t(mask), _index(group_size)
    )
    _close(ours, theirs)


@pytest.mark.parametrize("group_size", [2, 4])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("kind", ["gaussian", "binary"])
def test_pass_at_k_matches_verl(rng, group_size, norm_by_std, kind):
    rewards = _rewards(rng, kind, group_size)
    mask = _mask(rng)
    scale = "group" if norm_by_std else "none"
    ours = adv.pass_at_k(rewards, group_size=group_size, scale=scale)[:, None] * mask
    theirs, _ = core_algos.compute_grpo_passk_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)),
        _t(mask),
        _index(group_size),
        config=AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std),
    )
    _close(ours, theirs)


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_reinforce_pp_baseline_matches_verl(rng, group_size):
    # Unlike GRPO / RLOO / OPO, both sides agree on G = 1: no group baseline, A0 = r.
    rewards = _rewards(rng, "gaussian", group_size)
    mask = _mask(rng, holes=True)
    ours = adv.reinforce_pp_baseline(rewards, mask, group_size=group_size)
    theirs, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)), _t(mask), _index(group_size)
    )
    _close(ours, theirs)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_verl(rng, gamma):
    mask = _mask(rng, holes=True)
    token_rewards = rng.normal(size=(B, T)).astype(np.float32)
    ours = adv.reinforce_pp(token_rewards, mask, gamma=gamma)
    theirs, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        _t(token_rewards), _t(mask), config=AlgoConfig(gamma=gamma)
    )
    _close(ours, theirs)


def test_remax_matches_verl(rng):
    rewards, baselines = rng.normal(size=(2, B)).astype(np.float32)
    mask = _mask(rng)  # right-padded: verl's reward-to-go is the outcome reward on every token
    ours = adv.remax(rewards, baselines)[:, None] * mask
    theirs, _ = core_algos.compute_remax_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)), _t(baselines), _t(mask)
    )
    _close(ours, theirs)


@pytest.mark.parametrize("group_size", [2, 4])
def test_gpg_matches_verl_when_its_alpha_agrees(rng, group_size):
    """verl's GPG uses ``α = B / #rows with a non-zero reward``, the spec ``α = B / #rows of
    non-constant groups``: the two coincide when every constant group is all-zero and no other
    row has a zero reward (here half the groups, so α = 2, not a trivial 1)."""
    rewards = _rewards(rng, "gaussian", group_size).reshape(-1, group_size)
    rewards[1::2] = 0.0
    rewards = rewards.reshape(-1)
    mask = _mask(rng)
    ours = adv.gpg(rewards, group_size=group_size)
    theirs, _ = core_algos.compute_gpg_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)), _t(mask), _index(group_size)
    )
    _close(ours[:, None] * mask, theirs)
    centered = rewards - np.repeat(rewards.reshape(-1, group_size).mean(1), group_size)
    np.testing.assert_allclose(ours, 2.0 * centered, rtol=1e-6, atol=1e-7)


def test_gpg_alpha_difference(rng):
    """DIFFERENCE: verl counts rows with a non-zero reward, so an all-correct group (zero
    advantage) inflates its denominator and a mixed 0/1 group counts only its correct rows;
    the spec counts rows whose group is not constant (the rows whose advantage can be
    non-zero, which is what GPG's correction is for)."""
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float32)  # G = 4: all-correct, mixed
    mask = _mask(rng)
    ours = adv.gpg(rewards, group_size=4)
    theirs, _ = core_algos.compute_gpg_outcome_advantage(
        _t(_outcome_token_rewards(rewards, mask)), _t(mask), _index(4)
    )
    centered = np.array([0, 0, 0, 0, -0.25, 0.75, -0.25, -0.25])
    np.testing.assert_allclose(ours, 8 / 4 * centered, rtol=1e-6)  # 4 rows in mixed groups
    _close(8 / 5 * centered[:, None] * mask, theirs)  # 5 rows with reward 1


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.0, 0.5)])
def test_gae_matches_verl_on_valid_tokens(rng, gamma, lam):
    """DIFFERENCE at masked positions: verl leaves the carried GAE (whitened) and value there;
    the spec returns exactly 0 (the aggregation masks them on both sides)."""
    mask = _mask(rng, holes=True)
    token_rewards, values = rng.normal(size=(2, B, T)).astype(np.float32)
    ours_adv, ours_ret = adv.gae(token_rewards, values, mask, gamma=gamma, lam=lam)
    theirs_adv, theirs_ret = core_algos.compute_gae_advantage_return(
        _t(token_rewards), _t(values), _t(mask), gamma, lam
    )
    valid = mask > 0
    _close(np.asarray(ours_adv)[valid], _np(theirs_adv)[valid])
    _close(np.asarray(ours_ret)[valid], _np(theirs_ret)[valid])
    assert not np.any(np.asarray(ours_adv)[~valid]) and not np.any(np.asarray(ours_ret)[~valid])
    assert np.any(_np(theirs_ret)[~valid] != 0)


def test_group_of_one_difference(rng):
    """DIFFERENCE for G = 1 (one completion per prompt): the spec gives GRPO, RLOO, OPO and GPG
    advantage exactly 0 (no baseline can be formed from the row itself); verl's loop
    implementations fall back to baseline 0 (and std 1), i.e. the raw reward. verl's own
    vectorized RLOO agrees with the spec."""
    rewards = rng.normal(size=B).astype(np.float32)
    mask = _mask(rng)
    token_rewards, index = _t(_outcome_token_rewards(rewards, mask)), _index(1)
    for name in ("grpo", "rloo", "gpg"):
        np.testing.assert_array_equal(getattr(adv, name)(rewards, group_size=1), np.zeros(B))
    np.testing.assert_array_equal(adv.opo(rewards, mask, group_size=1), np.zeros(B))
    raw = rewards[:, None] * mask
    grpo, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, _t(mask), index)
    _close(raw / (1 + 1e-6), grpo)
    _close(raw, core_algos.compute_rloo_outcome_advantage(token_rewards, _t(mask), index)[0])
    _close(raw, core_algos.compute_opo_outcome_advantage(token_rewards, _t(mask), index)[0])
    gpg, _ = core_algos.compute_gpg_outcome_advantage(token_rewards, _t(mask), index)
    _close(raw, gpg)  # α = 1: no reward is exactly 0
    rloo_vec, _ = core_algos.compute_rloo_vectorized_outcome_advantage(
        token_rewards, _t(mask), index
    )
    _close(np.zeros((B, T)), rloo_vec)


def test_whitening_a_single_token_difference():
    """DIFFERENCE: with fewer than two valid tokens verl's masked_whiten raises (unbiased
    variance of one value); the spec returns ``x − μ`` (here 0) so a tiny batch never crashes."""
    mask = np.zeros((2, 3), np.float32)
    mask[0, 1] = 1.0
    token_rewards = np.full((2, 3), 2.0, np.float32)
    np.testing.assert_array_equal(adv.reinforce_pp(token_rewards, mask), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="sum of the mask is one"):
        core_algos.compute_reinforce_plus_plus_outcome_advantage(
            _t(token_rewards), _t(mask), config=AlgoConfig(gamma=1.0)
        )


# ----------------------------------------------------------------------------- KL


KL_NAMES = [
    ("kl", "k1"),
    ("k1", "k1"),
    ("mse", "k2"),
    ("k2", "k2"),
    ("low_var_kl", "k3"),
    ("k3", "k3"),
    ("abs", "abs"),
]


@pytest.mark.parametrize("straight_through", [False, True], ids=["plain", "plus"])
@pytest.mark.parametrize(("verl_name", "kind"), KL_NAMES, ids=[n for n, _ in KL_NAMES])
def test_kl_penalty_matches_verl(rng, verl_name, kind, straight_through):
    lp = rng.uniform(-30.0, -0.01, (B, T)).astype(np.float32)
    ref_lp = (lp + rng.normal(0.0, 10.0, (B, T))).astype(np.float32)
    x = ref_lp - lp
    assert (x > 20).any() and (x < -20).any() and ((x > 2.7) & (x < 20)).any()  # k3's clamps

    def ours(x):
        per_token = kl.estimate(x, ref_lp, kind=kind, straight_through=straight_through)
        return per_token.sum(), per_token

    _, ours_grad, ours_value = _ours(ours, lp)
    log_prob = _t(lp, grad=True)
    name = verl_name + ("+" if straight_through else "")
    theirs = core_algos.kl_penalty(log_prob, _t(ref_lp), name)
    theirs.sum().backward()
    _close(ours_value, theirs, msg=name)
    _close(ours_grad, log_prob.grad, msg=name)


def test_kl_in_reward_matches_verl(rng):
    scores = rng.normal(size=(B, T)).astype(np.float32)
    old, ref_lp = rng.uniform(-8.0, -0.01, (2, B, T)).astype(np.float32)
    ours = scores - 0.05 * kl.estimate(old, ref_lp, kind="k1")
    _close(ours, core_algos.compute_rewards(_t(scores), _t(old), _t(ref_lp), 0.05))


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_verl(rng, mode):
    mask = _mask(rng, holes=True, empty_rows=(3,))
    values = rng.normal(0.0, 2.0, (B, T)).astype(np.float32)

    def ours(v, **kwargs):
        return aggregation.aggregate(v, mask, mode, **kwargs), None

    loss, grad, _ = _ours(ours, values)
    theirs_values = _t(values, grad=True)
    theirs = core_algos.agg_loss(theirs_values, _t(mask), mode)
    theirs.backward()
    _close(loss, theirs)
    _close(grad, theirs_values.grad)

    # Micro-batches with global normalisers (verl's global_batch_info) sum to the full batch.
    num_tokens, num_seqs = aggregation.normalisers(mask)
    total_ours = total_theirs = 0.0
    for rows in np.split(np.arange(B), 2):
        total_ours += aggregation.aggregate(
            values[rows], mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs
        )
        total_theirs += core_algos.agg_loss(
            _t(values[rows]),
            _t(mask[rows]),
            mode,
            batch_num_tokens=float(num_tokens),
            global_batch_size=float(num_seqs),
        )
    _close(total_ours, total_theirs)
    _close(total_ours, theirs)
    custom = aggregation.aggregate(values, mask, mode, norm_constant=3.0)
    _close(custom, core_algos.agg_loss(_t(values), _t(mask), mode, loss_scale_factor=3.0))


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_difference(mode):
    """DIFFERENCE: an all-masked (micro-)batch divides 0 by 0 in verl (NaN, except token-sum);
    the spec guards every denominator with ``max(·, 1)``, so the loss is exactly 0."""
    values, mask = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    assert aggregation.aggregate(values, mask, mode) == 0.0
    theirs = float(core_algos.agg_loss(_t(values), _t(mask), mode))
    assert theirs == 0.0 if mode == "token-sum" else np.isnan(theirs)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_matches_verl(rng, mode, clip):
    mask = _mask(rng, empty_rows=(3,))
    old_values, returns = rng.normal(0.0, 2.0, (2, B, T)).astype(np.float32)
    values = (old_values + rng.normal(0.0, 0.7, (B, T))).astype(np.float32)

    def ours(v):
        per_token = value.clipped_value_loss(v, old_values, returns, clip=clip)
        frac = value.value_clip_fraction(v, old_values, returns, clip=clip)
        return aggregation.aggregate(per_token, mask, mode), _token_mean(frac, mask)

    loss, grad, clipfrac = _ours(ours, values)
    vpreds = _t(values, grad=True)
    theirs, theirs_clipfrac = core_algos.compute_value_loss(
        vpreds, _t(returns), _t(old_values), _t(mask), clip, mode
    )
    theirs.backward()
    _close(loss, theirs)
    _close(grad, vpreds.grad)
    _close(clipfrac, theirs_clipfrac)
    assert 0 < clipfrac < 1


# ----------------------------------------------------------------------------- policy losses


# (clip_low, clip_high, dual_clip, aggregation, advantage rank): every mode with clip-higher and
# the dual clip, the other settings with the two most used modes.
PPO_CASES = [(0.2, 0.28, 3.0, mode, rank) for mode in MODES for rank in (1, 2)]
PPO_CASES += [
    (*bounds, mode, rank)
    for bounds, rank in [((0.2, 0.2, None), 1), ((0.2, 0.28, None), 2), ((0.1, 0.3, 2.0), 1)]
    for mode in ("token-mean", "seq-mean-token-mean")
]


@pytest.mark.parametrize(("clip_low", "clip_high", "dual_clip", "mode", "adv_rank"), PPO_CASES)
def test_vanilla_ppo_matches_verl(rng, clip_low, clip_high, dual_clip, mode, adv_rank):
    """verl's "vanilla" loss always dual-clips (``clip_ratio_c``, default 3); ``dual_clip=None``
    is verl with an unreachable ``clip_ratio_c``."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank)
    kw = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}

    def ours(x):
        log_ratio = ratios.token_log_ratio(x, old)
        per_token = surrogates.ppo_clip(log_ratio, advantages, **kw)
        indicators = surrogates.ppo_clip_metrics(log_ratio, advantages, **kw)
        metrics = {
            "actor/pg_clipfrac": _token_mean(indicators["clipped"], mask),
            "actor/pg_clipfrac_lower": _token_mean(indicators["clipped_lower"], mask),
            "actor/ppo_kl": _token_mean(-log_ratio, mask),
        }
        return aggregation.aggregate(per_token, mask, mode), metrics

    loss, grad, metrics = _ours(ours, lp)
    config = _actor_config(
        clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=dual_clip or 1e9
    )
    theirs, theirs_grad, theirs_metrics = _verl_policy_loss(
        "vanilla", config, lp, old, advantages, mask, mode
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)
    assert metrics.keys() == theirs_metrics.keys()
    for key, value_ in metrics.items():
        _close(value_, theirs_metrics[key], msg=key)
    assert metrics["actor/pg_clipfrac"] > 0
    assert (metrics["actor/pg_clipfrac_lower"] > 0) == (dual_clip is not None)


def test_vanilla_ppo_with_global_normalisers_matches_verl(rng):
    """verl's ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size) is the
    spec's ``num_tokens`` / ``num_seqs``: two micro-batches sum to the full-batch loss."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=1)
    num_tokens, num_seqs = aggregation.normalisers(mask)
    info = {
        "dp_size": 1,
        "batch_num_tokens": float(num_tokens),
        "global_batch_size": float(num_seqs),
    }
    for mode in MODES:
        total_ours = total_theirs = 0.0
        for rows in np.split(np.arange(B), 2):
            per_token = surrogates.ppo_clip(
                ratios.token_log_ratio(lp[rows], old[rows]), advantages[rows], dual_clip=3.0
            )
            total_ours += aggregation.aggregate(
                per_token, mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs
            )
            config = _actor_config(clip_ratio_c=3.0, global_batch_info=dict(info))
            total_theirs += _verl_policy_loss(
                "vanilla", config, lp[rows], old[rows], advantages[rows], mask[rows], mode
            )[0]
        _close(total_ours, total_theirs, msg=mode)


GSPO_CASES = [(3e-4, 4e-4, mode, 1) for mode in MODES]
GSPO_CASES += [(3e-4, 4e-4, "seq-mean-token-mean", 2), (0.2, 0.2, "seq-mean-token-mean", 2)]


@pytest.mark.parametrize(("clip_low", "clip_high", "mode", "adv_rank"), GSPO_CASES)
def test_gspo_matches_verl(rng, clip_low, clip_high, mode, adv_rank):
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank)

    def ours(x):
        log_ratio = ratios.gspo_token_log_ratio(x, old, mask)
        per_token = surrogates.ppo_clip(
            log_ratio, advantages, clip_low=clip_low, clip_high=clip_high
        )
        clipped = surrogates.ppo_clip_metrics(
            log_ratio, advantages, clip_low=clip_low, clip_high=clip_high
        )["clipped"]
        metrics = {
            "actor/pg_clipfrac": _token_mean(clipped, mask),
            "actor/ppo_kl": _token_mean(old - x, mask),  # unclamped in verl's GSPO
        }
        return aggregation.aggregate(per_token, mask, mode), metrics

    loss, grad, metrics = _ours(ours, lp)
    config = _actor_config(clip_ratio_low=clip_low, clip_ratio_high=clip_high)
    theirs, theirs_grad, theirs_metrics = _verl_policy_loss(
        "gspo", config, lp, old, advantages, mask, mode
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)
    for key, value_ in metrics.items():
        _close(value_, theirs_metrics[key], msg=key)
    assert theirs_metrics["actor/pg_clipfrac_lower"] == 0.0


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("clip_low", "clip_high"), [(None, 4.0), (0.2, 0.28)])
def test_cispo_matches_verl(rng, clip_low, clip_high, mode, adv_rank):
    """Both read the upper bound as ``1 + clip_high``; the spec's ``clip_low=None`` (no lower
    bound) is verl's ``clip_ratio_low=1`` (lower bound 0, and a ratio is never negative)."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank)
    kw = {"clip_low": clip_low, "clip_high": clip_high}

    def ours(x):
        log_ratio = ratios.token_log_ratio(x, old)
        per_token = surrogates.cispo(log_ratio, x, advantages, **kw)
        clipped = surrogates.cispo_metrics(log_ratio, **kw)["clipped"]
        return aggregation.aggregate(per_token, mask, mode), _token_mean(clipped, mask)

    loss, grad, clipfrac = _ours(ours, lp)
    config = _actor_config(
        clip_ratio_low=1.0 if clip_low is None else clip_low, clip_ratio_high=clip_high
    )
    theirs, theirs_grad, theirs_metrics = _verl_policy_loss(
        "cispo", config, lp, old, advantages, mask, mode
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)
    _close(clipfrac, theirs_metrics["actor/pg_clipfrac"])
    assert clipfrac > 0


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_matches_verl(rng, tau_pos, tau_neg, adv_rank):
    """verl's SAPO always aggregates seq-mean-token-mean (its ``loss_agg_mode`` is ignored);
    here the mode is the objective's, and the sapo preset uses seq-mean-token-mean."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank)
    mode = "seq-mean-token-mean"

    def ours(x):
        log_ratio = ratios.token_log_ratio(x, old)
        per_token = surrogates.sapo(log_ratio, advantages, tau_pos=tau_pos, tau_neg=tau_neg)
        return aggregation.aggregate(per_token, mask, mode), None

    loss, grad, _ = _ours(ours, lp)
    config = _actor_config(tau_pos=tau_pos, tau_neg=tau_neg)
    for verl_mode in (mode, "token-mean"):
        theirs, theirs_grad, _ = _verl_policy_loss(
            "sapo", config, lp, old, advantages, mask, verl_mode
        )
        _close(loss, theirs, msg=verl_mode)
        _close(grad, theirs_grad, msg=verl_mode)


@pytest.mark.parametrize(("mode", "adv_rank"), [(mode, 1) for mode in MODES] + [("token-mean", 2)])
def test_gpg_loss_matches_verl(rng, mode, adv_rank):
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank)

    def ours(x):
        return aggregation.aggregate(surrogates.reinforce(x, advantages), mask, mode), None

    loss, grad, _ = _ours(ours, lp)
    theirs, theirs_grad, _ = _verl_policy_loss(
        "gpg", _actor_config(), lp, old, advantages, mask, mode
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize(("clip_low", "clip_high"), [(0.4, 0.4), (0.2, 0.3)])
def test_gmpo_matches_verl_geo_mean(rng, clip_low, clip_high, adv_rank):
    """verl's ``geo_mean`` is GMPO: log-space token clip, no ratio clamp, one loss per sequence
    averaged over the batch (its ``loss_agg_mode`` is unused)."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=adv_rank, empty_rows=())
    kw = {"clip_low": clip_low, "clip_high": clip_high}

    def ours(x):
        per_seq = surrogates.gmpo(x - old, advantages, mask, **kw)
        return aggregation.sequence_mean(per_seq, mask), None

    loss, grad, _ = _ours(ours, lp)
    config = _actor_config(clip_ratio_low=clip_low, clip_ratio_high=clip_high)
    theirs, theirs_grad, _ = _verl_policy_loss(
        "geo_mean", config, lp, old, advantages, mask, "token-mean"
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)


def test_gmpo_empty_rows_difference(rng):
    """DIFFERENCE: verl averages GMPO's per-sequence losses over all B rows, so an empty
    (fully masked) row dilutes the mean; the spec averages over non-empty rows only, as the
    seq-mean aggregation modes do on both sides."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=1, empty_rows=(3, 5))
    per_seq = surrogates.gmpo(lp - old, advantages, mask)
    ours = aggregation.sequence_mean(per_seq, mask)
    theirs, _, _ = _verl_policy_loss(
        "geo_mean",
        _actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4),
        lp,
        old,
        advantages,
        mask,
        "token-mean",
    )
    _close(ours * (B - 2) / B, theirs)
    assert abs(float(ours) - float(_np(theirs))) > 1e-3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clip_cov_without_selected_tokens_is_ppo_clip(rng, mode):
    """Clip-Cov (not in the spec) zeroes the gradient of a random few tokens whose
    advantage-logprob covariance lies in ``[lb, ub]``; with an empty window it must reduce to
    the plain clipped surrogate (no dual clip, no ratio clamp), which is ours."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=2, extreme=False)

    def ours(x):
        per_token = surrogates.ppo_clip(x - old, advantages, clip_low=0.2, clip_high=0.28)
        return aggregation.aggregate(per_token, mask, mode), None

    loss, grad, _ = _ours(ours, lp)
    config = _actor_config(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_lb=1e8, clip_cov_ub=1e9),
    )
    theirs, theirs_grad, _ = _verl_policy_loss("clip_cov", config, lp, old, advantages, mask, mode)
    _close(loss, theirs)
    _close(grad, theirs_grad)


# ----------------------------------------------------------------------------- presets


# verl's loss for each of our (surrogate, ratio) pairs.
_VERL_LOSS = {
    ("ppo_clip", "token"): "vanilla",
    ("ppo_clip", "gspo_token"): "gspo",
    ("cispo", "token"): "cispo",
    ("sapo", "token"): "sapo",
    ("reinforce", "token"): "gpg",
    ("gmpo", "token"): "geo_mean",
}
_VERL_KL = {"k1": "k1", "k2": "k2", "k3": "low_var_kl", "abs": "abs"}
PRESETS = ["grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "cispo", "gmpo", "sapo"]
PRESETS += ["rloo", "reinforce_pp", "gpg", "ppo", "prime"]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_policy_loss_matches_verl_actor(rng, name):
    """``objectives.policy_loss`` of each preset against verl's actor loss with the same
    settings: the registered policy loss plus ``kl_loss_coef · agg_loss(kl_penalty(lp, ref))``
    when the KL is in the loss (as ``verl/workers/utils/losses.py::ppo_loss`` composes them)."""
    objective = objectives.make(name)
    assert (objective.ratio.clamp, objective.ratio.max_log_ratio) == (
        20.0,
        10.0,
    )  # verl's constants
    assert objective.entropy.coef == 0.0
    # The gmpo preset feeds GMPO the token log-ratio clamped at ±20 like every other preset,
    # verl's geo_mean does not clamp: they differ on tokens with |Δ| > 20 only.
    lp, old, advantages, mask = _policy_batch(
        rng,
        adv_rank=2 if name == "gspo_token" else 1,
        extreme=name != "gmpo",
        empty_rows=() if name == "gmpo" else (3,),
    )
    ref_lp = (lp + rng.normal(0.0, 0.5, lp.shape)).astype(np.float32)
    batch = RolloutBatch(
        completion_mask=mask, old_logprobs=old, advantages=advantages, ref_logprobs=ref_lp
    )

    def ours(x):
        out = objectives.policy_loss(objective, x, batch)
        return out.loss, out.metrics

    loss, grad, _ = _ours(ours, lp)

    clip_low = objective.surrogate.clip_low
    config = _actor_config(
        clip_ratio_low=1.0 if clip_low is None else clip_low,
        clip_ratio_high=objective.surrogate.clip_high,
        clip_ratio_c=objective.surrogate.dual_clip or 1e9,
        tau_pos=objective.surrogate.tau_pos,
        tau_neg=objective.surrogate.tau_neg,
        global_batch_info={"loss_scale_factor": objective.aggregation.norm_constant},
    )
    log_prob = _t(lp, grad=True)
    token_adv = (
        np.broadcast_to(advantages[:, None], lp.shape) if advantages.ndim == 1 else advantages
    )
    loss_fn = core_algos.get_policy_loss_fn(
        _VERL_LOSS[objective.surrogate.name, objective.ratio.kind]
    )
    theirs, _ = loss_fn(
        _t(old), log_prob, _t(token_adv), _t(mask), objective.aggregation.mode, config
    )
    if objective.kl.kind is not None and objective.kl.placement == "loss":
        kl_name = _VERL_KL[objective.kl.kind] + ("+" if objective.kl.straight_through else "")
        kld = core_algos.kl_penalty(log_prob, _t(ref_lp), kl_name)
        theirs = theirs + objective.kl.coef * core_algos.agg_loss(
            kld, _t(mask), objective.aggregation.mode, **config.global_batch_info
        )
    theirs.backward()
    _close(loss, theirs)
    _close(grad, log_prob.grad)


# ----------------------------------------------------------------------------- 2025-26 stabilisers


def _probability_batch(rng):
    """f32 ``(lp, old, token advantages, mask)`` with probabilities over (0, 1) and moves that
    cross DPPO's trust regions on both sides."""
    old = np.log(rng.uniform(0.02, 0.98, (B, T)))
    lp = np.log(np.clip(np.exp(old) + rng.normal(0.0, 0.25, (B, T)), 1e-3, 0.999))
    advantages = rng.normal(size=(B, T))
    advantages[1] = 0.0
    mask = _mask(rng, empty_rows=(3,))
    return tuple(x.astype(np.float32) for x in (lp, old, advantages)) + (mask,)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(("divergence", "delta", "cap"), [("tv", 0.15, 3.0), ("kl", 0.05, 1.5)])
def test_dppo_matches_verl(rng, divergence, delta, cap, mode):
    lp, old, advantages, mask = _probability_batch(rng)
    kw = {"divergence": divergence, "delta_low": delta, "delta_high": delta, "ratio_cap": cap}

    def ours(x):
        log_ratio = ratios.token_log_ratio(x, old)
        indicators = surrogates.dppo_metrics(log_ratio, x, old, advantages, **kw)
        metrics = {
            "actor/pg_clipfrac": _token_mean(indicators["clipped"], mask),
            "actor/pg_clipfrac_lower": _token_mean(indicators["clipped_lower"], mask),
            "actor/ppo_kl": _token_mean(-log_ratio, mask),
        }
        per_token = surrogates.dppo(log_ratio, x, old, advantages, **kw)
        return aggregation.aggregate(per_token, mask, mode), metrics

    loss, grad, metrics = _ours(ours, lp)
    config = _actor_config(clip_ratio_low=delta, clip_ratio_high=delta, clip_ratio_c=cap)
    theirs, theirs_grad, theirs_metrics = _verl_policy_loss(
        f"dppo_{divergence}", config, lp, old, advantages, mask, mode
    )
    _close(loss, theirs)
    _close(grad, theirs_grad)
    assert metrics.keys() == theirs_metrics.keys()
    for key, value_ in metrics.items():
        _close(value_, theirs_metrics[key], msg=key)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("fraction", "coef"), [(0.2, 0.5), (1e-4, 0.1)])
def test_kl_cov_matches_verl(rng, fraction, coef, mode):
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=2, extreme=False)

    def ours(x):
        per_token = surrogates.kl_cov(x - old, x, advantages, mask, fraction=fraction, coef=coef)
        return aggregation.aggregate(per_token, mask, mode), None

    loss, grad, _ = _ours(ours, lp)
    config = _actor_config(
        policy_loss=PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=fraction, ppo_kl_coef=coef)
    )
    theirs, theirs_grad, _ = _verl_policy_loss("kl_cov", config, lp, old, advantages, mask, mode)
    _close(loss, theirs)
    _close(grad, theirs_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clip_cov_matches_verl_when_every_candidate_is_drawn(rng, mode):
    """verl draws its tokens with torch's generator: with ``clip_cov_ratio = 1`` every
    candidate is taken on both sides, so the draw cannot differ."""
    lp, old, advantages, mask = _policy_batch(rng, adv_rank=2, extreme=False)
    centred_a = advantages - _token_mean(advantages, mask)
    centred_lp = lp - _token_mean(lp, mask)
    cov = np.asarray(centred_a * centred_lp)[mask > 0]
    low, high = (float(b) for b in np.quantile(cov, [0.3, 0.9]))
    kw = {"fraction": 1.0, "cov_low": low, "cov_high": high, "clip_low": 0.2, "clip_high": 0.28}

    def ours(x):
        per_token = surrogates.clip_cov(x - old, x, advantages, mask, key=jax.random.key(0), **kw)
        return aggregation.aggregate(per_token, mask, mode), None

    loss, grad, _ = _ours(ours, lp)
    config = _actor_config(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(
            loss_mode="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=low, clip_cov_ub=high
        ),
    )
    theirs, theirs_grad, _ = _verl_policy_loss("clip_cov", config, lp, old, advantages, mask, mode)
    _close(loss, theirs)
    _close(grad, theirs_grad)
    plain = jax.grad(
        lambda x: aggregation.aggregate(
            surrogates.ppo_clip(x - old, advantages, clip_high=0.28), mask, mode
        )
    )(jnp.asarray(lp))
    assert np.any((np.asarray(grad) == 0) & (np.asarray(plain) != 0))  # tokens were left out


@pytest.mark.parametrize("group_size", [2, 4])
def test_gdpo_matches_verl(rng, group_size):
    """verl's ``gdpo`` whitens the weighted sum over tokens: ours with ``batch_norm="token"``."""
    mask = _mask(rng)
    columns = np.stack(
        [_rewards(rng, "binary", group_size), 5.0 * _rewards(rng, "gaussian", group_size)], axis=1
    )
    weights = (1.0, 0.5)
    ours = adv.gdpo(columns, mask, group_size=group_size, weights=weights, batch_norm="token")
    prompt = 3
    attention = np.concatenate([np.ones((B, prompt)), mask], axis=1)
    theirs, _ = core_algos.compute_gdpo_outcome_advantage(
        _t(np.zeros((B, T))),
        _t(mask),
        _index(group_size),
        config={"gdpo_reward_keys": ["correct", "style"], "gdpo_reward_weights": list(weights)},
        non_tensor_batch={"correct": columns[:, 0], "style": columns[:, 1]},
        batch={
            "prompts": torch.zeros((B, prompt)),
            "attention_mask": torch.tensor(attention, dtype=torch.long),
        },
    )
    _close(ours, theirs)
