"""``jaxrl-llm plan`` for PPO's joint optimizer, a critic initialised from a reward model and a
learned reward model (``reward_model.path``), as ``train`` runs them, by hand.

* ``critic.optimizer=joint`` (``PPOTrainer``): one train state over ``{"policy", "value"}``
  under the trainer's AdamW; the update is the joint step (both models' forward and backward),
  no ``critic_update``; the state's bytes are split by model, each counted once.
* ``critic.init=reward_model``: the critic has the architecture of ``critic.path``'s
  ``config.json`` (here a smaller model than the policy), in ``model.param_dtype``.
* ``reward_model.path``: the reward model stays on device all run in the compute dtype (the
  ``reward_model`` part of every program) and scores the rollout batch once a step
  (``rm_scores``: its backbone over ``B x (P + T)`` positions, no unembedding).

The job is test_programs' tiny one (4 x 2 rows, 16 + 8 tokens, fsdp 4 over 4 of the 8 fake CPU
devices); the reward model's directory holds only a ``config.json``, as plan reads nothing else.
"""

import dataclasses
import json

import jax
import pytest

from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import flops
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import GiB, libtpu_available, resolve_topology
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig
from tests.plan.test_programs import SCALARS, TINY, TINY_PARAMS

V5E_4 = resolve_topology("v5litepod-4")
needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)

# A reward model smaller than the policy, on its vocabulary: D=32, F=64, one layer, N=4, K=2,
# H=16, saved as a sequence classifier with one label (what heads.save_scalar_model writes).
RM = {
    **TINY,
    "architectures": ["LlamaForSequenceClassification"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
    "pad_token_id": 0,
}
# Its backbone (tied: no lm_head) and head: V D + L (2 D + D N H + 2 D K H + N H D + 3 D F)
# + D (final norm) + D (score) = 8192 + (64 + 2048 + 2048 + 2048 + 6144) + 32 + 32.
RM_PARAMS = 8192 + 12352 + 32 + 32
# The policy-architecture critic: the policy less its unembedding (V D), plus a [D, 1] head.
CRITIC_PARAMS = TINY_PARAMS - 256 * 64 + 64
# Rows 8 = 2 a chip; P = 16, T = 8: 24 positions a row, 192 in all.
ROWS, SEQ, T = 8, 24, 8
# Matmul weights a token passes through in one layer, D (N H + 2 K H) + N H D + 3 D F:
RM_LAYER = 32 * (64 + 64) + 64 * 32 + 3 * 32 * 64  # 12288
POLICY_LAYER = 64 * (64 + 64) + 64 * 64 + 3 * 64 * 128  # 36864
# Causal (query, key) pairs: 24 x 25 / 2 a row; 4 N H FLOPs a pair and layer.
PAIRS = ROWS * 24 * 25 // 2
# The reward model's scoring forward: 2 N a token (N = its layers' weights), attention, no
# unembedding (the head's 2 D a row is left out).
RM_FORWARD = 2 * RM_LAYER * ROWS * SEQ + 4 * 4 * 16 * PAIRS  # 4718592 + 614400
# The policy's forward, its unembedding at the T completion positions, and its backbone alone.
POLICY_BACKBONE = 2 * 2 * POLICY_LAYER * ROWS * SEQ + 2 * 4 * 4 * 16 * PAIRS
POLICY_FORWARD = POLICY_BACKBONE + ROWS * T * 2 * 64 * 256


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "config.json").write_text(json.dumps(TINY))
    (root / "rm").mkdir()
    (root / "rm" / "config.json").write_text(json.dumps(RM))
    (root / "other_vocab").mkdir()
    (root / "other_vocab" / "config.json").write_text(json.dumps({**RM, "vocab_size": 512}))
    return {"policy": str(root / "config.json"), "rm": str(root / "rm"), "root": root}


