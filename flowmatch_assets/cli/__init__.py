"""`flowmatch`: the command table (:data:`commands.COMMANDS`) and its thin verbs over the library
(:mod:`flowmatch_assets.runs`); the verbs whose module has its own parser (budget, backfill, bench,
sample, zoo) take the rest of the line."""

from flowmatch_assets.cli.common import CliError
from flowmatch_assets.cli.main import main

__all__ = ["CliError", "main"]
