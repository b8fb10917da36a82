"""Data assets: raw shards -> 256px images, publishing what ``ingest/`` makes (a partition's
source lists its rows and says how its images are read: ``sources/``, PD12M's in
``sources/urls.py``; ``shard.py`` makes the images)."""

import time
import warnings
from collections import Counter
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
from pydantic import Field

from flowmatch_assets import catalog
from flowmatch_assets.catalog import RowOutcome
from flowmatch_assets.defs.deploy import IMAGE_TAGS
from flowmatch_assets.defs.partitions import shard_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.routine import (
    PartitionOutput,
    human_bytes,
    run_partitions,
    shards_check_result,
)
from flowmatch_assets.freshness import fingerprints
from flowmatch_assets.freshness.state import DATA_CHECKS
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_assets.ingest.metadata import MetadataError, filter_rows
from flowmatch_assets.ingest.shard import NothingToRetry, TooFewStored, make_image_shard
from flowmatch_assets.ingest.sources import SourceError, partition_source
from flowmatch_models.figures.grid import make_grid, markdown_image, save_png
from flowmatch_models.storage import remote
from flowmatch_models.storage.atomic import atomic_path, write_parquet
from flowmatch_models.storage.fingerprint import rows_digest
from flowmatch_models.storage.image_shard import decode, read_image_meta, write_image_shard
from flowmatch_models.storage.layout import source_of

GROUP = "data"


