"""Registries of importance ratios and policy surrogates, open to user entries.

A surrogate is registered as a function ``fn(surrogate, inputs) -> (loss, metrics)``:

- ``surrogate``: its own piece, a :class:`~jaxrl_llm.objectives.pieces.Surrogate` (name,
  bounds, and a user surrogate's declared ``params``);
- ``inputs``: a :class:`SurrogateInputs` (log-ratio, log-probs, advantages, mask, global
  normalisers, and the objective's aggregation as :meth:`SurrogateInputs.aggregate`);
- ``loss``: either a per-token ``[B, T]`` loss to minimise, which :func:`policy_loss`
  aggregates with the objective's mode, or an already reduced scalar (as GMPO's mean of a
  per-sequence loss over non-empty rows);
- ``metrics``: ``{name: scalar}``, normalised with the global counts (use
  :meth:`SurrogateInputs.token_mean`) so that micro-batch metrics sum to the full-batch one.

A ratio is registered as ``fn(ratio, logprobs, old_logprobs, mask) -> log_ratio [B, T]``,
``ratio`` its :class:`~jaxrl_llm.objectives.pieces.Ratio` piece.

The built-ins adapt :mod:`jaxrl_llm.losses.surrogates` and :mod:`jaxrl_llm.losses.ratios`, whose
docstrings carry the formulas and papers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.losses import aggregation, masked, ratios, surrogates
from jaxrl_llm.objectives.pieces import Ratio, Surrogate, check_params_type
from jaxrl_llm.objectives.registry import Registry, check_registration

Array = jax.Array


class SurrogateInputs(NamedTuple):
    """Everything a surrogate may need, from one (micro-)batch; all float32.

    Attributes:
      log_ratio: ``[B, T]`` log importance ratio of the objective's ratio kind.
      logprobs: ``[B, T]`` current policy log-probs (carry the gradient).
      old_logprobs: ``[B, T]`` behaviour log-probs (stop-gradient).
      advantages: ``[B]`` or ``[B, T]`` advantages (stop-gradient).
      mask: ``[B, T]`` 0/1 completion mask.
      num_tokens: scalar, valid tokens of the whole batch (global normaliser).
      num_seqs: scalar, non-empty rows of the whole batch (global normaliser).
      aggregation: the objective's aggregation mode.
      norm_constant: the objective's ``seq-mean-token-sum-norm`` constant.
    """

    log_ratio: Array
    logprobs: Array
    old_logprobs: Array
    advantages: Array
    mask: Array
    num_tokens: Array
    num_seqs: Array
    aggregation: str
    norm_constant: float | None

    def aggregate(self, values: Array) -> Array:
        """``[B, T]`` -> scalar with the objective's mode and the global normalisers."""
        return aggregation.aggregate(
            values,
            self.mask,
            self.aggregation,
            num_tokens=self.num_tokens,
            num_seqs=self.num_seqs,
            norm_constant=self.norm_constant,
        )

    def token_mean(self, values: Array) -> Array:
        """``Σ v·m / max(N_tok, 1)``: the normaliser of additive metrics."""
        return masked.token_mean(values, self.mask, self.num_tokens)

    def sequence_mean(self, seq_values: Array) -> Array:
        """``[B]`` -> mean over non-empty rows with the global ``N_seq``."""
        return aggregation.sequence_mean(seq_values, self.mask, num_seqs=self.num_seqs)


SurrogateFn = Callable[[Surrogate, SurrogateInputs], tuple[Array, Mapping[str, Array]]]
RatioFn = Callable[[Ratio, Array, Array, Array], Array]


class SurrogateSpec(NamedTuple):
    """A registered surrogate.

    Attributes:
      fn: ``fn(surrogate, inputs) -> (loss [B, T] or scalar, metrics)``.
      needs_old_logprobs: whether the behaviour log-probs enter the loss.
      ratios: ratio kinds it accepts (``None``: any registered ratio).
      clip_low_optional: whether ``clip_low=None`` (no lower bound) is meaningful for it.
      params: the frozen dataclass of its own hyper-parameters (``surrogate.params``), or
        ``None`` when it takes none beyond the piece's fields.
    """

    fn: SurrogateFn
    needs_old_logprobs: bool = True
    ratios: tuple[str, ...] | None = None
    clip_low_optional: bool = False
    params: type | None = None


