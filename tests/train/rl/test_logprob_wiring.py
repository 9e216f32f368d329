"""The RL trainer's log-prob wiring: rollout temperature and K > 1 update epochs (issue 17).

Contract (``RolloutSection``: "the trainer recomputes log-probs at the same temperature"):
the behaviour (``old_logprobs``) and reference log-probs, and the policy step's recomputed
log-probs, are ``log_softmax(logits / T)`` of the sampled tokens -- the temperature-scaled,
*untruncated* distribution, as in verl and TRL; top-p / top-k / min-p only restrict which tokens
the sampler draws. The behaviour log-probs are computed once per rollout, before any update,
and every minibatch of every epoch carries those same values (PPO's fixed π_old).

Each test drives one RL step of a tiny GRPO run (``setup`` + ``train_step``, no evaluation or
export) and records every batch the jitted policy step (``update_fn``) receives, with the
policy parameters it is applied to. The expected log-probs are float64 NumPy
(``tests.reference``) from the logits of the library's model forward at the recorded parameters.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl.config import check_config
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.reference import logprobs as ref_logprobs
from tests.reference import sampling as ref_sampling
from tests.train.rl import rl_helpers

GRPO = rl_helpers.CONFIGS / "grpo.yaml"
# f32 chunked log-softmax on device vs float64 NumPy on the same f32 logits.
ATOL = 2e-5
# The policy step recomputes the behaviour log-probs in another program (with entropy and
# gradients): its ratio is 1 up to f32 rounding when the policy has not moved.
RATIO_ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@dataclasses.dataclass
class Call:
    """One call of the jitted policy step: its input batch, the parameters it started from
    and the metrics it returned, all on the host."""

    params: Any
    batch: Any
    metrics: dict[str, float]


def _one_step(cfg) -> tuple[RLTrainer, list[Call]]:
    """Runs the first RL step of ``cfg``, recording every policy-step call."""
    trainer = RLTrainer(cfg)
    calls: list[Call] = []
    try:
        trainer.setup()
        step_fn = trainer.update_fn

        def recording_step(state, batch):
            params, host_batch = jax.device_get((state.params, batch))  # before donation
            new_state, metrics = step_fn(state, batch)
            metrics_host = {k: float(v) for k, v in jax.device_get(metrics).items()}
            calls.append(Call(params, host_batch, metrics_host))
            return new_state, metrics

        trainer.update_fn = recording_step
        trainer.train_step(0, PhaseTimer())
    finally:
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
    return trainer, calls


def _full_logits(params, model_config, batch) -> np.ndarray:
    """``[B, P + T, V]`` float64 logits of ``[prompt ; completion]`` (the library's forward)."""
    tokens = np.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1).astype(bool)
    logits = jax.jit(models.logits, static_argnums=1)(
        params, model_config, tokens, attention_mask=mask
    )
    return np.asarray(logits, np.float64)


def _expected_logprobs(logits, batch, temperature: float) -> np.ndarray:
    """``log_softmax(logits / T)`` of the completion tokens, 0 where masked (float64)."""
    out, _ = ref_logprobs.completion_logprobs(
        logits,
        batch.prompt_tokens.shape[1],
        batch.completion_tokens,
        batch.completion_mask.astype(bool),
        temperature=temperature,
    )
    return out


def _truncated_logprobs(logits, batch, **sampling) -> np.ndarray:
    """Log-probs of the completion tokens under the sampler's truncated, renormalised
    distribution (``-inf`` outside its support), 0 where masked."""
    prompt_len = batch.prompt_tokens.shape[1]
    mask = batch.completion_mask.astype(bool)
    out = np.zeros(mask.shape)
    for b, t in zip(*np.nonzero(mask)):
        probs = ref_sampling.truncated_probs(logits[b, prompt_len - 1 + t], **sampling)
        with np.errstate(divide="ignore"):
            out[b, t] = np.log(probs[batch.completion_tokens[b, t]])
    return out


def _row_key(batch, row: int) -> tuple:
    """A row's identity: its real prompt tokens and its real completion tokens."""
    prompt = batch.prompt_tokens[row][batch.prompt_mask[row].astype(bool)]
    completion = batch.completion_tokens[row][batch.completion_mask[row].astype(bool)]
    return tuple(prompt.tolist()), tuple(completion.tolist())


def _rows(batch) -> int:
    return batch.completion_tokens.shape[0]


