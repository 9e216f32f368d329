"""The tag-layout format reward."""

import pytest

from jaxrl_llm.rewards import FormatReward, RewardInput, matches_format


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>reason</think><answer>42</answer>", True),
        ("  <think>a\nb\n</think>\n\n<answer>\n42\n</answer>\n", True),  # whitespace, newlines
        ("<think></think><answer></answer>", True),  # empty blocks are a layout, not content
        ("<answer>42</answer><think>x</think>", False),  # wrong order
        ("<think>x</think>", False),  # missing answer block
        ("<think>x</think><answer>42", False),  # unclosed
        ("Sure! <think>x</think><answer>42</answer>", False),  # text before
        ("<think>x</think><answer>42</answer> done", False),  # text after
        ("<think>x</think> and <answer>42</answer>", False),  # text between
        ("<think>x</think><answer>1</answer><answer>2</answer>", False),  # repeated block
        ("<think>x<think>y</think></think><answer>1</answer>", False),  # nested block
        ("<think>x</think><answer>a <answer> b</answer>", False),  # tag inside content
        ("<think>x</think><answer>a < b, c > d</answer>", True),  # other angle brackets are fine
        ("<THINK>x</THINK><answer>1</answer>", False),  # tags are case-sensitive
        ("", False),
    ],
)
def test_default_layout(text, expected):
    assert matches_format(text) is expected
    assert FormatReward()(RewardInput("p", text)) == (1.0 if expected else 0.0)


def test_configurable_tags():
    assert matches_format("<reasoning>r</reasoning><final>1</final>", ("reasoning", "final"))
    assert not matches_format("<think>r</think><answer>1</answer>", ("reasoning", "final"))
    assert matches_format("<answer>1</answer>", ("answer",))
    assert matches_format("<answer>1</answer>", "answer")
    assert not matches_format("<think>r</think><answer>1</answer>", ("answer",))
    three = ("plan", "work", "answer")
    assert matches_format("<plan>p</plan><work>w</work><answer>a</answer>", three)
    assert matches_format("<a.b>x</a.b>", ("a.b",))  # regex characters are escaped
    assert not matches_format("<aXb>x</aXb>", ("a.b",))


def test_reward_values_and_config_lists():
    reward = FormatReward(tags=["answer"], reward=0.5, penalty=-1.0)
    assert reward.tags == ("answer",)
    assert reward(RewardInput("p", "<answer>3</answer>")) == 0.5
    assert reward(RewardInput("p", "3")) == -1.0
    assert FormatReward(tags=["answer"]) == FormatReward(tags=("answer",))


@pytest.mark.parametrize(
    "tags, message",
    [
        ((), "at least one"),
        (("a b",), "XML names"),
        (("<think>",), "XML names"),
        (("a", "a"), "distinct"),
    ],
)
def test_bad_tags(tags, message):
    with pytest.raises(ValueError, match=message):
        FormatReward(tags=tags)
    with pytest.raises(ValueError, match=message):
        matches_format("x", tags)
