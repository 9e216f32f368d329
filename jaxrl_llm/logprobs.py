"""Per-token log-probs and entropies without materialising ``[B, T, V]`` logits.

The unembedding, ``log_softmax`` and target gather run over chunks of the sequence inside a
``lax.scan`` whose body is rematerialised (``jax.checkpoint``): the forward pass holds one
``[B, C, V]`` chunk of logits at a time and the backward pass recomputes each chunk instead
of storing it, so memory is ``O(B * C * V)`` rather than ``O(B * T * V)``. A single chunk is
not rematerialised (it would hold the same logits while costing another unembedding product).

``packed_completion_logprobs`` gives the same log-probs from packed rows (several sequences
per row, ``jaxrl_llm.packing``): the model and the unembedding run over the packed rows only,
and the results are scattered back to the padded ``[B, T]`` layout.

``routed_completion_logprobs`` gives either's log-probs together with the mixture-of-experts
router logits of the same forward (and the mask of the real tokens they cover), from which the
policy update adds the router losses (``jaxrl_llm.models.moe``) without a second forward.

The three take the same keyword options, ``LogprobOptions`` (temperature, chunk size, entropy,
remat, prompt log-probs, dropout key, and for distillation a teacher's top-k tokens or the ids
to gather a student's log-probs at), and run the same forward (padded or packed). With the
distillation options they return a ``LogprobOutputs`` (the ``[B, T, k]`` arrays beside the
``[B, T]`` log-probs), each chunk of logits reduced to ``k`` values a position before the next.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_llm._checks import check_positive, check_rank, check_same_shape
from jaxrl_llm.models import (
    ModelConfig,
    cast_params,
    context_parallel,
    forward,
    unembed,
    unembedding,
)
from jaxrl_llm.models.attention import softcap
from jaxrl_llm.models.layers import constrain
from jaxrl_llm.packing import PackingPlan, pack, unpack
from jaxrl_llm.parallel import vocab as vocab_parallel
from jaxrl_llm.parallel.rules import ACTIVATION_RULES, mesh_axes_of
from jaxrl_llm.parallel.vocab import vocab_parallel_axis
from jaxrl_llm.types import Sequences, join_sequences

Array = jax.Array

# Default chunk: the largest power of two C <= T with B * C * V <= this many f32 logits per
# device (128 MiB), but at least MIN_CHUNK tokens so the scan does not degenerate into T steps.
CHUNK_ELEMENTS = 2**25
MIN_CHUNK = 8


def default_chunk_size(batch: int, length: int, vocab: int) -> int:
    """``C = min(T, max(MIN_CHUNK, 2^floor(log2(CHUNK_ELEMENTS / (B V)))))``.

    ``batch`` and ``vocab`` are what one device holds (see ``per_device_sizes``).
    """
    budget = max(1, CHUNK_ELEMENTS // max(batch * vocab, 1))
    chunk = max(MIN_CHUNK, 1 << (budget.bit_length() - 1))
    return max(1, min(length, chunk))


def per_device_sizes(batch: int, vocab: int) -> tuple[int, int]:
    """``(rows, vocab)`` of one device's logits under ``ACTIVATION_RULES`` on the context mesh
    (``jax.set_mesh`` / the trainers' steps): rows split over the batch axes, the vocabulary
    over the tensor axis. Without a mesh, the global sizes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return batch, vocab
    shape = dict(mesh.shape)

    def shards(name: str) -> int:
        return math.prod(shape.get(a, 1) for a in mesh_axes_of(ACTIVATION_RULES[name]))

    return -(-batch // shards("batch")), -(-vocab // shards("vocab"))


class LogprobOutputs(NamedTuple):
    """Everything one chunked log-prob pass can return (``[B, T]`` positions; None: not asked).

    Attributes:
      logprobs: ``[B, T]`` f32 ``log softmax(z_t / tau)[y_t]`` of each target token.
      entropy: ``[B, T]`` f32 entropy of ``softmax(z_t / tau)`` (``return_entropy``).
      top_logprobs: ``[B, T, k]`` f32, the ``k`` largest ``log softmax(z_t / tau)`` values of
        each position in decreasing order (``top_k``: a teacher's most likely tokens).
      top_ids: ``[B, T, k]`` int32, their token ids.
      gathered: ``[B, T, k]`` f32 ``log softmax(z_t / tau)`` at the ``gather_ids`` (a student's
        log-probs of a teacher's top-k tokens; differentiable).

    Masked positions hold exactly 0 in every field (ids included).
    """

    logprobs: Array
    entropy: Array | None = None
    top_logprobs: Array | None = None
    top_ids: Array | None = None
    gathered: Array | None = None


def token_logprobs_from_hidden(
    hidden: Array,
    unembed_fn: Callable[[Array], Array],
    targets: Array,
    *,
    mask: Array | None = None,
    temperature: float | Array = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    top_k: int | None = None,
    gather_ids: Array | None = None,
) -> Array | tuple[Array, Array] | LogprobOutputs:
    """Log-prob of each target token (and the entropy) from the hidden state predicting it.

    ``z_t = unembed(h_t) / tau``; ``logp_t = z_t[y_t] - logsumexp(z_t)``;
    ``H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v``. Masked positions give exactly 0
    (value and gradient). Computed over chunks of ``chunk_size`` positions (padding T up to a
    multiple), with the chunk body rematerialised when there is more than one chunk, so
    ``[B, T, V]`` never exists: with ``top_k`` each chunk's ``log softmax(z_t)`` is reduced to
    its ``k`` largest values and their ids (``lax.top_k``), with ``gather_ids`` to its values
    at ``k`` given ids, before the next chunk.

    Args:
      hidden: ``[B, T, D]`` states; ``hidden[:, t]`` predicts ``targets[:, t]``.
      unembed_fn: maps ``[B, C, D]`` to f32 logits ``[B, C, V]`` (e.g.
        ``functools.partial(jaxrl_llm.models.unembed, params, config)``); may close over
        parameters: gradients flow to them.
      targets: ``[B, T]`` int token ids.
      mask: ``[B, T]`` bool/0-1, 1 on positions to score (default all).
      temperature: ``tau > 0`` (Python float or traced scalar).
      chunk_size: positions per chunk; None picks ``default_chunk_size``.
      return_entropy: also return the per-token entropy of ``softmax(z_t)``.
      top_k: also return the ``k`` (a static int in ``[1, V]``) most likely tokens' log-probs
        and ids at each position (``LogprobOutputs.top_logprobs`` / ``top_ids``).
      gather_ids: ``[B, T, k]`` int token ids in ``[0, V)``: also return the log-probs of these
        tokens at each position (``LogprobOutputs.gathered``).

    Returns:
      ``logprobs [B, T]`` f32, or ``(logprobs, entropy)`` both ``[B, T]`` f32; with ``top_k``
      or ``gather_ids``, a ``LogprobOutputs``.
    """
    out = _token_outputs(
        hidden,
        unembed_fn,
        targets,
        mask=mask,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        top_k=top_k,
        gather_ids=gather_ids,
    )
    if top_k is not None or gather_ids is not None:
        return out
    return (out.logprobs, out.entropy) if return_entropy else out.logprobs


def _token_outputs(
    hidden: Array,
    unembed_fn: Callable[[Array], Array],
    targets: Array,
    *,
    mask: Array | None,
    temperature: float | Array,
    chunk_size: int | None,
    return_entropy: bool,
    top_k: int | None = None,
    gather_ids: Array | None = None,
    table: VocabTable | None = None,
) -> LogprobOutputs:
    """``token_logprobs_from_hidden``'s values, every one asked for, as a ``LogprobOutputs``;
    with ``table`` (and neither ``top_k`` nor ``gather_ids``) over the unembedding split by
    vocabulary over fsdp (``_vocab_parallel_scan``) instead of ``unembed_fn``'s gathered one."""
    check_rank("hidden", hidden, 3)
    check_rank("targets", targets, 2)
    batch, length = targets.shape
    if hidden.shape[:2] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [B, T, D] with [B, T]={targets.shape} of targets"
        )
    if mask is None:
        mask = jnp.ones(targets.shape, bool)
    check_same_shape(targets=targets, mask=mask)
    if not isinstance(temperature, jax.Array):
        check_positive("temperature", temperature)
    vocab = None
    if chunk_size is None or top_k is not None:
        vocab = jax.eval_shape(unembed_fn, hidden[:, :1]).shape[-1]
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab
    ):
        raise ValueError(f"top_k must be an int in [1, {vocab}] (the vocabulary), got {top_k!r}")
    if gather_ids is not None:
        check_rank("gather_ids", gather_ids, 3)
        if gather_ids.shape[:2] != targets.shape:
            raise ValueError(
                f"gather_ids {tuple(gather_ids.shape)} must be [B, T, k] with [B, T]="
                f"{targets.shape} of targets"
            )
        if not jnp.issubdtype(gather_ids.dtype, jnp.integer):
            raise ValueError(f"gather_ids must hold integer token ids, got {gather_ids.dtype}")
    if chunk_size is None:
        rows, local_vocab = per_device_sizes(batch, vocab)
        chunk_size = default_chunk_size(rows, length, local_vocab)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length

    def to_chunks(x: Array | None) -> Array | None:
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(batch, chunks, chunk_size, *x.shape[2:]), 0, 1)

    inv_temperature = 1.0 / jnp.asarray(temperature, jnp.float32)
    body = functools.partial(_chunk, unembed_fn, inv_temperature, return_entropy, top_k)
    if chunks > 1:  # one chunk holds its logits either way: recomputing them would only cost
        body = jax.checkpoint(body, prevent_cse=False)
    ids = None if gather_ids is None else gather_ids.astype(jnp.int32)
    xs = (to_chunks(hidden), to_chunks(targets), to_chunks(mask.astype(bool)), to_chunks(ids))
    if table is not None and top_k is None and gather_ids is None:
        out = _vocab_parallel_scan(table, inv_temperature, return_entropy, chunks > 1, *xs[:3])
    else:
        _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, xs)

    def from_chunks(x: Array | None) -> Array | None:
        if x is None:
            return None
        x = jnp.swapaxes(x, 0, 1)
        return x.reshape(batch, chunks * chunk_size, *x.shape[3:])[:, :length]

    return LogprobOutputs(*(from_chunks(x) for x in out))


