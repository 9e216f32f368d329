"""Preference jobs across processes: DPO with packed forwards (the update's, chosen and rejected
rows sharing packed rows, and the on-the-fly reference's) on two processes of 4 CPU devices
(gloo) trains as one process of 8 devices does. Every process plans the packing from the whole
batch's masks and places its own shards of that one plan; a process that planned from its own
rows only, or placed another's shard, scores other sequences than the one-process run and moves
the loss.

Both runs start from the same random tiny model (no warm-up: the two collectives sum in
different orders, and rounding grows over training steps) and compare their two steps' loss,
reward accuracy and margin within 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.train import helpers
from tests.train.preference.preference_helpers import SMALL_MODEL, TINY

OVERRIDES = (
    str(helpers.CONFIGS / "dpo.yaml"),
    *(o for o in TINY if not o.startswith("mesh.")),
    *SMALL_MODEL,
    "trainer.max_steps=2",
    "trainer.micro_batches=2",
    "trainer.packing=on",
    "loss.reference=on_the_fly",
    "mesh.data=2",
    "mesh.fsdp=4",
)
COMPARED = ("loss", "rewards/accuracies", "rewards/margins")


@pytest.mark.slow
def test_a_packed_preference_job_across_two_processes_trains_as_one_process(tmp_path):
    two = helpers.train_in_two_processes(tmp_path / "two", OVERRIDES)
    one = helpers.train_in_one_process(tmp_path / "one", OVERRIDES)
    two, one = ([r for r in rows if "loss" in r] for rows in (two, one))
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    for got, want in zip(two, one):
        for key in COMPARED:
            np.testing.assert_allclose(
                got[key], want[key], rtol=1e-4, atol=1e-7, err_msg=f"step {got['step']} {key}"
            )
    assert any(abs(r["rewards/margins"]) > 1e-6 for r in one)  # the policy moved off the reference
