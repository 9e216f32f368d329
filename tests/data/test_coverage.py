"""The characters a tokenizer maps to unknown (``data.coverage``), counted by hand: the
built-in character tokenizer (one character a token), a word-level vocabulary (an unknown
word covers all its characters), a tokenizer without an unknown token, and a slow one
without offsets."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_llm import data
from jaxrl_llm.data import coverage


def test_character_tokenizer_counts_each_unknown_character():
    tok = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    found = coverage.unknown_characters(tok, ["12+ab=3", "bb", ""])
    assert (found.unknown, found.total) == (4, 9)  # a, b | b, b ; the empty text reads nothing
    assert found.examples == ("b", "a")  # most frequent first
    assert found.share == pytest.approx(4 / 9)
    assert coverage.unknown_characters(tok, ["12+34=46"]).share == 0.0


def test_an_unknown_word_covers_all_its_characters():
    backend = Tokenizer(models.WordLevel(vocab={"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    found = coverage.unknown_characters(tok, ["hello world", "hello"])
    assert (found.unknown, found.total) == (5, 16)
    assert found.examples == ("w", "o", "r", "l", "d")


class _NoUnknown:
    unk_token_id = None


class _Slow:
    """A slow tokenizer: ids without offsets; id 0 is unknown (every 'x')."""

    unk_token_id = 0

    def __call__(self, texts, add_special_tokens=False, return_offsets_mapping=False):
        if return_offsets_mapping:
            raise NotImplementedError
        return {"input_ids": [[0 if c == "x" else 1 for c in t] for t in texts]}


def test_without_an_unknown_token_everything_is_read_and_slow_tokenizers_count_tokens():
    assert coverage.unknown_characters(_NoUnknown(), ["anything"]) == (0, 8, ())
    assert coverage.unknown_characters(_Slow(), ["axx", "x"]) == (3, 4, ())
    assert coverage.Coverage(0, 0, ()).share == 0.0
