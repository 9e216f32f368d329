"""Tokenizer loading: a thin wrapper over ``transformers.AutoTokenizer``."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str | os.PathLike, *, padding_side: str = "left") -> Any:
    """Loads the checkpoint's tokenizer, set up for batched prompts.

    Prompts are left-padded (the model's positions come from ``cumsum(mask) - 1``, and the
    sampler appends completions on the right). A tokenizer without a pad token gets its EOS
    token as pad, so batching works; the attention mask, not the pad id, marks padding.

    Args:
      path: a directory holding the tokenizer files (``tokenizer.json``, ...).
      padding_side: ``"left"`` (default) or ``"right"``.

    Returns:
      A ``transformers.PreTrainedTokenizerBase``.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {os.fspath(path)!r} is not a directory")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(path))
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