class VocabTable(NamedTuple):
    """The unembedding in its stored layout for ``_vocab_parallel_scan``: ``weight`` (cast to
    the compute dtype) is ``E [V, D]`` (``vocab_dim`` 0, tied) or ``W_U [D, V]`` (1)."""

    weight: Array
    vocab_dim: int
    config: ModelConfig


def vocab_table(params: Any, config: ModelConfig, rows: int) -> VocabTable | None:
    """The unembedding to split by vocabulary over fsdp for ``rows`` batch rows, or None
    where the context mesh does not (``parallel.vocab.vocab_parallel_axis``)."""
    if vocab_parallel_axis(config.vocab_size, config.hidden_size, rows) is None:
        return None
    name = "embed" if config.tie_word_embeddings else "lm_head"
    weight = cast_params({name: params[name]}, config)[name]
    return VocabTable(weight, 0 if config.tie_word_embeddings else 1, config)


def _vocab_parallel_scan(
    table: VocabTable,
    inv_temperature: Array,
    return_entropy: bool,
    remat: bool,
    hidden: Array,
    targets: Array,
    mask: Array,
) -> LogprobOutputs:
    """``_chunk`` over ``[n, B, C, ...]`` chunks with ``W_U`` split by vocabulary over fsdp.

    Per chunk, on device ``j`` of the fsdp group (rows ``B_f``, vocabulary ids
    ``o_j .. o_j + V / f``): ``h = all_gather(h)``, ``z_j = unembed(h; W_j) / tau``
    ``[B_f, C, V / f]``, ``m = pmax(max z_j)``, ``lse = m + log psum(sum exp(z_j - m))``,
    ``z[y] = psum([y in j] z_j[y - o_j])``, entropy ``lse - psum(sum p_j z_j)``; each device
    keeps its own ``B_f / f`` rows of these. ``W_j`` comes
    from the stored shard by one all-to-all (``to_vocab_shard``), so ``dW_j`` stays local;
    ``dh`` is reduce-scattered (the transpose of the gather). Returns ``[n, B, C]`` values.
    """
    axis = vocab_parallel.AXIS

    def local(weight, inv_temperature, hidden, targets, mask):
        w = vocab_parallel.to_vocab_shard(weight, table.vocab_dim)
        w = w.T if table.vocab_dim == 0 else w  # [D, V / f]
        offset = vocab_parallel.vocab_offset(w.shape[1])
        # Typed as varying over the other batch axes already, so that ``dW_j`` is summed over
        # them once after the loop over chunks, not once a chunk.
        others = tuple(a for a in vocab_parallel.batch_axes() if a != axis)
        w = jax.lax.pcast(w, others, to="varying") if others else w

        def body(h, y, m):
            h, y, m = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (h, y, m))
            # A plain product (not ``models.matmul.dense``, whose CPU backward is a custom VJP
            # that does not track shard_map's per-axis variance).
            z = jnp.tensordot(h, w, 1, preferred_element_type=jnp.float32)
            z = softcap(z, table.config.final_logit_softcapping) * inv_temperature
            top = jax.lax.stop_gradient(jnp.max(z, axis=-1))
            top = jax.lax.stop_gradient(jax.lax.pmax(top, axis))
            lse = top + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(z - top[..., None]), -1), axis))
            ids = y.astype(jnp.int32) - offset
            owned = (ids >= 0) & (ids < w.shape[1])
            picked = jnp.take_along_axis(z, jnp.where(owned, ids, 0)[..., None], axis=-1)[..., 0]
            target = jax.lax.psum(jnp.where(owned, picked, 0.0), axis)
            out = (jnp.where(m, target - lse, 0.0),)
            if return_entropy:
                expected = jax.lax.psum(jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1), axis)
                out = (*out, jnp.where(m, lse - expected, 0.0))
            # Every device of the group holds all B_f rows' values; each keeps its own B_f / f.
            rows = hidden.shape[1]
            start = jax.lax.axis_index(axis) * rows
            return tuple(jax.lax.dynamic_slice_in_dim(x, start, rows, axis=0) for x in out)

        if remat:
            body = jax.checkpoint(body, prevent_cse=False)
        _, out = jax.lax.scan(lambda carry, x: (carry, body(*x)), None, (hidden, targets, mask))
        return out

    rows = vocab_parallel.batch_axes() or None
    stored = P(None, axis) if table.vocab_dim == 0 else P(axis, None)
    with jax.named_scope(vocab_parallel.SCOPE):  # names its collectives (``plan`` reads them)
        out = jax.shard_map(
            local,
            in_specs=(
                stored,
                P(),
                P(None, rows, None, None),
                P(None, rows, None),
                P(None, rows, None),
            ),
            out_specs=(P(None, rows, None),) * (2 if return_entropy else 1),
        )(table.weight, inv_temperature, hidden, targets, mask)
    return LogprobOutputs(out[0], out[1] if return_entropy else None, None, None, None)