def _job(paths, *overrides):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"model.architecture={paths['policy']}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "data.max_prompt_tokens=12",
            "rollout.max_new_tokens=8",
            "mesh.fsdp=4",
            *(o.format(rm=paths["rm"], root=paths["root"]) for o in overrides),
        ],
    )
    return pr.build_job(cfg, V5E_4, devices=jax.devices()[:4])


JOINT = ("objective.name=ppo", "critic.optimizer=joint")
RM_CRITIC = ("objective.name=ppo", "critic.init=reward_model", "critic.path={rm}")
REWARD = ("reward_model.path={rm}",)


def test_hand_counts_match_the_formulas():
    from jaxrl_llm.models import ModelConfig, heads, param_count

    rm = ModelConfig.from_hf_dict({**RM, "architectures": ["LlamaForCausalLM"]})
    assert param_count(heads.backbone_config(rm)) + rm.hidden_size == RM_PARAMS == 20608
    assert flops.forward_flops(rm, ROWS, SEQ, logits_positions=0) == RM_FORWARD == 5332992
    policy = ModelConfig.from_hf_dict(TINY)
    assert flops.forward_flops(policy, ROWS, SEQ, logits_positions=T) == POLICY_FORWARD
    assert flops.forward_flops(policy, ROWS, SEQ, logits_positions=0) == POLICY_BACKBONE


# -- a learned reward model ---------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, itemsize",
    [
        ((), 2),  # the compute dtype (bf16 on TPU), whatever the masters' (f32)
        (("model.param_dtype=bfloat16", "model.compute_dtype=float32"), 4),
    ],
)
def test_reward_model_weights_are_resident_in_every_program(paths, overrides, itemsize):
    """``load_reward_model`` keeps the reward model in the compute dtype, split over fsdp 4,
    all run: every program counts it once (its scoring forward as an argument)."""
    job = _job(paths, *REWARD, *overrides)
    assert job.state.reward_model == RM_PARAMS * itemsize // 4
    base = _job(paths, *overrides).state
    assert job.state.resident == base.resident + job.state.reward_model
    assert "rm_scores" in job.programs
    for name, program in job.programs.items():
        alive = program.resident.get("reward_model", 0)
        alive += program.argument_parts.get("reward_model", 0)
        assert alive == job.state.reward_model, name
    assert job.programs["rm_scores"].argument_parts == {"reward_model": job.state.reward_model}


def test_rm_scores_runs_the_reward_models_backbone_over_the_rollout(paths):
    """One scoring forward a step over all B rows of P + T positions with the reward model's
    own architecture (not the policy's): 2 N a token plus causal attention, no unembedding;
    compiled, its arguments are the reward model and the rollout's sequences."""
    job = _job(paths, *REWARD)
    program = job.programs["rm_scores"]
    assert program.calls_per_step == 1
    assert program.flops == program.model_flops == RM_FORWARD
    assert program.tokens == ROWS * T
    memory = est.memory_breakdown(program.lowered.compile())
    # Per chip: the reward model, and 2 rows of prompt tokens 2x16x4, mask 2x16, completion
    # tokens 2x8x4, mask 2x8.
    assert memory.argument_bytes == job.state.reward_model + 240
    parts = pr.memory_parts(program, memory)
    assert parts["reward_model"] == job.state.reward_model and parts["inputs"] == 240
    assert sum(parts.values()) == memory.total_bytes + sum(program.resident.values())


