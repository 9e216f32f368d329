"""``jaxrl-llm generate``: sample completions from a local checkpoint with the batching engine.

Two ways to give prompts:

* ``jaxrl-llm generate MODEL_DIR PROMPT...``: completions are printed, decoded, special tokens
  removed, under a ``[prompt i]`` / ``[prompt i, sample g]`` header;
* ``jaxrl-llm generate MODEL_DIR --prompts FILE.jsonl --out OUT.jsonl``: batch generation. Each
  input line is ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``,
  optionally with ``"max_new_tokens"`` (that request's budget) and ``"id"`` (copied to the
  output). Each output line, in input order and sample order, is ``{"index", "sample", "id"?,
  "text", "tokens", "logprobs", "finish_reason", "num_tokens"}``. A progress bar and the
  run's tokens/s and slot utilisation go to stderr.

``--stop TEXT`` (repeatable) ends a completion once its tokens end with TEXT's tokens (matched
as token ids on device, so TEXT must tokenize the same inside a completion).

Prompts are written as the policy was trained: a checkpoint written by a ``jaxrl-llm`` run
records its prompt format (``prompt_format.json``: chat template or raw text, system prompt;
``data.encoding.PromptFormat``); any other checkpoint's prompts go through its chat template
when it has one. ``--chat-template`` / ``--no-chat-template`` override that (a one-line note
says when it differs from the training); ``messages`` always need the template, and a
checkpoint without one is bad input (exit 2, as every other bad input).
Requests run through ``jaxrl_llm.sampling.engine`` (``--engine continuous``, the default, refills
slots as completions finish; ``static`` decodes one batch of ``--slots`` requests at a time);
the ``G`` samples of a prompt share its prefill, and each request's tokens depend only on
``--seed`` and its position in the input (prompt ``i``, sample ``g``: request ``i * G + g``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from jaxrl_llm.console import USER_ERRORS, quiet_start
from jaxrl_llm.data.encoding import PromptFormat, read_prompt_format, stop_token_ids
from jaxrl_llm.sampling.prompt_format import (
    add_chat_template_flags,
    asked_chat_template,
    resolve_prompt_format,
)

_DTYPES = ("float32", "bfloat16")
_ROW_KEYS = {"prompt", "messages", "max_new_tokens", "id"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm generate",
        description="Sample completions from a Hugging Face checkpoint directory (a run's "
        "hf/, prompted as it was trained).",
    )
    parser.add_argument("model_dir", help="directory with config.json, safetensors, tokenizer")
    parser.add_argument("prompt", nargs="*", help="prompts (or --prompts FILE.jsonl)")
    parser.add_argument("--prompts", metavar="FILE.jsonl", help="one JSON request per line")
    parser.add_argument("--out", metavar="OUT.jsonl", help="write the completions as JSONL")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens a completion (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature, 0 = greedy (default: %(default)s)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s = off)")
    parser.add_argument("--top-k", type=int, default=0, help="(default: %(default)s = off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="(default: %(default)s = off)")
    parser.add_argument(
        "--num-samples", type=int, default=1, help="completions per prompt (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--dtype", choices=_DTYPES, default="float32", help="parameter dtype (default: %(default)s)"
    )
    parser.add_argument(
        "--slots", type=int, default=None, help="decode slots (default: min(64, requests))"
    )
    parser.add_argument(
        "--engine",
        choices=("continuous", "static"),
        default="continuous",
        help="(default: %(default)s)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=8,
        help="decode steps per host round trip (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="a paged KV cache of blocks of this many slots (default: contiguous rows)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="the paged cache's blocks (default: every slot's longest request)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end a completion when it ends with TEXT's tokens (repeatable; kept in the output)",
    )
    add_chat_template_flags(parser, unrecorded="whenever the tokenizer has a template")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def read_prompts(path: str) -> list[dict]:
    """The JSONL request rows of ``path``, checked (``ValueError`` naming the line)."""
    from jaxrl_llm.data.datasets import jsonl_records  # noqa: PLC0415

    rows = []
    for where, row in jsonl_records(path, fields=()):
        unknown = set(row) - _ROW_KEYS
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)}; expected {sorted(_ROW_KEYS)}"
            )
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{where}: give exactly one of 'prompt' and 'messages'")
        if "prompt" in row and not isinstance(row["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        messages = row.get("messages")
        if messages is not None and not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)
        ):
            raise ValueError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
            )
        budget = row.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{where}: 'max_new_tokens' must be a positive int, got {budget!r}")
        rows.append(row)
    return rows


def _encode(tokenizer: Any, row: dict, prompt_format: PromptFormat) -> list[int]:
    """The prompt's token ids (no padding)."""
    if "messages" in row or prompt_format.chat_template:
        messages = [
            dict(m) for m in row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        ]
        system = prompt_format.system_prompt if prompt_format.chat_template else None
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})  # as in training
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already writes any BOS it wants.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(row["prompt"])["input_ids"]
    if not ids:
        raise ValueError(f"a prompt encodes to no tokens: {row!r}")
    return list(ids)


