r"""Conformance with TRL's GRPO trainer (``trl.trainer.grpo_trainer.GRPOTrainer``): the two
token masks it exposes as methods, run on the same inputs as ours; and with its GKD trainer's
generalised JSD (``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss``), values and
gradients.

TRL's other stabilisers (``use_bias_correction_kl``, ``multi_objective_aggregation=
"normalize_then_sum"``) are written inline in the trainer; their formulas are transcribed in
tests/reference/stabilisers.py and tested in tests/test_kl.py and tests/test_advantages.py.
Skipped unless TRL is installed (``JAXRL_REQUIRE_TRL=1`` turns the skip into a failure).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from jaxrl_llm import aggregation, distillation, token_selection

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
