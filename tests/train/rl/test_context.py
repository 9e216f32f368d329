"""What an RL run holds between steps (``train.rl.context``): its stop tokens, its learned
reward's normalisation, and its prompts (``data.task: hf``, overlong prompts filtered, refused
or truncated as the rollout tokenises them).

The stop tokens are the union of ``config.json``'s EOS ids, ``generation_config.json``'s (where
chat models list their end-of-turn token) and the tokenizer's EOS (``data.stop_token_ids``);
a run over a checkpoint directory samples with that union. Nothing here compiles a step.
"""

from __future__ import annotations

import dataclasses
import json
import types

import datasets
import jax
import numpy as np
import pytest

from jaxrl_llm import data, models
from jaxrl_llm.data.encoding import encode_prompts, stop_token_ids
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.rl.config import TrainConfig, check_config
from jaxrl_llm.train.rl.context import (
    eval_batch_prompts,
    load_examples,
    normalize_scores,
    screen_prompts,
)
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
    bad = load_config(TrainConfig, None, ["run_dir=x", "data.overlong_prompts=clip"])
    with pytest.raises(ValueError, match=r"data.overlong_prompts must be one of \('filter'"):
        check_config(bad)


# --------------------------------------------------------------------------------------
# Truncation (data.overlong_prompts=truncate)
# --------------------------------------------------------------------------------------


def _rollout_length(cfg, tokenizer, ex) -> int:
    """The prompt's length as the rollout encodes it (``data.encode_prompts``, which refuses
    a prompt over the limit)."""
    text = data.format_example(
        ex, tokenizer, chat_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt
    )
    tokens, _ = encode_prompts(
        tokenizer,
        [text],
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        add_special_tokens=not cfg.data.chat_template,
    )
    return tokens.shape[1]


def test_truncate_keeps_the_end_or_the_beginning_and_counts(tmp_path, caplog):
    cfg, tokenizer, examples = _screen_setup(tmp_path, "data.overlong_prompts=truncate")
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        kept = screen_prompts(cfg, tokenizer, examples, "train")
    # left (the default, verl's side): the last 12 characters, where the question ends.
    assert [ex.prompt for ex in kept] == ["1+2=", "34+56+78+90="] * 2 + ["34+56+78+90="]
    assert kept[0] is examples[0]  # prompts that fit are untouched
    assert all(_rollout_length(cfg, tokenizer, ex) <= 12 for ex in kept)
    assert kept[1].answer == "270"
    assert "truncated 3 of 5 train prompts longer than data.max_prompt_tokens=12 (longest 15" in (
        caplog.text
    )
    assert "to their end" in caplog.text and "dropped" not in caplog.text
    cfg, tokenizer, examples = _screen_setup(
        tmp_path, "data.overlong_prompts=truncate", "data.truncation_side=right"
    )
    assert screen_prompts(cfg, tokenizer, examples, "eval")[1].prompt == "12+34+56+78+"


def test_truncate_cuts_the_prompt_text_never_the_template(tmp_path, caplog):
    """With the chat template and a system prompt only the user text is cut; in a conversation
    the last user message is, earlier turns stay whole; what cannot fit is dropped, counted."""
    chat = ("data.overlong_prompts=truncate", "data.chat_template=true", "data.system_prompt=+-")
    cfg, tokenizer, _ = _screen_setup(tmp_path, *chat)
    long = data.Example(prompt="12+34+56+78+90=", answer="270")
    (got,) = screen_prompts(cfg, tokenizer, [long], "train")
    # <|system|>+-<|user|> ... <|assistant|>: 5 template tokens, 7 left for the text.
    assert got.prompt == "+78+90=" and _rollout_length(cfg, tokenizer, got) == 12
    turns = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "12+34+56+78+90="},
    ]
    cfg, tokenizer, _ = _screen_setup(tmp_path, *chat, "data.max_prompt_tokens=16")
    conversation = data.Example(prompt="12+34+56+78+90=", answer="270", messages=turns)
    (got,) = screen_prompts(cfg, tokenizer, [conversation], "train")
    # 13 tokens of template and earlier turns (<eos> closes the assistant's), 3 of text.
    assert got.messages[:2] == conversation.messages[:2]
    assert got.messages[2]["content"] == got.prompt == "90="
    assert _rollout_length(cfg, tokenizer, got) == 16
    # The cut is in the last *user* message, wherever it stands.
    answered = data.Example(prompt="12+34+56+78+90=", answer="270", messages=turns[2:0:-1])
    (got,) = screen_prompts(cfg, tokenizer, [answered], "train")
    assert got.messages[0]["content"] == got.prompt == "6+78+90=" and got.messages[1] == turns[1]
    # Here the long turn comes first: cutting the last user message cannot make it fit.
    first_long = data.Example(prompt="1+1=", answer="2", messages=[turns[2], turns[1], turns[0]])
    with caplog.at_level("WARNING", logger="jaxrl_llm"):
        kept = screen_prompts(cfg, tokenizer, [long, first_long], "eval")
    assert [ex.prompt for ex in kept] == ["4+56+78+90="]
    assert "truncated 1 of 2 eval prompts" in caplog.text
    assert "dropped 1 of 2 eval prompts" in caplog.text
    assert "earlier turns alone exceed it" in caplog.text


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on a few sentences, GPT-2 style: it adds BOS on
    encode and trims spaces from offsets, so a text cut at a token boundary can re-tokenise to
    more or fewer tokens than were kept."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "the quick brown fox jumps over the lazy dog " * 3,
        "how many apples does Tom have if he buys 12 more? " * 3,
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    core.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)]),
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


