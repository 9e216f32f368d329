r"""GKD's generalised JSD as the RL update computes it, against TRL's
``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss``: values and gradients with respect to
the student's logits.

Our side is the update's chain: the teacher's chunked top-k (``logprobs``' ``top_k``: log-probs
and ids ``[B, T, k]``), the student's log-probs gathered at those ids in its own chunked pass
(``gather_ids``), ``distillation.top_k_generalized_jsd`` and the token mean. TRL has no top-k
form; it is handed both logits restricted to the teacher's top-k ids (its ``log_softmax`` then
renormalises them over the k tokens, the restriction ours makes), or the whole vocabulary
(``k = V``). Skipped unless TRL is installed (``JAXRL_REQUIRE_TRL=1`` turns the skip into a
failure).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.logprobs import token_logprobs_from_hidden
from jaxrl_llm.losses import aggregation, distillation

try:
    import torch
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    if os.environ.get("JAXRL_REQUIRE_TRL") == "1":
        pytest.fail(f"JAXRL_REQUIRE_TRL=1 but TRL is not importable: {error}", pytrace=False)
    pytest.skip(f"TRL is not importable: {error}", allow_module_level=True)

B, T, V = 4, 6, 13


def _identity(hidden):  # the "hidden states" are the logits themselves
    return hidden


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [1, 4, V])
def test_top_k_jsd_matches_trl_gkd_in_values_and_gradients(rng, beta, top_k):
    temperature = 0.8  # both sides divide the logits by it before the softmax
    student = rng.normal(0, 2, (B, T, V)).astype(np.float32)
    teacher = rng.normal(0, 2, (B, T, V)).astype(np.float32)
    lengths = np.array([T, 3, 0, 5])
    mask = np.arange(T)[None, :] < lengths[:, None]
    targets = rng.integers(0, V, (B, T))
    top = token_logprobs_from_hidden(
        jnp.asarray(teacher),
        _identity,
        targets,
        mask=mask,
        temperature=temperature,
        chunk_size=4,
        top_k=top_k,
    )

    def ours(logits):
        gathered = token_logprobs_from_hidden(
            logits,
            _identity,
            targets,
            mask=mask,
            temperature=temperature,
            chunk_size=4,
            gather_ids=top.top_ids,
        ).gathered
        jsd = distillation.top_k_generalized_jsd(gathered, top.top_logprobs, mask, beta=beta)
        return aggregation.aggregate(jsd, mask, "token-mean")

    value, grad = jax.value_and_grad(ours)(jnp.asarray(student))

    ids = torch.tensor(np.asarray(top.top_ids), dtype=torch.int64)
    torch_student = torch.tensor(student, dtype=torch.float64, requires_grad=True)
    theirs = GKDTrainer.generalized_jsd_loss(
        torch.gather(torch_student, -1, ids),
        torch.gather(torch.tensor(teacher, dtype=torch.float64), -1, ids),
        labels=torch.tensor(np.where(mask, 1, -100)),
        beta=beta,
        temperature=temperature,
        reduction="batchmean",  # over the valid tokens: their mean
    )
    theirs.backward()
    np.testing.assert_allclose(float(value), theirs.item(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), torch_student.grad.numpy(), atol=2e-6)
    if top_k == V:  # the whole vocabulary: TRL's full-logit loss itself
        full = GKDTrainer.generalized_jsd_loss(
            torch.tensor(student, dtype=torch.float64),
            torch.tensor(teacher, dtype=torch.float64),
            labels=torch.tensor(np.where(mask, 1, -100)),
            beta=beta,
            temperature=temperature,
        )
        np.testing.assert_allclose(float(value), full.item(), rtol=1e-5, atol=1e-7)
