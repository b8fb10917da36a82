"""One images shard from its metadata rows: fetch, encode, dedupe by content, and (for a
retry) merge into the existing shard. No Dagster: the ``images`` asset writes the result.

:func:`make_image_shard` returns one :class:`ImageShard` for a first run and for a retry (only
the failed rows are fetched again and merged into the shard in metadata order; the other rows
keep their outcomes). It raises :class:`TooFewStored` when a first run stores fewer than
``ingest.min_stored_fraction`` of the rows (the caller records the attempt and replaces
nothing), and :class:`NothingToRetry` for a retry without a shard.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from flowmatch_assets import catalog
from flowmatch_assets.catalog import RowOutcome
from flowmatch_assets.ingest.batch import ingest_blobs, ingest_rows
from flowmatch_assets.ingest.dedupe import drop_content_duplicates, stored_before
from flowmatch_assets.ingest.images import IngestConfig, IngestError, IngestResult, is_retryable
from flowmatch_assets.ingest.metadata import FilterConfig, size_reason
from flowmatch_models.data.buckets import kept_fraction
from flowmatch_models.storage.image_shard import read_image_meta


class NothingToRetry(Exception):
    """A retry of a partition that has no images shard yet."""


class TooFewStored(Exception):
    """A run stored fewer than ``floor`` of its rows: nothing may be replaced. ``attempt`` is
    every fetched row's outcome (the rejected attempt's record)."""

    def __init__(self, partition: str, stored: int, rows: int, floor: float, results):
        self.stored, self.rows = stored, rows
        self.attempt = [RowOutcome(r.id, r.url, r.outcome, r.reason, r.detail) for r in results]
        self.failed = dict(Counter(r.reason for r in results if r.outcome == "failed"))
        super().__init__(
            f"{partition}: stored {stored}/{rows} images, below "
            f"ingest.min_stored_fraction={floor:g}; top failure reasons: {top_reasons(results)}"
        )


def top_reasons(results: list[IngestResult], n: int = 3) -> str:
    """``"file_not_allowed x102, timeout x3"``: the most common failure reasons."""
    c = Counter(r.reason for r in results if r.outcome == "failed")
    return ", ".join(f"{k} x{v}" for k, v in c.most_common(n)) or "none"


@dataclass
class ImageShard:
    """What one run made of a partition: the images rows to store (metadata order, content
    duplicates dropped), every input row's outcome, and what the catalog records of it."""

    stored: list[dict]
    outcomes: list[RowOutcome]
    dropped: list[dict]  # content-duplicate records (``catalog.record_duplicates``)
    content: list[dict]  # id, position, md5 of the stored rows (``catalog.record_content``)
    input_rows: int
    fetched: int
    recovered: int
    downloaded_bytes: int  # by this run
    retry: bool = False
    previous: dict = field(default_factory=dict)  # a retry: the shard's previous record

    @property
    def buckets(self) -> dict[str, int]:
        """Stored rows per size (``"224x288"``), most common first."""
        c = Counter(f"{r['height']}x{r['width']}" for r in self.stored)
        return dict(c.most_common())

    @property
    def kept_mean(self) -> float:
        """The mean share of the originals' area the stored crops keep."""
        return sum(r["kept"] for r in self.stored) / len(self.stored) if self.stored else 0.0

    @property
    def failed(self) -> dict[str, int]:
        return dict(Counter(o.reason for o in self.outcomes if o.outcome == "failed"))

    def record(self, seconds: float) -> tuple[float, dict]:
        """(seconds, extra) of the shard's catalog record: a retry adds the first run's seconds
        and downloads, so throughput stays samples / all the seconds spent on them."""
        extra: dict = {"failed": self.failed, "downloaded_bytes": self.downloaded_bytes}
        if not self.retry:
            return seconds, extra
        prev_extra = json.loads(self.previous.get("extra") or "{}")
        extra["downloaded_bytes"] += int(prev_extra.get("downloaded_bytes") or 0)
        extra["retry"] = {"fetched": self.fetched, "recovered": self.recovered, "seconds": seconds}
        return seconds + float(self.previous.get("seconds") or 0.0), extra

    def run_metadata(self) -> dict:
        """What a retry adds to the materialization's metadata."""
        return {"retried": self.fetched, "recovered": self.recovered} if self.retry else {}

    def summary(self, seconds: float) -> str:
        what = f"retried {self.fetched}, recovered {self.recovered}; " if self.retry else ""
        return (
            f"{what}stored {len(self.stored)}/{self.input_rows}, failed {self.failed}, "
            f"{seconds:.1f}s"
        )


