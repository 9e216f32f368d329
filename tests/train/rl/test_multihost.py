"""The README's multi-host launch: two processes of 4 CPU devices (gloo) train as one 8-device
process does.

The README's own command is read from README.md (the block that sets ``JAX_PROCESS_ID=$i``),
run with small-run overrides as two ``jaxrl-llm train`` processes by ``tests.parallel.launcher``
(a reserved coordinator port, every process polled, a hang stopped), and compared with one
process of 8 devices running the same overrides: the first two RL steps' loss, KL, entropy and
gradient norm within 1e-4 relative. The same holds for a LoRA job sampled by the continuous
engine (paged) and for PPO (a critic of its own) over packed rows. The asynchronous loop on
several hosts runs with the sampler on processes of its own (``test_pipeline.py``'s two-process
runs).

Both runs start from one warmed-up policy (50 supervised steps, made once by one process) and
warm up 5 steps more each. Not a 50-step warm-up each: the two collectives sum in different
orders, and over the warm-up's AdamW steps that rounding grows about tenfold every 7 steps (from
1e-7 to 2e-4 in the NLL by step 50), as it does between one process's meshes ``2 x 4`` and
``8 x 1``; the RL steps after it then differ by percents on either pair, hiding what the
comparison is for.
"""

from __future__ import annotations

import re
import shlex

import numpy as np
import pytest

from tests.parallel import launcher
from tests.train.helpers import train_in_one_process, train_in_two_processes

README = launcher.REPO / "README.md"
COMPARED = ("loss", "kl", "entropy", "grad_norm")
# A small run of the README's command from the warmed-up policy: two RL steps (with reward
# variance: a non-zero loss), a small held-out set.
SMALL = ("seed=0", "sft_warmup.steps=5", "trainer.max_steps=2", "data.eval_size=16")
# The other parts that split over the processes, in one job, smaller still: adapters over a
# frozen base (policy and critic), the continuous engine sampling from a paged cache, and packed
# forwards (the update, the reference and the critic's values), each process placing its own
# shards of the one plan every process makes from the gathered masks.
VARIANTS = {
    "ppo, lora, continuous engine (paged), packed": (
        "objective.name=ppo",
        "model.lora={rank: 4, alpha: 8.0}",
        "rollout.engine=continuous",
        "rollout.kv_block_size=4",
        "rollout.prompts_per_step=8",
        "trainer.packing=on",
    ),
}


def readme_launch() -> list[str]:
    """The overrides of the README's two-process ``jaxrl-llm train`` command."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    launches = [b for b in blocks if "JAX_PROCESS_ID=$i" in b]
    assert len(launches) == 1, "README.md must hold one two-process launch block"
    command = " ".join(launches[0].replace("\\\n", " ").split())
    match = re.search(r"jaxrl-llm train (.*?) &", command)
    assert match, f"no `jaxrl-llm train ... &` in the README's launch: {command!r}"
    assert "JAX_NUM_PROCESSES=2" in command
    assert "--xla_force_host_platform_device_count=4" in command
    return [a for a in shlex.split(match.group(1)) if not a.startswith("run_dir=")]


def assert_same_steps(two: list[dict], one: list[dict], steps: int = 2) -> None:
    assert [m["step"] for m in two[:steps]] == [m["step"] for m in one[:steps]] == [1, 2]
    for got, want in zip(two[:steps], one[:steps]):
        assert got["num_tokens"] == want["num_tokens"]  # the same completions were sampled
        for key in COMPARED:
            # atol: a loss whose advantages cancel (a group baseline, whitening) is float noise
            # of a few 1e-8 either way; a step's real loss here is ~2e-4.
            np.testing.assert_allclose(
                got[key], want[key], rtol=1e-4, atol=2e-7, err_msg=f"step {got['step']} {key}"
            )


@pytest.fixture(scope="module")
def warmed(tmp_path_factory) -> str:
    """The built-in task's policy after 50 supervised steps (``hf/`` of a one-device run)."""
    out = tmp_path_factory.mktemp("warmed")
    overrides = ["seed=0", "sft_warmup.steps=50", "trainer.max_steps=1", "data.eval_size=16"]
    train_in_one_process(out, [*overrides, "mesh.data=1", "mesh.fsdp=1"], devices=1)
    return str(out / "run" / "hf")


def test_readme_launch_is_two_processes_of_four_devices():
    overrides = readme_launch()
    assert "mesh.data=2" in overrides and "mesh.fsdp=4" in overrides


@pytest.mark.slow
def test_the_readme_launch_trains_as_one_8_device_process(warmed, tmp_path):
    overrides = [*readme_launch(), *SMALL, f"model.path={warmed}"]
    two = train_in_two_processes(tmp_path / "two", overrides)
    one = train_in_one_process(tmp_path / "one", overrides)
    assert_same_steps(two, one)
    assert any(abs(m["loss"]) > 1e-6 for m in one[:2])  # a step with a learning signal


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_job_across_two_processes_trains_as_one_process(variant, warmed, tmp_path):
    overrides = [*readme_launch(), *SMALL, f"model.path={warmed}", *VARIANTS[variant]]
    two = train_in_two_processes(tmp_path / "two", overrides)
    one = train_in_one_process(tmp_path / "one", overrides)
    assert_same_steps(two, one)
