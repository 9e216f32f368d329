"""``jaxrl-llm eval`` prompts a policy as it was trained (its ``prompt_format.json``), unless
told otherwise, and says so in one line when the two differ (issue 46). No model is built."""

from __future__ import annotations

import dataclasses

import pytest

from jaxrl_llm.train.rl.config import TrainConfig
from jaxrl_llm.train.rl.evaluate import as_trained


def _config(tmp_path, *, recorded, chat_template=False, system_prompt=None):
    from jaxrl_llm.data.encoding import PromptFormat, write_prompt_format

    if recorded is not None:
        write_prompt_format(tmp_path, PromptFormat(*recorded))
    cfg = TrainConfig()
    data = dataclasses.replace(cfg.data, chat_template=chat_template, system_prompt=system_prompt)
    return dataclasses.replace(
        cfg, data=data, model=dataclasses.replace(cfg.model, path=str(tmp_path))
    )


def _format(cfg):
    return cfg.data.chat_template, cfg.data.system_prompt


@pytest.mark.parametrize(
    ("recorded", "config", "asked", "want", "note"),
    [
        # A run directory: its config says what hf/ records.
        ((False, None), (False, None), None, (False, None), None),
        # A config that says otherwise: the training wins, in one line.
        ((False, None), (True, None), None, (False, None), "trained without its chat template"),
        ((True, "Be brief."), (False, None), None, (True, "Be brief."), "and its system prompt"),
        # Told otherwise: that, with a note when it differs from the training.
        ((False, None), (False, None), True, (True, None), "--chat-template applies it anyway"),
        ((True, "S"), (True, "S"), False, (False, None), "--no-chat-template leaves it out"),
        ((True, "S"), (True, "S"), True, (True, "S"), None),
        # A checkpoint no run wrote: the config as it is.
        (None, (True, None), None, (True, None), None),
    ],
)
def test_eval_prompts_the_policy_as_it_was_trained(tmp_path, recorded, config, asked, want, note):
    cfg = _config(tmp_path, recorded=recorded, chat_template=config[0], system_prompt=config[1])
    chosen, said = as_trained(cfg, asked=asked)
    assert _format(chosen) == want
    if note is None:
        assert said is None
    else:
        assert said.startswith("note: ") and note in said and "\n" not in said