_SURROGATES: Registry[SurrogateSpec] = Registry("surrogate")
_RATIOS: Registry[RatioFn] = Registry("ratio")
# Live read-only views: name -> SurrogateSpec / ratio function.
SURROGATES: Mapping[str, SurrogateSpec] = _SURROGATES.view
RATIOS: Mapping[str, RatioFn] = _RATIOS.view


def register_surrogate(
    name: str,
    fn: SurrogateFn | None = None,
    *,
    override: bool = False,
    needs_old_logprobs: bool = True,
    ratios: tuple[str, ...] | None = None,
    clip_low_optional: bool = False,
    params: type | None = None,
) -> Any:
    """Registers a policy surrogate under ``name``; usable as a decorator or a plain call.

    ``@register_surrogate("mine", params=MineParams)`` above ``def mine(surrogate, inputs):
    ...`` (reading ``surrogate.params.alpha``), or ``register_surrogate("mine", mine)``; then
    ``make("grpo", surrogate="mine", surrogate_params={"alpha": 0.5})``.

    Args:
      name: the value of ``Objective.surrogate.name`` that selects it.
      fn: ``fn(surrogate: Surrogate, inputs: SurrogateInputs) -> (loss, metrics)``, ``loss`` a
        ``[B, T]``
        per-token loss (aggregated by the objective's mode) or a scalar; ``None`` returns a
        decorator.
      override: replace an already registered name (built-ins included).
      needs_old_logprobs: whether the loss uses the behaviour log-probs.
      ratios: the ratio kinds it accepts (``None``: any).
      clip_low_optional: whether ``clip_low=None`` is valid with it.
      params: a frozen dataclass type of its own hyper-parameters (defaults for every field);
        the objective converts ``surrogate_params`` to it.

    Returns:
      ``fn`` unchanged (or a decorator when ``fn`` is None).

    Raises:
      ValueError: ``name`` is taken and ``override`` is False, ``fn`` is not callable, or
        ``params`` is not a frozen dataclass type.
    """
    check_registration("surrogate", name, fn)
    check_params_type("surrogate", params)
    if fn is None:
        return functools.partial(
            register_surrogate,
            name,
            override=override,
            needs_old_logprobs=needs_old_logprobs,
            ratios=ratios,
            clip_low_optional=clip_low_optional,
            params=params,
        )
    if ratios is not None:
        ratios = tuple(ratios)
    spec = SurrogateSpec(fn, bool(needs_old_logprobs), ratios, bool(clip_low_optional), params)
    _SURROGATES.add(name, spec, override=override)
    return fn


def register_ratio(name: str, fn: RatioFn | None = None, *, override: bool = False) -> Any:
    """Registers an importance-ratio kind ``fn(ratio, lp, old_lp, mask) -> log_ratio``.

    Used as :func:`register_surrogate`; selected by ``Objective.ratio.kind``.
    """
    check_registration("ratio", name, fn)
    if fn is None:
        return functools.partial(register_ratio, name, override=override)
    _RATIOS.add(name, fn, override=override)
    return fn


def unregister_surrogate(name: str) -> None:
    """Removes a user surrogate (built-ins cannot be removed)."""
    _SURROGATES.remove(name)


def unregister_ratio(name: str) -> None:
    """Removes a user ratio kind (built-ins cannot be removed)."""
    _RATIOS.remove(name)


def surrogates_available() -> tuple[str, ...]:
    """Registered surrogate names, built-ins first."""
    return _SURROGATES.names()


def ratios_available() -> tuple[str, ...]:
    """Registered ratio kinds, built-ins first."""
    return _RATIOS.names()


def surrogate_spec(name: str) -> SurrogateSpec:
    """The registered :class:`SurrogateSpec` of ``name`` (ValueError listing the names)."""
    return _SURROGATES.get(name)