def test_rm_scores_sees_what_the_trainer_keeps_alive_when_it_scores(paths):
    """Without reward workers the learned reward is added inside the rollout, while the
    sampler's serving copy is alive; with them the trainer scores once the log-prob forwards
    are dispatched: their outputs, the sampler's log-probs and the step's sequences are on
    device instead. Multi-turn episodes never score with it: train and plan refuse both."""
    job = _job(paths, *REWARD)
    served = job.programs["reshard"].inner_parts["sampler_weights"]
    assert served > 0
    inline = job.programs["rm_scores"].resident
    assert inline["sampler_weights"] == served and "inputs" not in inline
    # DAPO's dynamic sampling waits for every draw's rewards: inside the rollout too.
    dapo = _job(paths, *REWARD, "objective.name=dapo", "rollout.reward_workers=2")
    assert dapo.programs["rm_scores"].resident["sampler_weights"] == served
    # Deferred, two minibatches (so the behaviour log-probs are recomputed) and a reference:
    # the step's sequences (240 a chip) and three [2, 8] f32 log-prob arrays (64 each).
    deferred = _job(paths, *REWARD, "rollout.reward_workers=2", "trainer.minibatches=2")
    resident = deferred.programs["rm_scores"].resident
    assert resident["sampler_weights"] == 0
    assert resident["inputs"] == 240 + 3 * 64
    with pytest.raises(pr.PlanError, match="needs a learned reward model"):
        _job(paths, *REWARD, "env.name=calculator")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("reward_model.path={root}/other_vocab",), "reward_model.path .* vocab_size 512"),
        (("reward_model.path={root}/nowhere",), "reward_model.path: .*does not exist"),
        (
            ("objective.name=ppo", "critic.init=reward_model", "critic.path={root}/other_vocab"),
            "critic.path .* vocab_size 512",
        ),
    ],
)
def test_reward_model_refusals_name_the_key(paths, overrides, message):
    with pytest.raises(pr.PlanError, match=message):
        _job(paths, *overrides)


# -- PPO's critic: joint optimizer, initialised from a reward model ------------------------


def test_joint_optimizer_is_one_state_split_once(paths):
    """``critic.optimizer=joint``: the policy's and the critic's parameters in one state under
    the trainer's AdamW; the policy's share (its parameters, moments and the state's counters)
    and the critic's (its parameters and moments) add up to the whole state."""
    job = _job(paths, *JOINT)
    aux, state = job.aux, job.state
    assert aux.joint and set(aux.state.params) == {"policy", "value"}
    policy_leaves = jax.tree.leaves(aux.state.params["policy"])
    value_leaves = jax.tree.leaves(aux.state.params["value"])
    assert len(jax.tree.leaves(aux.state.params)) == len(policy_leaves) + len(value_leaves)
    assert set(aux.state.params["value"]) == {"backbone", "score"}
    # f32 over 4 chips: bytes a chip = parameters; two f32 moments each.
    assert state.params == TINY_PARAMS and state.aux_params == CRITIC_PARAMS
    assert state.optimizer == 2 * TINY_PARAMS + SCALARS  # the counters once, with the policy
    assert state.aux_optimizer == 2 * CRITIC_PARAMS
    whole = pr.shard_bytes(aux.state)
    assert state.params + state.optimizer + state.aux == whole
    # The reference copies the policy's parameters only.
    assert state.reference == TINY_PARAMS


def test_joint_optimizer_programs_by_hand(paths):
    """The update is the joint step: both models' forward and backward on the minibatch; no
    ``critic_update``; the ``values`` forward reads the critic's share of the state."""
    job = _job(paths, *JOINT)
    programs = job.programs
    assert "critic_update" not in programs and {"update", "values"} <= set(programs)
    critic_forward = POLICY_BACKBONE  # the critic is the policy's backbone and a head
    assert programs["update"].flops == 3 * (POLICY_FORWARD + critic_forward)
    assert programs["values"].flops == critic_forward
    assert programs["update"].argument_parts == {
        "parameters": job.state.params,
        "optimizer_state": job.state.optimizer,
        "aux_model": job.state.aux,
    }
    assert "aux_model" not in programs["update"].resident


