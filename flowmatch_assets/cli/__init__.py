"""`flowmatch`: the command table (:data:`commands.COMMANDS`) and its thin verbs over the library
(:mod:`flowmatch_assets.runs`); the verbs whose module has its own parser (budget, backfill, bench,
sample, zoo) take the rest of the line."""

from flowmatch_assets.cli.commands import main
from flowmatch_assets.cli.common import CliError

__all__ = ["CliError", "main"]