def _stop_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"--stop {text!r} encodes to no tokens")
    return list(ids)


def generate_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm generate``; returns the process exit status."""
    parser = _parser()
    # Prompts may follow the options (``MODEL --temperature 0 PROMPT``).
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    if bool(args.prompt) == bool(args.prompts):
        parser.error("give prompts as arguments or --prompts FILE.jsonl (one of the two)")
    if not os.path.isdir(args.model_dir):
        print(f"error: {args.model_dir!r} is not a directory", file=sys.stderr)
        return 2
    if args.prompts and not os.path.isfile(args.prompts):
        print(f"error: --prompts {args.prompts!r} is not a file", file=sys.stderr)
        return 2
    if args.num_samples < 1:
        parser.error(f"--num-samples must be >= 1, got {args.num_samples}")

    quiet_start()
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.models import load_pretrained, load_tokenizer
    from jaxrl_llm.sampling.engine import Engine, EngineSettings, Request
    from jaxrl_llm.sampling.state import SamplingOptions

    try:
        rows = read_prompts(args.prompts) if args.prompts else [{"prompt": p} for p in args.prompt]
        tokenizer = load_tokenizer(args.model_dir)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        trained = read_prompt_format(args.model_dir)
        prompt_format, note = resolve_prompt_format(
            trained,
            asked=asked_chat_template(args),
            unrecorded=PromptFormat(has_template),
            # Asked for the template, the training's system prompt (if it had the template).
            system_prompt=trained.system_prompt if trained and trained.chat_template else None,
            model_dir=args.model_dir,
        )
        if (prompt_format.chat_template or any("messages" in r for r in rows)) and not has_template:
            raise ValueError(f"{args.model_dir} has no chat template (needed for chat prompts)")
        if note is not None:
            print(note, file=sys.stderr)
        prompts = [_encode(tokenizer, row, prompt_format) for row in rows]
        config, params = load_pretrained(args.model_dir, dtype=jnp.dtype(args.dtype))
        eos_ids = stop_token_ids(tokenizer, config, args.model_dir)
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        budgets = [row.get("max_new_tokens") or args.max_new_tokens for row in rows]
        requests = [
            Request(prompt, budget, prompt_key=i)
            for i, (prompt, budget) in enumerate(zip(prompts, budgets))
            for _ in range(args.num_samples)
        ]
        slots = args.slots or min(64, len(requests))
        engine = Engine(
            params,
            config,
            settings=EngineSettings(
                slots=slots,
                burst=args.burst,
                engine=args.engine,
                kv_block_size=args.kv_block_size,
                kv_blocks=args.kv_blocks,
            ),
            max_new_tokens=max(budgets),
            max_prompt_len=max(map(len, prompts)),
            sampling=SamplingOptions(
                eos_ids=eos_ids,
                pad_id=pad_id,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                min_p=args.min_p,
            ),
            stop_sequences=[_stop_ids(tokenizer, text) for text in args.stop],
        )
        progress = None
        if args.prompts and not args.no_progress:
            from tqdm import tqdm  # noqa: PLC0415

            progress = tqdm(total=len(requests), unit="req", file=sys.stderr)
        try:
            results, stats = engine.run(requests, seed=args.seed, progress=progress)
        finally:
            if progress is not None:
                progress.close()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    texts = [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in results]
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for n, (result, text) in enumerate(zip(results, texts)):
                index, sample = divmod(n, args.num_samples)
                line = {"index": index, "sample": sample}
                if "id" in rows[index]:
                    line["id"] = rows[index]["id"]
                line |= {
                    "text": text,
                    "tokens": result.tokens.tolist(),
                    "logprobs": np.round(result.logprobs.astype(float), 6).tolist(),
                    "finish_reason": result.finish_reason,
                    "num_tokens": len(result.tokens),
                }
                f.write(json.dumps(line) + "\n")
    if args.prompt and not args.out:
        for n, text in enumerate(texts):
            index, sample = divmod(n, args.num_samples)
            header = f"[prompt {index}"
            header += f", sample {sample}]" if args.num_samples > 1 else "]"
            print(f"{header} {args.prompt[index]}")
            print(text)
    print(
        f"{stats.requests} requests, {stats.tokens} tokens in {stats.seconds:.2f} s "
        f"({stats.tokens_per_s:,.0f} tokens/s, compile included); {slots} slots, "
        f"{args.engine} engine, slot utilisation {stats.utilisation:.1%}"
        + (
            f"; paged KV cache: peak {stats.peak_blocks} blocks, {stats.preemptions} preemptions"
            if args.kv_block_size
            else ""
        )
        + (f"; wrote {args.out}" if args.out else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(generate_main())
