"""Parquet files with the image bytes inside, as the Hugging Face ``datasets`` library writes
them: an ``image`` struct column with ``bytes`` and ``path`` (or a plain binary column) and a
caption column whose name is configurable (``caption_field``, default ``text``). Every
``*.parquet`` under the location (local or any fsspec URL) is a unit; a file of R rows becomes
``ceil(R / shard_size)`` partitions. The listing reads only the caption (and id) column; the
images stage streams the image column in row batches.

A caption is text (a string, UTF-8 bytes, or the first of a list of them); anything else is
``bad_caption`` naming its type. A file that cannot be opened as parquet when it is registered
(a damaged footer, not parquet, a link out of the location) is skipped with its reason; one
that breaks after registration fails its rows as ``corrupt_container``, never the partition. A
cell with only a ``path`` (an image kept elsewhere) stays ``missing_image``: a dataset's paths
are never followed.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import NotText, caption_text, failure, row
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError
from flowmatch_assets.ingest.sources.kind import (
    Found,
    ImageRead,
    ListedRow,
    Listing,
    Manifest,
    Skipped,
    SourceKind,
    cut,
)
from flowmatch_assets.ingest.sources.location import Location
from flowmatch_assets.ingest.sources.parquet_pages import BadPage, pages_bytes

BATCH_ROWS = 64  # image rows decoded from parquet at a time (memory: 64 originals)
#: The most bytes one row group's column may hold uncompressed (its footer's column-chunk
#: metadata, checked before reading): a row group above it is not read and its rows fail as
#: ``too_large`` (a 39 KB file of one 600 MiB caption cell and one 600 MiB image cell took
#: GBs to list and to read). Captions are sentences; images are read in batches.
CAPTION_CHUNK_MAX_BYTES = 256 << 20
IMAGE_CHUNK_MAX_BYTES = 512 << 20
#: What reading a damaged parquet file raises.
_BROKEN = (pa.ArrowException, OSError, ValueError, EOFError)


def footer_rows(pf: pq.ParquetFile, size: int | None, rel: str) -> int:
    """The rows ``pf``'s footer claims, refused (``corrupt_container``) when it claims more
    rows than the file has bytes: a footer is the file's own word, and a 2 KB file claiming
    10^10 rows would otherwise be cut into millions of partitions. Every real row of a source
    holds an image or a URL, so a real file always has more bytes than rows."""
    n = pf.metadata.num_rows
    if n < 0 or (size is not None and n > size):
        raise IngestError(
            "corrupt_container",
            f"{rel} claims {n} rows in {size} bytes (more rows than bytes): not registered",
        )
    return n


def _broken(rel: str, e: BaseException) -> IngestError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return IngestError("corrupt_container", f"{rel} cannot be read as parquet: {first}")


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


def _chunk_bytes(pf: pq.ParquetFile, g: int, column: str, f=None, limit: int = 0) -> int:
    """Uncompressed bytes of ``column`` (all its leaves: a struct's ``bytes`` and ``path``) in
    row group ``g``: the footer's word, and with the open file ``f`` the larger of it and what
    the pages' own headers say (what Arrow allocates: ``parquet_pages.py``), read up to past
    ``limit``. A page header that cannot be read raises BadPage."""
    rg = pf.metadata.row_group(g)
    size = _file_size(f)
    total = 0
    for i in range(rg.num_columns):
        c = rg.column(i)
        if c.path_in_schema == column or c.path_in_schema.startswith(column + "."):
            n = c.total_uncompressed_size
            if size is not None:
                start = c.data_page_offset
                if c.has_dictionary_page and c.dictionary_page_offset:
                    start = min(start, c.dictionary_page_offset)
                n = max(n, pages_bytes(f, start, c.num_values, size, limit - total))
            total += n
    return total


def _file_size(f) -> int | None:
    if f is None:
        return None
    try:
        here = f.tell()
        end = f.seek(0, 2)
        f.seek(here)
        return end
    except (OSError, ValueError):
        return None


def _group_rows(pf: pq.ParquetFile, groups: list[int], first: int) -> Iterator[tuple[int, int]]:
    """``(group, its first row)`` of consecutive ``groups`` starting at row ``first``."""
    for g in groups:
        yield g, first
        first += pf.metadata.row_group(g).num_rows


def _too_big(
    pf: pq.ParquetFile, g: int, column: str, limit: int, rel: str, f=None
) -> IngestError | None:
    """``too_large`` when row group ``g``'s ``column`` is above ``limit`` bytes uncompressed
    (its footer, and with the open file ``f`` its pages' headers); ``corrupt_container`` when
    a page header cannot be read."""
    try:
        n = _chunk_bytes(pf, g, column, f, limit)
    except BadPage as e:
        return IngestError("corrupt_container", f"{rel} row group {g}: column {column!r}: {e}")
    if n <= limit:
        return None
    return IngestError(
        "too_large",
        f"{rel} row group {g}: column {column!r} is above {limit} bytes uncompressed (its "
        "footer or its pages); not read",
    )


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


def _stem(m) -> str:
    return posixpath.basename(m.unit).removesuffix(".parquet")


def _rows_of(
    cfg: SourceConfig, name: str, m, stem: str, t: pa.Table, start: int, out: list, failed: list
) -> None:
    """The rows (into ``out``) and failures (into ``failed``) of ``t``, rows ``start``... of
    the file."""
    captions = t.column(cfg.caption()).to_pylist()
    ids = t.column(cfg.id_field).to_pylist() if cfg.id_field else [None] * len(captions)
    for i, (cap, rid) in enumerate(zip(captions, ids)):
        r = start + i
        sid = str(rid) if rid is not None else f"{stem}/{r}"
        url = f"{m.unit}#{r}"
        try:
            text = caption_text(cap)
        except NotText as e:
            failed.append(failure(sid, url, "bad_caption", f"{cfg.caption()} in row {r} is {e}"))
            continue
        if text is None:
            failed.append(
                failure(sid, url, "missing_caption", f"{cfg.caption()} is null in row {r}")
            )
            continue
        out.append(row(cfg, name, sid, url, text, r - m.start))


def _image_bytes(value) -> tuple[bytes | None, str | None]:
    """(bytes, path) of one image cell: the datasets struct, or plain binary."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    else:
        data, path = value, None
    return (data if isinstance(data, bytes) else None), (path if isinstance(path, str) else None)


def _one(value, r: int, max_bytes: int) -> bytes | IngestError:
    data, p = _image_bytes(value)
    if data is None:
        return IngestError(
            "missing_image", f"row {r} has no image bytes" + (f" (path {p!r})" if p else "")
        )
    if len(data) > max_bytes:
        return IngestError("too_large", f"{len(data)} bytes > max_bytes {max_bytes}")
    return data


class ParquetKind(SourceKind):
    """Hugging Face-style parquet files, the image bytes inside (module doc)."""

    name = "parquet"

    def scan(self, cfg: SourceConfig, known: Sequence[Manifest]) -> Found:
        """New partitions ``(file, start row, end row, [])`` for every parquet file under the
        location that is not registered yet, in path order, and the files skipped
        (``(file, reason, detail)``: they cannot be opened as parquet)."""
        loc = Location(cfg)
        held = {m.unit for m in known}
        out, skipped = [], []
        for rel in loc.files():
            if not rel.endswith(".parquet") or rel in held:
                continue
            try:
                with loc.open(rel) as f:
                    n = footer_rows(pq.ParquetFile(f), loc.size(f), rel)
            except IngestError as e:
                skipped.append(Skipped(rel, e.reason, e.detail))
                continue
            except _BROKEN as e:
                e = _broken(rel, e)
                skipped.append(Skipped(rel, e.reason, e.detail))
                continue
            out += cut(rel, n, cfg.shard_size)
        return Found(out, skipped)

    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """The partition's rows (caption and id columns only) and the rows that cannot be
        (``missing_caption``, ``bad_caption``; every row, with the reason, when the file cannot
        be read any more)."""
        loc = Location(cfg)
        stem = _stem(m)
        parts: list[tuple[int, int, pa.Table | IngestError]] = []  # (first row, rows, table or why)
        try:
            with loc.open(m.unit) as f:
                try:
                    pf = pq.ParquetFile(f)
                    _check_columns(pf, cfg, m.unit)
                    cols = [cfg.caption()] + ([cfg.id_field] if cfg.id_field else [])
                    groups, first = _groups(pf, m.start, m.end)
                    for g, at in _group_rows(pf, groups, first):
                        big = _too_big(pf, g, cfg.caption(), CAPTION_CHUNK_MAX_BYTES, m.unit, f)
                        if big is None and cfg.id_field:
                            big = _too_big(pf, g, cfg.id_field, CAPTION_CHUNK_MAX_BYTES, m.unit, f)
                        n = pf.metadata.row_group(g).num_rows
                        parts.append((at, n, big or pf.read_row_group(g, columns=cols)))
                except SourceError:
                    raise  # the source's settings name a column the file lacks: the user's fix
                except _BROKEN as e:
                    raise _broken(m.unit, e) from None
        except IngestError as e:  # the whole file: each of its rows fails with the reason
            return Listing(
                [],
                [
                    failure(f"{stem}/{r}", f"{m.unit}#{r}", e.reason, e.detail)
                    for r in range(m.start, m.end)
                ],
            )
        out, failed = [], []
        for at, n, t in parts:
            lo, hi = max(m.start, at), min(m.end, at + n)
            if isinstance(t, IngestError):  # a row group too big to read: each of its rows says so
                failed += [
                    failure(f"{stem}/{r}", f"{m.unit}#{r}", t.reason, t.detail)
                    for r in range(lo, hi)
                ]
                continue
            _rows_of(cfg, name, m, stem, t.slice(lo - at, hi - lo), lo, out, failed)
        return Listing(out, failed)

    def images(
        self, cfg: SourceConfig, m: Manifest, rows: Sequence[ListedRow], max_bytes: int
    ) -> Iterator[ImageRead]:
        """The image bytes of each row, in order, read from the file's image column in batches of
        ``BATCH_ROWS``; a cell without bytes fails as ``missing_image``; if the file cannot be
        read (any more), the rows not read yet fail with the reason."""
        loc = Location(cfg)
        want = {int(r["url"].rsplit("#", 1)[1]): r for r in rows}
        if not want:
            return
        lo, hi = min(want), max(want) + 1
        broke: IngestError | None = None
        try:
            with loc.open(m.unit) as f:
                try:
                    pf = pq.ParquetFile(f)
                    _check_columns(pf, cfg, m.unit)
                    groups, first = _groups(pf, lo, hi)
                    for g, pos in _group_rows(pf, groups, first):
                        big = _too_big(pf, g, cfg.image_field, IMAGE_CHUNK_MAX_BYTES, m.unit, f)
                        if big is not None:
                            n = pf.metadata.row_group(g).num_rows
                            for r in [r for r in want if pos <= r < pos + n]:
                                yield want.pop(r), big
                            continue
                        cols = [cfg.image_field]
                        for batch in pf.iter_batches(BATCH_ROWS, row_groups=[g], columns=cols):
                            col: pa.Array = batch.column(0)
                            for j in range(len(col)):
                                r = pos + j
                                if r in want:
                                    yield want.pop(r), _one(col[j].as_py(), r, max_bytes)
                            pos += len(col)
                            if pos >= hi:
                                break
                except SourceError:
                    raise  # the source's settings name a column the file lacks: the user's fix
                except _BROKEN as e:
                    raise _broken(m.unit, e) from None
        except IngestError as e:
            broke = e
        for r in sorted(want):  # rows beyond the file's end (it was replaced after registration)
            yield want[r], broke or IngestError("not_found", f"{m.unit} has no row {r}")

    def sample_ids(self, m: Manifest) -> list[str]:
        """A parquet partition's rows are ``<file stem>/<row>``: its manifest lists no entries."""
        return [f"{_stem(m)}/{r}" for r in range(m.start, m.end)]
