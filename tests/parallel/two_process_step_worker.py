"""One of the two JAX processes launched by ``test_two_process_step.py`` (4 CPU devices each).

Run as ``python -m tests.parallel.two_process_step_worker OUT_DIR`` with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES=2`` and ``JAX_PROCESS_ID`` set, after the
launcher wrote ``OUT_DIR/problem.npz`` with ``write_problem`` (initial parameters and the host
batches of ``tests/train/step_problem``). For every ``(mesh shape, optimizer)`` in ``CASES`` the
worker builds the 8-device mesh over both processes, feeds the policy step only this process's
rows and writes the gathered parameters and the metrics after steps 1 and 3 to
``OUT_DIR/process{i}.npz``; it prints one JSON line describing what it did. ``run`` is also what
the test calls on one device, so both sides execute the very same code.

``JAXRL_TEST_CRASH_PROCESS=i`` makes process ``i`` die right after start-up, to check that the
launcher fails fast instead of waiting on the survivor, which blocks in a collective.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

OPTIMIZERS = ("sgd", "adamw")
# Each case costs two ~20-40 s XLA compiles per process on a shared 2-core machine, so each mesh
# runs one optimizer: FSDP-only with SGD, FSDP x tensor with AdamW (both meshes split the batch
# 2 ways across the processes).
CASES = (((2, 4, 1), "sgd"), ((2, 2, 2), "adamw"))
RECORD_AFTER = (1, 3)
CRASH_EXIT_CODE = 3
PROBLEM_FILE = "problem.npz"


def make_optimizer(name: str):
    """``sgd``: plain SGD(0.5), so rounding differences stay linear; ``adamw``: the library's."""
    import optax

    from jaxrl_llm.train import optim

    if name == "sgd":
        return optax.sgd(0.5)
    if name == "adamw":
        return optim.make_optimizer(1e-3)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def case_key(mesh_shape: tuple[int, int, int], optimizer: str) -> str:
    """The npz key prefix of one case, e.g. ``"2x4x1/adamw"``."""
    return f"{'x'.join(map(str, mesh_shape))}/{optimizer}"