def ratio_fn(name: str) -> RatioFn:
    """The registered ratio function of ``name`` (ValueError listing the names)."""
    return _RATIOS.get(name)


# ------------------------------------------------------------------------------------------
# Built-ins
# ------------------------------------------------------------------------------------------


@register_ratio("token")
def _token_ratio(ratio: Ratio, logprobs: Array, old_logprobs: Array, mask: Array):
    """PPO's per-token ``clip(lp − old, −clamp, clamp)``."""
    del mask
    return ratios.token_log_ratio(logprobs, old_logprobs, clamp=ratio.clamp)


@register_ratio("gspo_token")
def _gspo_token_ratio(ratio: Ratio, logprobs: Array, old_logprobs: Array, mask: Array):
    """GSPO-token's length-normalised sequence ratio with per-token gradient (Zheng et al.)."""
    return ratios.gspo_token_log_ratio(
        logprobs, old_logprobs, mask, max_log_ratio=ratio.max_log_ratio
    )


@register_surrogate("ppo_clip")
def _ppo_clip(surrogate: Surrogate, inputs: SurrogateInputs):
    """``max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``, dual clip for ``A < 0`` (PPO, DAPO)."""
    bounds = {
        "clip_low": surrogate.clip_low,
        "clip_high": surrogate.clip_high,
        "dual_clip": surrogate.dual_clip,
    }
    per_token = surrogates.ppo_clip(inputs.log_ratio, inputs.advantages, **bounds)
    indicators = surrogates.ppo_clip_metrics(inputs.log_ratio, inputs.advantages, **bounds)
    return per_token, {
        "clip_frac": inputs.token_mean(indicators["clipped"]),
        "clip_frac_lower": inputs.token_mean(indicators["clipped_lower"]),
    }


@register_surrogate("cispo", clip_low_optional=True)
def _cispo(surrogate: Surrogate, inputs: SurrogateInputs):
    """``−sg(clip(r, 1 − ε_low, 1 + ε_high))·A·lp`` (MiniMax-M1's CISPO)."""
    bounds = {"clip_low": surrogate.clip_low, "clip_high": surrogate.clip_high}
    per_token = surrogates.cispo(inputs.log_ratio, inputs.logprobs, inputs.advantages, **bounds)
    indicators = surrogates.cispo_metrics(inputs.log_ratio, **bounds)
    return per_token, {"clip_frac": inputs.token_mean(indicators["clipped"])}


@register_surrogate("sapo")
def _sapo(surrogate: Surrogate, inputs: SurrogateInputs):
    """``−σ(τ·(r − 1))·(4/τ)·A``, ``τ = τ_pos`` if ``A > 0`` else ``τ_neg`` (SAPO)."""
    per_token = surrogates.sapo(
        inputs.log_ratio, inputs.advantages, tau_pos=surrogate.tau_pos, tau_neg=surrogate.tau_neg
    )
    return per_token, {}


@register_surrogate("gmpo", ratios=("token",))
def _gmpo(surrogate: Surrogate, inputs: SurrogateInputs):
    """``mean_i(−Ā_i·ρ_i)`` over non-empty rows, ``ρ_i`` a clipped geometric mean (GMPO).

    Already per sequence, so it is reduced here whatever the aggregation mode (which then
    applies to the KL and entropy terms only).
    """
    bounds = {"clip_low": surrogate.clip_low, "clip_high": surrogate.clip_high}
    per_seq = surrogates.gmpo(inputs.log_ratio, inputs.advantages, inputs.mask, **bounds)
    indicators = surrogates.gmpo_metrics(inputs.log_ratio, inputs.advantages, inputs.mask, **bounds)
    return inputs.sequence_mean(per_seq), {"clip_frac": inputs.token_mean(indicators["clipped"])}


