"""Every FLOWMATCH_* environment variable the code reads is documented in one place,
docs/command-line.md (its Settings table, or the list of variables set for child processes),
and every one documented there exists in the code."""

from __future__ import annotations

import re

from tests.conftest import REPO

NAME = re.compile(r"\bFLOWMATCH_[A-Z0-9_]*[A-Z0-9]\b")
#: names that are marker files of model folders, not environment variables
MARKER = re.compile(r'_MARKER = "(FLOWMATCH_[A-Z_]+)"')


def _code() -> str:
    return "\n".join(
        p.read_text()
        for pkg in ("flowmatch_assets", "flowmatch_models")
        for p in sorted((REPO / pkg).rglob("*.py"))
    )


def test_every_flowmatch_variable_is_documented_and_every_documented_one_exists():
    code = _code()
    markers = set(MARKER.findall(code))
    used = set(NAME.findall(code)) - markers
    doc = (REPO / "docs" / "command-line.md").read_text()
    settings = doc.split("## Settings", 1)[1].split("\n## ", 1)[0]
    documented = set(NAME.findall(settings))
    assert not used - documented, (
        f"read by the code, not in docs/command-line.md: {used - documented}"
    )
    assert not documented - used - markers, f"documented, not in the code: {documented - used}"
    assert {"FLOWMATCH_DEMO_VAE", "FLOWMATCH_RANDOM_WEIGHTS", "FLOWMATCH_PRETRAINED"} <= markers


def test_the_settings_table_agrees_with_the_settings_list():
    """docs/command-line.md's Settings table against SETTINGS (flowmatch_assets/defs/settings.py),
    the one list of the resource's fields: each setting's variable is in a row that names its
    field and its default as the list does, and a row naming a field names a listed one."""
    from flowmatch_assets.defs.settings import SETTINGS

    doc = (REPO / "docs" / "command-line.md").read_text()
    settings = doc.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in settings.splitlines()
        if line.startswith("| `FLOWMATCH_")
    ]
    for s in SETTINGS:
        (row,) = [r for r in rows if f"`{s.env}`" in r[0]]
        assert f"`{s.field}`" in row[1], (s.env, row[1])
        assert row[2] == s.default, (s.env, row[2])
    named = {f for r in rows for f in re.findall(r"`(\w+)`", r[1])}
    assert named == {s.field for s in SETTINGS}
