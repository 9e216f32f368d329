"""RL runs with ``trainer.packing`` (issue 44, item 1): the policy's update, behaviour and
reference forwards run over packed rows and train what the padded run trains.

The reference is the padded run of the same config (whose forward is checked against
transformers elsewhere): two off-policy steps (two minibatches, so the behaviour forward runs),
two micro-batches, a KL term (the reference forward), float32; the metrics and the parameters
after both steps agree to float rounding. No SFT warm-up but for the token budget: the
untrained policy's shaped rewards already differ within groups (a learning signal), and nearly
half its completions stop before the limit (sequences of many lengths to pack). On 8 fake
devices (fsdp 4 x data 2), each of the 8 batch shards packs its own rows, and whole groups
move between shards to even out the frozen forwards' tokens (each minibatch still holds the
rows it would have held as drawn).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import make_objective
from jaxrl_llm.train.rl.run import trainer_class
from tests.train.rl import rl_helpers

pytestmark = pytest.mark.slow

KEYS = ("loss", "pg_loss", "grad_norm", "kl", "entropy", "ratio_mean", "clip_frac")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def recorder(base: type) -> type:
    """``base`` recording the shape of every packing plan it makes (None: padded) and every
    minibatch layout (``balanced``: the rows as drawn, as laid out, and their lengths)."""

    def packing_plan(self, *args):
        plan = base.packing_plan(self, *args)
        self.__dict__.setdefault("plans", []).append(None if plan is None else plan.source.shape)
        return plan

    def balanced(self, part, lengths):
        laid_out = base.balanced(self, part, lengths)
        self.__dict__.setdefault("layouts", []).append((part, laid_out, lengths))
        return laid_out

    def balanced_groups(self, samples):
        moved, drawn = base.balanced_groups(self, samples)
        tokens = samples.prompt_mask.sum(axis=1) + samples.completion_mask.sum(axis=1)
        self.__dict__.setdefault("groups", []).append((tokens, drawn))
        return moved, drawn

    methods = {"packing_plan": packing_plan, "balanced": balanced}
    methods["balanced_groups"] = balanced_groups
    return type(f"Recording{base.__name__}", (base,), methods)


def _check_balanced(layouts, shards: int, micro: int) -> None:
    """Every minibatch laid out from its drawn rows with each (shard, micro-batch) cell's
    tokens within one row's length of every other cell's, never further apart than as drawn,
    and closer in some minibatch."""

    def spread(order, lengths):
        cells = lengths[order].reshape(shards, -1, micro).sum(axis=1)  # [shard, micro]
        return cells.max() - cells.min()

    closer = False
    for drawn, laid_out, lengths in layouts:
        assert sorted(laid_out.tolist()) == sorted(drawn.tolist())
        assert spread(laid_out, lengths) <= lengths[laid_out].max()
        assert spread(laid_out, lengths) <= spread(drawn, lengths)
        closer |= spread(laid_out, lengths) < spread(drawn, lengths)
    assert closer


def _check_groups_balanced(groups, shards: int, size: int) -> None:
    """Every step's frozen forwards ran over whole groups moved so that no data shard's tokens
    are further from another's than as drawn, and closer in some step."""

    def spread(tokens):
        per_shard = tokens.reshape(shards, -1).sum(axis=1)
        return per_shard.max() - per_shard.min()

    closer = False
    for tokens, drawn in groups:
        if drawn is None:
            continue
        assert sorted(drawn.tolist()) == list(range(len(tokens)))
        starts = drawn.reshape(-1, size)
        assert (starts % size == 0)[:, 0].all() and (np.diff(starts, axis=1) == 1).all()
        assert spread(tokens[drawn]) <= spread(tokens)
        closer |= spread(tokens[drawn]) < spread(tokens)
    assert closer


def _run(path, packing, *extra):
    cfg = rl_helpers.tiny_config(
        None,
        path,
        rl_helpers.SHAPED_REWARDS,
        "sft_warmup.steps=0",
        "trainer.max_steps=2",
        "trainer.minibatches=2",
        "trainer.micro_batches=2",
        "model.compute_dtype=float32",
        "checkpoint.every_steps=1000",
        f"trainer.packing={packing}",
        *(extra or ("trainer.micro_batch_tokens=null",)),
    )
    trainer = recorder(trainer_class(make_objective(cfg.objective)))(cfg)
    trainer.fit()
    params = jax.device_get(trainer.state.params)
    return trainer, read_metrics(path), params


@pytest.mark.parametrize(
    "extra",
    [
        (),
        (
            "mesh.data=2",
            "mesh.fsdp=4",
            "rollout.prompts_per_step=16",  # two rows a (shard, micro-batch) cell to lay out
            "trainer.micro_batch_tokens=null",
        ),
        # A token budget (48 positions a device: two padded rows of 8 + 16): the packed run
        # counts packed rows (two or three short sequences a row), so it runs fewer
        # micro-batches than the padded one for the same update. Warmed up, the policy ends
        # most completions well before 16 tokens (untrained, most run to the limit).
        (
            "trainer.micro_batch_tokens=48",
            "trainer.micro_batches=1",
            "rollout.max_new_tokens=16",
            "sft_warmup.steps=50",
        ),
    ],
    ids=["one_device", "eight_devices", "token_budget"],
)
def test_packed_run_trains_what_the_padded_run_trains(tmp_path, extra):
    if "mesh.fsdp=4" in extra and jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    padded, padded_rows, padded_params = _run(tmp_path / "padded", "off", *extra)
    packed, packed_rows, packed_params = _run(tmp_path / "packed", "on", *extra)
    assert padded.plans == [None] * 6
    assert all((drawn == laid_out).all() for drawn, laid_out, _ in padded.layouts)
    assert all(drawn is None for _, drawn in padded.groups)  # padded: the groups as drawn
    # Per step: the behaviour forward's plan and the two minibatches'.
    shards = 8 if "mesh.fsdp=4" in extra else 1
    assert len(packed.plans) == 6
    assert all(p is not None and p[1] == shards for p in packed.plans)
    if "trainer.micro_batch_tokens=48" in extra:
        assert all(
            packed["micro_batches"] < padded["micro_batches"]
            for padded, packed in zip(padded_rows, packed_rows, strict=True)
        )
    else:
        assert all(p[0] in (1, 2) for p in packed.plans)
        _check_balanced(packed.layouts, shards, 2)
    if shards > 1:  # 16 groups of 4 over 8 shards: two groups a shard, moved to balance
        _check_groups_balanced(packed.groups, shards, 4)
    else:
        assert all(drawn is None for _, drawn in packed.groups)
    assert len(packed.layouts) == 4  # two minibatches a step
    _check_same(padded_rows, packed_rows, padded_params, packed_params, KEYS)


def _check_same(padded_rows, packed_rows, padded_params, packed_params, keys):
    for want, got in zip(padded_rows, packed_rows, strict=True):
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for want, got in zip(jax.tree.leaves(padded_params), jax.tree.leaves(packed_params)):
        np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("optimizer", ["separate", "joint"])
def test_packed_ppo_trains_what_the_padded_ppo_trains(tmp_path, optimizer):
    """PPO's critic update reads the policy's packing plans (its step micro-batches alike):
    the critic's loss, gradient and weights match the padded run's too."""
    extra = ("objective.name=ppo", f"critic.optimizer={optimizer}", "critic.warmup_steps=0")
    padded, padded_rows, _ = _run(tmp_path / "padded", "off", *extra)
    packed, packed_rows, _ = _run(tmp_path / "packed", "on", *extra)
    assert all(p is not None for p in packed.plans)
    keys = ("loss", "grad_norm", "vf_loss") + (("vf_grad_norm",) if optimizer == "separate" else ())
    critic = "value_state" if optimizer == "separate" else "state"
    padded_params = jax.device_get(getattr(padded, critic).params)
    packed_params = jax.device_get(getattr(packed, critic).params)
    _check_same(padded_rows, packed_rows, padded_params, packed_params, keys)
