"""The asynchronous RL loop (``rollout.max_staleness``, issue 14) and its timeline.

Unit tests drive ``RolloutPipeline`` with a fake rollout that records which parameter version
it was given and when it ran; the trainer tests run the RL job on the test session's 8 fake
CPU devices with the sampler on 4 of them (``mesh.rollout_devices``) and the trainer on the
other 4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import threading
import time
import types

import jax
import numpy as np
import pytest

from jaxrl_llm.train import timeline
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl.config import check_config
from jaxrl_llm.train.rl.pipeline import RolloutPipeline
from jaxrl_llm.train.rl.spec import resolve
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers

# -- the pipeline alone --------------------------------------------------------------------------


class FakeRollouts:
    """``produce`` for the pipeline: records ``(step, params, thread)``; ``params`` is the
    trainer's version counter as the snapshot saw it."""

    def __init__(self, delay: float = 0.0):
        self.calls: list[tuple[int, int, str]] = []
        self.delay = delay
        self.position = 0  # the prompt sampler's position: one per rollout

    def produce(self, step, params, timer):
        with timer.phase("rollout"):
            time.sleep(self.delay)
            self.position += 1
        self.calls.append((step, params, threading.current_thread().name))
        return {"step": step, "version": params}, {}


def _drive(pipeline, rollouts, steps, version):
    """The trainer loop: take step s's samples, then 'update' (version += 1)."""
    trained_on = []
    for step in range(steps):
        samples, info = pipeline.next(step, lambda: version[0], PhaseTimer())
        assert samples["step"] == step
        trained_on.append((samples["version"], info["rollout/staleness"]))
        version[0] += 1  # the update
    pipeline.close()
    return trained_on


def test_synchronous_pipeline_samples_each_step_from_the_current_parameters():
    rollouts = FakeRollouts()
    pipeline = RolloutPipeline(rollouts.produce, 0)
    trained_on = _drive(pipeline, rollouts, 5, [0])
    assert trained_on == [(s, 0.0) for s in range(5)]
    assert {thread for *_, thread in rollouts.calls} == {threading.main_thread().name}


@pytest.mark.parametrize("staleness", [1, 2])
def test_pipeline_runs_ahead_by_at_most_max_staleness(staleness):
    rollouts = FakeRollouts()
    pipeline = RolloutPipeline(rollouts.produce, staleness)
    trained_on = _drive(pipeline, rollouts, 6, [0])
    # Step s trains on samples of version max(0, s - j) where the rollout was started at step
    # s - j (j <= staleness): the first step's own rollout, then the pipeline fills.
    versions = [v for v, _ in trained_on]
    assert versions[0] == 0
    for step, (version, stale) in enumerate(trained_on):
        assert 0 <= step - version <= staleness
        assert stale == step - version
    assert max(step - v for step, v in enumerate(versions)) == staleness
    # Each step's rollout exactly once, off the main thread; the last step starts the next
    # ``staleness`` ones (a resumed longer run trains on them), dropped at close.
    launched = sorted(step for step, *_ in rollouts.calls)
    assert launched[:6] == list(range(6)) and set(launched[6:]) <= set(range(6, 6 + staleness))
    assert all(thread.startswith("rollout") for *_, thread in rollouts.calls)


def test_next_rollout_runs_while_the_update_runs():
    """Rollout s+1 is under way before step s+1 asks for it: the main thread, 'updating' on
    step 0, sees the rollout of step 1 start; a synchronous (or lazy) loop would start it
    only in step 1's call."""
    started = threading.Event()

    def produce(step, params, timer):
        if step == 1:
            started.set()
        return {"step": step}, {}

    pipeline = RolloutPipeline(produce, 1)
    pipeline.next(0, lambda: 0, PhaseTimer())
    assert started.wait(timeout=10), "rollout 1 did not run during update 0"
    pipeline.next(1, lambda: 1, PhaseTimer())
    pipeline.close()


