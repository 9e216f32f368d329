"""JSONL loading, the held-out split, the resumable prompt sampler and prompt formatting."""

import json

import numpy as np
import pytest

from jaxrl_llm.data import (
    ARITHMETIC_ALPHABET,
    Example,
    PromptSampler,
    build_char_tokenizer,
    format_example,
    format_prompt,
    load_jsonl,
    split_eval,
)
from jaxrl_llm.rewards import is_correct


def _examples(n):
    return [Example(prompt=f"q{i}", answer=str(i), extra={"id": i}) for i in range(n)]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------
# load_jsonl
# --------------------------------------------------------------------------------------


def test_load_jsonl_keeps_extra_fields_and_skips_blank_lines(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "1+1=", "answer": "2", "level": 1}),
            "",
            json.dumps({"prompt": "Héllo?", "answer": 72, "tags": ["a", "b"]}),
        ],
    )
    examples = load_jsonl(path)
    assert examples == [
        Example("1+1=", "2", {"level": 1}),
        Example("Héllo?", "72", {"tags": ["a", "b"]}),
    ]
    assert examples[1].to_dict() == {"prompt": "Héllo?", "answer": "72", "tags": ["a", "b"]}


def test_load_jsonl_custom_field_names(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"question": "q", "solution": "s", "x": 0})])
    (ex,) = load_jsonl(path, prompt_field="question", answer_field="solution")
    assert (ex.prompt, ex.answer, ex.extra) == ("q", "s", {"x": 0})


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_jsonl(tmp_path / "absent.jsonl")


def test_load_jsonl_bad_json_names_the_line(tmp_path):
    good = json.dumps({"prompt": "p", "answer": "a"})
    path = _write(tmp_path / "d.jsonl", [good, good, '{"prompt": "p", "answer": '])
    with pytest.raises(ValueError, match=r"d\.jsonl:3: invalid JSON"):
        load_jsonl(path)


def test_load_jsonl_missing_field_names_line_and_field(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"prompt": "p", "answer": "a"}), '{"p": 1}'])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: missing field 'prompt'"):
        load_jsonl(path)
    path = _write(tmp_path / "e.jsonl", [json.dumps({"prompt": "p"})])
    with pytest.raises(ValueError, match=r"e\.jsonl:1: missing field 'answer'"):
        load_jsonl(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"prompt": 3, "answer": "a"}), "'prompt' must be a string"),
        (json.dumps({"prompt": "p", "answer": None}), "'answer' must be a string or a number"),
        (json.dumps({"prompt": "p", "answer": True}), "'answer' must be a string or a number"),
    ],
)
def test_load_jsonl_wrong_types(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        load_jsonl(_write(tmp_path / "d.jsonl", [line]))


def test_float_answers_keep_their_decimal_form(tmp_path):
    """A JSON or Parquet column of floats: ``str`` would give ``1e-05`` and ``1e+16``, which no
    answer parser reads (a completion "0.00001" would never match)."""
    values = [1e-05, 1e16, 72.0, 0.1, 2.5e-3]
    lines = [json.dumps({"prompt": f"p{i}", "answer": v}) for i, v in enumerate(values)]
    answers = [e.answer for e in load_jsonl(_write(tmp_path / "d.jsonl", lines))]
    assert answers == ["0.00001", "10000000000000000", "72.0", "0.1", "0.0025"]
    assert is_correct("so 0.00001", Example("p", answers[0]))
    for bad in ("NaN", "Infinity"):
        line = f'{{"prompt": "p", "answer": {bad}}}'
        with pytest.raises(ValueError, match="'answer' must be a finite number"):
            load_jsonl(_write(tmp_path / "e.jsonl", [line]))


def test_load_jsonl_refuses_one_field_for_prompt_and_answer(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"q": "p"})])
    with pytest.raises(ValueError, match="prompt_field and answer_field must differ, both are 'q'"):
        load_jsonl(path, prompt_field="q", answer_field="q")


def test_load_jsonl_empty_file(tmp_path):
    with pytest.raises(ValueError, match="holds no record"):
        load_jsonl(_write(tmp_path / "d.jsonl", ["", "  "]))


def test_example_validates_types():
    with pytest.raises(ValueError, match="answer must be a str"):
        Example("p", 3)


