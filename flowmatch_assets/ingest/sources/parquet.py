"""Parquet files with the image bytes inside, as the Hugging Face ``datasets`` library writes
them: an ``image`` struct column with ``bytes`` and ``path`` (or a plain binary column) and a
caption column whose name is configurable (``caption_field``, default ``text``). Every
``*.parquet`` under the location (local or any fsspec URL) is a unit; a file of R rows becomes
``ceil(R / shard_size)`` partitions. The listing reads only the caption (and id) column; the
images stage streams the image column in row batches.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import (
    failure,
    find_files,
    join,
    open_file,
    open_location,
    row,
)
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError

BATCH_ROWS = 64  # image rows decoded from parquet at a time (memory: 64 originals)


def scan(cfg: SourceConfig, known: Iterable) -> list[tuple[str, int, int, list]]:
    """New partitions ``(file, start row, end row, [])`` for every parquet file under the
    location that is not registered yet, in path order."""
    fs, root = open_location(cfg)
    single = _single(fs, root)
    files = [root] if single else [join(root, f) for f in find_files(fs, root)]
    base = posixpath.dirname(root) if single else root
    held = {m.unit for m in known}
    out = []
    for path in files:
        rel = path[len(base.rstrip("/")) + 1 :] if path != base else posixpath.basename(path)
        if not rel.endswith(".parquet") or rel in held:
            continue
        with open_file(fs, path) as f:
            n = pq.ParquetFile(f).metadata.num_rows
        for k in range(max(1, math.ceil(n / cfg.shard_size))):
            out.append((rel, k * cfg.shard_size, min(n, (k + 1) * cfg.shard_size), []))
    return out


def _single(fs, root: str) -> bool:
    """The location is one parquet file (not a folder: over HTTP a folder's page is a file)."""
    return root.endswith(".parquet") and fs.isfile(root)


def _path(cfg: SourceConfig, fs, root: str, unit: str) -> str:
    return root if _single(fs, root) else join(root, unit)


def _groups(pf: pq.ParquetFile, start: int, end: int) -> tuple[list[int], int]:
    """Row groups that overlap ``[start, end)`` and the first row of the first one."""
    groups, offset, first = [], 0, None
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if offset + n > start and offset < end:
            groups.append(g)
            first = offset if first is None else first
        offset += n
    return groups, first or 0


def _check_columns(pf: pq.ParquetFile, cfg: SourceConfig, path: str) -> None:
    names = pf.schema_arrow.names
    wanted = {"caption_field": cfg.caption(), "image_field": cfg.image_field}
    if cfg.id_field:
        wanted["id_field"] = cfg.id_field
    for key, col in wanted.items():
        if col not in names:
            raise SourceError(
                f"{path} has no column {col!r} (the source's {key}); its columns: "
                f"{', '.join(names)}. Set {key} in the sources file"
            )


def rows(cfg: SourceConfig, name: str, m) -> tuple[list[dict], list[dict]]:
    """The partition's rows (caption and id columns only) and its ``missing_caption`` rows."""
    fs, root = open_location(cfg)
    path = _path(cfg, fs, root, m.unit)
    stem = posixpath.basename(m.unit).removesuffix(".parquet")
    with open_file(fs, path) as f:
        pf = pq.ParquetFile(f)
        _check_columns(pf, cfg, path)
        cols = [cfg.caption()] + ([cfg.id_field] if cfg.id_field else [])
        groups, first = _groups(pf, m.start, m.end)
        t = pf.read_row_groups(groups, columns=cols) if groups else None
    if t is None:
        return [], []
    t = t.slice(m.start - first, m.end - m.start)
    captions = t.column(cfg.caption()).to_pylist()
    ids = t.column(cfg.id_field).to_pylist() if cfg.id_field else [None] * len(captions)
    out, failed = [], []
    for i, (cap, rid) in enumerate(zip(captions, ids)):
        r = m.start + i
        sid = str(rid) if rid is not None else f"{stem}/{r}"
        url = f"{m.unit}#{r}"
        if cap is None or (isinstance(cap, list) and not cap):
            failed.append(
                failure(sid, url, "missing_caption", f"{cfg.caption()} is null in row {r}")
            )
            continue
        if isinstance(cap, list):  # several captions per image (e.g. COCO-style): the first
            cap = cap[0]
        out.append(row(cfg, name, sid, url, str(cap).strip(), i))
    return out, failed


def _image_bytes(value) -> tuple[bytes | None, str | None]:
    """(bytes, path) of one image cell: the datasets struct, or plain binary."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    return value, None


def images(
    cfg: SourceConfig, m, rows: list[dict], max_bytes: int
) -> Iterator[tuple[dict, bytes | IngestError]]:
    """The image bytes of each row, in order, read from the file's image column in batches of
    ``BATCH_ROWS``; a cell without bytes fails as ``missing_image``."""
    fs, root = open_location(cfg)
    path = _path(cfg, fs, root, m.unit)
    want = {int(r["url"].rsplit("#", 1)[1]): r for r in rows}
    if not want:
        return
    lo, hi = min(want), max(want) + 1
    with open_file(fs, path) as f:
        pf = pq.ParquetFile(f)
        _check_columns(pf, cfg, path)
        groups, first = _groups(pf, lo, hi)
        pos = first
        for batch in pf.iter_batches(BATCH_ROWS, row_groups=groups, columns=[cfg.image_field]):
            col: pa.Array = batch.column(0)
            for j in range(len(col)):
                r = pos + j
                if r in want:
                    data, p = _image_bytes(col[j].as_py())
                    if data is None:
                        err = IngestError(
                            "missing_image",
                            f"row {r} has no image bytes" + (f" (path {p!r})" if p else ""),
                        )
                        yield want.pop(r), err
                    elif len(data) > max_bytes:
                        yield (
                            want.pop(r),
                            IngestError("too_large", f"{len(data)} bytes > max_bytes {max_bytes}"),
                        )
                    else:
                        yield want.pop(r), data
            pos += len(col)
            if pos >= hi:
                break
    for r in sorted(want):  # rows beyond the file's end (it was replaced after registration)
        yield want[r], IngestError("not_found", f"{m.unit} has no row {r}")
