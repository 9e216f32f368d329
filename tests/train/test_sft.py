"""The supervised warm-up (``train.sft.sft_warmup``) against a float64 reference, and the
preference and reward-model jobs starting from the policy it leaves.

The reference: per-token log-probs from the library's forward logits, our own log-softmax,
masking and token mean (``−Σ m·log π(y_t) / Σ m``), ``jax.grad`` of that NLL, a global-norm
clip at 1 and AdamW (β₁ 0.9, β₂ 0.999, ε 1e-8, no weight decay, constant learning rate) in
float64 NumPy — the optimizer ``sft_warmup`` documents. The warm-up's NLL history is measured on
each batch before its update.

The jobs: ``sft_warmup.steps=3`` on the built-in synthetic pairs. The warm-up is watched through
the name the trainer calls (``jaxrl_llm.train.preference.trainer.sft_warmup``): what it is asked
for (steps, learning rate, batches of the training split's chosen completions) and what it
returns. DPO must start from those parameters and fix its reference there; the reward model's
backbone must be that policy's.
"""

from __future__ import annotations

import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models, parallel
from jaxrl_llm.train import setup, sft
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.preference import trainer as preference_trainer
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.types import Sequences
from tests.reference import logprobs as reference_logprobs
from tests.reference.preference_training import token_mean_nll
from tests.train import helpers

CONFIG = models.ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    tie_word_embeddings=False,
)
BATCH, PROMPT, COMPLETION = 8, 5, 7
MAX_STEPS = 3
LEARNING_RATE = 2e-3  # not the config default (3e-3), so a hard-coded rate shows
MAX_GRAD_NORM = 1.0
B1, B2, EPS = 0.9, 0.999, 1e-8


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


# -- the warm-up against a float64 reference ----------------------------------------------------


def host_batch(seed: int) -> Sequences:
    """Left-padded prompts (at least one real token), right-padded ragged completions, one empty
    completion row; padding positions hold real token ids, so only the masks exclude them."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(1, PROMPT + 1, size=BATCH)
    prompt_mask = np.arange(PROMPT)[None, :] >= (PROMPT - prompt_len)[:, None]
    completion_len = rng.integers(1, COMPLETION + 1, size=BATCH)
    completion_len[2] = 0
    completion_mask = np.arange(COMPLETION)[None, :] < completion_len[:, None]
    prompt_tokens = rng.integers(1, CONFIG.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    completion_tokens = rng.integers(1, CONFIG.vocab_size, (BATCH, COMPLETION)).astype(np.int32)
    return Sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)


def full_logits(params, config, prompt_tokens, prompt_mask, completion_tokens, completion_mask):
    """``[B, P + T, V]`` f32 logits of the library's forward over ``[prompt ; completion]``."""
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
    return models.logits(params, config, tokens, attention_mask=mask)


_full_logits = jax.jit(full_logits, static_argnums=1)


def token_logps_f64(params, config, prompt_tokens, prompt_mask, completion_tokens, mask):
    """``[B, T]`` float64 ``log π(y_t)`` of the completion tokens (0 where masked)."""
    logits = _full_logits(params, config, prompt_tokens, prompt_mask, completion_tokens, mask)
    logps, _ = reference_logprobs.completion_logprobs(
        np.asarray(logits, np.float64), prompt_tokens.shape[1], completion_tokens, mask
    )
    return logps


def nll_jax(params, seqs: Sequences):
    """The token-mean NLL written out (stable log-softmax, gather, mask, mean): our gradient."""
    logits = full_logits(params, CONFIG, *seqs)[:, PROMPT - 1 : PROMPT - 1 + COMPLETION]
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    target = jnp.take_along_axis(log_probs, seqs.completion_tokens[..., None], axis=-1)[..., 0]
    mask = seqs.completion_mask.astype(jnp.float32)
    return -jnp.sum(target * mask) / jnp.sum(mask)


_nll_grad = jax.jit(jax.grad(nll_jax))


