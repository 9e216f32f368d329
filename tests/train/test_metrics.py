"""metrics.jsonl rows, truncation on resume, summary.json, TensorBoard, progress bar (plots:
test_plots.py)."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.train.metrics import MetricsWriter, ProgressBar, read_metrics


def _lines(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_run(run_dir, steps, *, offset: float = 0.0, truncate_to: int | None = 0):
    with MetricsWriter(run_dir, tensorboard=False, primary=True) as writer:
        if truncate_to is not None:
            writer.truncate(truncate_to)
        for step in steps:
            writer.write(step, {"reward_mean": step / 10 + offset, "accuracy": step / 20})


@pytest.fixture(autouse=True)
def no_tensorboard(monkeypatch):
    """tests see the same thing whether or not tensorboardX is installed (the fake is opt-in)."""
    monkeypatch.setitem(sys.modules, "tensorboardX", None)


# -- rows ----------------------------------------------------------------------------------------


def test_rows_are_json_floats(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, primary=True) as writer:
        row = writer.write(
            1,
            {
                "reward_mean": np.float32(0.5),
                "accuracy": jnp.asarray(0.25),
                "count": 3,
                "clipped": np.bool_(True),
                "loss": jnp.ones((1,)) * 2,
                "nan": float("nan"),
            },
        )
        writer.write(np.int64(2), {"reward_mean": 1.5})
    rows = _lines(tmp_path)
    assert rows[0] == {k: v for k, v in row.items() if k != "nan"} | {"nan": rows[0]["nan"]}
    assert rows[0]["step"] == 1 and type(rows[0]["step"]) is int
    assert rows[0]["reward_mean"] == 0.5 and rows[0]["accuracy"] == 0.25
    assert rows[0]["count"] == 3.0 and type(rows[0]["count"]) is float
    assert rows[0]["clipped"] == 1.0 and rows[0]["loss"] == 2.0
    assert math.isnan(rows[0]["nan"])
    assert rows[1] == {"step": 2, "reward_mean": 1.5}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_rows_are_flushed_at_once(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    writer.write(1, {"a": 1.0})
    assert _lines(tmp_path) == [{"step": 1, "a": 1.0}]  # before close
    writer.close()


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"vec": np.zeros(3)}, "metric 'vec' must be a scalar, got an array of shape (3,)"),
        ({"name": "x"}, "metric 'name' must be a number, got str"),
        ({"none": None}, "metric 'none' must be a number"),
        ({"step": 3}, "must not contain a 'step' key"),
    ],
)
def test_bad_metrics(tmp_path, metrics, message):
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    with pytest.raises(ValueError) as info:
        writer.write(1, metrics)
    assert message in str(info.value)


def test_steps_must_increase(tmp_path):
    _write_run(tmp_path, [1, 2, 3])
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    with pytest.raises(ValueError, match=r"step 3 is not after the last row \(step 3\).*truncate"):
        writer.write(3, {"a": 1.0})
    writer.write(4, {"a": 1.0})
    with pytest.raises(ValueError, match="step 4 is not after"):
        writer.write(4, {"a": 1.0})
    writer.close()


def test_non_primary_process_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, primary=False) as writer:
        writer.truncate(0)
        assert writer.write(1, {"a": np.float32(2)}) == {"step": 1, "a": 2.0}
        writer.write_summary({"a": 1})
    assert not run_dir.exists()


# -- resume --------------------------------------------------------------------------------------


def test_truncate_on_resume_matches_an_uninterrupted_run(tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    _write_run(uninterrupted, range(1, 7))
    # Killed after step 5; the last checkpoint was step 3: rows 4, 5 are redone.
    _write_run(resumed, range(1, 6))
    _write_run(resumed, range(4, 7), truncate_to=3)
    assert (resumed / "metrics.jsonl").read_text() == (uninterrupted / "metrics.jsonl").read_text()
    assert [r["step"] for r in _lines(resumed)] == [1, 2, 3, 4, 5, 6]


def test_truncate_zero_starts_afresh_and_missing_file_is_fine(tmp_path):
    _write_run(tmp_path, [1, 2])
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    writer.truncate(0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    writer.write(1, {"a": 1.0})
    writer.close()
    assert _lines(tmp_path) == [{"step": 1, "a": 1.0}]
    fresh = MetricsWriter(tmp_path / "new", tensorboard=False, primary=True)
    fresh.truncate(5)
    assert not (tmp_path / "new" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="truncate step must be >= 0"):
        fresh.truncate(-1)


def test_truncate_drops_a_line_cut_short_by_a_kill(tmp_path):
    _write_run(tmp_path, [1, 2, 3])
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 4, "reward_me')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    writer.truncate(3)
    writer.write(4, {"a": 1.0})
    writer.close()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]


def test_malformed_middle_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": "1"}\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 1 has no integer 'step'"):
        read_metrics(tmp_path)


# -- summary -------------------------------------------------------------------------------------


def test_summary_json(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, primary=True)
    summary = {
        "eval_after_rl": {"accuracy": np.float32(0.75), "reward": jnp.asarray(0.5)},
        "steps": np.int64(40),
        "objective": "grpo",
        "curve": np.arange(3),
        "pair": (1, 2),
    }
    path = writer.write_summary(summary)
    assert path == str(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "eval_after_rl": {"accuracy": 0.75, "reward": 0.5},
        "steps": 40,
        "objective": "grpo",
        "curve": [0, 1, 2],
        "pair": [1, 2],
    }
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        writer.write_summary({"bad": object()})


# -- TensorBoard ---------------------------------------------------------------------------------


class _FakeSummaryWriter:
    instances: list[_FakeSummaryWriter] = []

    def __init__(self, logdir, purge_step=None, filename_suffix=""):
        self.logdir, self.purge_step, self.suffix = logdir, purge_step, filename_suffix
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        _FakeSummaryWriter.instances.append(self)

    def add_scalar(self, tag, value, global_step=None):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    _FakeSummaryWriter.instances = []
    module = types.ModuleType("tensorboardX")
    module.SummaryWriter = _FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "tensorboardX", module)
    return _FakeSummaryWriter.instances


def test_tensorboard_scalars_and_purge_on_resume(tmp_path, fake_tensorboard):
    with MetricsWriter(tmp_path, primary=True) as writer:
        writer.truncate(0)
        writer.write(1, {"reward_mean": 0.5, "kl": np.float32(0.25)})
    with MetricsWriter(tmp_path, primary=True) as writer:
        writer.truncate(1)
        writer.write(2, {"reward_mean": 0.75})
    first, second = fake_tensorboard
    assert first.logdir == str(tmp_path / "tensorboard")
    assert first.purge_step == 1 and second.purge_step == 2
    assert first.suffix != second.suffix
    assert first.scalars == [("reward_mean", 0.5, 1), ("kl", 0.25, 1)]
    assert second.scalars == [("reward_mean", 0.75, 2)]
    assert first.closed and second.closed


def test_tensorboard_off_or_missing(tmp_path, fake_tensorboard, monkeypatch, caplog):
    with MetricsWriter(tmp_path / "off", tensorboard=False, primary=True) as writer:
        writer.write(1, {"a": 1.0})
    assert fake_tensorboard == []
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not installed
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        with MetricsWriter(tmp_path / "missing", primary=True) as writer:  # auto: quiet
            writer.write(1, {"a": 1.0})
        assert caplog.records == []
        with MetricsWriter(tmp_path / "asked", tensorboard=True, primary=True) as writer:
            writer.write(1, {"a": 1.0})
            writer.write(2, {"a": 1.0})
    assert _lines(tmp_path / "missing") == [{"step": 1, "a": 1.0}]
    assert [r.getMessage() for r in caplog.records] == [  # said once
        "logging.tensorboard=true, but tensorboardX is not installed: no TensorBoard events are "
        'written (pip install "jaxrl-llm[tensorboard]")'
    ]


# -- progress bar --------------------------------------------------------------------------------


def test_progress_bar_shows_step_reward_accuracy_tokens(tmp_path):
    stream = io.StringIO()
    bar = ProgressBar(10, initial=3, file=stream)
    bar.update({"reward_mean": np.float32(0.5), "accuracy": 0.25, "tokens_per_s": 1234.4})
    assert bar.n == 4
    assert bar.postfix == {"reward": "0.500", "acc": "0.250", "tok/s": "1234"}
    bar.update({"reward_mean": 0.75})  # accuracy and tokens/s keep their last values
    assert bar.n == 5
    bar.close()
    text = stream.getvalue()
    assert "3/10" in text  # the initial draw
    final = text.strip().split("\r")[-1]
    assert "5/10" in final
    assert "reward=0.750" in final and "acc=0.250" in final and "tok/s=1234" in final


def test_progress_bar_checks_and_disable():
    with pytest.raises(ValueError, match=r"initial=11 must lie in \[0, total=10\]"):
        ProgressBar(10, initial=11)
    stream = io.StringIO()
    with ProgressBar(2, disable=True, file=stream) as bar:
        bar.update({"reward_mean": 1.0})
    assert stream.getvalue() == ""
