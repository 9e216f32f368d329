"""The built-in calculator tool and task (``envs.calculator``), against hand-computed values."""

from __future__ import annotations

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.envs import calculator, calculator_demonstration, calculator_env, make_env
from jaxrl_llm.envs.calculator import direct_demonstration


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("123*456", "56088"),
        ("4321*8765", "37873565"),
        (" 7 - 10 ", "-3"),
        ("-(2+3)**2", "-25"),
        ("1/4", "0.25"),
        ("3/8", "0.375"),
        ("1/3", "1/3"),
        ("7//2", "3"),
        ("7%4", "3"),
        ("0.1+0.2", "0.3"),  # exact: Fraction("0.1") + Fraction("0.2")
        ("2**10", "1024"),
    ],
)
def test_values(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("__import__('os').system('true')", "unsupported expression"),
        ("x+1", "unsupported expression"),
        ("2**100", "exponents must be integers of at most 64"),
        ("2**0.5", "exponents must be integers"),
        ("1/0", "division by zero"),
        ("1+", "not an arithmetic expression"),
        ("1" * 201, "at most 200 characters"),
    ],
)
def test_anything_else_is_refused(expr, match):
    with pytest.raises(ValueError, match=match):
        calculator(expr)


def test_demonstration_calls_the_tool_on_the_prompt_and_restates_its_answer():
    demo = calculator_demonstration(Example("123*456=", "56088"))
    assert demo == [
        {
            "role": "assistant",
            "content": '<tool_call>{"name":"calc","arguments":{"expr":"123*456"}}</tool_call>',
        },
        {"role": "tool", "content": "56088"},
        {"role": "assistant", "content": "56088"},
    ]


def test_make_env_builds_the_calculator_and_rejects_unknown_names():
    env = make_env("calculator", lambda inp: 1.0, timeout_s=0.5)
    assert env.timeout_s == 0.5 and set(env.tools) == {"calc"}
    assert calculator_env(lambda inp: 0.0).demonstration(Example("2*3=", "6"))[1] == {
        "role": "tool",
        "content": "6",
    }
    with pytest.raises(ValueError, match="unknown environment 'calculater'"):
        make_env("calculater", lambda inp: 1.0)
    with pytest.raises(ValueError, match="cannot import"):
        make_env("no_such_module:factory", lambda inp: 1.0)
    with pytest.raises(ValueError, match="bad settings for environment 'calculator'"):
        make_env("calculator", lambda inp: 1.0, colour="red")


TOOL_DEMO = calculator_demonstration(Example("123*456=", "56088"))
DIRECT_DEMO = [{"role": "assistant", "content": "56088"}]


def test_direct_demonstration_states_the_value_without_the_tool():
    assert direct_demonstration(Example("123*456=", "56088")) == DIRECT_DEMO
    assert direct_demonstration(Example("4321*8765=", "37873565"))[0]["content"] == "37873565"


def test_direct_rate_zero_and_one_are_never_and_always():
    ex = Example("123*456=", "56088")
    never = calculator_env(lambda inp: 0.0)  # the default: every demonstration calls the tool
    assert all(never.demonstration(ex) == TOOL_DEMO for _ in range(50))
    always = calculator_env(lambda inp: 0.0, direct_rate=1)
    assert all(always.demonstration(ex) == DIRECT_DEMO for _ in range(50))


def test_mixed_demonstrations_are_fresh_draws_at_the_rate():
    """Each call is a new draw of the teacher (not one frozen choice per problem), from a
    stream seeded by ``demo_seed``."""
    ex = Example("123*456=", "56088")
    env = make_env("calculator", lambda inp: 1.0, direct_rate=0.8, demo_seed=3)
    draws = [env.demonstration(ex) for _ in range(1000)]
    assert all(d in (TOOL_DEMO, DIRECT_DEMO) for d in draws)
    # Binomial(1000, 0.8): standard deviation 0.013; 0.05 is almost 4 of them.
    assert abs(sum(d == DIRECT_DEMO for d in draws) / 1000 - 0.8) < 0.05
    again = make_env("calculator", lambda inp: 1.0, direct_rate=0.8, demo_seed=3)
    other = make_env("calculator", lambda inp: 1.0, direct_rate=0.8, demo_seed=4)
    assert [again.demonstration(ex) for _ in range(100)] == draws[:100]
    assert [other.demonstration(ex) for _ in range(100)] != draws[:100]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"direct_rate": 1.5}, r"env.kwargs.direct_rate must be a number in \[0, 1\], got 1.5"),
        ({"direct_rate": -0.1}, "env.kwargs.direct_rate must be a number in"),
        ({"direct_rate": "0.5"}, "env.kwargs.direct_rate must be a number in"),
        ({"direct_rate": True}, "env.kwargs.direct_rate must be a number in"),
        ({"direct_rate": 0.5, "demo_seed": -1}, "env.kwargs.demo_seed must be a non-negative int"),
        ({"direct_rate": 0.5, "demo_seed": 1.5}, "env.kwargs.demo_seed must be a non-negative int"),
    ],
)
def test_bad_direct_rates_and_seeds_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_env("calculator", lambda inp: 1.0, **kwargs)
