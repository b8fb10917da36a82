"""`flowmatch`'s entry point: parse the line with the command table (``commands.py``), run the
verb, and turn a usage mistake into one line on stderr and exit code 2 (`--debug`: the
traceback); `--verbose` shows Dagster's event log and what the libraries print."""

from __future__ import annotations

import os
import sys

from flowmatch_assets import runs
from flowmatch_assets.cli.commands import COMMANDS, build_parser
from flowmatch_assets.cli.common import CliError


def _setting_message(e: Exception) -> str:
    """One line for a bad FLOWMATCH_* setting (pydantic ValidationError or SettingError)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        err = e.errors()[0]
        field = str(err["loc"][-1]) if err["loc"] else "?"
        from flowmatch_assets.defs.resources import ENV_OF

        var = ENV_OF.get(field, "the FLOWMATCH_* variable that sets it")
        return (
            f"bad setting {var}={err.get('input')!r} ({field}: {err['msg']}); fix that "
            "environment variable"
        )
    return f"bad setting {e}; fix that environment variable"


def _main(argv: list[str]) -> int:
    p = build_parser()
    ns, rest = p.parse_known_args(argv)
    kwargs = vars(ns)
    c = COMMANDS[kwargs.pop("cmd")]
    if c.rest:
        kwargs["argv"] = rest
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(c.run(**kwargs) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the command; a usage mistake is one line on stderr and exit code 2 (`--debug`:
    the traceback too). The runs a verb makes print one line per step; `--verbose` shows
    Dagster's event log too, and what the libraries print that tells a user nothing (their
    progress bars and notices: runs.quiet_dagster, flowmatch_models.train.quiet.quiet_libraries,
    flowmatch_models.encoders.loading.quiet_progress)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    runs.VERBOSE = "--verbose" in argv  # Dagster's event log of the runs a verb makes
    saved: tuple[str, str | None] | None = None
    if runs.VERBOSE:  # this process and the training process it starts (env is inherited)
        from flowmatch_models.encoders.loading import VERBOSE_ENV

        saved = (VERBOSE_ENV, os.environ.get(VERBOSE_ENV))
        os.environ[VERBOSE_ENV] = "1"
    argv = [x for x in argv if x not in ("--debug", "--verbose")]
    verb = next((a for a in argv if not a.startswith("-")), None)
    saved_tags = dict(runs.EXTRA_TAGS)
    if verb:  # every run this verb makes says where it came from (the UI's Tags column)
        runs.EXTRA_TAGS[runs.ORIGIN_TAG] = verb
    try:
        return _main(argv)
    except Exception as e:  # noqa: BLE001 - mapped to one line below, or re-raised
        msg = _one_line(e)
        if msg is None or debug:
            raise
        print(f"flowmatch: {msg} (--debug for the traceback)", file=sys.stderr)
        return 2
    finally:  # as it was (a caller that runs several commands in one process: the tests)
        runs.EXTRA_TAGS.clear()
        runs.EXTRA_TAGS.update(saved_tags)
        if saved is not None and saved[1] is None:
            os.environ.pop(saved[0], None)
        elif saved is not None:
            os.environ[saved[0]] = saved[1]


def _one_line(e: BaseException) -> str | None:
    """The one-line message of a usage mistake, or None for a real bug (traceback)."""
    from pydantic import ValidationError

    from flowmatch_assets.defs.resources import SettingError
    from flowmatch_assets.ingest.metadata import MetadataError
    from flowmatch_assets.ingest.sources import SourceError
    from flowmatch_models.inference.export import ExportError
    from flowmatch_models.storage.remote import RemoteError

    if isinstance(e, CliError | MetadataError | ExportError | SourceError | RemoteError):
        return str(e)  # MetadataError names the folder and FLOWMATCH_METADATA already
    if isinstance(e, ValidationError | SettingError):
        return _setting_message(e)
    from flowmatch_assets.compat import dagster_error_type

    if isinstance(e, dagster_error_type()):
        cause = getattr(e, "user_exception", None) or e.__cause__ or e  # the root cause
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return None


if __name__ == "__main__":
    sys.exit(main())
