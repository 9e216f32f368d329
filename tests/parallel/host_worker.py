"""One of the two JAX processes of ``test_host.py``'s multi-process test (4 CPU devices each):
``parallel.replicate`` and ``parallel.fetch`` across processes; prints one JSON line."""

from __future__ import annotations

import json

import numpy as np


def main() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxrl_llm import parallel

    parallel.initialize_distributed(initialization_timeout=300)
    trainer = parallel.make_mesh(data=2, fsdp=4)  # spans both processes
    serving = parallel.make_mesh(data=8, fsdp=1, devices=jax.devices()[::-1])
    mine = NamedSharding(
        jax.sharding.Mesh(np.array(jax.local_devices()), ("x",)), PartitionSpec("x")
    )
    # A key committed to the trainer's mesh, as a trainer's state holds it (device_put refuses
    # a typed key for a mesh spanning processes: what replicate works around).
    key = jax.jit(
        lambda: jax.random.key(3), out_shardings=NamedSharding(trainer, PartitionSpec())
    )()
    local = jax.device_put(np.arange(8, dtype=np.float32), mine)  # split over this process
    tree = {"key": key, "t": jnp.float32(0.5), "ids": np.array([1, 2], np.int32), "n": 7}
    out = parallel.replicate(tree, serving)
    target = NamedSharding(serving, PartitionSpec())
    # An array on this process's devices alone, split over them (the same values on each
    # process): replicated whole onto the mesh that spans both.
    whole = parallel.replicate(local, serving)
    rows = jax.device_put(
        np.arange(16, dtype=np.int32).reshape(8, 2),
        NamedSharding(trainer, PartitionSpec(("data", "fsdp"))),
    )
    try:
        parallel.replicate(rows, serving)
        refused = None
    except ValueError as err:
        refused = str(err)
    result = {
        "process": jax.process_index(),
        "on_target": all(leaf.sharding == target for leaf in jax.tree.leaves(out)),
        "key_data": parallel.fetch(jax.random.key_data(out["key"])).tolist(),
        "key_impl_kept": str(jax.random.key_impl(out["key"])) == str(jax.random.key_impl(key)),
        "t": float(parallel.fetch(out["t"])),
        "ids": parallel.fetch(out["ids"]).tolist(),
        "n": int(parallel.fetch(out["n"])),
        "local_whole": parallel.fetch(whole).tolist(),
        "rows_fetched": parallel.fetch(rows).tolist(),
        "replicated_fetched": parallel.fetch(out["ids"]).tolist(),
        "refused": refused,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
