"""load_tokenizer on a tiny tokenizer built locally with the `tokenizers` library."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.models import load_tokenizer

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat"]


def _save_tokenizer(path, **special):
    vocab = {word: i for i, word in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special).save_pretrained(
        path
    )


def test_left_pads_with_eos_when_no_pad_token(tmp_path):
    _save_tokenizer(tmp_path, bos_token="<s>", eos_token="</s>")
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "</s>"
    batch = tokenizer(["hello world the cat", "sat"], padding=True)
    assert batch["input_ids"] == [[3, 4, 5, 6], [2, 2, 2, 7]]
    assert batch["attention_mask"] == [[1, 1, 1, 1], [0, 0, 0, 1]]
    assert tokenizer.decode([3, 4]) == "hello world"


def test_keeps_existing_pad_token_and_right_padding(tmp_path):
    _save_tokenizer(tmp_path, eos_token="</s>", pad_token="<unk>")
    tokenizer = load_tokenizer(tmp_path, padding_side="right")
    assert tokenizer.pad_token == "<unk>"
    assert tokenizer(["cat sat", "cat"], padding=True)["input_ids"] == [[6, 7], [6, 0]]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="padding_side"):
        load_tokenizer(tmp_path, padding_side="middle")
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "absent")


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def test_the_checkpoint_chat_template_comes_along(tmp_path):
    vocab = {word: i for i, word in enumerate([*WORDS, "user", "assistant", "system"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "the cat"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s> user the cat </s> <s> assistant "
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == [1, 8, 5, 6, 2, 1, 9]
