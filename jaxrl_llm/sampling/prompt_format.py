"""Prompting a trained policy from the command line: the ``--chat-template`` /
``--no-chat-template`` flags of ``jaxrl-llm generate`` and ``eval``, and the prompt format they
resolve to.

A policy is prompted as it was trained (its ``prompt_format.json``,
``data.encoding.PromptFormat``) unless the user asks for the chat template or raw text; a choice
that differs from the training is said in one ``note:`` line.
"""

from __future__ import annotations

import argparse

from jaxrl_llm.data.encoding import PromptFormat


def add_chat_template_flags(parser: argparse.ArgumentParser, *, unrecorded: str) -> None:
    """Adds the mutually exclusive ``--chat-template`` / ``--no-chat-template`` flags to
    ``parser``; ``unrecorded`` says, in the help, what a checkpoint without a recorded prompt
    format gets."""
    template = parser.add_mutually_exclusive_group()
    template.add_argument(
        "--chat-template",
        action="store_true",
        help="apply the tokenizer's chat template (default: as the policy was trained, from its "
        f"prompt_format.json; without one, {unrecorded})",
    )
    template.add_argument(
        "--no-chat-template",
        action="store_true",
        help="tokenize the prompts as raw text (default: as the policy was trained)",
    )


def asked_chat_template(args: argparse.Namespace) -> bool | None:
    """What the flags of :func:`add_chat_template_flags` ask for: the chat template (True), raw
    text (False) or, with neither, the training's format (None)."""
    return True if args.chat_template else False if args.no_chat_template else None


def resolve_prompt_format(
    trained: PromptFormat | None,
    *,
    asked: bool | None,
    unrecorded: PromptFormat,
    system_prompt: str | None,
    model_dir: str,
) -> tuple[PromptFormat, str | None]:
    """``(format to prompt with, note)``.

    Args:
      trained: the format ``model_dir`` records (``data.encoding.read_prompt_format``), or None.
      asked: :func:`asked_chat_template`'s answer.
      unrecorded: the format without a choice and without a record.
      system_prompt: the system prompt when the chat template is asked for (raw text has none).
      model_dir: the checkpoint, as the note names it.

    Returns:
      The ``trained`` format (else ``unrecorded``) unless ``asked`` chose; ``note``: one line
      when the choice differs from the training, else None.
    """
    if asked is None:
        return (trained if trained is not None else unrecorded), None
    chosen = PromptFormat(asked, system_prompt if asked else None)
    if trained is None or trained.chat_template == asked:
        return chosen, None
    flag = "--chat-template applies it" if asked else "--no-chat-template leaves it out"
    return chosen, f"note: {model_dir} was trained {trained.describe()}; {flag} anyway"


__all__ = ["add_chat_template_flags", "asked_chat_template", "resolve_prompt_format"]