# --------------------------------------------------------------------------------------
# split_eval
# --------------------------------------------------------------------------------------


def test_split_eval_is_disjoint_complete_and_ordered():
    examples = _examples(50)
    train, evaluation = split_eval(examples, eval_size=12, seed=3)
    train_ids = [ex.extra["id"] for ex in train]
    eval_ids = [ex.extra["id"] for ex in evaluation]
    assert len(eval_ids) == 12 and len(train_ids) == 38
    assert not set(train_ids) & set(eval_ids)
    assert sorted(train_ids + eval_ids) == list(range(50))
    assert train_ids == sorted(train_ids) and eval_ids == sorted(eval_ids)


def test_split_eval_is_deterministic_in_seed():
    examples = _examples(100)
    first = split_eval(examples, eval_fraction=0.2, seed=7)
    assert split_eval(examples, eval_fraction=0.2, seed=7) == first
    assert split_eval(examples, eval_fraction=0.2, seed=8)[1] != first[1]
    assert len(first[1]) == 20


def test_split_eval_fraction_rounds():
    assert len(split_eval(_examples(10), eval_fraction=0.26, seed=0)[1]) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one"),
        ({"eval_fraction": 0.1, "eval_size": 2}, "exactly one"),
        ({"eval_fraction": 1.0}, r"\(0, 1\)"),
        ({"eval_size": 10}, "between 1 and 9"),
        ({"eval_size": 0}, "between 1 and 9"),
        ({"eval_fraction": 0.01}, "between 1 and 9"),
        ({"eval_size": 2.5}, "must be an int"),
    ],
)
def test_split_eval_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_eval(_examples(10), **kwargs)


# --------------------------------------------------------------------------------------
# PromptSampler
# --------------------------------------------------------------------------------------


def _ids(batch):
    return [ex.extra["id"] for ex in batch]


def test_sampler_follows_the_documented_epoch_permutations():
    examples = _examples(7)
    sampler = PromptSampler(examples, seed=5)
    drawn = _ids(sampler.next_batch(3) + sampler.next_batch(9) + sampler.next_batch(2))
    expected = [int(i) for e in range(2) for i in np.random.default_rng([5, e]).permutation(7)]
    assert drawn == expected
    assert sampler.epoch == 2 and sampler.state()["index"] == 0


def test_sampler_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(_examples(20), seed=0)
    epochs = [_ids(sampler.next_batch(20)) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(20))
    assert epochs[0] != epochs[1] != epochs[2]


def test_sampler_without_shuffle_keeps_dataset_order():
    sampler = PromptSampler(_examples(4), seed=9, shuffle=False)
    assert _ids(sampler.next_batch(6)) == [0, 1, 2, 3, 0, 1]


def test_sampler_depends_on_seed():
    a = _ids(PromptSampler(_examples(30), seed=1).next_batch(30))
    b = _ids(PromptSampler(_examples(30), seed=2).next_batch(30))
    assert a != b


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4])
def test_sampler_resume_draws_the_same_batches(stop_after):
    examples = _examples(11)
    sizes = [4, 5, 3, 13, 2, 6, 11]  # crosses epoch boundaries; one batch exceeds N
    uninterrupted = PromptSampler(examples, seed=42)
    reference = [_ids(uninterrupted.next_batch(n)) for n in sizes]

    first = PromptSampler(examples, seed=42)
    for n in sizes[:stop_after]:
        first.next_batch(n)
    saved = json.loads(json.dumps(first.state()))  # as stored in a checkpoint
    resumed = PromptSampler(examples, seed=42)
    resumed.restore(saved)
    assert [_ids(resumed.next_batch(n)) for n in sizes[stop_after:]] == reference[stop_after:]


def test_sampler_restore_refuses_other_seed_or_dataset():
    examples = _examples(10)
    sampler = PromptSampler(examples, seed=0)
    sampler.next_batch(3)
    state = sampler.state()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(examples, seed=1).restore(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptSampler(_examples(11), seed=0).restore(state)
    changed = examples[:-1] + [Example("other", "9", {"id": 9})]
    with pytest.raises(ValueError, match="fingerprint"):
        PromptSampler(changed, seed=0).restore(state)
    with pytest.raises(ValueError, match="shuffle"):
        PromptSampler(examples, seed=0, shuffle=False).restore(state)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"epoch": 0}, "lacks"),
        ({"epoch": -1, "index": 0}, "non-negative"),
        ({"epoch": 0, "index": 10}, "out of range"),
        ({"epoch": 0, "index": 1.5}, "non-negative int"),
    ],
)
def test_sampler_restore_rejects_bad_positions(state, message):
    with pytest.raises(ValueError, match=message):
        PromptSampler(_examples(10), seed=0).restore(state)


