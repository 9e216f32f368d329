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
from jaxrl_llm.data.preferences import (
    IndexSampler,
    PreferenceArrays,
    PreferencePair,
    UnpairedArrays,
    UnpairedExample,
    arithmetic_preference_pairs,
    encode_pairs,
    encode_unpaired,
    load_preference_jsonl,
    load_unpaired_jsonl,
    mismatched_partners,
    pair_keys,
    pairs_to_unpaired,
    unpaired_keys,
)

__all__ = [
    "ARITHMETIC_ALPHABET",
    "CHAT_TEMPLATE",
    "OPERATORS",
    "SPECIAL_TOKENS",
    "Example",
    "IndexSampler",
    "PreferenceArrays",
    "PreferencePair",
    "PromptSampler",
    "UnpairedArrays",
    "UnpairedExample",
    "arithmetic_examples",
    "arithmetic_preference_pairs",
    "build_char_tokenizer",
    "demonstration",
    "encode_pairs",
    "encode_unpaired",
    "format_prompt",
    "load_jsonl",
    "load_preference_jsonl",
    "load_unpaired_jsonl",
    "mismatched_partners",
    "num_problems",
    "pair_keys",
    "pairs_to_unpaired",
    "solve_arithmetic",
    "split_eval",
    "unpaired_keys",
]
