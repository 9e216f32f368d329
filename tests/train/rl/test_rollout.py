"""An RL step's rollout (``train.rl.rollout.collect``) and DAPO dynamic sampling.

First ``collect`` alone, on a fake ``draw`` whose groups are labelled by draw and position, so
each test reads off which groups the batch kept, in which order, and what filled the rest.
Then the trainer's rollout with the real sampler and a reward scripted by call order (rewards
are scored row by row, draw by draw): the batch it assembles is always
``prompts_per_step * group_size`` rows, the varied groups in draw order with their own prompts,
the counts in the metrics, and zero-mask filler when attempts run out.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm import data
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl.rollout import Samples, collect
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers

PROMPTS, GROUP = 4, 4
CONSTANT, VARIED = "constant", "varied"
LENGTH = 3


# -- collect on a fake draw --------------------------------------------------------------------


def fake_draw(kinds: list[list[str]]):
    """``draw(attempt)`` returning draw ``attempt`` of ``kinds`` (one kind per group).

    Group ``g`` of draw ``d`` is named ``"d{d}g{g}"`` in ``prompts``; its prompts are ``2 + d``
    tokens wide (so concatenating draws must pad them); a constant group's rewards are all 0,
    a varied one's are ``0, 1, ..., G-1``. ``draw.calls`` records the attempts asked for.
    """

    def draw(attempt: int) -> Samples:
        draw.calls.append(attempt)
        groups = kinds[attempt]
        rows = len(groups) * GROUP
        group = np.repeat(np.arange(len(groups)), GROUP)
        member = np.tile(np.arange(GROUP), len(groups))
        varied = np.array([groups[g] == VARIED for g in group])
        rewards = np.where(varied, member, 0).astype(np.float32)
        width = 2 + attempt
        return Samples(
            prompt_tokens=np.full((rows, width), 1 + 10 * attempt, np.int32) + group[:, None],
            prompt_mask=np.ones((rows, width), bool),
            completion_tokens=np.full((rows, LENGTH), 7, np.int32),
            completion_mask=np.ones((rows, LENGTH), bool),
            completions=[f"d{attempt}g{g}m{m}" for g, m in zip(group, member)],
            prompts=[f"d{attempt}g{g}" for g in group],
            rewards=rewards,
            correct=rewards > 0,
            components={"scripted": rewards},
            finished=np.ones(rows, bool),
        )

    draw.calls = []
    return draw


def group_names(samples: Samples) -> list[str]:
    """The name of each group of the batch (every row of a group must share it)."""
    names = np.asarray(samples.prompts).reshape(-1, GROUP)
    assert (names == names[:, :1]).all()
    return names[:, 0].tolist()


def _collect(draw, *, dynamic_sampling=True, max_attempts=4):
    return collect(
        draw,
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        dynamic_sampling=dynamic_sampling,
        max_attempts=max_attempts,
    )


def test_without_dynamic_sampling_the_first_draw_is_the_batch():
    draw = fake_draw([[CONSTANT, VARIED, CONSTANT, CONSTANT]])
    samples, info = _collect(draw, dynamic_sampling=False)
    assert draw.calls == [0]
    assert group_names(samples) == ["d0g0", "d0g1", "d0g2", "d0g3"]
    assert samples.completion_mask.all()
    assert info == {"zero_variance_frac": 0.75}


def test_constant_groups_are_replaced_in_draw_order():
    draw = fake_draw([[CONSTANT, VARIED, CONSTANT, CONSTANT], [VARIED, VARIED, CONSTANT, VARIED]])
    samples, info = _collect(draw)
    assert draw.calls == [0, 1]
    assert group_names(samples) == ["d0g1", "d1g0", "d1g1", "d1g3"]
    assert samples.rewards.tolist() == [0.0, 1.0, 2.0, 3.0] * PROMPTS
    assert samples.components["scripted"].tolist() == samples.rewards.tolist()
    assert samples.completion_mask.all() and samples.finished.all()
    # Every row keeps its own fields: completions, correctness and tokens move together.
    assert samples.completions[:GROUP] == [f"d0g1m{m}" for m in range(GROUP)]
    assert samples.correct.tolist() == (samples.rewards > 0).tolist()
    assert info == {
        "zero_variance_frac": 0.75,  # of the first draw
        "dynamic/dropped_groups": 4,  # 3 of the first draw, 1 of the second
        "dynamic/filled_groups": 0,
        "dynamic/attempts": 2,
    }


def test_the_engine_figures_cover_every_draw():
    """The continuous engine's figures over the step's draws, by hand: utilisation = tokens /
    slot-steps summed over draws, preemptions, admissions, prefilled and reused prompts summed,
    the peak the largest;
    without a paged cache no block figures, and the static sampler (no stats) none at all."""
    from jaxrl_llm.sampling.requests import EngineStats

    def stats(tokens, slot_steps, admissions, preemptions=0, peak=0):
        prefilled, reused = admissions + 1, 2 * admissions
        return EngineStats(
            4, tokens, 0, slot_steps, 0, admissions, prefilled, 0, 0.0, 0, preemptions, peak, reused
        )

    plain = fake_draw([[CONSTANT, VARIED, CONSTANT, CONSTANT], [VARIED] * 4])
    engine = [stats(30, 40, 3, preemptions=2, peak=9), stats(18, 20, 2, preemptions=1, peak=7)]
    draw = lambda attempt: plain(attempt)._replace(engine=engine[attempt])  # noqa: E731
    _, info = _collect(draw)
    assert info["engine/slot_utilisation"] == 48 / 60
    assert info["engine/admissions"] == 5 and info["engine/preemptions"] == 3
    assert info["engine/kv_peak_blocks"] == 9
    assert info["engine/prefill_rows"] == 4 + 3 and info["engine/reused_prompts"] == 6 + 4
    contiguous = lambda attempt: plain(attempt)._replace(engine=stats(10, 40, 1))  # noqa: E731
    _, info = _collect(contiguous, dynamic_sampling=False)
    assert info == {
        "zero_variance_frac": 0.75,
        "engine/slot_utilisation": 0.25,
        "engine/admissions": 1.0,
        "engine/prefill_rows": 2.0,
        "engine/reused_prompts": 2.0,
    }
    _, info = _collect(plain, dynamic_sampling=False)
    assert not [k for k in info if k.startswith("engine/")]


def test_prompts_of_different_widths_are_left_padded():
    draw = fake_draw([[VARIED, CONSTANT, CONSTANT, CONSTANT], [VARIED] * PROMPTS])
    samples, _ = _collect(draw)
    # Draw 0's prompts are 2 tokens wide, draw 1's 3: the batch is 3 wide, draw 0's rows
    # padded on the left with masked zeros.
    assert samples.prompt_tokens.shape == (PROMPTS * GROUP, 3)
    first = slice(0, GROUP)
    assert (samples.prompt_tokens[first, 0] == 0).all()
    assert not samples.prompt_mask[first, 0].any()
    assert (samples.prompt_tokens[first, 1:] == 1).all() and samples.prompt_mask[first, 1:].all()
    assert samples.prompt_mask[GROUP:].all()
    assert (samples.prompt_tokens[GROUP : 2 * GROUP] == 11).all()  # draw 1, group 0


def test_a_later_draw_is_taken_in_order_up_to_what_is_missing():
    draw = fake_draw([[CONSTANT, VARIED, VARIED, VARIED], [CONSTANT, VARIED, VARIED, VARIED]])
    samples, info = _collect(draw)
    assert group_names(samples) == ["d0g1", "d0g2", "d0g3", "d1g1"]
    assert info["dynamic/dropped_groups"] == 2
    assert info["dynamic/attempts"] == 2
    assert info["zero_variance_frac"] == 0.25


def test_a_full_first_draw_needs_no_second():
    draw = fake_draw([[VARIED] * PROMPTS])
    samples, info = _collect(draw)
    assert draw.calls == [0]
    assert group_names(samples) == ["d0g0", "d0g1", "d0g2", "d0g3"]
    assert info["dynamic/dropped_groups"] == 0
    assert info["dynamic/attempts"] == 1
    assert info["zero_variance_frac"] == 0.0


@pytest.mark.parametrize("max_attempts", [0, 1, 2])
def test_out_of_attempts_fills_with_dropped_groups_under_a_zero_mask(max_attempts):
    kinds = [[CONSTANT, CONSTANT, VARIED, CONSTANT]] + [[CONSTANT] * PROMPTS] * max_attempts
    draw = fake_draw(kinds)
    samples, info = _collect(draw, max_attempts=max_attempts)
    # One first draw, then at most ``max_attempts`` more.
    assert draw.calls == list(range(max_attempts + 1))
    names = group_names(samples)
    assert names[0] == "d0g2"
    # The filler is the first dropped groups (the batch keeps its shape: no re-trace)...
    assert names[1:] == ["d0g0", "d0g1", "d0g3"]
    assert samples.completion_mask[:GROUP].all()
    # ... and contributes no token.
    assert not samples.completion_mask[GROUP:].any()
    assert samples.completion_mask.shape == (PROMPTS * GROUP, LENGTH)
    assert info == {
        "zero_variance_frac": 0.75,
        "dynamic/dropped_groups": 3 + PROMPTS * max_attempts,
        "dynamic/filled_groups": 3,
        "dynamic/attempts": max_attempts + 1,
    }


def test_select_groups_reorders_a_pending_scoring_when_it_finishes():
    """The trainer moves whole groups before the rewards are in (``balanced_groups``): the
    scoring's rewards and components arrive for the selected rows, its error still reaches
    whoever waits, and the draw's engine figures stay."""
    import concurrent.futures  # noqa: PLC0415

    from jaxrl_llm.train.rl.rollout import finish_scoring, select_groups  # noqa: PLC0415

    drawn = fake_draw([[VARIED, CONSTANT, VARIED, CONSTANT]])(0)
    rewards = np.arange(PROMPTS * GROUP, dtype=np.float32)
    pending = drawn._replace(rewards=None, components=None, engine="stats")
    for fails in (False, True):
        future = concurrent.futures.Future()
        picked = select_groups(pending._replace(scoring=future), np.array([2, 0]), GROUP)
        assert group_names(picked) == ["d0g2", "d0g0"]
        assert picked.rewards is None and picked.engine == "stats"
        if fails:
            future.set_exception(RuntimeError("verifier died"))
            with pytest.raises(RuntimeError, match="verifier died"):
                finish_scoring(picked)
            continue
        future.set_result((rewards, {"scripted": 2 * rewards}))
        done = finish_scoring(picked)
        want = np.array([8, 9, 10, 11, 0, 1, 2, 3], np.float32)
        np.testing.assert_array_equal(done.rewards, want)
        np.testing.assert_array_equal(done.components["scripted"], 2 * want)