@pytest.mark.parametrize("chat_template", [False, True])
def test_truncation_re_tokenises_within_the_limit_with_bpe(tmp_path, bpe_tokenizer, chat_template):
    """At every limit the cut text is a suffix of the prompt at a token boundary, the rollout
    encodes it within the limit, and starting one token earlier would not fit."""
    tok = bpe_tokenizer
    text = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?"
    )
    example = data.Example(prompt=text, answer="72")
    starts = [
        a
        for a, _ in tok(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
    ]
    for limit in range(4, 30):
        cfg = load_config(
            TrainConfig,
            None,
            [
                f"run_dir={tmp_path}",
                f"data.max_prompt_tokens={limit}",
                "data.overlong_prompts=truncate",
                f"data.chat_template={str(chat_template).lower()}",
            ],
        )
        (got,) = screen_prompts(cfg, tok, [example], "train")
        assert text.endswith(got.prompt) and len(text) - len(got.prompt) in starts
        assert _rollout_length(cfg, tok, got) <= limit
        earlier = max(a for a in starts if a < len(text) - len(got.prompt))
        longer = dataclasses.replace(example, prompt=text[earlier:])
        with pytest.raises(ValueError, match="exceeds data.max_prompt_tokens"):
            _rollout_length(cfg, tok, longer)


# --------------------------------------------------------------------------------------
# data.task: hf
# --------------------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    """A saved DatasetDict: 20 training and 6 test rows with other column names."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))

    def split(n, offset):
        return datasets.Dataset.from_dict(
            {
                "question": [f"{i}+{i}=" for i in range(offset, offset + n)],
                "final": [2 * i for i in range(offset, offset + n)],
            }
        )

    path = tmp_path / "arith"
    datasets.DatasetDict({"train": split(20, 0), "test": split(6, 50)}).save_to_disk(path)
    return path


def _hf_config(tmp_path, path, *overrides):
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "seed=3",
            "data.task=hf",
            f"data.path={path}",
            "data.prompt_key=question",
            "data.answer_key=final",
            "data.eval_size=4",
            *overrides,
        ],
    )
    check_config(cfg)
    return cfg


def test_the_hf_task_loads_seeded_splits(tmp_path, hf_dir, tokenizer):
    cfg = _hf_config(tmp_path, hf_dir, "data.eval_split=test")
    train, held_out = load_examples(cfg, tokenizer)
    order = np.random.default_rng(3).permutation(20)  # data.shuffle, seeded by the run seed
    assert [ex.prompt for ex in train] == [f"{i}+{i}=" for i in order]
    assert train[0].answer == str(2 * order[0])  # numbers become their str
    test_order = np.random.default_rng(3).permutation(6)[:4]  # the first eval_size
    assert [ex.prompt for ex in held_out] == [f"{50 + i}+{50 + i}=" for i in test_order]
    # No eval split: eval_size examples split off the training split, as for JSONL.
    train, held_out = load_examples(_hf_config(tmp_path, hf_dir, "data.shuffle=false"))
    assert len(train) == 16 and len(held_out) == 4
    assert sorted(ex.prompt for ex in train + held_out) == sorted(f"{i}+{i}=" for i in range(20))
    assert [ex.prompt for ex in train] == sorted(
        (ex.prompt for ex in train), key=lambda p: int(p.split("+")[0])
    )  # unshuffled: stored order kept


def test_the_hf_task_with_truncation_through_load_examples(tmp_path, hf_dir, tokenizer):
    cfg = _hf_config(tmp_path, hf_dir, "data.max_prompt_tokens=4", "data.overlong_prompts=truncate")
    train, held_out = load_examples(cfg, tokenizer)
    assert len(train) == 16 and len(held_out) == 4  # nothing dropped
    # "12+12=" keeps its last 4 tokens; "1+1=" fits as it is.
    by_answer = {ex.answer: ex.prompt for ex in train + held_out}
    assert by_answer["24"] == "+12=" and by_answer["2"] == "1+1="


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.task=hf"], "data.task=hf needs data.path"),
        (["data.task=hf", "data.path=d", "data.train_path=x.jsonl"], "data.train_path is read by"),
        (["data.task=hf", "data.path=d", "data.eval_split=train"], "is the training split"),
        (["data.task=hf", "data.path=d", "data.messages_key=m"], "needs data.chat_template=true"),
        (["data.task=jsonl", "data.train_path=x", "data.path=d"], "data.path is read by data.tas"),
        (["data.truncation_side=middle"], r"data.truncation_side must be one of \('left', 'righ"),
        (
            ["data.task=parquet"],
            r"data.task must be one of \('arithmetic', 'carry_slips', 'jsonl', 'hf'\)",
        ),
        (["data.max_prompt_tokens=0"], "data.max_prompt_tokens must be an int >= 1"),
    ],
)
def test_data_config_errors(overrides, message):
    cfg = load_config(TrainConfig, None, ["run_dir=x", *overrides])
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


