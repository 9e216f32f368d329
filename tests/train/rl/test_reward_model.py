"""``job: reward_model``: a Bradley-Terry reward model learns the synthetic preferences, is
saved as a Hugging Face sequence classifier (``run_dir/hf``) and reloads to identical scores;
then it is the RL trainer's learned reward (``reward_model.path``)."""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxrl_llm import data, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.train import setup
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.preference.run import run
from jaxrl_llm.train.preference.trainer import PreferenceTrainer
from jaxrl_llm.train.rl import rollout as rollout_lib
from jaxrl_llm.train.rl.context import RunContext, reward_model_plan, reward_model_program
from jaxrl_llm.train.rl.trainer import RLTrainer
from jaxrl_llm.train.setup import build_policy
from tests.train.rl import critic_problem, rl_helpers

# 32 training pairs in one batch (every step sees them all), one device, no SFT warm-up.
TINY = (
    "sft_warmup.steps=0",
    "data.num_train=32",
    "data.eval_size=16",
    "trainer.batch_size=32",
    "trainer.learning_rate=3e-3",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm") / "run"
    cfg = load_config(
        PreferenceConfig,
        rl_helpers.CONFIGS / "reward_model.yaml",
        [*TINY, f"run_dir={run_dir}", "trainer.max_steps=40", "checkpoint.every_steps=40"],
    )
    return cfg, run(cfg)


def _training_pairs(cfg, tokenizer):
    pairs = data.arithmetic_preference_pairs(
        cfg.data.num_train + cfg.data.eval_size, seed=cfg.seed
    )[cfg.data.eval_size :]
    arrays, _ = data.encode_pairs(
        tokenizer,
        [p.prompt for p in pairs],
        [p.chosen for p in pairs],
        [p.rejected for p in pairs],
        max_prompt_tokens=16,
        max_completion_tokens=16,
    )
    return arrays


@pytest.mark.slow
def test_reward_model_fits_the_pairs_and_reloads_identically(trained):
    cfg, summary = trained
    assert summary["job"] == "reward_model" and summary["loss"] == "bradley_terry"
    rows = read_metrics(cfg.run_dir)
    assert rows[0]["loss"] > 0.5 and rows[-1]["loss"] < 0.2
    assert rows[-1]["rewards/accuracies"] >= 0.9
    for key in ("loss", "rewards/accuracies", "rewards/margins"):
        assert key in summary["eval_before"] and key in summary["eval_after"]

    # The saved model scores the training pairs as the final state does, and ranks them. Like
    # every job, the reward-model job leaves its final model in run_dir/hf (nothing else).
    assert pathlib.Path(summary["hf"]) == pathlib.Path(cfg.run_dir) / "hf"
    assert not (pathlib.Path(cfg.run_dir) / "reward_model").exists()
    rm_config, rm_params = heads.load_scalar_model(summary["hf"])
    trainer = PreferenceTrainer(
        load_config(PreferenceConfig, f"{cfg.run_dir}/config.yaml", ["resume=true"])
    )
    trainer.setup()
    trainer.restore(trainer.latest)
    state_params = trainer.state.params
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    assert rm_config.vocab_size == trainer.model_config.vocab_size
    a = _training_pairs(cfg, trainer.tokenizer)
    score = jax.jit(heads.sequence_scores, static_argnums=1)
    scores = {}
    for name, params, config in (("saved", rm_params, rm_config), ("state", state_params, None)):
        config = trainer.model_config if config is None else config
        chosen = score(
            params, config, a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask
        )
        rejected = score(
            params, config, a.prompt_tokens, a.prompt_mask, a.rejected_tokens, a.rejected_mask
        )
        scores[name] = np.asarray(chosen), np.asarray(rejected)
    np.testing.assert_array_equal(scores["saved"][0], scores["state"][0])
    np.testing.assert_array_equal(scores["saved"][1], scores["state"][1])
    chosen, rejected = scores["saved"]
    assert np.mean(chosen > rejected) >= 0.9


def test_reward_model_from_a_sequence_classifier_refuses_an_sft_warm_up(tmp_path):
    cfg = load_config(PreferenceConfig, rl_helpers.CONFIGS / "reward_model.yaml", list(TINY))
    tokenizer, model_config, _ = build_policy(cfg, None)
    params = jax.eval_shape(lambda: heads.init_scalar_params(model_config, jax.random.key(0)))
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), params)
    heads.save_scalar_model(tmp_path / "rm", model_config, params, tokenizer=tokenizer)
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'rm'}"]
    cfg = load_config(
        PreferenceConfig,
        rl_helpers.CONFIGS / "reward_model.yaml",
        [*TINY, *overrides, "sft_warmup.steps=5"],
    )
    with pytest.raises(ValueError, match="already a reward model .* sft_warmup.steps=0"):
        PreferenceTrainer(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()


# -- a reward model learned from a simple rule, then used as the RL reward -------------------

SEVEN = "7"


def _rule_pairs(path, count: int, seed: int) -> None:
    """JSONL pairs on arithmetic prompts: the chosen completion holds a 7, the rejected none.

    Completions are random 1-3 digit strings, so only the rule separates chosen from rejected.
    """
    rng = np.random.default_rng(seed)
    examples = data.arithmetic_examples(count, seed=seed)
    no_seven = [d for d in "0123456789" if d != SEVEN]

    def digits(with_seven: bool) -> str:
        chars = list(rng.choice(no_seven, rng.integers(1, 4)))
        if with_seven:
            chars[rng.integers(len(chars))] = SEVEN
        return "".join(chars)

    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            record = {"prompt": ex.prompt, "chosen": digits(True), "rejected": digits(False)}
            f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def rule_reward_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("rule_rm")
    _rule_pairs(root / "train.jsonl", 512, seed=1)
    _rule_pairs(root / "eval.jsonl", 64, seed=2)
    cfg = load_config(
        PreferenceConfig,
        rl_helpers.CONFIGS / "reward_model.yaml",
        [
            *TINY,
            "data.task=jsonl",
            f"data.train_path={root / 'train.jsonl'}",
            f"data.eval_path={root / 'eval.jsonl'}",
            "data.max_prompt_tokens=16",
            "data.max_completion_tokens=8",
            f"run_dir={root / 'run'}",
            "trainer.max_steps=120",
            "trainer.eval_every=0",
            "checkpoint.every_steps=120",
        ],
    )
    return root, run(cfg)


@pytest.mark.slow
def test_a_reward_model_learns_a_simple_rule_on_held_out_pairs(rule_reward_model):
    _, summary = rule_reward_model
    before, after = summary["eval_before"], summary["eval_after"]
    assert after["rewards/accuracies"] >= 0.95, (before, after)
    assert after["rewards/margins"] > before["rewards/margins"] + 1.0, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("rule_weight", [0.0, 1.0])
def test_the_learned_reward_drives_the_rl_loop(rule_reward_model, tmp_path, rule_weight):
    """The reward model alone (rule reward weight 0), or added to math_match, is the reward the
    RL loop maximises: its score of the policy's samples rises, and more of them hold a 7."""
    root, summary = rule_reward_model
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        tmp_path / "rl",
        f"rewards=[{{name: math_match, weight: {rule_weight}}}]",
        f"reward_model.path={summary['hf']}",
        "reward_model.normalize=none",
        "rollout.prompts_per_step=8",
        "rollout.group_size=8",
        "rollout.max_new_tokens=4",
        "trainer.max_steps=25",
        "trainer.learning_rate=3e-3",
    )
    trainer = RLTrainer(cfg)
    trainer.fit()
    rows = read_metrics(tmp_path / "rl")
    assert len(rows) == 25
    learned = [row["reward/reward_model"] for row in rows]
    assert all(np.isfinite(learned))
    first, last = np.mean(learned[:5]), np.mean(learned[-5:])
    assert last > first + 1.0, (first, last)
    # The learned reward enters the total with weight 1, next to the rule reward.
    for row in rows:
        assert row["reward_mean"] == pytest.approx(
            rule_weight * row["reward/math_match"] + row["reward/reward_model"], abs=1e-4
        )
    # What the reward model rewards is what the policy now writes.
    samples = trainer.run.sample(
        trainer.policy_params,
        trainer.run.eval_examples,
        jax.random.key(1),
        temperature=1.0,
        group_size=4,
    )
    texts = trainer.run.tokenizer.batch_decode(
        np.where(samples.completion_mask, samples.completion_tokens, 0), skip_special_tokens=True
    )
    assert np.mean([SEVEN in text for text in texts]) > 0.5


