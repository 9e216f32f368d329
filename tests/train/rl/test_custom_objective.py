"""A surrogate registered from user code trains end to end, with no library edit.

The user's surrogate is a clipped REINFORCE, ``ℓ_t = −clip(r_t, 1−ε, 1+ε)·A·lp_t`` with the
clipped ratio detached (CISPO-like but with a symmetric band and a user hyper-parameter ``ε``
the surrogate declares at registration, ``params=ClipParams``). The test checks (1) the
registered function is what the jitted step calls — its own metric is in every row and its
value equals a float64 NumPy evaluation of the formula on the step's inputs — and (2) the run
trains: the policy moves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.run import trainer_for

NAME = "user_clipped_reinforce"


@dataclasses.dataclass(frozen=True)
class ClipParams:
    eps: float = 0.2


def clipped_reinforce(surrogate, inputs):
    eps = surrogate.params.eps
    ratio = jnp.exp(inputs.log_ratio)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps, 1.0 + eps))
    per_token = -weight * inputs.advantages[:, None] * inputs.logprobs
    clipped = (jnp.abs(ratio - 1.0) > eps).astype(jnp.float32)
    return per_token, {"user/clip_frac": inputs.token_mean(clipped)}


@pytest.fixture
def registered():
    objectives.register_surrogate(NAME, clipped_reinforce, params=ClipParams)
    yield
    objectives.unregister_surrogate(NAME)


def test_user_surrogate_in_policy_loss_matches_numpy(registered):
    rng = np.random.default_rng(0)
    B, T = 4, 5
    logprobs = -rng.uniform(0.1, 3.0, (B, T))
    old = logprobs + rng.normal(0, 0.3, (B, T))
    adv = rng.normal(size=B)
    mask = np.ones((B, T))
    mask[1, 3:] = 0
    objective = objectives.make(
        "grpo",
        surrogate=NAME,
        kl_coef=0.0,
        surrogate_params={"eps": 0.2},
        aggregation="token-mean",
    )
    from jaxrl_llm.types import RolloutBatch  # noqa: PLC0415

    batch = RolloutBatch(
        completion_mask=jnp.asarray(mask, bool),
        old_logprobs=jnp.asarray(old, jnp.float32),
        advantages=jnp.asarray(adv, jnp.float32),
    )
    out = objectives.policy_loss(objective, jnp.asarray(logprobs, jnp.float32), batch)
    ratio = np.exp(np.clip(logprobs - old, -20, 20))
    want = np.sum(-np.clip(ratio, 0.8, 1.2) * adv[:, None] * logprobs * mask) / mask.sum()
    np.testing.assert_allclose(float(out.loss), want, rtol=1e-5)
    clip_frac = np.sum((np.abs(ratio - 1) > 0.2) * mask) / mask.sum()
    np.testing.assert_allclose(float(out.metrics["user/clip_frac"]), clip_frac, rtol=1e-5)


@pytest.mark.slow
def test_user_surrogate_trains_end_to_end(registered, tmp_path):
    cfg = load_config(
        TrainConfig,
        None,
        [
            "sft_warmup.steps=0",
            "data.eval_size=8",
            "data.num_train=100",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "trainer.max_steps=3",
            "trainer.epochs=2",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.plots=false",
            "mesh.fsdp=1",
            f"run_dir={tmp_path / 'run'}",
            f"objective.overrides={{surrogate: {NAME}, surrogate_params: {{eps: 0.1}}}}",
            "rewards=[{name: math_match}, {name: overlong, kwargs: {max_tokens: 6, "
            "buffer_tokens: 4}}]",
        ],
    )
    trainer = trainer_for(cfg)
    assert trainer.run.objective.surrogate.name == NAME
    trainer.setup()
    before = jax.tree.map(np.asarray, trainer.state.params)
    trainer.latest = None
    # fit() sets up again from scratch: use a fresh trainer for the run itself.
    trainer = trainer_for(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 3
    assert all("user/clip_frac" in row for row in rows)
    # Epoch 2 of each step sees a moved policy: some ratios leave the 0.1 band.
    assert max(row["user/clip_frac"] for row in rows) > 0.0
    from jaxrl_llm.train.checkpoint import Checkpointer  # noqa: PLC0415

    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False)
    state, _ = checkpointer.restore_raw(3)
    checkpointer.close()
    moved = [
        not np.allclose(np.asarray(state["params"][k]), before[k]) for k in ("embed", "lm_head")
    ]
    assert any(moved)


@pytest.mark.parametrize(
    ("requires", "trainer"),
    [((), "RLTrainer"), (("values",), "PPOTrainer"), (("process_rewards",), "PRIMETrainer")],
)
def test_the_trainer_follows_what_a_user_estimator_requires(requires, trainer):
    """A user's estimator that needs critic values runs with PPO's critic, whatever its name."""
    from jaxrl_llm.train.rl.run import trainer_class  # noqa: PLC0415

    def estimator(objective, inputs):
        return inputs.rewards, None

    objectives.register_estimator("user_estimator", estimator, requires=requires)
    try:
        objective = objectives.make("grpo", advantage="user_estimator")
        assert trainer_class(objective).__name__ == trainer
    finally:
        objectives.unregister_estimator("user_estimator")


def test_an_estimator_no_trainer_supplies_is_refused_by_name(tmp_path):
    objectives.register_estimator(
        "user_remax", lambda objective, inputs: (inputs.rewards, None), requires="baseline_rewards"
    )
    try:
        cfg = load_config(
            TrainConfig,
            None,
            [f"run_dir={tmp_path}", "objective.overrides={advantage: user_remax}"],
        )
        with pytest.raises(ValueError, match=r"no trainer supplies .*'baseline_rewards'"):
            trainer_for(cfg)
    finally:
        objectives.unregister_estimator("user_remax")


def digit_share(prompt, completion, example) -> float:
    """A reward that differs between an untrained policy's samples: the share of digits."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def test_gdpo_normalises_each_reward_function_of_the_run(tmp_path, monkeypatch):
    """``advantage: gdpo`` through the trainer: the step's advantages are TRL's
    normalise-then-sum (a float64 transcription) of the run's two reward functions' own scores
    (``rewards`` terms, before their weights), with the objective's ``reward_weights``."""
    from jaxrl_llm import parallel  # noqa: PLC0415
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415
    from tests.reference import stabilisers  # noqa: PLC0415
    from tests.train.rl import rl_helpers  # noqa: PLC0415

    captured = {}
    score = RLTrainer.score

    def spy(self, step, samples, seqs, forwards, rewards):
        batch, metrics = score(self, step, samples, seqs, forwards, rewards)
        captured.update(
            components=dict(samples.components),
            advantages=np.asarray(parallel.fetch(batch.advantages)),
        )
        return batch, metrics

    monkeypatch.setattr(RLTrainer, "score", spy)
    cfg = rl_helpers.tiny_config(
        None,
        tmp_path,
        "rewards=[{name: overlong, kwargs: {max_tokens: 6, buffer_tokens: 4}}, "
        "{name: 'tests.train.rl.test_custom_objective:digit_share'}]",
        "trainer.max_steps=1",
        "objective.overrides={advantage: gdpo, reward_weights: [1.0, 0.5]}",
    )
    trainer_for(cfg).fit()
    names = list(captured["components"])
    assert len(names) == 2 and names[0] == "overlong"
    columns = np.stack([captured["components"][k] for k in names], axis=1)
    assert (columns.std(axis=0) > 0).all()  # both rewards differ between rows: weights matter
    # TRL's formula at the library's eps (1e-6, as its other group estimators).
    want = stabilisers.gdpo_trl(columns, cfg.rollout.group_size, [1.0, 0.5], eps=1e-6)
    got = captured["advantages"]  # [B]: one advantage a sequence
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(got).max() > 0


def test_a_top_entropy_objective_gets_the_entropy_it_selects_by():
    """``top_entropy_quantile`` needs the per-token entropy even without an entropy bonus and
    with the entropy metric off (``compute_entropy=False``): the policy loss computes it
    (``Objective.needs_entropy``) and trains on the selected share of tokens."""
    from jaxrl_llm.models import init_params  # noqa: PLC0415
    from jaxrl_llm.train.rl.policy import make_policy_loss_fn  # noqa: PLC0415
    from tests.train import step_problem  # noqa: PLC0415

    objective = objectives.make("grpo", top_entropy_quantile=0.25)
    assert objective.entropy.coef == 0 and objective.needs_entropy
    loss_fn = make_policy_loss_fn(step_problem.CONFIG, objective, compute_entropy=False)
    params = init_params(step_problem.CONFIG, jax.random.key(0))
    batch = jax.tree.map(jnp.asarray, step_problem.host_batch(0))
    loss, metrics = jax.jit(loss_fn)(params, batch, None)
    assert np.isfinite(float(loss))
    assert 0.0 < float(metrics["top_entropy_frac"]) <= 0.5