def _retry_rows(
    rows: list[dict], previous, reasons: list[str] | None
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


def _shard_rows(
    results: list[IngestResult], rows: list[dict], ingest: IngestConfig
) -> dict[str, dict]:
    """The images rows of the stored results, by id (caption from the metadata row; the
    stored size is the row's bucket, ``kept`` the share of the original the crop kept)."""
    caption = {r["id"]: r["caption"] for r in rows}
    out = {}
    for r in results:
        if r.outcome != "stored":
            continue
        h, w = ingest.bucket_of(r.orig_width, r.orig_height)
        out[r.id] = {
            "id": r.id,
            "caption": caption[r.id],
            "image": r.image,
            "format": ingest.image_format,
            "orig_width": r.orig_width,
            "orig_height": r.orig_height,
            "md5": r.md5,
            "url": r.url,
            "height": h,
            "width": w,
            "kept": kept_fraction(r.orig_width, r.orig_height, (h, w)),
        }
    return out


def _drop_content_duplicates(
    root, part: str, stored: list[dict], outcomes: dict[str, RowOutcome], on: bool
) -> tuple[list[dict], list[dict]]:
    """Drop the rows whose bytes an earlier row already stored (dedupe.py), turning their
    outcome into ``filtered: duplicate_content``; returns (kept rows, dropped records)."""
    if not on:
        return stored, []
    earlier = stored_before(root, part, [r["md5"] for r in stored])
    stored, dropped = drop_content_duplicates(stored, earlier, part)
    for d in dropped:
        detail = f"same bytes (md5 {d['hash']}) as {d['kept_partition']}, id {d['kept_id']}"
        outcomes[d["id"]] = RowOutcome(d["id"], d["url"], "filtered", "duplicate_content", detail)
    return stored, dropped


def _earlier_drops(root, part: str, ids: set[str], dropped: list[dict]) -> list[dict]:
    """The content-duplicate records of the shard's previous run that this run did not redo."""
    p = catalog.record_path(root, "duplicates", "images", part)
    redone = {d["id"] for d in dropped}
    prev = pq.read_table(p).to_pylist() if p.exists() else []
    return [d for d in prev if d["id"] in ids and d["id"] not in redone]


#: ``read(rows)``: ``(row, its bytes or the IngestError why not)`` for each row, read by the
#: partition's source itself (flowmatch_assets/ingest/sources) instead of fetched by URL.
Reader = Callable[[list[dict]], Iterable[tuple[dict, "bytes | IngestError"]]]


def _decoded_size_filter(results: list[IngestResult], rows: list[dict], filters: FilterConfig):
    """Rows whose original size was not known before reading (a source's own images: no
    width/height in their listing) meet the metadata's size filters now, on the decoded size:
    a stored result becomes ``filtered`` with the same reason (small_original, aspect_ratio)."""
    unknown = {r["id"] for r in rows if r.get("width") is None or r.get("height") is None}
    for r in results:
        if r.outcome == "stored" and r.id in unknown:
            why = size_reason(r.orig_width, r.orig_height, filters)
            if why:
                r.outcome, r.reason, r.detail, r.image = "filtered", why[0], why[1], None


def make_image_shard(
    rows: list[dict],
    root: str | Path,
    part: str,
    shard: Path,
    ingest: IngestConfig,
    filters: FilterConfig,
    retry: bool = False,
    reasons: list[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
    read: Reader | None = None,
) -> ImageShard:
    """The images shard of partition ``part`` from its kept metadata ``rows``: fetch and
    encode them (``retry``: only the failed rows with a retryable reason, or one of
    ``reasons``, merged into the existing ``shard``), then drop content duplicates. ``read``:
    the partition's source reads the bytes (otherwise each row's ``url`` is fetched)."""
    fetch, before, previous = rows, {}, {}
    if retry:
        if not shard.exists():
            raise NothingToRetry(
                f"{part} has no images shard to retry into; materialize images first"
            )
        fetch, before = _retry_rows(rows, catalog.read_rows(root, "images", part), reasons)
        previous = catalog.read_materialization(root, "images", part) or {}
        log(f"{part}: retrying {len(fetch)} failed rows")
    if read is None:
        results = ingest_rows(fetch, ingest, progress=progress)
    else:
        results = ingest_blobs(fetch, read(fetch), ingest, progress=progress)
    _decoded_size_filter(results, fetch, filters)
    new = _shard_rows(results, rows, ingest)
    outcomes = {r.id: RowOutcome(r.id, r.url, r.outcome, r.reason, r.detail) for r in results}
    if retry:
        old = read_image_meta(shard, ingest.size, images=True).to_pylist()
        kept = {r["id"]: r for r in old}
        other = sorted(
            {
                f"{r['height']}x{r['width']}"
                for r in kept.values()
                if (r["height"], r["width"]) != ingest.bucket_of(r["orig_width"], r["orig_height"])
            }
        )
        if other:  # merging would mix two crops under one fingerprint
            raise NothingToRetry(
                f"{part}: its images shard holds sizes ({', '.join(other)}) that "
                f"ingest.buckets={ingest.buckets} would not make; re-materialize images "
                "without retry"
            )
        merged = {**kept, **new}
        stored = [merged[r["id"]] for r in rows if r["id"] in merged]  # metadata order
        for i, o in before.items():
            if i not in outcomes:
                outcomes[i] = RowOutcome(i, o["url"], o["outcome"], o["reason"], o["detail"])
    else:
        stored = [new[r["id"]] for r in rows if r["id"] in new]
        floor = ingest.min_stored_fraction
        wanted = len(rows) - sum(r.outcome == "filtered" for r in results)  # by decoded size
        if wanted and len(stored) < floor * wanted:
            raise TooFewStored(part, len(stored), wanted, floor, results)
    stored, dropped = _drop_content_duplicates(
        root, part, stored, outcomes, filters.drop_duplicate_content
    )
    all_outcomes = [outcomes[r["id"]] for r in rows if r["id"] in outcomes]
    if retry:  # the rows dropped by the first run stay dropped (they were not fetched)
        dropped += _earlier_drops(root, part, {o.id for o in all_outcomes}, dropped)
    position = {r["id"]: r["row_index"] for r in rows}
    return ImageShard(
        stored=stored,
        outcomes=all_outcomes,
        dropped=dropped,
        content=[{"id": s["id"], "position": position[s["id"]], "md5": s["md5"]} for s in stored],
        input_rows=len(rows),
        fetched=len(fetch),
        recovered=len(new),
        downloaded_bytes=sum(r.bytes_downloaded for r in results),
        retry=retry,
        previous=previous,
    )