def test_sampler_errors():
    with pytest.raises(ValueError, match="at least one"):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(_examples(2), seed=-1)
    with pytest.raises(ValueError, match="positive int"):
        PromptSampler(_examples(2), seed=0).next_batch(0)


# --------------------------------------------------------------------------------------
# format_prompt
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_char_tokenizer(ARITHMETIC_ALPHABET)


def test_format_prompt_raw(char_tokenizer):
    assert format_prompt("12+7=", char_tokenizer, chat_template=False) == "12+7="


def test_format_prompt_chat_template(char_tokenizer):
    text = format_prompt("12+7=", char_tokenizer, chat_template=True)
    assert text == "<|user|>12+7=<|assistant|>"
    text = format_prompt("12+7=", char_tokenizer, chat_template=True, system_prompt="0")
    assert text == "<|system|>0<|user|>12+7=<|assistant|>"


def test_format_prompt_errors(char_tokenizer):
    with pytest.raises(ValueError, match="system_prompt needs chat_template"):
        format_prompt("1+1=", char_tokenizer, chat_template=False, system_prompt="s")
    plain = build_char_tokenizer("ab")
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        format_prompt("ab", plain, chat_template=True)


# --------------------------------------------------------------------------------------
# Chat messages
# --------------------------------------------------------------------------------------

CONVERSATION = (
    {"role": "system", "content": "0"},
    {"role": "user", "content": "1+1="},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "2+2="},
)


def test_example_messages_render_through_the_chat_template(char_tokenizer):
    ex = Example(prompt="2+2=", answer="4", messages=[dict(m) for m in CONVERSATION])
    assert ex.messages == CONVERSATION  # stored as a tuple of dicts
    text = format_example(ex, char_tokenizer, chat_template=True, system_prompt="9")
    # The conversation's own system message is kept; data.system_prompt is not added.
    assert text == "<|system|>0<|user|>1+1=<|assistant|>2<eos><|user|>2+2=<|assistant|>"
    no_system = Example(prompt="2+2=", answer="4", messages=CONVERSATION[1:])
    text = format_example(no_system, char_tokenizer, chat_template=True, system_prompt="9")
    assert text.startswith("<|system|>9<|user|>1+1=")
    # Without messages, format_example is format_prompt of the prompt.
    plain = Example(prompt="2+2=", answer="4")
    assert format_example(plain, char_tokenizer, chat_template=True) == "<|user|>2+2=<|assistant|>"
    assert format_example(plain, char_tokenizer, chat_template=False) == "2+2="
    assert ex.to_dict()["messages"] == [dict(m) for m in CONVERSATION]
    assert "messages" not in plain.to_dict()


def test_messages_change_the_sampler_fingerprint():
    a = [Example(prompt="q", answer="1", messages=[{"role": "user", "content": "q"}])]
    b = [Example(prompt="q", answer="1", messages=[{"role": "user", "content": "q"}] * 2)]
    with pytest.raises(ValueError, match="fingerprint"):
        PromptSampler(b, seed=0).restore(PromptSampler(a, seed=0).state())


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty list of chat messages"),
        ("hi", "non-empty list of chat messages"),
        (["hi"], r"messages\[0\]: a message must be a mapping"),
        ([{"role": "user"}], r"messages\[0\]: a message needs a string 'content'"),
        ([{"role": "system", "content": "s"}], "no user message"),
    ],
)
def test_bad_messages(messages, message):
    with pytest.raises(ValueError, match=message):
        Example(prompt="p", answer="a", messages=messages)


def test_messages_need_the_chat_template(char_tokenizer):
    with pytest.raises(ValueError, match="chat messages need chat_template=True"):
        format_prompt("p", char_tokenizer, chat_template=False, messages=CONVERSATION)