def test_joint_update_compiles_with_the_whole_state_as_its_arguments(paths):
    """Compiled on the CPU devices: the joint update's arguments are the whole state (every
    byte the accounting names: policy, critic and their moments) plus its minibatch; each
    program's parts add up to its peak plus what is resident around it."""
    job = _job(paths, *JOINT)
    outcomes = pr.compile_job(job)
    update = job.programs["update"]
    memory = est.memory_breakdown(outcomes["update"].compiled)
    batch = memory.argument_bytes - sum(update.argument_parts.values())
    # The minibatch (the whole batch: one minibatch) less what the loss does not read.
    assert 0 < batch <= update.resident["inputs"]
    for name, program in job.programs.items():
        parts = pr.memory_parts(program, est.memory_breakdown(outcomes[name].compiled))
        total = est.memory_breakdown(outcomes[name].compiled).total_bytes
        assert sum(parts.values()) == total + sum(program.resident.values()), name
        assert parts["aux_model"] == job.state.aux, name
    report = pr.summarise(
        job,
        {n: pr._program_report(job, p, outcomes[n]) for n, p in job.programs.items()},
        skipped_compile=False,
    )
    assert report["fits"] and report["critic"]["optimizer"] == "joint"
    assert any("critic.optimizer=joint" in a for a in report["assumptions"])


@pytest.mark.parametrize("optimizer", ["separate", "joint"])
def test_critic_from_a_reward_model_has_its_architecture(paths, optimizer):
    """``critic.init=reward_model``: the critic is ``critic.path``'s model (D=32, one layer),
    in ``model.param_dtype``, whatever the policy's architecture; its forward and update
    count its own FLOPs."""
    job = _job(paths, *RM_CRITIC, f"critic.optimizer={optimizer}")
    assert job.aux.config.hidden_size == 32 and job.aux.config.num_hidden_layers == 1
    assert job.aux.source == paths["rm"]
    assert job.state.aux_params == RM_PARAMS  # f32 over 4 chips
    programs = job.programs
    assert programs["values"].flops == RM_FORWARD
    if optimizer == "separate":
        assert 2 * RM_PARAMS < job.state.aux_optimizer <= 2 * RM_PARAMS + SCALARS
        assert programs["critic_update"].flops == 3 * RM_FORWARD
        assert programs["update"].flops == 3 * POLICY_FORWARD
    else:
        assert job.state.aux_optimizer == 2 * RM_PARAMS
        assert programs["update"].flops == 3 * (POLICY_FORWARD + RM_FORWARD)
    bf16 = _job(paths, *RM_CRITIC, f"critic.optimizer={optimizer}", "model.param_dtype=bfloat16")
    assert bf16.state.aux_params == RM_PARAMS // 2


@pytest.mark.parametrize(
    "overrides",
    [
        JOINT,
        RM_CRITIC,
        (*JOINT, *RM_CRITIC[1:]),
        REWARD,
        (*JOINT, *REWARD),
        (*REWARD, "model.lora.rank=4"),
        (*REWARD, "model.lora.rank=4", "rollout.tensor_parallel=trainer"),
    ],
)
def test_every_program_counts_the_whole_resident_state_once(paths, overrides):
    job = _job(paths, *overrides)
    state = job.state
    for name, program in job.programs.items():
        for part in program.argument_parts.keys() & program.resident.keys():
            assert part == "aux_model" and name == "values", (name, part)  # split, not twice
        alive = dict(program.resident)
        for part, nbytes in program.argument_parts.items():
            alive[part] = alive.get(part, 0) + nbytes
        assert alive["parameters"] == state.params, name
        assert alive["optimizer_state"] == state.optimizer, name
        assert alive.get("reference", 0) == state.reference, name
        assert alive.get("aux_model", 0) == state.aux, name
        assert alive.get("reward_model", 0) == state.reward_model, name
        assert alive.get("frozen_base", 0) == state.base, name


