"""Offline preference training (DPO family, KTO, ORPO, SimPO, CPO) and reward-model training.

``run(cfg)`` is the job behind ``jaxrl-llm train`` with ``job: preference`` or
``job: reward_model``. A run tokenises the pairs once (dataset-wide widths: one compiled
program), optionally warms the policy up on the chosen completions, fixes the reference
policy (the warmed-up one) and either precomputes its log-probs over the whole dataset in one
jitted, sharded pass or scores each batch with a frozen copy. Then each step draws rows from a
seeded, resumable sampler and runs a jitted, sharded optimizer step on the preference loss.
``job: reward_model`` trains the transformer with a scalar head on the Bradley-Terry loss and
saves it as a Hugging Face sequence classifier under ``run_dir/reward_model/``, which the RL
loop loads (``reward_model.path``); a preference job saves the trained policy under
``run_dir/policy/`` (``models.save_pretrained``). Run directories look like the RL loop's:
``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``checkpoints/`` (the state, the
sampler position and, once, the reference: its parameters or its precomputed log-probs),
``plots/``; ``resume=true`` continues exactly.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import data, models, parallel
from jaxrl_llm.models import heads
from jaxrl_llm.train import rollout as rollout_lib
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import save_config
from jaxrl_llm.train.metrics import MetricsWriter, ProgressBar, plot
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.preference_config import (
    REFERENCE_FREE,
    PreferenceConfig,
    check_config,
    dpo_loss_types,
    is_scalar_model,
    load_records,
)
from jaxrl_llm.train.preference_step import (  # noqa: F401  (re-exported)
    RewardBatch,
    UnpairedBatch,
    bradley_terry,
    make_kto_loss_fn,
    make_pair_loss_fn,
    make_preference_step,
    make_reference_fn,
    make_reward_loss_fn,
)
from jaxrl_llm.train.run_setup import build_policy, make_run_mesh
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_sft_step
from jaxrl_llm.types import PreferenceBatch, RolloutBatch

log = logging.getLogger("jaxrl_llm")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PLOT_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "eval/rewards/accuracies")


def make_loss_fn(cfg: PreferenceConfig, model_config):
    """The loss function the config names, with its hyper-parameters bound."""
    loss, chunk, remat = cfg.loss, cfg.model.chunk_size, cfg.model.remat
    if loss.name == "bradley_terry":
        return make_reward_loss_fn(
            model_config,
            center_rewards_coefficient=loss.center_rewards_coefficient,
            remat=remat,
        )
    if loss.name == "kto":
        return make_kto_loss_fn(
            model_config,
            beta=loss.beta,
            chunk_size=chunk,
            remat=remat,
            desirable_weight=loss.desirable_weight,
            undesirable_weight=loss.undesirable_weight,
        )
    kwargs: dict[str, Any] = {}
    if loss.label_smoothing:
        kwargs["label_smoothing"] = loss.label_smoothing
    if loss.name == "dpo":
        types, weights = dpo_loss_types(loss)
        name = types[0] if len(types) == 1 else types
        if len(types) > 1:
            kwargs["loss_weights"] = weights
        if loss.discopop_tau is not None:
            kwargs["discopop_tau"] = loss.discopop_tau
    else:
        name = loss.name
        if loss.gamma is not None:
            kwargs["gamma"] = loss.gamma
        if loss.cpo_alpha is not None:
            kwargs["cpo_alpha"] = loss.cpo_alpha
    return make_pair_loss_fn(
        model_config, name, beta=loss.beta, chunk_size=chunk, remat=remat, **kwargs
    )


# --------------------------------------------------------------------------------------------
# The run


class _Split(NamedTuple):
    arrays: Any  # PreferenceArrays or UnpairedArrays (host)
    partners: np.ndarray | None  # KTO: the row whose completion pairs with each prompt


def _take(split: _Split, rows: np.ndarray, ref: dict | None, unpaired: bool):
    """The host batch of ``rows`` (with their precomputed reference log-probs, if any)."""
    a = split.arrays
    ref_first = None if ref is None else ref["first"][rows]
    ref_second = None if ref is None else ref["second"][rows]
    if unpaired:
        partner = split.partners[rows]
        return UnpairedBatch(
            a.prompt_tokens[rows],
            a.prompt_mask[rows],
            a.completion_tokens[rows],
            a.completion_mask[rows],
            a.labels[rows],
            a.completion_tokens[partner],
            a.completion_mask[partner],
            ref_first,
            ref_second,
        )
    return PreferenceBatch(
        a.prompt_tokens[rows],
        a.prompt_mask[rows],
        a.chosen_tokens[rows],
        a.chosen_mask[rows],
        a.rejected_tokens[rows],
        a.rejected_mask[rows],
        ref_first,
        ref_second,
    )


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}


class PreferenceTrainer:
    """One offline preference or reward-model run: state, reference, data position, writers."""

    def __init__(self, cfg: PreferenceConfig):
        check_config(cfg)
        parallel.initialize_distributed()
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self.is_main = jax.process_index() == 0
        self.reward_model = cfg.job == "reward_model"
        self.unpaired = cfg.loss.name == "kto"
        self.needs_reference = cfg.loss.name not in REFERENCE_FREE
        if cfg.model.dtype not in _DTYPES:
            raise ValueError(
                f"model.dtype must be one of {tuple(_DTYPES)}, got {cfg.model.dtype!r}"
            )
        self.dtype = _DTYPES[cfg.model.dtype]
        self.mesh = make_run_mesh(cfg.mesh)
        self._scalar_path = self.reward_model and is_scalar_model(cfg.model.path)
        if self._scalar_path and cfg.sft_warmup.steps:
            raise ValueError(
                f"model.path {cfg.model.path} is already a reward model (a sequence "
                "classifier): set sft_warmup.steps=0"
            )
        if self._scalar_path:
            self.model_config, self._initial = heads.load_scalar_model(
                cfg.model.path, dtype=self.dtype, mesh=self.mesh
            )
            self.tokenizer = models.load_tokenizer(cfg.model.path)
        else:
            # build_policy reads only ``cfg.model``, which this config shares with the RL one.
            self.tokenizer, self.model_config, self._initial = build_policy(cfg, self.mesh)
        self.train_split, self.eval_split, self.truncated = self._encode(*load_records(cfg))
        self._check_sizes()
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints",
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
        )
        self.latest = self.checkpointer.latest_step()
        if self.latest is not None and not cfg.resume:
            raise ValueError(
                f"{self.run_dir} already holds checkpoints (latest step {self.latest}): pass "
                "resume=true to continue, or choose another run_dir"
            )
        # Only a config that passed every check is written to the run directory.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        t = cfg.trainer
        self.optimizer = make_optimizer(
            t.learning_rate,
            schedule=t.schedule,
            warmup_steps=t.warmup_steps,
            total_steps=t.max_steps,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
        )
        self.sampler = data.IndexSampler(self._keys, seed=cfg.seed)
        self.metrics_writer = MetricsWriter(self.run_dir, tensorboard=cfg.logging.tensorboard)

    # -- data --------------------------------------------------------------------------------

    def _encode(self, train: list, evaluation: list) -> tuple[_Split, _Split, int]:
        d = self.cfg.data
        records = train + evaluation
        prompts = [
            data.format_prompt(
                r.prompt,
                self.tokenizer,
                chat_template=d.chat_template,
                system_prompt=d.system_prompt,
            )
            for r in records
        ]
        limits = {
            "max_prompt_tokens": d.max_prompt_tokens,
            "max_completion_tokens": d.max_completion_tokens,
            "truncate": d.truncate,
            "add_special_tokens": not d.chat_template,
        }
        # Both splits in one encoding: the same widths, so they share compiled programs.
        if self.unpaired:
            completions = [r.completion for r in records]
            labels = [r.label for r in records]
            arrays, truncated = data.encode_unpaired(
                self.tokenizer, prompts, completions, labels, **limits
            )
            self._keys = data.unpaired_keys(train)
        else:
            chosen, rejected = [r.chosen for r in records], [r.rejected for r in records]
            margins = [r.margin for r in records]
            arrays, truncated = data.encode_pairs(
                self.tokenizer, prompts, chosen, rejected, margins=margins, **limits
            )
            self._keys = data.pair_keys(train)
        if truncated:
            log.warning(
                "%d of %d records were truncated to the length limits", truncated, len(records)
            )
        splits = []
        for rows in (np.arange(len(train)), len(train) + np.arange(len(evaluation))):
            part = type(arrays)(*(x[rows] for x in arrays))
            splits.append(
                _Split(part, data.mismatched_partners(len(rows)) if self.unpaired else None)
            )
        return splits[0], splits[1], truncated

    def _check_sizes(self) -> None:
        t = self.cfg.trainer
        shards = int(np.prod([self.mesh.shape[a] for a in parallel.batch_mesh_axes(self.mesh)]))
        num_eval = len(self.eval_split.arrays.prompt_tokens)
        self.eval_batch = min(t.eval_batch_size or t.batch_size, num_eval)
        sizes = {"trainer.batch_size": t.batch_size, "the eval batch": self.eval_batch}
        if self.cfg.sft_warmup.steps:
            sizes["sft_warmup.batch_size"] = self.cfg.sft_warmup.batch_size
        for name, size in sizes.items():
            if size % shards:
                raise ValueError(
                    f"{name}={size} does not divide into the {shards} batch shards of the mesh "
                    f"{dict(self.mesh.shape)}"
                )
        dropped = num_eval % self.eval_batch
        if dropped:
            log.warning(
                "evaluating %d of the %d held-out records (whole batches of %d); set "
                "trainer.eval_batch_size to a divisor to use them all",
                num_eval - dropped,
                num_eval,
                self.eval_batch,
            )

    def _to_device(self, host):
        if jax.process_count() > 1:
            rows = parallel.process_local_slice(jax.tree.leaves(host)[0].shape[0], self.mesh)
            host = jax.tree.map(lambda x: x[rows], host)
        return parallel.shard_batch(host, self.mesh)

    def _device_batch(self, split: _Split, rows: np.ndarray, ref: dict | None):
        """The sharded batch of ``rows``, its reference log-probs filled in when needed."""
        host = _take(split, rows, ref, self.unpaired)
        if self.reward_model:
            host = RewardBatch(host, split.arrays.margins[rows])
        batch = self._to_device(host)
        if self.needs_reference and ref is None:
            first, second = self.reference_fn(self.reference, batch)
            fields = (
                ("ref_logps", "ref_kl_logps")
                if self.unpaired
                else ("ref_chosen_logps", "ref_rejected_logps")
            )
            batch = batch._replace(**dict(zip(fields, (first, second))))
        return batch

    # -- state and reference -----------------------------------------------------------------

    def _sft_warmup(self, params, key):
        """Supervised warm-up on the chosen (KTO: desirable) completions of the training set."""
        section, mc = self.cfg.sft_warmup, self.model_config
        optimizer = make_optimizer(section.learning_rate, max_grad_norm=1.0)
        state, shardings = create_train_state(
            mc, optimizer, key=key, mesh=self.mesh, params=params, param_dtype=self.dtype
        )
        step = jit_step(
            make_sft_step(
                mc,
                optimizer,
                chunk_size=self.cfg.model.chunk_size,
                remat=self.cfg.model.remat,
                param_shardings=shardings.params,
            ),
            shardings,
        )
        a = self.train_split.arrays
        if self.unpaired:
            tokens, mask, pool = a.completion_tokens, a.completion_mask, np.flatnonzero(a.labels)
        else:
            tokens, mask, pool = a.chosen_tokens, a.chosen_mask, np.arange(len(a.chosen_tokens))
        if len(pool) == 0:
            raise ValueError("sft_warmup needs desirable examples in the training data")
        rng = np.random.default_rng([self.cfg.seed, 1])
        for i in range(section.steps):
            rows = pool[rng.integers(0, len(pool), section.batch_size)]
            zeros = np.zeros(mask[rows].shape, np.float32)
            host = RolloutBatch(
                completion_mask=mask[rows],
                old_logprobs=zeros,
                advantages=zeros[:, 0],
                prompt_tokens=a.prompt_tokens[rows],
                prompt_mask=a.prompt_mask[rows],
                completion_tokens=tokens[rows],
            )
            state, metrics = step(state, self._to_device(host))
            if (i + 1) % 100 == 0 or i + 1 == section.steps:
                log.info("sft step %d/%d nll %.4f", i + 1, section.steps, float(metrics["nll"]))
        return state.params

    def _create_state(self, params, key):
        mc = self.model_config
        if not self.reward_model:
            return create_train_state(
                mc, self.optimizer, key=key, mesh=self.mesh, params=params, param_dtype=self.dtype
            )
        init_key, head_key = jax.random.split(key)
        if params is not None and not self._scalar_path:
            params = heads.init_scalar_params(mc, head_key, dtype=self.dtype, backbone=params)
        return create_train_state(
            mc,
            self.optimizer,
            key=init_key,
            mesh=self.mesh,
            params=params,
            init_params=lambda k: heads.init_scalar_params(mc, k, dtype=self.dtype),
            params_axes=heads.scalar_logical_axes(mc),
        )

    def _precompute(self, params, split: _Split, batch_size: int) -> dict[str, np.ndarray]:
        """Reference log-probs of every row of ``split``, batch by batch."""
        n = len(split.arrays.prompt_tokens)
        # The last batch wraps around to the first rows: one program for every batch.
        order = np.resize(np.arange(n), -(-n // batch_size) * batch_size)
        firsts, seconds = [], []
        for start in range(0, len(order), batch_size):
            host = _take(split, order[start : start + batch_size], None, self.unpaired)
            first, second = self.reference_fn(params, self._to_device(host))
            firsts.append(rollout_lib.fetch(first))
            seconds.append(rollout_lib.fetch(second))
        return {"first": np.concatenate(firsts)[:n], "second": np.concatenate(seconds)[:n]}

    def _reference_tree(self):
        """What the checkpoint keeps of the reference: its parameters or its log-probs."""
        if self.reference is not None:
            return self.reference
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(replicated, x, x.shape),
            self.ref_logps,
        )

    def _setup(self) -> None:
        cfg = self.cfg
        init_key, sft_key = jax.random.split(jax.random.key(cfg.seed))
        latest = self.latest
        params = self._initial if latest is None else None
        if latest is None and cfg.sft_warmup.steps > 0:
            log.info("SFT warm-up: %d steps", cfg.sft_warmup.steps)
            params = self._sft_warmup(params, sft_key)
        self.state, self.shardings = self._create_state(params, init_key)
        self.reference, self.ref_logps = None, None
        self.extra: dict[str, Any] = {}
        if self.needs_reference:
            self.reference_fn = make_reference_fn(
                self.model_config,
                unpaired=self.unpaired,
                chunk_size=cfg.model.chunk_size,
                param_shardings=self.shardings.params,
                row_sharding=NamedSharding(
                    self.mesh,
                    PartitionSpec(parallel.spec_entry(parallel.batch_mesh_axes(self.mesh))),
                ),
            )
            on_the_fly = cfg.loss.reference == "on_the_fly"
            if on_the_fly:
                copy = jax.jit(
                    lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.shardings.params
                )
                self.reference = copy(self.state.params)
            elif latest is None:
                log.info("precomputing reference log-probs")
                params = self.state.params
                self.ref_logps = {
                    "train": self._precompute(params, self.train_split, cfg.trainer.batch_size),
                    "eval": self._precompute(params, self.eval_split, self.eval_batch),
                }
        self.reference_dirty = self.needs_reference
        if latest is None:
            self.metrics_writer.truncate(0)
        else:
            self._restore(latest)

    def _restore(self, step: int) -> None:
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
        )
        abstract_reference = None
        if self.reference is not None:
            abstract_reference = abstract(self.reference)
        elif self.needs_reference:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            abstract_reference = {
                name: {
                    key: jax.ShapeDtypeStruct(
                        (len(split.arrays.prompt_tokens),), jnp.float32, sharding=replicated
                    )
                    for key in ("first", "second")
                }
                for name, split in (("train", self.train_split), ("eval", self.eval_split))
            }
        state, extra, reference = self.checkpointer.restore(
            step, abstract_state=abstract(self.state), abstract_reference=abstract_reference
        )
        self.state, self.extra = state, dict(extra)
        if self.needs_reference:
            if reference is None:
                raise ValueError(f"checkpoint {step} has no reference to resume from")
            if self.reference is not None:
                self.reference = reference
            else:
                self.ref_logps = jax.tree.map(rollout_lib.fetch, reference)
            self.reference_dirty = False
        self.sampler.restore(self.extra["sampler"])
        self.metrics_writer.truncate(step)
        log.info("resumed from step %d", step)

    def _save(self, step: int) -> None:
        self.extra["sampler"] = self.sampler.state()
        self.checkpointer.save(
            step,
            self.state,
            extra=self.extra,
            reference_params=self._reference_tree() if self.reference_dirty else None,
        )
        self.reference_dirty = False

    # -- the run -----------------------------------------------------------------------------

    def evaluate(self, params) -> dict[str, float]:
        """The loss metrics on the held-out set (whole eval batches), averaged over batches."""
        n, size = len(self.eval_split.arrays.prompt_tokens), self.eval_batch
        ref = None if self.ref_logps is None else self.ref_logps["eval"]
        rows = [
            self.eval_fn(params, self._device_batch(self.eval_split, np.arange(s, s + size), ref))
            for s in range(0, n - n % size, size)
        ]
        return _mean_rows(jax.device_get(rows))

    def train(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        self._setup()
        loss_fn = make_loss_fn(cfg, self.model_config)
        params_sharding = self.shardings.params
        step_fn = jit_step(
            make_preference_step(
                loss_fn,
                self.optimizer,
                micro_batches=t.micro_batches,
                param_shardings=params_sharding,
            ),
            self.shardings,
        )
        self.eval_fn = jax.jit(lambda p, b: loss_fn(p, b)[1], in_shardings=(params_sharding, None))
        if "eval_before" not in self.extra:
            self.extra["eval_before"] = self.evaluate(self.state.params)
            log.info("eval before training: %s", self.extra["eval_before"])
        train_ref = None if self.ref_logps is None else self.ref_logps["train"]
        start = int(self.state.step)
        bar = ProgressBar(t.max_steps, initial=start, disable=not cfg.logging.progress)
        for step in range(start, t.max_steps):
            t0 = time.perf_counter()
            batch = self._device_batch(
                self.train_split, self.sampler.next_indices(t.batch_size), train_ref
            )
            self.state, metrics = step_fn(self.state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if t.eval_every and (step + 1) % t.eval_every == 0:
                evaluation = self.evaluate(self.state.params)
                metrics.update({f"eval/{k}": v for k, v in evaluation.items()})
            metrics["time/step"] = time.perf_counter() - t0
            if self.is_main:
                self.metrics_writer.write(step + 1, metrics)
            # The bar shows RL's reward / accuracy: here the reward margin and pair accuracy.
            shown = {"reward_mean": "rewards/margins", "accuracy": "rewards/accuracies"}
            bar.update({k: metrics[v] for k, v in shown.items() if v in metrics})
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == t.max_steps:
                self._save(step + 1)
        bar.close()
        summary = {
            "job": cfg.job,
            "loss": cfg.loss.name,
            "steps": t.max_steps,
            "eval_before": self.extra["eval_before"],
            "eval_after": self.evaluate(self.state.params),
            "truncated_records": self.truncated,
        }
        self.checkpointer.wait()
        summary.update(self._export())
        if self.is_main:
            self.metrics_writer.write_summary(summary)
            if cfg.logging.plots:
                plot(self.run_dir, PLOT_KEYS)
        self.metrics_writer.close()
        self.checkpointer.close()
        log.info("eval after training: %s", summary["eval_after"])
        return summary

    def _export(self) -> dict[str, str]:
        """Saves the trained model as a Hugging Face directory (the main process writes)."""
        params = jax.tree.map(rollout_lib.fetch, self.state.params)
        if self.reward_model:
            path = self.run_dir / "reward_model"
            if self.is_main:
                heads.save_scalar_model(path, self.model_config, params, tokenizer=self.tokenizer)
            return {"reward_model": os.fspath(path)}
        path = self.run_dir / "policy"
        if self.is_main:
            models.save_pretrained(path, self.model_config, params)
            self.tokenizer.save_pretrained(os.fspath(path))
        return {"policy": os.fspath(path)}


def run(cfg: PreferenceConfig) -> dict[str, Any]:
    """Runs a ``preference`` or ``reward_model`` job; returns the summary in summary.json."""
    return PreferenceTrainer(cfg).train()
