"""YAML <-> frozen dataclass trees: round trips, type checks, unknown keys, overrides."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pytest

from jaxrl_llm.train.config_io import (
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    save_config,
    to_dict,
)


@dataclasses.dataclass(frozen=True)
class Optim:
    learning_rate: float = 1e-3
    schedule: Literal["constant", "cosine"] = "constant"
    betas: tuple[float, float] = (0.9, 0.999)
    max_steps: int = 10


@dataclasses.dataclass(frozen=True)
class Term:
    name: str = "match"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Positive:
    size: int = 1

    def __post_init__(self):
        if self.size <= 0:
            raise ValueError(f"size must be > 0, got {self.size}")


@dataclasses.dataclass(frozen=True)
class Root:
    run_dir: str = "runs/x"
    seed: int = 0
    resume: bool = False
    path: str | None = None
    scale: int | float = 1
    digits: tuple[int, ...] = (1, 2)
    optim: Optim = Optim()
    terms: tuple[Term, ...] = (Term(),)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    positive: Positive = Positive()


@dataclasses.dataclass(frozen=True)
class Required:
    name: str
    seed: int = 0


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# -- from_dict / round trips ---------------------------------------------------------------------


def test_defaults_from_empty_and_none():
    assert from_dict(Root, {}) == Root()
    assert from_dict(Root, None) == Root()


def test_nested_sections_keep_their_other_defaults():
    cfg = from_dict(Root, {"optim": {"max_steps": 7}, "terms": [{"name": "a"}, {"weight": 2}]})
    assert cfg.optim == Optim(max_steps=7)
    assert cfg.terms == (Term(name="a"), Term(weight=2.0))
    assert isinstance(cfg.terms, tuple)
    assert isinstance(cfg.terms[1].weight, float)


def test_lists_become_tuples_and_ints_floats():
    cfg = from_dict(Root, {"digits": [3, 4, 5], "optim": {"betas": [0, 1], "learning_rate": 1}})
    assert cfg.digits == (3, 4, 5)
    assert cfg.optim.betas == (0.0, 1.0)
    assert type(cfg.optim.learning_rate) is float
    assert type(cfg.optim.betas[0]) is float


def test_union_prefers_the_exact_type():
    assert type(from_dict(Root, {"scale": 3}).scale) is int
    assert type(from_dict(Root, {"scale": 0.5}).scale) is float


def test_free_form_mapping_accepts_anything():
    data = {"overrides": {"clip_high": 0.28, "nested": {"a": [1, "b"]}, "flag": None}}
    assert from_dict(Root, data).overrides == data["overrides"]


def test_round_trip_through_yaml(tmp_path):
    cfg = Root(
        run_dir="on",  # a YAML 1.1 bool spelling: must come back a string
        seed=3,
        resume=True,
        path="1e-3",  # looks like a float to the loader: must be quoted on save
        scale=2.5,
        digits=(1,),
        optim=Optim(learning_rate=1e-10, schedule="cosine", betas=(0.5, 0.75), max_steps=2),
        terms=(Term(name="null", kwargs={"k": 2}), Term(weight=-0.5)),
        overrides={"clip_high": 0.3, "loss_type": "sigmoid"},
    )
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    back = load_config(Root, path, [])
    assert back == cfg
    assert type(back.path) is str and type(back.run_dir) is str
    assert list(tmp_path.glob("sub/*")) == [path]  # no temporary file left behind


@pytest.mark.parametrize("job", ["rl", "preference"])
def test_round_trip_of_the_job_configs(tmp_path, job):
    from jaxrl_llm.train.cli import config_class

    cls = config_class(job)
    cfg = load_config(cls, None, ["seed=5", "trainer.max_steps=3"])
    # ``sft_warmup.steps: null`` (resolved per model at run time) survives the file.
    assert cfg.sft_warmup.steps is None
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(cls, tmp_path / "c.yaml", []) == cfg


def test_to_dict_is_plain_and_ordered():
    plain = to_dict(Root())
    assert list(plain) == [f.name for f in dataclasses.fields(Root)]
    assert plain["digits"] == [1, 2]
    assert plain["terms"] == [{"name": "match", "weight": 1.0, "kwargs": {}}]
    assert dump_yaml(Root()).startswith("run_dir: runs/x\n")
    assert "to_dict needs a dataclass instance" in _error(to_dict, Root)


# -- errors --------------------------------------------------------------------------------------


def test_unknown_key_suggests_the_nearest():
    message = _error(from_dict, Root, {"optim": {"max_step": 3}})
    assert message == "unknown config key 'optim.max_step'; did you mean 'optim.max_steps'?"
    assert "did you mean 'seed'" in _error(from_dict, Root, {"sed": 1})
    assert "'terms[1].nme'; did you mean 'terms[1].name'" in _error(
        from_dict, Root, {"terms": [{}, {"nme": "x"}]}
    )


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    message = _error(from_dict, Root, {"optim": {"zzzz": 1}})
    assert "unknown config key 'optim.zzzz'" in message
    assert "learning_rate, max_steps, schedule" in message


@pytest.mark.parametrize(
    ("data", "key", "expected"),
    [
        ({"seed": "3"}, "seed", "an int"),
        ({"seed": 1.5}, "seed", "an int"),
        ({"seed": True}, "seed", "an int"),
        ({"resume": 1}, "resume", "a bool"),
        ({"run_dir": 5}, "run_dir", "a string"),
        ({"optim": {"learning_rate": "fast"}}, "optim.learning_rate", "a float"),
        ({"optim": {"learning_rate": False}}, "optim.learning_rate", "a float"),
        ({"digits": [1, "two"]}, "digits[1]", "an int"),
        ({"digits": 3}, "digits", "a list"),
        ({"path": 3}, "path", "a string"),
        ({"overrides": [1]}, "overrides", "a mapping"),
    ],
)
def test_bad_types_name_the_key(data, key, expected):
    message = _error(from_dict, Root, data)
    assert f"config key {key!r} expects {expected}" in message


def test_literal_choices():
    message = _error(from_dict, Root, {"optim": {"schedule": "linear"}})
    assert "'optim.schedule' must be one of ('constant', 'cosine'), got 'linear'" in message


def test_fixed_length_tuple():
    message = _error(from_dict, Root, {"optim": {"betas": [0.9]}})
    assert "'optim.betas' expects a list of 2 items, got 1" in message


def test_section_must_be_a_mapping():
    assert "config section 'optim' must be a mapping" in _error(from_dict, Root, {"optim": 3})
    assert "'optim' expects a mapping (Optim), got null" in _error(from_dict, Root, {"optim": None})
    assert "the config must be a mapping" in _error(from_dict, Root, [1])


def test_missing_required_key():
    assert "missing required config key 'name'" in _error(from_dict, Required, {})
    assert from_dict(Required, {"name": "a"}) == Required(name="a")


def test_dataclass_validation_error_names_the_section():
    message = _error(from_dict, Root, {"positive": {"size": 0}})
    assert "config section 'positive'" in message and "size must be > 0" in message


def test_not_a_dataclass():
    assert "needs a dataclass type" in _error(from_dict, dict, {})


# -- overrides -----------------------------------------------------------------------------------


def test_override_values_are_yaml():
    data = {"optim": {"max_steps": 1}}
    out = apply_overrides(
        data,
        [
            "resume=true",
            "seed=3",
            "optim.learning_rate=1e-3",
            "digits=[1,2]",
            "path=null",
            "run_dir='7'",
            "optim.schedule=cosine",
            "overrides.clip_high=0.28",
            "overrides.name=a=b",
        ],
    )
    assert out == {
        "optim": {"max_steps": 1, "learning_rate": 1e-3, "schedule": "cosine"},
        "resume": True,
        "seed": 3,
        "digits": [1, 2],
        "path": None,
        "run_dir": "7",
        "overrides": {"clip_high": 0.28, "name": "a=b"},
    }
    assert type(out["optim"]["learning_rate"]) is float
    assert data == {"optim": {"max_steps": 1}}  # the input is not modified


def test_overrides_then_from_dict(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\noptim:\n  max_steps: 4\n  learning_rate: 3e-4\n")
    cfg = load_config(Root, path, ["optim.max_steps=9", "digits=[7]", "path=null"])
    assert cfg == Root(seed=1, optim=Optim(max_steps=9, learning_rate=3e-4), digits=(7,))


def test_unknown_override_key_is_caught_by_from_dict():
    message = _error(load_config, Root, None, ["optim.max_step=3"])
    assert "did you mean 'optim.max_steps'" in message


def test_malformed_overrides():
    assert "malformed override 'seed'" in _error(apply_overrides, {}, ["seed"])
    assert "empty key segment" in _error(apply_overrides, {}, ["optim..x=1"])
    assert "not valid YAML" in _error(apply_overrides, {}, ["seed=[1"])
    assert "'seed' is 3, not a mapping" in _error(apply_overrides, {"seed": 3}, ["seed.x=1"])
    assert "list of 'key=value' strings" in _error(apply_overrides, {}, "seed=1")


# -- load_config ---------------------------------------------------------------------------------


def test_load_config_defaults_and_file_errors(tmp_path):
    assert load_config(Root, None, []) == Root()
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(Root, tmp_path / "missing.yaml", [])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(Root, empty, []) == Root()
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert "must hold a mapping at the top level" in _error(load_config, Root, listing, [])
    broken = tmp_path / "broken.yaml"
    broken.write_text("seed: [1\n")
    assert "is not valid YAML" in _error(load_config, Root, broken, [])