def _chunk(
    unembed_fn: Callable[[Array], Array],
    inv_temperature: Array,
    return_entropy: bool,
    top_k: int | None,
    hidden: Array,
    targets: Array,
    mask: Array,
    gather_ids: Array | None,
) -> LogprobOutputs:
    """``[B, C, D]`` states -> the ``LogprobOutputs`` of ``C`` positions, 0 where ``mask`` is
    False. Under context parallelism (a ``sequence`` mesh axis that divides ``C``) each of its
    devices computes the logits of ``C / s`` of the positions, not all ``C`` of them."""
    count = context_parallel.shards()
    seq = "sequence" if count > 1 and hidden.shape[1] % count == 0 else None
    hidden = constrain(hidden, "batch", seq, "embed")
    z = constrain(unembed_fn(hidden).astype(jnp.float32), "batch", seq, "vocab")
    z = z * inv_temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    target_logit = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logprobs = jnp.where(mask, target_logit - lse, 0.0)
    entropy = top_logprobs = top_ids = gathered = None
    if return_entropy:
        probs = jnp.exp(z - lse[..., None])
        entropy = jnp.where(mask, lse - jnp.sum(probs * z, axis=-1), 0.0)
    positions = mask[..., None]
    if top_k is not None:
        values, ids = jax.lax.top_k(z, top_k)
        top_logprobs = jnp.where(positions, values - lse[..., None], 0.0)
        top_ids = jnp.where(positions, ids, 0).astype(jnp.int32)
    if gather_ids is not None:
        picked = jnp.take_along_axis(z, gather_ids, axis=-1)
        gathered = jnp.where(positions, picked - lse[..., None], 0.0)
    return LogprobOutputs(logprobs, entropy, top_logprobs, top_ids, gathered)


class LogprobOptions(NamedTuple):
    """The keyword options of ``completion_logprobs``, ``packed_completion_logprobs`` and
    ``routed_completion_logprobs`` (each takes them as keywords: ``**options``).

    Attributes:
      temperature: ``tau > 0`` (Python float or traced scalar): log-probs of
        ``log_softmax(logits / tau)``, as the sampler draws.
      chunk_size: sequence positions per unembedding chunk (packed: packed slots); None:
        ``default_chunk_size``.
      return_entropy: also return the per-token entropy of the scaled distribution.
      remat: the model's remat policy (``models.REMAT_POLICIES``).
      return_prompt_logprobs: also return ``[B, P]`` log-probs of the prompt tokens the model
        predicts (``log pi(x_j | x_<j)``; 0 on padding and on each row's first real token,
        which nothing predicts), from the same forward pass: what an NLL over the whole
        sequence (TRL ORPOTrainer's) needs. Not combined with ``return_entropy``.
      dropout_key: a PRNG key for the model's LoRA dropout (training), or None.
      top_k: also return, at each completion position, the ``k`` most likely tokens'
        log-probs and ids ``[B, T, k]`` (a distillation teacher's; a static int in
        ``[1, V]``).
      gather_ids: ``[B, T, k]`` int token ids: also return the log-probs of these tokens at
        each completion position (a student's of its teacher's top-k; differentiable).
        With ``top_k`` or ``gather_ids`` the result is a ``LogprobOutputs`` (entropy included
        with ``return_entropy``); neither combines with ``return_prompt_logprobs``.
      routing: ``[B, P + T, L, k]`` int expert ids to replay (routing replay, R3), aligned
        with ``join_sequences(prompt, completion)`` as the sampler records them (-1: route
        freely); the forward runs with ``routing[:, s, l]`` as layer ``l``'s experts of
        token ``s`` (``models.forward(routing=...)``; packed: packed like the tokens).
        Mixture-of-experts models only; None: every layer routes by its own top-k.
    """

    temperature: float | Array = 1.0
    chunk_size: int | None = None
    return_entropy: bool = False
    remat: str = "none"
    return_prompt_logprobs: bool = False
    dropout_key: Array | None = None
    top_k: int | None = None
    gather_ids: Array | None = None
    routing: Array | None = None

    @property
    def distills(self) -> bool:
        """Whether a distillation option (``top_k`` / ``gather_ids``) is set: the result is a
        ``LogprobOutputs``."""
        return self.top_k is not None or self.gather_ids is not None


