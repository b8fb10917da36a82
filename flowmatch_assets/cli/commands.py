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
from collections.abc import Callable
from dataclasses import dataclass, field

from flowmatch_assets.cli.data import (
    cmd_cache,
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


SET = arg(
    "--set",
    dest="overrides",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="one key of the YAML, e.g. trainer.max_steps=100 (repeatable; docs/settings.md)",
)
NO_SAMPLES = arg("--no-samples", action="store_true", help="the weights only (no samples asset)")
JSON = arg("--json", dest="as_json", action="store_true", help="print JSON instead of a table")
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
            arg(
                "action",
                choices=["list", "register", "remove"],
                nargs="?",
                default="list",
                help="list (NEW and ORPHAN keys), register the new ones, or remove keys",
            ),
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
            arg(
                "action",
                choices=["list", "add", "remove"],
                nargs="?",
                default="list",
                help="list the sources, add one (NAME and the options below) or remove one",
            ),
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
            arg("--run-name", default="default", help="the run: <data root>/runs/<name> (resumed)"),
            arg("--config", default=None, help="training YAML (default configs/tiny.yaml)"),
            SET,
            NO_SAMPLES,
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
            arg(
                "--weights",
                choices=["ema", "raw"],
                default="ema",
                help="the parent's EMA or raw weights",
            ),
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
            SET,
            arg(
                "--min-coverage",
                type=float,
                default=1.0,
                help="fraction of the chosen sources' partitions that must be covered",
            ),
            NO_SAMPLES,
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
            arg("--run-name", default="default", help="the run whose checkpoints are scored"),
            arg(
                "--checkpoints",
                choices=["latest", "all"],
                default="latest",
                help="its last checkpoint, or every EMA snapshot (a curve)",
            ),
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
            arg("--data-root", default="data", help="where the demo writes everything"),
            arg("--files", type=int, default=3, help="metadata files (partitions) of the sample"),
            arg("--rows-per-file", type=int, default=96, help="rows per metadata file"),
            arg("--regenerate", action="store_true", help="write the sample again"),
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
                    "neardup",
                    "sql",
                    "path",
                    "views",
                ],
                help="which report (docs/catalog.md describes each)",
            ),
            arg(
                "sql",
                nargs="?",
                help="SQL for `catalog sql` (`flowmatch catalog views` lists the views)",
            ),
            arg(
                "--threshold",
                type=int,
                default=None,
                help="`catalog neardup`: the pHash bits two images may differ in and still be "
                "near duplicates (default 10); re-decides the near duplicates only",
            ),
            arg(
                "--colour-tolerance",
                type=int,
                default=None,
                help="`catalog neardup`: the most the mean of the 4 largest cell differences "
                "of the two images' 4x4 colour signatures (YCbCr Cb, Cr, 0-255) may be for a "
                "pHash match to count (default 10; 255: the pHash alone); re-decides the near "
                "duplicates only",
            ),
            arg(
                "--min-cosine",
                type=float,
                default=None,
                help="`catalog neardup`: also call a row a near duplicate when its DINOv2 CLS "
                "(dino_features) has at least this cosine with an earlier kept row's (off by "
                "default; e.g. 0.95)",
            ),
            JSON,
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
            JSON,
        ],
    ),
    "cache": Command(
        cmd_cache,
        "this machine's cache of the remote data root (FLOWMATCH_REMOTE): show, or trim it",
        [
            arg("action", nargs="?", default="show", choices=["show", "trim"], help="default show"),
            arg("--max-gb", type=float, default=None, help="trim: keep at most this many GB"),
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
            JSON,
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
