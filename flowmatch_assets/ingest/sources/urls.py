"""URL lists as a source (kind ``urls``), and PD12M: the built-in source of that kind.

A ``urls`` source is a list of image URLs with their captions in one of img2dataset's input
formats: ``.csv``, ``.tsv``, ``.tsv.gz``, ``.jsonl`` or ``.parquet`` (one list file as the
location, or a folder of them; local or any fsspec URL). The columns are settable as
img2dataset's ``--url_col``/``--caption_col`` are: ``url_field`` (default ``url``),
``caption_field`` (default ``caption``), ``hash_field`` (an md5 of each image's bytes; none by
default) and ``id_field`` (default ``<file stem>/<row>``). A list of R rows becomes
``ceil(R / shard_size)`` partitions. The listing keeps the rows that carry a URL and a caption;
a row without one fails as ``missing_url`` or ``missing_caption`` (a caption that is not text:
``bad_caption``; a jsonl line that is not a JSON object: ``bad_metadata``). The images stage
DOWNLOADS a ``urls`` partition's rows (:attr:`UrlsKind.downloads`) exactly as it downloads
PD12M's: the guarded address pool (``ingest.allow_networks``), the thread pool, the byte and
time bounds, and the md5 check where the row has a hash (``ingest.check_hash``).

A list file is never read whole: it is streamed once at registration and each partition reads
its own stretch, a bad row costing its own row (``url_lists.py``); reads are confined like every
source read (``location.Location``).

PD12M itself is such a list, with the partition keys and the dedupe it had before sources
existed, kept so every data root and Dagster instance keeps working: :class:`Pd12mSource`
(registered in :data:`BUILT_IN`) reads the ``pd12m.NNN.parquet`` metadata files under the
resource's ``metadata_source`` (keys ``NNN-KK``, found anew from the files, never registered),
dedupes by hash across the whole dataset (``ingest/dedupe.py``) and has its images downloaded.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources import url_lists as lists
from flowmatch_assets.ingest.sources.common import NotText, caption_text, failure, mime_of, row
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError
from flowmatch_assets.ingest.sources.kind import (
    Found,
    ImageRead,
    ListedRow,
    Listing,
    Manifest,
    NewPartition,
    PartitionSource,
    Skipped,
    SourceKind,
    cut,
)
from flowmatch_assets.ingest.sources.location import Location
from flowmatch_assets.ingest.sources.parquet import _group_rows, _groups, _too_big, footer_rows
from flowmatch_models.storage.layout import PD12M

#: The list formats read (img2dataset's input formats), by the file name's ending.
LIST_SUFFIXES = (".csv", ".tsv", ".tsv.gz", ".jsonl", ".parquet")
#: What reading a damaged parquet list raises.
_BROKEN = (pa.ArrowException, OSError, ValueError, EOFError)


def _suffix(rel: str) -> str | None:
    return next((s for s in LIST_SUFFIXES if rel.lower().endswith(s)), None)


def _stem(unit: str) -> str:
    base = posixpath.basename(unit)
    return base[: -len(_suffix(base) or "")] if _suffix(base) else base


def _open_text(loc: Location, rel: str, cfg: SourceConfig, f) -> tuple[lists.Stream, list | None]:
    """The list's stream and (csv/tsv) its checked header."""
    stream = lists.open_text(f, rel, cfg.deadline_s)
    if _suffix(rel) == ".jsonl":
        return stream, None
    delim = "," if _suffix(rel) == ".csv" else "\t"
    return stream, lists.header_of(stream, delim, cfg, rel, list(lists.columns(cfg).values()))


def _scan_text(loc: Location, rel: str, cfg: SourceConfig) -> list[NewPartition]:
    """A text list read once, streamed: its partitions, each with the span of its stretch."""
    size = cfg.shard_size
    with loc.open(rel, stream_ok=True) as f:
        stream, header = _open_text(loc, rel, cfg, f)
        n, start, spans = 0, stream.pos, []
        for _ in lists.text_records(stream, cfg, rel, header, check=True):
            n += 1
            if n % size == 0:
                spans.append([start, stream.pos])
                start = stream.pos
        if n == 0 or n % size:
            spans.append([start, stream.pos])
    return [
        NewPartition(rel, k * size, min(n, (k + 1) * size), [], span)
        for k, span in enumerate(spans)
    ]


