"""An RL job's SFT warm-up: supervised steps on the task's demonstrations before RL, stopped
early (``sft_warmup.stop_at_accuracy``) once the policy solves that much of a probe of training
prompts.

The built-in tiny model knows nothing at first; its warm-up crosses a sharp transition (greedy
accuracy from ~10% to ~80% within a few hundred steps) whose position moves with the seed, the
device count and the floats' summation order, so a fixed step count starts RL anywhere between
40% and 83% held-out accuracy; the probe starts it from a policy of a chosen skill instead.

A stop signal (``train.core.stop_at_step_boundaries``) ends the warm-up at its next step with
``core.Interrupted`` and nothing saved: its end is the run's first checkpoint (step 0).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxrl_llm.train import adapters, core, setup
from jaxrl_llm.train.rl import episodes
from jaxrl_llm.train.sft import WarmupMonitor, sft_warmup

log = logging.getLogger("jaxrl_llm")

# At most this many supervised steps for the built-in model (``sft_warmup.steps: null``).
SFT_WARMUP_STEPS_BUILTIN = 2000


def probe_examples(train_examples: list, count: int, seed: int) -> list:
    """``count`` training examples (a seeded draw without replacement, repeated when the
    training set is smaller): the warm-up's probe, never the held-out prompts."""
    if not train_examples:
        raise ValueError("the SFT warm-up's accuracy probe needs training examples")
    order = np.random.default_rng([seed, 2]).permutation(len(train_examples))
    return [train_examples[order[i % len(order)]] for i in range(count)]


def make_probe(run, stop_at: float):
    """``probe(step, params) -> stop``: greedy accuracy on the probe prompts (logged) has
    reached ``stop_at``."""
    cfg = run.cfg
    examples = probe_examples(run.train_examples, cfg.data.eval_size, cfg.seed)

    def probe(step: int, params) -> bool:
        samples = run.sample(
            params, examples, jax.random.key(0), temperature=0.0, group_size=1, mesh=run.mesh
        )
        accuracy = float(np.mean(samples.correct))
        log.info(
            "sft warm-up step %d: greedy accuracy %.1f%% on %d training prompts (stops at %.1f%%)",
            step,
            100 * accuracy,
            len(examples),
            100 * stop_at,
        )
        return accuracy >= stop_at

    return probe


def stoppable(probe, *, check_every: int, steps: int):
    """``probe`` (None: no accuracy probe) called every ``check_every`` steps, behind a check
    at every step that raises ``core.Interrupted`` once a stop signal came."""

    def checked(step: int, params) -> bool:
        signum = core.stop_requested()
        if signum is not None:
            where = f"during the SFT warm-up (step {step} of {steps})"
            raise core.Interrupted(signum, None, where)
        return probe is not None and step % check_every == 0 and probe(step, params)

    return checked


def describe(cfg, steps: int) -> str:
    """The warm-up in words (the run's first lines and its log)."""
    stop_at = cfg.sft_warmup.stop_at_accuracy
    if stop_at is None:
        return f"{steps} supervised steps on the task's demonstrations"
    return (
        f"up to {steps} supervised steps on the task's demonstrations, until "
        f"{100 * stop_at:.0f}% greedy accuracy on {cfg.data.eval_size} training prompts "
        f"(checked every {cfg.sft_warmup.check_every})"
    )


def warm_up(cfg, run, params: Any, *, steps: int, key: jax.Array) -> tuple[Any, int]:
    """``(params, steps run)`` after the warm-up of ``params`` (None: a fresh built-in model)."""
    section = cfg.sft_warmup
    stop_at = section.stop_at_accuracy
    log.warning("SFT warm-up: %s before RL (sft_warmup.steps=0 turns it off)", describe(cfg, steps))
    model_config = adapters.sft_config(cfg, run.model_config)  # LoRA: it makes the base
    # The probe sees the parameters an adapter-only warm-up merges: checked every step only
    # where that costs nothing.
    every = section.check_every if model_config.lora is not None else 1
    params, history = sft_warmup(
        model_config,
        params,
        episodes.demonstration_batches(run, section.batch_size, cfg.seed),
        steps=steps,
        learning_rate=section.learning_rate,
        key=key,
        mesh=run.mesh,
        to_device=run.to_device,
        chunk_size=cfg.model.chunk_size,
        remat=cfg.model.remat,
        param_dtype=setup.param_dtype(cfg.model),
        monitor=WarmupMonitor(
            probe=stoppable(
                None if stop_at is None else make_probe(run, stop_at),
                check_every=section.check_every,
                steps=steps,
            ),
            check_every=every,
            progress=cfg.logging.progress,
        ),
    )
    return params, len(history)
