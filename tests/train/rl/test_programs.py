"""``train`` and ``plan`` run one description of the policy's programs (``train.rl.programs``).

A short real job on CPU records every call of its ``update``, ``logprobs`` and ``ref_logprobs``
programs (argument shapes and dtypes, calls in its one RL step); ``plan`` of the same config on
the same mesh shape (deviceless TPU where libtpu is installed, else the CPU devices) must lower
the same programs with the same argument shapes and dtypes, count the same calls per step, and
name the function that built each (what ``plan --json`` reports as ``function``).

The jobs: GRPO on-policy (the module's shared job), then one job per variant, several
variants combining features whose programs are independent (see ``VARIANTS``), so that GRPO
off-policy, PPO with a separate critic and with one optimizer, PRIME, LoRA, the sampler's
log-probs, the continuous engine (paged), sampler devices of their own, a distillation teacher
and packing each run in one job.

The packed variant (PRIME, ``trainer.packing=on``, two minibatches): the log-prob forwards
take the stacked packing plan as a third argument and each minibatch's ``RolloutBatch``
carries one. ``train`` sizes its
plans from the batch's masks, ``plan`` from the length model (full prompts, mean completion
``f x T``, first-fit at the ceiling), so the packed rows per shard need not agree: the real
job's lengths are whatever its sampler drew. Its plans are compared in everything but that
axis: the same programs, argument structure and dtypes, plan leaves of rank 4 with the same
micro-batches, shards and width (``[K, shards, rows, W]``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import inspect

import jax
import pytest

from jaxrl_llm.packing import PackingPlan
from jaxrl_llm.plan import programs as plan_programs
from jaxrl_llm.plan.topology import get_devices, libtpu_available, resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.packing import packing_mode
from jaxrl_llm.train.rl.config import TrainConfig, make_objective
from jaxrl_llm.train.rl.run import trainer_class
from jaxrl_llm.train.rl.trainer import RLTrainer

pytestmark = pytest.mark.needs_devices(8)

# Both sides must compute alike: a stated dtype (``auto`` is float32 on CPU, bfloat16 on TPU),
# no CPU token budget for the micro-batches, and prompts whose bucket (the trainer pads a
# batch's prompts to the bucket of its longest) is data.max_prompt_tokens's, which plan lowers:
# 4-digit operands make prompts of 10 tokens ("1234+5678="), padded to 16.
SMALL = (
    "data.digits=[4]",
    "data.max_prompt_tokens=16",
    "seed=0",
    "sft_warmup.steps=0",
    "trainer.max_steps=1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "data.eval_size=4",
    "mesh.data=1",
    "mesh.fsdp=4",
    "model.compute_dtype=float32",
    "trainer.micro_batch_tokens=null",
    "checkpoint.every_steps=1000",
    # The decode loop as on accelerators (CPU's auto decodes on per-layer copies).
    "rollout.decode_layers=stacked",
)
# The sampler's programs, named as plan reports them: the static engine's (``sampling.generate``)
# and the continuous engine's (``sampling.slots``, called from ``sampling.engine``).
SAMPLER_PROGRAMS = {
    "static": (
        "jaxrl_llm.sampling.generate",
        {"prefill": "prefill_program", "decode_step": "decode_program"},
    ),
    "continuous": ("jaxrl_llm.sampling.engine", {"prefill": "refill", "decode_step": "burst"}),
}
ATTRIBUTES = {
    "update": "update_fn",
    "logprobs": "logprob_fn",
    "ref_logprobs": "ref_logprob_fn",
    "values": "values_fn",  # PPO's critic
    "critic_update": "value_fn_step",
    "prm_update": "prm_step",  # PRIME's implicit PRM
    "prm_logprobs": "prm_logprob_fn",
}
# Each variant below adds features whose programs are independent of each other's: the
# sampler's log-probs (the update's batch holds them, no behaviour forward) with LoRA's update
# and frozen base; the continuous engine's paged cache (the sampler's admit and burst) with
# distillation's teacher forward; sampler devices of their own (one step off-policy: the
# behaviour forward runs) with PPO's joint policy-and-critic step; packing with PRIME's PRM
# programs and, two minibatches, the behaviour forward.
VARIANTS = {
    "grpo off-policy (two minibatches)": ("trainer.minibatches=2",),
    "lora, the sampler's log-probs": (
        "model.lora={rank: 4, alpha: 8.0}",
        "rollout.logprobs=sampler",
    ),
    "ppo, a critic of its own": (
        "objective.name=ppo",
        "critic.optimizer=separate",
        "critic.warmup_steps=0",
    ),
    "prime": ("objective.name=prime",),
    # On-policy distillation: the grpo job's exported policy is the teacher too.
    "the continuous engine, paged; distill, a teacher": (
        "rollout.engine=continuous",
        "rollout.kv_block_size=4",
        "objective.name=distill",
        "teacher.path={hf}",
    ),
    "sampler devices of their own; ppo, one optimizer over policy and critic": (
        "mesh.rollout_devices=4",
        "rollout.max_staleness=1",
        "objective.name=ppo",
        "critic.optimizer=joint",
        "critic.warmup_steps=0",
    ),
    # Packed forwards (two minibatches: the behaviour forward runs too).
    "prime, packed (two minibatches)": (
        "objective.name=prime",
        "trainer.packing=on",
        "rollout.expected_length_fraction=0.5",
        "trainer.minibatches=2",
    ),
}
# Programs the trainer calls through ``self.programs`` rather than an attribute.
SPEC_PROGRAMS = ("teacher_logprobs",)


def _signature(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)


def _free_rows(signature):
    """``signature`` with the packed-rows axis (2) of each packing plan's leaves left out (see
    the module: train's rows come from the batch, plan's from the length model)."""

    def free(node):
        if isinstance(node, PackingPlan):
            return PackingPlan(*(((*shape[:2], None, *shape[3:]), dtype) for shape, dtype in node))
        return node

    return jax.tree.map(free, signature, is_leaf=lambda x: isinstance(x, PackingPlan))


def _plans(signature) -> list:
    """The packing plans in a signature (``PackingPlan`` nodes)."""
    leaves = jax.tree.leaves(signature, is_leaf=lambda x: isinstance(x, PackingPlan))
    return [x for x in leaves if isinstance(x, PackingPlan)]


def _arguments(fn, args, kwargs) -> dict:
    """The traced arguments of a call of jitted ``fn`` by parameter name (positional or
    keyword alike), as shapes and dtypes; static and absent (None) ones left out."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    static = {"config", "mesh", "top_k", "max_new_tokens", "num_samples", "cache_dtype"}
    static |= {"unroll", "windows", "record_routing", "prompt_width"}
    return {k: _signature(v) for k, v in bound.items() if k not in static and v is not None}


