"""Tests of jaxrl_llm.objectives.registry: the generic name -> entry registry."""

from __future__ import annotations

import pytest

from jaxrl_llm.objectives.registry import Registry, check_registration


def test_add_get_names_and_the_live_read_only_view():
    registry = Registry("widget")
    view = registry.view
    registry.add("a", 1)
    registry.mark_builtins()
    registry.add("b", 2)
    assert registry.names() == ("a", "b") == tuple(view)
    assert registry.get("b") == 2 == view["b"]
    with pytest.raises(TypeError):
        view["c"] = 3
    with pytest.raises(ValueError, match=r"unknown widget 'c'; registered: \('a', 'b'\)"):
        registry.get("c")


def test_taken_names_need_override_and_built_ins_stay():
    registry = Registry("widget")
    registry.add("a", 1)
    registry.mark_builtins()
    with pytest.raises(ValueError, match="widget 'a' is already registered; pass override=True"):
        registry.add("a", 2)
    registry.add("a", 2, override=True)
    assert registry.get("a") == 2
    with pytest.raises(ValueError, match="widget 'a' is built in"):
        registry.remove("a")
    registry.add("b", 3)
    registry.remove("b")
    with pytest.raises(ValueError, match=r"no widget 'b' is registered; registered: \('a',\)"):
        registry.remove("b")
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty str"):
            registry.add(bad, 1)


def test_check_registration():
    check_registration("widget", "a", None)
    check_registration("widget", "a", len)
    with pytest.raises(ValueError, match=r"register_widget needs a name"):
        check_registration("widget", len, None)
    with pytest.raises(ValueError, match="a widget must be callable, got 3 for 'a'"):
        check_registration("widget", "a", 3)
