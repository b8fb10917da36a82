"""The catalog's summaries: compact tables the reports read instead of every record file.

Materializations keep writing one small parquet record per partition and asset (and the per-row
records beside it), lock-free and atomic: that is what lets parallel partitions never contend.
But a report that opened every record file would cost ~5 files a partition per query (PD12M:
~6,200), and the data card would join ~12M per-row records each time. So the catalog keeps
derived tables under ``<root>/catalog/summary/``, brought up to date from the records that
changed since (:func:`refresh`, under a file lock, before every catalog query):

    materializations.parquet   every materialization record, one row each (older record
                               schemas padded with NULLs: ``union_by_name``)
    outcomes.parquet           rows per (asset, partition, outcome, reason) of the row records
    content/<partition>.u64    the sorted 64-bit hashes of a partition's stored md5s
    content_losers.parquet     stored rows whose bytes an earlier row (dataset order) stored too
    state/                     per record folder its mtime when last listed and which files
                               have an older schema; per file its inode, size and mtime

and, beside the card records, ``<root>/catalog/card_summaries/<partition>.parquet``: one
partition's data card (counts, exact statistics, and bins that merge into the dataset's),
written with the card records (``record_card_rows``) and redone here only when one of its
inputs changed since (its card, metadata or image row records, its content losers).

A record file is re-read only when its identity changed (a rewrite is an atomic rename: a new
inode); a folder whose mtime did not change is not even listed. Nothing here is a source of
truth: deleting ``summary/`` rebuilds it (so does a new ``SUMMARY_VERSION`` or DuckDB).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog.records import (
    CARD_SCHEMA,
    CONTENT_SCHEMA,
    DUPLICATE_SCHEMA,
    MATERIALIZATION_SCHEMA,
    ROW_SCHEMA,
    SUMMARY_KEY,
)
from flowmatch_models.layout import DataLayout

#: Bump when a summary's definition changes: every summary is rebuilt from the records.
SUMMARY_VERSION = "1"
#: The per-row record kinds, their folder under ``catalog/`` and today's schema.
ROW_KINDS = {
    "rows": ROW_SCHEMA,
    "attempts": ROW_SCHEMA,
    "duplicates": DUPLICATE_SCHEMA,
    "content": CONTENT_SCHEMA,
    "cards": CARD_SCHEMA,
}
OUTCOME_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("outcome", pa.string()),
        ("reason", pa.string()),
        ("rows", pa.int64()),
    ]
)
LOSER_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("id", pa.string()),
        ("md5", pa.string()),
        ("kept_partition", pa.string()),
        ("kept_id", pa.string()),
    ]
)
#: One partition's data card: ``item`` (a count section's value) or ``value`` (one value of a
#: distribution), and how many rows have it.
CARD_SUMMARY_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("section", pa.string()),
        ("item", pa.string()),
        ("value", pa.float64()),
        ("n", pa.int64()),
    ]
)
#: Record files read per DuckDB query (bounds the memory of the first build).
BATCH = 256
#: Hashes held at once while looking for repeated md5s (x 8 bytes).
HASHES_PER_PASS = 8_000_000
#: A directory changed less than this long ago is listed even if its mtime looks unchanged
#: (two renames within one timestamp tick).
FRESH_DIR_S = 2.0


def summary_dir(layout: DataLayout) -> Path:
    return layout.catalog_dir / "summary"


def card_summary_path(layout: DataLayout, partition: str) -> Path:
    """A partition's data card summary: written with its card records (``record_card_rows``),
    redone by :func:`refresh` when one of its inputs changed since."""
    return layout.catalog_dir / "card_summaries" / f"{partition}.parquet"


def _version() -> str:
    return f"{SUMMARY_VERSION}/duckdb-{duckdb.__version__}"


# ------------------------------------------------------------------------------- writing


def _replace(path: Path, write) -> None:
    """``write(tmp)`` then rename onto ``path``: readers see the old file or the new one; a
    failed write (a full disk) leaves no temp file. No fsync: a summary is derived data, and
    one that does not read is rebuilt (:func:`refresh`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_bytes(path: Path, data: bytes) -> None:
    _replace(path, lambda tmp: tmp.write_bytes(data))


def _write_table(path: Path, table: pa.Table) -> None:
    _replace(path, lambda tmp: pq.write_table(table, tmp))


# ---------------------------------------------------------------------------- record files


class _File(NamedTuple):
    """A record file: its path, its folder's name (the asset) and its stem (the partition)."""

    path: str
    asset: str
    partition: str


@dataclass
class _Changes:
    """Per kind: the record files changed or new (re-read them) and gone (drop them)."""

    changed: dict[str, list[_File]] = field(default_factory=dict)
    gone: dict[str, list[_File]] = field(default_factory=dict)

    def any(self, kind: str) -> bool:
        return bool(self.changed.get(kind) or self.gone.get(kind))


class _State:
    """What the summaries were made from: per record folder (``<kind>/<asset>``) its mtime and
    inode when last listed and whether any file has an older schema (``dirs.json``), and per
    file its inode, size and mtime (``<kind>__<asset>.json``, read only when its folder
    changed)."""

    def __init__(self, s: Path):
        self.path = s / "state"
        try:
            self.dirs: dict[str, dict] = json.loads((self.path / "dirs.json").read_text())
        except (OSError, ValueError):
            self.dirs = {}
        self.files: dict[str, dict[str, list]] = {}  # rel -> name -> [ino, size, mtime_ns]

    def _file(self, rel: str) -> Path:
        return self.path / (rel.replace("/", "__") + ".json")

    def listing(self, rel: str) -> dict[str, list]:
        """The files of a folder as last listed."""
        if rel not in self.files:
            try:
                self.files[rel] = json.loads(self._file(rel).read_text())
            except (OSError, ValueError):
                self.files[rel] = {}
        return self.files[rel]

    def save(self, changed: Iterable[str]) -> None:
        for rel in changed:
            _write_bytes(self._file(rel), json.dumps(self.files.get(rel, {})).encode())
        _write_bytes(self.path / "dirs.json", json.dumps(self.dirs).encode())


def _scan(layout: DataLayout, state: _State, kinds: Sequence[str]) -> tuple[_Changes, list[str]]:
    """What changed in the record folders of ``kinds`` since the last refresh (a folder whose
    mtime and inode did not change, and that was listed well after its mtime, is not listed);
    and the folders listed."""
    c = layout.catalog_dir
    changes, listed = _Changes(), []
    now = time.time()
    for kind in kinds:
        root = c / kind
        assets = {e.name for e in os.scandir(root) if e.is_dir()} if root.is_dir() else set()
        assets |= {r.split("/", 1)[1] for r in state.dirs if r.split("/", 1)[0] == kind}
        for asset in sorted(assets - {"_empty"}):
            rel, folder = f"{kind}/{asset}", root / asset
            seen = state.dirs.get(rel)
            try:
                st = folder.stat()
            except FileNotFoundError:
                st = None
            if (st is not None and seen is not None
                    and [st.st_mtime_ns, st.st_ino] == seen["at"]
                    and seen["listed"] > st.st_mtime_ns / 1e9 + FRESH_DIR_S):  # fmt: skip
                continue  # the folder did not change since it was listed
            old = state.listing(rel)
            new: dict[str, list] = {}
            base = str(folder)
            if st is not None:
                changed = changes.changed.setdefault(kind, [])
                for e in os.scandir(base):
                    if not e.name.endswith(".parquet") or e.name.startswith("."):
                        continue
                    try:
                        t = e.stat()
                    except FileNotFoundError:
                        continue
                    new[e.name] = [t.st_ino, t.st_size, t.st_mtime_ns]
                    if old.get(e.name) != new[e.name]:
                        changed.append(_File(e.path, asset, e.name[: -len(".parquet")]))
            for name in old.keys() - new.keys():
                path = os.path.join(base, name)
                changes.gone.setdefault(kind, []).append(_File(path, asset, name[:-8]))
            state.files[rel] = new
            if st is None:
                state.dirs.pop(rel, None)
            else:
                prev = seen.get("legacy", []) if seen else []
                state.dirs[rel] = {"at": [st.st_mtime_ns, st.st_ino], "listed": now,
                                   "legacy": sorted(set(prev) & set(new))}  # fmt: skip
            listed.append(rel)
    return changes, listed


def _thrift_string(b: bytes) -> bytes:
    """``b`` as a thrift compact-protocol string: its length (varint), then its bytes."""
    n, out = len(b), bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + b


_SUMMARY = _thrift_string(SUMMARY_KEY)


class _Footer:
    """A parquet file's footer, read as bytes (a tenth of what parsing it costs): whether it
    names a column, and the record's own summary (``records.SUMMARY_KEY``)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            f.seek(-8, os.SEEK_END)
            tail = f.read(8)
            if tail[4:] != b"PAR1":
                raise ValueError(f"{path}: not a parquet file")
            n = int.from_bytes(tail[:4], "little")
            f.seek(-8 - n, os.SEEK_END)
            self.raw = f.read(n)
        self.path = path

    def has_columns(self, names: Iterable[str]) -> bool:
        return all(_thrift_string(n.encode()) in self.raw for n in names)

    def summary(self):
        """The summary the writer put in the footer (a key-value pair: key, then field 2 of
        type binary, 0x18, its length and bytes); None if there is none."""
        i = self.raw.find(_SUMMARY)
        if i < 0:
            return None
        j = i + len(_SUMMARY)
        if self.raw[j] != 0x18:  # not laid out as pyarrow writes it: parse it properly
            raw = (pq.read_metadata(self.path).metadata or {}).get(SUMMARY_KEY)
            return None if raw is None else json.loads(raw)
        j, n, shift = j + 1, 0, 0
        while True:
            b = self.raw[j]
            j += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        return json.loads(self.raw[j : j + n])


def _footers(files: Iterable[_File]) -> dict[str, _Footer]:
    """The footer of each file (a file gone meanwhile, or unreadable, is left out: the views'
    globs will say so)."""
    out = {}
    for f in files:
        try:
            out[f.path] = _Footer(f.path)
        except (OSError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------------- refresh


def _con(spill: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("SET memory_limit = '600MB'")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET temp_directory = '" + str(spill).replace("'", "''") + "'")
    return con


def _sql_list(paths: Iterable[str | Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _read(con, paths: Sequence[str], select: str, tail: str = "") -> pa.Table | None:
    """``select`` over the record files ``paths`` (``union_by_name``: older schemas too); a file
    that vanished meanwhile is skipped (a partition re-made or cleared while we read)."""
    paths = list(paths)
    while True:
        present = [p for p in paths if os.path.exists(p)]
        if not present:
            return None
        try:
            src = f"read_parquet({_sql_list(present)}, union_by_name=true, filename=true)"
            return con.sql(f"SELECT {select} FROM {src} {tail}").to_arrow_table()
        except duckdb.IOException:
            if all(os.path.exists(p) for p in present):
                raise
            paths = present


def _replace_rows(path: Path, keep_out: set[str], news: Sequence[pa.Table | None],
                  schema: pa.Schema) -> None:  # fmt: skip
    """A summary table (with a ``filename`` column) without the rows of ``keep_out`` files,
    plus the rows of ``news``; written atomically."""
    full = schema.append(pa.field("filename", pa.string()))
    old = pq.read_table(path) if path.exists() else full.empty_table()
    if keep_out and old.num_rows:
        import pyarrow.compute as pc

        mask = pc.invert(pc.is_in(old.column("filename"), value_set=pa.array(sorted(keep_out))))
        old = old.filter(mask)
    parts = [old.select(full.names).cast(full)]
    for new in news:
        if new is None or not new.num_rows:
            continue
        cols = {
            f.name: (new.column(f.name).cast(f.type) if f.name in new.column_names
                     else pa.nulls(new.num_rows, f.type))
            for f in full
        }  # fmt: skip
        parts.append(pa.table(cols, schema=full))
    _write_table(path, pa.concat_tables(parts))


def refresh(layout: DataLayout) -> frozenset[str]:
    """Bring every summary up to date with the records; returns the record kinds that have
    files of an older schema (their views read with ``union_by_name``). A summary that does
    not read (a crash mid-write) is rebuilt from the records."""
    from flowmatch_assets.catalog.views import file_lock

    s = summary_dir(layout)
    s.mkdir(parents=True, exist_ok=True)
    with file_lock(layout.catalog_dir / ".summary.lock"):
        try:
            return _refresh(layout, s)
        except (pa.ArrowInvalid, duckdb.InvalidInputException, ValueError):
            _clear(s)
            return _refresh(layout, s)


def _clear(s: Path) -> None:
    for p in s.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _refresh(layout: DataLayout, s: Path) -> frozenset[str]:
    marker = s / "VERSION"
    if not marker.exists() or marker.read_text() != _version():
        _clear(s)  # another summary version: start over
        _write_bytes(marker, _version().encode())
    state = _State(s)
    changes, listed = _scan(layout, state, ["materializations", *ROW_KINDS])
    footers = _footers(f for k in ("materializations", *ROW_KINDS)
                       for f in changes.changed.get(k, []))  # fmt: skip
    made = ("materializations.parquet", "outcomes.parquet", "content_losers.parquet")
    if (changes.changed or changes.gone or not all((s / m).exists() for m in made)
            or not card_summary_path(layout, "_empty").exists()):  # fmt: skip
        _update(layout, s, state, changes, footers)
    for kind, schema in ROW_KINDS.items():  # which files are of an older schema
        for f in changes.changed.get(kind, []):
            d, foot = state.dirs.get(f"{kind}/{f.asset}"), footers.get(f.path)
            if d is None or foot is None:
                continue
            name = f"{f.partition}.parquet"
            if not foot.has_columns(schema.names):
                d["legacy"] = sorted({*d["legacy"], name})
            elif name in d["legacy"]:
                d["legacy"].remove(name)
    if listed:
        state.save(listed)
    legacy = frozenset(r.split("/", 1)[0] for r, d in state.dirs.items() if d["legacy"])
    _save_legacy(s, legacy)
    return legacy


def _update(layout: DataLayout, s: Path, state: _State, changes: _Changes,
            footers: dict[str, _Footer]) -> None:  # fmt: skip
    spill = s / ".tmp-duckdb"
    try:
        with _con(spill) as con:
            if changes.any("materializations") or not (s / "materializations.parquet").exists():
                _refresh_materializations(con, s, changes, footers)
            if changes.any("rows") or not (s / "outcomes.parquet").exists():
                _refresh_outcomes(con, s, changes, footers)
            losers_changed = _refresh_content(layout, s, state, changes)
            _refresh_cards(layout, s, state, changes, losers_changed)
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _save_legacy(s: Path, legacy: frozenset[str]) -> None:
    p = s / "legacy.json"
    body = json.dumps(sorted(legacy))
    if not p.exists() or p.read_text() != body:
        _write_bytes(p, body.encode())


def legacy_kinds(layout: DataLayout) -> frozenset[str]:
    """The record kinds with files of an older schema, as the last refresh found them."""
    try:
        return frozenset(json.loads((summary_dir(layout) / "legacy.json").read_text()))
    except (OSError, ValueError):
        return frozenset()


def _refresh_materializations(con, s: Path, changes: _Changes, footers: dict) -> None:
    """Every changed record's row from its footer; a record written before footers carried
    it (an older flowmatch) is read whole, by name."""
    import datetime as dt

    changed = changes.changed.get("materializations", [])
    out = {f.path for f in [*changed, *changes.gone.get("materializations", [])]}
    rows, legacy = [], []
    for f in changed:
        row = footers[f.path].summary() if f.path in footers else None
        if row is None:
            legacy.append(f.path)
            continue
        if row.get("written_at"):
            row["written_at"] = dt.datetime.fromisoformat(row["written_at"])
        rows.append({**row, "filename": f.path})
    schema = MATERIALIZATION_SCHEMA.append(pa.field("filename", pa.string()))
    new = [pa.Table.from_pylist(rows, schema=schema)]
    for i in range(0, len(legacy), BATCH):
        new.append(_read(con, legacy[i : i + BATCH], "*", "WHERE asset IS NOT NULL"))
    _replace_rows(s / "materializations.parquet", out, new, MATERIALIZATION_SCHEMA)


def _refresh_outcomes(con, s: Path, changes: _Changes, footers: dict) -> None:
    """Rows per outcome and reason of every changed row record, from its footer (a record
    written before footers carried them: from its rows)."""
    changed = changes.changed.get("rows", [])
    out = {f.path for f in [*changed, *changes.gone.get("rows", [])]}
    cols: dict[str, list] = {k: [] for k in ("asset", "partition", "outcome", "reason", "rows",
                                             "filename")}  # fmt: skip
    legacy = []
    for f in changed:
        own = footers[f.path].summary() if f.path in footers else None
        if own is None:
            legacy.append(f.path)
            continue
        for o, why, n in own["outcomes"]:
            for k, v in zip(cols, (f.asset, f.partition, o, why, n, f.path)):
                cols[k].append(v)
    schema = OUTCOME_SCHEMA.append(pa.field("filename", pa.string()))
    new = [pa.table(cols, schema=schema)]
    for i in range(0, len(legacy), BATCH):
        new.append(_read(con, legacy[i : i + BATCH],
                         "asset, partition, outcome, reason, count(*) AS rows, filename",
                         "WHERE asset IS NOT NULL GROUP BY ALL"))  # fmt: skip
    _replace_rows(s / "outcomes.parquet", out, new, OUTCOME_SCHEMA)


# ------------------------------------------------------------------------ content duplicates

_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _HEX[ord(chr(_c).upper())] = _i


def md5_hashes(md5: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash of each md5 (its first 16 hex digits; another string: sha256 of it),
    nulls left out: what finds the repeated md5s without holding the strings."""
    import hashlib

    import pyarrow.compute as pc

    arr = md5.combine_chunks() if isinstance(md5, pa.ChunkedArray) else md5
    arr = arr.drop_null().cast(pa.string())
    n = len(arr)
    if not n:
        return np.zeros(0, np.uint64)
    hexed = pc.fill_null(pc.match_substring_regex(arr, "^[0-9a-fA-F]{16}"), False)
    head = pc.utf8_slice_codeunits(pc.if_else(hexed, arr, pa.scalar("0" * 16)), 0, 16)
    fixed = head.cast(pa.binary()).cast(pa.binary(16))
    raw = np.frombuffer(fixed.buffers()[1], np.uint8)[fixed.offset * 16 : (fixed.offset + n) * 16]
    nib = _HEX[raw.reshape(n, 16)].astype(np.uint64)
    h = np.zeros(n, np.uint64)
    for k in range(16):
        h = (h << np.uint64(4)) | nib[:, k]
    for i in np.flatnonzero(~hexed.to_numpy(zero_copy_only=False)):
        digest = hashlib.sha256(arr[int(i)].as_py().encode()).digest()
        h[i] = np.frombuffer(digest[:8], ">u8")[0]
    return h


def content_hashes_path(layout: DataLayout, partition: str) -> Path:
    """A partition's sorted md5 hashes: ``[inode, size, mtime_ns]`` of the content record they
    were made from (3 x uint64), then the hashes (uint64)."""
    return layout.catalog_dir / "content_hashes" / f"{partition}.u64"


def write_content_hashes(layout: DataLayout, partition: str, md5, ident: list[int]) -> None:
    """Write a partition's md5 hashes (``record_content`` calls it with the record it wrote)."""
    h = np.sort(md5_hashes(md5))
    _write_bytes(content_hashes_path(layout, partition),
                 np.asarray(ident, np.uint64).tobytes() + h.tobytes())  # fmt: skip


def _content_hashes(layout: DataLayout, partition: str, ident: list[int] | None) -> np.ndarray:
    """The partition's md5 hashes for its content record of identity ``ident`` (made again
    from the record when the file beside it was made from another)."""
    p = content_hashes_path(layout, partition)
    try:
        raw = np.fromfile(p, np.uint64)
        if ident is not None and len(raw) >= 3 and raw[:3].tolist() == list(ident):
            return raw[3:]
    except (OSError, ValueError):
        pass
    rec = layout.catalog_dir / "content" / "images_256" / f"{partition}.parquet"
    try:
        md5 = pq.read_table(rec, columns=["md5"]).column("md5")
    except (OSError, pa.ArrowInvalid, KeyError):
        return np.zeros(0, np.uint64)
    if ident is not None:
        write_content_hashes(layout, partition, md5, ident)
    return np.sort(md5_hashes(md5))


def _refresh_content(layout: DataLayout, s: Path, state: _State, changes: _Changes) -> bool:
    """If a content record changed (or which partitions have images_256 did), find the stored
    rows whose bytes an earlier row (dataset order) stored too: the repeated hashes over every
    partition's, then the exact md5s of the rows that have one. Returns whether they changed."""
    import pyarrow.compute as pc

    images_changed = any(f.asset == "images_256" for f in [
        *changes.changed.get("materializations", []), *changes.gone.get("materializations", [])])  # fmt: skip
    losers = s / "content_losers.parquet"
    if not (changes.any("content") or images_changed or not losers.exists()):
        return False
    made = _materialized(s, "images_256")
    listing = state.listing("content/images_256")
    parts = sorted(p for p in (n[: -len(".parquet")] for n in listing) if p in made)
    hashes = {p: _content_hashes(layout, p, listing[f"{p}.parquet"]) for p in parts}
    dup = _repeated_hashes(list(hashes.values()))
    rows = LOSER_SCHEMA.empty_table()
    if len(dup):
        c = layout.catalog_dir / "content" / "images_256"
        hit = [p for p in parts if np.isin(hashes[p], dup).any()]
        cand = []
        for p in hit:
            t = pq.read_table(c / f"{p}.parquet", columns=["partition", "id", "position", "md5"])
            t = t.filter(pc.is_valid(t.column("md5")))
            mask = np.isin(md5_hashes(t.column("md5")), dup)
            cand.append(t.filter(pa.array(mask)))
        first: dict[str, tuple] = {}
        allc = pa.concat_tables(cand).to_pylist()
        for r in sorted(allc, key=lambda r: (r["partition"], r["position"])):
            first.setdefault(r["md5"], (r["partition"], r["id"]))
        rows = pa.Table.from_pylist([
            {"partition": r["partition"], "id": r["id"], "md5": r["md5"],
             "kept_partition": first[r["md5"]][0], "kept_id": first[r["md5"]][1]}
            for r in allc if (r["partition"], r["id"]) != first[r["md5"]]], schema=LOSER_SCHEMA)  # fmt: skip
    old = pq.read_table(losers) if losers.exists() else None
    if old is None or not old.sort_by([("partition", "ascending"), ("id", "ascending")]).equals(
        rows.sort_by([("partition", "ascending"), ("id", "ascending")])
    ):
        _write_table(losers, rows)
        return True
    return False


def _materialized(s: Path, asset: str) -> set[str]:
    p = s / "materializations.parquet"
    if not p.exists():
        return set()
    t = pq.read_table(p, columns=["asset", "partition"])
    return {pt for a, pt in zip(t.column("asset").to_pylist(), t.column("partition").to_pylist())
            if a == asset}  # fmt: skip


def _repeated_hashes(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The hashes found more than once across ``parts`` (each sorted), in passes over ranges
    of the hash space so that at most ``HASHES_PER_PASS`` are sorted at once."""
    total = sum(len(h) for h in parts)
    passes = max(1, -(-total // HASHES_PER_PASS))
    edges = [2**64 * k // passes for k in range(passes + 1)]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        chunk = []
        for h in parts:
            a = np.searchsorted(h, np.uint64(lo))
            b = len(h) if hi >= 2**64 else np.searchsorted(h, np.uint64(hi))
            chunk.append(h[a:b])
        h = np.concatenate(chunk) if chunk else np.zeros(0, np.uint64)
        h.sort()
        out.append(np.unique(h[1:][h[1:] == h[:-1]]))
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


# -------------------------------------------------------------------------------- data cards

#: The data card's distributions: section -> how a stored row's value is read.
CARD_STATS = ("kept", "caption_chars", "caption_tokens", "orig_long_side", "orig_short_side")
#: Values of a distribution are kept exactly below this (whole numbers) ...
EXACT_BELOW = 256
#: ... and above it in bins of this relative width (a mergeable sketch: the dataset's
#: quantiles are within half a bin, 0.5%, of the exact ones; a partition's are exact).
BIN_RATIO = 1.01
_LOG_RATIO = float(np.log(BIN_RATIO))


def _bins(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bin value, rows) of the values ``x``: whole numbers below :data:`EXACT_BELOW` exactly,
    others at the nearest power of :data:`BIN_RATIO` (rounded, if all are whole numbers)."""
    whole = x == np.floor(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        binned = np.exp(np.round(np.log(x) / _LOG_RATIO) * _LOG_RATIO)
    if whole.all():  # whole numbers stay whole (a bin above EXACT_BELOW is > 2 wide)
        binned = np.round(binned)
    v = np.where((whole & (x < EXACT_BELOW)) | (x <= 0), x, binned)
    return np.unique(v, return_counts=True)


def _aspect_bucket(a: np.ndarray) -> np.ndarray:
    edges = np.array([1.25, 1.5, 2.0, 3.0])
    names = np.array(["1-1.25", "1.25-1.5", "1.5-2", "2-3", ">=3"], dtype=object)
    return names[np.searchsorted(edges, a, side="right")]


def _outcomes(cards: pa.Table, meta: pa.Table | None, images: pa.Table | None,
              losers: set[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Each card row's final outcome and reason by the ``dataset_rows`` rules (the metadata's;
    else the image stage's, ``pending`` before it ran, a content duplicate's ``filtered:
    duplicate_content``), and which card rows have a metadata row at all."""
    import pyarrow.compute as pc

    ids = cards.column("id")
    n = len(ids)

    def lookup(t: pa.Table | None):
        if t is None or not t.num_rows:
            return np.zeros(n, bool), np.full(n, None, object), np.full(n, None, object)
        idx = pc.index_in(ids, value_set=t.column("id"))
        has = pc.is_valid(idx).to_numpy(zero_copy_only=False)
        take = pc.fill_null(idx, 0)
        out = t.column("outcome").take(take).to_numpy(zero_copy_only=False)
        why = t.column("reason").take(take).to_numpy(zero_copy_only=False)
        return has, out, why

    has_m, m_out, m_why = lookup(meta)
    has_i, i_out, i_why = lookup(images)
    lost = (pc.is_in(ids, value_set=pa.array(sorted(losers), pa.string())).to_numpy(
        zero_copy_only=False) if losers else np.zeros(n, bool))  # fmt: skip
    by_meta = m_out != "stored"
    outcome = np.where(by_meta, m_out, np.where(~has_i, "pending",
                       np.where(lost, "filtered", i_out)))  # fmt: skip
    reason = np.where(by_meta, m_why, np.where(lost, "duplicate_content",
                      np.where(has_i, i_why, None)))  # fmt: skip
    return outcome, reason, has_m


def card_summary(partition: str, cards: pa.Table, meta: pa.Table | None,
                 images: pa.Table | None, losers: set[str]) -> pa.Table:  # fmt: skip
    """One partition's data card from its card records and its metadata and image row
    records (``losers``: its stored rows whose bytes an earlier row stored): rows per item of
    each count section, each distribution's exact p10 / p50 / p90 / mean / max (+ sum and
    count, which merge) and its bins (:func:`_bins`, which merge into the dataset's)."""
    import pyarrow.compute as pc

    outcome, reason, has_m = _outcomes(cards, meta, images, losers)
    keep = np.flatnonzero(has_m)  # a card row without a metadata row is no input row
    outcome, reason = outcome[keep], reason[keep]
    stored = outcome == "stored"
    rows = cards.take(pa.array(keep[stored], pa.int64()))
    out: list[tuple] = []

    def counts(section: str, values) -> None:
        vc = pc.value_counts(pa.array(values) if not isinstance(values, pa.ChunkedArray)
                             else values.combine_chunks())  # fmt: skip
        for v, k in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            out.append((section, "(none)" if v is None else str(v), None, int(k)))

    def floats(name: str) -> np.ndarray:
        if name not in rows.column_names:
            return np.full(rows.num_rows, np.nan)
        return rows.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)

    items = np.where(reason == None, outcome, outcome + ":" + reason.astype(str))  # noqa: E711
    counts("outcome", items.astype(str))
    for section in ("license", "source"):
        if section in rows.column_names:
            counts(section, rows.column(section).cast(pa.string()))
        else:
            counts(section, pa.nulls(rows.num_rows, pa.string()))
    w, h = floats("orig_width"), floats("orig_height")
    long_side, short_side = np.fmax(w, h), np.fmin(w, h)
    with np.errstate(divide="ignore", invalid="ignore"):
        aspect = long_side / short_side
    counts("aspect", _aspect_bucket(aspect[~np.isnan(w)]).astype(str))
    if "bucket" in rows.column_names:
        counts("bucket", rows.column("bucket").drop_null())
    values = {
        "kept": floats("kept"),
        "caption_chars": floats("caption_chars"),
        "caption_tokens": floats("caption_tokens"),
        "orig_long_side": long_side,
        "orig_short_side": short_side,
    }
    for section, x in values.items():
        x = x[~np.isnan(x)]
        if not len(x):
            continue
        q = np.quantile(x, [0.1, 0.5, 0.9])
        for item, v in zip(("p10", "p50", "p90", "mean", "max", "sum", "count"),
                           (*q, x.mean(), x.max(), x.sum(), len(x))):  # fmt: skip
            out.append((section, item, float(v), None))
        out += [(section, "bin", float(v), int(k)) for v, k in zip(*_bins(x))]
    for section, x in (("aspect_value", aspect), ("max_tokens", floats("max_tokens"))):
        x = x[~np.isnan(x)]
        out += [(section, "bin", float(v), int(k)) for v, k in zip(*_bins(x))]
    if rows.num_rows:
        tokens, most = floats("caption_tokens"), floats("max_tokens")
        with np.errstate(invalid="ignore"):
            over = int(np.sum(tokens > most))
        out.append(("text", "captions_over_max_tokens", None, over))
        out.append(("text", "tokenized", None, int(np.sum(~np.isnan(tokens)))))
    sections, items_, vals, ns = zip(*out) if out else ((), (), (), ())
    return pa.table({"partition": pa.repeat(pa.scalar(partition, pa.string()), len(out)),
                     "section": pa.array(sections, pa.string()),
                     "item": pa.array(items_, pa.string()),
                     "value": pa.array(vals, pa.float64()),
                     "n": pa.array(ns, pa.int64())}, schema=CARD_SUMMARY_SCHEMA)  # fmt: skip


def _ident(path: Path) -> list | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _card_inputs(layout: DataLayout, partition: str, losers: set[str]) -> dict:
    """What a partition's card summary is made from: its card, metadata and image row records
    (inode, size, mtime) and its content losers."""
    c = layout.catalog_dir
    return {
        "cards": _ident(c / "cards" / "data_card" / f"{partition}.parquet"),
        "meta": _ident(c / "rows" / "pd12m_metadata" / f"{partition}.parquet"),
        "images": _ident(c / "rows" / "images_256" / f"{partition}.parquet"),
        "losers": sorted(losers),
    }


def _losers_of(s: Path, partitions: Iterable[str]) -> dict[str, set[str]]:
    p = s / "content_losers.parquet"
    want = set(partitions)
    out: dict[str, set[str]] = {k: set() for k in want}
    if p.exists():
        t = pq.read_table(p, columns=["partition", "id"])
        for k, i in zip(t.column("partition").to_pylist(), t.column("id").to_pylist()):
            if k in want:
                out[k].add(i)
    return out


def write_card_summary(layout: DataLayout, partition: str, losers: set[str] | None = None) -> None:
    """Summarise one partition's data card from its records as they are now (the data card
    asset calls it when it writes the card records, so that no catalog query has to); its
    inputs' identities go into the file, so a refresh redoes it only when one changed."""
    s = summary_dir(layout)
    if losers is None:
        losers = _losers_of(s, [partition])[partition]
    inputs = _card_inputs(layout, partition, losers)  # before reading: a later change shows
    c = layout.catalog_dir

    def read(path: Path, columns=None) -> pa.Table | None:
        try:
            return pq.read_table(path, columns=columns)
        except FileNotFoundError:
            return None

    cards = read(c / "cards" / "data_card" / f"{partition}.parquet")
    if cards is None:
        card_summary_path(layout, partition).unlink(missing_ok=True)
        return
    cols = ["id", "outcome", "reason"]
    t = card_summary(partition, cards, read(c / "rows" / "pd12m_metadata" / f"{partition}.parquet",
                                             cols),
                     read(c / "rows" / "images_256" / f"{partition}.parquet", cols), losers)  # fmt: skip
    t = t.replace_schema_metadata({"flowmatch_inputs": json.dumps(inputs)})
    _write_table(card_summary_path(layout, partition), t)


def _card_is_current(layout: DataLayout, s: Path, partition: str, losers: set[str]) -> bool:
    try:
        meta = pq.read_schema(card_summary_path(layout, partition)).metadata or {}
        made = json.loads(meta.get(b"flowmatch_inputs", b"null"))
    except (OSError, ValueError, pa.ArrowInvalid):
        return False
    return made == _card_inputs(layout, partition, losers)


def _refresh_cards(layout: DataLayout, s: Path, state: _State, changes: _Changes,
                   losers_changed: bool) -> None:  # fmt: skip
    """Re-summarise the cards whose inputs changed (their card records, their metadata or
    image row records, their content losers) and whose summary was not written with them."""
    empty = card_summary_path(layout, "_empty")
    if not empty.exists():  # so that the view's glob always matches
        _write_table(empty, CARD_SUMMARY_SCHEMA.empty_table())
    for f in changes.gone.get("cards", []):
        card_summary_path(layout, f.partition).unlink(missing_ok=True)
    rows = [*changes.changed.get("rows", []), *changes.gone.get("rows", [])]
    touched = {f.partition for f in changes.changed.get("cards", [])}
    touched |= {f.partition for f in rows if f.asset in ("pd12m_metadata", "images_256")}
    if losers_changed:  # a partition whose losers changed: its card changes
        t = pq.read_table(s / "content_losers.parquet", columns=["partition"])
        now = set(t.column("partition").to_pylist())
        prev = s / "content_losers.partitions.json"
        touched |= now | (set(json.loads(prev.read_text())) if prev.exists() else set())
        _write_bytes(prev, json.dumps(sorted(now)).encode())
    if not touched:
        return
    cards = {n[: -len(".parquet")] for n in state.listing("cards/data_card")}
    todo = sorted(p for p in touched if p in cards)
    losers = _losers_of(s, todo)
    for p in todo:
        if not _card_is_current(layout, s, p, losers[p]):
            write_card_summary(layout, p, losers[p])