def test_drain_and_preload_keep_the_rollouts_in_flight():
    """A checkpoint waits for the rollouts in flight and keeps them queued; a resumed
    pipeline preloaded with them trains on them, then continues as the uninterrupted one."""
    rollouts = FakeRollouts(delay=0.05)
    pipeline = RolloutPipeline(rollouts.produce, 2)
    version = [0]
    for step in range(2):
        pipeline.next(step, lambda: version[0], PhaseTimer())
        version[0] += 1
    finished = []
    items = pipeline.drain(lambda samples, timer: finished.append(samples["step"]) or samples)
    assert [(step, v) for step, _, _, v, _ in items] == [(2, 0), (3, 1)]  # started at steps 0, 1
    assert all(timer.seconds["rollout"] > 0 for *_, timer in items)  # their phase times kept
    assert finished == [2, 3]
    continued = [pipeline.next(s, lambda: version[0], PhaseTimer())[0]["step"] for s in (2, 3)]
    pipeline.close()

    resumed = RolloutPipeline(FakeRollouts().produce, 2)
    resumed.preload(items)
    samples, info = resumed.next(2, lambda: 2, PhaseTimer())
    assert samples == {"step": 2, "version": 0} and info["rollout/staleness"] == 2.0
    assert [step for step, _ in resumed.pending] == [3, 4]  # 4 launched from version 2
    resumed.close()
    assert continued == [2, 3]


def test_a_failed_batch_from_a_sampler_process_past_the_end_keeps_those_before_it(tmp_path):
    """The trainer's side of a job whose sampler runs on processes of its own: batches 2 and 3
    are in flight after step 1 (k = 2), 3 failed on the sampler. The final checkpoint keeps
    batch 2 and the data position it carried (not past it), and does not fail."""
    from jaxrl_llm.train.rl import remote

    class FakeMessages:
        def receive(self, name):
            step = int(name.split("/")[1])
            if step == 3:
                raise RuntimeError("the other side of the job failed: reward server down")
            return {"step": step}, {}, PhaseTimer(), step - 2, {"after": step}, 0.0

    prompts = types.SimpleNamespace(position=None)
    prompts.restore = lambda state: setattr(prompts, "position", state)
    pipe = object.__new__(remote.RemotePipeline)  # no coordination service here
    pipe.max_staleness, pipe.prompts, pipe.messages = 2, prompts, FakeMessages()
    pipe.ready, pipe.started, pipe.step = {}, True, 1
    items, failure = pipe.drain_until_failure(lambda samples, timer: samples)
    assert [item[0] for item in items] == [2] and failure[0] == 3
    assert prompts.position == {"after": 2}

    pipe.ready, pipe.draw_starts = {}, {}  # the trainer draws nothing itself

    def save(max_steps: int) -> None:
        pipe.save_in_flight(
            2,
            tmp_path,
            kept_steps=[2],
            finish=lambda samples, timer: samples,
            max_steps=max_steps,
        )

    save(max_steps=2)
    saved = pickle.loads((tmp_path / "2-process0.pkl").read_bytes())
    assert [item[0] for item in saved] == [2] and prompts.position == {"after": 2}
    with pytest.raises(RuntimeError, match="reward server down"):
        save(max_steps=3)  # the same failure before the last step is the run's


def test_timer_merges_the_rollout_threads_spans():
    timer, other = PhaseTimer(), PhaseTimer(lane="rollout")
    with timer.phase("update"):
        pass
    with other.phase("rollout"):
        pass
    other.count("rollout", 10)
    timer.merge(other)
    assert set(timer.seconds) == {"update", "rollout"}
    assert [lane for lane, *_ in timer.spans] == ["trainer", "rollout"]
    assert timer.tokens == {"rollout": 10.0}


def test_overlap_seconds_by_hand():
    rows = [
        {"lane": "trainer", "phase": "update", "start": 1.0, "end": 3.0},
        {"lane": "rollout", "phase": "rollout", "start": 2.5, "end": 5.0},
        {"lane": "rollout", "phase": "rollout", "start": 0.0, "end": 0.5},
    ]
    assert timeline.overlap_seconds(rows, "trainer", {"update"}, "rollout", {"rollout"}) == 0.5


# -- the RL job ----------------------------------------------------------------------------------

ASYNC = (
    "rollout.max_staleness=1",
    "mesh.rollout_devices=4",
    "mesh.fsdp=-1",
    "objective.overrides={rollout_correction: {is_level: token}}",
    "logging.plots=true",
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def _config(run_dir, *extra):
    return rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        run_dir,
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=3",
        *extra,
    )


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """The one-step-off job with the sampler on 4 of the session's 8 devices: ``(trainer,
    run directory)``."""
    if jax.device_count() < 8:
        pytest.skip("needs the test session's 8 fake CPU devices")
    run_dir = tmp_path_factory.mktemp("async_run") / "async"
    trainer = RLTrainer(_config(run_dir, *ASYNC, "trainer.max_steps=4"))
    trainer.fit()
    return trainer, run_dir