def _options(options: dict[str, Any]) -> LogprobOptions:
    """The ``LogprobOptions`` of a log-prob function's keyword arguments, checked."""
    unknown = sorted(set(options) - set(LogprobOptions._fields))
    if unknown:
        raise TypeError(
            f"unknown log-prob option(s) {unknown}; the options are {list(LogprobOptions._fields)}"
        )
    out = LogprobOptions(**options)
    if out.return_prompt_logprobs and out.return_entropy:
        raise ValueError("return_prompt_logprobs and return_entropy cannot be combined")
    if out.return_prompt_logprobs and out.distills:
        raise ValueError("return_prompt_logprobs cannot be combined with top_k or gather_ids")
    return out


def _result(out: LogprobOutputs, options: LogprobOptions) -> Any:
    """The public form of a completion pass: the ``LogprobOutputs`` itself with a distillation
    option, else ``logprobs`` or ``(logprobs, entropy)``."""
    if options.distills:
        return out
    return (out.logprobs, out.entropy) if options.return_entropy else out.logprobs


def completion_logprobs(
    params: Any,
    config: ModelConfig,
    prompt_tokens: Array,
    prompt_mask: Array,
    completion_tokens: Array,
    completion_mask: Array,
    **options: Any,
) -> Array | tuple[Array, Array]:
    """``log pi(y_t | x, y_<t)`` of each completion token under the temperature-scaled policy.

    The model runs once over ``[prompt ; completion]`` (attention mask ``[prompt_mask ;
    completion_mask]``, positions ``cumsum(mask) - 1``, so left padding shifts nothing); the
    state at column ``P - 1 + t`` predicts completion token ``t``. Log-probs use
    ``log_softmax(logits / temperature)``, as the sampler does, computed chunk by chunk (see
    ``token_logprobs_from_hidden``). Masked completion positions return exactly 0.

    Each row needs at least one real prompt token (e.g. BOS): the last prompt column is what
    predicts the first completion token. Masked completion tokens are also hidden from the
    attention of later tokens (they are padding).

    Args:
      params: model parameters (plain nested dict).
      config: the model's ``ModelConfig``.
      prompt_tokens: ``[B, P]`` int32, left-padded.
      prompt_mask: ``[B, P]``, 1 on real prompt tokens.
      completion_tokens: ``[B, T]`` int32, right-padded.
      completion_mask: ``[B, T]``, 1 on tokens to score.
      **options: ``LogprobOptions`` by keyword (``temperature``, ``chunk_size``,
        ``return_entropy``, ``remat``, ``return_prompt_logprobs``, ``dropout_key``, ``top_k``,
        ``gather_ids``, ``routing``).

    Returns:
      ``logprobs [B, T]`` f32, ``(logprobs, entropy)``, or ``(logprobs, prompt_logprobs)``;
      with ``top_k`` or ``gather_ids``, a ``LogprobOutputs``.
    """
    seqs = Sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    return _routed(params, config, seqs, None, _options(options), router=False).logprobs


def replayed_routing(
    routing: Array | None, shape: tuple[int, ...], plan: PackingPlan | None = None
) -> Array | None:
    """A recorded ``[B, S, L, k]`` routing in ``models.forward``'s ``[L, N, S', k]`` layout:
    ``moveaxis(routing, 2, 0)`` over the padded ``[B, S]`` rows, or with ``plan`` over its
    packed ``[R, W]`` rows (``pack(routing + 1, plan) - 1``: padding slots get -1, free
    routing). None passes through.

    Raises:
      ValueError: ``routing`` not ``[B, S, L, k]`` with ``[B, S]`` = ``shape``.
    """
    if routing is None:
        return None
    check_rank("routing", routing, 4)
    if tuple(routing.shape[:2]) != tuple(shape):
        raise ValueError(
            f"routing {tuple(routing.shape)} must be [B, P + T, L, k] with [B, P + T]="
            f"{tuple(shape)} of the joined prompt and completion"
        )
    routing = jnp.asarray(routing, jnp.int32)
    if plan is not None:
        routing = pack(routing + 1, plan) - 1
    return jnp.moveaxis(routing, 2, 0)


def _padded(
    params: Any, config: ModelConfig, seqs: Sequences, options: LogprobOptions, *, router: bool
) -> tuple[Any, Array | None, Array]:
    """``completion_logprobs``'s output, the router logits ``[L, B, P + T, E]`` of its forward
    (with ``router``; else None) and the real tokens ``[B, P + T]`` bool."""
    prompt_tokens, prompt_mask, completion_tokens, completion_mask = seqs
    tokens, mask = join_sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    prompt_len = prompt_tokens.shape[1]
    temperature, chunk_size = options.temperature, options.chunk_size
    out = forward(
        params,
        config,
        tokens,
        attention_mask=mask,
        remat=options.remat,
        dropout_key=options.dropout_key,
        outputs=("router_logits",) if router else (),
        routing=replayed_routing(options.routing, tokens.shape),
    )
    hidden, router_logits = out[0], (out[2] if router else None)
    length = completion_tokens.shape[1]
    # Gathered (and cast) once here, outside the loop over chunks; on an fsdp-only mesh the
    # table is used split by vocabulary instead (``table``; the gathered one is then unused).
    unembed_fn = functools.partial(unembed, None, config, weight=unembedding(params, config))
    table = vocab_table(params, config, tokens.shape[0])
    if options.return_prompt_logprobs:
        # Column j predicts token j + 1: prompt tokens 1..P-1 (when both they and the token
        # before them are real) and then the completion tokens, in one chunked pass.
        prompt_mask = prompt_mask.astype(bool)
        predicted = jnp.concatenate(
            [prompt_mask[:, 1:] & prompt_mask[:, :-1], completion_mask.astype(bool)], axis=1
        )
        logprobs = _token_outputs(
            hidden[:, : prompt_len - 1 + length],
            unembed_fn,
            tokens[:, 1:],
            mask=predicted,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=False,
            table=table,
        ).logprobs
        prompt_logprobs = jnp.pad(logprobs[:, : prompt_len - 1], [(0, 0), (1, 0)])
        return (logprobs[:, prompt_len - 1 :], prompt_logprobs), router_logits, mask
    hidden = hidden[:, prompt_len - 1 : prompt_len - 1 + length]
    out = _token_outputs(
        hidden,
        unembed_fn,
        completion_tokens,
        mask=completion_mask,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=options.return_entropy,
        top_k=options.top_k,
        gather_ids=options.gather_ids,
        table=table,
    )
    return _result(out, options), router_logits, mask


