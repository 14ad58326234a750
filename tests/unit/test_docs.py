"""The docs hold together: every protocol section the code cites exists in docs/protocol.md, every
relative link in the README and docs/ points at a file (and heading) that exists, and the README's
Python blocks parse."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(REPO, "README.md"), os.path.join(REPO, "CHANGELOG.md"),
        *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
SOURCES = [path for pattern in ("transfer/**/*.py", "native/*.[ch]", "scripts/*")
           for path in glob.glob(os.path.join(REPO, pattern), recursive=True)]

# "SPEC.md section 9", "SPEC.md sections 5, 7 and 8", "SPEC.md 4.2", "SPEC.md 2-4, 6, 8", "SPEC 6".
_CITATION = re.compile(r"SPEC(?:\.md)?(?:'s)?\s+(?:sections?\s+)?"
                       r"((?:\d+(?:\.\d+)?(?![\d.]|\s*parts)(?:\s*(?:,|and|-|/|\+)\s*)?)+)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _sections() -> set[str]:
    headings = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", _read(os.path.join(REPO, "docs", "protocol.md")), re.M)
    return set(headings)


def _cited(text: str) -> set[str]:
    cited = set()
    for match in _CITATION.finditer(text):
        numbers = re.findall(r"\d+(?:\.\d+)?", match.group(1))
        cited.update(numbers)
        for low, high in re.findall(r"(\d+)\s*-\s*(\d+)", match.group(1)):
            cited.update(str(n) for n in range(int(low), int(high) + 1))
    return cited


def test_the_citation_pattern_reads_every_form():
    assert _cited("SPEC.md sections 5, 7 and 8; SPEC.md 4.2, 13 parts; SPEC.md 2-4, 6; SPEC 9's text") == \
        {"2", "3", "4", "4.2", "5", "6", "7", "8", "9"}


def test_every_cited_protocol_section_exists():
    sections = _sections()
    assert {"1", "2", "3", "4", "4.1", "4.2", "4.3", "5", "6", "7", "8", "9"} <= sections
    missing = {}
    for path in SOURCES + DOCS:
        unknown = _cited(_read(path)) - sections
        if unknown:
            missing[os.path.relpath(path, REPO)] = sorted(unknown)
    assert not missing, f"cited sections with no heading in docs/protocol.md: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(path):
    text = _read(path)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        assert os.path.exists(resolved), f"{os.path.relpath(path, REPO)} links to missing {target}"
        if anchor and resolved.endswith(".md"):
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", _read(resolved), re.M)}
            assert anchor in anchors, f"{os.path.relpath(path, REPO)} links to missing heading {target}"


def test_the_readme_python_blocks_parse():
    blocks = re.findall(r"```python\n(.*?)```", _read(os.path.join(REPO, "README.md")), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)


def test_the_readme_keeps_the_two_commands():
    readme = _read(os.path.join(REPO, "README.md"))
    assert "make test" in readme and "make demo" in readme


_GUARANTEES = os.path.join(REPO, "docs", "guarantees.md")


def _cited_tests(text: str) -> list[tuple[str, str]]:
    """(file, test name) of every `tests/...py::test_name` the text cites."""
    return re.findall(r"`(tests/(?:unit|live)/[\w/]+\.py)::(\w+)`", text)


def test_every_test_the_guarantees_cite_exists():
    cited = _cited_tests(_read(_GUARANTEES))
    assert len(cited) > 100
    missing = []
    for path, name in cited:
        file = os.path.join(REPO, path)
        if not os.path.exists(file) or not re.search(rf"^(?:async )?def {name}\(", _read(file), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"


def test_every_guarantee_names_the_tests_that_show_it():
    text = _read(_GUARANTEES)
    promises, _, mapping = text.partition("\n## Which tests show each guarantee\n")
    titles = [title.rstrip(".") for title in re.findall(r"^- \*\*(.+?)\*\*", promises, re.M)]
    assert len(titles) >= 11
    sections = dict(re.findall(r"^### (.+)\n\n((?:- .*\n?)+)", mapping, re.M))
    for title in titles:
        assert title in sections, f"guarantee {title!r} has no section under 'Which tests show each guarantee'"
        assert _cited_tests(sections[title]), f"guarantee {title!r} names no test"


@pytest.mark.parametrize("path", ["README.md", os.path.join("docs", "architecture.md")])
def test_the_failure_kinds_listed_are_the_ones_there_are(path):
    from transfer.core.failure import FailureKind

    text = " ".join(_read(os.path.join(REPO, path)).split())
    listed = re.search(r"\((?:`transfer\.core\.failure\.FailureKind`: )?(deadline, [a-z_, ]+)\)", text)
    assert listed is not None, f"{path} lists no failure kinds"
    assert listed.group(1).split(", ") == [kind.value for kind in FailureKind]


def test_the_readme_layout_names_every_core_module():
    # The Layout block's `core/` entry: the cores, failure.py, bounded.py and "one module per policy (...)".
    layout = _read(os.path.join(REPO, "README.md")).partition("\n## Layout\n")[2].partition("\n## ")[0]
    entry = layout.partition("  core/")[2].partition("\n  drive/")[0]
    named = set(re.findall(r"\b(\w+)\.py\b", entry))
    named |= set(re.search(r"one module per policy \(([^)]*)\)", entry, re.S).group(1).replace(",", " ").split())
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "transfer", "core", "*.py"))} - {"__init__"}
    assert modules - named == set(), f"README's Layout leaves out transfer/core modules: {sorted(modules - named)}"
    assert named - modules == set(), f"README's Layout names core modules that do not exist: {sorted(named - modules)}"
    public = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "transfer", "[!_]*.py"))}
    listed = set(re.findall(r"\b(\w+)\.py\b", layout.partition("\ntransfer/\n")[2].partition("\n  core/")[0]))
    listed |= set(re.findall(r"\b(\w+)\.py\b", layout.partition("\n  drive/")[2].partition("\ntests/")[0]))
    assert public - listed == set(), f"README's Layout leaves out transfer/ modules: {sorted(public - listed)}"
