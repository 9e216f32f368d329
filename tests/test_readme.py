"""The docs cannot drift from the code: every Python block of README.md runs as written, the
README's Layout section matches the tree, and every citation of ``benchmarks/RESULTS.md`` from
README.md and ``docs/*.md`` names a heading that exists there."""

from __future__ import annotations

import pathlib
import re

import pytest

from jaxrl_llm import objectives

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    registered = set(objectives.surrogates_available())
    try:
        # Run as a script is: as ``__main__`` (``dataclasses`` looks its module up).
        code = compile(BLOCKS[index], f"README.md block {index}", "exec")
        exec(code, {"__name__": "__main__"})
    finally:
        for name in set(objectives.surrogates_available()) - registered:
            objectives.unregister_surrogate(name)
    assert capsys.readouterr().out.strip()  # each block prints its result


# --- The Layout section -------------------------------------------------------------------


def layout_block(text: str) -> str:
    """The first ```` ```text ```` block of the ``## Layout`` section (up to the next ``## ``)."""
    section = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Layout' section"
    block = re.search(r"^```text\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the Layout section has no ```text block"
    return block.group(1)


def layout_paths(block: str) -> list[str]:
    """The repository paths the Layout block lists, in order.

    Format: one entry a line, ``<indent><path>[ <path> ...]<two or more spaces><what>`` (the
    description optional). Paths are separated by single spaces and hold none; a folder ends
    with ``/``. The indent is two spaces a level: an entry one level deeper than the line above
    lies in that line's folder, so that line must hold exactly one path, a folder. Paths are
    relative to the repository root at level 0.
    """
    paths: list[str] = []
    folders: list[str | None] = []  # the folder each level's last entry opened (None: none)
    for number, line in enumerate(block.splitlines(), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        where = f"Layout line {number}: {line.strip()!r}"
        assert indent % 2 == 0, f"{where}: indent by two spaces a level"
        level = indent // 2
        assert level <= len(folders), f"{where}: indented more than one level below its parent"
        if level:
            parent = folders[level - 1]
            assert parent is not None, f"{where}: the line above it is not a single folder"
        else:
            parent = ""
        names = re.split(r" {2,}", line.strip(), maxsplit=1)[0].split(" ")
        paths += [parent + name for name in names]
        folder = len(names) == 1 and names[0].endswith("/")
        folders[level:] = [parent + names[0] if folder else None]
    return paths


def layout_problems(text: str, root: pathlib.Path, package: str = "jaxrl_llm") -> list[str]:
    """What is wrong with ``text``'s Layout section against the tree at ``root``: listed paths
    that do not exist (a folder where a file is listed counts), and package folders under
    ``package/`` (directories with an ``__init__.py``) that are not listed."""
    paths = layout_paths(layout_block(text))
    problems = []
    for path in paths:
        target = root / path
        exists = target.is_dir() if path.endswith("/") else target.is_file()
        if not exists:
            problems.append(f"listed but missing: {path}")
    listed = {p for p in paths if p.endswith("/")}
    for init in sorted((root / package).rglob("__init__.py")):
        folder = init.parent.relative_to(root).as_posix() + "/"
        if folder not in listed:
            problems.append(f"package not listed: {folder}")
    return problems


def test_layout_matches_the_tree():
    assert layout_problems(README.read_text(encoding="utf-8"), ROOT) == []


def test_layout_check_sees_missing_paths_and_unlisted_packages(tmp_path):
    for folder in ("pkg", "pkg/a", "pkg/a/b", "pkg/c"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pkg" / "m.py").write_text("")
    text = "## Layout\n\n```text\n{}```\n\n## Next\n"
    good = "pkg/  the package\n  m.py  a module\n  a/ c/  two packages\n  a/\n    b/  deeper\n"
    assert layout_problems(text.format(good), tmp_path, "pkg") == []
    # A renamed folder: listed but missing, and its package not listed.
    (tmp_path / "pkg" / "c").rename(tmp_path / "pkg" / "d")
    assert layout_problems(text.format(good), tmp_path, "pkg") == [
        "listed but missing: pkg/c/",
        "package not listed: pkg/d/",
    ]
    with pytest.raises(AssertionError, match="not a single folder"):
        layout_paths("pkg/ docs/  two folders\n  a/\n")
    with pytest.raises(AssertionError, match="two spaces a level"):
        layout_paths("pkg/\n   a/\n")


# --- Citations of benchmarks/RESULTS.md ---------------------------------------------------


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[str]:
    """The Markdown headings (any level) outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            out.append(match.group(1).strip())
    return out


def anchors(text: str) -> set[str]:
    """Every heading's anchor, with GitHub's ``-1``, ``-2`` ... suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(f"{anchor}-{count}" if count else anchor)
    return out


LINK = re.compile(r"\]\(([^()\s]+)\)")
# A heading cited by name: `RESULTS, "Name"` or `benchmarks/RESULTS.md`, "Name".
CITED = re.compile(r"RESULTS(?:\.md)?`?,\s+\"([^\"]+)\"")


def results_problems(page: pathlib.Path, results_text: str) -> list[str]:
    """Links from ``page`` into RESULTS.md whose anchor is no heading there, and headings it
    cites by name that RESULTS.md does not have."""
    text = page.read_text(encoding="utf-8")
    known_anchors, known_names = anchors(results_text), set(headings(results_text))
    problems = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if not path.endswith("RESULTS.md"):
            continue
        if (page.parent / path).resolve() != RESULTS:
            problems.append(f"{page.name}: {target} is not benchmarks/RESULTS.md")
        elif anchor and anchor not in known_anchors:
            problems.append(f"{page.name}: no heading for #{anchor}")
    for name in CITED.findall(text):
        if name not in known_names:
            problems.append(f"{page.name}: no heading {name!r}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_results_citations_name_existing_headings(page):
    assert results_problems(page, RESULTS.read_text(encoding="utf-8")) == []


def test_results_check_sees_a_removed_heading(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    results = RESULTS.read_text(encoding="utf-8")
    page.write_text(
        'See [x](../benchmarks/RESULTS.md#pod-plans) and RESULTS, "Pod plans".\n'
        "And [y](../benchmarks/RESULTS.md#mixed-precision)."
    )
    # The page resolves to tmp_path/benchmarks/RESULTS.md, not this repository's.
    assert results_problems(page, results) == [
        "page.md: ../benchmarks/RESULTS.md#pod-plans is not benchmarks/RESULTS.md",
        "page.md: ../benchmarks/RESULTS.md#mixed-precision is not benchmarks/RESULTS.md",
    ]
    page = ROOT / "docs" / "plan.md"  # a real page; the heading it cites removed
    cut = results.replace("## Pod plans\n", "## Pod plan figures\n")
    assert "plan.md: no heading for #pod-plans" in results_problems(page, cut)
    assert "plan.md: no heading 'Pod plans'" in results_problems(page, cut)


def test_results_headings_are_unique():
    names = headings(RESULTS.read_text(encoding="utf-8"))
    assert len(names) == len(set(names))


# --- Links stay inside the repository -----------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_point_only_inside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text
    for target in LINK.findall(text):
        path = target.partition("#")[0]
        if not path or re.match(r"[a-z]+:", path):  # an anchor on the page, or a URL
            continue
        resolved = (page.parent / path).resolve()
        assert resolved.is_relative_to(ROOT), f"{target} leaves the repository"
        assert resolved.exists(), f"{target} does not exist"
