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

A list file is read whole, bounded (``LIST_MAX_BYTES``, a ``.tsv.gz`` decompressed too) and
confined like every source read (``location.Location``).

PD12M itself is such a list, with the partition keys and the dedupe it had before sources
existed, kept so every data root and Dagster instance keeps working: :class:`Pd12mSource`
(registered in :data:`BUILT_IN`) reads the ``pd12m.NNN.parquet`` metadata files under the
resource's ``metadata_source`` (keys ``NNN-KK``, found anew from the files, never registered),
dedupes by hash across the whole dataset (``ingest/dedupe.py``) and has its images downloaded.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import posixpath
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import NotText, caption_text, failure, mime_of, row
from flowmatch_assets.ingest.sources.config import SourceConfig, SourceError
from flowmatch_assets.ingest.sources.kind import (
    Found,
    ImageRead,
    ListedRow,
    Listing,
    Manifest,
    PartitionSource,
    Skipped,
    SourceKind,
    cut,
)
from flowmatch_assets.ingest.sources.location import Location
from flowmatch_assets.ingest.sources.parquet import footer_rows
from flowmatch_models.storage.layout import PD12M

#: The list formats read (img2dataset's input formats), by the file name's ending.
LIST_SUFFIXES = (".csv", ".tsv", ".tsv.gz", ".jsonl", ".parquet")
#: The most bytes a list file may hold (a ``.tsv.gz``: decompressed), checked while reading.
LIST_MAX_BYTES = 1 << 30
#: What reading a damaged list raises.
_BROKEN = (pa.ArrowException, OSError, ValueError, EOFError, UnicodeDecodeError, csv.Error)


def _suffix(rel: str) -> str | None:
    return next((s for s in LIST_SUFFIXES if rel.lower().endswith(s)), None)


def _stem(unit: str) -> str:
    base = posixpath.basename(unit)
    return base[: -len(_suffix(base) or "")] if _suffix(base) else base


def _columns(cfg: SourceConfig) -> dict[str, str]:
    """The columns a list must have, by setting: ``{url_field: ..., caption_field: ...}``
    (``hash_field``, ``id_field`` when set)."""
    want = {"url_field": cfg.url(), "caption_field": cfg.caption()}
    want |= {k: getattr(cfg, k) for k in ("hash_field", "id_field") if getattr(cfg, k)}
    return want


def _check(names: Sequence[str], cfg: SourceConfig, rel: str) -> None:
    """SourceError (the user's fix) when the list lacks a column its settings name."""
    for key, col in _columns(cfg).items():
        if col not in names:
            raise SourceError(
                f"{rel} has no column {col!r} (the source's {key}); its columns: "
                f"{', '.join(map(str, names))}. Set {key} in the sources file"
            )


def _gunzip(data: bytes, rel: str) -> bytes:
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
        out = g.read(LIST_MAX_BYTES + 1)
    if len(out) > LIST_MAX_BYTES:
        raise IngestError("too_large", f"{rel} is above {LIST_MAX_BYTES} bytes decompressed")
    return out


def read_list(loc: Location, rel: str, cfg: SourceConfig) -> pa.Table | list[dict | None]:
    """The columns its settings name of every row of list file ``rel``: a table, or (jsonl)
    one ``{column: value}`` per line (None: a line that is not a JSON object). Raises
    SourceError for a missing column, IngestError for a file that cannot be read."""
    suffix = _suffix(rel)
    cols = list(_columns(cfg).values())
    try:
        if suffix == ".parquet":
            with loc.open(rel) as f:
                pf = pq.ParquetFile(f)
                _check(pf.schema_arrow.names, cfg, rel)
                return pf.read(columns=cols)
        data = loc.read(rel, LIST_MAX_BYTES, "url list")
        if suffix == ".tsv.gz":
            data = _gunzip(data, rel)
        if suffix == ".jsonl":
            return _jsonl(data, cfg, rel)
        delim = "," if suffix == ".csv" else "\t"
        first = data.split(b"\n", 1)[0].decode("utf-8-sig").rstrip("\r")
        _check(next(csv.reader([first], delimiter=delim), []), cfg, rel)
        return pacsv.read_csv(
            io.BytesIO(data),
            parse_options=pacsv.ParseOptions(delimiter=delim, newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                include_columns=cols, column_types={c: pa.string() for c in cols}
            ),
        )
    except (SourceError, IngestError):
        raise
    except _BROKEN as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise IngestError("corrupt_container", f"{rel} cannot be read as a list: {first}") from None


def _jsonl(data: bytes, cfg: SourceConfig, rel: str) -> list[dict | None]:
    out: list[dict | None] = []
    keys: set[str] = set()
    for line in data.decode("utf-8-sig").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        out.append(obj if isinstance(obj, dict) else None)
        keys |= set(obj) if isinstance(obj, dict) else set()
    if keys:  # a column no line has is a setting to fix, as a csv header's would be
        _check(sorted(keys), cfg, rel)
    return out


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
        """New partitions ``(file, start row, end row, [])`` for every list file under the
        location not registered yet, in path order; the files that cannot be read, skipped."""
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
                else:
                    n = len(read_list(loc, rel, cfg))
            except IngestError as e:
                skipped.append(Skipped(rel, e.reason, e.detail))
                continue
            except _BROKEN as e:
                skipped.append(Skipped(rel, "corrupt_container", f"{rel}: {e}"[:200]))
                continue
            out += cut(rel, n, cfg.shard_size)
        return Found(out, skipped)

    def rows(self, cfg: SourceConfig, name: str, m: Manifest) -> Listing:
        """Rows ``[start, end)`` of the list that carry a URL and a caption; the others fail
        (``missing_url``, ``missing_caption``, ``bad_caption``, ``bad_metadata``)."""
        stem = _stem(m.unit)
        try:
            listed = read_list(Location(cfg), m.unit, cfg)
        except IngestError as e:  # the whole file: each of its rows fails with the reason
            return Listing(
                [],
                [failure(f"{stem}/{r}", None, e.reason, e.detail) for r in range(m.start, m.end)],
            )
        n = len(listed)
        if isinstance(listed, pa.Table):  # only this partition's rows become Python objects
            listed = listed.slice(m.start, max(0, min(n, m.end) - m.start)).to_pylist()
        else:
            listed = listed[m.start : m.end]
        out: list[ListedRow] = []
        failed = []
        for r in range(m.start, m.end):
            if r >= n:
                failed.append(failure(f"{stem}/{r}", None, "not_found", f"{m.unit} has no row {r}"))
                continue
            got = listed[r - m.start]
            if got is None:
                failed.append(
                    failure(
                        f"{stem}/{r}",
                        None,
                        "bad_metadata",
                        f"line {r} of {m.unit} is not a JSON object",
                    )
                )
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