# -- the trainer's rollout with the real sampler ---------------------------------------------


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
    assert trainer.run.objective.advantage.dynamic_sampling
    trainer.setup()
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


def test_trainer_replaces_constant_groups_from_the_next_draw(trainer, monkeypatch):
    draws = [
        [CONSTANT, VARIED, CONSTANT, CONSTANT],
        [VARIED, VARIED, CONSTANT, VARIED],
    ]
    examples = _script(trainer, monkeypatch, draws)
    timer = PhaseTimer()
    samples, info = trainer.rollout(0, timer)

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
        "rollout/staleness": 0.0,  # the synchronous loop
    }
    # Both draws were sampled and scored under the step's timer.
    assert set(timer.seconds) == {"rollout", "scoring"}


def test_trainer_with_a_full_first_draw_needs_no_resampling(trainer, monkeypatch):
    examples = _script(trainer, monkeypatch, [[VARIED] * PROMPTS])
    samples, info = trainer.rollout(1, PhaseTimer())
    _assert_groups_answer(trainer, samples, examples[0])
    assert info["dynamic/dropped_groups"] == 0
    assert info["dynamic/attempts"] == 1
    assert info["zero_variance_frac"] == 0.0


def test_trainer_out_of_attempts_fills_with_zero_mask_groups(trainer, monkeypatch):
    draws = [
        [CONSTANT, CONSTANT, VARIED, CONSTANT],
        [CONSTANT] * PROMPTS,
    ]
    examples = _script(trainer, monkeypatch, draws)
    samples, info = trainer.rollout(2, PhaseTimer())

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
    metrics = trainer.train_step(3, PhaseTimer())

    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["dynamic/filled_groups"] == 3
    # Only the kept group's tokens count: at most G rows of max_new_tokens.
    assert 0 < metrics["num_tokens"] <= GROUP * trainer.cfg.rollout.max_new_tokens
    assert metrics["num_tokens"] == pytest.approx(
        metrics["completion_length_mean"] * PROMPTS * GROUP
    )
    assert metrics["grad_norm"] > 0.0
    # Advantages of the kept group only: its rewards 0, 1, 2, 3 give (r - 1.5) / s for some
    # scale s, whose std over 4 rows is sqrt(1.25) / s and max 1.5 / s (over all 16 rows,
    # the 12 filler rows' zeros among them: sqrt(5 / 16) / s).
    assert metrics["advantage_std"] / metrics["advantage_max"] == pytest.approx(
        np.sqrt(1.25) / 1.5, rel=1e-4
    )


