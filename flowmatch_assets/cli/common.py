"""What every verb shares: the one-line usage error, the Dagster instance and the resource of the environment."""

from __future__ import annotations

from flowmatch_assets import runs
from flowmatch_assets.runs import UsageError

CliError = UsageError  # a usage mistake: one line, exit code 2 (the library raises it too)


def dagster_instance():
    return runs.instance()


def flowmatch_resource(overrides: dict | None = None):
    """The settings of a verb (bad ones: see _one_line), its remote data root synced first."""
    import sys

    from flowmatch_assets.defs.resources import synced

    return synced(runs.resource(overrides), lambda line: print(line, file=sys.stderr))