@pytest.mark.slow
def test_async_job_on_separate_sampler_devices(async_run):
    trainer, run_dir = async_run
    devices = jax.devices()
    train_devices = {d for leaf in jax.tree.leaves(trainer.state.params) for d in leaf.devices()}
    assert train_devices == set(devices[4:])
    sampler_devices = {
        d for leaf in jax.tree.leaves(trainer.sampler_params()) for d in leaf.devices()
    }
    assert sampler_devices == set(devices[:4])

    rows = rl_helpers.read_jsonl(run_dir / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    # The correction ran on every step: old log-probs (recomputed by the updated trainer)
    # against the stale sampler's.
    assert all("rollout_corr/rollout_is_mean" in r and "rollout_corr/kl" in r for r in rows)
    assert rows[0]["time/wait_rollout"] > 0  # the first step waits for its own rollout

    assert _overlap(run_dir) > 0, "no rollout ran while the trainer updated"
    assert (run_dir / "plots" / "timeline.png").is_file()


def _overlap(run_dir, first_step: int = 2) -> float:
    """Seconds the rollouts ran beside the trainer's log-probs and updates from ``first_step``
    on (the first step compiles)."""
    spans = [s for s in timeline.read(run_dir / timeline.FILE) if s["step"] >= first_step]
    return timeline.overlap_seconds(
        spans, "trainer", {"logprobs", "update"}, "rollout", {"rollout"}
    )


# Set to 0 to skip resuming the two-process run in a second launch (about 20 s; CI runs it).
REMOTE_RESUME_ENV = "JAXRL_REMOTE_RESUME_CHECK"


def _two_process_train(out_dir, *overrides) -> list[dict]:
    """``jaxrl-llm train CONFIG *overrides`` as two processes of 4 CPU devices each (one JAX
    cluster, ``tests/train/rl/remote_worker.py``); each process's summary."""
    from tests.parallel.launcher import launch, reserved_port

    args = [str(rl_helpers.CONFIGS / "grpo.yaml"), *rl_helpers.TINY, rl_helpers.SHAPED_REWARDS]
    with reserved_port(shared=False) as port0, reserved_port(shared=False) as port1:
        outputs = launch(
            "tests.train.rl.remote_worker",
            [f"{port0},{port1}", *args, *ASYNC, *overrides],
            log_dir=out_dir,
            timeout_s=900,  # a hang stopper only
            extra_env={"JAXRL_TEST_PHASE_DELAY": "0.2"},  # the overlap shows in the timeline
        )
    return [json.loads(out[out.index("{") :]) for out in outputs]


@pytest.mark.slow
def test_sampler_on_another_process_trains_what_one_process_does(async_run, tmp_path):
    """``mesh.rollout_devices=4`` on two processes of 4 devices: process 1 only samples, process
    0 trains, weights cross device to device and batches through the coordination service. Run
    for 2 steps, it samples and trains what the one-process job on 8 devices does and saves the
    batch in flight. Unless ``JAXRL_REMOTE_RESUME_CHECK=0`` (a quicker local run) it is
    then resumed to 4 steps in a second launch (the batch in flight restored, the sampler's data
    position sent back) and must match the one-process run's 4 rows and exported weights."""
    from jaxrl_llm import models
    from jaxrl_llm.train.rl.pipeline import IN_FLIGHT_DIR

    _, single_dir = async_run
    run_dir = tmp_path / "run"
    first = _two_process_train(tmp_path, f"run_dir={run_dir}", "trainer.max_steps=2")
    assert first[0]["steps"] == 2
    assert first[1] == {"job": "rl", "role": "sampler", "rollouts": 3}  # steps 0-2
    assert [p.name for p in (run_dir / IN_FLIGHT_DIR).iterdir()] == ["2-process0.pkl"]
    # Batch 1 was generated on the other process while step 0's log-probs and update ran.
    assert _overlap(run_dir, first_step=1) > 0, "no rollout ran while the trainer updated"

    resume = os.environ.get(REMOTE_RESUME_ENV) != "0"
    if resume:
        resumed = _two_process_train(
            tmp_path, f"run_dir={run_dir}", "trainer.max_steps=4", "resume=true"
        )
        # Steps 3 and 4 (past the end); step 2's batch came with the checkpoint.
        assert resumed[1]["rollouts"] == 2
        assert resumed[0]["eval_before_rl"] == first[0]["eval_before_rl"]
    steps = 4 if resume else 2

    rows = rl_helpers.without_timing(rl_helpers.read_jsonl(run_dir / "metrics.jsonl"))
    expected = rl_helpers.without_timing(rl_helpers.read_jsonl(single_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row, want in zip(rows, expected[:steps], strict=True):
        assert row.keys() == want.keys()
        for key in ("reward_mean", "accuracy", "completion_length_mean", "rollout/staleness"):
            assert row[key] == want[key], (row["step"], key)
        # The same programs on the same mesh shapes: the update's figures agree to float
        # noise; the correction's spreads (std of weights all near 1) amplify it.
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "rollout_corr/kl"):
            assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (row["step"], key)
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-3, abs=1e-6), (row["step"], key)
    if resume:
        _, params = models.load_pretrained(run_dir / "hf", dtype=np.float32)
        _, single = models.load_pretrained(single_dir / "hf", dtype=np.float32)
        # Adam's normalised steps carry the float noise of near-zero gradients into the
        # weights: up to ~0.3% of one step (lr 2e-4) measured; 1% allowed.
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_synchronous_job_never_overlaps(tmp_path):
    cfg = _config(tmp_path / "sync", "logging.plots=false")
    RLTrainer(cfg).fit()
    rows = rl_helpers.read_jsonl(tmp_path / "sync" / "metrics.jsonl")
    assert [r["rollout/staleness"] for r in rows] == [0.0, 0.0, 0.0]
    spans = timeline.read(tmp_path / "sync" / timeline.FILE)
    assert {s["lane"] for s in spans} == {"trainer"}
    update = [(s["start"], s["end"]) for s in spans if s["phase"] == "update"]
    rollout = [(s["start"], s["end"]) for s in spans if s["phase"] == "rollout"]
    assert update and rollout
    assert all(e1 <= s2 or e2 <= s1 for s1, e1 in update for s2, e2 in rollout)


def test_config_refuses_inconsistent_correction_and_staleness(tmp_path):
    bypass = "objective.overrides={rollout_correction: {mode: bypass}}"
    with pytest.raises(ValueError, match="mode=bypass needs rollout.logprobs=sampler"):
        check_config(_config(tmp_path, bypass))
    decoupled = "objective.overrides={rollout_correction: {is_level: token}}"
    with pytest.raises(ValueError, match="mode=decoupled needs rollout.logprobs=recompute"):
        check_config(_config(tmp_path, decoupled, "rollout.logprobs=sampler"))
    with pytest.raises(ValueError, match="rollout.max_staleness must be >= 0"):
        check_config(_config(tmp_path, "rollout.max_staleness=-1"))
    with pytest.raises(ValueError, match="unknown rollout_correction key"):
        check_config(_config(tmp_path, "objective.overrides={rollout_correction: {level: 1}}"))
    check_config(_config(tmp_path, bypass, "rollout.logprobs=sampler"))


def test_stale_rollouts_are_never_trained_as_on_policy(tmp_path):
    """With one update per batch the old-log-prob forward is skipped (ratio 1) only when the
    sampler's parameters are the trainer's; a stale batch needs it."""
    cfg = _config(tmp_path, "trainer.epochs=1", "trainer.minibatches=1")
    assert rl_helpers.on_policy_update(resolve(cfg, training=False))
    stale = _config(tmp_path, "rollout.max_staleness=1")
    assert not rl_helpers.on_policy_update(resolve(stale, training=False))
    corrected = _config(tmp_path, "objective.overrides={rollout_correction: {is_level: token}}")
    assert not rl_helpers.on_policy_update(resolve(corrected, training=False))


def test_bad_rollout_devices_are_refused(tmp_path):
    from jaxrl_llm.train import setup

    cfg = _config(tmp_path, f"mesh.rollout_devices={jax.device_count()}")
    with pytest.raises(ValueError, match="mesh.rollout_devices must be an int in"):
        setup.make_run_mesh(cfg.mesh)
    assert np.asarray(setup.make_run_mesh(_config(tmp_path).mesh).devices).size == 1


def test_sampler_processes_are_the_last_whole_processes(monkeypatch):
    from jaxrl_llm.train import setup

    # Three processes of 2 devices: the sampler takes whole processes from the end.
    devices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(6)]
    monkeypatch.setattr(setup.jax, "devices", lambda: devices)
    monkeypatch.setattr(setup.jax, "device_count", lambda: 6)
    monkeypatch.setattr(setup.jax, "process_count", lambda: 3)
    assert setup.split_devices(2) == (devices[4:], devices[:4])
    assert setup.process_roles(2) == ((2,), (0, 1))
    assert setup.process_roles(4) == ((1, 2), (0,))
    with pytest.raises(ValueError, match=r"splits process\(es\) \[1\].*multiple of their 2"):
        setup.process_roles(3)
    # One process: the first ones (devices given, as ``plan`` passes a slice's).
    one = [types.SimpleNamespace(id=i, process_index=0) for i in range(6)]
    assert setup.split_devices(2, one) == (one[:2], one[2:])
    assert setup.split_devices(0, one) == ([], one)