def test_a_missing_hf_path_is_named(tmp_path):
    cfg = _hf_config(tmp_path, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_examples(cfg)


def test_rollouts_decode_with_the_configured_layer_layout(tmp_path, monkeypatch):
    """``rollout.decode_layers=stacked`` reaches the rollout's decode program (on CPU ``auto``
    would decode per layer)."""
    import importlib

    generate = importlib.import_module("jaxrl_llm.sampling.generate")
    seen = []
    real = generate.decode_program

    def recording(*args, **kwargs):
        seen.append(kwargs["unroll"])
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "decode_program", recording)
    for mode, unrolled in (("stacked", False), ("auto", True)):
        cfg = load_config(
            TrainConfig,
            None,
            [
                *rl_helpers.TINY,
                f"rollout.decode_layers={mode}",
                f"run_dir={tmp_path / mode}",
            ],
        )
        trainer = RLTrainer(cfg)
        try:
            with jax.set_mesh(trainer.mesh):
                trainer.setup()
            seen.clear()
            trainer.run.sample(
                trainer.sampler_params(),
                trainer.sampler.next_batch(2),
                jax.random.key(0),
                temperature=1.0,
                group_size=2,
            )
            assert seen == [unrolled], mode
        finally:
            trainer.checkpointer.close()
            trainer.metrics_writer.close()


def test_rollouts_use_the_configured_paged_cache(tmp_path, monkeypatch):
    """``rollout.kv_block_size`` / ``rollout.kv_blocks`` reach the continuous engine, whose
    paged cache (here small enough to preempt) samples the contiguous cache's tokens."""
    import importlib

    rollout = importlib.import_module("jaxrl_llm.train.rl.rollout")
    engines = []

    class Recording(rollout.Engine):
        def run(self, *args, **kwargs):
            results, stats = super().run(*args, **kwargs)
            engines.append((self.paged, stats))
            return results, stats

    monkeypatch.setattr(rollout, "Engine", Recording)
    draws = []
    for name, extra in (("contiguous", []), ("paged", ["rollout.kv_block_size=4"])):
        overrides = [*rl_helpers.TINY, "rollout.engine=continuous", "rollout.slots=8", *extra]
        if extra:  # 5 blocks of 4: under 2 rows' worth (a row: its prompt, 6 new tokens)
            # bursts of 2: an admission reserves its first burst's blocks, not the whole row
            overrides += ["rollout.kv_blocks=5", "rollout.burst=2"]
        cfg = load_config(TrainConfig, None, [*overrides, f"run_dir={tmp_path / name}"])
        trainer = RLTrainer(cfg)
        try:
            with jax.set_mesh(trainer.mesh):
                trainer.setup()
            batch = trainer.sampler.next_batch(4)
            samples = trainer.run.sample(
                trainer.sampler_params(), batch, jax.random.key(0), temperature=1.0, group_size=4
            )
            draws.append(samples)
        finally:
            trainer.checkpointer.close()
            trainer.metrics_writer.close()
    (none, _), (paged, stats) = engines
    assert none is None and paged[1] == 4 and paged[0] == 5
    assert stats.preemptions > 0 and stats.peak_blocks <= 5
    # The step's metrics carry the engine's figures (rollout.engine_info).
    assert draws[1].engine == stats
    info = rollout.engine_info(draws[1:])
    assert info["engine/preemptions"] == stats.preemptions
    assert info["engine/kv_peak_blocks"] == stats.peak_blocks
    assert "engine/preemptions" not in rollout.engine_info(draws[:1])  # contiguous
    np.testing.assert_array_equal(draws[0].completion_tokens, draws[1].completion_tokens)
    np.testing.assert_allclose(draws[0].logprobs, draws[1].logprobs, atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.kv_block_size=4"], "need rollout.engine=continuous"),
        (["rollout.engine=continuous", "rollout.kv_blocks=8"], "kv_block_size >= 1"),
        (["rollout.engine=continuous", "rollout.kv_block_size=-1"], "kv_block_size must be >= 0"),
    ],
)
def test_paged_cache_settings_are_checked(overrides, match):
    with pytest.raises(ValueError, match=match):
        check_config(load_config(TrainConfig, None, list(overrides)))


@pytest.mark.parametrize(
    ("samples", "want"),
    [(1, 256), (2, 128), (8, 32), (16, 32), (3, 64)],
)
def test_eval_batches_hold_about_a_rollout_batch(samples, want):
    rollout = types.SimpleNamespace(prompts_per_step=32, group_size=8)
    assert eval_batch_prompts(rollout, samples) == want
