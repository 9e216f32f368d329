"""The RL trainer end to end on the built-in task: step metrics, resume, interrupted saves,
evaluation samples, plots, errors.

One uninterrupted 6-step GRPO run (checkpoints every 3 steps, two minibatches per step, a
learning-rate warm-up and evaluations every 3 steps) is the reference. A run stopped at step 3
and resumed to 6, and a run killed while saving step 6 and resumed, must both reproduce it
exactly: the same metric rows (wall-clock keys aside), the same summary and the same final
train state and reference, restored from the checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.rewards import is_correct
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.context import load_examples
from jaxrl_llm.train.rl.run import run
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.reference import advantages as ref_advantages
from tests.train.rl import rl_helpers

GRPO = rl_helpers.CONFIGS / "grpo.yaml"
RESUME_OVERRIDES = (
    rl_helpers.SHAPED_REWARDS,
    "trainer.max_steps=6",
    "trainer.minibatches=2",
    # A warm-up makes every optimizer step's learning rate differ: a resumed run that lost the
    # optimizer step count would not reproduce the uninterrupted one.
    "trainer.warmup_steps=4",
    "trainer.eval_every=3",
    "checkpoint.every_steps=3",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "jax_cache"


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(cache_dir):
    with rl_helpers.persistent_compilation_cache(cache_dir):
        yield


def _resume_config(run_dir, *extra: str) -> TrainConfig:
    return rl_helpers.tiny_config(GRPO, run_dir, *RESUME_OVERRIDES, *extra)


@dataclasses.dataclass
class Uninterrupted:
    cfg: TrainConfig
    summary: dict
    rollouts: list  # the Samples of each step, in order


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run, recording what each step sampled."""
    cfg = _resume_config(tmp_path_factory.mktemp("uninterrupted"))
    rollouts = []
    original = RLTrainer.rollout

    def recording_rollout(self, step, timer):
        samples, info = original(self, step, timer)
        rollouts.append(samples)
        return samples, info

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RLTrainer, "rollout", recording_rollout)
        summary = run(cfg)
    return Uninterrupted(cfg, summary, rollouts)


def _restore_latest(run_dir, cfg: TrainConfig, scratch: pathlib.Path):
    """``(state, extra, reference)`` of the latest checkpoint in ``run_dir``, on the host.

    A fresh trainer in ``scratch`` provides the structure and shardings to restore into, so
    nothing is written to ``run_dir``.
    """
    template = RLTrainer(dataclasses.replace(cfg, run_dir=str(scratch)))
    try:
        template.setup()
        with Checkpointer(pathlib.Path(run_dir) / "checkpoints") as ckpt:
            state, extra, reference = ckpt.restore(
                abstract_state=template.state, abstract_reference=template.reference
            )
    finally:
        template.checkpointer.close()
        template.metrics_writer.close()
    state = state._replace(rng=jax.random.key_data(state.rng))
    return jax.device_get(state), extra, jax.device_get(reference)


def _without_hf(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "hf"}


def _assert_same_run(cfg: TrainConfig, summary: dict, expected: Uninterrupted, scratch) -> None:
    run_dir = pathlib.Path(cfg.run_dir)
    # Only the path of the exported policy differs: the policy itself must not.
    assert _without_hf(summary) == _without_hf(expected.summary)
    assert summary["hf"] == str(run_dir / "hf")
    assert rl_helpers.read_json(run_dir / "summary.json") == summary
    _, exported = models.load_pretrained(run_dir / "hf", dtype=np.float32)
    _, expected_export = models.load_pretrained(
        pathlib.Path(expected.cfg.run_dir) / "hf", dtype=np.float32
    )
    chex.assert_trees_all_equal(exported, expected_export)
    rows = rl_helpers.without_timing(read_metrics(run_dir))
    assert rows == rl_helpers.without_timing(read_metrics(expected.cfg.run_dir))
    state, extra, reference = _restore_latest(run_dir, cfg, scratch / "a")
    expected_state, expected_extra, expected_reference = _restore_latest(
        expected.cfg.run_dir, cfg, scratch / "b"
    )
    assert int(state.step) == 6 * 2  # RL steps x minibatches
    chex.assert_trees_all_equal(state, expected_state)
    assert reference is not None
    chex.assert_trees_all_equal(reference, expected_reference)
    assert extra == expected_extra


