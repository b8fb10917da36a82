"""Data assets: raw PD12M shards -> 256px images. Thin wiring over metadata.py and ingest.py."""

import time
from collections import Counter

import dagster as dg
import pyarrow.parquet as pq

from flowmatch_assets import catalog
from flowmatch_assets.catalog import MaterializationRecord, RowOutcome
from flowmatch_assets.deploy import IMAGE_TAGS
from flowmatch_assets.ingest import ingest_rows
from flowmatch_assets.metadata import filter_rows, ids_as_strings, read_shard
from flowmatch_assets.partitions import shard_partitions
from flowmatch_assets.resources import FlowmatchResource
from flowmatch_models.atomic import atomic_path, remove_stale_temps
from flowmatch_models.grid import make_grid, markdown_image, save_png
from flowmatch_models.image_shard import decode, write_image_shard

GROUP = "data"


def _run_id(context: dg.AssetExecutionContext) -> str | None:
    try:
        return context.run.run_id
    except Exception:  # noqa: BLE001 - direct invocation has no run
        return None


@dg.asset(
    partitions_def=shard_partitions,
    group_name=GROUP,
    kinds={"parquet"},
    description="One PD12M shard's metadata rows, validated and filtered (filtered rows counted by reason).",
)
def pd12m_metadata(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    t0 = time.perf_counter()
    part = context.partition_key
    root = flowmatch.data_root
    catalog.clear_partition(root, "pd12m_metadata", part)  # delete-then-write
    table, spec = read_shard(flowmatch.metadata_source, part, flowmatch.shard_size)
    table = ids_as_strings(table)
    kept, filtered = filter_rows(table, flowmatch.filters)
    out = flowmatch.layout.asset_path("pd12m_metadata", part)
    remove_stale_temps(out)
    with atomic_path(out) as tmp:
        pq.write_table(kept, tmp)
    kept_ids = kept.column("id").to_pylist()
    kept_urls = kept.column("url").to_pylist()
    outcomes = [RowOutcome(i, u, "stored") for i, u in zip(kept_ids, kept_urls)]
    outcomes += [
        RowOutcome(f["id"], f["url"], "filtered", f["reason"], f["detail"]) for f in filtered
    ]
    catalog.record_rows(root, "pd12m_metadata", part, outcomes)
    by_reason = dict(Counter(f["reason"] for f in filtered))
    seconds = time.perf_counter() - t0
    size = out.stat().st_size
    catalog.record_materialization(
        root,
        MaterializationRecord(
            asset="pd12m_metadata",
            partition=part,
            samples=kept.num_rows,
            input_rows=table.num_rows,
            raw_bytes=kept.nbytes,
            stored_bytes=size,
            seconds=seconds,
            run_id=_run_id(context),
            extra={
                "source_file": spec.path,
                "row_start": spec.row_start,
                "row_end": spec.row_end,
                "filtered": by_reason,
            },
        ),
    )
    context.log.info(f"{part}: {table.num_rows} rows, kept {kept.num_rows}, filtered {by_reason}")
    return dg.MaterializeResult(
        metadata={
            "input_rows": table.num_rows,
            "kept_rows": kept.num_rows,
            "filtered_rows": len(filtered),
            "filtered_by_reason": dg.MetadataValue.json(by_reason),
            "source_file": spec.path,
            "row_range": f"[{spec.row_start}, {spec.row_end})",
            "path": dg.MetadataValue.path(str(out)),
        }
    )


@dg.asset(
    partitions_def=shard_partitions,
    deps=[pd12m_metadata],
    group_name=GROUP,
    kinds={"parquet", "pillow"},
    op_tags=IMAGE_TAGS,
    description="The shard's images: downloaded, short side 256, centre-cropped 256x256, encoded (JPEG q95); failures recorded with reasons.",
)
def images_256(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    t0 = time.perf_counter()
    part = context.partition_key
    root, layout = flowmatch.data_root, flowmatch.layout
    catalog.clear_partition(root, "images_256", part)
    rows = pq.read_table(layout.asset_path("pd12m_metadata", part)).to_pylist()
    step = max(1, len(rows) // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            rate = done / max(time.perf_counter() - t0, 1e-9)
            context.log.info(f"{part}: {done}/{total} images ({rate:.1f}/s)")

    results = ingest_rows(rows, flowmatch.ingest, progress=progress)
    by_id = {r["id"]: r for r in rows}
    stored = [
        {
            "id": r.id,
            "caption": by_id[r.id]["caption"],
            "image": r.image,
            "format": flowmatch.ingest.image_format,
            "orig_width": r.orig_width,
            "orig_height": r.orig_height,
            "md5": r.md5,
            "url": r.url,
        }
        for r in results
        if r.outcome == "stored"
    ]
    out = layout.asset_path("images_256", part)
    if remove_stale_temps(out):
        context.log.warning(f"{part}: removed the temp files of an earlier, killed run")
    size = write_image_shard(out, stored)
    catalog.record_rows(
        root,
        "images_256",
        part,
        [RowOutcome(r.id, r.url, r.outcome, r.reason, r.detail) for r in results],
    )
    failed = dict(Counter(r.reason for r in results if r.outcome == "failed"))
    seconds = time.perf_counter() - t0
    side = flowmatch.ingest.size
    raw = len(stored) * side * side * 3
    downloaded = sum(getattr(r, "bytes_downloaded", 0) or 0 for r in results)
    grid = make_grid([decode(s["image"]) for s in stored[:64]], cell=96)
    preview = save_png(grid, layout.preview_path("images_256", part))
    catalog.record_materialization(
        root,
        MaterializationRecord(
            asset="images_256",
            partition=part,
            samples=len(stored),
            input_rows=len(rows),
            raw_bytes=raw,
            stored_bytes=size,
            seconds=seconds,
            codec=flowmatch.ingest.image_format,
            device="cpu",
            run_id=_run_id(context),
            extra={"failed": failed, "downloaded_bytes": downloaded},
        ),
    )
    context.log.info(f"{part}: stored {len(stored)}/{len(rows)}, failed {failed}, {seconds:.1f}s")
    return dg.MaterializeResult(
        metadata={
            "input_rows": len(rows),
            "stored": len(stored),
            "failed": len(rows) - len(stored),
            "failed_by_reason": dg.MetadataValue.json(failed),
            "downloaded_bytes": downloaded,
            "stored_bytes": size,
            "images_per_s": round(len(rows) / seconds, 2) if seconds else 0.0,
            "path": dg.MetadataValue.path(str(out)),
            "preview_png": dg.MetadataValue.path(str(preview)),
            "preview": dg.MetadataValue.md(markdown_image(grid, f"images_256 {part}")),
        }
    )


@dg.asset_check(
    asset=images_256,
    description="Every kept metadata row has exactly one outcome; stored images are 256x256 RGB.",
)
def images_256_complete(
    context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
) -> dg.AssetCheckResult:
    layout = flowmatch.layout
    parts = run_partitions(context) or layout.partitions_with("images_256")
    problems = []
    for p in parts:
        md_ids = set(
            pq.read_table(layout.asset_path("pd12m_metadata", p), columns=["id"])
            .column("id")
            .to_pylist()
        )
        rows_file = layout.catalog_dir / "rows" / "images_256" / f"{p}.parquet"
        if not rows_file.exists():
            problems.append(f"{p}: no outcome records")
            continue
        outcome_ids = pq.read_table(rows_file, columns=["id"]).column("id").to_pylist()
        if sorted(outcome_ids) != sorted(md_ids):
            problems.append(f"{p}: {len(outcome_ids)} outcomes for {len(md_ids)} rows")
        t = pq.read_table(layout.asset_path("images_256", p), columns=["image"])
        if t.num_rows:
            im = decode(t.column("image")[0].as_py())
            if im.shape != (flowmatch.ingest.size, flowmatch.ingest.size, 3):
                problems.append(f"{p}: image shape {im.shape}")
    return dg.AssetCheckResult(
        passed=not problems,
        metadata={
            "partitions_checked": len(parts),
            "problems": dg.MetadataValue.json(problems[:20]),
        },
    )


def run_partitions(context: dg.AssetCheckExecutionContext) -> list[str]:
    """The partition(s) of the run the check executes in (empty: check every partition)."""
    tags = context.run.tags if context.run else {}
    if "dagster/partition" in tags:
        return [tags["dagster/partition"]]
    return []
