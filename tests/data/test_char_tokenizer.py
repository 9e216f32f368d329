"""The character tokenizer: a real transformers tokenizer, round trips, padding, chat template."""

import string

import pytest
from transformers import AutoTokenizer

from jaxrl_llm.data import ARITHMETIC_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer

TEXT_ALPHABET = string.ascii_lowercase + " .,\n\t-=01"


@pytest.fixture(scope="module")
def arithmetic_tokenizer():
    return build_char_tokenizer(ARITHMETIC_ALPHABET)


def test_vocabulary_layout(arithmetic_tokenizer):
    tok = arithmetic_tokenizer
    assert len(tok) == len(SPECIAL_TOKENS) + len(ARITHMETIC_ALPHABET)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.padding_side == "left"
    first = len(SPECIAL_TOKENS)
    assert tok.convert_tokens_to_ids(list(ARITHMETIC_ALPHABET)) == list(
        range(first, first + len(ARITHMETIC_ALPHABET))
    )


def test_one_token_per_character_and_no_added_specials(arithmetic_tokenizer):
    ids = arithmetic_tokenizer("12+7=")["input_ids"]
    assert arithmetic_tokenizer.convert_ids_to_tokens(ids) == ["1", "2", "+", "7", "="]


@pytest.mark.parametrize(
    "text", ["a b", "  leading and trailing  ", "a .b , c", "line\nnext\ttab", "-0=1", ""]
)
def test_round_trip_keeps_spaces_and_punctuation(text):
    tok = build_char_tokenizer(TEXT_ALPHABET)
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_round_trip_over_the_arithmetic_alphabet(arithmetic_tokenizer, rng):
    for _ in range(20):
        text = "".join(rng.choice(list(ARITHMETIC_ALPHABET), size=int(rng.integers(1, 12))))
        assert arithmetic_tokenizer.decode(arithmetic_tokenizer(text)["input_ids"]) == text


def test_unknown_characters_become_unk(arithmetic_tokenizer):
    ids = arithmetic_tokenizer("1a2")["input_ids"]
    assert ids[1] == arithmetic_tokenizer.unk_token_id and len(ids) == 3


def test_special_tokens_are_single_tokens_and_skippable(arithmetic_tokenizer):
    tok = arithmetic_tokenizer
    ids = tok("<|user|>1+2=<|assistant|>3<eos>")["input_ids"]
    assert len(ids) == 1 + 4 + 1 + 1 + 1
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "1+2=3"


def test_left_padding_batch(arithmetic_tokenizer):
    tok = arithmetic_tokenizer
    batch = tok(["1+2=", "10+20="], padding=True)
    one = tok.convert_tokens_to_ids("1")
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["input_ids"][0][2] == one
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1], [1] * 6]


def test_chat_template(arithmetic_tokenizer):
    tok = arithmetic_tokenizer
    messages = [{"role": "user", "content": "12+7="}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>12+7=<|assistant|>"
    full = messages + [{"role": "assistant", "content": "19"}]
    assert tok.apply_chat_template(full, tokenize=False) == "<|user|>12+7=<|assistant|>19<eos>"
    with pytest.raises(Exception, match="roles must be"):
        tok.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)


def test_save_and_reload_through_auto_tokenizer(tmp_path):
    built = build_char_tokenizer(TEXT_ALPHABET, save_dir=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "ab c.\n-=10"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 2, 1)
    assert len(loaded) == len(built)
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert loaded.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert loaded(["a", "abc"], padding=True)["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


@pytest.mark.parametrize(
    "chars, message",
    [("", "at least one"), ("abca", "repeated: \\['a'\\]"), (["a", "bc"], "single characters")],
)
def test_bad_alphabets(chars, message):
    with pytest.raises(ValueError, match=message):
        build_char_tokenizer(chars)
