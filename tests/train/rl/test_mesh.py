"""The RL trainer on a data x fsdp x tensor = 2 x 2 x 2 mesh of 8 fake CPU devices (issue 7).

The same config that runs on one device runs unchanged on the mesh: the state is sharded over
every axis, the batch over data x fsdp, and the first step samples and scores the same batch
as the one-device run (same seed, same programs up to the partitioning).
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers

pytestmark = pytest.mark.slow

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def _config(run_dir, *extra):
    return rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        run_dir,
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=2",
        # The tensor axis (2) splits the vocabulary; pad it the same way on one device.
        "model.tiny.vocab_multiple=2",
        *extra,
    )


def _mesh_axes(sharding) -> set[str]:
    axes = set()
    for entry in sharding.spec:
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes - {None}


def test_two_steps_on_a_2x2x2_mesh(tmp_path):
    cfg = _config(tmp_path / "mesh", *MESH)
    trainer = RLTrainer(cfg)
    summary = trainer.fit()

    mesh = trainer.run.mesh
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    leaves = jax.tree.leaves(trainer.state.params)
    assert all(leaf.sharding.mesh.devices.size == 8 for leaf in leaves)
    used = set().union(*(_mesh_axes(leaf.sharding) for leaf in leaves))
    assert {"fsdp", "tensor"} <= used, f"parameters are not sharded over fsdp and tensor: {used}"

    run_dir = pathlib.Path(cfg.run_dir)
    rl_helpers.check_run_dir(run_dir, cfg, summary)
    rows = read_metrics(run_dir)
    rl_helpers.check_rows(rows, cfg)

    # The one-device run of the same config samples the same first batch.
    single_cfg = _config(tmp_path / "single")
    single = RLTrainer(single_cfg).fit()
    first, single_first = rows[0], read_metrics(tmp_path / "single")[0]
    assert summary["eval_before_rl"] == single["eval_before_rl"]
    for key in ("reward_mean", "accuracy", "completion_length_mean", "zero_variance_frac"):
        assert first[key] == single_first[key], key
    for key in ("advantage_std", "entropy", "grad_norm", "loss"):
        assert first[key] == pytest.approx(single_first[key], rel=1e-4, abs=1e-6), key


def test_continuous_engine_rollouts_on_the_mesh_match_one_device(tmp_path):
    """``rollout.engine=continuous`` with 8 slots for 16 rows (refills) over the mesh's 4
    batch shards samples the same first batch as on one device."""
    engine = ("rollout.engine=continuous", "rollout.slots=8", "trainer.max_steps=1")
    cfg = _config(tmp_path / "mesh", *MESH, *engine)
    summary = RLTrainer(cfg).fit()
    single = RLTrainer(_config(tmp_path / "single", *engine)).fit()
    first = read_metrics(pathlib.Path(cfg.run_dir))[0]
    single_first = read_metrics(tmp_path / "single")[0]
    assert summary["eval_before_rl"] == single["eval_before_rl"]
    for key in ("reward_mean", "accuracy", "completion_length_mean", "zero_variance_frac"):
        assert first[key] == single_first[key], key
    assert first["rollout/logprob_diff_max"] < 1e-5


def test_context_parallel_mesh_trains_what_one_device_trains(tmp_path):
    """``mesh.fsdp=2 mesh.sequence=4`` (context parallelism, issue 44): the update's and the
    log-prob forwards' positions split over 4 devices, the weights over all 8; sampling (no
    sequence to split) spreads its rows over the sequence axis too. The first step samples the
    one-device batch and its update (loss, gradient norm, KL-free GRPO terms) agrees."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    extra = ("trainer.max_steps=1", "model.compute_dtype=float32")
    cfg = _config(tmp_path / "cp", "mesh.fsdp=2", "mesh.sequence=4", *extra)
    trainer = RLTrainer(cfg)
    trainer.fit()
    assert dict(trainer.run.mesh.shape) == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    used = set().union(*(_mesh_axes(p.sharding) for p in jax.tree.leaves(trainer.state.params)))
    assert {"fsdp", "sequence"} <= used, used
    RLTrainer(_config(tmp_path / "single", *extra)).fit()
    first = read_metrics(pathlib.Path(cfg.run_dir))[0]
    single_first = read_metrics(tmp_path / "single")[0]
    for key in ("reward_mean", "accuracy", "completion_length_mean"):
        assert first[key] == single_first[key], key
    for key in ("advantage_std", "entropy", "grad_norm", "loss"):
        assert first[key] == pytest.approx(single_first[key], rel=1e-5, abs=1e-6), key