def _text_records(loc: Location, m: Manifest, cfg: SourceConfig) -> Iterator[lists.Record]:
    """The records of rows ``[m.start, m.end)`` of a text list: its own stretch (``m.span``;
    a plain file seeks there, a ``.tsv.gz`` is decompressed up to it), else the rows before
    it read past."""
    with loc.open(m.unit, stream_ok=True) as f:
        stream, header = _open_text(loc, m.unit, cfg, f)
        span, skip = getattr(m, "span", None), m.start
        if span and span[0] >= stream.pos:
            plain = not m.unit.lower().endswith(".gz") and f.seekable()
            if plain:
                f.seek(span[0])
                stream = lists.Stream(f, m.unit, cfg.deadline_s)
                stream.pos = span[0]
            else:
                stream.skip(span[0] - stream.pos)
            skip = 0
        records = lists.text_records(stream, cfg, m.unit, header)
        for _ in range(skip):
            if next(records, None) is None:
                return
        for _, rec in zip(range(m.start, m.end), records):
            yield rec


def _parquet_records(loc: Location, m: Manifest, cfg: SourceConfig) -> Iterator[lists.Record]:
    """The records of rows ``[m.start, m.end)`` of a parquet list, read per row group (each
    column's size checked against the footer first: ``too_large``)."""
    want = list(lists.columns(cfg).values())
    try:
        with loc.open(m.unit) as f:
            pf = pq.ParquetFile(f)
            lists.check_columns(pf.schema_arrow.names, cfg, m.unit, want)
            groups, first = _groups(pf, m.start, m.end)
            for g, at in _group_rows(pf, groups, first):
                lo, hi = max(m.start, at), min(m.end, at + pf.metadata.row_group(g).num_rows)
                big = next(
                    (e for c in want if (e := _too_big(pf, g, c, LIST_CELLS_MAX, m.unit, f))), None
                )
                if big is not None:
                    yield from [(None, (big.reason, big.detail))] * (hi - lo)
                    continue
                table = pf.read_row_group(g, columns=want).slice(lo - at, hi - lo)
                for values in table.to_pylist():
                    yield values, None
    except (SourceError, IngestError):
        raise  # a column the settings name is missing (the user's fix); a refused read
    except _BROKEN as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise IngestError("corrupt_container", f"{m.unit} cannot be read: {first}") from None


#: The most bytes one row group's URL, caption, hash or id column may hold uncompressed.
LIST_CELLS_MAX = 256 << 20


def _text(value) -> str | None:
    """A cell as stripped text; None when empty."""
    if value is None:
        return None
    s = str(value).strip()
    return s or None


class UrlsKind(SourceKind):
    """Lists of image URLs and captions (module doc); the images stage downloads them."""

    name = "urls"
    downloads: ClassVar[bool] = True

    def scan(self, cfg: SourceConfig, known: Sequence[Manifest]) -> Found:
        """New partitions ``(file, start row, end row, [], span)`` for every list file under
        the location not registered yet, in path order; the files that cannot be read,
        skipped. A text list is streamed once (``url_lists.py``); a parquet list's footer
        may not claim more rows than the file has bytes."""
        loc = Location(cfg)
        held = {m.unit for m in known}
        out, skipped = [], []
        for rel in loc.files():
            if _suffix(rel) is None or rel in held:
                continue
            try:
                if _suffix(rel) == ".parquet":
                    with loc.open(rel) as f:
                        n = footer_rows(pq.ParquetFile(f), loc.size(f), rel)
                    out += cut(rel, n, cfg.shard_size)
                else:
                    out += _scan_text(loc, rel, cfg)
            except IngestError as e:
                skipped.append(Skipped(rel, e.reason, e.detail))
            except SourceError:
                raise
            except _BROKEN as e:
                skipped.append(Skipped(rel, "corrupt_container", f"{rel}: {e}"[:200]))
        return Found(out, skipped)

    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """Rows ``[start, end)`` of the list that carry a URL and a caption; the others fail
        (``missing_url``, ``missing_caption``, ``bad_caption``, ``bad_metadata``)."""
        stem = _stem(m.unit)
        loc = Location(cfg)
        read = _parquet_records if _suffix(m.unit) == ".parquet" else _text_records
        records: list[lists.Record] = []
        try:
            records.extend(read(loc, m, cfg))
        except IngestError as e:  # the rest of the file: each of its rows fails with the reason
            records += [(None, (e.reason, e.detail))] * (m.end - m.start - len(records))
        out: list[ListedRow] = []
        failed = []
        for r in range(m.start, m.end):
            if r - m.start >= len(records):
                failed.append(failure(f"{stem}/{r}", None, "not_found", f"{m.unit} has no row {r}"))
                continue
            got, why = records[r - m.start]
            if got is None:
                reason, detail = why
                failed.append(failure(f"{stem}/{r}", None, reason, f"row {r}: {detail}"))
                continue
            sid = _text(got.get(cfg.id_field)) if cfg.id_field else None
            sid = sid or f"{stem}/{r}"
            url = _text(got.get(cfg.url()))
            if url is None:
                failed.append(failure(sid, None, "missing_url", f"{cfg.url()} is empty in row {r}"))
                continue
            try:
                text = caption_text(got.get(cfg.caption()))
            except NotText as e:
                failed.append(
                    failure(sid, url, "bad_caption", f"{cfg.caption()} in row {r} is {e}")
                )
                continue
            if not text:
                failed.append(
                    failure(sid, url, "missing_caption", f"{cfg.caption()} is empty in row {r}")
                )
                continue
            one = row(cfg, name, sid, url, text, r - m.start)
            one["mime_type"] = mime_of(url.split("?", 1)[0])
            one["hash"] = _text(got.get(cfg.hash_field)) if cfg.hash_field else None
            out.append(one)
        return Listing(out, failed)

    def images(
        self, cfg: SourceConfig, m: Manifest, rows: Sequence[ListedRow], max_bytes: int
    ) -> Iterator[ImageRead]:
        """Never called: the images stage downloads a ``urls`` partition (``downloads``)."""
        raise TypeError("a urls partition's images are downloaded by the images stage")

    def sample_ids(self, m: Manifest) -> list[str]:
        """A list partition's rows are ``<file stem>/<row>``: its manifest lists no entries."""
        return [f"{_stem(m.unit)}/{r}" for r in range(m.start, m.end)]


