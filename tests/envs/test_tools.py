"""Hermes tool calls (``envs.tools``): parsing, dispatch with timeouts, and ``ToolEnv``'s
turns. Expected values are written out by hand."""

from __future__ import annotations

import time

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.envs import Episode, ToolCall, ToolEnv, format_tool_call, parse_tool_calls, run_tool
from jaxrl_llm.rewards.base import RewardInput


def test_parse_hermes_calls_in_order_with_whitespace_and_several_per_turn():
    text = (
        'I will compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n'
        '</tool_call>\n<tool_call>{"name":"lookup","arguments":{"key":"a","n":2}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calc", {"expr": "2*3"}),
        ToolCall("lookup", {"key": "a", "n": 2}),
    ]
    assert parse_tool_calls("the answer is 6") == []


def test_arguments_serialised_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calc", {"expr": "1+1"})]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json}", "not valid JSON"),
        ('{"arguments": {}}', 'needs {"name"'),
        ('["calc"]', 'needs {"name"'),
        ('{"name": "calc", "arguments": [1]}', "must be a JSON object"),
    ],
)
def test_malformed_calls_become_error_strings(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert isinstance(call, str) and call.startswith("error:") and message in call


def test_format_round_trips_through_the_parser():
    text = format_tool_call("calc", {"expr": "12*34"})
    assert text == '<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calc", {"expr": "12*34"})]


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def _boom() -> str:
    raise RuntimeError("disk on fire")


TOOLS = {"add": lambda a, b: a + b, "slow": _slow, "boom": _boom}


@pytest.mark.parametrize(
    ("call", "want"),
    [
        (ToolCall("add", {"a": 2, "b": 5}), "7"),
        (ToolCall("nope", {}), "error: unknown tool 'nope' (available: ['add', 'boom', 'slow'])"),
        (ToolCall("add", {"a": 1}), "error: bad arguments for 'add'"),
        (ToolCall("boom", {}), "error: 'boom' failed: RuntimeError: disk on fire"),
        ("error: the tool call is not valid JSON", "error: the tool call is not valid JSON"),
    ],
)
def test_run_tool_answers_results_and_every_failure_as_text(call, want):
    assert run_tool(TOOLS, call, timeout_s=2.0).startswith(want)


def test_a_tool_over_its_timeout_is_answered_with_an_error_in_time():
    start = time.perf_counter()
    out = run_tool(TOOLS, ToolCall("slow", {"seconds": 3.0}), timeout_s=0.2)
    assert out == "error: tool 'slow' timed out after 0.2s"
    assert time.perf_counter() - start < 1.5


def _reward(inp: RewardInput) -> float:
    return float(inp.completion.strip() == inp.example.answer)


def test_tool_env_answers_calls_then_scores_the_final_answer():
    env = ToolEnv({"add": TOOLS["add"]}, _reward, system_prompt="tools: add(a, b)")
    example = Example("2+5=", "7")
    opening = env.reset(example)
    assert opening == [
        {"role": "system", "content": "tools: add(a, b)"},
        {"role": "user", "content": "2+5="},
    ]
    episode = Episode(example, list(opening))
    call = format_tool_call("add", {"a": 2, "b": 5})
    episode.messages.append({"role": "assistant", "content": call})
    result = env.step(episode, call)
    assert result.messages == [{"role": "tool", "content": "7"}]
    assert (result.reward, result.done) == (0.0, False)
    assert result.info == {"tool_calls": 1, "tool_errors": 0}
    assert env.step(episode, "7") == (None, 1.0, True, {"tool_calls": 0})
    assert env.step(episode, "8").reward == 0.0


def test_tool_env_limits_calls_per_turn_and_counts_errors():
    env = ToolEnv({"add": TOOLS["add"]}, _reward, max_calls_per_turn=1)
    episode = Episode(Example("q", "a"), env.reset(Example("q", "a")))
    two = format_tool_call("add", {"a": 1, "b": 1}) * 2
    result = env.step(episode, two)
    assert result.messages == [
        {"role": "tool", "content": "error: at most 1 tool calls a turn, got 2"}
    ]
    bad = env.step(episode, format_tool_call("sub", {}))
    assert bad.info == {"tool_calls": 1, "tool_errors": 1} and not bad.done


def test_tool_env_without_demonstrations_says_so_and_bad_settings_raise():
    env = ToolEnv({"add": TOOLS["add"]}, _reward)
    with pytest.raises(NotImplementedError):
        env.demonstration(Example("q", "a"))
    with pytest.raises(ValueError, match="tools must map names to callables"):
        ToolEnv({"x": 3}, _reward)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        ToolEnv({"add": TOOLS["add"]}, _reward, timeout_s=0)