@register_surrogate("reinforce", needs_old_logprobs=False, ratios=("token",))
def _reinforce(surrogate: Surrogate, inputs: SurrogateInputs):
    """``−A·lp``: vanilla policy gradient, no ratio, no clip (GPG)."""
    del surrogate
    return surrogates.reinforce(inputs.logprobs, inputs.advantages), {}


def _no_dual_clip(surrogate: Surrogate, instead: str) -> None:
    if surrogate.dual_clip is not None:
        raise ValueError(
            f"surrogate {surrogate.name!r} has no dual clip (dual_clip="
            f"{surrogate.dual_clip!r}); set dual_clip=None{instead}"
        )


def _dppo(divergence: str) -> SurrogateFn:
    def fn(surrogate: Surrogate, inputs: SurrogateInputs):
        _no_dual_clip(surrogate, " (its IS weight is capped by ratio_cap)")
        kw = {
            "divergence": divergence,
            "delta_low": surrogate.clip_low,
            "delta_high": surrogate.clip_high,
            "ratio_cap": surrogate.ratio_cap,
        }
        args = (inputs.log_ratio, inputs.logprobs, inputs.old_logprobs, inputs.advantages)
        indicators = surrogates.dppo_metrics(*args, **kw)
        return surrogates.dppo(*args, **kw), {
            "clip_frac": inputs.token_mean(indicators["clipped"]),
            "clip_frac_lower": inputs.token_mean(indicators["clipped_lower"]),
        }

    fn.__doc__ = (
        f"``−A·sg(min(r, C))·lp`` inside DPPO's binary-{divergence.upper()} trust region "
        "(bounds clip_low / clip_high), 0 outside."
    )
    return fn


register_surrogate("dppo_tv", _dppo("tv"), ratios=("token",))
register_surrogate("dppo_kl", _dppo("kl"), ratios=("token",))


@register_surrogate("kl_cov", ratios=("token",))
def _kl_cov(surrogate: Surrogate, inputs: SurrogateInputs):
    """``−A·r + β·|log r|`` on the highest-covariance tokens, ``−A·r`` elsewhere (KL-Cov)."""
    kw = {"fraction": surrogate.cov_fraction}
    args = (inputs.logprobs, inputs.advantages, inputs.mask)
    per_token = surrogates.kl_cov(inputs.log_ratio, *args, coef=surrogate.kl_cov_coef, **kw)
    return per_token, {"cov_frac": inputs.token_mean(surrogates.kl_cov_selection(*args, **kw))}


def _data_key(inputs: SurrogateInputs) -> Array:
    """A key drawn from the batch itself: the draw is a pure function of the data."""
    bits = jax.lax.bitcast_convert_type(inputs.old_logprobs, jnp.uint32)
    seed = jnp.sum(jnp.where(inputs.mask > 0, bits, jnp.uint32(0)), dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(0), seed)


@register_surrogate("clip_cov", ratios=("token",))
def _clip_cov(surrogate: Surrogate, inputs: SurrogateInputs):
    """PPO's clipped surrogate with a random few tokens of high covariance left out (Clip-Cov).

    The draw's key is derived from the batch's old log-probs, so a step is a pure function of
    its data and repeats exactly.
    """
    _no_dual_clip(surrogate, "")
    kw = {
        "key": _data_key(inputs),
        "fraction": surrogate.cov_fraction,
        "cov_low": surrogate.cov_bounds[0],
        "cov_high": surrogate.cov_bounds[1],
        "clip_low": surrogate.clip_low,
        "clip_high": surrogate.clip_high,
    }
    args = (inputs.log_ratio, inputs.logprobs, inputs.advantages, inputs.mask)
    selected = surrogates.clip_cov_selection(*args, **kw)
    clipped = surrogates.ppo_clip_metrics(
        inputs.log_ratio,
        inputs.advantages,
        clip_low=surrogate.clip_low,
        clip_high=surrogate.clip_high,
    )["clipped"]
    return surrogates.clip_cov(*args, **kw), {
        "clip_frac": inputs.token_mean(clipped),
        "cov_frac": inputs.token_mean(selected),
    }


_SURROGATES.mark_builtins()
_RATIOS.mark_builtins()
