"""LoRA beyond the policy: PPO's critic, PRIME's implicit PRM, reward-model jobs, and the
adapter-only SFT warm-up of a pretrained base.

Each trained network is adapters (and a scalar head) over a frozen base: the critic and the PRM
over the policy's own base (the same arrays, no copy), a reward model over its backbone. The
exported critic / reward model is a plain sequence classifier with the adapters merged, so
``transformers`` loads it with the LoRA model's scores.
"""

from __future__ import annotations

import pathlib

import chex
import jax
import numpy as np
import pytest
import torch
import transformers

from jaxrl_llm import models
from jaxrl_llm.models import heads, lora
from jaxrl_llm.train import adapters, cli
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.ppo import PPOTrainer
from jaxrl_llm.train.rl.prime import PRIMETrainer
from jaxrl_llm.train.rl.serving import trainer_sampler
from tests.train.rl import rl_helpers
from tests.train.test_adapters import preference_config


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


LORA = "model.lora={rank: 4, alpha: 8.0, targets: [q, v, o, up, down]}"
ADAPTERS = {f"{w}_lora_{f}" for w in ("wq", "wv", "wo", "w_up", "w_down") for f in "ab"}


def _rl(config, run_dir, *extra):
    # No SFT warm-up (tiny_config's default): the shaped rewards give the untrained policy's
    # groups different rewards, so every update has a learning signal; checkpoints only at the
    # end (what the tests restore).
    return rl_helpers.tiny_config(
        rl_helpers.CONFIGS / config,
        run_dir,
        rl_helpers.SHAPED_REWARDS,
        LORA,
        "trainer.learning_rate=3e-3",
        "trainer.max_steps=3",
        *extra,
    )


def _same_arrays(a, b) -> bool:
    return all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _seqs(rng, vocab: int):
    prompt = rng.integers(3, vocab, size=(2, 5)).astype(np.int32)
    completion = rng.integers(3, vocab, size=(2, 4)).astype(np.int32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int32)
    return prompt, np.ones_like(prompt), completion, mask


# -- PPO -----------------------------------------------------------------------------------------

# The critic's warm-up step, then one that trains both networks.
PPO_STEPS = ("critic.warmup_steps=1", "trainer.max_steps=2")


@pytest.fixture(scope="module")
def lora_ppo(tmp_path_factory):
    """``lora_ppo(optimizer) -> (trainer, run_dir)``: one 2-step LoRA PPO run per critic
    optimizer, shared by the tests that read it."""
    runs = {}

    def run(optimizer: str):
        if optimizer not in runs:
            run_dir = tmp_path_factory.mktemp(f"lora_ppo_{optimizer}")
            trainer = PPOTrainer(
                _rl("ppo.yaml", run_dir, f"critic.optimizer={optimizer}", *PPO_STEPS)
            )
            trainer.fit()
            runs[optimizer] = trainer, run_dir
        return runs[optimizer]

    return run


