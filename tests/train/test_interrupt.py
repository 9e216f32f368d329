"""Ctrl-C and SIGTERM stop a run at a step boundary with a checkpoint (issue 46).

The core's rules on the one-number ``CountingTrainer`` of ``test_core`` (seconds): the step a
signal lands in finishes and is checkpointed, ``Interrupted`` says where, the resumed run equals
an uninterrupted one, a warm-up's end is checkpoint 0, a second signal stops at once. Then
``jaxrl-llm train`` itself in a subprocess, as a user runs it: a real RL job with an SFT
warm-up gets SIGINT during its second step (sent by the process to itself, so the step it lands
in is known), exits 130 with one line naming the resume command, and that command's run equals
an uninterrupted one row for row (the data position restored from the checkpoint); SIGTERM
during the warm-up exits 143 with nothing saved.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxrl_llm.train import cli, core
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl import warmup
from tests.train.helpers import read_json, without_timing
from tests.train.rl import rl_helpers
from tests.train.test_core import CountingTrainer, _config


class SignalledTrainer(CountingTrainer):
    """Sends itself ``signals`` (a signal for each step index) while that step runs; with
    ``warm_up`` its setup records warm-up steps, as the RL job's does."""

    signals: dict[int, list[int]] = {}
    warm_up = False

    def setup(self) -> None:
        super().setup()
        if self.warm_up and self.latest is None:
            self.extra[core.WARMUP_KEY] = 7
            for signum in self.signals.get(-1, []):  # a signal during the warm-up
                os.kill(os.getpid(), signum)

    def train_step(self, step, timer):
        for signum in self.signals.get(step, []):
            os.kill(os.getpid(), signum)
        return super().train_step(step, timer)


def _fit(cfg, signals=None, warm_up=False):
    trainer = SignalledTrainer(cfg)
    trainer.signals, trainer.warm_up = signals or {}, warm_up
    return trainer.fit()


def _steps(run_dir):
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        return ckpt.all_steps(), {s: ckpt.restore_raw(s)[1] for s in ckpt.all_steps()}


def _rows(run_dir):
    return [{k: v for k, v in row.items() if "/" not in k} for row in read_metrics(run_dir)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_checkpoints_it_and_the_resumed_run_is_the_same(
    tmp_path, signum
):
    # The handlers this process had (an xdist worker may start with SIGINT ignored).
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    straight = tmp_path / "straight"
    _fit(_config(straight, max_steps=5))
    run_dir = tmp_path / "run"
    with pytest.raises(core.Interrupted) as info:
        _fit(_config(run_dir, max_steps=5), signals={2: [signum]})  # during step 3
    assert (info.value.signum, info.value.step, info.value.where) == (signum, 3, "at step 3")
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored
    assert core.stop_requested() is None
    steps, extras = _steps(run_dir)
    assert steps == [2, 3] and extras[3]["saved_at"] == 3
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "hf").exists()

    summary = _fit(dataclasses.replace(_config(run_dir, max_steps=5), resume=True))
    assert summary["eval_after"] == {"w": 2.5}
    assert _rows(run_dir) == _rows(straight)


