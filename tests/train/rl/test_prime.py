"""PRIME (issue 8): implicit process rewards, the PRM's cross-entropy update, a short run.

The process-reward math lives in ``jaxrl_llm.losses.implicit_prm``; the trainer's PRM loss function
and ``PRIMETrainer`` in ``jaxrl_llm.train.rl.prime``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models, objectives, parallel
from jaxrl_llm.losses.implicit_prm import implicit_sequence_reward, process_rewards
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.rl.prime import PRIMETrainer, make_prm_loss_fn
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import Totals, jit_step, make_step
from jaxrl_llm.types import RolloutBatch, sequences_of
from tests.train.rl import rl_helpers

CONFIG = models.ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=24,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def test_process_rewards_shape_sign_and_mask():
    # Row 0: the PRM likes token 0 more than the reference (+), token 1 less (-), token 2 is
    # padding. Row 1: identical to the reference, so no reward anywhere.
    prm = np.array([[-0.5, -2.0, -9.0], [-1.0, -1.0, -1.0]], np.float32)
    ref = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    dense = np.asarray(process_rewards(prm, ref, mask, beta=0.1))
    assert dense.shape == (2, 3) and dense.dtype == np.float32
    np.testing.assert_allclose(dense[0], [0.05, -0.1, 0.0], atol=1e-7)
    assert np.all(dense[1] == 0.0)
    seq = np.asarray(implicit_sequence_reward(prm, ref, mask, beta=0.1))
    np.testing.assert_allclose(seq, dense.sum(axis=1), atol=1e-7)


def test_prime_advantages_from_constructed_dense_rewards():
    """RLOO over process rewards + RLOO over outcomes: the better row of a group gains."""
    objective = objectives.make("prime")
    mask = np.ones((2, 2), bool)
    rewards = np.array([1.0, 0.0], np.float32)  # one group of 2: row 0 correct
    prm = np.array([[-0.5, -0.5], [-1.5, -1.5]], np.float32)
    ref = np.full((2, 2), -1.0, np.float32)
    dense = process_rewards(prm, ref, mask, beta=1.0)
    _, returns = objectives.compute_advantages(
        objective, rewards, mask, group_size=2, process_rewards=dense
    )
    returns = np.asarray(returns, np.float64)
    # Float64 reference: leave-one-out baselines of per-row mean process reward (0.5, -0.5)
    # and of outcomes (1, 0); returns are reverse cumulative sums.
    d = np.array([[0.5, 0.5], [-0.5, -0.5]])
    loo_d = d * 2 - d.mean(axis=1).sum() * np.ones((2, 1))  # G/(G-1)·r - sum/(G-1) with G=2
    outcome = np.zeros((2, 2))
    outcome[:, -1] = [1.0 - 0.0, 0.0 - 1.0]
    want = np.flip(np.cumsum(np.flip(loo_d + outcome, 1), 1), 1)
    np.testing.assert_allclose(returns, want, atol=1e-6)
    assert returns[0, 0] > 0 > returns[1, 0]


def _batch(rows=8, prompt=4, length=5, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.arange(length)[None] < rng.integers(1, length + 1, (rows, 1))
    return RolloutBatch(
        completion_mask=mask,
        old_logprobs=np.zeros((rows, length), np.float32),
        advantages=np.zeros(rows, np.float32),
        prompt_tokens=rng.integers(0, CONFIG.vocab_size, (rows, prompt)).astype(np.int32),
        prompt_mask=np.ones((rows, prompt), bool),
        completion_tokens=rng.integers(0, CONFIG.vocab_size, (rows, length)).astype(np.int32),
        rewards=(np.arange(rows) % 2).astype(np.float32),
    )


def test_prm_loss_is_bce_of_the_implicit_logit_and_learns_the_labels():
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    ref_params = models.init_params(CONFIG, jax.random.key(0))
    batch = _batch()
    seqs = sequences_of(batch)
    ref = np.asarray(make_logprob_fn(CONFIG)(ref_params, seqs))
    batch = batch._replace(ref_logprobs=ref)
    beta = 0.5
    loss_fn = make_prm_loss_fn(CONFIG, beta=beta)
    # A PRM that moved away from the reference: float64 BCE reference.
    moved = jax.tree.map(lambda x: x * 1.1, ref_params)
    lp = np.asarray(make_logprob_fn(CONFIG)(moved, seqs), np.float64)
    logit = beta * ((lp - ref) * batch.completion_mask).sum(axis=1)
    labels = batch.rewards.astype(np.float64)
    want = np.mean(np.logaddexp(0.0, logit) - labels * logit)
    totals = Totals(jnp.float32(batch.completion_mask.sum()), jnp.float32(len(labels)))
    loss, metrics = loss_fn(moved, batch, totals)
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(metrics["prm/accuracy"]) == pytest.approx(np.mean((logit > 0) == (labels > 0.5)))

    optimizer = make_optimizer(3e-3)
    state, shardings = create_train_state(
        CONFIG, optimizer, key=jax.random.key(1), mesh=mesh, params=ref_params
    )
    step = jit_step(make_step(loss_fn, optimizer, param_shardings=shardings.params), shardings)
    first = None
    for _ in range(40):
        state, metrics = step(state, batch)
        first = float(metrics["prm/loss"]) if first is None else first
    assert float(metrics["prm/loss"]) < 0.5 * first
    assert float(metrics["prm/accuracy"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("update", ["after"])
def test_prime_run_completes_with_prm_metrics(tmp_path, update):
    # ("before", the default, runs in tests/train/rl/test_recipes.py.)
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "prime.yaml",
        tmp_path / "prime",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=2",
        f"prime.update={update}",
    )
    trainer = PRIMETrainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path / "prime")
    assert len(rows) == 2
    for row in rows:
        for key in ("prm/loss", "prm/accuracy", "prm/process_reward_mean"):
            assert math.isfinite(row[key]), (key, row)
    # The PRM is its own network: trained, so no longer equal to the policy.
    differs = jax.tree.map(
        lambda a, b: bool(jnp.any(a != b)), trainer.prm_state.params, trainer.policy_params
    )
    assert any(jax.tree.leaves(differs))


def test_prime_config_errors(tmp_path):
    base = (rl_helpers.CONFIGS / "prime.yaml", tmp_path / "p")
    with pytest.raises(ValueError, match="prime.update"):
        PRIMETrainer(rl_helpers.tiny_config(*base, "prime.update=sometimes"))
    with pytest.raises(ValueError, match="group_size"):
        PRIMETrainer(rl_helpers.tiny_config(*base, "rollout.group_size=1"))


class RecordingPRIME(PRIMETrainer):
    """PRIME recording the shapes of the PRM's packing plans (None: padded)."""

    def prm_packing_plans(self, samples, seqs, forwards):
        plans = super().prm_packing_plans(samples, seqs, forwards)
        shapes = tuple(None if p is None else p.source.shape for p in plans)
        # The PRM's forward reuses the frozen forwards' plan (no second host planning).
        assert plans[0] is None or plans[0] is forwards.plan
        self.__dict__.setdefault("prm_plans", []).append(shapes)
        return plans