class Recording:
    """A trainer that records the argument signature of each program's first call and
    counts its calls (mixed into the class the objective needs)."""

    def compile(self):
        super().compile()
        self.seen, self.calls = {}, collections.Counter()
        for name, attribute in ATTRIBUTES.items():
            if name == "update" and getattr(self, "joint", False):
                attribute = "joint_fn"  # PPO's joint step is the update
            if name in self.programs:
                setattr(self, attribute, self._recorded(name, getattr(self, attribute)))
        for name in SPEC_PROGRAMS:
            if name in self.programs:
                spec = self.programs[name]
                recorded = self._recorded(name, spec.fn)
                self.programs[name] = dataclasses.replace(spec, fn=recorded)

    def _recorded(self, name, fn):
        @functools.wraps(fn)
        def call(*args):
            self.seen.setdefault(name, _signature(args))
            self.calls[name] += 1
            return fn(*args)

        return call


def _train(tmp_path, *overrides) -> RLTrainer:
    cfg = load_config(TrainConfig, None, [*SMALL, f"run_dir={tmp_path / 'run'}", *overrides])
    trainer_cls = trainer_class(make_objective(cfg.objective))
    trainer = type(f"Recording{trainer_cls.__name__}", (Recording, trainer_cls), {})(cfg)
    sampled = {}
    module_name, names = SAMPLER_PROGRAMS[cfg.rollout.engine]
    module = importlib.import_module(module_name)
    with pytest.MonkeyPatch.context() as patch:
        for name, attribute in names.items():
            real = getattr(module, attribute)

            def call(*args, _real=real, _name=name, **kwargs):
                sampled.setdefault(_name, []).append(_arguments(_real, args, kwargs))
                return _real(*args, **kwargs)

            patch.setattr(module, attribute, call)
        trainer.fit()
    trainer.sampled = sampled
    return trainer


