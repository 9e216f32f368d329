"""``jaxrl-llm plan`` for a LoRA job's auxiliary models, as ``train`` runs them, by hand.

With ``model.lora`` PPO's critic trains its own adapters and a ``[D, 1]`` head over a frozen
backbone, the policy's base itself (``critic.init=policy``: the same arrays, no second copy)
or ``critic.path``'s backbone in the compute dtype (``critic.init=reward_model``); PRIME's PRM
trains its own adapters over the policy's base. The job is test_programs' tiny one (4 x 2
rows, fsdp 4 over 4 of the 8 fake CPU devices) with rank-4 adapters on all seven projections.
"""

import pytest

from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from tests.plan.test_critic_and_reward_model import JOINT, RM_CRITIC, _job
from tests.plan.test_critic_and_reward_model import paths as paths  # noqa: F401 (fixture)
from tests.plan.test_lora import ADAPTER_ELEMENTS_PER_CHIP, SCALARS
from tests.plan.test_programs import TINY_PARAMS

LORA = ("model.lora.rank=4",)
SEPARATE = ("objective.name=ppo", "critic.optimizer=separate")
PRIME = ("objective.name=prime",)
# The policy's adapters a chip, f32 (test_lora); the critic's over the policy's backbone are
# the same seven projections' (its backbone is the policy's less the unembedding).
ADAPTERS = 4 * ADAPTER_ELEMENTS_PER_CHIP  # 22016
# The critic's head [D = 64, 1] f32 over fsdp 4 (its embed axis): 16 a chip.
SCORE = 4 * 64 // 4
# The frozen base, bf16 over fsdp 4.
BASE = 2 * TINY_PARAMS // 4
# test_critic_and_reward_model's reward model (D = 32, one layer, N = 4, K = 2, H = 16,
# F = 64, tied) as a LoRA critic's frozen backbone, bf16 over fsdp 4 (norms included):
# (V D + 12352 + D) x 2 / 4 = (8192 + 12352 + 32) / 2.
RM_BACKBONE = (8192 + 12352 + 32) * 2 // 4
# Its rank-4 adapters a chip: A of q, k, v, gate, up [32, 4] and B of o, down [4, 32] split
# by fsdp 4: 7 x 32 = 224; B of q [4, 64], A of o [64, 4], B of gate, up [4, 64], A of down
# [64, 4]: 256 each, B of k, v [4, 32] 128 each: whole, 1536. f32.
RM_ADAPTERS = 4 * (224 + 1536)
RM_SCORE = 4 * 32 // 4


@pytest.mark.parametrize(
    "overrides, aux_params, aux_optimizer, optimizer",
    [
        # A separate critic: its adapters and head, their two moments and its own scalars.
        (SEPARATE, ADAPTERS + SCORE, 2 * (ADAPTERS + SCORE) + SCALARS, 2 * ADAPTERS + SCALARS),
        # Joint: one state; the critic's moments are its share, the scalars the policy's.
        (JOINT, ADAPTERS + SCORE, 2 * (ADAPTERS + SCORE), 2 * ADAPTERS + SCALARS),
        # From a reward model: its frozen backbone is the critic's own.
        (
            (*RM_CRITIC, "critic.optimizer=separate"),
            RM_BACKBONE + RM_ADAPTERS + RM_SCORE,
            2 * (RM_ADAPTERS + RM_SCORE) + SCALARS,
            2 * ADAPTERS + SCALARS,
        ),
        # PRIME: the PRM's adapters over the policy's base.
        (PRIME, ADAPTERS, 2 * ADAPTERS + SCALARS, 2 * ADAPTERS + SCALARS),
    ],
)
def test_lora_aux_state_by_hand(paths, overrides, aux_params, aux_optimizer, optimizer):
    job = _job(paths, *overrides, *LORA)
    state = job.state
    assert job.aux.config.lora is not None
    assert state.params == ADAPTERS and state.optimizer == optimizer
    assert state.base == BASE and state.reference == 0  # one base: policy, reference, critic
    assert state.aux_params == aux_params
    assert state.aux_optimizer == aux_optimizer


CASES = [SEPARATE, JOINT, (*RM_CRITIC, "critic.optimizer=separate"), (*JOINT, *RM_CRITIC[1:])]
CASES += [PRIME, (*SEPARATE, "rollout.tensor_parallel=trainer")]


