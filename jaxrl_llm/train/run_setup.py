"""What an RL run is made of before its first step: mesh, policy, data, rewards, warm-up.

``RunContext`` holds them between steps (host-side orchestration, never traced) and knows how
to sample and score a batch, add a learned reward model's scores, and evaluate greedily.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data, models, objectives, parallel, sampling
from jaxrl_llm.train import rollout as rollout_lib
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import create_train_state
from jaxrl_llm.train.step import jit_step, make_sft_step
from jaxrl_llm.types import RolloutBatch

log = logging.getLogger("jaxrl_llm")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_run_mesh(section) -> jax.sharding.Mesh:
    """The mesh of ``mesh.*``; without a ``-1`` the first ``data·fsdp·tensor`` devices are used."""
    sizes = (section.data, section.fsdp, section.tensor)
    devices = None
    if -1 not in sizes:
        count = int(np.prod(sizes))
        if count > jax.device_count():
            raise ValueError(f"mesh {sizes} needs {count} devices; {jax.device_count()} available")
        devices = jax.devices()[:count]
    return parallel.make_mesh(*sizes, devices=devices)


def build_policy(cfg: TrainConfig, mesh):
    """``(tokenizer, model_config, params or None)``; ``None`` means initialise randomly."""
    if cfg.model.dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {tuple(_DTYPES)}, got {cfg.model.dtype!r}")
    if cfg.model.remat not in models.REMAT_POLICIES:
        raise ValueError(
            f"model.remat must be one of {models.REMAT_POLICIES}, got {cfg.model.remat!r}"
        )
    if cfg.model.path is not None:
        model_config, params = models.load_pretrained(
            cfg.model.path, dtype=_DTYPES[cfg.model.dtype], mesh=mesh
        )
        return models.load_tokenizer(cfg.model.path), model_config, params
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    tiny = cfg.model.tiny
    # Like Megatron's make-vocab-size-divisible-by: the embedding rows are split over the
    # tensor axis, so the row count is rounded up to a multiple of it (and of
    # ``model.tiny.vocab_multiple``). The extra ids decode to nothing and earn no reward.
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    multiple = math.lcm(tiny.vocab_multiple, tensor)
    vocab_size = -(-len(tokenizer) // multiple) * multiple
    model_config = models.ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, model_config, None


_RM_NORMALIZE = ("batch", "none")


def load_reward_model(cfg: TrainConfig, policy_config, mesh):
    """``(score_fn, params)`` of ``reward_model.path`` (scored on device), or None."""
    section = cfg.reward_model
    if section.path is None:
        return None
    if section.normalize not in _RM_NORMALIZE:
        raise ValueError(
            f"reward_model.normalize must be one of {_RM_NORMALIZE}, got {section.normalize!r}"
        )
    from jaxrl_llm.models import heads  # noqa: PLC0415

    rm_config, params = heads.load_scalar_model(section.path, dtype=jnp.float32, mesh=mesh)
    if rm_config.vocab_size != policy_config.vocab_size:
        raise ValueError(
            f"reward_model.path {section.path} has vocab_size {rm_config.vocab_size}, the policy "
            f"{policy_config.vocab_size}: the reward model must share the policy's tokenizer"
        )

    @jax.jit
    def score_fn(params, batch: RolloutBatch):
        return heads.sequence_scores(
            params,
            rm_config,
            batch.prompt_tokens,
            batch.prompt_mask,
            batch.completion_tokens,
            batch.completion_mask,
        )

    return score_fn, params


def load_examples(cfg: TrainConfig) -> tuple[list, list]:
    """``(train, eval)`` examples of the configured task."""
    section = cfg.data
    if section.task == "arithmetic":
        examples = data.arithmetic_examples(
            section.num_train + section.eval_size,
            seed=cfg.seed,
            digits=section.digits,
            ops=section.ops,
        )
        return examples[section.eval_size :], examples[: section.eval_size]
    if section.task != "jsonl":
        raise ValueError(f"data.task must be 'arithmetic' or 'jsonl', got {section.task!r}")
    if section.train_path is None:
        raise ValueError("data.task=jsonl needs data.train_path")
    fields = {"prompt_field": section.prompt_field, "answer_field": section.answer_field}
    train = data.load_jsonl(section.train_path, **fields)
    if section.eval_path is not None:
        return train, data.load_jsonl(section.eval_path, **fields)[: section.eval_size]
    return data.split_eval(train, eval_size=section.eval_size, seed=cfg.seed)


@dataclasses.dataclass
class RunContext:
    """What one run holds between steps (host-side orchestration, not traced)."""

    cfg: TrainConfig
    mesh: Any
    tokenizer: Any
    model_config: Any
    objective: objectives.Objective
    reward_fn: Any
    train_examples: list
    eval_examples: list
    reward_model: Any = None  # (score_fn, params) of a learned reward model, or None

    def prompts(self, examples) -> list[str]:
        return [
            data.format_prompt(
                ex.prompt,
                self.tokenizer,
                chat_template=self.cfg.data.chat_template,
                system_prompt=self.cfg.data.system_prompt,
            )
            for ex in examples
        ]

    def to_device(self, host: RolloutBatch) -> RolloutBatch:
        """Pads prompts to a bucketed width (few compiled programs) and shards the rows."""
        width = sampling.bucket_length(host.prompt_tokens.shape[1])
        extra = width - host.prompt_tokens.shape[1]
        host = host._replace(
            prompt_tokens=np.pad(host.prompt_tokens, ((0, 0), (extra, 0))),
            prompt_mask=np.pad(host.prompt_mask, ((0, 0), (extra, 0))),
        )
        if jax.process_count() > 1:
            rows = parallel.process_local_slice(host.completion_mask.shape[0], self.mesh)
            host = jax.tree.map(lambda x: x[rows], host)
        return parallel.shard_batch(host, self.mesh)

    def sample(self, params, examples, key, *, temperature, group_size) -> rollout_lib.Samples:
        r = self.cfg.rollout
        samples = rollout_lib.sample_and_score(
            params,
            self.model_config,
            self.tokenizer,
            examples,
            self.prompts(examples),
            key=key,
            reward_fn=self.reward_fn,
            group_size=group_size,
            max_new_tokens=r.max_new_tokens,
            max_prompt_tokens=self.cfg.data.max_prompt_tokens,
            temperature=temperature,
            add_special_tokens=not self.cfg.data.chat_template,
            top_k=r.top_k if temperature > 0 else 0,
            top_p=r.top_p,
            min_p=r.min_p,
            mesh=self.mesh,
        )
        return self.add_learned_reward(samples)

    def add_learned_reward(self, samples: rollout_lib.Samples) -> rollout_lib.Samples:
        """Adds ``weight * normalise(RM score)`` of the learned reward model, scored on device."""
        if self.reward_model is None:
            return samples
        score_fn, rm_params = self.reward_model
        section = self.cfg.reward_model
        host = RolloutBatch(
            completion_mask=samples.completion_mask,
            old_logprobs=np.zeros(samples.completion_mask.shape, np.float32),
            advantages=np.zeros(samples.completion_mask.shape[:1], np.float32),
            prompt_tokens=samples.prompt_tokens,
            prompt_mask=samples.prompt_mask,
            completion_tokens=samples.completion_tokens,
        )
        scores = rollout_lib.fetch(score_fn(rm_params, self.to_device(host))).astype(np.float64)
        if section.normalize == "batch" and scores.size > 1:
            scores = (scores - scores.mean()) / (scores.std() + 1e-6)
        scores = scores.astype(np.float32)
        components = dict(samples.components)
        components["reward_model"] = scores
        return samples._replace(
            rewards=(samples.rewards + section.weight * scores).astype(np.float32),
            components=components,
        )

    def evaluate(self, params) -> dict[str, float]:
        """Greedy accuracy and mean reward on the held-out prompts."""
        samples = self.sample(
            params, self.eval_examples, jax.random.key(0), temperature=0.0, group_size=1
        )
        return {
            "accuracy": float(samples.correct.mean()),
            "reward_mean": float(samples.rewards.mean()),
        }


def sft_warmup(run: RunContext, params, key) -> Any:
    """Supervised warm-up on demonstrations, so RL starts from a policy that sometimes succeeds."""
    section = run.cfg.sft_warmup
    optimizer = make_optimizer(section.learning_rate, max_grad_norm=1.0)
    state, shardings = create_train_state(
        run.model_config, optimizer, key=key, mesh=run.mesh, params=params
    )
    step = jit_step(
        make_sft_step(
            run.model_config,
            optimizer,
            chunk_size=run.cfg.model.chunk_size,
            remat=run.cfg.model.remat,
            param_shardings=shardings.params,
        ),
        shardings,
    )
    rng = np.random.default_rng([run.cfg.seed, 1])
    for i in range(section.steps):
        idx = rng.integers(0, len(run.train_examples), section.batch_size)
        examples = [run.train_examples[j] for j in idx]
        prompt_tokens, prompt_mask = rollout_lib.encode_prompts(
            run.tokenizer,
            run.prompts(examples),
            max_prompt_tokens=run.cfg.data.max_prompt_tokens,
            add_special_tokens=not run.cfg.data.chat_template,
        )
        completion_tokens, completion_mask = rollout_lib.encode_completions(
            run.tokenizer,
            [data.demonstration(ex) for ex in examples],
            max_tokens=run.cfg.rollout.max_new_tokens,
        )
        zeros = np.zeros(completion_mask.shape, np.float32)
        host = RolloutBatch(
            completion_mask=completion_mask,
            old_logprobs=zeros,
            advantages=zeros[:, 0],
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            completion_tokens=completion_tokens,
        )
        state, metrics = step(state, run.to_device(host))
        if (i + 1) % 100 == 0 or i + 1 == section.steps:
            log.info("sft step %d/%d nll %.4f", i + 1, section.steps, float(metrics["nll"]))
    return state.params
