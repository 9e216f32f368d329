"""The run core (``train.core``) on a one-number job: the loop, its outputs and the resume guard.

``CountingTrainer`` is the smallest wing: its state is one scalar ``w`` that each step moves by
``trainer.learning_rate``, so every row, evaluation and checkpoint is known by hand. Nothing is
compiled beyond a scalar add, so the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil

import jax.numpy as jnp
import pytest

from jaxrl_llm.train import core
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import CheckpointSection, LoggingSection
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics

TOKENS_PER_STEP = 8.0


@dataclasses.dataclass(frozen=True)
class CountingTrainerSection:
    max_steps: int = 4
    eval_every: int = 0
    learning_rate: float = 0.5


@dataclasses.dataclass(frozen=True)
class CountingConfig:
    job: str = "counting"
    run_dir: str = "runs/counting"
    seed: int = 0
    resume: bool = False
    resume_force: bool = False
    trainer: CountingTrainerSection = CountingTrainerSection()
    checkpoint: CheckpointSection = CheckpointSection(every_steps=2, keep=5, async_save=False)
    logging: LoggingSection = LoggingSection(tensorboard=False, plots=False, progress=False)


class CountingTrainer(core.Trainer):
    """``w ← w + learning_rate`` per step; the evaluation reports ``w``."""

    plot_keys = ("w", "eval/w", "time/step", "never_written")
    eval_key = "eval_before"

    def __init__(self, cfg: CountingConfig):
        super().__init__(cfg)
        self.open_run()

    def setup(self) -> None:
        self.state = {"w": jnp.zeros((), jnp.float32)}

    def train_step(self, step, timer):
        with timer.phase("update"):
            self.state = {"w": self.state["w"] + self.cfg.trainer.learning_rate}
        timer.count("update", TOKENS_PER_STEP)
        return {"w": float(self.state["w"])}

    def evaluate(self):
        return {"w": float(self.state["w"])}

    def save_extra(self):
        return {"saved_at": self.completed_steps}

    def export(self, directory) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "w.json").write_text(json.dumps(float(self.state["w"])))

    def summary(self):
        return {"counting": True}

    def prompt_format(self):
        return None  # no text policy


def _config(run_dir, **trainer) -> CountingConfig:
    return CountingConfig(
        run_dir=str(run_dir), trainer=dataclasses.replace(CountingTrainerSection(), **trainer)
    )


# -- config_changes and PhaseTimer ---------------------------------------------------------


def test_config_changes_lists_every_differing_leaf_by_dotted_key():
    old = {"seed": 0, "trainer": {"max_steps": 4, "learning_rate": 0.5}, "rewards": [1, 2]}
    new = {"seed": 0, "trainer": {"max_steps": 6, "eval_every": 2}, "rewards": [1, 3]}
    assert core.config_changes(old, new) == {
        "rewards": ([1, 2], [1, 3]),
        "trainer.eval_every": (None, 2),
        "trainer.learning_rate": (0.5, None),
        "trainer.max_steps": (4, 6),
    }
    assert core.config_changes(old, old) == {}


def test_phase_timer_sums_seconds_and_divides_tokens_by_them(monkeypatch):
    clock = iter([0.0, 1.5, 10.0, 10.5, 20.0, 22.0])
    monkeypatch.setattr(core.time, "perf_counter", lambda: next(clock))
    timer = core.PhaseTimer()
    with timer.phase("rollout"):
        pass
    with timer.phase("update"):
        pass
    with timer.phase("rollout"):  # a second draw adds to the first
        pass
    timer.count("rollout", 70.0)
    timer.count("rollout", 30.0)
    assert timer.metrics() == {
        "time/rollout": 3.5,
        "time/update": 0.5,
        "tokens_per_s/rollout": 100.0 / 3.5,
    }


# -- the loop and its outputs --------------------------------------------------------------


def test_fit_writes_rows_checkpoints_summary_export_and_plots(tmp_path):
    cfg = dataclasses.replace(
        _config(tmp_path / "run", eval_every=2),
        logging=dataclasses.replace(CountingConfig().logging, plots=True),
    )
    summary = CountingTrainer(cfg).fit()
    run_dir = tmp_path / "run"
    assert load_config(CountingConfig, run_dir / "config.yaml") == cfg
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["w"] for r in rows] == [0.5, 1.0, 1.5, 2.0]
    assert [r.get("eval/w") for r in rows] == [None, 1.0, None, 2.0]
    for row in rows:
        assert row["tokens_per_s/update"] == pytest.approx(TOKENS_PER_STEP / row["time/update"])
        assert ("time/evaluation" in row) == ("eval/w" in row)
        # Step 2's checkpoint is timed in step 3's row.
        assert ("time/checkpoint" in row) == (row["step"] == 3)
        phases = row["time/update"] + row.get("time/evaluation", 0.0)
        assert row["time/step"] >= phases
    assert summary == {
        "job": "counting",
        "steps": 4,
        "eval_before": {"w": 0.0},
        "eval_after": {"w": 2.0},
        "counting": True,
        "hf": str(run_dir / "hf"),
    }
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert json.loads((run_dir / "hf" / "w.json").read_text()) == 2.0
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2, 4]
        _, extra = ckpt.restore_raw(4)
    assert extra == {"eval_before": {"w": 0.0}, "saved_at": 4}
    # One PNG per plotted key present in the rows, and the timeline of the steps' phases.
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == [
        "eval_w.png",
        "time_step.png",
        "timeline.png",
        "w.png",
    ]


def test_plots_off_draws_nothing(tmp_path):
    CountingTrainer(_config(tmp_path / "run")).fit()
    assert not (tmp_path / "run" / "plots").exists()


# -- resume ------------------------------------------------------------------------------------


@pytest.fixture
def stopped_at_2(tmp_path):
    """A 4-step run stopped after its step-2 checkpoint (``max_steps=2``)."""
    run_dir = tmp_path / "run"
    CountingTrainer(_config(run_dir, max_steps=2)).fit()
    return run_dir


def test_resume_continues_from_the_latest_checkpoint(stopped_at_2, tmp_path):
    straight = tmp_path / "straight"
    CountingTrainer(_config(straight)).fit()
    cfg = dataclasses.replace(_config(stopped_at_2), resume=True)
    summary = CountingTrainer(cfg).fit()
    assert summary["eval_after"] == {"w": 2.0}
    assert summary["eval_before"] == {"w": 0.0}  # from the checkpoint, not re-evaluated
    strip = lambda rows: [{k: v for k, v in r.items() if "/" not in k} for r in rows]  # noqa: E731
    assert strip(read_metrics(stopped_at_2)) == strip(read_metrics(straight))


def test_an_existing_run_needs_resume(stopped_at_2):
    text = (stopped_at_2 / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"already holds checkpoints \(latest step 2\)"):
        CountingTrainer(_config(stopped_at_2, max_steps=4))
    assert (stopped_at_2 / "config.yaml").read_text() == text


def test_resume_with_a_key_that_breaks_exactness_is_refused(stopped_at_2):
    text = (stopped_at_2 / "config.yaml").read_text()
    rows = read_metrics(stopped_at_2)
    cfg = dataclasses.replace(_config(stopped_at_2, learning_rate=0.25, max_steps=4), resume=True)
    with pytest.raises(ValueError) as info:
        CountingTrainer(cfg)
    message = str(info.value)
    # Every change is listed; only the unsafe one is blamed.
    assert "trainer.learning_rate: 0.5 -> 0.25" in message
    assert "trainer.max_steps: 2 -> 4" in message
    assert "; trainer.learning_rate would make the resumed run differ" in message
    assert "resume_force=true" in message
    # Refused before anything was touched.
    assert (stopped_at_2 / "config.yaml").read_text() == text
    assert read_metrics(stopped_at_2) == rows


def test_resume_force_accepts_the_change_with_a_warning(stopped_at_2, caplog):
    cfg = dataclasses.replace(
        _config(stopped_at_2, learning_rate=0.25, max_steps=4), resume=True, resume_force=True
    )
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        summary = CountingTrainer(cfg).fit()
    assert "resuming with a changed config: " in caplog.text
    assert "trainer.learning_rate: 0.5 -> 0.25" in caplog.text
    # Steps 3 and 4 at the new rate, from the checkpointed w = 1.
    assert summary["eval_after"] == {"w": 1.5}
    assert load_config(CountingConfig, stopped_at_2 / "config.yaml") == cfg


def test_a_moved_run_directory_resumes(stopped_at_2, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(stopped_at_2, moved)
    summary = CountingTrainer(dataclasses.replace(_config(moved), resume=True)).fit()
    assert summary["eval_after"] == {"w": 2.0}
    assert load_config(CountingConfig, moved / "config.yaml").run_dir == str(moved)


@pytest.mark.parametrize(
    "change",
    [
        {"trainer": CountingTrainerSection(max_steps=6, eval_every=3)},
        {"checkpoint": CheckpointSection(every_steps=1, keep=2, async_save=True)},
        {"logging": LoggingSection(tensorboard=False, plots=True, progress=True, show_samples=0)},
    ],
    ids=["steps_and_evaluation", "checkpoints", "logging"],
)
def test_resume_safe_keys_may_change(stopped_at_2, change, caplog):
    cfg = dataclasses.replace(_config(stopped_at_2), resume=True, **change)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        trainer = CountingTrainer(cfg)
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    assert trainer.latest == 2
    assert "resuming with a changed config" in caplog.text
    assert isinstance(trainer.run_dir, pathlib.Path)


def test_resuming_notes_no_change_for_the_resume_flag_itself(stopped_at_2, caplog):
    """``resume=true`` is how a run is continued, not a config change (issue 46)."""
    cfg = dataclasses.replace(_config(stopped_at_2, max_steps=2), resume=True)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        trainer = CountingTrainer(cfg)
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    assert trainer.latest == 2
    assert "resuming with a changed config" not in caplog.text


def test_resume_with_nothing_to_resume_says_so_and_starts(tmp_path, caplog):
    run_dir = tmp_path / "fresh"
    cfg = dataclasses.replace(_config(run_dir), resume=True)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        summary = CountingTrainer(cfg).fit()
    said = [r.getMessage() for r in caplog.records if "resume=true" in r.getMessage()]
    assert said == [
        f"resume=true: {run_dir / 'checkpoints'} holds no checkpoint to resume from; starting "
        "from the beginning"
    ]
    assert summary["eval_after"] == {"w": 2.0}


class EvaluationCountingTrainer(CountingTrainer):
    """Counts its evaluations and records what the plots are drawn with."""

    def evaluate(self):
        self.evaluations = getattr(self, "evaluations", 0) + 1
        return super().evaluate()


def test_the_last_steps_evaluation_is_the_one_after_training_and_both_ends_are_plotted(
    tmp_path, monkeypatch
):
    drawn = []
    monkeypatch.setattr(
        core.plots, "plot", lambda run_dir, keys, extra=None: drawn.append(extra) or []
    )
    cfg = _config(tmp_path / "run", max_steps=4, eval_every=2)
    cfg = dataclasses.replace(cfg, logging=LoggingSection(tensorboard=False, plots=True))
    trainer = EvaluationCountingTrainer(cfg)
    summary = trainer.fit()
    # before, at steps 2 and 4; step 4's is the one after training (not evaluated again).
    assert trainer.evaluations == 3
    assert summary["eval_before"] == {"w": 0.0} and summary["eval_after"] == {"w": 2.0}
    # The plots at each evaluation and at the end carry the evaluation before training at
    # step 0, and the last one the evaluation after it at the last step.
    assert drawn == [{"eval/w": [(0, 0.0)]}] * 2 + [{"eval/w": [(0, 0.0), (4, 2.0)]}]
