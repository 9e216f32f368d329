"""The loss layer: pure, jit-able functions over ``[B, T]`` / ``[B]`` arrays.

Every function here is a formula with its paper in the docstring: shaped arguments in, an
unreduced ``[B, T]`` (or ``[B]``) array or a scalar out, float32 math whatever the input dtype,
no model, config or state. :mod:`jaxrl_llm.objectives` composes them into a trainable policy
objective (presets, registries, ``policy_loss``); a researcher can use any piece alone::

    from jaxrl_llm.losses import advantages, aggregation, kl, ratios, surrogates

    adv = advantages.grpo(rewards, group_size=8)
    log_ratio = ratios.token_log_ratio(logprobs, old_logprobs)
    per_token = surrogates.ppo_clip(log_ratio, adv, clip_low=0.2, clip_high=0.28)
    loss = aggregation.aggregate(per_token, mask, "token-mean")

Modules (each one concept):

- :mod:`.advantages` — advantage estimators (GRPO, RLOO, REINFORCE++, GAE, OPO, ...);
- :mod:`.ratios` — token and sequence (GSPO) importance ratios, in log space;
- :mod:`.surrogates` — policy-gradient surrogates (PPO clip, dual clip, CISPO, GMPO, SAPO,
  DPPO, clip-/KL-Cov, ...);
- :mod:`.kl` — per-token KL estimators (k1, k2, k3, abs);
- :mod:`.aggregation` — how a per-token loss becomes the scalar (token-mean, seq-mean-*, ...);
- :mod:`.correction` — rollout correction (IS weights and rejection of the sampler/trainer
  mismatch);
- :mod:`.token_selection` — which tokens a loss trains on (top entropy, off-policy sequence
  mask, M2PO);
- :mod:`.distillation` — divergences to a teacher's next-token distribution (GKD's JSD);
- :mod:`.value` — the critic's clipped value loss;
- :mod:`.implicit_prm` — PRIME's implicit process rewards and the PRM's loss;
- :mod:`.masked` — the masked reductions all of them share.

The same modules are importable from the package root as they always were
(``from jaxrl_llm import advantages, kl, surrogates``).
"""

from jaxrl_llm.losses import (
    advantages,
    aggregation,
    correction,
    distillation,
    implicit_prm,
    kl,
    masked,
    ratios,
    surrogates,
    token_selection,
    value,
)

__all__ = [
    "advantages",
    "aggregation",
    "correction",
    "distillation",
    "implicit_prm",
    "kl",
    "masked",
    "ratios",
    "surrogates",
    "token_selection",
    "value",
]