def test_landed_weights_reach_a_serving_mesh_that_orders_the_devices_otherwise():
    """On a TPU slice ``parallel.make_mesh`` orders the sampler's chips for their topology,
    so its serving mesh and the landing mesh (the trainer's order) list the same devices in
    another order, which a jitted reshard refuses ("incompatible devices"; found by ``plan``
    of a two-host job). The sampler lands them with ``device_put``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrl_llm.train.rl import remote

    chips = jax.devices()[4:8]
    axes = ("data", "fsdp", "tensor")
    landing = Mesh(np.asarray(chips).reshape(1, 4, 1), axes)
    serving = Mesh(np.asarray([chips[0], chips[2], chips[1], chips[3]]).reshape(2, 1, 2), axes)
    weights = np.arange(64, dtype=np.float32).reshape(8, 8)
    landed = {"w": jax.device_put(weights, NamedSharding(landing, PartitionSpec("fsdp")))}
    target = {"w": NamedSharding(serving, PartitionSpec(None, "tensor"))}
    served = remote.to_serving(landed, target)
    assert served["w"].sharding == target["w"]
    np.testing.assert_array_equal(np.asarray(served["w"]), weights)


@pytest.mark.slow
def test_async_stop_and_resume_equals_uninterrupted(tmp_path):
    """A one-step-off run stopped at step 3 and resumed to 6 samples, trains and exports
    exactly what the uninterrupted 6-step run does: the rollout of step 3 (in flight at the
    checkpoint, from step 2's weights) is saved with it and trained on after the resume."""
    from jaxrl_llm import models
    from jaxrl_llm.train.rl.pipeline import IN_FLIGHT_DIR
    from jaxrl_llm.train.rl.run import run

    extra = ("rollout.max_staleness=1", "trainer.max_steps=6", "checkpoint.every_steps=3")
    extra += ("objective.overrides={rollout_correction: {is_level: token}}",)
    whole = _config(tmp_path / "whole", *extra)
    expected = run(whole)

    cfg = _config(tmp_path / "resumed", *extra)
    first = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=3))
    run(first)
    assert sorted(p.name for p in (tmp_path / "resumed" / IN_FLIGHT_DIR).iterdir()) == [
        "3-process0.pkl"
    ]
    summary = run(dataclasses.replace(cfg, resume=True))

    rows = rl_helpers.without_timing(rl_helpers.read_jsonl(tmp_path / "resumed" / "metrics.jsonl"))
    whole_rows = rl_helpers.without_timing(
        rl_helpers.read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    )
    assert rows == whole_rows
    assert [r["rollout/staleness"] for r in rows] == [0.0] + [1.0] * 5
    # The saved rollout keeps its phase times: no step without a rollout time.
    resumed_rows = rl_helpers.read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert all(r["time/rollout"] > 0 for r in resumed_rows)
    assert {k: v for k, v in summary.items() if k != "hf"} == {
        k: v for k, v in expected.items() if k != "hf"
    }
    _, params = models.load_pretrained(tmp_path / "resumed" / "hf", dtype=np.float32)
    _, whole_params = models.load_pretrained(tmp_path / "whole" / "hf", dtype=np.float32)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole_params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("staleness", "fails_at"), [(1, 2), (2, 3)])
