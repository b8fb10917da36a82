"""A shard's rows through fetch and decode on a thread pool: exactly one IngestResult per row, in order, never an exception for a bad row."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, as_completed, wait

import urllib3

from flowmatch_assets.ingest.decode import process_image
from flowmatch_assets.ingest.fetch import fetch_bytes, make_pool
from flowmatch_assets.ingest.images import IngestConfig, IngestError, IngestResult, pillow_format


def _check_hash(row: Mapping, md5: str, cfg: IngestConfig) -> None:
    """``hash_mismatch`` when the row's metadata ``hash`` is an md5 (32 hex digits) and the
    downloaded bytes' md5 is another (``cfg.check_hash``)."""
    want = row.get("hash")
    if not cfg.check_hash or not isinstance(want, str):
        return
    want = want.strip().lower()
    if len(want) == 32 and all(c in "0123456789abcdef" for c in want) and want != md5:
        raise IngestError(
            "hash_mismatch", f"the bytes' md5 is {md5}, the metadata's hash {want}: not this image"
        )


def ingest_one(row: Mapping, cfg: IngestConfig, pool: urllib3.PoolManager) -> IngestResult:
    """One row (``id``, ``url``, ``hash``): fetch, md5, decode, crop, encode, the md5 checked
    against ``hash`` (:func:`_check_hash`); never raises for bad data."""
    rid = str(row.get("id", ""))
    url = row.get("url")
    url_s = url if isinstance(url, str) else ""
    n = 0
    try:
        data = fetch_bytes(url, cfg, pool)  # type: ignore[arg-type]  # bad types -> bad_url
        n = len(data)
        md5 = hashlib.md5(data).hexdigest()
        image, ow, oh = process_image(data, cfg)
        _check_hash(row, md5, cfg)  # after decoding: bytes that are no image say so first
    except IngestError as e:
        return IngestResult(rid, url_s, "failed", e.reason, e.detail or None, bytes_downloaded=n)
    except Exception as e:  # noqa: BLE001 - a bad row must never crash the shard
        return IngestResult(
            rid, url_s, "failed", "internal", f"{type(e).__name__}: {e}", bytes_downloaded=n
        )
    return IngestResult(rid, url_s, "stored", None, None, image, ow, oh, md5, n)


def ingest_rows(
    rows: Sequence[Mapping],
    cfg: IngestConfig,
    progress: Callable[[int, int], None] | None = None,
) -> list[IngestResult]:
    """Fetch and process every row (``id``, ``url``) on ``cfg.threads`` threads.

    Returns one ``IngestResult`` per row, in input order; never raises for a bad row (only for
    a bad config). ``progress(done, total)`` is called from the calling thread as rows finish.
    """
    pillow_format(cfg.image_format)  # a bad config raises before any row
    if cfg.threads < 1:
        raise ValueError(f"ingest.threads must be >= 1, got {cfg.threads}")
    total = len(rows)
    results: list[IngestResult | None] = [None] * total
    if total == 0:
        return []
    pool = make_pool(cfg)
    try:
        with ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="ingest") as ex:
            futures = {ex.submit(ingest_one, row, cfg, pool): i for i, row in enumerate(rows)}
            for done, fut in enumerate(as_completed(futures), start=1):
                i = futures[fut]
                results[i] = fut.result()
                if progress is not None:
                    progress(done, total)
    finally:
        pool.clear()
    return [r for r in results if r is not None]


def _process_one(row: Mapping, data: bytes | IngestError, cfg: IngestConfig) -> IngestResult:
    """One row whose bytes were read already (or whose read failed)."""
    rid, url = str(row.get("id", "")), str(row.get("url") or "")
    if isinstance(data, IngestError):
        return IngestResult(rid, url, "failed", data.reason, data.detail or None)
    try:
        md5 = hashlib.md5(data).hexdigest()
        image, ow, oh = process_image(data, cfg)
    except IngestError as e:
        return IngestResult(
            rid, url, "failed", e.reason, e.detail or None, bytes_downloaded=len(data)
        )
    except Exception as e:  # noqa: BLE001 - a bad row must never crash the shard
        return IngestResult(
            rid, url, "failed", "internal", f"{type(e).__name__}: {e}", bytes_downloaded=len(data)
        )
    return IngestResult(rid, url, "stored", None, None, image, ow, oh, md5, len(data))


def ingest_blobs(
    rows: Sequence[Mapping],
    blobs: Iterable[tuple[Mapping, bytes | IngestError]],
    cfg: IngestConfig,
    progress: Callable[[int, int], None] | None = None,
) -> list[IngestResult]:
    """:func:`ingest_rows` for rows whose bytes a source reads itself (a folder, parquet or tar
    source: flowmatch_assets/ingest/sources): ``blobs`` yields ``(row, bytes or the
    IngestError why not)`` in any order, read in the calling thread (sequential I/O), while
    ``cfg.threads`` threads decode; at most ``4 x threads`` read images, and at most half of
    ``cfg.decode_memory_bytes`` of them (or one), wait in memory. Returns
    one ``IngestResult`` per row of ``rows``, in their order (a row ``blobs`` never yields fails
    as ``internal``)."""
    pillow_format(cfg.image_format)  # a bad config raises before any row
    position = {str(r.get("id", "")): i for i, r in enumerate(rows)}
    results: list[IngestResult | None] = [None] * len(rows)
    done = 0
    waiting = 0  # bytes of read images not decoded yet
    with ThreadPoolExecutor(max_workers=max(1, cfg.threads), thread_name_prefix="decode") as ex:
        pending: set = set()
        futures: dict = {}

        def drain(limit: int, limit_bytes: int) -> None:
            nonlocal pending, done, waiting
            while len(pending) > limit or (len(pending) > 1 and waiting > limit_bytes):
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    i, size = futures.pop(fut)
                    waiting -= size
                    results[i] = fut.result()
                    done += 1
                    if progress is not None:
                        progress(done, len(rows))

        for row, data in blobs:
            fut = ex.submit(_process_one, row, data, cfg)
            size = len(data) if isinstance(data, bytes | bytearray | memoryview) else 0
            futures[fut] = (position[str(row.get("id", ""))], size)
            waiting += size
            pending.add(fut)
            # a slow decode (a budgeted 100 Mpx image) must not let the reader hold 4 x threads
            # files of up to max_bytes (sparse ones cost nothing on disk): half the decode budget
            drain(4 * max(1, cfg.threads), cfg.decode_memory_bytes // 2)
        drain(0, 0)
    return [
        r
        if r is not None
        else IngestResult(
            str(rows[i].get("id", "")),
            str(rows[i].get("url") or ""),
            "failed",
            "internal",
            "the source never yielded this row's bytes",
        )
        for i, r in enumerate(results)
    ]


def count_reasons(results: Sequence[IngestResult]) -> dict[str, int]:
    """Counts per outcome: ``{"stored": n, "<reason>": n, ...}`` (for logs and the catalog)."""
    counts: dict[str, int] = {}
    for r in results:
        key = "stored" if r.outcome == "stored" else (r.reason or "internal")
        counts[key] = counts.get(key, 0) + 1
    return counts
