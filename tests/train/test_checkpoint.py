"""orbax checkpoints of a sharded TrainState on 8 fake CPU devices.

Round trips keep values and shardings; only the last ``keep`` steps stay; references are saved
only when given and found again for later steps; a process killed mid-save leaves the previous
step loadable, and the half-written step is named and removed when the directory is opened.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.parallel import make_mesh
from jaxrl_llm.train.checkpoint import Checkpointer, committed_steps, interrupted_steps
from jaxrl_llm.train.state import TrainState

PARAM_SPECS = {"embed": P("fsdp", "tensor"), "mlp": {"w": P("data", None), "b": P()}}


def _build_state(rng: np.random.Generator, mesh, *, seed: int = 7) -> TrainState:
    """A TrainState-like pytree: sharded params, a (non-trivial) adam state, a typed key."""
    specs = jax.tree.map(lambda s: NamedSharding(mesh, s), PARAM_SPECS)
    params = {
        "embed": rng.normal(size=(8, 4)).astype(np.float32),
        "mlp": {
            "w": rng.normal(size=(4, 6)).astype(np.float32),
            "b": rng.normal(size=(6,)).astype(np.float32),
        },
    }
    params = jax.device_put(params, specs)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    _, opt_state = optimizer.update(grads, opt_state, params)
    replicated = NamedSharding(mesh, P())
    # mu / nu inherit the parameter shardings; the count is a scalar: replicate it.
    opt_state = jax.tree.map(
        lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
        opt_state,
    )
    return TrainState(
        step=jax.device_put(jnp.asarray(5, jnp.int32), replicated),
        params=params,
        opt_state=opt_state,
        rng=jax.device_put(jax.random.key(seed), replicated),
    )


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _plain(state: TrainState):
    """Host copies (keys as key data) for value comparisons."""
    return jax.device_get(state._replace(rng=jax.random.key_data(state.rng)))


def _shifted(tree, amount: float):
    return jax.tree.map(lambda x: x + amount, tree)


def _with_params_shifted(state: TrainState, amount: float) -> TrainState:
    return state._replace(params=_shifted(state.params, amount))


def _step_dirs(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n != "reference")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(2, 2, 2)


@pytest.fixture
def state(rng, mesh):
    return _build_state(rng, mesh)


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_keeps_values_and_shardings(tmp_path, state, async_save):
    with Checkpointer(tmp_path / "ckpt", async_save=async_save) as ckpt:
        ckpt.save(3, state, extra={"position": 12})
    with Checkpointer(tmp_path / "ckpt") as fresh:
        assert fresh.latest_step() == 3
        restored, extra, reference = fresh.restore(abstract_state=_abstract(state))
    assert extra == {"position": 12}
    assert reference is None
    assert isinstance(restored, TrainState)
    chex.assert_trees_all_equal(_plain(restored), _plain(state))
    chex.assert_trees_all_equal_shapes_and_dtypes(restored, state)
    expected = jax.tree.map(lambda x: x.sharding, state)
    got = jax.tree.map(lambda x: x.sharding, restored)
    assert jax.tree.leaves(got) == jax.tree.leaves(expected)
    assert restored.params["embed"].sharding.spec == P("fsdp", "tensor")
    assert restored.rng.dtype == state.rng.dtype  # a typed key comes back typed


def test_restore_into_other_shardings(tmp_path, state, mesh):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        other = jax.tree.map(lambda x: NamedSharding(mesh, P()), state)
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, other
        )
        restored, _, _ = ckpt.restore(1, abstract_state=abstract)
    assert all(x.sharding.spec == P() for x in jax.tree.leaves(restored))
    chex.assert_trees_all_equal(_plain(restored), _plain(state))


def test_concrete_arrays_stand_for_their_abstract(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        restored, _, _ = ckpt.restore(abstract_state=state)
    chex.assert_trees_all_equal(_plain(restored), _plain(state))


def test_async_save_copies_before_returning(tmp_path, rng, mesh):
    state = _build_state(rng, mesh)
    expected = _plain(state)
    ckpt = Checkpointer(tmp_path, async_save=True)
    abstract = _abstract(state)
    ckpt.save(1, state)
    # The caller may donate the state right after save returns: free every buffer.
    for leaf in jax.tree.leaves(state):
        leaf.delete()
    ckpt.wait()
    assert _step_dirs(tmp_path) == ["1"]  # committed: no temporary directory left
    restored, _, _ = ckpt.restore(abstract_state=abstract)
    chex.assert_trees_all_equal(_plain(restored), expected)
    ckpt.close()


def test_keep_last_n(tmp_path, state):
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, _with_params_shifted(state, step))
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
        assert _step_dirs(tmp_path) == ["4", "5"]
        restored, _, _ = ckpt.restore(4, abstract_state=_abstract(state))
        chex.assert_trees_all_equal(
            restored.params, jax.device_get(_with_params_shifted(state, 4).params)
        )
        with pytest.raises(FileNotFoundError, match=r"step 3 .* available steps: \[4, 5\]"):
            ckpt.restore(3, abstract_state=_abstract(state))


def test_extra_json_round_trip(tmp_path, state):
    extra = {
        "sampler": {"epoch": 2, "position": np.int64(17), "order_seed": 3},
        "eval_before_rl": {"accuracy": np.float32(0.25), "reward": jnp.asarray(0.5)},
        "history": (1, 2.5, None, True, "text"),
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, extra=extra)
        ckpt.save(2, state)
        _, restored, _ = ckpt.restore(1, abstract_state=_abstract(state))
        _, empty, _ = ckpt.restore(2, abstract_state=_abstract(state))
    assert restored == {
        "sampler": {"epoch": 2, "position": 17, "order_seed": 3},
        "eval_before_rl": {"accuracy": 0.25, "reward": 0.5},
        "history": [1, 2.5, None, True, "text"],
    }
    assert empty == {}


def test_extra_must_be_json(tmp_path, state):
    ckpt = Checkpointer(tmp_path / "c")
    with pytest.raises(ValueError, match=r"extra\['bad'\]: object is not JSON"):
        ckpt.save(1, state, extra={"bad": object()})
    with pytest.raises(ValueError, match="JSON keys must be strings"):
        ckpt.save(1, state, extra={1: 2})
    with pytest.raises(ValueError, match=r"extra\['a'\]: ndarray"):
        ckpt.save(1, state, extra={"a": np.zeros(3)})
    assert not (tmp_path / "c").exists()  # rejected before anything was written


# -- reference parameters ------------------------------------------------------------------------


def test_reference_saved_only_when_given(tmp_path, state):
    ref_a, ref_b = _shifted(state.params, 100.0), _shifted(state.params, 200.0)
    with Checkpointer(tmp_path, keep=10) as ckpt:
        ckpt.save(1, state, reference_params=ref_a)
        ckpt.save(2, state)
        ckpt.save(3, state, reference_params=ref_b)
        ckpt.save(4, state)
        ckpt.wait()
        assert ckpt.reference_steps() == [1, 3]
        assert sorted(os.listdir(tmp_path / "reference")) == ["1", "3"]
        abstract, abstract_ref = _abstract(state), _abstract(state.params)
        for step, want in [(1, ref_a), (2, ref_a), (3, ref_b), (4, ref_b)]:
            _, _, ref = ckpt.restore(step, abstract_state=abstract, abstract_reference=abstract_ref)
            chex.assert_trees_all_equal(ref, jax.device_get(want))
            assert ref["embed"].sharding == state.params["embed"].sharding
        _, _, skipped = ckpt.restore(4, abstract_state=abstract)
        assert skipped is None


def test_no_reference_saved_gives_none(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        _, _, ref = ckpt.restore(
            abstract_state=_abstract(state), abstract_reference=_abstract(state.params)
        )
    assert ref is None


def test_reference_outlives_the_steps_it_was_saved_with(tmp_path, state):
    ref_a, ref_b = _shifted(state.params, 1.0), _shifted(state.params, 2.0)
    with Checkpointer(tmp_path, keep=2) as ckpt:
        ckpt.save(1, state, reference_params=ref_a)
        for step in range(2, 6):
            ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5] and ckpt.reference_steps() == [1]
        _, _, ref = ckpt.restore(
            abstract_state=_abstract(state), abstract_reference=_abstract(state.params)
        )
        chex.assert_trees_all_equal(ref, jax.device_get(ref_a))
        # Once no kept step needs reference 1, it goes.
        ckpt.save(6, state, reference_params=ref_b)
        ckpt.save(7, state)
        ckpt.save(8, state)
        ckpt.wait()
        assert ckpt.all_steps() == [7, 8] and ckpt.reference_steps() == [6]


# -- step order, errors --------------------------------------------------------------------------


def test_saving_an_old_step_needs_force(tmp_path, state):
    ref_a, ref_b = _shifted(state.params, 1.0), _shifted(state.params, 2.0)
    with Checkpointer(tmp_path, keep=5) as ckpt:
        ckpt.save(1, state, reference_params=ref_a)
        ckpt.save(2, _with_params_shifted(state, 2.0))
        ckpt.save(3, _with_params_shifted(state, 3.0), reference_params=ref_b)
        with pytest.raises(ValueError, match="already holds step 3.*force=True"):
            ckpt.save(2, state)
        with pytest.raises(ValueError, match="already holds step 3"):
            ckpt.save(3, state)
        # Resume from step 2 on purpose: steps 2.. and references after 2 are replaced.
        ckpt.save(2, _with_params_shifted(state, 20.0), force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2] and ckpt.reference_steps() == [1]
        restored, _, ref = ckpt.restore(
            abstract_state=_abstract(state), abstract_reference=_abstract(state.params)
        )
    chex.assert_trees_all_equal(
        restored.params, jax.device_get(_with_params_shifted(state, 20.0).params)
    )
    chex.assert_trees_all_equal(ref, jax.device_get(ref_a))


def test_missing_directory_and_no_checkpoint(tmp_path, state):
    missing = tmp_path / "missing"
    ckpt = Checkpointer(missing)
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.restore(abstract_state=_abstract(state))
    assert not missing.exists()  # looking does not create it
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        Checkpointer(empty).restore(abstract_state=_abstract(state))


def test_bad_arguments(tmp_path, state):
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpointer(tmp_path, keep=0)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="non-negative int"):
        ckpt.save(-1, state)
    ckpt.save(1, state)
    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(ValueError, match=r"abstract_state\.step has no sharding"):
        ckpt.restore(abstract_state=no_sharding)
    with pytest.raises(ValueError, match="must be a jax.ShapeDtypeStruct"):
        ckpt.restore(abstract_state=jax.device_get(state))
    wrong = _abstract(state)._replace(
        params={**_abstract(state.params), "embed": _abstract(state.params["embed"][:4])}
    )
    # Named before any read starts (orbax would find it mid-read).
    with pytest.raises(
        ValueError,
        match=r"does not match abstract_state: params\.embed has shape \(\d+, \d+\) "
        r"there, \(4, \d+\) here",
    ):
        ckpt.restore(abstract_state=wrong)
    ckpt.close()


# -- killed mid-save -----------------------------------------------------------------------------

_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from orbax.checkpoint._src.path import atomicity
    from jaxrl_llm.train.checkpoint import Checkpointer, committed_steps, interrupted_steps
    from jaxrl_llm.train.state import TrainState

    directory, mode = sys.argv[1], sys.argv[2]
    def state(value, size):
        params = {"w": jnp.full((size,), value, jnp.float32)}
        return TrainState(jnp.asarray(0, jnp.int32), params, (), jax.random.key(0))

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt = Checkpointer(directory, keep=3, async_save=True)
    ckpt.save(1, state(1.0, 1024), reference_params={"w": jnp.full((1024,), -1.0)})
    ckpt.wait()
    if mode == "before_rename":
        # Everything written, the rename to the final name never happens.
        atomicity.AtomicRenameTemporaryPath.finalize = die
        ckpt.save(2, state(2.0, 1024))
        ckpt.wait()
    elif mode == "while_writing":
        # 64 MiB still being written by the background thread when the process dies: killed
        # once the save's temporary directory exists (on a busy machine the thread may not
        # have started yet right after save returns).
        ckpt.save(2, state(2.0, 16 * 1024 * 1024))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            ".orbax-checkpoint-tmp" in name for name in os.listdir(directory)
        ):
            time.sleep(0.001)
        die()
    elif mode == "after_reference":
        # The new reference is committed, the state step that needs it never starts.
        ckpt._state_manager.save = die
        ckpt.save(2, state(2.0, 1024), reference_params={"w": jnp.full((1024,), -2.0)})
    print("not killed")
    """
)


