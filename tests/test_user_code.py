"""Importing the user's code a config names (``user_code``): search paths put first once,
failures as one line saying where modules are searched."""

from __future__ import annotations

import sys

import pytest

from jaxrl_llm import user_code


def test_search_paths_go_first_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", ["/elsewhere"])
    (tmp_path / "a").mkdir()
    user_code.add_search_paths(tmp_path / "a", tmp_path)
    user_code.add_search_paths(tmp_path)
    assert sys.path == [str(tmp_path / "a"), str(tmp_path), "/elsewhere"]


def test_a_module_on_a_search_path_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "beside_config.py").write_text("def score(p, c, e):\n    return 1.0\n")
    with pytest.raises(ValueError) as info:
        user_code.import_object("beside_config:score", "reward 'beside_config:score'")
    assert str(info.value) == (
        "reward 'beside_config:score': cannot import 'beside_config' (No module named "
        "'beside_config'); modules are found in the working directory, the config's directory "
        "and PYTHONPATH"
    )
    user_code.add_search_paths(tmp_path)
    assert user_code.import_object("beside_config:score", "reward")(0, 0, 0) == 1.0
    monkeypatch.delitem(sys.modules, "beside_config")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("json:absent", "x: cannot import 'absent' from 'json' (no such name)"),
        ("json", "x: 'json' is not 'package.module:name'"),
        (":f", "x: ':f' is not 'package.module:name'"),
    ],
)
def test_bad_names_are_one_line(spec, message):
    with pytest.raises(ValueError) as info:
        user_code.import_object(spec, "x")
    assert str(info.value) == message