def packed_completion_logprobs(
    params: Any, config: ModelConfig, seqs: Sequences, plan: PackingPlan, **options: Any
) -> Array | tuple[Array, Array]:
    """``completion_logprobs`` of ``seqs`` computed on packed rows: the same ``[B, T]`` values.

    The ``[B, P + T]`` rows ``[prompt ; completion]`` are packed by ``plan`` into ``[R, W]``
    (``jaxrl_llm.packing.pack``); the model runs once over them with the plan's segment ids and
    positions (attention within a sequence only, positions restarting at 0, as padded). Packed
    slot ``i`` predicts the token at slot ``i + 1`` when both hold the same sequence and that
    token is scored (a completion token with ``completion_mask``; with
    ``return_prompt_logprobs`` also a prompt token): ``z_i = unembed(h_i) / tau``,
    ``logp = z_i[x_{i+1}] - logsumexp(z_i)``, chunk by chunk over the packed rows
    (``token_logprobs_from_hidden``: the unembedding runs over ``R x W`` slots, not ``B x T``).
    Each value is then scattered back to its token's padded place (``unpack``): 0 on padding,
    on unscored tokens and on each sequence's first token.

    Each row needs at least one real prompt token (as for ``completion_logprobs``); the masks
    must be a left-padded prompt and a right-padded completion; ``plan`` must come from
    ``packing.plan_sequences(seqs.prompt_mask, seqs.completion_mask, shards=...)`` (not checked
    under jit: another plan gives wrong values). With a ``dropout_key`` the LoRA dropout masks
    are drawn over the packed layout (random like the padded ones, not the same draws).

    Args:
      params, config: the model.
      seqs: the padded ``Sequences`` (``[B, P]`` left-padded prompts, ``[B, T]`` right-padded
        completions).
      plan: a ``PackingPlan`` for ``[B, P + T]``.
      **options: ``LogprobOptions`` by keyword, as for ``completion_logprobs``
        (``chunk_size`` counts packed slots).

    Returns:
      ``logprobs [B, T]`` f32, ``(logprobs, entropy)``, or ``(logprobs, prompt_logprobs [B, P])``;
      with ``top_k`` or ``gather_ids``, a ``LogprobOutputs`` (its ``[B, T, k]`` fields
      scattered back like the log-probs; ``gather_ids`` are given, and packed, in the padded
      layout).
    """
    if plan is None:
        raise ValueError(
            "packed_completion_logprobs needs a PackingPlan, got None (padded: completion_logprobs)"
        )
    return _routed(params, config, seqs, plan, _options(options), router=False).logprobs


