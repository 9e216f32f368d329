"""Weighted combination, batch scoring, error reporting and the registry."""

import math

import chex
import numpy as np
import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.rewards import (
    REWARDS,
    CodeExec,
    CombinedReward,
    FormatReward,
    MathMatch,
    OverlongPenalty,
    RewardError,
    RewardInput,
    combine_rewards,
    compute_rewards,
    make_reward,
    summarize_rewards,
)
from tests.reference import rewards as ref


def length_bonus(inp):
    return len(inp.completion) / 10


def is_even(inp):
    return int(inp.completion_tokens) % 2 == 0  # bools and ints are valid rewards


def _inputs():
    example = Example("12+7=", "19")
    completions = ["19", "<think>hm</think><answer>19</answer>", "20", "<answer>7</answer>", ""]
    return [RewardInput(example.prompt, c, example, n) for n, c in enumerate(completions, 3)]


def test_combined_reward_is_the_weighted_sum(rng):
    inputs = _inputs()
    terms = [(MathMatch(), 1.0), (FormatReward(tags=["answer"]), 0.5), (length_bonus, -0.25)]
    reward = combine_rewards(terms)
    rewards, components = compute_rewards(reward, inputs)
    table = [[fn(inp) for inp in inputs] for fn, _ in terms]
    want = ref.weighted_sum(table, [w for _, w in terms])
    chex.assert_shape(rewards, (len(inputs),))
    assert rewards.dtype == np.float32
    np.testing.assert_allclose(rewards, want, rtol=1e-6)
    np.testing.assert_allclose([reward(inp) for inp in inputs], want, rtol=1e-12)
    assert list(components) == ["math_match", "format", "length_bonus"]
    for (fn, _), (name, values) in zip(terms, components.items()):
        assert values.dtype == np.float32
        np.testing.assert_allclose(values, [fn(inp) for inp in inputs], rtol=1e-6, err_msg=name)


def test_fractional_rewards_are_never_truncated():
    # The pitfall: integer-valued rewards scaled by 0.5 must stay 0.5, not become 0.
    inputs = _inputs()
    rewards, components = compute_rewards(combine_rewards([(is_even, 0.5)]), inputs)
    np.testing.assert_array_equal(rewards, [0.0, 0.5, 0.0, 0.5, 0.0])
    assert rewards.dtype == np.float32 and components["is_even"].dtype == np.float32


def test_plain_function_reports_itself_as_the_component():
    rewards, components = compute_rewards(length_bonus, _inputs())
    np.testing.assert_allclose(rewards, [0.2, 3.6, 0.2, 1.8, 0.0], rtol=1e-6)
    assert list(components) == ["length_bonus"]
    np.testing.assert_array_equal(components["length_bonus"], rewards)


def test_empty_batch():
    rewards, components = compute_rewards(combine_rewards([(MathMatch(), 1.0)]), [])
    chex.assert_shape(rewards, (0,))
    chex.assert_shape(components["math_match"], (0,))


def test_names_explicit_automatic_and_repeated():
    reward = combine_rewards([(MathMatch(), 1.0), (MathMatch(correct=2.0), 1.0), ("x", is_even, 0)])
    assert [t.name for t in reward.terms] == ["math_match", "math_match_2", "x"]
    assert reward.terms[2].weight == 0.0
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        combine_rewards([("a", is_even, 1.0), ("a", length_bonus, 1.0)])


@pytest.mark.parametrize(
    "terms, message",
    [
        ([], "at least one"),
        ([(is_even,)], r"\(fn, weight\)"),
        ([("not callable", 1.0)], "not callable"),
        ([(is_even, math.nan)], "finite number"),
        ([(is_even, "1")], "finite number"),
        ([(is_even, True)], "finite number"),
        ([("", is_even, 1.0)], "non-empty str"),
    ],
)
def test_combine_errors(terms, message):
    with pytest.raises(ValueError, match=message):
        combine_rewards(terms)


def test_nested_combination():
    inner = combine_rewards([(MathMatch(), 2.0), (length_bonus, 1.0)])
    outer = combine_rewards([("inner", inner, 0.5), (is_even, 1.0)])
    inputs = _inputs()
    rewards, components = compute_rewards(outer, inputs)
    want = [0.5 * inner(inp) + float(is_even(inp)) for inp in inputs]
    np.testing.assert_allclose(rewards, want, rtol=1e-6)
    assert set(components) == {"inner", "is_even"}


def test_failing_reward_reports_the_example():
    def broken(inp):
        if inp.completion == "20":
            raise ZeroDivisionError("boom")
        return 1.0

    reward = combine_rewards([(MathMatch(), 1.0), (broken, 1.0)])
    with pytest.raises(RewardError) as info:
        compute_rewards(reward, _inputs())
    message = str(info.value)
    assert "'broken'" in message and "row 2" in message
    assert "ZeroDivisionError: boom" in message
    assert "completion: '20'" in message and "prompt: '12+7='" in message
    assert "Example(prompt='12+7=', answer='19'" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(RewardError, match="'broken'"):
        reward(_inputs()[2])  # a direct call reports it too


def test_nested_failures_are_reported_once():
    def broken(inp):
        raise KeyError("k")

    outer = combine_rewards([("inner", combine_rewards([(broken, 1.0)]), 1.0)])
    with pytest.raises(RewardError) as info:
        compute_rewards(outer, _inputs()[:1])
    assert str(info.value).count("completion:") == 1 and "'broken'" in str(info.value)