def flatten(tree, prefix: str) -> dict[str, np.ndarray]:
    """``{prefix + keystr(path): leaf}`` as NumPy arrays, e.g. ``"params['layers']['wq']"``."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {f"{prefix}{jax.tree_util.keystr(path)}": np.asarray(leaf) for path, leaf in leaves}


def write_problem(path: str) -> None:
    """Writes the initial parameters and the per-step host batches to ``path`` (an npz).

    Computed once by the launching process, so the workers compile only the sharded programs
    (random initialisation alone compiles for ~30 s per mesh on a loaded 2-core machine) and
    both sides start from bit-identical inputs.
    """
    import jax

    from jaxrl_llm import models
    from tests.train.step_problem import CONFIG, host_batch

    params = jax.device_get(models.init_params(CONFIG, jax.random.key(0)))
    arrays = {f"params/{k}": v for k, v in _flat_dict(params).items()}
    for index in range(max(RECORD_AFTER)):
        batch = host_batch(index)
        arrays.update(
            {
                f"batch{index}/{k}": np.asarray(v)
                for k, v in batch._asdict().items()
                if v is not None
            }
        )
    np.savez(path, **arrays)


def _flat_dict(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat_dict(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value)
    return out


def load_problem(path: str):
    """``(params, batches)``: the nested parameter dict and one ``RolloutBatch`` per step."""
    from jaxrl_llm.types import RolloutBatch

    params: dict = {}
    fields: list[dict[str, np.ndarray]] = [{} for _ in range(max(RECORD_AFTER))]
    with np.load(path) as data:
        for name in data.files:
            group, key = name.split("/", 1)
            if group == "params":
                *parents, leaf = key.split("/")
                node = params
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = data[name]
            else:
                fields[int(group.removeprefix("batch"))][key] = data[name]
    return params, [RolloutBatch(**f) for f in fields]


def run(mesh, optimizer_name: str, problem) -> tuple[dict[str, np.ndarray], dict]:
    """Runs ``max(RECORD_AFTER)`` GRPO policy steps of ``step_problem`` on ``mesh``.

    Each process places only its shards of the initial parameters and loads only the batch
    rows that ``process_local_slice`` gives it; ``shard_batch`` assembles the global arrays.

    Args:
      mesh: the device mesh (all processes' devices).
      optimizer_name: ``"sgd"`` or ``"adamw"`` (see ``make_optimizer``).
      problem: ``load_problem``'s ``(params, batches)``.

    Returns:
      ``(arrays, info)``: ``arrays`` maps ``"params<path>@k"`` / ``"metrics['name']@k"`` to the
      full (gathered) parameters and the replicated metrics after step ``k``; ``info`` holds
      ``rows``, the ``[start, stop)`` this process fed, and the sharding spec and local shard
      shape of the query weight ``wq`` after the last step.
    """
    import jax
    from jax.experimental import multihost_utils

    from jaxrl_llm import models, objectives, parallel
    from jaxrl_llm.train.rl.policy import make_policy_step
    from jaxrl_llm.train.state import create_train_state
    from jaxrl_llm.train.step import jit_step
    from tests.train.step_problem import BATCH, CONFIG

    host_params, batches = problem
    optimizer = make_optimizer(optimizer_name)
    param_shardings = parallel.logical_to_sharding(
        models.logical_axes(CONFIG), mesh, parallel.PARAM_RULES, shapes=host_params
    )
    params = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
        host_params,
        param_shardings,
    )
    state, shardings = create_train_state(
        CONFIG, optimizer, key=jax.random.key(0), mesh=mesh, params=params
    )
    step = jit_step(
        make_policy_step(
            CONFIG, objectives.make("grpo"), optimizer, param_shardings=shardings.params
        ),
        shardings,
    )
    rows = parallel.process_local_slice(BATCH, mesh)
    arrays: dict[str, np.ndarray] = {}
    for index, batch in enumerate(batches):
        local = jax.tree.map(lambda x: x[rows], batch)
        state, metrics = step(state, parallel.shard_batch(local, mesh))
        done = index + 1
        if done in RECORD_AFTER:
            # The state spans both processes' devices, which device_get refuses: gather it.
            gathered = multihost_utils.process_allgather(state.params, tiled=True)
            arrays.update({f"{k}@{done}": v for k, v in flatten(gathered, "params").items()})
            values = {k: np.asarray(v.addressable_data(0)) for k, v in metrics.items()}
            arrays.update({f"{k}@{done}": v for k, v in flatten(values, "metrics").items()})
    wq = state.params["layers"]["wq"]
    info = {
        "rows": [rows.start, rows.stop],
        "wq_spec": str(wq.sharding.spec),
        "wq_local_shard": list(wq.addressable_shards[0].data.shape),
    }
    return arrays, info


def main(argv: list[str]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxrl_llm.parallel import initialize_distributed, make_mesh

    (out_dir,) = argv
    info = initialize_distributed(initialization_timeout=300)
    crash = os.environ.get("JAXRL_TEST_CRASH_PROCESS")
    if crash == str(info.process_index):
        print(f"process {info.process_index}: exiting on purpose", file=sys.stderr, flush=True)
        os._exit(CRASH_EXIT_CODE)
    if crash is not None:
        # The others wait in a collective for the dead peer, as a real step would (and do not
        # need the problem file, so they cannot fail on their own first).
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("waiting for a peer that died")
    problem = load_problem(os.path.join(out_dir, PROBLEM_FILE))
    arrays: dict[str, np.ndarray] = {}
    cases = {}
    for shape, optimizer in CASES:
        prefix = case_key(shape, optimizer)
        case, cases[prefix] = run(make_mesh(*shape), optimizer, problem)
        arrays.update({f"{prefix}/{k}": v for k, v in case.items()})
    np.savez(os.path.join(out_dir, f"process{info.process_index}.npz"), **arrays)
    print(json.dumps({**info._asdict(), "cases": cases}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