@pytest.mark.parametrize("optimizer", ["separate", "joint"])
def test_a_lora_critic_trains_adapters_and_head_over_the_policys_base(lora_ppo, optimizer, rng):
    trainer, tmp_path = lora_ppo(optimizer)

    # One base serves the policy, its reference and the critic: the same arrays.
    assert _same_arrays(trainer.value_frozen, adapters.backbone_view(trainer.base))
    trained = trainer.state.params["value"] if trainer.joint else trainer.value_state.params
    assert set(trained) == {"backbone", "score"}
    assert set(trained["backbone"]) == {"layers"} and set(trained["backbone"]["layers"]) == ADAPTERS
    policy = trainer.state.params["policy"] if trainer.joint else trainer.state.params
    assert set(policy["layers"]) == ADAPTERS
    # The base never moved; the critic's adapters did (B left 0), and so did the policy's
    # after the critic's warm-up step.
    _, saved = models.load_pretrained(tmp_path / "base", dtype=np.float32)
    chex.assert_trees_all_equal(jax.device_get(trainer.base), saved)
    for tree in (trained["backbone"], policy):
        assert np.abs(np.asarray(tree["layers"]["wq_lora_b"])).max() > 0
    rows = read_metrics(tmp_path)
    assert "pg_loss" not in rows[0] and "pg_loss" in rows[1]
    assert all(np.isfinite(row["vf_loss"]) for row in rows)

    # The checkpoint holds adapters and head only.
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        raw, _ = ckpt.restore_raw(2)
    value_raw = raw["params"]["value"] if trainer.joint else raw["critic"]["params"]
    assert set(value_raw["backbone"]["layers"]) == ADAPTERS and "embed" not in value_raw["backbone"]

    # The exported critic is a plain sequence classifier (adapters merged): its values are the
    # LoRA critic's.
    config, loaded = heads.load_scalar_model(tmp_path / "critic")
    assert config.lora is None
    seqs = _seqs(rng, config.vocab_size)
    want = heads.token_values(trainer.value_params, trainer.value_config, *seqs)
    got = heads.token_values(loaded, config, *seqs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.slow
def test_a_lora_ppo_run_resumes_exactly(lora_ppo, tmp_path):
    """Stopped after the critic's warm-up step and resumed: the frozen halves (the policy's
    base, shared by the critic) are rebuilt, the adapters and heads restored (the straight run
    is the shared one of the default, separate critic optimizer)."""
    straight, straight_dir = lora_ppo("separate")
    common = ("critic.optimizer=separate", *PPO_STEPS)
    PPOTrainer(_rl("ppo.yaml", tmp_path / "resumed", *common, "trainer.max_steps=1")).fit()
    resumed = PPOTrainer(_rl("ppo.yaml", tmp_path / "resumed", *common, "resume=true"))
    resumed.fit()
    assert rl_helpers.without_timing(read_metrics(tmp_path / "resumed")) == (
        rl_helpers.without_timing(read_metrics(straight_dir))
    )
    chex.assert_trees_all_equal(
        jax.device_get(resumed.value_params), jax.device_get(straight.value_params)
    )
    chex.assert_trees_all_equal(
        jax.device_get(resumed.policy_params), jax.device_get(straight.policy_params)
    )


def test_a_lora_critic_from_a_reward_model_freezes_the_reward_models_backbone(tmp_path):
    """``critic.init=reward_model``: the frozen backbone is the reward model's (its own copy,
    in the compute dtype), the head starts from the reward model's head."""
    policy = PPOTrainer(_rl("ppo.yaml", tmp_path / "seed", "sft_warmup.steps=0"))
    config = lora.base_config(policy.run.model_config)  # the built-in model, same tokenizer
    policy.checkpointer.close()
    policy.metrics_writer.close()
    written = heads.init_scalar_params(config, jax.random.key(3), score_std=0.5)
    heads.save_scalar_model(tmp_path / "rm", config, jax.device_get(written))
    trainer = PPOTrainer(
        _rl(
            "ppo.yaml",
            tmp_path / "run",
            "critic.init=reward_model",
            f"critic.path={tmp_path / 'rm'}",
            "sft_warmup.steps=0",
        )
    )
    trainer.setup()
    _, rm = heads.load_scalar_model(tmp_path / "rm")
    assert not _same_arrays(
        trainer.value_frozen["backbone"], adapters.backbone_view(trainer.base)["backbone"]
    )
    chex.assert_trees_all_equal(jax.device_get(trainer.value_frozen["backbone"]), rm["backbone"])
    trained = trainer.value_state.params
    np.testing.assert_array_equal(np.asarray(trained["score"]), rm["score"])
    assert set(trained["backbone"]["layers"]) == ADAPTERS
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


# -- PRIME ---------------------------------------------------------------------------------------


def test_a_lora_prm_is_adapters_over_the_policys_base(tmp_path):
    """The PRM starts as the policy (its adapters' B = 0, over the same base), so before its
    first update (``prime.update=after``) its implicit process rewards are 0 — the reference is
    that base too; then its adapters move and the base does not."""
    trainer = PRIMETrainer(_rl("prime.yaml", tmp_path, "prime.update=after", "trainer.max_steps=2"))
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert abs(rows[0]["prm/process_reward_mean"]) < 1e-6
    assert abs(rows[1]["prm/process_reward_mean"]) > 1e-6
    assert set(trainer.prm_state.params) == {"layers"}
    assert set(trainer.prm_state.params["layers"]) == ADAPTERS
    assert _same_arrays(lora.split(trainer.prm_params)[0], trainer.base)
    assert np.abs(np.asarray(trainer.prm_state.params["layers"]["wq_lora_b"])).max() > 0
    _, saved = models.load_pretrained(tmp_path / "base", dtype=np.float32)
    chex.assert_trees_all_equal(jax.device_get(trainer.base), saved)


# -- reward-model jobs ---------------------------------------------------------------------------


def _reward_model(run_dir, *extra):
    # No SFT warm-up: the adapters and head learn the preferences over the random base too.
    return preference_config(
        "reward_model.yaml", run_dir, "checkpoint.every_steps=2", "sft_warmup.steps=0", *extra
    )


@pytest.mark.slow
def test_a_lora_reward_model_trains_adapters_and_head_exports_merged_and_resumes(tmp_path, rng):
    from jaxrl_llm.train.preference.trainer import PreferenceTrainer  # noqa: PLC0415

    trainer = PreferenceTrainer(_reward_model(tmp_path / "straight"))
    summary = trainer.fit()
    trained = trainer.state.params
    assert set(trained) == {"backbone", "score"}
    assert set(trained["backbone"]["layers"]) == {  # every projection: the default targets
        f"{w}_lora_{f}" for w, _ in lora.LORA_WEIGHTS.values() for f in "ab"
    }
    assert np.abs(np.asarray(trained["backbone"]["layers"]["wq_lora_b"])).max() > 0
    rows = read_metrics(tmp_path / "straight")
    assert rows[-1]["loss"] < rows[0]["loss"]
    # The frozen backbone is what the run wrote to base/.
    _, saved = models.load_pretrained(tmp_path / "straight" / "base", dtype=np.float32)
    chex.assert_trees_all_equal(jax.device_get(trainer.base["backbone"]), saved)

    # hf/ is a plain sequence classifier: transformers scores it like the LoRA model.
    hf = pathlib.Path(summary["hf"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(hf)).eval()
    config = trainer.model_config
    prompt = rng.integers(3, config.vocab_size, size=(2, 6)).astype(np.int32)
    empty = np.zeros((2, 0), np.int32)
    want = heads.sequence_scores(
        trainer.policy_params, config, prompt, np.ones_like(prompt), empty, empty
    )
    with torch.no_grad():
        got = model(input_ids=torch.as_tensor(prompt, dtype=torch.long)).logits[:, 0].numpy()
    np.testing.assert_allclose(got, np.asarray(want), atol=1e-4, rtol=1e-4)
    # jaxrl-llm export of its last checkpoint writes the same classifier.
    again = tmp_path / "again"
    assert cli.export_main([str(tmp_path / "straight"), "--out", str(again)]) == 0
    chex.assert_trees_all_equal(heads.load_scalar_model(again)[1], heads.load_scalar_model(hf)[1])

    # Stopped at its step-2 checkpoint and resumed, it trains what the straight run did.
    PreferenceTrainer(_reward_model(tmp_path / "resumed", "trainer.max_steps=2")).fit()
    resumed = PreferenceTrainer(_reward_model(tmp_path / "resumed", "resume=true"))
    resumed.fit()
    assert rl_helpers.without_timing(read_metrics(tmp_path / "resumed")) == (
        rl_helpers.without_timing(rows)
    )
    chex.assert_trees_all_equal(
        jax.device_get(resumed.policy_params), jax.device_get(trainer.policy_params)
    )


# -- the adapter-only SFT warm-up ----------------------------------------------------------------


def test_the_sft_warm_up_of_a_pretrained_base_trains_adapters_only(tmp_path):
    """With ``model.path`` (a pretrained base) the LoRA run's warm-up trains rank-r adapters and
    merges them: each targeted weight moves by a matrix of rank <= r, the rest not at all."""
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    # The base: the built-in model as a job exports it (no RL step needed, nor a warm-up).
    seed = RLTrainer(rl_helpers.tiny_config(None, tmp_path / "seed", "trainer.max_steps=0"))
    seed.fit()
    path = tmp_path / "seed" / "hf"
    _, original = models.load_pretrained(path, dtype=np.float32)
    trainer = RLTrainer(
        rl_helpers.tiny_config(
            None,
            tmp_path / "run",
            f"model.path={path}",
            LORA,
            "sft_warmup.steps=10",
            "sft_warmup.learning_rate=1e-2",
            "trainer.max_steps=1",
        )
    )
    trainer.setup()
    warmed = jax.device_get(trainer.base)
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(warmed[name], original[name])
    layers = warmed["layers"]
    for name in ("wk", "w_gate", "attn_norm"):
        np.testing.assert_array_equal(layers[name], original["layers"][name])
    for target in ("q", "v", "o", "up", "down"):
        name, contract = lora.LORA_WEIGHTS[target]
        delta = np.asarray(layers[name], np.float64) - np.asarray(original["layers"][name])
        assert np.abs(delta).max() > 0, name
        for layer in delta:
            flat = layer.reshape(int(np.prod(layer.shape[:contract])), -1)
            assert np.linalg.matrix_rank(flat, tol=1e-6 * np.abs(flat).max()) <= 4, name
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


# -- the sampler's weights: adapters on the fly or merged ----------------------------------------


@pytest.mark.parametrize(
    "max_new_tokens, sampler, merged",
    [(20, "auto", False), (21, "auto", True), (200, "adapters", False), (1, "merged", True)],
)
def test_auto_merges_when_the_decode_reads_more_adapter_bytes_than_a_merge(
    tmp_path, max_new_tokens, sampler, merged
):
    """By hand, per layer of the built-in model (d 64, MLP 192, 4 query and 2 key/value heads
    of 16) with rank 4 on q, v, o, up, down: the targeted weights hold N_W = 4096 + 2048 + 4096
    + 12288 + 12288 = 34816 values, the adapters N_A = 4 (128 + 96 + 128 + 256 + 256) = 3456;
    merging (2 N_W = 69632) moves fewer bytes than decoding T tokens on the fly (T N_A) from
    T = 21 on."""
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    cfg = _rl(
        "grpo.yaml",
        tmp_path,
        f"rollout.max_new_tokens={max_new_tokens}",
        f"model.lora.sampler={sampler}",
    )
    trainer = RLTrainer(cfg)
    layout = trainer_sampler(cfg, trainer.run.model_config, trainer.run.mesh)[0]
    assert adapters.merged_sampler(cfg, trainer.run.model_config, layout) is merged
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


def test_an_unknown_lora_sampler_is_named(tmp_path):
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    with pytest.raises(ValueError, match="model.lora.sampler must be one of"):
        RLTrainer(_rl("grpo.yaml", tmp_path, "model.lora.sampler=fused"))


def test_the_merged_sampler_decodes_what_the_adapters_do(tmp_path):
    """``model.lora.sampler=merged``: the sampler runs the base model's program on
    ``W + (alpha / r) A B`` (no adapter in its parameters), and in f32 samples the same
    completions with the same log-probs (to float rounding) as adapters applied on the fly."""
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    runs = {}
    for mode in ("adapters", "merged"):
        trainer = RLTrainer(
            _rl("grpo.yaml", tmp_path / mode, f"model.lora.sampler={mode}", "trainer.max_steps=2")
        )
        trainer.fit()
        runs[mode] = trainer
    merged, on_the_fly = runs["merged"], runs["adapters"]
    assert merged.run.sampler_config == lora.base_config(merged.run.model_config)
    assert on_the_fly.merge_sampler is None and on_the_fly.run.sampler_config is None
    served = merged.sampler_params()
    assert not lora.split(served)[1]["layers"]
    chex.assert_trees_all_close(
        jax.device_get(served),
        jax.device_get(lora.merge_weights(merged.policy_params, merged.run.model_config)),
        atol=1e-6,
    )
    a = read_metrics(tmp_path / "adapters")
    b = read_metrics(tmp_path / "merged")
    for row_a, row_b in zip(a, b, strict=True):
        for key in ("reward_mean", "completion_length_mean", "accuracy"):
            assert row_a[key] == row_b[key], key
        assert row_b["rollout/logprob_diff_max"] < 1e-4
        assert row_a["loss"] == pytest.approx(row_b["loss"], rel=1e-4, abs=1e-6)
