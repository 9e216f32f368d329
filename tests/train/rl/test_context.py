"""What an RL run holds between steps (``train.rl.context``): its stop tokens and its learned
reward's normalisation.

The stop tokens are the union of ``config.json``'s EOS ids, ``generation_config.json``'s (where
chat models list their end-of-turn token) and the tokenizer's EOS (``data.stop_token_ids``);
a run over a checkpoint directory samples with that union. Nothing here compiles a step.
"""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import numpy as np
import pytest

from jaxrl_llm import data, models
from jaxrl_llm.data.encoding import stop_token_ids
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig, check_config
from jaxrl_llm.train.rl.context import normalize_scores, screen_prompts
from jaxrl_llm.train.rl.trainer import SFT_WARMUP_STEPS_BUILTIN, RLTrainer
from jaxrl_llm.train.setup import tiny_model_config
from tests.train.rl import rl_helpers

EOS = 2  # the character tokenizer's <eos>
END_OF_TURN = 6  # <|assistant|>, standing in for a chat model's end-of-turn token


def _write_generation_config(directory, eos) -> None:
    with open(directory / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": eos, "pad_token_id": 0}, f)


@pytest.fixture(scope="module")
def tokenizer():
    return data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)


def test_stop_tokens_are_the_union_in_order(tokenizer, tmp_path):
    config = types.SimpleNamespace(eos_token_ids=(9, EOS))
    _write_generation_config(tmp_path, [END_OF_TURN, 9])
    # config.json's, then generation_config.json's, then the tokenizer's; each once.
    assert stop_token_ids(tokenizer, config, tmp_path) == (9, EOS, END_OF_TURN)
    _write_generation_config(tmp_path, END_OF_TURN)  # a single id, not a list
    assert stop_token_ids(tokenizer, None, tmp_path) == (END_OF_TURN, EOS)
    _write_generation_config(tmp_path, None)
    assert stop_token_ids(tokenizer, config, tmp_path) == (9, EOS)


def test_without_a_generation_config_the_model_and_tokenizer_decide(tokenizer, tmp_path):
    assert stop_token_ids(tokenizer) == (EOS,)
    assert stop_token_ids(tokenizer, types.SimpleNamespace(eos_token_ids=(7,))) == (7, EOS)
    assert stop_token_ids(tokenizer, None, tmp_path / "no-such-dir") == (EOS,)


def test_an_unreadable_generation_config_or_no_stop_token_is_an_error(tokenizer, tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*generation_config.json"):
        stop_token_ids(tokenizer, None, tmp_path)
    no_eos = types.SimpleNamespace(eos_token_id=None)
    with pytest.raises(ValueError, match="no stop token"):
        stop_token_ids(no_eos, types.SimpleNamespace(eos_token_ids=()), tmp_path / "missing")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, tokenizer):
    """The built-in tiny model saved as a checkpoint directory whose generation config adds an
    end-of-turn stop token."""
    path = tmp_path_factory.mktemp("checkpoint")
    data.build_char_tokenizer(data.ARITHMETIC_ALPHABET, save_dir=path)
    config = tiny_model_config(TrainConfig().model, tokenizer, None)
    models.save_pretrained(path, config, models.init_params(config, jax.random.key(0)))
    _write_generation_config(path, [END_OF_TURN, EOS])
    return path


def test_a_run_over_a_checkpoint_samples_with_the_union(checkpoint_dir, tmp_path):
    """The trainer stops completions at every stop id, and (``sft_warmup.steps`` left null) does
    not train a loaded checkpoint on demonstrations unasked."""
    overrides = [o for o in rl_helpers.TINY if not o.startswith("sft_warmup.")]
    cfg = load_config(
        TrainConfig,
        None,
        [*overrides, f"run_dir={tmp_path / 'run'}", f"model.path={checkpoint_dir}"],
    )
    assert cfg.sft_warmup.steps is None
    trainer = RLTrainer(cfg)
    try:
        assert trainer.run.stop_ids == (EOS, END_OF_TURN)
        assert trainer.sft_steps == 0
    finally:
        trainer.checkpointer.close()
        trainer.metrics_writer.close()
    # The built-in model with the same (null) setting warms up first.
    builtin = RLTrainer(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=None)))
    try:
        assert builtin.run.stop_ids == (EOS,)
        assert builtin.sft_steps == SFT_WARMUP_STEPS_BUILTIN == 2000
    finally:
        builtin.checkpointer.close()
        builtin.metrics_writer.close()


def test_learned_rewards_are_whitened_over_the_batch(rng):
    scores = rng.normal(3.0, 2.0, size=16).astype(np.float32)
    got = normalize_scores(scores, "batch")
    x = scores.astype(np.float64)
    np.testing.assert_allclose(got, (x - x.mean()) / (x.std() + 1e-6), rtol=1e-6)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(normalize_scores(scores, "none"), scores)
    # One score has no spread to whiten: it is kept as it is.
    np.testing.assert_array_equal(normalize_scores(scores[:1], "batch"), scores[:1])


def _screen_setup(tmp_path, *overrides):
    cfg = load_config(
        TrainConfig, None, [f"run_dir={tmp_path}", "data.max_prompt_tokens=12", *overrides]
    )
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    short = data.Example(prompt="1+2=", answer="3")
    long = data.Example(prompt="12+34+56+78+90=", answer="270")
    return cfg, tokenizer, [short, long, short, long, long]


def test_overlong_prompts_are_dropped_and_counted(tmp_path, caplog):
    # The character tokenizer: one token a character, so "1+2=" is 4 tokens and the
    # 15-character prompt 15, over the limit of 12.
    cfg, tokenizer, examples = _screen_setup(tmp_path)
    assert len(tokenizer("1+2=")["input_ids"]) == 4
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        kept = screen_prompts(cfg, tokenizer, examples, "train")
    assert kept == [examples[0], examples[2]]
    assert "dropped 3 of 5 train prompts longer than data.max_prompt_tokens=12 (longest 15" in (
        caplog.text
    )
    # The limit is inclusive: a prompt of exactly 12 tokens stays.
    edge = data.Example(prompt="12+34+56+78=", answer="180")
    assert screen_prompts(cfg, tokenizer, [edge], "eval") == [edge]


def test_overlong_prompts_error_mode_and_nothing_left(tmp_path):
    cfg, tokenizer, examples = _screen_setup(tmp_path, "data.overlong_prompts=error")
    with pytest.raises(ValueError, match="a train prompt of 15 tokens exceeds data.max_prompt"):
        screen_prompts(cfg, tokenizer, examples, "train")
    cfg, tokenizer, examples = _screen_setup(tmp_path)
    with pytest.raises(ValueError, match="every eval prompt exceeds data.max_prompt_tokens=12"):
        screen_prompts(cfg, tokenizer, examples[1:2], "eval")
    bad = load_config(TrainConfig, None, ["run_dir=x", "data.overlong_prompts=truncate"])
    with pytest.raises(ValueError, match=r"data.overlong_prompts must be one of \('filter'"):
        check_config(bad)