# -- the reference run itself --------------------------------------------------------------------


def test_run_dir_is_complete(uninterrupted):
    cfg = uninterrupted.cfg
    run_dir = pathlib.Path(cfg.run_dir)
    rl_helpers.check_run_dir(run_dir, cfg, uninterrupted.summary)
    rl_helpers.check_rows(read_metrics(run_dir), cfg)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3, 6]
        # A frozen reference is saved once, with the first checkpoint.
        assert ckpt.reference_steps() == [3]


def _tensorboard_scalars(directory: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value)]`` read back from the TFRecord event files in ``directory``."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            length = int.from_bytes(data[offset : offset + 8], "little")
            record = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4  # length, its CRC, the record, its CRC
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_plots_and_tensorboard_events_are_written(tmp_path):
    """A real run fills plots/ (matplotlib, drawn whenever ``logging.plots``) and tensorboard/
    (tensorboardX, in the test extra) with the metrics of metrics.jsonl."""
    pytest.importorskip("tensorboardX")
    cfg = rl_helpers.tiny_config(
        GRPO,
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        "trainer.max_steps=2",
        "logging.plots=true",
        "logging.tensorboard=true",
    )
    run(cfg)
    run_dir = tmp_path / "run"
    pngs = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    want = {"reward_mean.png", "accuracy.png", "completion_length_mean.png", "kl.png"}
    assert want | {"time_step.png", "entropy.png"} <= set(pngs)
    assert all((run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in pngs)
    scalars = _tensorboard_scalars(run_dir / "tensorboard")
    rows = read_metrics(run_dir)
    for key in ("reward_mean", "kl", "entropy"):
        assert [step for step, _ in scalars[key]] == [1, 2]
        np.testing.assert_allclose([v for _, v in scalars[key]], [r[key] for r in rows], rtol=1e-6)


def test_samples_jsonl_holds_every_evaluation(uninterrupted):
    """One block of greedy completions of the held-out prompts per evaluation -- before the
    run and every ``eval_every`` steps; the last step's is the one after the run (not sampled
    twice) -- each agreeing with that evaluation's accuracy and mean reward."""
    cfg, summary = uninterrupted.cfg, uninterrupted.summary
    run_dir = pathlib.Path(cfg.run_dir)
    samples = rl_helpers.check_samples(run_dir, cfg)
    size = cfg.data.eval_size
    blocks = [samples[i : i + size] for i in range(0, len(samples), size)]
    assert [{row["step"] for row in block} for block in blocks] == [{0}, {3}, {6}]
    _, eval_examples = load_examples(cfg)
    assert len(eval_examples) == size
    rows = {row["step"]: row for row in read_metrics(run_dir)}
    expected = [
        summary["eval_before_rl"],
        {"accuracy": rows[3]["eval/accuracy"], "reward_mean": rows[3]["eval/reward_mean"]},
        summary["eval_after_rl"],
    ]
    assert summary["eval_after_rl"] == {
        "accuracy": rows[6]["eval/accuracy"],
        "reward_mean": rows[6]["eval/reward_mean"],
    }
    for block, want in zip(blocks, expected, strict=True):
        assert [row["prompt"] for row in block] == [ex.prompt for ex in eval_examples]
        assert np.mean([row["correct"] for row in block]) == pytest.approx(want["accuracy"])
        assert np.mean([row["reward"] for row in block]) == pytest.approx(want["reward_mean"])
        # ``correct`` is the answer check of the completion text.
        for row, example in zip(block, eval_examples):
            assert row["correct"] == is_correct(row["completion"], example)


def test_the_final_policy_is_a_hugging_face_checkpoint(uninterrupted, tmp_path):
    """``run_dir/hf`` holds the last step's policy, reloadable as it was trained."""
    cfg = uninterrupted.cfg
    run_dir = pathlib.Path(cfg.run_dir)
    config, params = models.load_pretrained(run_dir / "hf", dtype=np.float32)
    state, _, _ = _restore_latest(run_dir, cfg, tmp_path / "template")
    assert config.vocab_size == rl_helpers.model_vocab_size(cfg)
    chex.assert_trees_all_close(jax.device_get(params), state.params, rtol=0, atol=0)


def test_step_metrics_describe_the_sampled_batch(uninterrupted):
    """Rewards, lengths and GRPO advantages recomputed from each step's samples."""
    cfg = uninterrupted.cfg
    group = cfg.rollout.group_size
    rows = read_metrics(cfg.run_dir)
    assert len(uninterrupted.rollouts) == len(rows) == 6
    eos = 2  # <eos> of the character tokenizer
    for row, samples in zip(rows, uninterrupted.rollouts):
        rewards = samples.rewards.astype(np.float64)
        assert rewards.shape == (cfg.rollout.prompts_per_step * group,)
        np.testing.assert_allclose(
            rewards, samples.components["math_match"] + samples.components["overlong"], atol=1e-6
        )
        assert row["reward_mean"] == pytest.approx(rewards.mean(), abs=1e-6)
        assert row["reward_std"] == pytest.approx(rewards.std(), abs=1e-6)
        assert row["accuracy"] == pytest.approx(samples.components["math_match"].mean())
        advantages = ref_advantages.grpo(rewards, group)
        for stat in ("mean", "std", "min", "max"):
            value = getattr(np, stat)(advantages)
            assert row[f"advantage_{stat}"] == pytest.approx(value, abs=1e-4), stat
        constant = [len(set(g)) == 1 for g in rewards.reshape(-1, group).tolist()]
        assert row["zero_variance_frac"] == pytest.approx(np.mean(constant))
        lengths = samples.completion_mask.sum(axis=1)
        assert row["completion_length_mean"] == pytest.approx(lengths.mean())
        assert row["completion_length_max"] == lengths.max()
        ends_with_eos = [
            n > 0 and tokens[n - 1] == eos for tokens, n in zip(samples.completion_tokens, lengths)
        ]
        assert row["completion_clipped_frac"] == pytest.approx(1.0 - np.mean(ends_with_eos))
        # Mask is a prefix: generated tokens up to and including EOS, padding after.
        for mask, n in zip(samples.completion_mask, lengths):
            assert mask[:n].all() and not mask[n:].any()
        # Every group shares one prompt.
        prompts = samples.prompt_tokens.reshape(-1, group, samples.prompt_tokens.shape[1])
        assert (prompts == prompts[:, :1]).all()


def test_evaluations_every_3_steps_and_after_the_run(uninterrupted):
    rows = read_metrics(uninterrupted.cfg.run_dir)
    with_eval = [row["step"] for row in rows if "eval/accuracy" in row]
    assert with_eval == [3, 6]
    # The evaluation after the last step and the end-of-run one see the same parameters.
    last = rows[-1]
    after = uninterrupted.summary["eval_after_rl"]
    assert last["eval/accuracy"] == after["accuracy"]
    assert last["eval/reward_mean"] == after["reward_mean"]


def test_parameters_move_and_approx_kl_appears_with_two_minibatches(uninterrupted):
    rows = read_metrics(uninterrupted.cfg.run_dir)
    assert all(row["grad_norm"] > 0 for row in rows)
    # The second minibatch sees a policy one update away from the sampling one.
    assert any(abs(row["approx_kl"]) > 0 for row in rows)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert rows[-1]["kl"] > 0.0


# -- resume --------------------------------------------------------------------------------------


def test_stop_at_3_then_resume_to_6_equals_uninterrupted(tmp_path, uninterrupted):
    cfg = _resume_config(tmp_path / "resumed")
    first = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=3))
    run(first)
    assert [row["step"] for row in read_metrics(tmp_path / "resumed")] == [1, 2, 3]
    with Checkpointer(tmp_path / "resumed" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3]

    resumed = dataclasses.replace(cfg, resume=True)
    summary = run(resumed)
    _assert_same_run(resumed, summary, uninterrupted, tmp_path)
    assert load_config(TrainConfig, tmp_path / "resumed" / "config.yaml") == resumed


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from orbax.checkpoint._src.path import atomicity
    from jaxrl_llm.train import checkpoint, cli

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    save = checkpoint.Checkpointer.save

    def save_then_die_before_commit(self, step, *args, **kwargs):
        if step == int(os.environ["KILL_AT_STEP"]):
            # Earlier saves commit first; then every file of this step is written and the
            # rename that would commit it kills the process.
            self.wait()
            atomicity.AtomicRenameTemporaryPath.finalize = die
        return save(self, step, *args, **kwargs)

    checkpoint.Checkpointer.save = save_then_die_before_commit
    cli.train_main(sys.argv[1:])
    print("not killed")
    """
)


def test_save_killed_midway_keeps_the_previous_checkpoint_and_resumes(
    tmp_path, uninterrupted, cache_dir
):
    run_dir = tmp_path / "killed"
    cfg = _resume_config(run_dir)
    args = [str(GRPO), *rl_helpers.TINY, f"run_dir={run_dir}", *RESUME_OVERRIDES]
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **rl_helpers.cache_env(cache_dir), "KILL_AT_STEP": "6"},
    )
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert any(".orbax-checkpoint-tmp" in name for name in os.listdir(run_dir / "checkpoints"))
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3]
    # Steps 4-6 were logged before the save died; resuming drops and redoes them.
    assert len(read_metrics(run_dir)) == 6

    resumed = dataclasses.replace(cfg, resume=True)
    summary = run(resumed)
    _assert_same_run(resumed, summary, uninterrupted, tmp_path)


def test_resume_false_on_a_run_dir_with_checkpoints_is_refused(tmp_path, uninterrupted):
    run_dir = tmp_path / "existing"
    shutil.copytree(uninterrupted.cfg.run_dir, run_dir)
    cfg = dataclasses.replace(uninterrupted.cfg, run_dir=str(run_dir))
    assert cfg.resume is False
    rows = read_metrics(run_dir)
    config_text = (run_dir / "config.yaml").read_text()
    with pytest.raises(
        ValueError, match=r"already holds checkpoints \(latest step 6\).*resume=true"
    ):
        RLTrainer(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=9)))
    # Refused before anything was overwritten, the resolved config included.
    assert (run_dir / "config.yaml").read_text() == config_text
    assert read_metrics(run_dir) == rows
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3, 6]


def test_resume_with_a_changed_config_refuses_keys_that_break_exactness(tmp_path, uninterrupted):
    """A resumed run may change the step count, evaluation and checkpoint cadence and logging;
    anything else (here the learning rate) is refused by name unless ``resume_force=true``."""
    run_dir = tmp_path / "existing"
    shutil.copytree(uninterrupted.cfg.run_dir, run_dir)
    cfg = dataclasses.replace(uninterrupted.cfg, run_dir=str(run_dir), resume=True)
    config_text = (run_dir / "config.yaml").read_text()
    changed = dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, learning_rate=1e-3, max_steps=9)
    )
    with pytest.raises(ValueError, match=r"trainer.learning_rate: 0.0002 -> 0.001.*resume_force"):
        RLTrainer(changed)
    assert (run_dir / "config.yaml").read_text() == config_text
    with pytest.raises(ValueError, match=r"; trainer.learning_rate would make") as info:
        RLTrainer(changed)
    assert "trainer.max_steps would" not in str(info.value)

    for accepted in (
        dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=9)),
        dataclasses.replace(changed, resume_force=True),
    ):
        trainer = RLTrainer(accepted)
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
        assert trainer.latest == 6
        assert load_config(TrainConfig, run_dir / "config.yaml") == accepted


# -- reference policies --------------------------------------------------------------------------


def _initial_policy(cfg: TrainConfig):
    """The policy a run starts from (no SFT in the tiny configs), without training it."""
    trainer = RLTrainer(dataclasses.replace(cfg, run_dir=f"{cfg.run_dir}-initial"))
    trainer.setup()
    params = jax.device_get(trainer.policy_params)
    trainer.checkpointer.close()
    trainer.metrics_writer.close()
    return params


@pytest.mark.parametrize("mode", ["frozen", "refresh", "ema", "none"])
def test_reference_modes(tmp_path, mode):
    """frozen: the initial policy; refresh every 2 steps: the policy after step 2 (3 steps);
    ema: (1 − d)·θ_1 + d·θ_0 after one step; none (no KL term): no reference at all."""
    settings = {
        "frozen": ("trainer.max_steps=3",),
        "refresh": ("trainer.max_steps=2", "reference.mode=refresh", "reference.refresh_every=2"),
        "ema": ("trainer.max_steps=1", "reference.mode=ema", "reference.ema_decay=0.75"),
        "none": ("trainer.max_steps=1", "objective.overrides={kl_coef: 0.0}"),
    }[mode]
    cfg = rl_helpers.tiny_config(GRPO, tmp_path / "run", rl_helpers.SHAPED_REWARDS, *settings)
    initial = _initial_policy(cfg)
    trainer = RLTrainer(cfg)
    trainer.fit()
    policy = jax.device_get(trainer.policy_params)
    if mode == "none":
        assert trainer.reference is None
        return
    reference = jax.device_get(trainer.reference)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), initial, policy)
    assert any(jax.tree.leaves(moved))
    if mode == "frozen":
        want = initial
    elif mode == "refresh":
        want = policy
    else:
        want = jax.tree.map(lambda p0, p1: 0.75 * p0 + 0.25 * p1, initial, policy)
        assert all(x.dtype == np.float32 for x in jax.tree.leaves(reference))
    jax.tree.map(
        lambda got, exp: np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-7),
        reference,
        want,
    )


# -- configuration errors ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "prime"])
def test_objectives_needing_a_critic_or_prm_are_refused(tmp_path, name):
    cfg = rl_helpers.tiny_config(None, tmp_path, f"objective.name={name}")
    with pytest.raises(
        ValueError, match=rf"objective '{name}' .*needs (values|process_rewards), which RLTrainer"
    ):
        RLTrainer(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["rollout.prompts_per_step=3", "rollout.group_size=2"],
            r"rollout batch \(prompts_per_step x group_size\)=6 does not divide into the 4 batch",
            id="rollout_batch",
        ),
        pytest.param(
            ["data.eval_size=18"],
            r"data.eval_size=18 does not divide into the 4 batch shards",
            id="eval_size",
        ),
        pytest.param(
            ["trainer.minibatches=3"],
            r"trainer.minibatches=3 does not divide the rollout batch 16",
            id="minibatches",
        ),
        pytest.param(
            ["trainer.minibatches=8"],
            r"minibatch=2 does not divide into the 4 batch shards",
            id="minibatch_size",
        ),
        pytest.param(
            ["sft_warmup.steps=1", "sft_warmup.batch_size=6"],
            r"sft_warmup.batch_size=6 does not divide into the 4 batch shards",
            id="sft_batch",
        ),
    ],
)
def test_batch_sizes_must_divide_the_mesh(tmp_path, overrides, message):
    cfg = rl_helpers.tiny_config(
        None, tmp_path, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *overrides
    )
    with pytest.raises(ValueError, match=message):
        RLTrainer(cfg)


def test_a_mesh_larger_than_the_devices_is_refused(tmp_path):
    cfg = rl_helpers.tiny_config(None, tmp_path, "mesh.data=4", "mesh.fsdp=4")
    with pytest.raises(ValueError, match=r"needs 16 devices; 8 available"):
        RLTrainer(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["model.param_dtype=float16"],
            r"model.param_dtype must be one of \('float32', 'bfloat16'\)",
            id="param_dtype",
        ),
        pytest.param(
            ["model.compute_dtype=float16"],
            r"model.compute_dtype must be one of \('auto', 'float32', 'bfloat16'\)",
            id="compute_dtype",
        ),
        pytest.param(
            ["model.remat=full"],
            r"model.remat must be one of \('none', 'layer', 'offload'\)",
            id="remat",
        ),
        pytest.param(["reference.mode=moving"], r"reference.mode must be one of", id="reference"),
        pytest.param(
            ["reference.mode=refresh"],
            r"reference.mode=refresh needs reference.refresh_every >= 1",
            id="refresh_every",
        ),
        pytest.param(
            ["reference.mode=ema", "reference.ema_decay=1.0"],
            r"reference.ema_decay must be in \[0, 1\)",
            id="ema_decay",
        ),
        pytest.param(
            ["data.task=gsm8k"],
            r"data.task must be one of \('arithmetic', 'carry_slips', 'jsonl', 'hf'\)",
            id="task",
        ),
        pytest.param(["data.task=jsonl"], r"data.task=jsonl needs data.train_path", id="jsonl"),
        pytest.param(["objective.name=grpoo"], r"unknown objective 'grpoo'", id="objective"),
        pytest.param(
            ["objective.overrides={kl_coeff: 0.1}"],
            r"unknown Objective field\(s\) \['kl_coeff'\]",
            id="objective_field",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(tmp_path, overrides, message):
    cfg = rl_helpers.tiny_config(None, tmp_path, *overrides)
    with pytest.raises(ValueError, match=message):
        RLTrainer(cfg)


def test_the_removed_model_dtype_key_names_its_replacements(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"model.dtype was split in two: model.param_dtype .* and model.compute_dtype",
    ):
        rl_helpers.tiny_config(None, tmp_path, "model.dtype=bfloat16")


# -- advantage metrics -----------------------------------------------------------------------------


def test_advantage_metrics_cover_the_trained_rows_and_tokens_only():
    """By hand: per-row advantages over the rows with a trained token, per-token ones over the
    trained tokens; a batch with none (dynamic sampling's filler only) reports zeros."""
    from jaxrl_llm.train.rl.trainer import advantage_metrics

    trained = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0]], np.float32)  # row 1: filler
    rows = advantage_metrics(np.array([2.0, 100.0, -1.0], np.float32), trained)
    assert rows == pytest.approx(
        {"advantage_mean": 0.5, "advantage_std": 1.5, "advantage_max": 2.0, "advantage_min": -1.0}
    )
    per_token = np.array([[1.0, 3.0, 50.0], [9.0, 9.0, 9.0], [-4.0, 7.0, 7.0]], np.float32)
    tokens = advantage_metrics(per_token, trained)  # 1, 3, -4
    assert tokens == pytest.approx(
        {
            "advantage_mean": 0.0,
            "advantage_std": np.sqrt(26 / 3),
            "advantage_max": 3.0,
            "advantage_min": -4.0,
        }
    )
    empty = np.zeros_like(trained)
    for advantages in (np.ones(3, np.float32), per_token):
        assert advantage_metrics(advantages, empty) == {
            "advantage_mean": 0.0,
            "advantage_std": 0.0,
            "advantage_max": 0.0,
            "advantage_min": 0.0,
        }
