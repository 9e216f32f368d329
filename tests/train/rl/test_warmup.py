"""The RL job's SFT warm-up stopped by an accuracy probe (``train.rl.warmup``).

The probe is greedy accuracy on ``data.eval_size`` *training* prompts, checked every
``sft_warmup.check_every`` steps; the warm-up ends at the first check that reaches
``sft_warmup.stop_at_accuracy`` and RL starts from the parameters of that step. Checked here: the
probe's prompts (training, never held-out), its decision (greedy, ``>=``), and a real trainer
starting RL from the probed parameters with the step count in its summary.
"""

from __future__ import annotations

import types

import chex
import jax
import numpy as np
import pytest

from jaxrl_llm.data.datasets import Example
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import warmup
from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers


def _examples(count: int, tag: str) -> list[Example]:
    return [Example(f"{tag}{i}=", str(i)) for i in range(count)]


def test_probe_examples_are_a_seeded_draw_of_training_examples():
    train = _examples(50, "t")
    probe = warmup.probe_examples(train, 16, seed=3)
    assert len(probe) == 16 and len({e.prompt for e in probe}) == 16  # without replacement
    assert all(e in train for e in probe)
    assert probe == warmup.probe_examples(train, 16, seed=3)
    assert probe != warmup.probe_examples(train, 16, seed=4)
    assert probe != train[:16]  # drawn, not the first rows
    # A training set smaller than the probe is repeated, every example as often (+-1).
    small = warmup.probe_examples(train[:6], 16, seed=0)
    counts = [sum(e is x for x in small) for e in train[:6]]
    assert len(small) == 16 and sorted(counts) == [2, 2, 3, 3, 3, 3]
    with pytest.raises(ValueError, match="needs training examples"):
        warmup.probe_examples([], 16, seed=0)


def test_the_probe_is_greedy_accuracy_on_training_prompts_against_the_bar():
    train, held_out = _examples(40, "t"), _examples(8, "e")
    calls = []

    def sample(params, examples, key, *, temperature, group_size, mesh):
        calls.append((params, examples, temperature, group_size, mesh))
        correct = np.zeros(len(examples), bool)
        correct[:params] = True  # "params" = how many the fake policy answers
        return types.SimpleNamespace(correct=correct)

    cfg = load_config(TrainConfig, None, ["data.eval_size=8", "seed=5"])
    run = types.SimpleNamespace(
        cfg=cfg, train_examples=train, eval_examples=held_out, mesh="the run's mesh", sample=sample
    )
    probe = warmup.make_probe(run, 0.75)
    assert [probe(50 * i, solved) for i, solved in enumerate((0, 5, 6, 8), 1)] == [
        False,
        False,
        True,  # 6 of 8 = 0.75: the bar is inclusive
        True,
    ]
    assert all(c[2] == 0.0 and c[3] == 1 and c[4] == "the run's mesh" for c in calls)
    probed = calls[0][1]
    assert probed == warmup.probe_examples(train, 8, seed=5)
    assert all(c[1] == probed for c in calls)  # the same prompts every check
    assert not {e.prompt for e in probed} & {e.prompt for e in held_out}


@pytest.mark.parametrize(("stop", "stop_step"), [("0.5", 4), ("0.5", None)], ids=["4", "never"])
def test_rl_starts_from_the_parameters_the_probe_stopped_at(tmp_path, monkeypatch, stop, stop_step):
    """6 warm-up steps checked every 2: a probe that stops at step 4 leaves RL at step 4's
    parameters (and the summary says 4); one that never stops is asked at 2 and 4 (not after
    the last step) and all 6 run."""
    seen = []
    real = warmup.make_probe

    def make_probe(run, stop_at):
        inner = real(run, stop_at)

        def probe(step, params):
            inner(step, params)  # the real probe runs (the sampler on the warm-up's params)
            seen.append((step, jax.device_get(params)))
            return stop_step is not None and step >= stop_step

        return probe

    monkeypatch.setattr(warmup, "make_probe", make_probe)
    cfg = rl_helpers.tiny_config(
        None,
        tmp_path,
        "sft_warmup.steps=6",
        "sft_warmup.check_every=2",
        "sft_warmup.batch_size=16",
        f"sft_warmup.stop_at_accuracy={stop}",
    )
    trainer = RLTrainer(cfg)
    try:
        with jax.set_mesh(trainer.mesh):
            trainer.setup()
        if stop_step is None:
            assert [s for s, _ in seen] == [2, 4]
            assert trainer.summary()["sft_warmup_steps"] == 6
            return
        assert [s for s, _ in seen] == [2, 4]
        assert trainer.summary()["sft_warmup_steps"] == 4
        chex.assert_trees_all_close(jax.device_get(trainer.policy_params), seen[-1][1], rtol=0)
        assert not np.allclose(
            jax.tree.leaves(seen[0][1])[0], jax.tree.leaves(seen[-1][1])[0]
        )  # the warm-up did move between the checks
    finally:
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