@pytest.mark.parametrize("overrides", CASES)
def test_every_lora_aux_program_counts_the_resident_state_once(paths, overrides):
    """The base is counted once in every program: the critic's forward and update take its
    backbone view (the rest of the base, the unembedding, alive beside them), the PRM's the
    whole base; the base's serving copy is alive around the auxiliary programs too."""
    job = _job(paths, *overrides, *LORA)
    state = job.state
    served_adapters = (
        job.programs["reshard"].inner_parts["sampler_weights"] if ("reshard" in job.programs) else 0
    )
    for name, program in job.programs.items():
        alive = dict(program.resident)
        for part in (*program.argument_parts, *program.inner_parts):
            nbytes = program.argument_parts.get(part, 0) + program.inner_parts.get(part, 0)
            alive[part] = alive.get(part, 0) + nbytes
        assert alive["parameters"] == state.params, name
        assert alive["optimizer_state"] == state.optimizer, name
        assert alive["frozen_base"] == state.base, name
        assert alive["aux_model"] == state.aux, name
        if not job.serving.is_trainer_layout and name not in ("prefill", "decode_step", "reshard"):
            assert alive["sampler_weights"] == state.serving_base, name
        elif not job.serving.is_trainer_layout:
            assert alive["sampler_weights"] == state.serving_base + served_adapters, name
    if RM_CRITIC[2] in overrides or "critic.init=reward_model" in overrides:
        return
    taken = {"values": BASE - 2 * 256 * 64 // 4, "prm_update": BASE, "prm_logprobs": BASE}
    taken["critic_update"] = taken["values"]  # the backbone view: the base less lm_head
    for name, nbytes in taken.items():
        if name in job.programs:
            assert job.programs[name].argument_parts["frozen_base"] == nbytes, name


AUX_PROGRAMS = ("values", "critic_update", "update", "prm_update")


@pytest.mark.parametrize("overrides", [SEPARATE, JOINT, PRIME])
def test_lora_aux_compile_matches_the_accounting(paths, overrides):
    """Compiled on CPU devices: each auxiliary program's arguments are the parts the
    accounting names plus the same inputs (batches, sequences) as the full-training job's
    program: the frozen half is what the accounting says it is. A joint update takes the
    base's arrays twice (as the policy's and the critic's frozen halves): counted once."""
    lora_job, full_job = _job(paths, *overrides, *LORA), _job(paths, *overrides)
    for name in AUX_PROGRAMS:
        if name not in lora_job.programs or (name == "update") != (JOINT[1] in overrides):
            continue  # a joint critic's programs: its update (its values are the separate's)
        inputs = []
        for job in (lora_job, full_job):
            program = job.programs[name]
            memory = est.memory_breakdown(program.lowered.compile())
            arguments = memory.argument_bytes - program.shared_argument_bytes
            inputs.append(arguments - sum(program.argument_parts.values()))
            parts = pr.memory_parts(program, memory)
            assert sum(parts.values()) == (
                memory.total_bytes - program.shared_argument_bytes + sum(program.resident.values())
            ), name
        assert inputs[0] == inputs[1] > 0, name
    if JOINT[1] in overrides:  # the base's view passed a second time
        shared = lora_job.programs["update"].shared_argument_bytes
        assert shared == BASE - 2 * 256 * 64 // 4


def test_lora_aux_flops_count_the_adapters_not_the_base_gradients(paths):
    """The LoRA critic's update does its backbone's forward and activation gradients plus the
    adapters' (``flops.train_flops`` of a LoRA config), less than full training's."""
    lora_job, full_job = _job(paths, *SEPARATE, *LORA), _job(paths, *SEPARATE)
    for name in ("critic_update", "prm_update"):
        if name in lora_job.programs:
            assert lora_job.programs[name].flops < full_job.programs[name].flops, name
    prime, full_prime = _job(paths, *PRIME, *LORA), _job(paths, *PRIME)
    assert prime.programs["prm_update"].flops < full_prime.programs["prm_update"].flops
    report = pr.summarise(
        lora_job,
        {n: pr._program_report(lora_job, p, None) for n, p in lora_job.programs.items()},
        skipped_compile=True,
    )
    assert report["critic"]["lora"] is True and report["critic"]["init"] == "policy"
    text = format_report(report)
    assert "LoRA: its adapters and head trained over the policy's frozen base" in text