def test_a_failed_rollout_past_the_end_leaves_its_prompts_to_a_longer_run(
    tmp_path, monkeypatch, caplog, staleness, fails_at
):
    """Steps 0 and 1, ``k`` rollouts in flight past the end (steps 2 .. 1 + k); the rollout of
    step ``fails_at`` fails. The run still ends and saves: the rollouts before the failed one
    beside the checkpoint, the data position where the failed one started drawing (as many
    batches in as steps 0 .. fails_at - 1 drew), not past its prompts. Resumed to more steps,
    the run trains on the saved ones and draws the failed one's prompts again."""
    from jaxrl_llm.data import PromptSampler
    from jaxrl_llm.train.rl.pipeline import IN_FLIGHT_DIR

    produce = RLTrainer.rollout_from
    fail = {"at": fails_at}

    def failing_past_the_end(self, step, params, timer, **partial):
        out = produce(self, step, params, timer, **partial)  # draws step's prompts
        if step == fail["at"]:
            raise RuntimeError("reward server down")
        return out

    monkeypatch.setattr(RLTrainer, "rollout_from", failing_past_the_end)
    cfg = _config(tmp_path, f"rollout.max_staleness={staleness}", "trainer.max_steps=2")
    trainer = RLTrainer(cfg)
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        trainer.fit()
    assert (
        f"the rollout of step {fails_at} (past the last step) failed (reward server down): "
        f"checkpoint 2 keeps the {fails_at - 2} before it" in caplog.text
    )

    def position_after(batches: int) -> dict:
        fresh = PromptSampler(trainer.sampler._examples, seed=cfg.seed, shuffle=cfg.data.shuffle)
        for _ in range(batches):
            fresh.next_batch(cfg.rollout.prompts_per_step)
        return fresh.state()

    _, extra = trainer.checkpointer.restore_raw(2)
    assert extra["sampler"] == position_after(fails_at)
    saved = pickle.loads((tmp_path / IN_FLIGHT_DIR / "2-process0.pkl").read_bytes())
    assert [item[0] for item in saved] == list(range(2, fails_at))
    if staleness == 1:
        return
    fail["at"] = None
    longer = dataclasses.replace(
        cfg, resume=True, trainer=dataclasses.replace(cfg.trainer, max_steps=4)
    )
    resumed = RLTrainer(longer)
    resumed.fit()
    assert resumed.pipeline.draw_starts[fails_at] == position_after(fails_at)  # drawn again
    rows = rl_helpers.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert resumed.checkpointer.restore_raw(4)[1]["sampler"] == position_after(4 + staleness)


