"""Deferred scoring: the scoring workers run while the step's log-prob forwards are dispatched.

Without dynamic sampling nothing needs the rewards before the old-policy and reference
forwards, so the trainer sends the rows to the scoring workers, dispatches both forwards, and
only then waits for the scores. A stand-in pool whose future is scored only when waited on
records the order of events; the rewards that reach the advantages are checked against the
reward function run here, row by row, on the decoded completions.
"""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest

from jaxrl_llm.rewards import compute_rewards
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl import rollout as rollout_lib
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers


class LazyPool:
    """A ``rewards.ScoringPool`` stand-in: ``submit_score`` returns a pending future that is
    scored (and ``"scored"`` logged) only when someone waits on it."""

    def __init__(self, reward_fn, events: list[str]):
        self.reward_fn, self.events = reward_fn, events

    def submit_score(self, inputs):
        pool = self

        class Lazy(concurrent.futures.Future):
            def result(self, timeout=None):
                if not self.done():
                    pool.events.append("scored")
                    self.set_result(compute_rewards(pool.reward_fn, inputs))
                return super().result(timeout)

        return Lazy()

    def score(self, inputs):
        self.events.append("scored")
        return compute_rewards(self.reward_fn, inputs)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = rl_helpers.tiny_config(
        None,
        tmp_path_factory.mktemp("overlap"),
        rl_helpers.SHAPED_REWARDS,
        "trainer.epochs=2",  # off-policy: the old log-probs are recomputed
        "objective.overrides={kl_coef: 0.05}",  # and the reference's
    )
    trainer = RLTrainer(cfg)
    trainer.setup()
    assert trainer.reference is not None and not trainer.on_policy
    assert not trainer.run.objective.advantage.dynamic_sampling
    yield trainer
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


def test_scores_are_waited_for_after_the_forwards_are_dispatched(trainer, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(trainer.run, "scorer", LazyPool(trainer.run.reward_fn, events))
    for name in ("logprob_fn", "ref_logprob_fn"):  # the old policy's and the reference's
        forward = getattr(trainer, name)

        def logged_forward(params, seqs, *packing, forward=forward):
            events.append("forward")
            return forward(params, seqs, *packing)

        monkeypatch.setattr(trainer, name, logged_forward)
    seen = {}
    score = trainer.score

    def logged_score(step, samples, seqs, forwards, rewards):
        seen["samples"], seen["rewards"] = samples, np.asarray(jax.device_get(rewards))
        return score(step, samples, seqs, forwards, rewards)

    monkeypatch.setattr(trainer, "score", logged_score)
    timer = PhaseTimer()
    metrics = trainer.train_step(0, timer)

    assert events == ["forward", "forward", "scored"]  # old, reference, then the wait
    samples = seen["samples"]
    assert samples.scoring is None
    # The rewards are the reward function's on each decoded completion (scored here).
    group = trainer.cfg.rollout.group_size
    examples = [ex for ex in samples_examples(trainer, samples) for _ in range(group)]
    expected = [
        trainer.run.reward_fn(
            rollout_lib.RewardInput(prompt=p, completion=c, example=ex, completion_tokens=int(n))
        )
        for p, c, ex, n in zip(
            samples.prompts, samples.completions, examples, samples.completion_mask.sum(1)
        )
    ]
    np.testing.assert_allclose(seen["rewards"], expected, rtol=1e-6)
    np.testing.assert_allclose(samples.rewards, expected, rtol=1e-6)
    assert metrics["reward_mean"] == pytest.approx(np.mean(expected), rel=1e-6)
    grouped = np.asarray(expected).reshape(-1, group)
    constant = np.ptp(grouped, axis=1) == 0
    assert metrics["zero_variance_frac"] == pytest.approx(constant.mean())
    assert {"scoring", "logprobs"} <= set(timer.seconds)


def samples_examples(trainer, samples) -> list:
    """The examples of the step's groups, found by their prompt text."""
    by_prompt = {trainer.run.prompts([ex])[0]: ex for ex in trainer.run.train_examples}
    group = trainer.cfg.rollout.group_size
    return [by_prompt[p] for p in samples.prompts[::group]]


def test_a_draw_sampled_for_evaluation_is_scored_at_once(trainer, monkeypatch):
    """Evaluation and ``sample`` without ``defer`` never hand back pending rows."""
    events: list[str] = []
    monkeypatch.setattr(trainer.run, "scorer", LazyPool(trainer.run.reward_fn, events))
    samples = trainer.run.sample(
        trainer.sampler_params(),
        trainer.run.eval_examples[:4],
        jax.random.key(0),
        temperature=0.0,
        group_size=1,
    )
    assert samples.scoring is None and samples.rewards.shape == (4,)
    assert events == ["scored"]