def _prime_run(path, packing):
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "prime.yaml",
        path,
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=2",
        "trainer.micro_batches=2",
        "trainer.micro_batch_tokens=null",
        "model.compute_dtype=float32",
        "checkpoint.every_steps=1000",
        f"trainer.packing={packing}",
    )
    trainer = RecordingPRIME(cfg)
    trainer.fit()
    return trainer, read_metrics(path), jax.device_get(trainer.prm_state.params)


@pytest.mark.slow
def test_packed_prime_trains_the_prm_the_padded_run_trains(tmp_path):
    """trainer.packing=on: the PRM's log-prob forward and its (two-micro-batch) update run
    over packed rows; its loss, accuracy, dense rewards and weights after two steps are the
    padded run's (f32)."""
    padded, padded_rows, padded_prm = _prime_run(tmp_path / "padded", "off")
    packed, packed_rows, packed_prm = _prime_run(tmp_path / "packed", "on")
    assert padded.prm_plans == [(None, None)] * 2
    assert len(packed.prm_plans) == 2
    for forward, update in packed.prm_plans:
        assert forward is not None and forward[0] == 1  # one forward micro-batch
        assert update is not None and update[0] == 2  # the update's two micro-batches
    keys = ("prm/loss", "prm/process_reward_mean", "loss", "grad_norm")
    for want, got in zip(padded_rows, packed_rows, strict=True):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # The first update's PRM is the reference: every implicit logit is 0 up to rounding, so its
    # accuracy (the logit's sign) is a coin toss; the second's is not.
    assert packed_rows[1]["prm/accuracy"] == padded_rows[1]["prm/accuracy"]
    for want, got in zip(jax.tree.leaves(padded_prm), jax.tree.leaves(packed_prm), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
