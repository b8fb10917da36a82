"""`flowmatch`: the command line of the pipeline (demo-data, partitions, materialize, retry, verify, demo, catalog, bench, ...).

One table, :data:`COMMANDS`: a verb -> the function that runs it and its arguments; the function
takes them as typed keyword arguments and lives in the module of its concern (``data.py``,
``training.py``, ``reports.py``; ``common.py`` what they share). Adding a verb is one entry
here and one function there. Verbs whose
module has its own parser (demo-data, zoo, budget, backfill, bench) take the rest of the line as
``argv``. The verbs are thin: the work is a library function (:mod:`flowmatch_assets.runs` for
what runs the asset graph, else the folder of the concern), which the tests and the demo call too.
Settings come from the same FLOWMATCH_* environment variables as `dagster dev`
(``defs.resources.resource_from_env``), and runs are recorded in the Dagster instance at
DAGSTER_HOME, so what the CLI materializes shows up in the UI. A verb prints its answer and one
progress line per step; `--verbose` adds Dagster's event log. A usage mistake (unknown partition
or asset, bad setting, no metadata, ...) is one line naming the problem and the fix, exit code 2;
`--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from flowmatch_assets import runs
from flowmatch_assets.cli.common import CliError
from flowmatch_assets.cli.data import (
    cmd_demo_data,
    cmd_materialize,
    cmd_partitions,
    cmd_retry,
    cmd_sources,
    cmd_stale,
    cmd_upgrade,
    cmd_verify,
)
from flowmatch_assets.cli.demo import cmd_demo
from flowmatch_assets.cli.reports import (
    cmd_backfill,
    cmd_bench,
    cmd_budget,
    cmd_catalog,
    cmd_data_card,
    cmd_zoo,
)
from flowmatch_assets.cli.training import (
    cmd_evaluate,
    cmd_export,
    cmd_finetune,
    cmd_ledger,
    cmd_train,
)


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


def arg(*flags: str, **kw) -> tuple[tuple[str, ...], dict]:
    """One argument of a verb, as ``argparse.add_argument`` takes it."""
    return flags, kw


@dataclass(frozen=True)
class Command:
    """A verb: the function that runs it (called with the parsed arguments by name), its help,
    its arguments, and whether the rest of the line goes to the function as ``argv``."""

    run: Callable[..., int]
    help: str
    args: list[tuple[tuple[str, ...], dict]] = field(default_factory=list)
    rest: bool = False


PARTITION = arg("--partition", "-p", action="append", default=[], help="partition key (repeatable)")

COMMANDS: dict[str, Command] = {
    "demo-data": Command(cmd_demo_data, "write the demo dataset (PD12M format)", rest=True),
    "upgrade": Command(
        cmd_upgrade,
        "carry a data root and Dagster instance made before the asset renames over (once)",
    ),
    "partitions": Command(
        cmd_partitions,
        "list or register the partitions of PD12M and of your own image sources",
        [
            arg("action", choices=["list", "register", "remove"], nargs="?", default="list"),
            arg("--source", default=None, help="only this source (a name, or pd12m)"),
            arg(
                "--partition",
                "-p",
                action="append",
                default=[],
                help="remove: a key with no data behind it (repeatable)",
            ),
            arg(
                "--orphans",
                action="store_true",
                help="remove: every key with no data behind it (ORPHAN in list)",
            ),
        ],
    ),
    "sources": Command(
        cmd_sources,
        "your own images as sources: image folders, Hugging Face parquet, WebDataset tars, URL lists",
        [
            arg("action", choices=["list", "add", "remove"], nargs="?", default="list"),
            arg(
                "name", nargs="?", help="add/remove: the source's name (starts its partition keys)"
            ),
            arg(
                "--kind",
                default=None,
                help="folder, parquet, webdataset or urls (ingest/sources/config.py SOURCE_KINDS)",
            ),
            arg("--location", default=None, help="a folder or an fsspec URL"),
            arg(
                "--caption-field",
                default=None,
                help="folder: metadata.jsonl key (text); parquet: column (text); webdataset: "
                "member extension or .json key (txt); urls: column (caption)",
            ),
            arg("--shard-size", type=int, default=None, help="samples per partition (1000)"),
            arg("--image-field", default=None, help="parquet: the image column (image)"),
            arg("--id-field", default=None, help="parquet, urls: a column naming each row"),
            arg("--url-field", default=None, help="urls: the column of image URLs (url)"),
            arg("--hash-field", default=None, help="urls: a column of md5s to check (none)"),
            arg("--license", default=None, help="recorded for every image"),
            arg("--deadline-s", type=float, default=None, help="remote reads' limit (600 s)"),
            arg(
                "--follow-links",
                action="store_true",
                help="read files through links that leave the location (off: outside_source)",
            ),
            arg(
                "--replace",
                action="store_true",
                help="add: give an existing source these settings (its partitions keep their "
                "samples)",
            ),
            arg(
                "--allow-missing",
                action="store_true",
                help="add: a location that does not exist yet",
            ),
            arg(
                "--purge",
                action="store_true",
                help="remove: also delete what was made from its partitions (shards, records)",
            ),
        ],
    ),
    "materialize": Command(
        cmd_materialize,
        "materialize assets for partitions, in-process",
        [
            PARTITION,
            arg(
                "--asset",
                "-a",
                action="append",
                default=[],
                help="asset name (repeatable; default all partitioned)",
            ),
            arg(
                "--missing",
                action="store_true",
                help="only asset partitions that are missing (file gone or corrupt, no catalog "
                "record, or not materialized in Dagster)",
            ),
            arg(
                "--stale",
                action="store_true",
                help="only asset partitions that are stale (`flowmatch stale`): made with "
                "other settings than the current ones, or from a stale or re-made upstream",
            ),
            arg(
                "--source",
                action="append",
                default=[],
                help="every partition of this source (repeatable; pd12m or a source name)",
            ),
        ],
    ),
    "retry": Command(
        cmd_retry,
        "re-fetch retryable failed images and merge them into their shards",
        [
            PARTITION,
            arg(
                "--reason",
                "-r",
                action="append",
                default=[],
                help="failure reason to re-fetch (repeatable; default: every retryable one)",
            ),
        ],
    ),
    "verify": Command(
        cmd_verify,
        "find shards that are gone or corrupt; make the catalog and Dagster say missing",
        [PARTITION, arg("--quick", action="store_true", help="headers only, no checksums")],
    ),
    "train": Command(
        cmd_train,
        "materialize flow_model (+ samples): start or resume training",
        [
            arg("--steps", type=int, default=None, help="total steps (default: the YAML's)"),
            arg("--run-name", default="default"),
            arg("--config", default=None, help="training YAML (default configs/tiny.yaml)"),
            arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"),
            arg("--no-samples", action="store_true"),
            arg(
                "--source",
                action="append",
                default=[],
                help="train on this source's partitions (repeatable; default every source)",
            ),
            arg(
                "--min-coverage",
                type=float,
                default=1.0,
                help="fraction of the (chosen sources') partitions that must be covered",
            ),
        ],
    ),
    "finetune": Command(
        cmd_finetune,
        "materialize fine_tune: a new run from another run's weights, on chosen sources",
        [
            arg("run", help="the fine-tune's run name (its own folder under <data root>/runs)"),
            arg("--from", dest="parent", required=True, help="the parent run (name or folder)"),
            arg("--step", type=int, default=None, help="the parent's step (default: latest)"),
            arg("--weights", choices=["ema", "raw"], default="ema"),
            arg(
                "--freeze",
                action="append",
                default=[],
                metavar="PREFIX",
                help="keep these parameters fixed (e.g. transformer.caption_projection)",
            ),
            arg(
                "--source",
                action="append",
                default=[],
                help="train on this source's partitions (repeatable; default all)",
            ),
            arg(
                "--weight",
                action="append",
                default=[],
                metavar="SOURCE=N",
                help="take SOURCE's partitions N times per epoch (repeatable)",
            ),
            arg("--steps", type=int, default=None, help="total steps (default 500)"),
            arg("--config", default=None, help="training YAML (default configs/tiny.yaml)"),
            arg("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"),
            arg(
                "--min-coverage",
                type=float,
                default=1.0,
                help="fraction of the chosen sources' partitions that must be covered",
            ),
            arg("--no-samples", action="store_true"),
        ],
    ),
    "export": Command(
        cmd_export,
        "a run's EMA weights as a diffusers SanaPipeline folder",
        [
            arg("run", help="run name (under <data root>/runs) or run folder"),
            arg("out", help="the pipeline folder to write"),
            arg("--checkpoint", default=None, help="a .ckpt (default: the run's last.ckpt)"),
            arg("--vae", default=None, help="VAE folder/hub id (default: the run's)"),
            arg("--text", default=None, help="text encoder folder/hub id (default: the run's)"),
        ],
    ),
    "ledger": Command(
        cmd_ledger,
        "which samples each checkpoint of a run trained (catalog: ledger_samples, ...)",
        [arg("run", help="run name (under <data root>/runs) or run folder")],
    ),
    "evaluate": Command(
        cmd_evaluate,
        "score caption following of a run's checkpoints (evaluation asset)",
        [
            arg("--run-name", default="default"),
            arg("--checkpoints", choices=["latest", "all"], default="latest"),
            arg("--prompts", type=int, default=48, help="prompts from the caption grammar"),
            arg(
                "--sizes",
                nargs="+",
                default=None,
                metavar="HxW",
                help="generate at these sizes, e.g. 256x256 224x320 320x224 (default: the square)",
            ),
        ],
    ),
    "demo": Command(
        cmd_demo,
        "write the demo dataset and materialize every partition end to end",
        [
            arg("--data-root", default="data"),
            arg("--files", type=int, default=3),
            arg("--rows-per-file", type=int, default=96),
            arg("--regenerate", action="store_true"),
            arg(
                "--train-steps",
                type=int,
                default=None,
                help="tiny DiT steps (default: configs/tiny.yaml's; 0: no training)",
            ),
            arg(
                "--text",
                choices=("real", "random"),
                default="real",
                help="caption encoder: the real Gemma3-270M (default; made once from the PyPI "
                "GGUF) or the zoo's random Gemma3",
            ),
        ],
    ),
    "catalog": Command(
        cmd_catalog,
        "reports from the DuckDB catalog (sizes: disk bytes per asset), or raw SQL",
        [
            arg(
                "report",
                choices=[
                    "coverage",
                    "summary",
                    "failures",
                    "compression",
                    "throughput",
                    "sizes",
                    "sql",
                    "path",
                    "views",
                ],
            ),
            arg(
                "sql",
                nargs="?",
                help="SQL for `catalog sql` (`flowmatch catalog views` lists the views)",
            ),
            arg("--json", dest="as_json", action="store_true"),
        ],
    ),
    "data-card": Command(
        cmd_data_card,
        "the data card: caption lengths, sizes, licenses, outcomes, text saturation",
        [
            arg("-p", "--partition", action="append", default=[], help="only these (repeatable)"),
            arg(
                "--no-refresh",
                dest="refresh",
                action="store_false",
                help="print from the records as they are (materialize nothing)",
            ),
            arg("--json", dest="as_json", action="store_true"),
        ],
    ),
    "stale": Command(
        cmd_stale,
        "stale asset partitions and training runs, with the settings that changed",
        [
            PARTITION,
            arg(
                "--asset",
                "-a",
                action="append",
                default=[],
                help="asset name (repeatable; default every partitioned asset and flow_model)",
            ),
            arg("--json", dest="as_json", action="store_true"),
            arg(
                "--no-report",
                action="store_true",
                help="do not report the <asset>_fresh check results to Dagster",
            ),
        ],
    ),
    "zoo": Command(
        cmd_zoo,
        "offline models: `create DEST` (tiny random zoo) or `gemma [DIR]` (the REAL Gemma3-270M)",
        rest=True,
    ),
    "budget": Command(cmd_budget, "time, cost, energy and disk for PD12M and N updates", rest=True),
    "backfill": Command(
        cmd_backfill,
        "launch a backfill (--missing) through the running webserver's GraphQL",
        rest=True,
    ),
    "bench": Command(
        cmd_bench,
        "benchmarks: images, store, loader, precalc, train, orchestration, learning, ...",
        [arg("which", nargs="?", help="the benchmark (flowmatch bench --help lists them)")],
        rest=True,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowmatch", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, c in COMMANDS.items():
        # a verb that hands on the rest of the line leaves --help to its module
        s = sub.add_parser(name, help=c.help, add_help=not c.rest)
        for flags, kw in c.args:
            s.add_argument(*flags, **kw)
    return p


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
    progress bars and notices: runs.quiet_dagster, flowmatch_models.train.run.quiet_libraries,
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
