"""A character-level tokenizer that is a real ``transformers`` tokenizer, built offline.

One token per character of a fixed alphabet plus special tokens, made with the ``tokenizers``
library and wrapped in ``transformers.PreTrainedTokenizerFast``: it pads, batches, applies a
chat template, saves with ``save_pretrained`` and reloads with ``AutoTokenizer``, like the
tokenizer of any Hugging Face checkpoint. The built-in tiny task uses it with
``ARITHMETIC_ALPHABET``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

ARITHMETIC_ALPHABET = "0123456789+-*="
# The built-in tool task (``env.name``): arithmetic plus what Hermes tool calls and responses
# are written with (``<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call>``).
TOOL_ALPHABET = ARITHMETIC_ALPHABET + 'abcdefghijklmnopqrstuvwxyz<>/{}[]":,_. ()'

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

# Role markers are special tokens, so the template tokenises whatever the alphabet and
# `decode(..., skip_special_tokens=True)` leaves only the message text. Assistant turns end
# with EOS, which is what the policy learns to emit; the generation prompt opens one.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _check_alphabet(chars: str | Sequence[str]) -> list[str]:
    alphabet = list(chars)
    if not alphabet:
        raise ValueError("the alphabet must hold at least one character")
    bad = [c for c in alphabet if not isinstance(c, str) or len(c) != 1]
    if bad:
        raise ValueError(f"alphabet entries must be single characters, got {bad!r}")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet characters must be distinct, repeated: {repeated!r}")
    return alphabet


def build_char_tokenizer(
    chars: str | Sequence[str], *, save_dir: str | os.PathLike | None = None
) -> Any:
    """Builds a character-level ``PreTrainedTokenizerFast`` over a fixed alphabet.

    Ids: ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``, the role markers ``<|system|>=4,
    <|user|>=5, <|assistant|>=6``, then the alphabet in the given order. The pre-tokenizer
    isolates every character and the decoder concatenates tokens, so
    ``decode(encode(s)) == s`` for any ``s`` over the alphabet, spaces and newlines included
    when they belong to it (characters outside it become ``<unk>``). No special token is added
    on encode; prompts are padded on the left; ``CHAT_TEMPLATE`` renders
    ``<|user|>12+7=<|assistant|>`` for a user turn with the generation prompt.

    Args:
      chars: the alphabet, e.g. ``ARITHMETIC_ALPHABET``; distinct single characters.
      save_dir: if given, the tokenizer is also saved there (``save_pretrained``), reloadable
        with ``transformers.AutoTokenizer.from_pretrained(save_dir)``.

    Returns:
      The ``transformers.PreTrainedTokenizerFast``; ``len(tokenizer)`` is the vocabulary size.

    Raises:
      ValueError: on an empty alphabet, repeated characters or entries that are not single
        characters.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _check_alphabet(chars)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(alphabet)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    # Without a decoder, tokens would be joined with spaces.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,  # would rewrite " ." as "." on decode
        chat_template=CHAT_TEMPLATE,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer
