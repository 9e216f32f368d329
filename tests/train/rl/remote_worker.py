"""One process of the two-process RL job (``test_remote.py``): ``jaxrl-llm train`` as a user
runs it on each host, the sampler on process 0's devices, the trainer on process 1's.

Run by ``tests.parallel.launcher.launch`` (which sets the ``JAX_*`` cluster variables) as
``python -m tests.train.rl.remote_worker PORT0,PORT1 OVERRIDE ...``: each process serves JAX's
cross-process transfers on its own port (``JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS``, which
``jaxrl_llm`` hands to JAX when it starts the cluster) and prints the job's summary JSON last.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    ports = sys.argv[1].split(",")
    process = int(os.environ["JAX_PROCESS_ID"])
    os.environ["JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS"] = f"127.0.0.1:{ports[process]}"
    import jax  # noqa: PLC0415

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    cache = os.environ.get("JAXRL_TEST_JAX_CACHE")  # the test session's (tests/conftest.py)
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    delay = float(os.environ.get("JAXRL_TEST_PHASE_DELAY", 0))
    if delay:  # every update and rollout lasts at least this long: their overlap is plain
        _slow_down(delay)
    from jaxrl_llm.train.cli import train_main  # noqa: PLC0415

    return train_main(sys.argv[2:])


def _slow_down(delay: float) -> None:
    from jaxrl_llm.train.rl import rollout  # noqa: PLC0415
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    def slow(fn):
        def wrapper(*args, **kwargs):
            time.sleep(delay)
            return fn(*args, **kwargs)

        return wrapper

    RLTrainer.update = slow(RLTrainer.update)
    rollout.encode_prompts = slow(rollout.encode_prompts)  # inside the rollout phase


if __name__ == "__main__":
    sys.exit(main())