def test_a_signal_in_the_last_step_stops_before_the_final_evaluation(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(core.Interrupted) as info:
        _fit(_config(run_dir), signals={3: [signal.SIGINT]})
    assert info.value.step == 4 and not (run_dir / "hf").exists()
    summary = _fit(dataclasses.replace(_config(run_dir), resume=True))
    assert summary["eval_after"] == {"w": 2.0} and (run_dir / "hf").is_dir()


def test_the_warm_up_end_is_checkpoint_0_and_a_resume_starts_there(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(core.Interrupted) as info:
        _fit(_config(run_dir), signals={-1: [signal.SIGINT]}, warm_up=True)
    assert (info.value.step, info.value.where) == (0, "at step 0 (the end of the warm-up)")
    steps, extras = _steps(run_dir)
    assert steps == [0] and extras[0][core.WARMUP_KEY] == 7
    resumed = SignalledTrainer(dataclasses.replace(_config(run_dir), resume=True))
    assert resumed.latest == 0
    resumed.warm_up = True  # it would warm up again on a fresh run; resumed, it does not
    summary = resumed.fit()
    assert summary["eval_after"] == {"w": 2.0}
    assert _steps(run_dir)[1][4][core.WARMUP_KEY] == 7


def test_a_signal_before_the_first_step_saves_nothing(tmp_path):
    with pytest.raises(core.Interrupted) as info:
        _fit(_config(tmp_path / "run"), signals={0: [signal.SIGINT]})
    # Step 1 ran (the signal came during it) and is saved; a run stopped before it has none.
    assert info.value.step == 1
    # A signal during setup (model building, compiling): no step, no warm-up, no checkpoint.
    trainer = SignalledTrainer(_config(tmp_path / "setup"))
    trainer.setup = lambda: (os.kill(os.getpid(), signal.SIGINT), CountingTrainer.setup(trainer))
    with pytest.raises(core.Interrupted) as info:
        trainer.fit()
    assert (info.value.step, info.value.where) == (None, "at step 0")
    assert not (tmp_path / "setup" / "checkpoints").exists()


def test_a_second_signal_stops_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _fit(_config(tmp_path / "run"), signals={1: [signal.SIGINT, signal.SIGINT]})
    assert core.stop_requested() is None


def test_the_warm_up_stops_at_its_next_step_with_nothing_saved(monkeypatch):
    probed = []
    probe = warmup.stoppable(lambda s, p: probed.append(s) or False, check_every=2, steps=9)
    assert [probe(s, None) for s in (1, 2, 3, 4)] == [False] * 4 and probed == [2, 4]
    monkeypatch.setattr(core, "stop_requested", lambda: signal.SIGTERM)
    with pytest.raises(core.Interrupted) as info:
        probe(5, None)
    assert (info.value.signum, info.value.step) == (signal.SIGTERM, None)
    assert info.value.where == "during the SFT warm-up (step 5 of 9)"


def test_resume_command_replaces_any_resume_override():
    argv = ["configs/grpo.yaml", "resume=false", "seed=1", "run_dir=runs/my run"]
    assert cli.resume_command(argv) == (
        "jaxrl-llm train configs/grpo.yaml seed=1 'run_dir=runs/my run' resume=true"
    )


# -- jaxrl-llm train in a subprocess -----------------------------------------------------------

_SIGNALLED = textwrap.dedent(
    """
    import os, signal, sys
    from jaxrl_llm.train import cli
    from jaxrl_llm.train.rl import episodes
    from jaxrl_llm.train.rl.trainer import RLTrainer

    at = int(os.environ["SIGNAL_AT"])
    signum = getattr(signal, os.environ["SIGNAL"])
    train_step, batches = RLTrainer.train_step, episodes.demonstration_batches

    def signalled_step(self, step, timer):
        if step == at:
            os.kill(os.getpid(), signum)
        return train_step(self, step, timer)

    def signalled_batches(*args, **kwargs):  # warm-up step at + 1 runs with the signal pending
        for i, batch in enumerate(batches(*args, **kwargs)):
            if i == at and os.environ["IN"] == "warm-up":
                os.kill(os.getpid(), signum)
            yield batch

    RLTrainer.train_step = signalled_step
    episodes.demonstration_batches = signalled_batches
    sys.exit(cli.train_main(sys.argv[1:]))
    """
)

RUN = (*rl_helpers.TINY, "sft_warmup.steps=4", "trainer.max_steps=3", "checkpoint.every_steps=10")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(cache_dir):
    with rl_helpers.persistent_compilation_cache(cache_dir):
        yield


def _signalled(cache_dir, argv, *, signal_name, at, within):
    return subprocess.run(
        [sys.executable, "-c", _SIGNALLED, *argv],
        capture_output=True,
        text=True,
        timeout=600,
        # The session's devices and flags: the resumed run in this process must match it.
        env={
            **os.environ,
            **rl_helpers.cache_env(cache_dir),
            "SIGNAL": signal_name,
            "SIGNAL_AT": str(at),
            "IN": within,
        },
    )


def test_ctrl_c_in_train_checkpoints_and_the_printed_command_resumes_it(
    tmp_path, cache_dir, capsys, caplog
):
    run_dir = tmp_path / "run"
    argv = [*RUN, f"run_dir={run_dir}"]
    result = _signalled(cache_dir, argv, signal_name="SIGINT", at=1, within="steps")
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"interrupted at step 2; resume with {cli.resume_command(argv)}"
    )
    steps, extras = _steps(run_dir)
    assert steps == [0, 2]  # the warm-up's end, and the step the signal came in
    assert extras[0]["sft_warmup_steps"] == 4
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]

    with caplog.at_level(logging.INFO, logger="jaxrl_llm"):
        assert cli.train_main([*argv, "resume=true"]) == 0
    assert "resumed from step 2" in caplog.text
    assert "SFT warm-up" not in caplog.text and "changed config" not in caplog.text
    straight = tmp_path / "straight"
    assert cli.train_main([*RUN, f"run_dir={straight}"]) == 0
    assert without_timing(read_metrics(run_dir)) == without_timing(read_metrics(straight))
    resumed, uninterrupted = (
        read_json(run_dir / "summary.json"),
        read_json(straight / "summary.json"),
    )
    for key in ("eval_before_rl", "eval_after_rl", "sft_warmup_steps"):
        assert resumed[key] == uninterrupted[key], key


def test_sigterm_in_the_warm_up_exits_143_with_nothing_saved(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    result = _signalled(
        cache_dir, [*RUN, f"run_dir={run_dir}"], signal_name="SIGTERM", at=1, within="warm-up"
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "interrupted during the SFT warm-up (step 2 of 4), before the first checkpoint: nothing "
        "to resume (the same command starts over)"
    )
    assert not (run_dir / "checkpoints").exists()
