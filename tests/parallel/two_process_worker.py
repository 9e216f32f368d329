"""One of the two JAX processes launched by ``test_two_process.py`` (4 CPU devices each).

Run as ``python -m tests.parallel.two_process_worker`` with ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES=2`` and ``JAX_PROCESS_ID`` set; prints one JSON line with what it computed.
The problem and the jitted step live here so the test can run the very same code on one process.
"""

from __future__ import annotations

import json

import numpy as np

GLOBAL_BATCH = 16
FEATURES = 8
HIDDEN = 4


def global_problem() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The global batch (``x [16, 8]`` f32, ``mask [16]`` bool, a scalar), weight ``[8, 4]``."""
    rng = np.random.default_rng(7)
    batch = {
        "x": rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32),
        "mask": rng.random(GLOBAL_BATCH) < 0.7,
        "scale": np.float32(0.5),
    }
    weight = rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32)
    return batch, weight


def run(mesh):
    """Shards this process's rows and the fsdp-sharded weight, runs one jitted global step.

    Returns a dict of plain Python values (identical on every process).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm.parallel import (
        ACTIVATION_RULES,
        PARAM_RULES,
        logical_to_sharding,
        process_local_slice,
        shard_batch,
        with_logical_constraint,
    )

    batch, weight = global_problem()
    rows = process_local_slice(GLOBAL_BATCH, mesh)
    local = {k: (v[rows] if np.ndim(v) else v) for k, v in batch.items()}
    sharded = shard_batch(local, mesh)
    w_sharding = logical_to_sharding(("embed", "mlp"), mesh, PARAM_RULES, shapes=weight.shape)
    w = jax.make_array_from_callback(weight.shape, w_sharding, lambda index: weight[index])

    def step(b, w):
        hidden = with_logical_constraint(jnp.tanh(b["x"] @ w), ("batch", "mlp"), ACTIVATION_RULES)
        masked = jnp.where(b["mask"][:, None], hidden, 0.0)
        return {
            "x_sum": b["x"].sum(),
            "loss": b["scale"] * masked.sum() / jnp.maximum(b["mask"].sum(), 1),
            "hidden": hidden,
        }

    replicated = NamedSharding(mesh, PartitionSpec())
    with jax.set_mesh(mesh):
        out = jax.jit(step, out_shardings=replicated)(sharded, w)
    own_rows = [
        np.asarray(shard.data).tolist()
        for shard in sorted(sharded["x"].addressable_shards, key=lambda s: s.index[0].start)
    ]
    return {
        "rows": [rows.start, rows.stop],
        "x_spec": str(sharded["x"].sharding.spec),
        "w_spec": str(w.sharding.spec),
        "x_shape": list(sharded["x"].shape),
        "own_rows_match": bool(
            np.array_equal(np.concatenate(own_rows, axis=0), batch["x"][rows])
            if own_rows
            else False
        ),
        "x_sum": float(np.asarray(out["x_sum"].addressable_data(0))),
        "loss": float(np.asarray(out["loss"].addressable_data(0))),
        "hidden": np.asarray(out["hidden"].addressable_data(0)).tolist(),
    }


def main() -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxrl_llm.parallel import initialize_distributed, make_mesh

    info = initialize_distributed(initialization_timeout=300)
    mesh = make_mesh(data=2, fsdp=4)
    result = run(mesh)
    result.update(info._asdict())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
