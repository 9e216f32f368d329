"""Preference data: JSONL pairs and unpaired records, the synthetic pair set, row sampling."""

import json

import numpy as np
import pytest

from jaxrl_llm.data import (
    IndexSampler,
    PreferencePair,
    UnpairedExample,
    arithmetic_preference_pairs,
    load_preference_jsonl,
    load_unpaired_jsonl,
    mismatched_partners,
    pair_keys,
    pairs_to_unpaired,
    solve_arithmetic,
)


def _write(path, records):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def test_load_preference_jsonl_reads_pairs_and_keeps_extra_fields(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+1=", "chosen": "2", "rejected": "3", "source": "a"},
            "",
            {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        ],
    )
    pairs = load_preference_jsonl(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("1+1=", "2", "3"),
        ("2+2=", "4", "5"),
    ]
    assert pairs[0].extra == {"source": "a"} and pairs[1].extra == {}
    assert pairs[0].margin == 0.0


def test_load_preference_jsonl_custom_fields_and_margins(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"q": "x", "good": "a", "bad": "b", "m": 2},
            {"q": "y", "good": "c", "bad": "d", "m": 0.5},
        ],
    )
    pairs = load_preference_jsonl(
        path, prompt_field="q", chosen_field="good", rejected_field="bad", margin_field="m"
    )
    assert [p.margin for p in pairs] == [2.0, 0.5]
    assert pairs[1] == PreferencePair("y", "c", "d", 0.5, {})


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"prompt": "a", "chosen": "b"}], r"p.jsonl:1: missing field 'rejected'"),
        ([{"prompt": "a", "chosen": 3, "rejected": "c"}], r"field 'chosen' must be a string"),
        (["{not json"], r"p.jsonl:1: invalid JSON"),
        (["[1, 2]"], r"expected a JSON object, got list"),
        (["", "  "], r"holds no record"),
    ],
    ids=["missing", "wrong_type", "bad_json", "not_object", "empty"],
)
def test_load_preference_jsonl_errors_name_the_line(tmp_path, records, message):
    path = _write(tmp_path / "p.jsonl", records)
    with pytest.raises(ValueError, match=message):
        load_preference_jsonl(path)


def test_a_margin_field_must_be_a_number_on_every_line(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(ValueError, match=r"missing field 'margin'"):
        load_preference_jsonl(path, margin_field="margin")
    path = _write(
        tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}]
    )
    with pytest.raises(ValueError, match=r"field 'margin' must be a number"):
        load_preference_jsonl(path, margin_field="margin")


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_preference_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_unpaired_jsonl(tmp_path / "nope.jsonl")


def test_load_unpaired_jsonl_reads_labels(tmp_path):
    path = _write(
        tmp_path / "u.jsonl",
        [
            {"prompt": "1+1=", "completion": "2", "label": True},
            {"prompt": "1+2=", "completion": "9", "label": False, "why": "wrong"},
        ],
    )
    examples = load_unpaired_jsonl(path)
    assert examples == [
        UnpairedExample("1+1=", "2", True, {}),
        UnpairedExample("1+2=", "9", False, {"why": "wrong"}),
    ]


@pytest.mark.parametrize("label", [1, "true", None])
def test_unpaired_labels_must_be_json_booleans(tmp_path, label):
    path = _write(tmp_path / "u.jsonl", [{"prompt": "a", "completion": "b", "label": label}])
    with pytest.raises(ValueError, match=r"u.jsonl:1: field 'label' must be a JSON boolean"):
        load_unpaired_jsonl(path)


def test_records_validate_their_fields():
    with pytest.raises(ValueError, match="PreferencePair.chosen must be a str"):
        PreferencePair("a", None, "b")
    with pytest.raises(ValueError, match="margin must be finite"):
        PreferencePair("a", "b", "c", float("nan"))
    with pytest.raises(ValueError, match="label must be a bool"):
        UnpairedExample("a", "b", 1)


def test_pairs_to_unpaired_puts_chosen_first_and_partners_answer_other_prompts():
    pairs = [PreferencePair(f"p{i}", f"c{i}", f"r{i}") for i in range(3)]
    unpaired = pairs_to_unpaired(pairs)
    assert [(u.prompt, u.completion, u.label) for u in unpaired] == [
        ("p0", "c0", True),
        ("p1", "c1", True),
        ("p2", "c2", True),
        ("p0", "r0", False),
        ("p1", "r1", False),
        ("p2", "r2", False),
    ]
    partners = mismatched_partners(len(unpaired))
    np.testing.assert_array_equal(partners, [1, 2, 3, 4, 5, 0])
    for i, j in enumerate(partners):
        assert unpaired[i].prompt != unpaired[j].prompt
    with pytest.raises(ValueError, match="at least 2"):
        mismatched_partners(1)


# --------------------------------------------------------------------------------------
# The synthetic set
# --------------------------------------------------------------------------------------


def test_arithmetic_pairs_follow_the_rule():
    pairs = arithmetic_preference_pairs(300, seed=5, max_offset=4)
    assert len({p.prompt for p in pairs}) == 300
    for p in pairs:
        correct = int(solve_arithmetic(p.prompt))
        wrong = int(p.rejected)
        assert p.chosen == str(correct) == p.extra["answer"]
        assert wrong >= 0 and 1 <= abs(wrong - correct) <= 4
    offsets = {int(p.rejected) - int(p.chosen) for p in pairs}
    assert offsets == {-4, -3, -2, -1, 1, 2, 3, 4}


def test_arithmetic_pairs_are_deterministic_and_seeded():
    a = arithmetic_preference_pairs(50, seed=1)
    assert a == arithmetic_preference_pairs(50, seed=1)
    assert a != arithmetic_preference_pairs(50, seed=2)
    # Prompts come from arithmetic_examples: a prefix of a longer draw is the shorter draw.
    assert [p.prompt for p in a] == [p.prompt for p in arithmetic_preference_pairs(80, seed=1)][:50]


def test_arithmetic_pairs_check_their_settings():
    with pytest.raises(ValueError, match="max_offset"):
        arithmetic_preference_pairs(4, seed=0, max_offset=0)
    with pytest.raises(ValueError, match="only give"):
        arithmetic_preference_pairs(1000, seed=0, digits=1, ops=("+",))


# --------------------------------------------------------------------------------------
# Row sampling
# --------------------------------------------------------------------------------------


def test_index_sampler_visits_every_row_once_per_epoch_and_resumes():
    pairs = arithmetic_preference_pairs(10, seed=0)
    sampler = IndexSampler(pair_keys(pairs), seed=3)
    first_epoch = sampler.next_indices(10)
    assert sorted(first_epoch.tolist()) == list(range(10))
    sampler.next_indices(4)
    saved = sampler.state()
    expected = sampler.next_indices(13)

    resumed = IndexSampler(pair_keys(pairs), seed=3)
    resumed.restore(saved)
    np.testing.assert_array_equal(resumed.next_indices(13), expected)


def test_index_sampler_refuses_another_dataset():
    sampler = IndexSampler(pair_keys(arithmetic_preference_pairs(10, seed=0)), seed=0)
    other = IndexSampler(pair_keys(arithmetic_preference_pairs(10, seed=1)), seed=0)
    with pytest.raises(ValueError, match="fingerprint"):
        other.restore(sampler.state())
