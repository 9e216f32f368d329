"""``logging.wandb``: the config section, and what a run logs to W&B, read back from W&B's own
offline files.

Every W&B run here is ``offline`` (no network, no login) with every W&B directory under a
temporary one. What W&B logged is read from the transaction log it writes offline,
``<run_dir>/wandb/offline-run-<time>-<id>/run-<id>.wandb`` (what ``wandb sync`` uploads): a
LevelDB-style log of ``wandb.proto.wandb_internal_pb2.Record`` messages. Recent wandb (0.31
here) ships no Python reader for it any more (``wandb.sdk.internal.datastore`` is gone; the Go
``wandb-core`` reads it), so ``read_offline_runs`` below decodes the framing: a 7-byte file
header (``:W&B``, magic ``0xBEE1``, version), then 32 KiB blocks of chunks, each
``crc32 (4) | length (2, little-endian) | type (1: full, 2: first, 3: middle, 4: last)`` and the
payload.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import pathlib
import struct
import sys

import pytest

from jaxrl_llm.train import plots
from jaxrl_llm.train.config import LoggingSection, WandbSection
from jaxrl_llm.train.config_io import from_dict, load_config, to_dict
from jaxrl_llm.train.metrics import MetricsWriter, read_metrics
from jaxrl_llm.train.wandb_logger import ID_FILE
from tests.train.test_core import CountingConfig, CountingTrainer, _config

BLOCK = 32 * 1024
OFFLINE = WandbSection(project="jaxrl-llm-tests", mode="offline")


# -- reading W&B's offline files -------------------------------------------------------------


def _chunks(data: bytes, path: str) -> list[bytes]:
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += BLOCK - pos % BLOCK
            continue
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(payload)
        elif kind in (2, 3):
            pending += payload
        else:
            records.append(pending + payload)
            pending = b""
    return records


def _put(target: dict, items) -> None:
    """Sets ``target[key] = value`` for each protobuf item (``nested_key``: nested dicts)."""
    for item in items:
        *parents, last = [item.key] if item.key else list(item.nested_key)
        node = target
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = json.loads(item.value_json)


def read_offline_runs(run_dir) -> list[dict]:
    """What each W&B start in ``run_dir`` logged, in order of start: id, project, name, tags,
    config, history (step -> {key: value}), summary and whether the run was finished.

    Shuts W&B's service down first: offline, ``run.finish()`` may return before the service has
    written the log out (the next ``wandb.init`` starts a new service).
    """
    import wandb  # noqa: PLC0415
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415

    wandb.teardown()

    runs = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))):
        with open(path, "rb") as f:
            data = f.read()
        run = {"history": {}, "summary": {}, "config": {}, "finished": False}
        for payload in _chunks(data, path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                start = record.run.start_time
                run.update(
                    id=record.run.run_id,
                    project=record.run.project,
                    name=record.run.display_name,
                    tags=list(record.run.tags),
                    started=(start.seconds, start.nanos),
                )
                _put(run["config"], record.run.config.update)
            elif kind == "config":
                _put(run["config"], record.config.update)
            elif kind == "history":
                _put(run["history"].setdefault(record.history.step.num, {}), record.history.item)
            elif kind == "summary":
                _put(run["summary"], record.summary.update)
            elif kind == "telemetry" and record.telemetry.feature.finish:
                run["finished"] = True  # run.finish() was called (an exit record is not proof)
        run["config"].pop("_wandb", None)
        runs.append(run)
    # Directory names do not sort by start: a second start within the same second is "<id>-1".
    return sorted(runs, key=lambda run: run["started"])


def _logged(history: dict) -> dict[int, dict]:
    """The history without W&B's own keys (``_step``, ``_runtime``, ...)."""
    return {s: {k: v for k, v in r.items() if not k.startswith("_")} for s, r in history.items()}