@dg.asset(
    partitions_def=shard_partitions,
    group_name=GROUP,
    kinds={"parquet"},
    description="One shard's rows, validated and filtered: a PD12M metadata shard, or a "
    "partition of your own images (folder, parquet, WebDataset, URL list) listed with its captions; "
    "filtered and failed rows counted by reason.",
)
def metadata(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Read the partition's rows (its metadata file's, or its source's), filter them, store the
    kept ones."""
    with PartitionOutput(context, flowmatch, "metadata") as out:
        return _metadata(context, flowmatch, out)


def _metadata(context, flowmatch: FlowmatchResource, out: PartitionOutput) -> dg.MaterializeResult:
    t0 = time.perf_counter()
    try:
        source = partition_source(flowmatch, out.partition)
        table, failed, extra = source.rows(out.partition, context.log.info)
    except MetadataError as e:
        if (failure := orphan_failure(flowmatch, out.partition, e)) is e:
            raise  # the key matches data: a real read error, with its trace
        raise failure from None  # one line that names the fix (the read error is in it)
    except SourceError as e:  # not configured (any more), unreadable: one line, the fix
        raise dg.Failure(str(e)) from e
    winners = extra.pop("winners", None)
    kept, filtered = filter_rows(table, flowmatch.filters, winners)
    with atomic_path(out.path) as tmp:
        write_parquet(kept, tmp)
    outcomes = [
        RowOutcome(i, u, "stored")
        for i, u in zip(kept.column("id").to_pylist(), kept.column("url").to_pylist())
    ]
    outcomes += [
        RowOutcome(f["id"], f["url"], "filtered", f["reason"], f["detail"]) for f in filtered
    ]
    outcomes += [RowOutcome(f["id"], f["url"], "failed", f["reason"], f["detail"]) for f in failed]
    by_reason = dict(Counter(f["reason"] for f in filtered))
    failed_by_reason = dict(Counter(f["reason"] for f in failed))
    dups = [f for f in filtered if f["reason"] == "duplicate_hash"]
    catalog.record_duplicates(flowmatch.data_root, "metadata", out.partition, "hash", dups)
    input_rows = table.num_rows + len(failed)
    context.log.info(
        f"{out.partition}: {input_rows} rows, kept {kept.num_rows}, filtered {by_reason}"
        + (f", failed {failed_by_reason}" if failed else "")
    )
    return out.publish(
        samples=kept.num_rows,
        rows=outcomes,
        seconds=time.perf_counter() - t0,
        input_rows=input_rows,
        raw_bytes=kept.nbytes,
        extra={**extra, "filtered": by_reason, "failed": failed_by_reason},
        metadata={
            "input_rows": input_rows,
            "kept_rows": kept.num_rows,
            "filtered_rows": len(filtered),
            "filtered_by_reason": dg.MetadataValue.json(by_reason),
            "failed_rows": len(failed),
            "failed_by_reason": dg.MetadataValue.json(failed_by_reason),
            "source": source_of(out.partition),
            "source_file": extra["source_file"],
            "row_range": f"[{extra['row_start']}, {extra['row_end']})",
        },
    )


def orphan_failure(flowmatch: FlowmatchResource, key: str, error: Exception) -> Exception:
    """The failure of a partition key with no data behind it (added by hand in the UI's
    Materialize dialog, or its source removed): one line that names the fix, not retried.
    ``error`` itself when the key does match data (a real read error)."""
    from flowmatch_assets.defs.partitions import discover

    if any(p["partition"] == key for p in discover(flowmatch).partitions):
        return error
    return dg.Failure(
        description=f"partition {key} has no data behind it ({error}); remove it with "
        f"`flowmatch partitions remove --orphans` (or `-p {key}`)",
        allow_retries=False,
    )


class ImagesConfig(dg.Config):
    """How one images materialization treats the partition's existing shard."""

    retry: bool = Field(
        default=False,
        description="Re-fetch only the shard's failed rows (retryable reasons, or `reasons`) and "
        "merge the new images into the existing shard; the other rows are not fetched again.",
    )
    reasons: list[str] | None = Field(
        default=None,
        description="With retry: the failure reasons to re-fetch (None: every retryable one).",
    )


@dg.asset(
    partitions_def=shard_partitions,
    deps=[metadata],
    group_name=GROUP,
    kinds={"parquet", "pillow"},
    op_tags=IMAGE_TAGS,
    description="The shard's images: downloaded (or read from their source), resized and centre-cropped to 256x256 (or, with ingest.buckets: aspect, to the nearest aspect-ratio bucket of ~256x256 pixels), encoded (JPEG q95); failures recorded with reasons.",
)
def images(
    context: dg.AssetExecutionContext, config: ImagesConfig, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Fetch and encode the partition's images (ingest/shard.py) and publish the shard. A run
    that stores fewer than ``ingest.min_stored_fraction`` of the kept rows fails and replaces
    nothing (the previous shard and its catalog records stay; its failures go to
    ``rejected_attempts``). With ``retry`` only the failed rows are fetched again and merged
    into the shard, in order. The shard, its content and duplicate records, its preview and its
    catalog records are published together, or (a failure anywhere) none of them."""
    with PartitionOutput(context, flowmatch, "images") as out:
        return _images(context, config, flowmatch, out)


def _images(
    context, config: ImagesConfig, flowmatch: FlowmatchResource, out: PartitionOutput
) -> dg.MaterializeResult:
    t0 = time.perf_counter()
    part, root = out.partition, flowmatch.data_root
    rows = pq.read_table(remote.ensure(flowmatch.layout.asset_path("metadata", part))).to_pylist()

    def progress(done: int, total: int) -> None:
        if done % max(1, total // 10) == 0 or done == total:
            rate = done / max(time.perf_counter() - t0, 1e-9)
            context.log.info(f"{part}: {done}/{total} images ({rate:.1f}/s)")

    try:  # None: each row's url is downloaded; else the source reads the bytes (a file, ...)
        read = partition_source(flowmatch, part).reader(part, flowmatch.ingest.max_bytes)
    except SourceError as e:
        raise dg.Failure(str(e)) from e
    try:
        shard = make_image_shard(
            rows,
            root,
            part,
            out.path,
            flowmatch.ingest,
            flowmatch.filters,
            retry=config.retry,
            reasons=config.reasons,
            progress=progress,
            log=context.log.info,
            read=read,
        )
    except NothingToRetry as e:
        raise dg.Failure(str(e)) from e
    except TooFewStored as e:
        raise _rejected(out, e) from e
    write_image_shard(out.path, shard.stored)
    catalog.record_content(root, part, shard.content)
    catalog.record_duplicates(root, "images", part, "content", shard.dropped)
    seconds = time.perf_counter() - t0
    grid = make_grid([decode(s["image"]) for s in shard.stored[:64]], cell=96)
    preview = save_png(grid, flowmatch.layout.preview_path("images", part))
    record_seconds, extra = shard.record(seconds)
    context.log.info(f"{part}: {shard.summary(seconds)}")
    ids, captions = [s["id"] for s in shard.stored], [s["caption"] for s in shard.stored]
    fp = fingerprints.current(flowmatch, "images", part).with_rows(
        ids=rows_digest(ids), captions=rows_digest(ids, captions)
    )  # what each embedding kind reads of it (EmbeddingKind inputs)
    return out.publish(
        samples=len(shard.stored),
        rows=shard.outcomes,
        seconds=record_seconds,
        fingerprint=fp,
        input_rows=len(rows),
        raw_bytes=sum(s["height"] * s["width"] * 3 for s in shard.stored),
        codec=flowmatch.ingest.image_format,
        device="cpu",
        extra=extra,
        metadata={
            "input_rows": len(rows),
            "stored": len(shard.stored),
            # as `flowmatch catalog failures` counts them: failed (a fetch or decode that went
            # wrong: retryable or not) apart from filtered (dropped on purpose: duplicates)
            "failed": sum(1 for r in shard.outcomes if r.outcome == "failed"),
            "failed_by_reason": dg.MetadataValue.json(shard.failed),
            "filtered": sum(1 for r in shard.outcomes if r.outcome == "filtered"),
            "duplicate_content": len(shard.dropped),
            "buckets": dg.MetadataValue.json(shard.buckets),
            # the mean fraction of each original image that was kept by the crop (1.0: nothing
            # cropped; a 4:3 original center-cropped to a square keeps 0.75)
            "kept_mean": round(shard.kept_mean, 4),
            "downloaded_bytes": shard.downloaded_bytes,  # this run's (catalog: all runs')
            "downloaded_size": human_bytes(shard.downloaded_bytes),
            "stored_bytes": out.written().stat().st_size,
            "stored_size": human_bytes(out.written().stat().st_size),
            "images_per_s": round(shard.fetched / seconds, 1) if seconds else 0.0,
            "preview_png": dg.MetadataValue.path(str(preview)),
            "preview": dg.MetadataValue.md(markdown_image(grid, f"images {part}")),
            **shard.run_metadata(),
        },
    )


def _rejected(out: PartitionOutput, e: TooFewStored) -> dg.Failure:
    """Record the rejected attempt (replacing nothing); the failure names why and the fix."""
    out.reject(e.attempt)
    kept_note = (
        f"the previous shard ({out.path.name}) and its catalog records are unchanged"
        if out.path.exists()
        else "no shard written"
    )
    return dg.Failure(
        f"{e}; {kept_note}. The failures are in the catalog view "
        "rejected_attempts; fix the cause (e.g. FLOWMATCH_FILE_ROOT after moving a data "
        "root) and re-run, or lower ingest.min_stored_fraction.",
        metadata={
            "stored": e.stored,
            "input_rows": e.rows,
            "failed_by_reason": dg.MetadataValue.json(e.failed),
        },
    )


def images_complete(
    context: dg.AssetCheckExecutionContext, flowmatch: FlowmatchResource
) -> dg.AssetCheckResult:
    layout = flowmatch.layout
    parts = run_partitions(context) or layout.partitions_with("images")
    problems, rows = [], 0
    for p in parts:
        md_ids = set(
            pq.read_table(remote.ensure(layout.asset_path("metadata", p)), columns=["id"])
            .column("id")
            .to_pylist()
        )
        rows += len(md_ids)
        rows_file = catalog.record_path(layout, "rows", "images", p)
        if not layout.asset_path("images", p).exists():
            problems.append(f"{p}: no images shard")
            continue
        if not rows_file.exists():
            problems.append(f"{p}: no outcome records")
            continue
        outcome_ids = pq.read_table(rows_file, columns=["id"]).column("id").to_pylist()
        if sorted(outcome_ids) != sorted(md_ids):
            problems.append(f"{p}: {len(outcome_ids)} outcomes for {len(md_ids)} rows")
        problems += _size_problems(p, layout.asset_path("images", p), flowmatch.ingest)
    return shards_check_result(parts, problems, rows)


with warnings.catch_warnings():  # partitioned checks are "preview" in Dagster 1.13
    warnings.simplefilter("ignore", dg.PreviewWarning)
    images_complete = dg.asset_check(  # per partition: the UI's check table has a row each
        asset=images,
        name=DATA_CHECKS["images"],  # the one name `verify` and the freshness reports read
        partitions_def=shard_partitions,
        blocking=True,
        description="Every kept metadata row has exactly one outcome; stored images are RGB at "
        "their row's size (256x256, or its aspect-ratio bucket), a size the settings allow.",
    )(images_complete)


def _size_problems(part: str, shard: Path, ingest: IngestConfig) -> list[str]:
    """The first image of each stored size decodes to that size, and every size is one of the
    settings' buckets."""
    meta = read_image_meta(shard, ingest.size)
    allowed = set(ingest.bucket_list())
    hs, ws = meta.column("height").to_pylist(), meta.column("width").to_pylist()
    first: dict[tuple[int, int], int] = {}
    for i, hw in enumerate(zip(hs, ws)):
        first.setdefault(hw, i)
    problems = [
        f"{part}: stored size {h}x{w} is not a bucket of ingest (size {ingest.size}, "
        f"buckets {ingest.buckets})"
        for h, w in first
        if (h, w) not in allowed
    ]
    if first:
        t = pq.read_table(shard, columns=["image"]).take(sorted(first.values()))
        for blob, (hw, _) in zip(
            t.column("image").to_pylist(), sorted(first.items(), key=lambda kv: kv[1])
        ):
            im = decode(blob)
            if im.shape != (*hw, 3):
                problems.append(f"{part}: image shape {im.shape}, its row says {hw[0]}x{hw[1]}")
    return problems