def _rollout_samples(rng, rows=8):
    """Host ``Samples`` of ``critic_problem.ragged_rows`` (row 2 empty), as the sampler
    returns them."""
    seqs = critic_problem.ragged_rows(rng, rows, empty_row=2)
    return rollout_lib.Samples(
        prompt_tokens=seqs.prompt_tokens,
        prompt_mask=seqs.prompt_mask,
        completion_tokens=seqs.completion_tokens,
        completion_mask=seqs.completion_mask,
        completions=[""] * rows,
        prompts=[""] * rows,
        rewards=np.zeros(rows, np.float32),
        correct=np.zeros(rows, bool),
        components={},
        finished=np.ones(rows, bool),
    )


def test_packed_reward_model_scoring_gives_the_padded_rewards():
    """``trainer.packing=on``: the learned reward model scores the rollout over packed rows
    (``reward_model_plan``), and ``add_learned_reward`` adds what the padded scoring adds
    (f32, 1e-5), on every batch shard of the mesh."""
    config = critic_problem.CONFIG
    std = 1.0 / np.sqrt(config.hidden_size)  # O(1) scores: a mis-pooled state shows
    params = heads.init_scalar_params(config, jax.random.key(0), score_std=std)
    mesh = parallel.make_mesh(devices=jax.devices()[:8] if jax.device_count() >= 8 else None)
    samples = _rollout_samples(np.random.default_rng(0))
    got = {}
    for mode in ("off", "on"):
        cfg = SimpleNamespace(
            reward_model=SimpleNamespace(normalize="none", weight=2.0),
            trainer=SimpleNamespace(packing=mode),
        )
        run = SimpleNamespace(
            reward_model=(reward_model_program(config), params), cfg=cfg, mesh=mesh
        )
        seqs = setup.bucket_prompts(samples)
        plan = reward_model_plan(mode, seqs, mesh)
        assert (plan is None) == (mode == "off")
        got[mode] = RunContext.add_learned_reward(run, samples)
    padded, packed = got["off"], got["on"]
    assert np.all(padded.components["reward_model"] != 0)
    np.testing.assert_allclose(
        packed.components["reward_model"], padded.components["reward_model"], atol=1e-5
    )
    np.testing.assert_allclose(packed.rewards, padded.rewards, atol=2e-5)