@pytest.fixture(scope="module")
def offline_wandb(tmp_path_factory):
    """W&B kept off the network and out of $HOME; the service it starts is shut down after."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_API_KEY", raising=False)
        for name, value in {
            "WANDB_MODE": "offline",  # what ``mode: null`` falls back to
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(home),
            "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"),
            "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
            "WANDB_DISABLE_GIT": "true",
            "WANDB_DISABLE_CODE": "true",
            "WANDB_CONSOLE": "off",
            "WANDB__DISABLE_STATS": "true",
            "WANDB__DISABLE_META": "true",
        }.items():
            mp.setenv(name, value)
        yield wandb
        wandb.teardown()


@pytest.fixture(autouse=True)
def no_tensorboard(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)


# -- the config section -------------------------------------------------------------------------


def test_wandb_is_off_by_default_and_parses_from_yaml(tmp_path):
    assert LoggingSection().wandb is None
    assert from_dict(LoggingSection, {"wandb": None}).wandb is None
    path = tmp_path / "c.yaml"
    path.write_text(
        "logging:\n  wandb:\n    project: grpo\n    mode: offline\n    tags: [a, b]\n"
        "    entity: team\n    name: first\n    group: g\n    notes: hi\n"
    )
    cfg = load_config(CountingConfig, path, ["logging.wandb.group=g2"])
    assert cfg.logging.wandb == WandbSection(
        project="grpo",
        mode="offline",
        entity="team",
        name="first",
        group="g2",
        tags=("a", "b"),
        notes="hi",
    )
    # An override alone turns it on; ``mode`` defaults to null (WANDB_MODE, else online).
    cfg = load_config(CountingConfig, None, ["logging.wandb.project=p"])
    assert cfg.logging.wandb == WandbSection(project="p")
    assert cfg.logging.wandb.mode is None


@pytest.mark.parametrize(
    "wandb, message",
    [
        ({"mode": "offline"}, "missing required config key 'logging.wandb.project'"),
        ({}, "missing required config key 'logging.wandb.project'"),
        (
            {"project": "p", "mode": "ofline"},
            r"'logging.wandb.mode' must be one of \('online', 'offline', 'disabled'\), "
            "got 'ofline'",
        ),
        ({"project": "p", "projet": "q"}, "did you mean 'logging.wandb.project'"),
        (
            {"project": "p", "report_to": "wandb"},
            "unknown config key 'logging.wandb.report_to'; valid keys here: entity, group, "
            "mode, name, notes, project, tags",
        ),
        ({"project": " "}, "logging.wandb.project must be a non-empty string"),
        ({"project": "p", "tags": "a"}, "'logging.wandb.tags' expects a list"),
        ({"project": "p", "tags": [""]}, "logging.wandb.tags must be non-empty strings"),
        ({"project": "p", "entity": ""}, "logging.wandb.entity must be null or a non-empty"),
        ({"project": 3}, "'logging.wandb.project' expects a string"),
    ],
)
def test_bad_wandb_sections_fail_at_load_naming_the_key(tmp_path, wandb, message):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"logging": {"wandb": wandb}}))
    with pytest.raises(ValueError, match=message):
        load_config(CountingConfig, path)


def test_a_wandb_value_that_is_not_a_mapping_fails(tmp_path):
    with pytest.raises(ValueError, match="config section 'logging.wandb' must be a mapping"):
        load_config(CountingConfig, None, ["logging.wandb=my-project"])


def test_logging_section_rejects_a_negative_show_samples():
    with pytest.raises(ValueError, match="logging.show_samples must be >= 0, got -1"):
        load_config(CountingConfig, None, ["logging.show_samples=-1"])


# -- without W&B -------------------------------------------------------------------------------


def test_no_module_imports_wandb_at_import_time():
    """``wandb`` is imported only inside the functions that need it (startup stays fast)."""
    package = pathlib.Path(__file__).resolve().parents[2] / "jaxrl_llm"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for top in tree.body:  # module-level statements, and what top-level if / try hold
            if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                if any(name == "wandb" or name.startswith("wandb.") for name in names):
                    offenders.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert offenders == []


def test_without_wandb_nothing_imports_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would now fail
    CountingTrainer(_config(tmp_path / "run")).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert not (tmp_path / "run" / "wandb").exists()
    assert not (tmp_path / "run" / ID_FILE).exists()


def test_a_missing_wandb_package_fails_before_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = dataclasses.replace(
        _config(tmp_path / "run"), logging=LoggingSection(progress=False, wandb=OFFLINE)
    )
    with pytest.raises(ImportError, match=r'pip install "jaxrl-llm\[wandb\]"'):
        CountingTrainer(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    with pytest.raises(ImportError, match=r"logging.wandb needs the wandb package"):
        MetricsWriter(tmp_path / "w", wandb=OFFLINE, primary=True)


def test_only_the_primary_process_starts_a_wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def refuse(*args, **kwargs):
        raise AssertionError("wandb.init on a non-primary process")

    monkeypatch.setattr(wandb, "init", refuse)
    with MetricsWriter(tmp_path, wandb=OFFLINE, config={"seed": 0}, primary=False) as writer:
        writer.truncate(0)
        writer.write(1, {"loss": 1.0})
        writer.log_plots(1, [str(tmp_path / "plots" / "loss.png")])
        writer.write_summary({"steps": 1})
    assert writer.wandb is None
    assert os.listdir(tmp_path) == []


# -- offline runs, read back ---------------------------------------------------------------


def test_writer_logs_rows_plots_config_and_summary(tmp_path, offline_wandb):
    run_dir = tmp_path / "my-run"
    config = {"seed": 3, "trainer": {"max_steps": 3, "learning_rate": 0.5}, "tags": [1, 2]}
    settings = WandbSection(project="jaxrl-llm-tests", tags=("smoke",))  # mode null: WANDB_MODE
    with MetricsWriter(run_dir, tensorboard=False, wandb=settings, config=config) as writer:
        writer.truncate(0)
        for step in (1, 2, 3):
            writer.write(step, {"train/loss": 1.0 / step, "reward_mean": step / 4})
        writer.log_plots(3, plots.plot(run_dir, ("reward_mean", "train/loss")))
        writer.write_summary({"steps": 3, "eval_after": {"accuracy": 0.75}})
    [run] = read_offline_runs(run_dir)
    assert run["id"] == (run_dir / ID_FILE).read_text().strip()
    assert run["project"] == "jaxrl-llm-tests" and run["tags"] == ["smoke"]
    assert run["name"] == "my-run"  # null name: the run directory's
    assert run["config"] == config
    rows = {r.pop("step"): r for r in read_metrics(run_dir)}
    history = _logged(run["history"])
    for step, row in history.items():
        images = {k: row.pop(k) for k in list(row) if k.startswith("plots/")}
        assert row == rows[step]  # the same scalars as metrics.jsonl, at the same step
        assert sorted(images) == (["plots/reward_mean", "plots/train_loss"] if step == 3 else [])
        for image in images.values():
            assert image["_type"] == "image-file" and image["path"].endswith(".png")
    assert sorted(history) == [1, 2, 3]
    assert run["summary"]["steps"] == 3
    assert run["summary"]["eval_after"] == {"accuracy": 0.75}
    assert run["finished"]


def test_training_loop_logs_to_wandb_and_a_resume_continues_the_run(
    tmp_path, offline_wandb, monkeypatch
):
    inits = []

    def spy(*args, **kwargs):
        inits.append(kwargs)
        return real_init(*args, **kwargs)

    real_init = offline_wandb.init
    monkeypatch.setattr(offline_wandb, "init", spy)
    run_dir = tmp_path / "run"
    logging_section = LoggingSection(progress=False, tensorboard=False, wandb=OFFLINE)
    # Three steps, evaluated at step 2; then resumed from the step-3 checkpoint up to step 5.
    cfg = dataclasses.replace(_config(run_dir, max_steps=3, eval_every=2), logging=logging_section)
    CountingTrainer(cfg).fit()
    resumed = dataclasses.replace(
        cfg, resume=True, trainer=dataclasses.replace(cfg.trainer, max_steps=5)
    )
    summary = CountingTrainer(resumed).fit()

    assert [(i["mode"], i["project"], i["resume"]) for i in inits] == [
        ("offline", "jaxrl-llm-tests", "allow")
    ] * 2
    first, second = read_offline_runs(run_dir)
    assert first["id"] == second["id"] == (run_dir / ID_FILE).read_text().strip()
    assert first["config"] == to_dict(cfg) and second["config"] == to_dict(resumed)
    rows = {r.pop("step"): r for r in read_metrics(run_dir)}
    for run, steps in ((first, [1, 2, 3]), (second, [4, 5])):
        history = _logged(run["history"])
        assert sorted(history) == steps
        for step in steps:
            images = {k for k in history[step] if k.startswith("plots/")}
            scalars = {k: v for k, v in history[step].items() if k not in images}
            assert scalars == rows[step]
            # Plots at each evaluation (steps 2 and 4) and at the end (3 and 5), with the
            # timeline of the steps' phases.
            drawn = {"plots/w", "plots/eval_w", "plots/time_step", "plots/timeline"}
            expected = drawn if step > 1 else set()
            assert images == expected, step
        assert run["finished"]
    assert second["summary"]["eval_after"] == summary["eval_after"] == {"w": 2.5}
    assert second["summary"]["job"] == "counting"

    # A fresh start in the same directory (no checkpoint to resume) is a new W&B run.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ID_FILE).write_text("stale0id\n")
    with MetricsWriter(fresh, tensorboard=False, wandb=OFFLINE, resume=False) as writer:
        new_id = writer.wandb.id
    assert new_id != "stale0id" and (fresh / ID_FILE).read_text().strip() == new_id
