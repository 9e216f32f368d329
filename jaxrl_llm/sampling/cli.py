"""``jaxrl-llm generate MODEL_DIR PROMPT...``: sample completions from a local checkpoint.

Prompts go through the checkpoint's chat template (when it has one) as a single user turn, are
left-padded into one batch and sampled with :func:`jaxrl_llm.sampling.generate`; completions
are printed decoded, special tokens removed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

_DTYPES = ("float32", "bfloat16")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm generate",
        description="Sample completions from a Hugging Face checkpoint directory.",
    )
    parser.add_argument("model_dir", help="directory with config.json, safetensors, tokenizer")
    parser.add_argument("prompt", nargs="+", help="one or more prompts (one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="parameter dtype")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="tokenize the prompts as raw text"
    )
    return parser


def _encode(tokenizer: Any, prompts: Sequence[str], *, chat: bool) -> tuple[Any, Any]:
    """Left-padded ``[N, P]`` token ids and mask as NumPy arrays."""
    if chat and getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        # The template already writes any BOS it wants.
        batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="np")
    else:
        batch = tokenizer(list(prompts), padding=True, return_tensors="np")
    return batch["input_ids"], batch["attention_mask"]


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm generate``; returns the process exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if not os.path.isdir(args.model_dir):
        print(f"error: {args.model_dir!r} is not a directory", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.data.encoding import stop_token_ids
    from jaxrl_llm.models import load_pretrained, load_tokenizer
    from jaxrl_llm.sampling.generate import generate

    try:
        tokenizer = load_tokenizer(args.model_dir)
        config, params = load_pretrained(args.model_dir, dtype=jnp.dtype(args.dtype))
        tokens, mask = _encode(tokenizer, args.prompt, chat=not args.no_chat_template)
        eos_ids = stop_token_ids(tokenizer, config, args.model_dir)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        completion = generate(
            params,
            config,
            tokens,
            mask,
            key=jax.random.key(args.seed),
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            eos_ids=eos_ids,
            pad_id=pad_id,
            num_samples=args.num_samples,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1

    out_tokens = np.asarray(completion.tokens)
    out_mask = np.asarray(completion.mask)
    for row in range(out_tokens.shape[0]):
        prompt, sample = divmod(row, args.num_samples)
        text = tokenizer.decode(out_tokens[row][out_mask[row]], skip_special_tokens=True)
        header = f"[prompt {prompt}"
        header += f", sample {sample}]" if args.num_samples > 1 else "]"
        print(f"{header} {args.prompt[prompt]}")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(generate_main())
