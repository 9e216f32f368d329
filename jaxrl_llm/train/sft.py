"""Supervised fine-tuning: the token-mean NLL step and the one warm-up loop every job uses.

An RL job warms its policy up on demonstrations (``data.demonstration`` of each prompt), a
preference job on the chosen (KTO: desirable) completions, a reward model on the chosen
completions before its head is added. All three run :func:`sft_warmup` over an iterator of host
:class:`~jaxrl_llm.types.Sequences`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import optax

from jaxrl_llm.losses import aggregation
from jaxrl_llm.train import adapters
from jaxrl_llm.train.forward import sequence_logprobs
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import Totals, jit_step, make_step
from jaxrl_llm.types import MaskedSequences, Sequences, sequences_of

log = logging.getLogger("jaxrl_llm")
PyTree = Any


def make_sft_loss_fn(model_config, *, chunk_size: int | None = None, remat: str = "none"):
    """``(params, seqs, totals) -> (nll, metrics)``: ``−Σ m·log π(y_t) / N_tok`` of the batch.

    ``seqs``: ``Sequences``, or ``MaskedSequences`` whose ``completion_mask`` (``m``, the
    trained tokens) is narrower than the attended ``attention_mask`` (multi-turn episodes)."""

    def loss_fn(params, seqs: Sequences | MaskedSequences, totals: Totals | None, key=None):
        token_logprobs = sequence_logprobs(
            params,
            model_config,
            sequences_of(seqs),
            chunk_size=chunk_size,
            remat=remat,
            dropout_key=key,
        )
        nll = aggregation.aggregate(
            -token_logprobs,
            seqs.completion_mask,
            "token-mean",
            num_tokens=None if totals is None else totals.num_tokens,
        )
        return nll, {"nll": nll}

    return loss_fn


def make_sft_step(
    model_config,
    optimizer: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    chunk_size: int | None = None,
    remat: str = "none",
    param_shardings: PyTree | None = None,
):
    """A supervised step on :class:`Sequences` (token-mean NLL of the completions)."""
    return make_step(
        make_sft_loss_fn(model_config, chunk_size=chunk_size, remat=remat),
        optimizer,
        micro_batches=micro_batches,
        param_shardings=param_shardings,
        loss_takes_key=adapters.has_dropout(model_config),
    )


@dataclasses.dataclass(frozen=True)
class WarmupMonitor:
    """What :func:`sft_warmup` watches as it runs.

    Attributes:
      log_every: without a bar, log the NLL every this many steps (and after the last).
      probe: ``probe(step, params) -> stop`` every ``check_every`` steps (and not after the
        last): True ends the warm-up there (``params`` as returned: LoRA adapters merged).
      check_every: the steps between two calls of ``probe``.
      progress: a progress bar over the steps (done, total, rate, time left) showing the last
        finished step's NLL, in place of the periodic NLL lines (``logging.progress``); the
        NLL after the last step is still logged.
      stream: where the bar draws (None: stderr).
    """

    log_every: int = 100
    probe: Callable[[int, PyTree], bool] | None = None
    check_every: int = 50
    progress: bool = False
    stream: TextIO | None = None


class _WarmupBar:
    """:func:`sft_warmup`'s bar: counts a step once its NLL is on the host, so reading it
    never stalls the device (the next step is already dispatched) and the rate and time left
    are of finished steps. Log lines print above it (``logging_redirect_tqdm``)."""

    def __init__(self, monitor: WarmupMonitor, steps: int):
        from tqdm.auto import tqdm  # noqa: PLC0415
        from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415

        self.enabled = monitor.progress
        self._bar = tqdm(
            total=steps,
            desc="sft warm-up",
            unit="step",
            dynamic_ncols=True,
            disable=not monitor.progress,
            file=monitor.stream,
        )
        self._lines = logging_redirect_tqdm() if self.enabled else contextlib.nullcontext()
        self._lines.__enter__()

    def show(self, history: list) -> None:
        """Counts the steps of ``history`` (device NLLs) not counted yet, showing the NLL."""
        while self.enabled and self._bar.n < len(history):
            nll = float(history[self._bar.n])
            self._bar.set_postfix_str(f"nll {nll:.4f}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._lines.__exit__(None, None, None)


def sft_warmup(
    model_config,
    params: PyTree | None,
    batches: Iterator[Sequences],
    *,
    steps: int,
    learning_rate: float,
    key: jax.Array,
    mesh,
    to_device: Callable[[Sequences], Sequences],
    chunk_size: int | None = None,
    remat: str = "none",
    param_dtype=None,
    monitor: WarmupMonitor = WarmupMonitor(),
) -> tuple[PyTree, list[float]]:
    """``steps`` AdamW steps (global-norm clip 1) on the NLL of the given host batches.

    With ``model_config.lora`` set (a LoRA run from a pretrained base) the warm-up trains
    adapters only over the frozen ``params`` and returns the base with them merged in (the
    warmed-up base, in its dtype), so a 7B base never gets full-size gradients or moments.

    Args:
      model_config: the policy's ``ModelConfig`` (``lora`` set: an adapter-only warm-up).
      params: starting parameters, or None to initialise randomly (not with ``lora``).
      batches: yields host ``Sequences`` (one per step).
      steps: optimizer steps.
      learning_rate: constant AdamW learning rate.
      key: initialisation key (used when ``params`` is None).
      mesh: the run's mesh.
      to_device: shards a host batch over the mesh.
      chunk_size, remat: the log-prob computation's settings.
      param_dtype: dtype of freshly initialised parameters.
      monitor: the NLL's logging and the probe that may end the warm-up early
        (:class:`WarmupMonitor`).

    Returns:
      ``(params, nll_history)``: the warmed-up parameters and each step's NLL (its length is
      the number of steps run).
    """
    optimizer = make_optimizer(learning_rate, max_grad_norm=1.0)
    extra = {} if param_dtype is None else {"param_dtype": param_dtype}
    frozen = frozen_shardings = None
    if model_config.lora is not None:
        if params is None:
            raise ValueError("an adapter-only SFT warm-up (model.lora) needs a base to adapt")
        made = adapters.create_lora_state(
            model_config, optimizer, key=key, mesh=mesh, params=params, **extra
        )
        state, shardings, frozen, frozen_shardings = made
    else:
        state, shardings = create_train_state(
            model_config, optimizer, key=key, mesh=mesh, params=params, **extra
        )
    step = jit_step(
        make_sft_step(
            model_config,
            optimizer,
            chunk_size=chunk_size,
            remat=remat,
            param_shardings=shardings.params,
        ),
        shardings,
        frozen=frozen,
        frozen_shardings=frozen_shardings,
    )
    if frozen is None:
        finished = lambda trained: trained  # noqa: E731
    else:
        merge = adapters.merge_program(model_config, frozen_shardings)
        finished = lambda trained: merge(frozen, trained)  # noqa: E731
    history = []
    bar = _WarmupBar(monitor, steps)
    try:
        for i in range(steps):
            state, metrics = step(state, to_device(next(batches)))
            bar.show(history)  # the steps before this one, while it runs
            history.append(metrics["nll"])
            if i + 1 == steps:
                bar.show(history)
            if i + 1 == steps or (not bar.enabled and (i + 1) % monitor.log_every == 0):
                log.info("sft warm-up step %d/%d: nll %.4f", i + 1, steps, float(metrics["nll"]))
            checked = monitor.probe is not None and (i + 1) % monitor.check_every == 0
            if checked and i + 1 < steps and monitor.probe(i + 1, finished(state.params)):
                break
        bar.show(history)  # stopped early by the probe
    finally:
        bar.close()
    return finished(state.params), [float(x) for x in jax.device_get(history)]