@pytest.mark.parametrize(
    ("sampling", "minibatches"),
    [
        pytest.param({"temperature": 0.7}, 2, id="T0.7"),
        pytest.param({"temperature": 0.7, "top_p": 0.8, "top_k": 5}, 2, id="T0.7-top_p0.8-top_k5"),
        pytest.param({"temperature": 0.7}, 1, id="T0.7-on-policy"),
    ],
)
def test_logprobs_use_the_rollout_temperature(tmp_path, sampling, minibatches):
    """``old_logprobs`` and ``ref_logprobs`` are ``log_softmax(logits / T)`` of the sampled
    tokens at the rollout-time parameters -- not T = 1, and not the top-p / top-k truncated
    distribution the tokens were drawn from -- and the policy step recomputes them at the same
    temperature: the first minibatch, no update yet, so its ratio is exactly 1.

    With one minibatch and one epoch the update is on-policy: the trainer skips the behaviour
    forward (``old_logprobs`` is None) and the step's own log-probs, at the same temperature,
    meet the reference's with a KL of 0."""
    cfg = rl_helpers.tiny_config(
        GRPO,
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        f"trainer.minibatches={minibatches}",
        *(f"rollout.{k}={v}" for k, v in sampling.items()),
    )
    assert cfg.trainer.epochs == 1 and check_config(cfg).kl.placement == "loss"
    temperature = sampling["temperature"]
    trainer, calls = _one_step(cfg)
    assert trainer.on_policy == (minibatches == 1)
    assert len(calls) == minibatches
    call = calls[0]
    batch = call.batch
    mask = batch.completion_mask.astype(bool)
    assert _rows(batch) == cfg.rollout.prompts_per_step * cfg.rollout.group_size // minibatches
    assert mask.sum() > 0

    # The first policy step sees the rollout-time policy (the parameters the rollout sampled
    # and scored with), and the frozen reference is that same initial policy.
    logits = _full_logits(call.params, trainer.run.model_config, batch)
    want = _expected_logprobs(logits, batch, temperature)
    np.testing.assert_allclose(batch.ref_logprobs, want, rtol=0, atol=ATOL)
    if minibatches == 1:
        assert batch.old_logprobs is None
        # The step's own log-probs at T meet the reference's: no KL. (At T = 1 the k3 KL to
        # these reference log-probs is far from 0: see the check below.)
        assert call.metrics["kl"] == pytest.approx(0.0, abs=RATIO_ATOL)
    else:
        np.testing.assert_allclose(batch.old_logprobs, want, rtol=0, atol=ATOL)
        assert not np.any(batch.old_logprobs[~mask])
    # Temperature 1 would be a different distribution (so the check above has teeth).
    at_one = _expected_logprobs(logits, batch, 1.0)
    assert np.abs(at_one - want)[mask].max() > 100 * ATOL

    if "top_k" in sampling or "top_p" in sampling:
        truncated = _truncated_logprobs(logits, batch, **sampling)
        # Every sampled token lies in the truncated support (the sampler did truncate) ...
        assert np.isfinite(truncated[mask]).all()
        # ... and the trainer scores it under the untruncated distribution, which puts less
        # mass on it (truncation renormalises).
        assert (truncated[mask] >= want[mask] - 1e-9).all()
        assert np.abs(truncated - want)[mask].max() > 100 * ATOL

    # The policy step: the same temperature, so the ratio π_θ / π_old is 1 on every token.
    metrics = call.metrics
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=RATIO_ATOL)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=RATIO_ATOL)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=RATIO_ATOL)
    assert metrics["grad_norm"] > 0.0


def test_old_logprobs_stay_fixed_across_epochs(tmp_path):
    """``trainer.epochs=2``, two minibatches: every minibatch of both epochs carries the
    behaviour log-probs of the rollout-time policy, although the policy moves between updates
    (so from the second update on the step's ratio differs from 1)."""
    cfg = rl_helpers.tiny_config(
        GRPO,
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        "trainer.epochs=2",
        "trainer.minibatches=2",
    )
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    trainer, calls = _one_step(cfg)
    assert len(calls) == 4  # 2 epochs x 2 minibatches
    rollout_params = calls[0].params
    model_config = trainer.run.model_config

    # Each epoch visits every sampled row once; both epochs see the same rows.
    epochs = [calls[:2], calls[2:]]
    keys = [
        sorted(_row_key(c.batch, r) for c in epoch for r in range(_rows(c.batch)))
        for epoch in epochs
    ]
    assert len(keys[0]) == rows
    assert keys[0] == keys[1]

    # Every minibatch: old log-probs (and advantages) of the rollout-time policy.
    first_epoch: dict[tuple, list] = defaultdict(list)
    for i, call in enumerate(calls):
        batch = call.batch
        assert _rows(batch) == rows // 2
        logits = _full_logits(rollout_params, model_config, batch)
        want = _expected_logprobs(logits, batch, cfg.rollout.temperature)
        np.testing.assert_allclose(batch.old_logprobs, want, rtol=0, atol=ATOL, err_msg=f"{i}")
        for r in range(_rows(batch)):
            value = (batch.old_logprobs[r], batch.advantages[r])
            if i < 2:
                first_epoch[_row_key(batch, r)].append(value)
            else:  # the same row in epoch 1 carried exactly these values
                assert any(
                    np.array_equal(value[0], old) and np.array_equal(value[1], adv)
                    for old, adv in first_epoch[_row_key(batch, r)]
                ), (i, r)

    # The policy moved before every later update ...
    for i in (1, 2, 3):
        moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), rollout_params, calls[i].params)
        assert any(jax.tree.leaves(moved)), i

    # ... and the steps' log-probs are those of their own parameters: a ratio of 1 before any
    # update, away from 1 after it -- in epoch 2 above all (the behaviour log-probs did not
    # follow the policy, neither per minibatch nor per epoch).
    first = calls[0].metrics
    assert first["ratio_max"] == pytest.approx(1.0, abs=RATIO_ATOL)
    assert first["ratio_min"] == pytest.approx(1.0, abs=RATIO_ATOL)
    for i, call in enumerate(calls[1:], start=1):
        m = call.metrics
        assert max(m["ratio_max"] - 1.0, 1.0 - m["ratio_min"]) > 1e-3, (i, m)
        assert abs(m["approx_kl"]) > 1e-5, (i, m)


