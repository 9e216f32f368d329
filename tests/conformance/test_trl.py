r"""Conformance with TRL's GRPO trainer (``trl.trainer.grpo_trainer.GRPOTrainer``): the two
token masks it exposes as methods, run on the same inputs as ours; its adaptive entropy
coefficient (``use_adaptive_entropy``), run by its own ``_compute_loss`` on a stand-in
trainer over several optimizer steps; and with its GKD trainer's
generalised JSD (``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss``), values and
gradients.

TRL's other stabilisers (``use_bias_correction_kl``, ``multi_objective_aggregation=
"normalize_then_sum"``) are written inline in the trainer; their formulas are transcribed in
tests/reference/stabilisers.py and tested in tests/losses/test_kl.py and
tests/losses/test_advantages.py.
Skipped unless TRL is installed (``JAXRL_REQUIRE_TRL=1`` turns the skip into a failure).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from jaxrl_llm.losses import aggregation, distillation, token_selection

try:
    import torch
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    if os.environ.get("JAXRL_REQUIRE_TRL") == "1":
        pytest.fail(f"JAXRL_REQUIRE_TRL=1 but TRL is not importable: {error}", pytrace=False)
    pytest.skip(f"TRL is not importable: {error}", allow_module_level=True)

B, T = 8, 7


def _mask(rng):
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0] = T
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    mask[3] = 0.0
    return mask


# One process: TRL's cross-process padding and gathering are the identity.
_ONE_PROCESS = types.SimpleNamespace(
    accelerator=types.SimpleNamespace(
        pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x
    )
)


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 1.0])
def test_top_entropy_mask_matches_trl(rng, quantile):
    entropy = rng.uniform(0.0, 4.0, (B, T)).astype(np.float32)
    mask = _mask(rng)
    ours = token_selection.top_entropy_mask(entropy, mask, quantile=quantile)
    theirs = GRPOTrainer.get_high_entropy_mask(
        _ONE_PROCESS, torch.tensor(entropy), torch.tensor(mask), 1.0 - quantile
    )
    np.testing.assert_array_equal(np.asarray(ours), theirs.numpy().astype(np.float32))


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.5])
def test_off_policy_sequence_mask_matches_trl(rng, adv_rank, threshold):
    lp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
    sampling = (lp + rng.normal(0.1, 0.3, (B, T))).astype(np.float32)
    advantages = rng.normal(size=(B,) if adv_rank == 1 else (B, T)).astype(np.float32)
    mask = _mask(rng)
    ours = token_selection.off_policy_sequence_mask(
        lp, sampling, advantages, mask, threshold=threshold
    )
    theirs = GRPOTrainer.get_off_policy_mask(
        advantages=torch.tensor(advantages[:, None] if adv_rank == 1 else advantages),
        per_token_logps=torch.tensor(lp),
        sampling_per_token_logps=torch.tensor(sampling),
        mask=torch.tensor(mask),
        off_policy_threshold=threshold,
    )
    # TRL's mask is per row ([B, 1]) or per token, padding included; ours is 0 on padding.
    np.testing.assert_array_equal(np.asarray(ours), np.broadcast_to(theirs.numpy(), (B, T)) * mask)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_generalized_jsd_matches_trl_gkd_in_values_and_gradients(rng, beta, temperature):
    import jax  # noqa: PLC0415

    vocab = 11
    student = rng.normal(0, 2, (B, T, vocab))
    teacher = rng.normal(0, 2, (B, T, vocab))
    mask = _mask(rng)
    labels = np.where(mask > 0, 1, -100)

    def ours(s):
        per_token = distillation.generalized_jsd(
            s, teacher, mask, beta=beta, temperature=temperature
        )
        return aggregation.aggregate(per_token, mask, "token-mean")

    value, grad = jax.value_and_grad(ours)(student)
    torch_student = torch.tensor(student, requires_grad=True)
    theirs = GKDTrainer.generalized_jsd_loss(
        torch_student,
        torch.tensor(teacher),
        labels=torch.tensor(labels),
        beta=beta,
        temperature=temperature,
        reduction="batchmean",  # over the valid tokens: their mean
    )
    theirs.backward()
    np.testing.assert_allclose(float(value), theirs.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), torch_student.grad.numpy(), atol=1e-6)


def _trl_trainer(*, quantile, coef, target, delta, bounds):
    """A stand-in ``GRPOTrainer`` for its own ``_compute_loss``: one process, no accumulation,
    ``loss_type="bnpo"`` (the token mean), no KL; the model forward is replaced by the given
    log-probs and entropies."""
    from collections import defaultdict  # noqa: PLC0415

    accelerator = types.SimpleNamespace(
        pad_across_processes=lambda x, dim, pad_index: x,
        gather=lambda x: x,
        reduce=lambda x, reduction: x,
        sync_gradients=True,
        num_processes=1,
    )
    trainer = types.SimpleNamespace(
        accelerator=accelerator,
        model=types.SimpleNamespace(training=True),
        aux_loss_enabled=False,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type="bnpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        entropy_coef=coef,
        use_adaptive_entropy=True,
        _entropy_bonus_enabled=True,
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=types.SimpleNamespace(
            entropy_target=target,
            entropy_coef_delta=delta,
            entropy_coef_min=bounds[0],
            entropy_coef_max=bounds[1],
            use_bias_correction_kl=False,
            delta=None,  # TRL's two-sided clip: off
        ),
    )
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    return trainer


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_entropy_coefficient_matches_trl_over_steps(rng, quantile):
    """TRL's controller, run by its ``_compute_loss`` over optimizer steps whose entropies
    cross the target, against ``objectives.entropy_control`` + ``policy_loss``: the applied
    coefficient, the loss and its gradients (log-probs and entropies), the measured entropy and
    the next coefficient, step by step. With a top-entropy mask TRL's bonus averages over the
    selected tokens, ours over all tokens (the aggregation of every term): that known factor
    is applied to TRL's numbers before comparing."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxrl_llm import objectives  # noqa: PLC0415
    from jaxrl_llm.objectives import entropy_control  # noqa: PLC0415
    from jaxrl_llm.types import RolloutBatch  # noqa: PLC0415

    target, delta, bounds = 0.8, 0.01, (0.0, 0.025)
    objective = objectives.make(
        "dapo",
        clip_high=0.2,
        top_entropy_quantile=quantile,
        entropy_coef=0.005,
        entropy_target=target,
        entropy_coef_delta=delta,
        entropy_coef_bounds=bounds,
    )
    trainer = _trl_trainer(quantile=quantile, coef=0.005, target=target, delta=delta, bounds=bounds)
    control = entropy_control.init_control(objective)
    mask = _mask(rng)
    applied_nonzero = 0
    # Mean entropies around the target: up, up, at/below, below, ..., then above.
    for scale in (0.5, 0.6, 0.7, 0.9, 1.2, 0.4, 1.5, 0.3):
        lp = -rng.uniform(0.1, 3.0, (B, T)).astype(np.float32)
        old = (lp + rng.normal(0.0, 0.2, (B, T))).astype(np.float32)
        entropy = rng.uniform(0.0, 2.0 * scale, (B, T)).astype(np.float32)
        adv = rng.normal(size=B).astype(np.float32)
        lp_t = torch.tensor(lp, requires_grad=True)
        h_t = torch.tensor(entropy, requires_grad=True)
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp_t, h_t, None)  # noqa: B023
        inputs = {
            "prompt_ids": torch.zeros((B, 1), dtype=torch.long),
            "prompt_mask": torch.ones((B, 1), dtype=torch.long),
            "completion_ids": torch.zeros((B, T), dtype=torch.long),
            "completion_mask": torch.tensor(mask),
            "advantages": torch.tensor(adv),
            "old_per_token_logps": torch.tensor(old),
        }
        trl_applied = trainer.entropy_coef if trainer._last_world_entropy <= target else 0.0
        theirs = GRPOTrainer._compute_loss(trainer, None, inputs)
        theirs.backward()

        applied = entropy_control.applied_coef(objective, control)
        batch = RolloutBatch(
            completion_mask=jnp.asarray(mask),
            old_logprobs=jnp.asarray(old),
            advantages=jnp.asarray(adv),
        )

        def loss_fn(x, h, applied=applied, batch=batch):
            out = objectives.policy_loss(objective, x, batch, entropy=h, entropy_coef=applied)
            return out.loss, out.metrics

        (loss, metrics), (d_lp, d_h) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            jnp.asarray(lp), jnp.asarray(entropy)
        )
        control = entropy_control.update_control(objective, control, metrics)

        # TRL's bonus is the mean entropy of the selected tokens; ours is aggregated like every
        # term, over all N tokens (additive over micro-batches): a factor Σsel / N apart.
        sel = np.asarray(token_selection.top_entropy_mask(entropy, mask, quantile=quantile))
        share, bonus = sel.sum() / mask.sum(), float(np.sum(entropy * sel, dtype=np.float64))
        theirs_loss = theirs.item() + trl_applied * bonus * (1 / sel.sum() - 1 / mask.sum())
        np.testing.assert_allclose(float(applied), trl_applied, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(float(loss), theirs_loss, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(d_lp), lp_t.grad.numpy() * mask, atol=1e-6)
        np.testing.assert_allclose(np.asarray(d_h), h_t.grad.numpy() * mask * share, atol=1e-7)
        np.testing.assert_allclose(float(control.coef), trainer.entropy_coef, rtol=1e-6)
        np.testing.assert_allclose(
            float(control.entropy), trainer._last_world_entropy, rtol=1e-5, atol=1e-7
        )
        applied_nonzero += trl_applied > 0
    assert 0 < applied_nonzero < 8  # the bonus was on for some steps, off for others