def test_the_report_shows_the_critic_and_the_reward_model(paths):
    """Compiled on the CPU devices: the report's JSON and text carry the reward model's part,
    its scoring program and the critic's origin and optimizer."""
    job = _job(paths, *RM_CRITIC, "critic.optimizer=joint", *REWARD)
    outcomes = pr.compile_job(job)
    report = pr.summarise(
        job,
        {n: pr._program_report(job, p, outcomes[n]) for n, p in job.programs.items()},
        skipped_compile=False,
    )
    rm = report["reward_model"]
    assert rm["params"] == RM_PARAMS and rm["dtype"] == "bfloat16"
    assert rm["bytes_per_chip"] == report["resident_bytes"]["reward_model"] == RM_PARAMS // 2
    for name, program in report["programs"].items():
        assert program["memory_bytes"]["reward_model"] == RM_PARAMS // 2, name
    assert report["programs"]["rm_scores"]["flops"] == RM_FORWARD
    assert report["step_breakdown_s"]["rm_scores"] > 0
    critic = report["critic"]
    assert (critic["optimizer"], critic["init"], critic["path"]) == (
        "joint",
        "reward_model",
        paths["rm"],
    )
    assert critic["params"] == RM_PARAMS
    text = format_report(report)
    assert "reward model: " in text and "rm_scores" in text and "  RM  " in text
    assert f"initialised from the reward model {paths['rm']}" in text
    json.dumps(report)


@needs_libtpu
def test_plan_on_tpu_with_a_joint_critic_and_a_reward_model(paths):
    """Deviceless on a v5litepod-4: the joint update, the critic's values, the reward model's
    scoring forward and the rest compile for the TPU and fit."""
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"model.architecture={paths['policy']}",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "data.max_prompt_tokens=12",
            "rollout.max_new_tokens=8",
            "mesh.fsdp=4",
            *(o.format(rm=paths["rm"]) for o in (*RM_CRITIC, "critic.optimizer=joint", *REWARD)),
        ],
    )
    report = pr.plan_job(cfg, V5E_4)
    assert report["fits"] and all(p["compiled"] for p in report["programs"].values())
    assert {"update", "values", "rm_scores"} <= set(report["programs"])
    assert "critic_update" not in report["programs"]
    assert report["programs"]["rm_scores"]["memory_bytes"]["reward_model"] == RM_PARAMS // 2


def test_an_overflowing_scoring_forward_gets_its_own_suggestion(paths):
    job = _job(paths, *REWARD)
    usable = job.spec.usable_hbm_bytes_per_chip
    programs = {
        n: {"total_bytes": 2 * usable if n == "rm_scores" else 1, "compiled": True}
        for n in job.programs
    }
    text = "\n".join(pr.suggestions(job, programs))
    assert "rm_scores" in text and "reward_model.path" in text
    fine = {n: {"total_bytes": 1, "compiled": True} for n in job.programs}
    assert "rm_scores" not in "\n".join(pr.suggestions(job, fine))


@pytest.mark.parametrize("optimizer", ["separate", "joint"])
def test_suggestions_count_the_critic_where_a_setting_changes_it(paths, optimizer):
    """bf16 moments halve the critic's too on the joint optimizer (the trainer's AdamW), not
    on its own (f32 moments whatever trainer.optimizer_state_dtype); bf16 masters halve the
    critic's parameters either way (they are in model.param_dtype)."""
    job = _job(paths, "objective.name=ppo", f"critic.optimizer={optimizer}")
    state = dataclasses.replace(
        job.state,
        params=GiB,
        optimizer=2 * GiB,
        reference=GiB,
        aux_params=2 * GiB,
        aux_optimizer=4 * GiB,
    )
    job = dataclasses.replace(job, state=state)
    programs = {
        n: {"total_bytes": 40 * GiB, "compiled": True, "memory_bytes": {"kv_cache": 0}}
        for n in job.programs
    }
    lines = pr.suggestions(job, programs)
    moments = next(line for line in lines if "optimizer_state_dtype" in line)
    assert ("saves 3.00 GiB" if optimizer == "joint" else "saves 1.00 GiB") in moments
    masters = next(line for line in lines if "model.param_dtype" in line)
    assert "saves 2.00 GiB" in masters and "critic" in masters
