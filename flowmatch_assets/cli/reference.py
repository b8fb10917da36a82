"""docs/cli.md, made from the command table itself: every verb of `flowmatch` with its help,
as `flowmatch <verb> --help` prints it (the same call, so the two cannot differ).

A newcomer looks here before adding a flag: the one they want may exist (``--json`` on
catalog, data-card, stale and budget, say). The file is generated
(``python -m flowmatch_assets.cli.reference > docs/cli.md``) and tests/test_cli_reference.py
fails when it is not current.
"""

from __future__ import annotations

import contextlib
import io
import os

HEADER = """# Every verb of `flowmatch`

Generated from the command table (`flowmatch_assets/cli/commands.py`) by
`python -m flowmatch_assets.cli.reference > docs/cli.md` (`tests/test_cli_reference.py`
fails when this file is not current): each verb's `--help`. What the verbs are for, with
examples: docs/command-line.md. Every verb also takes `--verbose` and `--debug`.
"""


def verb_help(name: str) -> str:
    """What `flowmatch NAME --help` prints (80 columns, whoever runs it)."""
    from flowmatch_assets.cli.main import main

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([name, "--help"])
        return out.getvalue()
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def render() -> str:
    from flowmatch_assets.cli.commands import COMMANDS

    lines = [HEADER]
    for name, c in COMMANDS.items():
        what = c.help[0].upper() + c.help[1:]
        lines += [f"## flowmatch {name}", "", what + ("" if what.endswith(".") else "."), ""]
        lines += ["```text", verb_help(name).rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
