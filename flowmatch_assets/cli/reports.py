"""The verbs that report and measure: catalog, data-card, budget, backfill, zoo, bench."""

from __future__ import annotations

import json
from pathlib import Path

from flowmatch_assets import runs
from flowmatch_assets.cli.common import CliError, flowmatch_resource


def cmd_catalog(
    report: str,
    sql: str | None,
    as_json: bool,
    threshold: int | None = None,
    min_cosine: float | None = None,
    colour_tolerance: int | None = None,
) -> int:
    from flowmatch_assets.catalog import Catalog, format_table, view_names

    if report == "views":
        print("\n".join(view_names()))
        return 0
    cat = Catalog(flowmatch_resource().data_root)
    if report == "neardup":
        return _neardup(cat, threshold, as_json, min_cosine, colour_tolerance)
    if report == "path":
        print(cat.ensure())
        return 0
    if report == "sql":
        if not sql:
            raise CliError(
                'catalog sql needs the SQL: flowmatch catalog sql "SELECT * FROM coverage"'
            )
        import duckdb

        try:
            rows = cat.query(sql)
        except duckdb.Error as e:
            first = str(e).strip().splitlines()[0]
            raise CliError(
                f"the catalog rejected the SQL: {first}; views: {', '.join(view_names())}"
            ) from e
    else:
        rows = {
            "coverage": cat.coverage,
            "summary": cat.coverage_summary,
            "failures": cat.failures_by_reason,
            "compression": cat.compression,
            "throughput": cat.throughput,
            "sizes": cat.sizes,
        }[report]()
    if report == "sizes" and not as_json:  # one line per asset, in human units
        from flowmatch_assets.defs.routine import human_bytes

        width = max((len(r["asset"]) for r in rows), default=0)
        for r in rows:
            print(f"{r['asset']:<{width}}  {human_bytes(r['bytes'] or 0):>10}")
        return 0
    if as_json:
        print(json.dumps(rows, default=str, indent=1))
    else:
        print(format_table(rows))
    return 0


def _neardup(
    cat,
    threshold: int | None,
    as_json: bool,
    min_cosine: float | None = None,
    colour_tolerance: int | None = None,
) -> int:
    """`flowmatch catalog neardup`: :func:`decide_near_duplicates`, printed."""
    from flowmatch_assets.catalog import format_table

    rows = decide_near_duplicates(cat, threshold, min_cosine, colour_tolerance)
    print(json.dumps(rows, indent=1) if as_json else format_table([rows]))
    return 0


def decide_near_duplicates(
    cat,
    threshold: int | None = None,
    min_cosine: float | None = None,
    colour_tolerance: int | None = None,
) -> dict:
    """Hash the images partitions not hashed yet (or rewritten since), decide the near
    duplicates at ``threshold`` bits and ``colour_tolerance`` over every partition (and, with
    ``min_cosine``, by their DINOv2 CLS), draw the pairs picture; return how many there are
    (`catalog neardup` prints it, the demo calls it before training)."""
    from flowmatch_assets.ingest import neardup
    from flowmatch_assets.ingest.neardup_colour import check_tolerance

    t = threshold if threshold is not None else neardup.DEFAULT_THRESHOLD
    tol = neardup.DEFAULT_COLOUR_TOLERANCE if colour_tolerance is None else colour_tolerance
    try:
        tol = check_tolerance(tol)
    except ValueError as e:
        raise CliError(str(e)) from None
    parts = [
        r["partition"]
        for r in cat.query(
            "SELECT DISTINCT partition FROM materializations WHERE asset = 'images' ORDER BY 1"
        )
    ]
    for p in parts:
        neardup.phash_partition(cat.layout.root, p)
    near = neardup.write_near_duplicates(cat.layout.root, t, parts, min_cosine, tol)
    rows = cat.query(
        """SELECT count(*) FILTER (WHERE outcome = 'stored') AS kept,
                  count(*) FILTER (WHERE reason = 'near_duplicate') AS near_duplicates,
                  count(*) FILTER (WHERE reason = 'duplicate_content') AS content_duplicates
           FROM dataset_rows"""
    )[0]
    settings = {"threshold": t, "colour_tolerance": tol, "min_cosine": min_cosine}
    rows = {**settings, "partitions": len(parts), **rows}
    rows["near_fraction"] = round(near.num_rows / max(1, rows["kept"] + near.num_rows), 6)
    detectors = near.column("detector").to_pylist()
    rows["detectors"] = {d: detectors.count(d) for d in sorted(set(detectors))}
    picture, _ = neardup.pairs_picture(cat.layout.root, near)
    rows["pairs_png"] = str(picture) if picture else None
    return rows


def print_reports(data_root: str) -> None:
    from flowmatch_assets.catalog import Catalog, format_table

    cat = Catalog(data_root)
    for title, rows in (
        ("Coverage (samples per partition and asset)", cat.coverage()),
        ("Failures and filtered rows by reason", cat.failures_by_reason()),
        ("Compression", cat.compression()),
        ("Throughput", cat.throughput()),
    ):
        print(f"\n## {title}\n{format_table(rows)}")


def cmd_data_card(partition: list[str], refresh: bool, as_json: bool) -> int:
    """Materialize ``data_card`` for ``partition`` (default: every partition with metadata)
    and ``dataset_card``; print the whole dataset's card (``--no-refresh``: from the records)."""
    from flowmatch_assets.defs.data_card_assets import write_dataset_card

    res = flowmatch_resource()
    if refresh:
        runs.materialize_data_cards(partition or None, res)
    md_path, png_path, _, view = write_dataset_card(res.data_root)
    if as_json:
        print(json.dumps(view, default=str, indent=1))
    else:
        print(Path(md_path).read_text())
    print(f"card: {md_path} and {png_path}")
    return 0


def cmd_zoo(argv: list[str]) -> int:
    from flowmatch_models.encoders.zoo import main

    return int(main(argv) or 0)


def cmd_budget(argv: list[str]) -> int:
    from flowmatch_assets.cli.budget import main

    return main(argv)


def cmd_backfill(argv: list[str]) -> int:
    from flowmatch_assets.defs.resources import resource_from_env
    from flowmatch_assets.freshness.backfill import main

    return main(argv, resource_from_env)


def cmd_bench(which: str | None, argv: list[str]) -> int:
    """`flowmatch bench NAME [options]`: runs flowmatch_assets.bench.NAME (see its --help)."""
    import importlib

    from flowmatch_assets.bench import BENCHES

    if which in (None, "-h", "--help"):
        print("usage: flowmatch bench {" + ",".join(sorted(BENCHES)) + "} [options]")
        print("  flowmatch bench <name> --help   shows that benchmark's options")
        return 0
    if which not in BENCHES:
        raise CliError(f"unknown benchmark {which!r}; choose one of {', '.join(sorted(BENCHES))}")
    importlib.import_module(BENCHES[which]).main(argv)
    return 0