def _crash(directory, mode: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(directory), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr[-3000:]


def _abstract_crash_state(size: int = 1024):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding),
        params={"w": jax.ShapeDtypeStruct((size,), jnp.float32, sharding=sharding)},
        opt_state=(),
        rng=jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding),
    )


@pytest.mark.parametrize("mode", ["before_rename", "while_writing", "after_reference"])
def test_killed_during_save_leaves_previous_step_loadable(tmp_path, mode, caplog):
    _crash(tmp_path, mode)
    if mode == "after_reference":
        assert sorted(os.listdir(tmp_path / "reference")) == ["1", "2"]
    else:
        assert any(".orbax-checkpoint-tmp" in name for name in os.listdir(tmp_path))
    # Read without opening (what a failed run reports): step 1 complete, step 2 never finished.
    assert committed_steps(tmp_path) == [1]
    assert interrupted_steps(tmp_path) == ([] if mode == "after_reference" else [2])
    abstract = _abstract_crash_state()
    abstract_ref = {"w": abstract.params["w"]}
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm.train.checkpoint"):
        ckpt = Checkpointer(tmp_path, keep=3)
    incomplete = (
        f"checkpoint step 2 in {tmp_path} is incomplete (its write never finished): removing "
        "it; the latest complete checkpoint is step 1"
    )
    assert (incomplete in caplog.text) == (mode != "after_reference"), caplog.text
    assert interrupted_steps(tmp_path) == []
    with ckpt:
        assert ckpt.all_steps() == [1]
        restored, _, ref = ckpt.restore(abstract_state=abstract, abstract_reference=abstract_ref)
        np.testing.assert_array_equal(restored.params["w"], np.ones(1024, np.float32))
        np.testing.assert_array_equal(ref["w"], np.full(1024, -1.0, np.float32))
        # The run goes on from step 1 and saves step 2 again, without a new reference: the
        # leftover of the killed save must neither block it nor stand in for step 2's reference.
        ckpt.save(2, restored._replace(params={"w": restored.params["w"] * 3}))
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2] and ckpt.reference_steps() == [1]
        restored, _, ref = ckpt.restore(abstract_state=abstract, abstract_reference=abstract_ref)
    np.testing.assert_array_equal(restored.params["w"], np.full(1024, 3.0, np.float32))
    np.testing.assert_array_equal(ref["w"], np.full(1024, -1.0, np.float32))
    assert not any(".orbax-checkpoint-tmp" in name for name in os.listdir(tmp_path))