def test_a_step_of_filler_groups_only_reports_zero_advantages(trainer, monkeypatch):
    _script(trainer, monkeypatch, [[CONSTANT] * PROMPTS] * 2)
    metrics = trainer.train_step(4, PhaseTimer())
    assert metrics["dynamic/filled_groups"] == PROMPTS and metrics["num_tokens"] == 0
    assert all(np.isfinite(v) for v in metrics.values())
    assert metrics["advantage_std"] == metrics["advantage_max"] == 0.0


def test_the_continuous_engine_samples_what_the_static_one_does(trainer, monkeypatch):
    """``rollout.engine=continuous`` (5 slots for 16 rows: refills) gives the same greedy
    batch as the static sampler: same rows, tokens, masks and rewards."""
    run = trainer.run
    examples = run.train_examples[:PROMPTS]
    out = {}
    for engine in ("static", "continuous"):
        rollout = dataclasses.replace(run.cfg.rollout, engine=engine, slots=5, burst=2)
        monkeypatch.setattr(run, "cfg", dataclasses.replace(run.cfg, rollout=rollout))
        out[engine] = run.sample(
            trainer.policy_params, examples, jax.random.key(0), temperature=0.0, group_size=GROUP
        )
    static, continuous = out["static"], out["continuous"]
    assert continuous.completion_tokens.shape == (PROMPTS * GROUP, run.cfg.rollout.max_new_tokens)
    np.testing.assert_array_equal(continuous.completion_mask, static.completion_mask)
    np.testing.assert_array_equal(
        np.where(static.completion_mask, continuous.completion_tokens, 0),
        np.where(static.completion_mask, static.completion_tokens, 0),
    )
    np.testing.assert_array_equal(continuous.rewards, static.rewards)
    assert continuous.completions == static.completions
    np.testing.assert_array_equal(continuous.prompt_tokens, static.prompt_tokens)


