"""Prompt datasets and built-in toy tasks (host-side Python, no JAX)."""

from jaxrl_llm.data.arithmetic import (
    OPERATORS,
    arithmetic_examples,
    demonstration,
    num_problems,
    solve_arithmetic,
)
from jaxrl_llm.data.char_tokenizer import (
    ARITHMETIC_ALPHABET,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_char_tokenizer,
)
from jaxrl_llm.data.datasets import Example, PromptSampler, format_prompt, load_jsonl, split_eval

__all__ = [
    "ARITHMETIC_ALPHABET",
    "CHAT_TEMPLATE",
    "OPERATORS",
    "SPECIAL_TOKENS",
    "Example",
    "PromptSampler",
    "arithmetic_examples",
    "build_char_tokenizer",
    "demonstration",
    "format_prompt",
    "load_jsonl",
    "num_problems",
    "solve_arithmetic",
    "split_eval",
]
