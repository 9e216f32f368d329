"""Every Python block of README.md runs as written (the docs cannot drift from the code)."""

from __future__ import annotations

import pathlib
import re

import pytest

from jaxrl_llm import objectives

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    registered = set(objectives.surrogates_available())
    try:
        exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
    finally:
        for name in set(objectives.surrogates_available()) - registered:
            objectives.unregister_surrogate(name)
    assert capsys.readouterr().out.strip()  # each block prints its result
