"""Data assets: raw PD12M shards -> 256px images. Thin wiring over metadata.py and ingest.py."""

import json
import time
from collections import Counter

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from flowmatch_assets import catalog
from flowmatch_assets.catalog import RowOutcome
from flowmatch_assets.defs.deploy import IMAGE_TAGS
from flowmatch_assets.defs.partitions import shard_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.routine import PartitionOutput, run_partitions, shards_check_result
from flowmatch_assets.ingest.dedupe import (
    build_hash_index,
    drop_content_duplicates,
    hash_winners,
    stored_before,
)
from flowmatch_assets.ingest.images import IngestResult, ingest_rows, is_retryable
from flowmatch_assets.ingest.metadata import (
    filter_rows,
    ids_as_strings,
    parse_shard_key,
    read_metadata_shard,
)
from flowmatch_models.atomic import atomic_path
from flowmatch_models.grid import make_grid, markdown_image, save_png
from flowmatch_models.image_shard import decode, write_image_shard
from flowmatch_models.layout import DataLayout

GROUP = "data"


@dg.asset(
    partitions_def=shard_partitions,
    group_name=GROUP,
    kinds={"parquet"},
    description="One PD12M shard's metadata rows, validated and filtered (filtered rows counted by reason).",
)
def pd12m_metadata(
    context: dg.AssetExecutionContext, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Read the partition's rows of its metadata file, filter them, store the kept ones."""
    t0 = time.perf_counter()
    out = PartitionOutput(context, flowmatch, "pd12m_metadata")
    table, spec = read_metadata_shard(
        flowmatch.metadata_source, out.partition, flowmatch.shard_size
    )
    table = ids_as_strings(table)
    winners = None
    if flowmatch.filters.drop_duplicate_hash:  # across the whole dataset: dedupe.py
        index = build_hash_index(
            flowmatch.data_root,
            flowmatch.metadata_source,
            flowmatch.filters,
            flowmatch.shard_size,
            log=context.log.info,
        )
        winners = hash_winners(index, parse_shard_key(out.partition)[0])
    kept, filtered = filter_rows(table, flowmatch.filters, winners)
    with atomic_path(out.path) as tmp:
        pq.write_table(kept, tmp)
    outcomes = [
        RowOutcome(i, u, "stored")
        for i, u in zip(kept.column("id").to_pylist(), kept.column("url").to_pylist())
    ]
    outcomes += [
        RowOutcome(f["id"], f["url"], "filtered", f["reason"], f["detail"]) for f in filtered
    ]
    by_reason = dict(Counter(f["reason"] for f in filtered))
    dups = [f for f in filtered if f["reason"] == "duplicate_hash"]
    catalog.record_duplicates(flowmatch.data_root, "pd12m_metadata", out.partition, "hash", dups)
    context.log.info(
        f"{out.partition}: {table.num_rows} rows, kept {kept.num_rows}, filtered {by_reason}"
    )
    return out.publish(
        samples=kept.num_rows,
        rows=outcomes,
        seconds=time.perf_counter() - t0,
        input_rows=table.num_rows,
        raw_bytes=kept.nbytes,
        extra={
            "source_file": spec.path,
            "row_start": spec.row_start,
            "row_end": spec.row_end,
            "filtered": by_reason,
        },
        metadata={
            "input_rows": table.num_rows,
            "kept_rows": kept.num_rows,
            "filtered_rows": len(filtered),
            "filtered_by_reason": dg.MetadataValue.json(by_reason),
            "source_file": spec.path,
            "row_range": f"[{spec.row_start}, {spec.row_end})",
        },
    )


class ImagesConfig(dg.Config):
    """How one images_256 materialization treats the partition's existing shard."""

    retry: bool = Field(
        default=False,
        description="Re-fetch only the shard's failed rows (retryable reasons, or `reasons`) and "
        "merge the new images into the existing shard; the other rows are not fetched again.",
    )
    reasons: list[str] | None = Field(
        default=None,
        description="With retry: the failure reasons to re-fetch (None: every retryable one).",
    )


def top_reasons(results: list[IngestResult], n: int = 3) -> str:
    """``"file_not_allowed x102, timeout x3"``: the most common failure reasons."""
    c = Counter(r.reason for r in results if r.outcome == "failed")
    return ", ".join(f"{k} x{v}" for k, v in c.most_common(n)) or "none"


def _retry_rows(
    rows: list[dict], previous: pa.Table | None, reasons: list[str] | None
) -> tuple[list[dict], dict[str, dict]]:
    """(metadata rows to re-fetch, the previous outcome of every row by id)."""
    before = {r["id"]: r for r in (previous.to_pylist() if previous is not None else [])}
    want = [
        r
        for r in rows
        if (o := before.get(r["id"])) is not None
        and o["outcome"] == "failed"
        and (o["reason"] in reasons if reasons else is_retryable(o["reason"]))
    ]
    return want, before


@dg.asset(
    partitions_def=shard_partitions,
    deps=[pd12m_metadata],
    group_name=GROUP,
    kinds={"parquet", "pillow"},
    op_tags=IMAGE_TAGS,
    description="The shard's images: downloaded, short side 256, centre-cropped 256x256, encoded (JPEG q95); failures recorded with reasons.",
)
def images_256(
    context: dg.AssetExecutionContext, config: ImagesConfig, flowmatch: FlowmatchResource
) -> dg.MaterializeResult:
    """Fetch and encode the partition's images. A run that stores fewer than
    ``ingest.min_stored_fraction`` of the kept rows fails and replaces nothing (the previous
    shard and its catalog records stay; its failures go to ``rejected_attempts``). With
    ``retry`` only the failed rows are fetched again and merged into the shard, in order."""
    t0 = time.perf_counter()
    out = PartitionOutput(context, flowmatch, "images_256")
    part, root = out.partition, flowmatch.data_root
    rows = pq.read_table(flowmatch.layout.asset_path("pd12m_metadata", part)).to_pylist()
    fetch, before = rows, {}
    if config.retry:
        if not out.path.exists():
            raise dg.Failure(
                f"{part} has no images_256 shard to retry into; materialize images_256 first"
            )
        fetch, before = _retry_rows(
            rows, catalog.read_rows(root, "images_256", part), config.reasons
        )
        context.log.info(f"{part}: retrying {len(fetch)} failed rows")
    step = max(1, len(fetch) // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            rate = done / max(time.perf_counter() - t0, 1e-9)
            context.log.info(f"{part}: {done}/{total} images ({rate:.1f}/s)")

    results = ingest_rows(fetch, flowmatch.ingest, progress=progress)
    new = _shard_rows(results, rows, flowmatch.ingest.image_format)
    outcomes = {r.id: RowOutcome(r.id, r.url, r.outcome, r.reason, r.detail) for r in results}
    downloaded = sum(r.bytes_downloaded for r in results)
    if config.retry:
        kept = {r["id"]: r for r in pq.read_table(out.path).to_pylist()}
        merged = {**kept, **new}
        stored = [merged[r["id"]] for r in rows if r["id"] in merged]  # metadata order
        for i, o in before.items():
            if i not in outcomes:
                outcomes[i] = RowOutcome(i, o["url"], o["outcome"], o["reason"], o["detail"])
    else:
        stored = [new[r["id"]] for r in rows if r["id"] in new]
        _refuse_if_too_few(out, stored, rows, results, flowmatch.ingest.min_stored_fraction)
    stored, dropped = _drop_content_duplicates(flowmatch, part, stored, outcomes)
    write_image_shard(out.path, stored)
    all_outcomes = [outcomes[r["id"]] for r in rows if r["id"] in outcomes]
    failed = dict(Counter(o.reason for o in all_outcomes if o.outcome == "failed"))
    position = {r["id"]: r["row_index"] for r in rows}
    catalog.record_content(
        root,
        part,
        [{"id": s["id"], "position": position[s["id"]], "md5": s["md5"]} for s in stored],
    )
    if config.retry:  # the rows dropped by the first run stay dropped (they were not fetched)
        dropped += _earlier_drops(root, part, {o.id for o in all_outcomes}, dropped)
    catalog.record_duplicates(root, "images_256", part, "content", dropped)
    seconds = time.perf_counter() - t0
    grid = make_grid([decode(s["image"]) for s in stored[:64]], cell=96)
    preview = save_png(grid, flowmatch.layout.preview_path("images_256", part))
    extra: dict = {"failed": failed, "downloaded_bytes": downloaded}
    record_seconds = seconds
    if config.retry:
        # the shard's images cost the first run's seconds plus this one's: throughput (and the
        # budget's images/s) stays samples / all the seconds spent on them
        prev = catalog.read_materialization(root, "images_256", part) or {}
        record_seconds += float(prev.get("seconds") or 0.0)
        prev_extra = json.loads(prev.get("extra") or "{}")
        extra["downloaded_bytes"] = downloaded + int(prev_extra.get("downloaded_bytes") or 0)
        extra["retry"] = {"fetched": len(fetch), "recovered": len(new), "seconds": seconds}
    what = f"retried {len(fetch)}, recovered {len(new)}; " if config.retry else ""
    context.log.info(
        f"{part}: {what}stored {len(stored)}/{len(rows)}, failed {failed}, {seconds:.1f}s"
    )
    retried = {"retried": len(fetch), "recovered": len(new)} if config.retry else {}
    return out.publish(
        samples=len(stored),
        rows=all_outcomes,
        seconds=record_seconds,
        input_rows=len(rows),
        raw_bytes=len(stored) * flowmatch.ingest.size**2 * 3,
        codec=flowmatch.ingest.image_format,
        device="cpu",
        extra=extra,
        metadata={
            "input_rows": len(rows),
            "stored": len(stored),
            "failed": len(rows) - len(stored),
            "failed_by_reason": dg.MetadataValue.json(failed),
            "duplicate_content": len(dropped),
            "downloaded_bytes": downloaded,  # this run's (the catalog: the shard's, all runs)
            "stored_bytes": out.path.stat().st_size,
            "images_per_s": round(len(fetch) / seconds, 1) if seconds else 0.0,
            "preview_png": dg.MetadataValue.path(str(preview)),
            "preview": dg.MetadataValue.md(markdown_image(grid, f"images_256 {part}")),
            **retried,
        },
    )


def _drop_content_duplicates(
    flowmatch: FlowmatchResource, part: str, stored: list[dict], outcomes: dict[str, RowOutcome]
) -> tuple[list[dict], list[dict]]:
    """Drop the rows whose bytes an earlier row already stored (dedupe.py), turning their
    outcome into ``filtered: duplicate_content``; returns (kept rows, dropped records)."""
    if not flowmatch.filters.drop_duplicate_content:
        return stored, []
    earlier = stored_before(flowmatch.data_root, part, [r["md5"] for r in stored])
    stored, dropped = drop_content_duplicates(stored, earlier, part)
    for d in dropped:
        detail = f"same bytes (md5 {d['hash']}) as {d['kept_partition']}, id {d['kept_id']}"
        outcomes[d["id"]] = RowOutcome(d["id"], d["url"], "filtered", "duplicate_content", detail)
    return stored, dropped


def _earlier_drops(root, part: str, ids: set[str], dropped: list[dict]) -> list[dict]:
    """The content-duplicate records of the shard's previous run that this run did not redo."""
    p = DataLayout(root).catalog_dir / "duplicates" / "images_256" / f"{part}.parquet"
    redone = {d["id"] for d in dropped}
    prev = pq.read_table(p).to_pylist() if p.exists() else []
    return [d for d in prev if d["id"] in ids and d["id"] not in redone]


def _shard_rows(results: list[IngestResult], rows: list[dict], fmt: str) -> dict[str, dict]:
    """The images_256 rows of the stored results, by id (caption from the metadata row)."""
    caption = {r["id"]: r["caption"] for r in rows}
    return {
        r.id: {
            "id": r.id,
            "caption": caption[r.id],
            "image": r.image,
            "format": fmt,
            "orig_width": r.orig_width,
            "orig_height": r.orig_height,
            "md5": r.md5,
            "url": r.url,
        }
        for r in results
        if r.outcome == "stored"
    }


def _refuse_if_too_few(
    out: PartitionOutput,
    stored: list[dict],
    rows: list[dict],
    results: list[IngestResult],
    floor: float,
) -> None:
    """Fail (recording the attempt, replacing nothing) when fewer than ``floor`` of the rows
    were stored."""
    if not rows or len(stored) >= floor * len(rows):
        return
    out.reject(RowOutcome(r.id, r.url, r.outcome, r.reason, r.detail) for r in results)
    kept_note = (
        f"the previous shard ({out.path.name}) and its catalog records are unchanged"
        if out.path.exists()
        else "no shard written"
    )
    raise dg.Failure(
        f"{out.partition}: stored {len(stored)}/{len(rows)} images, below "
        f"ingest.min_stored_fraction={floor:g}; top failure reasons: "
        f"{top_reasons(results)}; {kept_note}. The failures are in the catalog view "
        "rejected_attempts; fix the cause (e.g. FLOWMATCH_FILE_ROOT after moving a data "
        "root) and re-run, or lower ingest.min_stored_fraction.",
        metadata={
            "stored": len(stored),
            "input_rows": len(rows),
            "failed_by_reason": dg.MetadataValue.json(
                dict(Counter(r.reason for r in results if r.outcome == "failed"))
            ),
        },
    )


@dg.asset_check(
    asset=images_256,
    blocking=True,
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
        if not layout.asset_path("images_256", p).exists():
            problems.append(f"{p}: no images_256 shard")
            continue
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
    return shards_check_result(parts, problems)