def _packed(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    plan: PackingPlan,
    options: LogprobOptions,
    *,
    router: bool,
) -> tuple[Any, Array | None, Array]:
    """``packed_completion_logprobs``'s output, the router logits ``[L, R, W, E]`` of its
    forward over the packed rows (with ``router``; else None) and their real slots ``[R, W]``
    bool (``segment_ids > 0``)."""
    prompt_tokens, prompt_mask, completion_tokens, completion_mask = seqs
    tokens, _ = join_sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)
    return_entropy, return_prompt_logprobs = options.return_entropy, options.return_prompt_logprobs
    shape = tokens.shape
    prompt_len = prompt_tokens.shape[1]
    scored_prompt = prompt_mask.astype(bool) & return_prompt_logprobs
    scored = jnp.concatenate([scored_prompt, completion_mask.astype(bool)], axis=1)
    packed_tokens = pack(tokens, plan)
    segments, positions = plan.flat("segment_ids"), plan.flat("positions")
    out = forward(
        params,
        config,
        packed_tokens,
        positions=positions,
        segment_ids=segments,
        remat=options.remat,
        dropout_key=options.dropout_key,
        outputs=("router_logits",) if router else (),
        routing=replayed_routing(options.routing, shape, plan),
    )
    hidden, router_logits = out[0], (out[2] if router else None)
    real = segments > 0
    # Slot i predicts slot i + 1 of the same sequence when that token is scored.
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    predicted = same & pack(scored, plan)[:, 1:]
    unembed_fn = functools.partial(unembed, None, config, weight=unembedding(params, config))
    packed_ids = None
    if options.gather_ids is not None:  # slot i gathers at the ids of the token it predicts
        ids = options.gather_ids.astype(jnp.int32)
        check_rank("gather_ids", ids, 3)
        if ids.shape[:2] != completion_tokens.shape:
            raise ValueError(
                f"gather_ids {tuple(ids.shape)} must be [B, T, k] with [B, T]="
                f"{completion_tokens.shape} of the completions"
            )
        prompt_ids = jnp.zeros((shape[0], prompt_len, ids.shape[2]), jnp.int32)
        packed_ids = pack(jnp.concatenate([prompt_ids, ids], axis=1), plan)[:, 1:]
    out = _token_outputs(
        hidden[:, :-1],
        unembed_fn,
        packed_tokens[:, 1:],
        mask=predicted,
        temperature=options.temperature,
        chunk_size=options.chunk_size,
        return_entropy=return_entropy,
        top_k=options.top_k,
        gather_ids=packed_ids,
        table=vocab_table(params, config, packed_tokens.shape[0]),
    )

    def padded(x: Array | None) -> Array | None:  # slot i's value at its target's slot
        if x is None:
            return None
        return unpack(jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2)), plan, shape)

    scattered = LogprobOutputs(*(padded(x) for x in out))
    if return_prompt_logprobs:
        logprobs = scattered.logprobs
        return (logprobs[:, prompt_len:], logprobs[:, :prompt_len]), router_logits, real
    completion = LogprobOutputs(*(None if x is None else x[:, prompt_len:] for x in scattered))
    return _result(completion, options), router_logits, real


class RoutedLogprobs(NamedTuple):
    """The log-probs of ``routed_completion_logprobs`` and the router logits of their forward.

    ``logprobs`` is what ``completion_logprobs`` returns for the same arguments (``[B, T]``,
    or a pair with ``return_entropy`` / ``return_prompt_logprobs``); ``router_logits`` is
    ``[L, N, S, E]`` f32 over the rows the model ran on (the padded ``[B, P + T]`` rows, or the
    packed ``[R, W]`` ones), None for a dense model; ``token_mask`` ``[N, S]`` bool marks their
    real tokens (``[prompt_mask ; completion_mask]``, or ``segment_ids > 0`` when packed).
    """

    logprobs: Any
    router_logits: Array | None
    token_mask: Array


def routed_completion_logprobs(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    plan: PackingPlan | None = None,
    **options: Any,
) -> RoutedLogprobs:
    """``completion_logprobs`` (``plan`` None) or ``packed_completion_logprobs`` of ``seqs``
    and, from the same forward, every layer's router logits with the real-token mask.

    One forward: the router logits are those the log-probs' hidden states were computed with
    (what ``models.moe.load_balancing_loss`` / ``router_z_loss`` take, with ``token_mask``).
    ``options``: ``LogprobOptions`` by keyword, as for ``completion_logprobs``.

    Returns:
      A ``RoutedLogprobs``; ``router_logits`` is None for a dense model.
    """
    return _routed(params, config, seqs, plan, _options(options), router=True)


def _routed(
    params: Any,
    config: ModelConfig,
    seqs: Sequences,
    plan: PackingPlan | None,
    options: LogprobOptions,
    *,
    router: bool,
) -> RoutedLogprobs:
    """The one forward behind the three public functions: padded rows (``plan`` None) or
    packed ones, the router logits only with ``router``."""
    if plan is None:
        return RoutedLogprobs(*_padded(params, config, seqs, options, router=router))
    return RoutedLogprobs(*_packed(params, config, seqs, plan, options, router=router))
