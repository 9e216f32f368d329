"""Two real JAX processes (4 CPU devices each, gloo collectives) form one 8-device mesh.

Each process runs ``two_process_worker``: initialize_distributed() from the explicit
``JAX_*`` variables, make_mesh(data=2, fsdp=4), shard_batch from its own half of the rows, and a
jitted global reduction with an fsdp-sharded weight. Both must print the single-process answer.
"""

import json

import numpy as np
import pytest

from jaxrl_llm.parallel import make_mesh
from tests.parallel import launcher
from tests.parallel import two_process_worker as worker
from tests.reference.parallel_step import step_reference

# Only stops a hang (a worker waiting for a peer that is gone); never a performance limit.
TIMEOUT_S = 600


def _launch_two_processes(log_dir) -> list[dict]:
    outputs = launcher.launch(
        "tests.parallel.two_process_worker", log_dir=log_dir, timeout_s=TIMEOUT_S
    )
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    results = _launch_two_processes(tmp_path)
    single = worker.run(make_mesh(data=2, fsdp=4))
    batch, weight = worker.global_problem()
    x_sum, loss, hidden = step_reference(batch["x"], batch["mask"], batch["scale"], weight)

    assert [r["process_index"] for r in results] == [0, 1]
    half = worker.GLOBAL_BATCH // 2
    for index, result in enumerate(results):
        assert result["process_count"] == 2
        assert result["local_device_count"] == 4
        assert result["global_device_count"] == 8
        assert result["cluster"] == "explicit"
        assert result["rows"] == [index * half, (index + 1) * half]
        assert result["own_rows_match"]
        assert result["x_shape"] == [worker.GLOBAL_BATCH, worker.FEATURES]
        assert result["x_spec"] == single["x_spec"] == str(("data", "fsdp")).join(["P(", ",)"])
        assert result["w_spec"] == "P('fsdp', 'tensor')"
        # Same program, same reduction tree as one process with 8 devices.
        np.testing.assert_allclose(result["x_sum"], single["x_sum"], rtol=1e-6)
        np.testing.assert_allclose(result["loss"], single["loss"], rtol=1e-6)
        np.testing.assert_allclose(result["hidden"], single["hidden"], rtol=1e-6)
        np.testing.assert_allclose(result["x_sum"], x_sum, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
        np.testing.assert_allclose(result["hidden"], hidden, rtol=1e-5, atol=1e-6)
    assert single["rows"] == [0, worker.GLOBAL_BATCH]