def _f32(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def reference_warmup(initial, batches, *, steps, learning_rate, clip=True):
    """``(params after each step [0..steps], NLL before each update, gradient global norms)``.

    Clipped AdamW in float64. optax keeps β₁, β₂ as float32 numbers (``1 − float32(0.999)`` is
    1.3e-5 away from 1e-3 relatively, which would move every update by that much), so the
    reference uses those values of β; everything else is float64.
    """
    b1, b2 = float(np.float32(B1)), float(np.float32(B2))
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: np.asarray(x, np.float64), initial))
    mu = [np.zeros_like(p) for p in leaves]
    nu = [np.zeros_like(p) for p in leaves]
    trajectory, nlls, norms = [treedef.unflatten(leaves)], [], []
    for t in range(1, steps + 1):
        seqs, params32 = batches[t - 1], _f32(treedef.unflatten(leaves))
        logps = token_logps_f64(params32, CONFIG, *seqs)
        nlls.append(token_mean_nll(logps, seqs.completion_mask))
        grads = [np.asarray(g, np.float64) for g in jax.tree.leaves(_nll_grad(params32, seqs))]
        norm = float(np.sqrt(sum(np.sum(g**2) for g in grads)))
        norms.append(norm)
        if clip and norm > MAX_GRAD_NORM:
            grads = [g * (MAX_GRAD_NORM / norm) for g in grads]
        mu = [b1 * m + (1.0 - b1) * g for m, g in zip(mu, grads)]
        nu = [b2 * v + (1.0 - b2) * g * g for v, g in zip(nu, grads)]
        leaves = [
            p - learning_rate * (m / (1.0 - b1**t)) / (np.sqrt(v / (1.0 - b2**t)) + EPS)
            for p, m, v in zip(leaves, mu, nu)
        ]
        trajectory.append(treedef.unflatten(leaves))
    return trajectory, nlls, norms


@pytest.fixture(scope="module")
def problem():
    """The initial parameters (host), the batches and the float64 reference trajectory."""
    initial = jax.device_get(models.init_params(CONFIG, jax.random.key(0)))
    batches = [host_batch(seed) for seed in range(MAX_STEPS)]
    reference = reference_warmup(initial, batches, steps=MAX_STEPS, learning_rate=LEARNING_RATE)
    return initial, batches, reference


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}steps")
def warmed(request, problem):
    """``(steps, params, history)`` of the library's warm-up on an FSDP mesh of 2 devices."""
    steps = request.param
    initial, batches, _ = problem
    mesh = parallel.make_mesh(1, 2, 1, devices=jax.devices()[:2])
    params, history = sft.sft_warmup(
        CONFIG,
        jax.tree.map(jnp.asarray, initial),
        iter(batches),
        steps=steps,
        learning_rate=LEARNING_RATE,
        key=jax.random.key(1),
        mesh=mesh,
        to_device=lambda seqs: setup.to_device(seqs, mesh),
    )
    return steps, jax.device_get(params), history


def test_warmup_history_is_the_token_mean_nll_before_each_update(problem, warmed):
    initial, batches, (_, reference_nlls, _) = problem
    steps, _, history = warmed
    assert len(history) == steps and all(isinstance(x, float) for x in history)
    # The first entry is the initial policy's NLL on the first batch, computed here directly.
    first = batches[0]
    want = token_mean_nll(token_logps_f64(initial, CONFIG, *first), first.completion_mask)
    np.testing.assert_allclose(history[0], want, rtol=1e-5)
    np.testing.assert_allclose(history, reference_nlls[:steps], rtol=1e-5)


def test_warmup_params_are_clipped_adamw_on_the_nll(problem, warmed):
    initial, _, (trajectory, _, norms) = problem
    steps, params, _ = warmed
    chex.assert_trees_all_equal_shapes_and_dtypes(params, initial)
    want = trajectory[steps]
    for (path, got), expected, start in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(want),
        jax.tree.leaves(initial),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        # optax's bias corrections 1 − β^t are float32 (~1e-5 relative from t = 2 on) and Adam
        # divides by √v, so an element whose gradient nearly cancels carries its gradient's f32
        # rounding into the update, which the CPU's vector width reorders (measured: up to 0.3%
        # of one step and 5e-5 of a leaf's update on an AVX2 EPYC, 1.1% and 1.6e-4 on an
        # AVX-512 Xeon). Each element within 5% of a step, each leaf's update within 1e-3: an
        # unclipped run is 2.6e-2 to 4.9e-2 away.
        np.testing.assert_allclose(
            got, expected, rtol=1e-5, atol=5e-2 * LEARNING_RATE, err_msg=name
        )
        update, want_update = got - start, expected - np.asarray(start, np.float64)
        error = np.linalg.norm(update - want_update) / np.linalg.norm(want_update)
        assert error < 1e-3, (name, error)
    # The problem exercises the clip: every step's gradient is over the norm, by differing
    # factors (Adam is invariant to one constant scale, not to a varying one).
    assert min(norms[:steps]) > MAX_GRAD_NORM, norms
    unclipped, _, _ = reference_warmup(
        initial, problem[1], steps=steps, learning_rate=LEARNING_RATE, clip=False
    )
    assert not np.allclose(params["lm_head"], unclipped[steps]["lm_head"], rtol=1e-5, atol=1e-5)


