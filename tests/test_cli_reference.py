"""docs/cli.md lists every verb of `flowmatch` with its help, made from the command table
(flowmatch_assets/cli/reference.py): a verb or a flag added without its line there, or an
argument without a help text, fails here."""

from __future__ import annotations

from pathlib import Path

from flowmatch_assets.cli import reference
from flowmatch_assets.cli.commands import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def test_every_argument_of_every_verb_says_what_it_is():
    bare = [(n, f) for n, c in COMMANDS.items() for f, kw in c.args if not kw.get("help")]
    assert bare == []


def test_docs_cli_md_is_current():
    got = (REPO / "docs" / "cli.md").read_text()
    assert got == reference.render(), (
        "docs/cli.md is not current: python -m flowmatch_assets.cli.reference > docs/cli.md"
    )
    assert [ln[len("## flowmatch ") :] for ln in got.splitlines() if ln.startswith("## ")] == list(
        COMMANDS
    )
    for name, c in COMMANDS.items():  # every flag, in its verb's section
        section = got.split(f"## flowmatch {name}\n", 1)[1].split("\n## ", 1)[0]
        for flags, _ in c.args:
            assert all(f in section for f in flags if f.startswith("-")), (name, flags)
    # a verb with its own parser shows that parser's help, e.g. `flowmatch bench`
    assert "flowmatch bench <name> --help" in got
    assert "--json                print JSON instead of a table" in got