# -- the sample lines ----------------------------------------------------------------------------

# 61 characters: 0123456789 six times, then X.
SIXTY_ONE = "0123456789" * 6 + "X"


@pytest.mark.parametrize(
    "prompt, shown",
    [
        ("12+34=", "12+34="),
        ("0123456789" * 6, "0123456789" * 6),  # exactly 60: whole
        # 61: the first 29, the ellipsis, the last 30 (indices 31 to 60).
        (SIXTY_ONE, "01234567890123456789012345678…12345678901234567890123456789X"),
        # Lines on one line, each run of whitespace one space.
        ("Question:\n  What is 2+2?\n\nAnswer:", "Question: What is 2+2? Answer:"),
        (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "What is 12+34?<|im_end|>\n<|im_start|>assistant\n",
            "<|im_start|>system You are a …im_end|> <|im_start|>assistant",
        ),
    ],
)
def test_prompt_excerpt_shows_the_start_and_the_end(prompt, shown):
    from jaxrl_llm.train.rl.rollout import prompt_excerpt

    assert prompt_excerpt(prompt) == shown
    assert len(prompt_excerpt(prompt)) <= 60


def test_prompt_excerpt_width():
    from jaxrl_llm.train.rl.rollout import prompt_excerpt

    assert prompt_excerpt("abcdefgh", width=5) == "ab…gh"
    assert prompt_excerpt("abcdefgh", width=4) == "a…gh"
    with pytest.raises(ValueError, match="at least 3"):
        prompt_excerpt("abcdefgh", width=2)


def test_sample_lines_show_the_prompts_start_and_end(tmp_path, caplog):
    from jaxrl_llm.train.rl.rollout import write_samples

    samples = fake_draw([[VARIED]])(0)._replace(prompts=[f"Solve:\n{SIXTY_ONE}"] * GROUP)
    with caplog.at_level("INFO", logger="jaxrl_llm"):
        write_samples(tmp_path / "samples.jsonl", 3, samples, show=1)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample ")]
    # 68 characters on one line: "Solve: " and the 61; the first 29 and the last 30 shown.
    assert line.startswith(
        "sample 0: 'Solve: 0123456789012345678901…12345678901234567890123456789X'"
    )
