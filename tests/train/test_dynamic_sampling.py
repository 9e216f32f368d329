"""DAPO dynamic sampling in the loop: all-equal groups are dropped, counted and replaced.

The reward is scripted by call order (rewards are scored row by row, draw by draw), so each
test decides which groups of which draw have equal rewards and checks the batch the trainer
assembles: always ``prompts_per_step * group_size`` rows, the varied groups in draw order with
their own prompts, the counts in the metrics, and zero-mask filler when attempts run out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrl_llm import data
from jaxrl_llm.train.loop import RLTrainer
from tests.train import rl_helpers

PROMPTS, GROUP = 4, 4
CONSTANT, VARIED = "constant", "varied"


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A DAPO trainer with its state set up (no step taken), at most one extra draw."""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "dapo.yaml",
        tmp_path_factory.mktemp("dapo"),
        "rollout.max_resample_attempts=1",
    )
    trainer = RLTrainer(cfg)
    assert trainer.run.objective.dynamic_sampling
    trainer._setup_state()
    yield trainer
    trainer.checkpointer.close()
    trainer.metrics_writer.close()


@dataclasses.dataclass
class ScriptedReward:
    """Reward of the ``i``-th scored row: draw ``i // (P·G)``, group ``(i % (P·G)) // G``.

    A constant group scores 0 on every row; a varied one scores its row index in the group.
    """

    draws: list[list[str]]
    calls: int = 0

    def __call__(self, inp) -> float:
        draw, row = divmod(self.calls, PROMPTS * GROUP)
        self.calls += 1
        group, member = divmod(row, GROUP)
        return float(member) if self.draws[draw][group] == VARIED else 0.0


def _script(trainer, monkeypatch, draws) -> list:
    """Scripts the rewards; returns the examples the next draws will hold."""
    monkeypatch.setattr(trainer.run, "reward_fn", ScriptedReward(draws))
    upcoming = data.PromptSampler(trainer.run.train_examples, seed=trainer.cfg.seed)
    upcoming.restore(trainer.sampler.state())
    return [upcoming.next_batch(PROMPTS) for _ in draws]


def _prompt_ids(trainer, example) -> list[int]:
    (text,) = trainer.run.prompts([example])
    return trainer.run.tokenizer(text)["input_ids"]


def _assert_groups_answer(trainer, samples, examples) -> None:
    """Group ``g`` of the batch holds ``examples[g]``'s prompt on each of its rows."""
    for g, example in enumerate(examples):
        for row in range(g * GROUP, (g + 1) * GROUP):
            tokens = samples.prompt_tokens[row][samples.prompt_mask[row]]
            assert tokens.tolist() == _prompt_ids(trainer, example), (g, row)


def test_constant_groups_are_dropped_and_replaced_from_the_next_draw(trainer, monkeypatch):
    draws = [
        [CONSTANT, VARIED, CONSTANT, CONSTANT],
        [VARIED, VARIED, CONSTANT, VARIED],
    ]
    examples = _script(trainer, monkeypatch, draws)
    samples, info = trainer._rollout(0)

    assert samples.completion_mask.shape[0] == PROMPTS * GROUP
    assert samples.rewards.tolist() == [0.0, 1.0, 2.0, 3.0] * PROMPTS
    assert samples.completion_mask.any(axis=1).all()
    kept = [examples[0][1], examples[1][0], examples[1][1], examples[1][3]]
    _assert_groups_answer(trainer, samples, kept)
    assert info == {
        "zero_variance_frac": 0.75,  # of the first draw
        "dynamic/dropped_groups": 4,
        "dynamic/filled_groups": 0,
        "dynamic/attempts": 2,
    }


def test_a_full_first_draw_needs_no_resampling(trainer, monkeypatch):
    examples = _script(trainer, monkeypatch, [[VARIED] * PROMPTS])
    samples, info = trainer._rollout(1)
    _assert_groups_answer(trainer, samples, examples[0])
    assert info["dynamic/dropped_groups"] == 0
    assert info["dynamic/attempts"] == 1
    assert info["zero_variance_frac"] == 0.0


def test_out_of_attempts_fills_with_zero_mask_groups(trainer, monkeypatch):
    draws = [
        [CONSTANT, CONSTANT, VARIED, CONSTANT],
        [CONSTANT] * PROMPTS,
    ]
    examples = _script(trainer, monkeypatch, draws)
    samples, info = trainer._rollout(2)

    assert samples.completion_mask.shape[0] == PROMPTS * GROUP
    _assert_groups_answer(trainer, samples, [examples[0][2]])
    assert samples.completion_mask[:GROUP].any(axis=1).all()
    # The filler keeps the batch shape but contributes no token.
    assert not samples.completion_mask[GROUP:].any()
    assert info["dynamic/filled_groups"] == 3
    assert info["dynamic/dropped_groups"] == 3 + 4
    assert info["dynamic/attempts"] == 2


def test_a_step_with_filler_groups_trains_on_the_kept_group_only(trainer, monkeypatch):
    draws = [
        [CONSTANT, CONSTANT, VARIED, CONSTANT],
        [CONSTANT] * PROMPTS,
    ]
    _script(trainer, monkeypatch, draws)
    trainer._compile()
    metrics = trainer.step(3)

    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["dynamic/filled_groups"] == 3
    # Only the kept group's tokens count: at most G rows of max_new_tokens.
    assert 0 < metrics["num_tokens"] <= GROUP * trainer.cfg.rollout.max_new_tokens
    assert metrics["num_tokens"] == pytest.approx(
        metrics["completion_length_mean"] * PROMPTS * GROUP
    )
    assert metrics["grad_norm"] > 0.0