def test_staleness_is_refused_across_processes_and_warned_uncorrected(
    tmp_path, monkeypatch, caplog
):
    from jaxrl_llm.train.rl import pipeline

    cfg = _config(tmp_path, "rollout.max_staleness=1")
    objective = check_config(cfg)
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        pipeline.check_staleness(cfg, objective)
    assert "without a rollout_correction" in caplog.text
    monkeypatch.setattr(pipeline.jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="needs the sampler on processes of its own"):
        pipeline.check_staleness(cfg, objective)
    pipeline.check_staleness(_config(tmp_path), objective)  # synchronous: nothing to refuse


# -- partial rollouts ----------------------------------------------------------------------------


def test_partial_rollouts_take_each_steps_weights_in_flight():
    """``partial``: step ``s`` publishes the weights it trains with (version ``s``) to the
    rollout in flight, which started on version ``s - 1``: the fake rollout waits for them, so
    every rollout after the first sees its own step's version while it runs."""
    seen = {}

    def produce(step, params, timer, updates, version):
        assert params == version  # the snapshot it started from
        newer = None
        if step > 0:
            deadline = time.monotonic() + 10
            while newer is None and time.monotonic() < deadline:
                newer = updates.newer(version)
                time.sleep(0.001)
        seen[step] = (version, None if newer is None else newer[0])
        return {"step": step}, {}

    pipeline = RolloutPipeline(produce, 1, partial=True)
    version = [0]
    for step in range(4):
        samples, info = pipeline.next(step, lambda: version[0], PhaseTimer())
        assert samples["step"] == step
        version[0] += 1
    pipeline.close()
    assert seen[0] == (0, None)
    for step in (1, 2, 3):
        assert seen[step] == (step - 1, step), seen