def _plan(*overrides):
    cfg = load_config(TrainConfig, None, [*SMALL, *overrides])
    chips = 4 + cfg.mesh.rollout_devices  # the trainer's mesh, and the sampler's own chips
    spec = resolve_topology(f"v5litepod-{chips}")
    devices = get_devices(spec) if libtpu_available() else jax.devices()[:chips]
    return plan_programs.build_job(cfg, spec, devices=devices)


def _check_same_programs(trainer: RLTrainer, job) -> None:
    expected = {"update", "logprobs"} | (
        {"ref_logprobs"} if trainer.reference is not None else set()
    )
    assert expected <= set(trainer.programs) <= expected | {*ATTRIBUTES, *SPEC_PROGRAMS}
    for name, program in trainer.programs.items():
        planned = job.programs[name]
        assert planned.function == program.builder
        assert planned.calls_per_step == program.calls_per_step == trainer.calls[name], name
        if not program.calls_per_step:
            continue
        lowered = planned.lowered or job.programs[planned.same_as].lowered
        recorded = trainer.seen[name]
        # A LoRA update is lowered with its frozen base as a third argument the trainer's
        # call binds (``train.step.jit_step``).
        planned_args = _signature(lowered.args_info[0][: len(recorded)])
        assert _free_rows(planned_args) == _free_rows(recorded), name
        assert all(len(shape) == 4 for plan in _plans(planned_args) for shape, _ in plan), name
        if packing_mode(trainer.cfg.trainer.packing) == "on":  # the job packed: so did plan
            assert _plans(recorded) and len(_plans(planned_args)) == len(_plans(recorded)), name


def _check_same_sampler_programs(trainer: RLTrainer, job) -> None:
    """The sampler's prefill and decode loop, on the layout both chose: plan lowers them with
    arguments one of the job's calls passed (the rollout's; the evaluations' greedy calls draw
    one sample a prompt, and a continuous engine's admissions and drained bursts are smaller)."""
    assert job.serving.mesh.shape == trainer.serving.mesh.shape
    module_name, names = SAMPLER_PROGRAMS[trainer.cfg.rollout.engine]
    assert set(trainer.sampled) == set(names)
    module = importlib.import_module(module_name)
    for name, recorded in trainer.sampled.items():
        positional, keywords = job.programs[name].lowered.args_info
        planned = _arguments(getattr(module, names[name]), positional, keywords)
        assert planned in recorded, name


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """The default objective (on-policy: no behaviour forward) on the built-in task; its
    exported policy is the other jobs' model."""
    path = tmp_path_factory.mktemp("grpo")
    return _train(path), path / "run" / "hf"


@pytest.mark.slow
def test_plan_lowers_what_the_grpo_job_ran(grpo):
    trainer, hf = grpo
    assert trainer.calls["logprobs"] == 0 and trainer.calls["update"] == 1
    job = _plan(f"model.path={hf}")
    _check_same_programs(trainer, job)
    _check_same_sampler_programs(trainer, job)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plan_lowers_what_the_job_ran(variant, grpo, tmp_path):
    _, hf = grpo
    overrides = (f"model.path={hf}", *(o.replace("{hf}", str(hf)) for o in VARIANTS[variant]))
    trainer = _train(tmp_path, *overrides)
    job = _plan(*overrides)
    _check_same_programs(trainer, job)
    if trainer.cfg.rollout.engine == "continuous" or trainer.cfg.mesh.rollout_devices:
        _check_same_sampler_programs(trainer, job)
