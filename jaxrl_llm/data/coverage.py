"""How much of a dataset's text a tokenizer can read: the characters it maps to unknown.

A tokenizer with an unknown token (a character or word-level vocabulary, the built-in tiny
model's) turns every character outside its vocabulary into that token: a policy trained on
such data sees ``<unk>`` where the text was, and can neither read the prompts nor write the
answers. Byte-level tokenizers (GPT-2, Llama 3, Qwen) have no unknown token and read every
text; ``unknown_characters`` then finds none.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any, NamedTuple


class Coverage(NamedTuple):
    """The characters of some texts a tokenizer maps to its unknown token.

    Attributes:
      unknown: characters inside unknown tokens.
      total: characters read.
      examples: the most frequent unknown characters, most frequent first (at most 8).
    """

    unknown: int
    total: int
    examples: tuple[str, ...]

    @property
    def share(self) -> float:
        """``unknown / total`` (0 for no text)."""
        return self.unknown / self.total if self.total else 0.0


def unknown_characters(tokenizer: Any, texts: Iterable[str]) -> Coverage:
    """Counts the characters of ``texts`` that ``tokenizer`` maps to its unknown token.

    A fast tokenizer's offsets give the characters each unknown token covers; a slow one's
    unknown tokens count one character each (no examples). A tokenizer without an unknown
    token reads everything.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    texts = [t for t in texts if t]
    total = sum(len(t) for t in texts)
    if unk is None or not texts:
        return Coverage(0, total, ())
    counts: collections.Counter[str] = collections.Counter()
    unknown = 0
    try:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # slow tokenizers have no offsets
        encoded = tokenizer(texts, add_special_tokens=False)
        unknown = sum(ids.count(unk) for ids in encoded["input_ids"])
        return Coverage(unknown, total, ())
    for text, ids, spans in zip(texts, encoded["input_ids"], encoded["offset_mapping"]):
        for token, (start, end) in zip(ids, spans):
            if token == unk:
                unknown += end - start
                counts.update(text[start:end])
    return Coverage(unknown, total, tuple(c for c, _ in counts.most_common(8)))