# ------------------------------------------------------------------- PD12M, the built-in source


class Pd12mSource(PartitionSource):
    """PD12M (module doc): its partitions are found from the metadata files under the
    resource's ``metadata_source`` (``NNN-KK``), its rows are a metadata shard's with the
    dataset-wide hash dedupe, its images are downloaded. ``res``: the FlowmatchResource."""

    registers: ClassVar[bool] = False

    def __init__(self, res) -> None:
        self.res, self.name = res, PD12M

    def partitions(self) -> list[dict]:
        """Its shards as catalog ``partitions`` rows; none when the metadata source is absent
        and sources of the user's own images are configured (otherwise: MetadataError)."""
        from flowmatch_assets.ingest.metadata import discover_shards, metadata_exists

        res = self.res
        if res.sources and not metadata_exists(res.metadata_source):
            return []
        specs = discover_shards(res.metadata_source, res.shard_size)
        return [{**s.as_dict(), "source": self.name} for s in specs]

    def rows(self, key: str, log: Callable[[str], None]) -> tuple[pa.Table, list[dict], dict]:
        """The shard's rows of its metadata file (no listing failures), with the global hash
        dedupe's winners (flowmatch_assets/ingest/dedupe.py)."""
        from flowmatch_assets.ingest.dedupe import build_hash_index, hash_winners
        from flowmatch_assets.ingest.metadata import (
            ids_as_strings,
            parse_shard_key,
            read_metadata_shard,
        )

        res = self.res
        table, spec = read_metadata_shard(res.metadata_source, key, res.shard_size)
        table = ids_as_strings(table)
        extra: dict = {
            "source_file": spec.path,
            "row_start": spec.row_start,
            "row_end": spec.row_end,
        }
        if res.filters.drop_duplicate_hash:  # across the whole dataset: dedupe.py
            index = build_hash_index(
                res.data_root, res.metadata_source, res.filters, res.shard_size, log=log
            )
            extra["winners"] = hash_winners(index, parse_shard_key(key)[0])
        return table, [], extra

    def reader(self, key: str, max_bytes: int) -> None:
        """None: the images stage downloads each row's URL."""
        return None

    def row_fields(self) -> dict:
        return {"shard_size": self.res.shard_size}

    def listing(self, key: str) -> list[dict]:
        """Every row of the shard's metadata file (the data card's input rows)."""
        from flowmatch_assets.ingest.metadata import ids_as_strings, read_metadata_shard

        table, _ = read_metadata_shard(self.res.metadata_source, key, self.res.shard_size)
        return ids_as_strings(table).to_pylist()


#: The sources every data root has, by name, beside the configured ones (their keys are not
#: ``<name>-NNNNN``: flowmatch_models.storage.layout.source_of).
BUILT_IN: dict[str, type[PartitionSource]] = {PD12M: Pd12mSource}