def test_staleness_info_counts_tokens_by_version():
    from jaxrl_llm.train.rl.pipeline import staleness_info

    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    versions = np.array([[4, 5, 5, 0], [4, 4, 0, 0]], np.int32)
    samples = types.SimpleNamespace(completion_mask=mask, versions=versions)
    info = staleness_info(samples, 5, 4)
    assert info == {
        "rollout/staleness": 1.0,
        "rollout/stale_token_frac": 3 / 5,
        "rollout/token_staleness_mean": 3 / 5,
    }
    whole = types.SimpleNamespace(completion_mask=mask, versions=None)
    assert staleness_info(whole, 5, 4) == {"rollout/staleness": 1.0}
    empty = types.SimpleNamespace(completion_mask=mask & False, versions=versions)
    assert staleness_info(empty, 5, 4) == {
        "rollout/staleness": 1.0,
        "rollout/stale_token_frac": 1.0,
        "rollout/token_staleness_mean": 1.0,
    }


def test_partial_rollouts_need_staleness_and_the_continuous_engine(tmp_path):
    from jaxrl_llm.train.rl import pipeline

    for extra in (
        ("rollout.partial=true", "rollout.engine=continuous"),
        ("rollout.partial=true", "rollout.max_staleness=1"),
    ):
        cfg = _config(tmp_path, *extra)
        with pytest.raises(ValueError, match="rollout.partial .* needs rollout.max_staleness"):
            pipeline.check_staleness(cfg, check_config(cfg))


@pytest.mark.slow
def test_partial_rollout_job_trains_on_tokens_of_two_versions(tmp_path, monkeypatch):
    """The RL job with ``rollout.partial``, the continuous engine on the sampler's own four
    devices: rollout ``s`` (from step ``s - 1``'s weights) takes step ``s``'s weights between
    bursts; decoding is slowed here (one token a burst,
    a pause each) so the update always ends first. Each row's tokens are the old version,
    then the new one; the step reports the share of stale tokens."""
    from jaxrl_llm.sampling import engine as engine_lib
    from jaxrl_llm.sampling.requests import WeightUpdates

    burst = engine_lib.burst

    def slow_burst(*args, **kwargs):
        time.sleep(0.25)
        return burst(*args, **kwargs)

    monkeypatch.setattr(engine_lib, "burst", slow_burst)
    publish = WeightUpdates.publish

    def late_publish(self, version, params):  # as if the update took 0.4 s
        time.sleep(0.4)
        publish(self, version, params)

    monkeypatch.setattr(WeightUpdates, "publish", late_publish)
    seen = []
    produce = RLTrainer.rollout_from

    def recording(self, step, params, timer, **partial):
        samples, info = produce(self, step, params, timer, **partial)
        seen.append((step, samples.versions, samples.completion_mask))
        return samples, info

    monkeypatch.setattr(RLTrainer, "rollout_from", recording)
    if jax.device_count() < 8:
        pytest.skip("needs the test session's 8 fake CPU devices")
    extra = ("rollout.partial=true", "rollout.engine=continuous", "rollout.burst=1")
    extra += ("mesh.rollout_devices=4", "mesh.fsdp=-1")  # the engine on the sampler's devices
    extra += ("rollout.max_staleness=1", "trainer.max_steps=3", "logging.plots=false")
    extra += ("objective.overrides={rollout_correction: {is_level: token}}",)
    RLTrainer(_config(tmp_path, *extra)).fit()
    rows = rl_helpers.read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["rollout/staleness"] == 0.0 and rows[0]["rollout/stale_token_frac"] == 0.0
    for step, versions, mask in seen:
        if step >= 3:  # past the run's end
            continue
        valid = versions[mask]
        assert set(valid.tolist()) <= {max(step - 1, 0), step}, (step, set(valid.tolist()))
        for row, m in zip(versions, mask):  # old, then new: never back
            assert (np.diff(row[m]) >= 0).all()
        frac = rows[step]["rollout/stale_token_frac"]
        assert frac == pytest.approx(float((valid < step).mean()))
        assert rows[step]["rollout/staleness"] == float(frac > 0)
    # Step 1's rollout ran beside the first update's compile and finished on the old weights;
    # step 2's was still decoding when step 2's weights came, and took them.
    assert 0.0 < rows[2]["rollout/stale_token_frac"] < 1.0
