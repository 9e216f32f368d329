"""Shared data and helpers of the jaxrl_llm.objectives tests.

Numbers are compared with tests/reference/objectives.py, a float64 NumPy transcription of
shared/SPEC_LOSSES.md (values, metrics and the analytic gradient with respect to log-probs).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import objectives
from jaxrl_llm.types import RolloutBatch
from tests.reference import losses as losses_ref
from tests.reference import objectives as ref

B, T, G = 6, 7, 3
# Ragged right-padded completions; row 2 is all-masked, row 1 carries a tiny ratio so that
# GSPO's sequence ratio sits inside its 3e-4 / 4e-4 bounds there.
LENGTHS = (7, 3, 0, 5, 1, 6)
TINY_ROW = 1
ROW_ADVANTAGES = (1.3, -0.7, 0.9, -1.5, 0.4, -0.6)
AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
# Log-ratios where some surrogate used below changes branch: PPO 0.8 / 1.2 / 1.28, dual clip 2
# and 3, CISPO 1 + 4 and 1 + 1, CISPO lower 0.7, GMPO ±0.4, GSPO 1 - 3e-4 / 1 + 4e-4.
RATIO_KINKS = np.concatenate(
    [np.log([0.8, 1.2, 1.28, 2.0, 3.0, 5.0, 0.7, 1 - 3e-4, 1 + 4e-4]), [-0.4, 0.4]]
)
# KL kinks in x = ref - lp: abs at 0, k3's value clamp where exp(x) - x - 1 = 10.
KL_KINKS = np.array([0.0, 2.5277])
RTOL, ATOL = 2e-5, 2e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def mask_of(lengths, width=T) -> np.ndarray:
    """``[len(lengths), width]`` right-padded 0/1 mask."""
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def push_away(x: np.ndarray, kinks: np.ndarray, gap: float = 0.02) -> np.ndarray:
    # Finite f32 rounding must not flip a branch between the JAX and the float64 computation.
    x = x.copy()
    for _ in range(20):
        close = np.any(np.abs(x[..., None] - kinks) < gap, axis=-1)
        if not close.any():
            return x
        x = np.where(close, x + 2.5 * gap, x)
    raise AssertionError("could not move values away from the kinks")


def policy_data(rng: np.random.Generator, *, lengths=LENGTHS, width=T) -> dict[str, np.ndarray]:
    """A random rollout batch; masked positions hold finite garbage."""
    rows = len(lengths)
    mask = mask_of(lengths, width)
    old = -rng.uniform(0.1, 3.0, (rows, width))
    delta = rng.normal(0.0, 0.5, (rows, width))
    # Ratios far beyond every clip bound, on both sides, for both advantage signs.
    delta[0, 1], delta[0, 4], delta[3, 2], delta[5, 0] = 3.0, -2.5, 2.2, -3.0
    # GSPO's ratio is the row mean: keep the means clear of the kinks as well.
    for _ in range(20):
        delta = push_away(delta, RATIO_KINKS)
        means = np.sum(delta * mask, axis=1) / np.maximum(mask.sum(axis=1), 1.0)
        shift = np.where(mask.any(axis=1), push_away(means, RATIO_KINKS) - means, 0.0)
        if not shift.any():
            break
        delta += shift[:, None]
    else:
        raise AssertionError("could not move the row means away from the kinks")
    if rows > TINY_ROW:
        delta[TINY_ROW] = rng.uniform(-1e-4, 1e-4, width)
    old = old.astype(np.float32)
    logprobs = (old + delta).astype(np.float32)
    x = push_away(rng.normal(0.0, 0.4, (rows, width)), KL_KINKS)
    x[0, 2] = 3.2  # k3 clamped at 10 there
    ref_logprobs = (logprobs + x).astype(np.float32)
    token_adv = rng.normal(0.0, 1.0, (rows, width))
    token_adv[0, 3] = token_adv[4, 0] = 0.0
    token_adv[3, 2] = -abs(token_adv[3, 2]) - 0.5
    return {
        "mask": mask,
        "logprobs": logprobs,
        "old_logprobs": old,
        "ref_logprobs": ref_logprobs,
        "row_advantages": np.resize(np.asarray(ROW_ADVANTAGES, np.float32), rows),
        "token_advantages": token_adv.astype(np.float32),
        "entropy": rng.uniform(0.1, 2.0, (rows, width)).astype(np.float32),
    }


def rollout_batch(data, *, per_token=False, global_norm=False) -> RolloutBatch:
    """``[B]`` or ``[B, T]`` advantages; ``global_norm`` sets the whole-batch normalisers."""
    num_tokens, num_seqs = ref.normalisers(data["mask"]) if global_norm else (None, None)
    return RolloutBatch(
        completion_mask=jnp.asarray(data["mask"]),
        old_logprobs=jnp.asarray(data["old_logprobs"]),
        advantages=jnp.asarray(data["token_advantages" if per_token else "row_advantages"]),
        ref_logprobs=jnp.asarray(data["ref_logprobs"]),
        num_tokens=None if num_tokens is None else jnp.float32(num_tokens),
        num_seqs=None if num_seqs is None else jnp.float32(num_seqs),
    )


# Tokens of the teacher's top-k a distilling objective's JSD loss sees in these tests.
DISTILL_K = 4
# Fixed random log-probs of k tokens (under a larger vocabulary: they sum below 1) for every
# position of a batch of up to 16 x 16: padded variants of a batch see the same values.
_DISTILL_RNG = np.random.default_rng(47)
_DISTILL_TABLES = tuple(
    np.log(_DISTILL_RNG.dirichlet(np.ones(DISTILL_K + 2), (16, 16))[..., :DISTILL_K])
    for _ in range(2)
)


def distill_tables(shape) -> tuple[np.ndarray, np.ndarray]:
    """``(teacher, student)`` top-k log-probs ``[*shape, DISTILL_K]`` float64 (see above)."""
    rows, width = shape
    return tuple(table[:rows, :width] for table in _DISTILL_TABLES)


def distill_inputs(objective, batch: RolloutBatch, shape) -> tuple[RolloutBatch, dict]:
    """The batch and ``policy_loss`` keywords of an objective with a distillation loss
    (``Objective.distill_loss``): a teacher's top-k log-probs in the batch and the student's
    log-probs of the same tokens (``distill_tables``; NaN on the masked positions: they must
    not leak); unchanged for any other objective."""
    if objective.distill.loss is None or batch.teacher_top_logprobs is not None:
        return batch, {}
    mask = (jnp.asarray(batch.completion_mask) > 0)[..., None]  # may be traced (jit tests)
    teacher, student = (
        jnp.where(mask, jnp.asarray(x, jnp.float32), jnp.nan) for x in distill_tables(shape)
    )
    return batch._replace(teacher_top_logprobs=teacher), {"student_top_logprobs": student}


def reference_top_k_jsd(student, teacher, mask, beta: float) -> np.ndarray:
    """GKD's ``JSD_β`` (Eq. 1 of arXiv:2306.13649; TRL's KLs at β = 0 and 1) per position in
    float64, both ``[..., k]`` log-probs renormalised over their k tokens; 0 where masked."""

    def renormalised(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return np.exp(x) / np.exp(x).sum(axis=-1, keepdims=True)

    valid = np.asarray(mask) > 0
    p = renormalised(np.where(valid[..., None], teacher, 0.0))
    q = renormalised(np.where(valid[..., None], student, 0.0))

    def kl(a, b):
        return np.where(a > 0, a * (np.log(a) - np.log(b)), 0.0).sum(-1)

    if beta == 0.0:
        out = kl(p, q)
    elif beta == 1.0:
        out = kl(q, p)
    else:
        m = beta * p + (1 - beta) * q
        out = beta * kl(p, m) + (1 - beta) * kl(q, m)
    return np.where(valid, out, 0.0)


def loss_and_grad(objective, logprobs, batch, entropy):
    """``(loss, metrics, d loss / d logprobs)`` of ``policy_loss`` (a distilling objective
    gets ``distill_inputs``).

    Most tests call it eagerly: each primitive then compiles once per shape and is cached,
    far cheaper than one XLA compile per objective; jit has its dedicated tests.
    """
    batch, extra = distill_inputs(objective, batch, logprobs.shape)

    def loss_fn(lp):
        out = objectives.policy_loss(objective, lp, batch, entropy=entropy, **extra)
        return out.loss, out.metrics

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logprobs)
    return loss, metrics, grad


def reference_loss(cfg, data, *, per_token=False, global_norm=False):
    num_tokens, num_seqs = ref.normalisers(data["mask"]) if global_norm else (None, None)
    return ref.policy_loss(
        cfg,
        data["logprobs"],
        data["old_logprobs"],
        data["token_advantages" if per_token else "row_advantages"],
        data["mask"],
        ref_logprobs=data["ref_logprobs"],
        entropy=data["entropy"],
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )


def assert_matches_reference(objective, cfg, data, **kwargs):
    """``policy_loss`` of ``objective`` against ``ref.policy_loss`` of ``cfg`` (plus, for a
    distilling objective, its JSD term on ``distill_tables`` in float64: the reference knows
    no teacher)."""
    batch = rollout_batch(data, **kwargs)
    loss, metrics, grad = loss_and_grad(
        objective, jnp.asarray(data["logprobs"]), batch, jnp.asarray(data["entropy"])
    )
    want_loss, want_metrics, want_grad = reference_loss(cfg, data, **kwargs)
    if objective.distill.loss is not None:
        mask = data["mask"]
        jsd = reference_top_k_jsd(
            *distill_tables(mask.shape)[::-1], mask, objective.distill.jsd_beta
        )
        num_tokens, num_seqs = ref.normalisers(mask) if kwargs.get("global_norm") else (None, None)
        jsd_loss = losses_ref.aggregate(
            jsd,
            mask,
            objective.aggregation.mode,
            num_tokens,
            num_seqs,
            objective.aggregation.norm_constant,
        )
        want_loss = want_loss + objective.distill.coef * jsd_loss
        want_metrics = {
            **want_metrics,
            "loss": want_loss,
            "distill/jsd_loss": jsd_loss,
            "distill/jsd": losses_ref.aggregate(jsd, mask, "token-mean", num_tokens),
        }
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL, atol=ATOL)
    missing = sorted(set(want_metrics) - set(metrics))
    assert not missing, f"metrics {missing} not reported"
    for key, want in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), want, rtol=RTOL, atol=ATOL, err_msg=key)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def embed(values, fill: float) -> jax.Array:
    """A small hand case in the corner of a ``[B, T]`` (or ``[B]``) array of masked garbage.

    Every test shares the ``[B, T]`` shape so that eager primitives compile once.
    """
    values = np.asarray(values, np.float32)
    out = np.full((B, T)[: values.ndim], fill, np.float32)
    out[tuple(slice(0, n) for n in values.shape)] = values
    return jnp.asarray(out)


def hand_case(objective, logprobs, deltas, mask, advantages):
    """Loss, metrics and gradient of a hand case; the rest of the batch is masked garbage."""
    lp = embed(logprobs, -0.5)
    batch = RolloutBatch(
        completion_mask=embed(mask, 0.0),
        old_logprobs=lp - embed(deltas, 2.5),
        advantages=embed(advantages, 4.0),
    )
    loss, metrics, grad = loss_and_grad(objective, lp, batch, None)
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def single_token(objective, delta, advantage, *, lp=-1.0):
    """Loss, metrics and gradient of one valid token with log-ratio ``delta``."""
    loss, metrics, grad = hand_case(objective, [[lp]], [[delta]], [[1.0]], [advantage])
    assert not np.any(grad[1:]) and not np.any(grad[:, 1:])
    return loss, metrics, float(grad[0, 0])


def rollout_data(rng, lengths=LENGTHS):
    """Rewards and the optional arrays of a rollout batch of groups of ``G``."""
    mask = mask_of(lengths)
    return {
        "mask": mask,
        # Group 0 has distinct rewards; group 1 ties two rows.
        "rewards": np.asarray([1.0, 0.0, 0.5, 2.0, 2.0, -1.0], np.float32),
        "old": (-rng.uniform(0.1, 3.0, mask.shape)).astype(np.float32),
        "ref": (-rng.uniform(0.1, 3.0, mask.shape)).astype(np.float32),
        "values": rng.normal(0.0, 1.0, mask.shape).astype(np.float32),
        "process": rng.normal(0.0, 0.1, mask.shape).astype(np.float32),
        "baseline": np.asarray([0.5, 0.5, 0.5, 1.0, 1.0, 1.0], np.float32),
    }


def compute(objective, roll, **kwargs):
    """``compute_advantages`` on ``roll`` with every optional array given (``kwargs`` win)."""
    defaults = {
        "old_logprobs": roll["old"],
        "ref_logprobs": roll["ref"],
        "values": roll["values"],
        "baseline_rewards": roll["baseline"],
        "process_rewards": roll["process"],
    }
    return objectives.compute_advantages(
        objective, roll["rewards"], roll["mask"], group_size=G, **{**defaults, **kwargs}
    )
