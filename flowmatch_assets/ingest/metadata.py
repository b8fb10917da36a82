"""PD12M metadata: discover the source files, cut them into shards, validate, filter.

The real metadata is 125 parquet files ``pd12m.000.parquet`` ... ``pd12m.124.parquet`` of 100k
rows each with columns ``id, url, caption, width, height, mime_type, hash, license, source``.
One partition is one shard of ``shard_size`` rows of one file: key ``NNN-KK`` (file number,
shard number within the file), so keys are stable and sort in dataset order.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

#: The PD12M metadata columns and the arrow type family each must have.
PD12M_COLUMNS: dict[str, str] = {
    "id": "string",
    "url": "string",
    "caption": "string",
    "width": "integer",
    "height": "integer",
    "mime_type": "string",
    "hash": "string",
    "license": "string",
    "source": "string",
}

FILE_RE = re.compile(r"(\d+)\.parquet$")


class MetadataError(ValueError):
    """The metadata source or one of its files is unusable; the message says which and why."""


class FilterConfig(BaseModel):
    """Row filters applied to PD12M metadata before any image is fetched (counted by reason)."""

    min_width: int = Field(default=256, description="Minimum original width in pixels.")
    min_height: int = Field(default=256, description="Minimum original height in pixels.")
    max_aspect_ratio: float = Field(
        default=3.0, description="Maximum long/short side ratio of the original image."
    )
    min_caption_chars: int = Field(
        default=1, description="Minimum caption length (characters, stripped)."
    )
    max_caption_chars: int = Field(
        default=4000, description="Maximum caption length (characters, stripped)."
    )
    min_caption_words: int = Field(
        default=0,
        description="Minimum caption length in words (whitespace-separated, as str.split "
        "counts them); 0 turns the filter off.",
    )
    licenses: list[str] | None = Field(
        default=None,
        description="License allow-list (exact strings); None keeps every license.",
    )
    drop_duplicate_hash: bool = Field(
        default=True,
        description="Keep only the first row of each md5 `hash` in the whole dataset (dataset "
        "order: metadata file, then row; among rows the other filters keep).",
    )
    drop_duplicate_content: bool = Field(
        default=True,
        description="After download, drop a row whose bytes (md5) an earlier row in dataset "
        "order already stored (a wrong metadata hash); see flowmatch_assets/ingest/dedupe.py.",
    )


#: Fields that join the filters' fingerprint (and the dedupe index's digest) only when set, so
#: partitions made before the field existed stay fresh while it is off: field -> its "off" value.
_FINGERPRINT_WHEN_SET: dict[str, object] = {"min_caption_words": 0}


def filter_fields(cfg: FilterConfig, exclude: set[str] | frozenset[str] = frozenset()) -> dict:
    """The filter settings a fingerprint records: every field, less those at their "off"
    value that were added later (``_FINGERPRINT_WHEN_SET``) and ``exclude``."""
    d = cfg.model_dump(exclude=set(exclude))
    for name, off in _FINGERPRINT_WHEN_SET.items():
        if d.get(name, off) == off:
            d.pop(name, None)
    return d


@dataclass(frozen=True)
class ShardSpec:
    """One partition: rows ``[row_start, row_end)`` of one metadata file."""

    key: str
    path: str
    row_start: int
    row_end: int

    def as_dict(self) -> dict:
        return {
            "partition": self.key,
            "source_file": self.path,
            "row_start": self.row_start,
            "row_end": self.row_end,
        }


def shard_key(file_number: int, shard_index: int) -> str:
    return f"{file_number:03d}-{shard_index:02d}"


def parse_shard_key(key: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d{3,})-(\d{2,})", key)
    if not m:
        raise MetadataError(f"partition key {key!r} is not of the form NNN-KK (file-shard)")
    return int(m.group(1)), int(m.group(2))


def metadata_exists(source: str) -> bool:
    """Whether the PD12M metadata source (folder or fsspec URL) is there at all."""
    fs, root = fsspec.core.url_to_fs(source)
    return bool(fs.exists(root))


def list_metadata_files(source: str) -> dict[int, str]:
    """Map file number -> path/URL for every ``*NNN.parquet`` under ``source`` (local or fsspec)."""
    fs, root = fsspec.core.url_to_fs(source)
    if not fs.exists(root):
        raise MetadataError(
            f"metadata source {source!r} does not exist; point FLOWMATCH_METADATA (or the "
            "resource's metadata_source) at the folder of pd12m.NNN.parquet files, run "
            "`flowmatch demo-data` to write the embedded sample, or add a source of your own "
            "images (`flowmatch sources add`)"
        )
    out: dict[int, str] = {}
    for p in sorted(fs.ls(root, detail=False)):
        name = p.rsplit("/", 1)[-1]
        m = FILE_RE.search(name)
        if not m or name.startswith("."):
            continue
        n = int(m.group(1))
        if n in out:
            raise MetadataError(f"two metadata files share number {n}: {out[n]} and {p}")
        out[n] = p if "://" not in source else fs.unstrip_protocol(p)
    return out


def _open(path: str):
    return fsspec.open(path, "rb").open()


def validate_schema(schema: pa.Schema, path: str) -> None:
    """Raise MetadataError naming every missing or mistyped PD12M column."""
    problems = []
    for col, kind in PD12M_COLUMNS.items():
        if col not in schema.names:
            problems.append(f"missing column {col!r}")
            continue
        t = schema.field(col).type
        ok = (
            pa.types.is_integer(t) or pa.types.is_floating(t)
            if kind == "integer"
            else pa.types.is_string(t) or pa.types.is_large_string(t)
        )
        if not ok:
            problems.append(f"column {col!r} has type {t}, expected {kind}")
    if problems:
        raise MetadataError(
            f"{path}: not PD12M metadata: "
            + "; ".join(problems)
            + f" (expected columns: {', '.join(PD12M_COLUMNS)})"
        )


def discover_shards(source: str, shard_size: int) -> list[ShardSpec]:
    """Every shard of every metadata file under ``source``, in key order."""
    if shard_size <= 0:
        raise MetadataError(f"shard_size must be positive, got {shard_size}")
    specs: list[ShardSpec] = []
    for n, path in list_metadata_files(source).items():
        with _open(path) as f:
            md = pq.ParquetFile(f).metadata
            validate_schema(md.schema.to_arrow_schema(), path)
            rows = md.num_rows
        for k in range(max(1, math.ceil(rows / shard_size))):
            specs.append(
                ShardSpec(shard_key(n, k), path, k * shard_size, min(rows, (k + 1) * shard_size))
            )
    return specs


#: The row groups of the metadata file read last, kept for the next partition of the same file
#: (PD12M's files are one row group of 100k rows: ten partitions, one read, in one process).
_LAST_READ: dict[tuple, pa.Table] = {}
_LAST_READ_LOCK = threading.Lock()


def _read_groups(pf: pq.ParquetFile, path: str, groups: list[int]) -> pa.Table:
    """``groups`` of ``pf`` (the PD12M columns); the last file's are reused while its size and
    modification time are the same."""
    fs, p = fsspec.core.url_to_fs(path)
    info = fs.info(p)
    stamp = next((info[k] for k in ("mtime", "LastModified", "ETag", "etag") if k in info), None)
    key = (path, info.get("size"), str(stamp), tuple(groups))
    with _LAST_READ_LOCK:
        if stamp is not None and key in _LAST_READ:
            return _LAST_READ[key]
    table = pf.read_row_groups(groups, columns=list(PD12M_COLUMNS))
    if stamp is not None:
        with _LAST_READ_LOCK:
            _LAST_READ.clear()
            _LAST_READ[key] = table
    return table


def read_metadata_shard(source: str, key: str, shard_size: int) -> tuple[pa.Table, ShardSpec]:
    """Read the rows of partition ``key`` (with a ``row_index`` column: position in the file)."""
    file_number, shard_index = parse_shard_key(key)
    files = list_metadata_files(source)
    if file_number not in files:
        raise MetadataError(
            f"partition {key}: no metadata file number {file_number} under {source!r} "
            f"(found {len(files)} files)"
        )
    path = files[file_number]
    with _open(path) as f:
        pf = pq.ParquetFile(f)
        validate_schema(pf.schema_arrow, path)
        rows = pf.metadata.num_rows
        start, end = shard_index * shard_size, min(rows, (shard_index + 1) * shard_size)
        if start >= rows and not (start == 0 and rows == 0):
            raise MetadataError(
                f"partition {key}: shard {shard_index} starts at row {start} but {path} has "
                f"{rows} rows (was shard_size changed? it is {shard_size})"
            )
        # read only the row groups that overlap [start, end)
        groups, offset, first = [], 0, None
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > start and offset < end:
                groups.append(g)
                first = offset if first is None else first
            offset += n
        table = _read_groups(pf, path, groups) if groups else None
    if table is None:
        table = pa.table({c: pa.array([], pa.string()) for c in PD12M_COLUMNS})
        first = start
    table = table.slice(start - first, end - start)
    table = table.append_column("row_index", pa.array(range(start, end), pa.int64()))
    return table, ShardSpec(key, path, start, end)


#: ``winners(table, eligible)``: for the rows ``eligible`` (indices into ``table``, each kept by
#: every other filter and carrying a hash), ``{index: (kept_partition, kept_id)}`` of those that
#: are not their hash's first occurrence (flowmatch_assets.ingest.dedupe: across the whole dataset).
HashWinners = Callable[[pa.Table, list[int]], dict[int, tuple[str, str]]]


def _first_in_table(table: pa.Table, eligible: list[int]) -> dict[int, tuple[str, str]]:
    """Within ``table`` only: every row but the first of each hash."""
    hashes, ids = table.column("hash").to_pylist(), table.column("id").to_pylist()
    first: dict[str, int] = {}
    out = {}
    for i in eligible:
        j = first.setdefault(hashes[i], i)
        if j != i:
            out[i] = ("", str(ids[j]))
    return out


def size_reason(w: int | None, h: int | None, cfg: FilterConfig) -> tuple[str, str] | None:
    """The size filter that drops an original of ``w`` x ``h`` (reason, detail), or None; the
    metadata's claimed size here, the decoded size for a source's own images (ingest/shard.py)."""
    if w is not None and h is not None and (w < cfg.min_width or h < cfg.min_height):
        return "small_original", f"{w}x{h} < {cfg.min_width}x{cfg.min_height}"
    if w and h and max(w, h) / min(w, h) > cfg.max_aspect_ratio:
        return "aspect_ratio", f"{w}x{h}: {max(w, h) / min(w, h):.2f} > {cfg.max_aspect_ratio}"
    return None


def _row_reason(
    url: str | None,
    width: int | None,
    height: int | None,
    caption: str | None,
    license: str | None,
    cfg: FilterConfig,
    allowed: set | None,
) -> tuple[str, str] | None:
    """The first row-local filter that drops a row (reason, detail), or None."""
    caption = (caption or "").strip()
    if not (url or "").strip():
        return "missing_url", "empty url"
    if why := size_reason(width, height, cfg):
        return why
    if len(caption) < cfg.min_caption_chars:
        return "caption_too_short", f"{len(caption)} chars < {cfg.min_caption_chars}"
    if len(caption) > cfg.max_caption_chars:
        return "caption_too_long", f"{len(caption)} chars > {cfg.max_caption_chars}"
    if cfg.min_caption_words > 0 and (words := len(caption.split())) < cfg.min_caption_words:
        return "caption_too_few_words", f"{words} words < {cfg.min_caption_words}"
    if allowed is not None and license not in allowed:
        return "license", f"license {license!r} not allowed"
    return None


def _surely_kept(table: pa.Table, cfg: FilterConfig) -> np.ndarray | None:
    """Which rows no row-local filter drops, found by column (a Python call per row costs ~3
    µs: 40 s over PD12M's files when the hash index is built): only rows whose url and caption
    begin and end with a printable ASCII character (so ``strip`` leaves them as they are) and
    whose size is known and not zero; every other row is left to :func:`_row_reason`. None:
    the table lacks a column."""
    names = set(table.column_names)
    if not {"url", "width", "height", "caption"} <= names or (
        cfg.licenses is not None and "license" not in names
    ):
        return None

    def plain(c) -> pa.ChunkedArray:  # non-empty, no whitespace at either end
        c = c.cast(pa.string())
        return pc.and_(pc.match_substring_regex(c, "^[!-~]"), pc.match_substring_regex(c, "[!-~]$"))

    try:
        w = table.column("width").cast(pa.float64())
        h = table.column("height").cast(pa.float64())
        cap = table.column("caption").cast(pa.string())
        url = plain(table.column("url"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # odd types: row by row
        return None
    length = pc.utf8_length(cap)
    ok = [
        url,
        plain(cap),
        pc.greater_equal(length, cfg.min_caption_chars),
        pc.less_equal(length, cfg.max_caption_chars),
        pc.greater(w, 0),
        pc.greater(h, 0),
        pc.greater_equal(w, cfg.min_width),
        pc.greater_equal(h, cfg.min_height),
        pc.less_equal(
            pc.divide(pc.max_element_wise(w, h), pc.min_element_wise(w, h)), cfg.max_aspect_ratio
        ),
    ]
    if cfg.min_caption_words > 0:  # vouched for only where str.split's whitespace is the space:
        ok.append(pc.match_substring_regex(cap, "^[ -~]*$"))  # printable ASCII and spaces
        ok.append(pc.greater_equal(pc.count_substring_regex(cap, "[!-~]+"), cfg.min_caption_words))
    if cfg.licenses is not None:
        ok.append(pc.is_in(table.column("license"), value_set=pa.array(cfg.licenses)))
    mask = ok[0]
    for m in ok[1:]:
        mask = pc.and_(mask, m)
    return pc.fill_null(mask, False).to_numpy(zero_copy_only=False).astype(bool)


def filter_rows(
    table: pa.Table, cfg: FilterConfig, winners: HashWinners | None = None
) -> tuple[pa.Table, list[dict]]:
    """Apply the row filters. Returns the kept rows and one ``{id, url, reason, detail,
    kept_id, kept_partition}`` per filtered row; every row is either kept or filtered with
    exactly one reason. Duplicate hashes: among the rows every other filter keeps, only each
    hash's first occurrence stays (``winners``: across the dataset; default: within ``table``).
    Works by column: the rows :func:`_surely_kept` cannot vouch for go through
    :func:`_row_reason` one by one (a dict per row cost ~0.1 s a 10k-row partition)."""
    n = table.num_rows

    def col(name: str, rows) -> list:
        if name not in table.column_names:
            return [None] * len(rows)
        return table.column(name).take(pa.array(rows, pa.int64())).to_pylist()

    allowed = set(cfg.licenses) if cfg.licenses is not None else None
    sure = _surely_kept(table, cfg)  # the rest: the one definition, row by row
    ask = np.arange(n) if sure is None else np.flatnonzero(~sure)
    reasons: dict[int, tuple] = {}
    looked = zip(*(col(c, ask) for c in ("url", "width", "height", "caption", "license")))
    for i, (u, w, h, c, lic) in zip(ask.tolist(), looked):
        why = _row_reason(u, w, h, c, lic, cfg, allowed)
        if why is not None:
            reasons[i] = why
    if "hash" in table.column_names:
        hashes = table.column("hash").cast(pa.string())
        present = pc.fill_null(pc.greater(pc.utf8_length(hashes), 0), False)
        present = present.to_numpy(zero_copy_only=False).astype(bool)
    else:
        present = np.zeros(n, bool)
    if cfg.drop_duplicate_hash:
        flagged = np.zeros(n, bool)
        flagged[list(reasons)] = True
        eligible = np.flatnonzero(present & ~flagged).tolist()
        dups = (winners or _first_in_table)(table, eligible)
        dup_hash = dict(zip(dups, col("hash", list(dups))))
        for i, (kp, kid) in dups.items():
            where = f"{kp}, " if kp else ""
            detail = f"hash {dup_hash[i]} first kept as {where}id {kid}"
            reasons[i] = ("duplicate_hash", detail, kid, kp or None)
    out = sorted(reasons)
    filtered: list[dict] = []
    for i, id_, url, h in zip(out, col("id", out), col("url", out), col("hash", out)):
        reason, detail, kept_id, kept_partition = (*reasons[i], None, None)[:4]
        filtered.append(
            {
                "id": str(id_),
                "url": url,
                "reason": reason,
                "detail": detail,
                "kept_id": kept_id,
                "kept_partition": kept_partition,
                "hash": h,
            }
        )
    if not out:
        return table, filtered
    keep = np.ones(n, bool)
    keep[out] = False
    return table.filter(pa.array(keep)), filtered


def ids_as_strings(table: pa.Table) -> pa.Table:
    """PD12M ids are strings; cast other id types so downstream joins are uniform."""
    i = table.schema.get_field_index("id")
    if not pa.types.is_string(table.schema.field(i).type):
        table = table.set_column(i, "id", pc.cast(table.column(i), pa.string()))
    return table
