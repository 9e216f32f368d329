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


def main() -> int:
    ports = sys.argv[1].split(",")
    process = int(os.environ["JAX_PROCESS_ID"])
    os.environ["JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS"] = f"127.0.0.1:{ports[process]}"
    import jax  # noqa: PLC0415

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from jaxrl_llm.train.cli import train_main  # noqa: PLC0415

    return train_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
