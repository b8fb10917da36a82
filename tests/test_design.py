"""docs/DESIGN.md's "Where a change goes" stays true: every file a row names exists, and the
grep of each row's concept finds it in those files and nowhere else in the two packages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flowmatch_assets", "flowmatch_models")


def _rows() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "DESIGN.md").read_text()
    table = text.split("## Where a change goes", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 3 and cells[2].startswith("`") and cells[0] != "change":
            rows.append((cells[0], cells[1], cells[2].strip("`")))
    return rows


def _sources() -> dict[str, str]:
    return {
        p.relative_to(REPO).as_posix(): p.read_text()
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
    }


def test_the_table_has_its_rows():
    assert len(_rows()) >= 15


@pytest.mark.parametrize("change, where, pattern", _rows(), ids=lambda x: x[:40])
def test_each_change_names_the_files_a_grep_finds(change, where, pattern):
    named = re.findall(r"`((?:flowmatch_assets|flowmatch_models|tests)/[^`\s]+)`", where)
    assert named, f"{change}: no file named"
    for f in named:
        if "<" in f:  # a template (<kind>.py): its folder exists
            assert (REPO / f.split("<", 1)[0]).is_dir(), f
        else:
            assert (REPO / f).exists(), f"{change}: {f} does not exist"
    # every name the row gives (`encode`, `ROW_SCHEMA`, ...) is in one of its files (a
    # setting FLOWMATCH_*: anywhere in the packages), so a renamed function cannot hide here
    sources = _sources()
    texts = [sources.get(f) or (REPO / f).read_text() for f in named if "<" not in f]
    for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", where):
        pool = sources.values() if name.startswith("FLOWMATCH_") else texts
        assert any(re.search(rf"\b{name}\b", t) for t in pool), f"{change}: no {name} in {named}"
    regex = re.compile(pattern.replace("\\|", "|"), re.M)
    found = {f for f, src in sources.items() if regex.search(src)}
    assert found, f"{change}: nothing matches {pattern!r}"
    assert found <= set(named), f"{change}: {pattern!r} also in {sorted(found - set(named))}"
