"""``train.plots``: one PNG per metric of ``metrics.jsonl``, drawn at every evaluation and at the
end of every job (matplotlib is a dependency: no silent fall-back)."""

from __future__ import annotations

import math

import pytest

from jaxrl_llm.train import plots
from jaxrl_llm.train.metrics import MetricsWriter

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_pngs(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, primary=True) as writer:
        for step in range(1, 5):
            row = {"reward_mean": step / 4, "nan": math.nan}
            if step % 2 == 0:
                row["eval/accuracy"] = 0.5
            writer.write(step, row)
    written = plots.plot(tmp_path, keys=("reward_mean", "eval/accuracy", "absent", "nan"))
    # Keys absent from every row, or never finite, are skipped; "/" becomes "_".
    assert written == [
        str(tmp_path / "plots" / "reward_mean.png"),
        str(tmp_path / "plots" / "eval_accuracy.png"),
    ]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "eval_accuracy.png",
        "reward_mean.png",
    ]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == PNG


def test_plot_redraws_over_the_previous_pngs(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, primary=True) as writer:
        writer.write(1, {"loss": 1.0})
        first = plots.plot(tmp_path, keys=("loss",))
        writer.write(2, {"loss": 0.5})
        second = plots.plot(tmp_path, keys=("loss",))
    assert first == second == [str(tmp_path / "plots" / "loss.png")]


def test_plot_nothing_to_draw_makes_no_folder(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, primary=True) as writer:
        writer.write(1, {"loss": 1.0})
    assert plots.plot(tmp_path, keys=("reward_mean",)) == []
    assert not (tmp_path / "plots").exists()


def test_plot_needs_metrics(tmp_path):
    with pytest.raises(FileNotFoundError):
        plots.plot(tmp_path)


def test_default_keys_are_the_rl_keys_and_each_job_plots_its_own():
    assert plots.DEFAULT_PLOT_KEYS == plots.RL_PLOT_KEYS
    assert {"reward_mean", "accuracy", "eval/accuracy", "time/step"} <= set(plots.RL_PLOT_KEYS)
    assert {"loss", "rewards/accuracies", "eval/rewards/accuracies"} <= set(
        plots.PREFERENCE_PLOT_KEYS
    )


def test_a_curve_takes_the_evaluations_before_and_after_training_as_points():
    rows = [
        {"step": 1, "eval/accuracy": math.nan},
        {"step": 2, "eval/accuracy": 0.5},
        {"step": 3},
        {"step": 4, "eval/accuracy": 0.75},
    ]
    extra = [(0, 0.25), (4, 0.0), (5, 0.9)]  # before training, a clash with a row, after
    assert plots.curve(rows, "eval/accuracy", extra) == [(0, 0.25), (2, 0.5), (4, 0.75), (5, 0.9)]
    assert plots.curve(rows, "absent") == []