def test_long_inputs_are_shortened_in_the_message():
    def broken(inp):
        raise ValueError("bad")

    with pytest.raises(RewardError, match=r"\.\.\. \(5002 characters\)"):
        compute_rewards(broken, [RewardInput("p", "y" * 5000)])


@pytest.mark.parametrize("value", [None, "1.0", math.nan, math.inf, [1.0], np.zeros(2)])
def test_bad_return_values(value):
    with pytest.raises(RewardError, match="expected a finite real number"):
        compute_rewards(lambda inp: value, _inputs()[:1])


def test_missing_answer_becomes_a_reward_error():
    with pytest.raises(RewardError, match="reference answer") as info:
        compute_rewards(MathMatch(), [RewardInput("p", "1", {"question": "p"})])
    assert isinstance(info.value.__cause__, ValueError)


def test_inputs_must_be_reward_inputs():
    with pytest.raises(ValueError, match=r"inputs\[0\] must be a RewardInput"):
        compute_rewards(MathMatch(), [("p", "1", None, 1)])


def test_summarize_rewards():
    rewards = np.array([1.0, 0.0, 0.5, 0.5], np.float32)
    components = {"a": np.array([1.0, 0.0, 1.0, 0.0]), "b": np.array([2.0, 2.0, 2.0, 4.0])}
    metrics = summarize_rewards(rewards, components)
    assert metrics == pytest.approx(
        {"reward/mean": 0.5, "reward/std": math.sqrt(0.125), "reward/a": 0.5, "reward/b": 2.5}
    )
    empty = summarize_rewards(np.zeros(0), {"a": np.zeros(0)}, prefix="eval")
    assert set(empty) == {"eval/mean", "eval/std", "eval/a"} and math.isnan(empty["eval/a"])


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------


def test_registry_builds_each_reward():
    assert set(REWARDS) == {"math_match", "format", "overlong", "code_exec"}
    assert make_reward("math_match") == MathMatch()
    assert make_reward("format", tags=["answer"], reward=2.0) == FormatReward(("answer",), 2.0)
    assert make_reward("overlong", max_tokens=10, buffer_tokens=2) == OverlongPenalty(10, 2)
    assert make_reward("code_exec", partial=True) == CodeExec(partial=True)
    for name in REWARDS:
        kwargs = {"max_tokens": 4, "buffer_tokens": 1} if name == "overlong" else {}
        assert make_reward(name, **kwargs).name == name


def test_registry_names_flow_into_components():
    reward = combine_rewards(
        [
            (make_reward("math_match"), 1.0),
            (make_reward("overlong", max_tokens=5, buffer_tokens=2), 1.0),
        ]
    )
    assert isinstance(reward, CombinedReward)
    _, components = compute_rewards(reward, _inputs())
    assert list(components) == ["math_match", "overlong"]
    # completion_tokens are 3..7; the buffer starts after 5 - 2 = 3 tokens.
    np.testing.assert_allclose(components["overlong"], [0.0, -0.5, -1.0, -1.0, -1.0])


@pytest.mark.parametrize(
    "name, nearest", [("fromat", "format"), ("math", "math_match"), ("overlength", "overlong")]
)
def test_unknown_name_suggests_the_nearest(name, nearest):
    with pytest.raises(ValueError, match=f"unknown reward '{name}'; did you mean '{nearest}'"):
        make_reward(name)


def test_bad_settings_list_the_fields():
    with pytest.raises(ValueError, match=r"bad settings for reward 'format'.*\['tags', 'reward"):
        make_reward("format", tag=["x"])
    with pytest.raises(ValueError, match="bad settings for reward 'overlong'"):
        make_reward("overlong")
    with pytest.raises(ValueError, match="must not exceed"):
        make_reward("overlong", max_tokens=2, buffer_tokens=3)


_USER_REWARDS = """
def starts_with(prompt, completion, example, prefix="7"):
    return float(completion.startswith(prefix)) + (0.5 if example["answer"] in prompt else 0.0)


def from_input(inp):
    return float(inp.completion_tokens or 0)


def needs_two(prompt, completion):
    return 0.0


def broken(prompt, completion, example):
    raise KeyError("score")
"""


def test_a_config_may_name_any_importable_reward_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(_USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = make_reward("my_rewards:starts_with")
    inp = RewardInput("1+6=7?", "7", {"answer": "7"}, completion_tokens=2)
    assert plain(inp) == 1.5
    assert make_reward("my_rewards:starts_with", prefix="8")(inp) == 0.5
    assert make_reward("my_rewards:from_input")(inp) == 2.0
    # Reported under the config name, like the built-in rewards.
    reward = combine_rewards([(plain, 2.0), (make_reward("my_rewards:from_input"), 1.0)])
    totals, components = compute_rewards(reward, [inp])
    assert totals.tolist() == [5.0]
    assert {k: v.tolist() for k, v in components.items()} == {
        "my_rewards:starts_with": [1.5],
        "my_rewards:from_input": [2.0],
    }
    with pytest.raises(RewardError, match=r"'my_rewards:broken' .*raised KeyError"):
        combine_rewards([(make_reward("my_rewards:broken"), 1.0)])(inp)
    with pytest.raises(ValueError, match=r"cannot import 'absent' from 'my_rewards'"):
        make_reward("my_rewards:absent")
    with pytest.raises(ValueError, match=r"cannot import .* 'no_such_module'"):
        make_reward("no_such_module:fn")
    with pytest.raises(ValueError, match=r"must take \(prompt, completion, example\)"):
        make_reward("my_rewards:needs_two")
