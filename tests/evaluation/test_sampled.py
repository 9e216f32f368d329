"""``evaluation.sampled_report`` draws the prompts in batches (issue 46: a bounded sampler
batch, and a progress bar with the time left).

A fake run context stands in for the sampler: it records every draw and marks a completion
correct by a rule of its prompt, so the per-prompt counts show whether the batches were put
back together in order.
"""

from __future__ import annotations

import io
import types

import jax
import numpy as np
import pytest

from jaxrl_llm.evaluation.sampled import sampled_report


class FakeContext:
    """Prompt ``i`` gets ``i % (samples + 1)`` correct completions of ``samples``."""

    def __init__(self):
        self.draws = []

    def sample(self, params, examples, key, *, temperature, group_size, mesh):
        self.draws.append((list(examples), jax.random.key_data(key).tolist()))
        correct, completions = [], []
        for example in examples:
            right = example.index % (group_size + 1)
            correct += [j < right for j in range(group_size)]
            completions += [f"#### {example.index if j < right else -1}" for j in range(group_size)]
        return types.SimpleNamespace(correct=np.array(correct), completions=completions)


def examples(n):
    return [types.SimpleNamespace(index=i, prompt=f"p{i}") for i in range(n)]


def report(context, n, **kwargs):
    return sampled_report(context, None, examples(n), k=2, samples=4, temperature=1.0, **kwargs)


def test_batches_cover_every_prompt_in_order_with_their_own_keys():
    context = FakeContext()
    summary, per_prompt = report(context, 10, batch_prompts=4)
    assert [[e.index for e in draw] for draw, _ in context.draws] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    key = jax.random.key(0)
    want = [jax.random.key_data(jax.random.fold_in(key, i)).tolist() for i in range(3)]
    assert [k for _, k in context.draws] == want
    assert [p["correct"] for p in per_prompt] == [i % 5 for i in range(10)]
    assert [p["answers"][0] for p in per_prompt] == [str(i) if i % 5 else "-1" for i in range(10)]
    # pass@1 by hand: the mean over prompts of correct / samples.
    assert summary["pass@1"] == pytest.approx(np.mean([(i % 5) / 4 for i in range(10)]))


def test_one_batch_draws_with_the_seeds_own_key():
    batched, whole = FakeContext(), FakeContext()
    one, _ = report(batched, 6, batch_prompts=8, seed=3)
    two, _ = report(whole, 6, seed=3)
    assert len(batched.draws) == len(whole.draws) == 1
    assert batched.draws[0][1] == jax.random.key_data(jax.random.key(3)).tolist()
    assert one == two


def test_bad_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_prompts must be at least 1"):
        report(FakeContext(), 4, batch_prompts=0)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_over_the_prompts_only_when_asked(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    report(FakeContext(), 10, batch_prompts=4)
    assert screen.getvalue() == ""
    report(FakeContext(), 10, batch_prompts=4, progress=True)
    assert "evaluating" in screen.getvalue() and "/10 " in screen.getvalue()