@pytest.mark.parametrize(
    ("overrides", "on_policy"),
    [
        pytest.param((), True, id="one-update"),
        pytest.param(("trainer.epochs=2",), False, id="epochs2"),
        pytest.param(("trainer.minibatches=2",), False, id="minibatches2"),
        # KL in the reward needs kl(old, ref) before the advantages exist.
        pytest.param(
            ("objective.overrides={kl_placement: reward, kl_kind: k1, kl_coef: 0.1}",),
            False,
            id="kl-in-reward",
        ),
        pytest.param(("objective.overrides={kl_coef: 0.0}",), True, id="no-kl"),
        # The sampler's log-probs are the behaviour log-probs: the update does not take its own.
        pytest.param(("rollout.logprobs=sampler",), False, id="sampler-logprobs"),
    ],
)
def test_on_policy_rule(tmp_path, overrides, on_policy):
    """The update takes its own forward's log-probs (no behaviour forward, none in its batch)
    exactly when it cannot have moved the policy since the rollout, the advantages do not need
    the behaviour log-probs and the sampler's are not used: the rule the trainer's programs
    follow (``train.rl.programs.takes_own_logprobs``)."""
    from jaxrl_llm.train.rl import programs, spec

    cfg = rl_helpers.tiny_config(GRPO, tmp_path, *overrides)
    assert programs.takes_own_logprobs(spec.resolve(cfg)) is on_policy


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_sampler_logprobs_equal_the_trainers_and_are_reported(tmp_path, engine):
    """The sampler's own log-probs ride along to the step (``rollout_logprobs``): in f32 they
    equal the trainer's (float64 reference from the rollout-time logits) to 1e-5, and the
    step reports the gap (``rollout/*``), near 0 here."""
    cfg = rl_helpers.tiny_config(
        GRPO,
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        "rollout.temperature=0.7",
        f"rollout.engine={engine}",
        "rollout.slots=5",
    )
    trainer, (call,) = _one_step(cfg)
    batch = call.batch
    mask = batch.completion_mask.astype(bool)
    want = _expected_logprobs(
        _full_logits(call.params, trainer.run.model_config, batch), batch, 0.7
    )
    np.testing.assert_allclose(batch.rollout_logprobs[mask], want[mask], rtol=0, atol=1e-5)
    assert not np.any(batch.rollout_logprobs[~mask])
    assert (
        0.0 <= call.metrics["rollout/logprob_diff_mean"] <= call.metrics["rollout/logprob_diff_max"]
    )
    assert call.metrics["rollout/logprob_diff_max"] < 1e-5
    assert abs(call.metrics["rollout/k3"]) < 1e-9


def test_sampler_mode_uses_the_samplers_logprobs_without_a_forward(tmp_path):
    """``rollout.logprobs=sampler``: the update's behaviour log-probs are the sampler's (no
    recompute forward, even with two minibatches), the same values in every minibatch."""
    cfg = rl_helpers.tiny_config(
        GRPO,
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=1",
        "trainer.minibatches=2",
        "rollout.logprobs=sampler",
    )
    trainer = RLTrainer(cfg)
    forwards = []
    try:
        trainer.setup()
        logprob_fn, step_fn = trainer.logprob_fn, trainer.update_fn
        trainer.logprob_fn = lambda params, seqs, *packing: (
            forwards.append(params) or logprob_fn(params, seqs, *packing)
        )
        batches = []

        def recording_step(state, batch):
            batches.append(jax.device_get(batch))
            return step_fn(state, batch)

        trainer.update_fn = recording_step
        trainer.train_step(0, PhaseTimer())
    finally:
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
    assert not trainer.on_policy and trainer.sampler_logprobs
    assert all(p is trainer.reference for p in forwards)  # only the reference's forward
    assert len(batches) == 2
    for batch in batches:
        np.testing.assert_array_equal(batch.old_logprobs, batch.rollout_logprobs)
