"""Offline preference training (DPO family, KTO, ORPO, SimPO, CPO) and reward-model training.

A run tokenises the pairs once (dataset-wide widths: one compiled program), optionally warms
the policy up on the chosen completions (``train.sft``), fixes the reference policy (the
warmed-up one) and either precomputes its log-probs over the whole dataset in one jitted,
sharded pass or scores each batch with a frozen copy. Then each step draws rows from a seeded,
resumable sampler and runs the jitted, sharded optimizer step (``train.step``, micro-batches
averaged as TRL does). ``job: reward_model`` trains the transformer with a scalar head on the
Bradley-Terry loss. Every run ends with ``run_dir/hf/``: the trained policy (a reward-model job:
the sequence classifier, which the RL loop loads as ``reward_model.path``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import data, models, parallel
from jaxrl_llm.models import heads, lora
from jaxrl_llm.train import adapters, export, setup
from jaxrl_llm.train.core import PhaseTimer, Trainer
from jaxrl_llm.train.optim import make_trainer_optimizer
from jaxrl_llm.train.packing import place_plan
from jaxrl_llm.train.plots import PREFERENCE_PLOT_KEYS
from jaxrl_llm.train.preference import packing as pref_packing
from jaxrl_llm.train.preference.config import REFERENCE_FREE, PreferenceConfig, check_config
from jaxrl_llm.train.preference.data import (
    Split,
    encode_splits,
    is_scalar_model,
    load_records,
    take,
)
from jaxrl_llm.train.preference.losses import RewardBatch, make_loss_fn, make_reference_fn
from jaxrl_llm.train.preference.packing import PackedBatch
from jaxrl_llm.train.sft import WarmupMonitor, sft_warmup
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_step, merge_trees
from jaxrl_llm.types import Sequences

log = logging.getLogger("jaxrl_llm")

SFT_WARMUP_STEPS_BUILTIN = 600


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}


class PreferenceTrainer(Trainer):
    """One offline preference or reward-model run: state, reference, data position, writers."""

    plot_keys = PREFERENCE_PLOT_KEYS
    #: A LoRA run's frozen base (``model.lora``; None: every weight is trained) and shardings.
    base: Any = None
    base_shardings: Any = None

    def __init__(self, cfg: PreferenceConfig):
        super().__init__(cfg)
        check_config(cfg)
        adapters.check_lora_job(cfg, cfg.job)
        self.reward_model = cfg.job == "reward_model"
        self.unpaired = cfg.loss.name == "kto"
        self.needs_reference = cfg.loss.name not in REFERENCE_FREE
        self.precision = setup.resolve_precision(cfg.model, cfg.trainer.optimizer_state_dtype)
        self.dtype = self.precision.param
        self.mesh = setup.make_run_mesh(cfg.mesh)
        self._scalar_path = self.reward_model and is_scalar_model(cfg.model.path)
        if self._scalar_path and cfg.sft_warmup.steps:
            raise ValueError(
                f"model.path {cfg.model.path} is already a reward model (a sequence "
                "classifier): set sft_warmup.steps=0"
            )
        if self._scalar_path:
            self.model_config, self._initial = setup.load_model(
                cfg.model.path,
                self.precision,
                head="scalar",
                mesh=self.mesh,
                lora=setup.lora_spec(cfg.model),
            )
            self.tokenizer = models.load_tokenizer(cfg.model.path)
        else:
            # build_policy reads only ``cfg.model``, which this config shares with the RL one.
            self.tokenizer, self.model_config, self._initial = setup.build_policy(
                cfg, self.mesh, self.precision
            )
        self.sft_steps = setup.sft_warmup_steps(cfg, SFT_WARMUP_STEPS_BUILTIN)
        if self._scalar_path:
            self.sft_steps = 0
        train, evaluation = load_records(cfg)
        self.train_split, self.eval_split, self.truncated, keys = encode_splits(
            cfg, self.tokenizer, train, evaluation
        )
        self._check_sizes()
        t = cfg.trainer
        self.optimizer = make_trainer_optimizer(t, total_steps=t.max_steps)
        self.sampler = data.IndexSampler(keys, seed=cfg.seed)
        self.open_run()
        self.start_lines(
            {
                "mesh": str(dict(self.mesh.shape)),
                "model": f"{self.model_config.architecture} "
                f"({cfg.model.path or 'built-in tiny model, random init'})",
                "task": f"{cfg.job}, loss {cfg.loss.name}: {len(train)} train / "
                f"{len(evaluation)} eval records",
                "sft warm-up": f"{self.sft_steps} steps on the chosen completions"
                if self.sft_steps
                else "off",
                **adapters.start_line(self.model_config),
            }
        )

    # -- data --------------------------------------------------------------------------------

    def _check_sizes(self) -> None:
        t = self.cfg.trainer
        num_eval = len(self.eval_split.arrays.prompt_tokens)
        self.eval_batch = min(t.eval_batch_size or t.batch_size, num_eval)
        sizes = {"trainer.batch_size": t.batch_size, "the eval batch": self.eval_batch}
        if self.sft_steps:
            sizes["sft_warmup.batch_size"] = self.cfg.sft_warmup.batch_size
        setup.check_batch_sizes(sizes, self.mesh)
        dropped = num_eval % self.eval_batch
        if dropped:
            log.warning(
                "evaluating %d of the %d held-out records (whole batches of %d); set "
                "trainer.eval_batch_size to a divisor to use them all",
                num_eval - dropped,
                num_eval,
                self.eval_batch,
            )

    def _device_batch(
        self, split: Split, rows: np.ndarray, ref: dict | None, *, packed: bool = False
    ):
        """The sharded batch of ``rows``, its reference log-probs filled in when needed;
        ``packed``: the update's batch, its forwards (and the reference's) over packed rows
        with ``trainer.packing`` (a ``PackedBatch``)."""
        host = take(split, rows, ref, self.unpaired)
        if self.reward_model:
            host = RewardBatch(host, split.arrays.margins[rows])
        batch = setup.to_device(host, self.mesh)
        if self.needs_reference and ref is None:
            rows_in = self._packed(host, batch, 1) if packed else batch
            first, second = self.reference_fn(self.reference, rows_in)
            fields = (
                ("ref_logps", "ref_kl_logps")
                if self.unpaired
                else ("ref_chosen_logps", "ref_rejected_logps")
            )
            batch = batch._replace(**dict(zip(fields, (first, second))))
        if packed:
            batch = self._packed(host, batch, self.cfg.trainer.micro_batches)
        return batch

    def _packed(self, host, batch, micro_batches: int):
        """``batch`` with the packing plan of its forward rows for ``micro_batches`` strided
        micro-batches (``packing.plan_batch``, on device), or ``batch`` itself (padded)."""
        plan = pref_packing.plan_batch(
            host,
            micro_batches=micro_batches,
            shards=parallel.batch_shards(self.mesh),
            mode=self.cfg.trainer.packing,
        )
        if plan is None:
            return batch
        return PackedBatch(batch, place_plan(plan, self.mesh))

    def _chosen_completions(self) -> Iterator[Sequences]:
        """SFT batches of the chosen (KTO: desirable) completions of the training set."""
        a, section = self.train_split.arrays, self.cfg.sft_warmup
        if self.unpaired:
            tokens, mask, pool = a.completion_tokens, a.completion_mask, np.flatnonzero(a.labels)
        else:
            tokens, mask, pool = a.chosen_tokens, a.chosen_mask, np.arange(len(a.chosen_tokens))
        if len(pool) == 0:
            raise ValueError("sft_warmup needs desirable examples in the training data")
        rng = np.random.default_rng([self.cfg.seed, 1])
        while True:
            rows = pool[rng.integers(0, len(pool), section.batch_size)]
            yield Sequences(a.prompt_tokens[rows], a.prompt_mask[rows], tokens[rows], mask[rows])

    # -- state and reference -----------------------------------------------------------------

    @property
    def policy_params(self):
        """The policy's parameters: a LoRA run's base with its adapters (no copy)."""
        if self.base is None:
            return self.state.params
        return merge_trees(self.base, self.state.params)

    def _create_scalar_lora_state(self, params, key):
        """A LoRA reward model: adapters and head trained over the frozen backbone (the loaded
        or warmed-up model's; a built-in model's is kept in ``run_dir/base``)."""
        cfg, mc = self.cfg, self.model_config
        builtin, resuming = cfg.model.path is None, self.latest is not None
        base_key, score_key, state_key = jax.random.split(key, 3)
        if builtin and resuming:
            params = adapters.load_base(self.run_dir, mesh=self.mesh, dtype=self.dtype)
        elif params is None:  # a random built-in model (sft_warmup.steps=0)
            params = models.init_params(lora.base_config(mc), base_key, dtype=self.dtype)
        frozen, frozen_shardings, score = adapters.frozen_scalar_base(
            mc, params, key=score_key, mesh=self.mesh, param_dtype=self.dtype
        )
        made = adapters.scalar_lora_state(
            mc,
            self.optimizer,
            key=state_key,
            mesh=self.mesh,
            frozen=frozen,
            frozen_shardings=frozen_shardings,
            score=score,
            param_dtype=self.dtype,
        )
        if builtin and not resuming:
            adapters.save_base(self.run_dir, heads.backbone_config(mc), frozen["backbone"])
        self.base, self.base_shardings = made.base, made.base_shardings
        return made.state, made.shardings

    def _create_state(self, params, key):
        mc = self.model_config
        if mc.lora is not None and self.reward_model:
            return self._create_scalar_lora_state(params, key)
        if mc.lora is not None:
            made = adapters.setup_run(
                self.cfg,
                mc,
                self.optimizer,
                self.mesh,
                run_dir=self.run_dir,
                resuming=self.latest is not None,
                params=params,
                key=key,
            )
            self.base, self.base_shardings = made.base, made.base_shardings
            return made.state, made.shardings
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

    def _precompute(self, params, split: Split, batch_size: int) -> dict[str, np.ndarray]:
        """Reference log-probs of every row of ``split``, batch by batch."""
        n = len(split.arrays.prompt_tokens)
        # The last batch wraps around to the first rows: one program for every batch.
        order = np.resize(np.arange(n), -(-n // batch_size) * batch_size)
        firsts, seconds = [], []
        for start in range(0, len(order), batch_size):
            host = take(split, order[start : start + batch_size], None, self.unpaired)
            batch = self._packed(host, setup.to_device(host, self.mesh), 1)
            first, second = self.reference_fn(params, batch)
            firsts.append(parallel.fetch(first))
            seconds.append(parallel.fetch(second))
        return {"first": np.concatenate(firsts)[:n], "second": np.concatenate(seconds)[:n]}

    def setup(self) -> None:
        cfg = self.cfg
        init_key, sft_key = jax.random.split(jax.random.key(cfg.seed))
        params, self._initial = (self._initial if self.latest is None else None), None
        if self.latest is None and self.sft_steps > 0:
            log.warning(
                "SFT warm-up: %d supervised steps on the chosen completions before %s "
                "(sft_warmup.steps=0 turns it off)",
                self.sft_steps,
                cfg.loss.name,
            )
            params, _ = sft_warmup(
                adapters.sft_config(cfg, self.model_config),  # LoRA: it makes the base
                params,
                self._chosen_completions(),
                steps=self.sft_steps,
                learning_rate=cfg.sft_warmup.learning_rate,
                key=sft_key,
                mesh=self.mesh,
                to_device=lambda seqs: setup.to_device(seqs, self.mesh),
                chunk_size=cfg.model.chunk_size,
                remat=cfg.model.remat,
                param_dtype=self.dtype,
                monitor=WarmupMonitor(progress=cfg.logging.progress),
            )
        self.state, self.shardings = self._create_state(params, init_key)
        self.reference, self.ref_logps = None, None
        # A LoRA run's reference is its base (adapters off, no copy).
        ref_config = lora.base_config(self.model_config)
        ref_shardings = self.shardings.params if self.base is None else self.base_shardings
        if self.needs_reference:
            self.reference_fn = make_reference_fn(
                ref_config,
                unpaired=self.unpaired,
                chunk_size=cfg.model.chunk_size,
                param_shardings=ref_shardings,
                row_sharding=setup.row_sharding(self.mesh),
            )
            if cfg.loss.reference == "on_the_fly" and self.base is not None:
                self.reference = self.base
            elif cfg.loss.reference == "on_the_fly":
                self.reference = setup.copy_fn(self.shardings.params)(self.state.params)
            elif self.latest is None:
                log.info("precomputing reference log-probs")
                params = self.state.params if self.base is None else self.base
                self.ref_logps = {
                    "train": self._precompute(params, self.train_split, cfg.trainer.batch_size),
                    "eval": self._precompute(params, self.eval_split, self.eval_batch),
                }
        lora_reference = self.base is not None and self.reference is self.base  # not saved
        self.reference_dirty = self.needs_reference and not lora_reference
        loss_fn = make_loss_fn(cfg, self.model_config)
        self.step_fn = jit_step(
            make_step(
                loss_fn,
                self.optimizer,
                micro_batches=cfg.trainer.micro_batches,
                accumulate="mean",
                param_shardings=self.shardings.params,
                loss_takes_key=adapters.has_dropout(self.model_config),
            ),
            self.shardings,
            frozen=self.base,
            frozen_shardings=self.base_shardings,
        )
        policy_shardings = self.shardings.params
        if self.base is not None:
            policy_shardings = merge_trees(self.base_shardings, self.shardings.params)
        self.eval_fn = jax.jit(lambda p, b: loss_fn(p, b)[1], in_shardings=(policy_shardings, None))

    def reference_tree(self):
        """The reference's parameters (on the fly) or its precomputed log-probs (a LoRA
        run's base is not saved: it is reloaded)."""
        if self.reference is not None and self.base is not None:
            return None
        if self.reference is not None:
            return self.reference
        if self.ref_logps is None:
            return None
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(replicated, x, x.shape),
            self.ref_logps,
        )

    def abstract_reference(self):
        if not self.needs_reference or (self.reference is not None and self.base is not None):
            return None
        if self.reference is not None:
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                self.reference,
            )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return {
            name: {
                key: jax.ShapeDtypeStruct(
                    (len(split.arrays.prompt_tokens),), jnp.float32, sharding=replicated
                )
                for key in ("first", "second")
            }
            for name, split in (("train", self.train_split), ("eval", self.eval_split))
        }

    def restore_reference(self, tree) -> None:
        if self.reference is not None:
            self.reference = tree
        else:
            self.ref_logps = jax.tree.map(parallel.fetch, tree)

    def save_extra(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state()}

    def restore_extra(self, extra: dict[str, Any]) -> None:
        self.sampler.restore(extra["sampler"])

    @property
    def start_step(self) -> int:
        return int(self.state.step)

    # -- the run -----------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The loss metrics on the held-out set (whole eval batches), averaged over batches."""
        n, size = len(self.eval_split.arrays.prompt_tokens), self.eval_batch
        ref = None if self.ref_logps is None else self.ref_logps["eval"]
        rows = [
            self.eval_fn(
                self.policy_params,
                self._device_batch(self.eval_split, np.arange(s, s + size), ref),
            )
            for s in range(0, n - n % size, size)
        ]
        return _mean_rows(jax.device_get(rows))

    def train_step(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        t = self.cfg.trainer
        train_ref = None if self.ref_logps is None else self.ref_logps["train"]
        with timer.phase("update"):
            batch = self._device_batch(
                self.train_split, self.sampler.next_indices(t.batch_size), train_ref, packed=True
            )
            self.state, metrics = self.step_fn(self.state, batch)
            return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def progress_view(self, metrics: dict[str, float]) -> dict[str, float]:
        # The bar shows RL's reward / accuracy: here the reward margin and pair accuracy.
        shown = {"reward_mean": "rewards/margins", "accuracy": "rewards/accuracies"}
        return {**metrics, **{k: metrics[v] for k, v in shown.items() if v in metrics}}

    def summary(self) -> dict[str, Any]:
        return {"loss": self.cfg.loss.name, "truncated_records": self.truncated}

    def export(self, directory) -> None:
        if self.reward_model:
            export.export_scalar_model(
                directory,
                lora.base_config(self.model_config),
                adapters.merged_scalar(self.model_config, self.policy_params),
                self.tokenizer,
            )
            return
        stop_ids = data.stop_token_ids(self.tokenizer, self.model_config, self.cfg.model.path)
        if self.base is not None:
            adapters.export_adapter(
                directory,
                self.model_config,
                self.policy_params,
                self.tokenizer,
                base_model=adapters.base_model_path(self.cfg, self.run_dir),
                stop_ids=stop_ids,
            )
            return
        export.export_policy(
            directory,
            self.model_config,
            self.state.params,
            self.tokenizer,
            stop_ids=stop_ids,
            source=self.cfg.model.path,
        )