# -- what the warm-up shows as it runs ------------------------------------------------------


def _warmup_shown(problem, caplog, monitor):
    """``(history, lines logged)`` of a 3-step warm-up on the problem, on one device."""
    initial, batches, _ = problem
    mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    with caplog.at_level("INFO", logger="jaxrl_llm"):
        _, history = sft.sft_warmup(
            CONFIG,
            jax.tree.map(jnp.asarray, initial),
            iter(batches),
            steps=MAX_STEPS,
            learning_rate=LEARNING_RATE,
            key=jax.random.key(1),
            mesh=mesh,
            to_device=lambda seqs: setup.to_device(seqs, mesh),
            monitor=monitor,
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sft warm-up")]
    return history, lines


def test_warmup_progress_bar_counts_the_steps_and_shows_the_nll(problem, caplog):
    """``logging.progress``: a bar over the steps (its total the warm-up's, with the time
    left) showing the last finished step's NLL, instead of the periodic NLL lines; the NLL
    after the last step is still logged."""
    stream = io.StringIO()
    monitor = sft.WarmupMonitor(log_every=1, progress=True, stream=stream)
    history, lines = _warmup_shown(problem, caplog, monitor)
    text = stream.getvalue()
    assert "sft warm-up" in text and f"0/{MAX_STEPS}" in text  # the first draw
    final = text.strip().split("\r")[-1]
    assert f"{MAX_STEPS}/{MAX_STEPS}" in final and "<00:00" in final  # done, none left
    assert f"nll {history[-1]:.4f}" in final
    assert lines == [f"sft warm-up step {MAX_STEPS}/{MAX_STEPS}: nll {history[-1]:.4f}"]


def test_warmup_without_a_bar_draws_nothing_and_logs_the_nll(problem, caplog):
    stream = io.StringIO()
    monitor = sft.WarmupMonitor(log_every=2, progress=False, stream=stream)
    history, lines = _warmup_shown(problem, caplog, monitor)
    assert stream.getvalue() == ""
    assert lines == [
        f"sft warm-up step 2/{MAX_STEPS}: nll {history[1]:.4f}",
        f"sft warm-up step {MAX_STEPS}/{MAX_STEPS}: nll {history[2]:.4f}",
    ]


# -- the preference and reward-model jobs start from the warmed-up policy ---------------------

# One device, 16 training pairs, 16 held out; a 3-step warm-up on batches of 8 chosen answers.
WARMUP_STEPS, WARMUP_BATCH = 3, 8
JOB_TINY = (
    f"sft_warmup.steps={WARMUP_STEPS}",
    f"sft_warmup.batch_size={WARMUP_BATCH}",
    "data.num_train=16",
    "data.eval_size=16",
    "trainer.batch_size=8",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
)


@pytest.fixture
def warmup_calls(monkeypatch):
    """Records each call the preference trainer makes to its warm-up: the keyword arguments,
    the host batches it drew and the parameters it returned (copied before the job's donated
    steps can free them). Wraps whatever the trainer's name refers to when the test starts."""
    calls = []
    inner = preference_trainer.sft_warmup

    def spy(model_config, params, batches, **kwargs):
        drawn = []

        def recorded():
            for seqs in batches:
                drawn.append(jax.tree.map(np.array, seqs))
                yield seqs

        out, history = inner(model_config, params, recorded(), **kwargs)
        warmed = None if out is None else jax.device_get(out)
        calls.append({"kwargs": kwargs, "batches": drawn, "params": warmed, "history": history})
        return out, history

    monkeypatch.setattr(preference_trainer, "sft_warmup", spy)
    return calls


def _trainer(config_name: str, run_dir):
    cfg = load_config(
        PreferenceConfig, helpers.CONFIGS / config_name, [*JOB_TINY, f"run_dir={run_dir}"]
    )
    trainer = preference_trainer.PreferenceTrainer(cfg)
    trainer.setup()
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    return cfg, trainer


def _completion_logps(params, model_config, arrays, which: str = "chosen"):
    tokens, mask = getattr(arrays, f"{which}_tokens"), getattr(arrays, f"{which}_mask")
    return token_logps_f64(
        params, model_config, arrays.prompt_tokens, arrays.prompt_mask, tokens, mask
    )


def _check_the_warmup_call(calls, cfg, trainer):
    """One call: the configured steps and rate, batches of the training split's (prompt, chosen
    answer) rows; returns the warmed-up policy."""
    assert len(calls) == 1
    call = calls[0]
    assert call["kwargs"]["steps"] == WARMUP_STEPS
    assert call["kwargs"]["learning_rate"] == cfg.sft_warmup.learning_rate
    assert len(call["batches"]) == WARMUP_STEPS
    a = trainer.train_split.arrays
    train_rows = {
        (tuple(p[m]), tuple(c[cm]))
        for p, m, c, cm in zip(a.prompt_tokens, a.prompt_mask, a.chosen_tokens, a.chosen_mask)
    }
    for seqs in call["batches"]:
        assert seqs.completion_tokens.shape[0] == WARMUP_BATCH
        for p, m, c, cm in zip(*seqs):
            assert (tuple(p[m]), tuple(c[cm])) in train_rows
    assert call["params"] is not None, "the warm-up returned no parameters"
    return call["params"]


def _held_out_nll(policy_params, trainer) -> float:
    a = trainer.eval_split.arrays
    logps = _completion_logps(policy_params, trainer.model_config, a)
    return token_mean_nll(logps, a.chosen_mask)


def _untrained_nll(trainer) -> float:
    """The held-out chosen NLL of a fresh random initialisation of the same model."""
    params = models.init_params(trainer.model_config, jax.random.key(7))
    return _held_out_nll(jax.device_get(params), trainer)


def test_dpo_starts_from_and_is_referenced_to_the_warmed_up_policy(warmup_calls, tmp_path):
    cfg, trainer = _trainer("dpo.yaml", tmp_path / "dpo")
    assert cfg.loss.name == "dpo" and cfg.loss.reference == "precompute"
    assert trainer.sft_steps == WARMUP_STEPS
    warmed = _check_the_warmup_call(warmup_calls, cfg, trainer)
    policy = jax.device_get(trainer.state.params)
    # DPO's first step starts from exactly the warmed-up parameters ...
    chex.assert_trees_all_equal(policy, warmed)
    # ... which model the held-out chosen answers better than an untrained policy does.
    after, before = _held_out_nll(policy, trainer), _untrained_nll(trainer)
    assert after < before - 0.1, (before, after)
    # The precomputed reference log-probs are the warmed-up policy's: Σ_t log π(y_t) of the
    # chosen and rejected answers of every training and held-out pair.
    for split_name, split in (("train", trainer.train_split), ("eval", trainer.eval_split)):
        ref = trainer.ref_logps[split_name]
        for key, which in (("first", "chosen"), ("second", "rejected")):
            mask = getattr(split.arrays, f"{which}_mask")
            want = _completion_logps(policy, trainer.model_config, split.arrays, which).sum(axis=1)
            assert ref[key].shape == (mask.shape[0],)
            np.testing.assert_allclose(ref[key], want, rtol=1e-5, atol=1e-5, err_msg=split_name)


def test_reward_model_starts_from_the_warmed_up_backbone(warmup_calls, tmp_path):
    cfg, trainer = _trainer("reward_model.yaml", tmp_path / "rm")
    assert cfg.job == "reward_model" and trainer.sft_steps == WARMUP_STEPS
    warmed = _check_the_warmup_call(warmup_calls, cfg, trainer)
    after, before = _held_out_nll(warmed, trainer), _untrained_nll(trainer)
    assert after < before - 0.1, (before, after)
    # The scalar-head model's backbone is the warmed-up policy without its unembedding.
    state = jax.device_get(trainer.state.params)
    assert set(state) == {"backbone", "score"}
    chex.assert_trees_all_equal(
        state["backbone"], {k: v for k, v in warmed.items() if k != "lm_head"}
    )
