"""The SFT warm-up's host batches (``train.rl.episodes.demonstration_batches``): examples drawn
with replacement, each with its demonstration; an example with alternative demonstrations (the
carry_slips teacher's slips) has one drawn afresh at each of its draws."""

from __future__ import annotations

import itertools
import types

import numpy as np

from jaxrl_llm import data
from jaxrl_llm.data.carry_slips import SLIP_RATE, carry_slip_examples
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl import episodes
from jaxrl_llm.train.rl.config import TrainConfig


def _run(examples, *overrides: str):
    """The attributes of a run ``demonstration_batches`` reads, for the built-in task."""
    cfg = load_config(TrainConfig, None, list(overrides))
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    return types.SimpleNamespace(
        cfg=cfg,
        train_examples=examples,
        env=None,
        tokenizer=tokenizer,
        prompts=lambda exs: [ex.prompt for ex in exs],
        stop_ids=(tokenizer.eos_token_id,),
    )


def _texts(run, batch) -> tuple[list[str], list[str]]:
    """(prompts, completions) of a ``Sequences`` batch, decoded."""

    def decode(tokens, mask):
        return [
            run.tokenizer.decode(t[m].tolist(), skip_special_tokens=True)
            for t, m in zip(tokens, mask)
        ]

    return (
        decode(batch.prompt_tokens, batch.prompt_mask),
        decode(batch.completion_tokens, batch.completion_mask),
    )


def test_each_draw_of_a_carrying_problem_slips_afresh():
    examples = carry_slip_examples(40, seed=0)
    run = _run(examples)
    by_prompt = {ex.prompt: ex for ex in examples}
    seen: dict[str, list[str]] = {}
    for batch in itertools.islice(episodes.demonstration_batches(run, 64, seed=0), 40):
        for prompt, completion in zip(*_texts(run, batch), strict=True):
            seen.setdefault(prompt, []).append(completion)
    carrying = [p for p in seen if "demonstrations" in by_prompt[p].extra]
    assert len(carrying) >= 10
    for prompt, completions in seen.items():
        ex = by_prompt[prompt]
        if prompt not in carrying:
            assert set(completions) == {ex.answer}
            continue
        # ~64 draws each: both the right answer and the slip, the slip ~70% of the time.
        assert set(completions) == set(ex.extra["demonstrations"]), prompt
    slips = [c == by_prompt[p].extra["demonstrations"][1] for p in carrying for c in seen[p]]
    # ~2000 draws of carrying problems: standard deviation 0.01, 0.04 is 4 of them.
    assert abs(np.mean(slips) - SLIP_RATE) < 0.04


def test_the_examples_drawn_do_not_depend_on_the_alternatives():
    """Fresh slips come from a stream of their own: the same examples in the same order as the
    plain arithmetic task's, which has none."""
    slips = _run(carry_slip_examples(300, seed=1))
    plain = _run(data.arithmetic_examples(300, seed=1))
    for a, b in itertools.islice(
        zip(
            episodes.demonstration_batches(slips, 32, seed=4),
            episodes.demonstration_batches(plain, 32, seed=4),
        ),
        5,
    ):
        assert _texts(slips, a)[0] == _texts(plain, b)[0]
        np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)


def test_batches_are_deterministic_in_the_seed():
    run = _run(carry_slip_examples(100, seed=0))
    first = [
        _texts(run, b) for b in itertools.islice(episodes.demonstration_batches(run, 32, 3), 4)
    ]
    again = [
        _texts(run, b) for b in itertools.islice(episodes.demonstration_batches(run, 32, 3), 4)
    ]
    other = [
        _texts(run, b) for b in itertools.islice(episodes.demonstration_batches(run, 32, 4), 4)
    ]
    assert first == again != other
