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
    near_duplicates.partitions.json  which partitions the near duplicates' table (written by
                               ingest/neardup.py) named when last read: their cards are redone
    state/                     what the record folders held when last listed (record_scan.py)

and, beside the card records, ``<root>/catalog/card_summaries/<partition>.parquet``: one
partition's data card (counts, exact statistics, and bins that merge into the dataset's),
written with the card records (``record_card_rows``) and redone here only when one of its
inputs changed since (its card, metadata or image row records, its content losers).

A record file is re-read only when its identity changed, and a folder whose mtime did not
change is not even listed (:mod:`.record_scan`).
Nothing here is a source of truth: deleting ``summary/`` rebuilds it (so does a new
``SUMMARY_VERSION`` or DuckDB).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog.derived import (
    CARD_SUMMARY_SCHEMA,
    NEAR_SCHEMA,
    _write_bytes,
    _write_table,
    card_inputs,
    card_summary_path,
    content_hashes_path,
    losers_of,
    md5_hashes,
    near_path,
    write_card_summary,
    write_content_hashes,
)
from flowmatch_assets.catalog.record_kinds import (
    MATERIALIZATION_SCHEMA,
    record_kind,
    record_path,
    row_kinds,
)
from flowmatch_assets.catalog.record_scan import Changes, Seen, State, read_footers, scan
from flowmatch_models.storage.layout import DataLayout

#: Bump when a summary's definition changes: every summary is rebuilt from the records.
SUMMARY_VERSION = "1"
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
#: Record files read per DuckDB query (bounds the memory of the first build).
BATCH = 256


def summary_dir(layout: DataLayout) -> Path:
    return layout.catalog_dir / "summary"


def _version() -> str:
    return f"{SUMMARY_VERSION}/duckdb-{duckdb.__version__}"


def cores() -> int:
    """The cores this process may run on (DuckDB's default counts the machine's: on a process
    pinned to one core its threads only take turns)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _con(spill: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute(f"SET threads = {cores()}")
    con.execute("SET memory_limit = '600MB'")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET enable_progress_bar = false")
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


def _replace_rows(
    path: Path, keep_out: set[str], news: Sequence[pa.Table | None], schema: pa.Schema
) -> None:
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
            f.name: (
                new.column(f.name).cast(f.type)
                if f.name in new.column_names
                else pa.nulls(new.num_rows, f.type)
            )
            for f in full
        }
        parts.append(pa.table(cols, schema=full))
    _write_table(path, pa.concat_tables(parts))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) for the block: one process at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def refresh(layout: DataLayout) -> frozenset[str]:
    """Bring every summary up to date with the records; returns the record kinds that have
    files of an older schema (their views read with ``union_by_name``). A summary that does
    not read (a crash mid-write) is rebuilt from the records."""
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
    state = State(s)
    kinds = row_kinds()
    changes, listed = scan(layout, state, ["materializations", *kinds])
    footers = read_footers(changes)
    made = ("materializations.parquet", "outcomes.parquet", "content_losers.parquet")
    near = _near_changed(layout, s)
    if (
        changes.changed
        or changes.gone
        or near
        or not all((s / m).exists() for m in made)
        or not card_summary_path(layout, "_empty").exists()
    ):
        _update(layout, s, state, changes, footers, near)
    for kind in kinds:  # which files are of an older schema
        for f in changes.changed.get(kind, []):
            d, foot = state.dirs.get(f"{kind}/{f.asset}"), footers.get(f.path)
            if d is None or foot is None:
                continue
            name = f"{f.partition}.parquet"
            if not foot.current:
                d["legacy"] = sorted({*d["legacy"], name})
            elif name in d["legacy"]:
                d["legacy"].remove(name)
    if listed:
        state.save(listed)
    legacy = frozenset(r.split("/", 1)[0] for r, d in state.dirs.items() if d["legacy"])
    _save_legacy(s, legacy)
    return legacy


def _update(
    layout: DataLayout,
    s: Path,
    state: State,
    changes: Changes,
    footers: dict[str, Seen],
    near: set[str],
) -> None:
    spill = s / ".tmp-duckdb"
    try:
        with _con(spill) as con:
            if changes.any("materializations") or not (s / "materializations.parquet").exists():
                _refresh_materializations(con, s, changes, footers)
            if changes.any("rows") or not (s / "outcomes.parquet").exists():
                _refresh_outcomes(con, s, changes, footers)
            losers_changed = _refresh_content(layout, s, state, changes)
            _refresh_cards(layout, s, state, changes, losers_changed, near)
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


def _refresh_materializations(con, s: Path, changes: Changes, footers: dict) -> None:
    """Every changed record's row from its footer; a record written before footers carried
    it (an older flowmatch) is read whole, by name."""
    import datetime as dt

    changed = changes.changed.get("materializations", [])
    out = {f.path for f in [*changed, *changes.gone.get("materializations", [])]}
    rows, legacy = [], []
    for f in changed:
        row = footers[f.path].summary if f.path in footers else None
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


def _refresh_outcomes(con, s: Path, changes: Changes, footers: dict) -> None:
    """Rows per outcome and reason of every changed row record, from its footer (a record
    written before footers carried them: from its rows)."""
    changed = changes.changed.get("rows", [])
    out = {f.path for f in [*changed, *changes.gone.get("rows", [])]}
    cols: dict[str, list] = {
        k: [] for k in ("asset", "partition", "outcome", "reason", "rows", "filename")
    }
    legacy = []
    for f in changed:
        own = footers[f.path].summary if f.path in footers else None
        if own is None:
            legacy.append(f.path)
            continue
        for o, why, n in own["outcomes"]:
            for k, v in zip(cols, (f.asset, f.partition, o, why, n, f.path)):
                cols[k].append(v)
    schema = OUTCOME_SCHEMA.append(pa.field("filename", pa.string()))
    new = [pa.table(cols, schema=schema)]
    for i in range(0, len(legacy), BATCH):
        new.append(
            _read(
                con,
                legacy[i : i + BATCH],
                "asset, partition, outcome, reason, count(*) AS rows, filename",
                "WHERE asset IS NOT NULL GROUP BY ALL",
            )
        )
    _replace_rows(s / "outcomes.parquet", out, new, OUTCOME_SCHEMA)


# ------------------------------------------------------------------------ content duplicates


def _hash_count(layout: DataLayout, partition: str, ident: list[int]) -> int:
    """How many md5 hashes the partition's hash file holds, after making it again from its
    content record if it was written for another (a record of an older flowmatch, or one
    rewritten since)."""
    p = content_hashes_path(layout, partition)
    try:
        with open(p, "rb") as f:
            head = np.frombuffer(f.read(24), np.uint64)
        if head.tolist() == list(ident):
            return (p.stat().st_size - 24) // 8
    except (OSError, ValueError):
        pass
    rec = record_path(layout, "content", "images", partition)
    try:
        md5 = pq.read_table(rec, columns=["md5"]).column("md5")
    except (OSError, pa.ArrowInvalid, KeyError):
        md5 = pa.array([], pa.string())
    write_content_hashes(layout, partition, md5, ident)
    return (p.stat().st_size - 24) // 8


def _refresh_content(layout: DataLayout, s: Path, state: State, changes: Changes) -> bool:
    """If a content record changed (or which partitions have images did), find the stored
    rows whose bytes an earlier row (dataset order) stored too: the repeated hashes over every
    partition's, then the exact md5s of the rows that have one. Returns whether they changed."""
    import pyarrow.compute as pc

    images_changed = any(
        f.asset == "images"
        for f in [
            *changes.changed.get("materializations", []),
            *changes.gone.get("materializations", []),
        ]
    )
    losers = s / "content_losers.parquet"
    if not (changes.any("content") or images_changed or not losers.exists()):
        return False
    made = _materialized(s, "images")
    listing = state.listing("content/images")
    parts = sorted(p for p in (n[: -len(".parquet")] for n in listing) if p in made)
    sizes = [_hash_count(layout, p, listing[f"{p}.parquet"]) for p in parts]
    dup = _repeated_hashes([content_hashes_path(layout, p) for p in parts], sizes)
    rows = LOSER_SCHEMA.empty_table()
    if len(dup):
        c = record_kind("content").folder(layout) / "images"
        hit = [
            p
            for p in parts
            if np.isin(np.fromfile(content_hashes_path(layout, p), np.uint64)[3:], dup).any()
        ]
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
        rows = pa.Table.from_pylist(
            [
                {
                    "partition": r["partition"],
                    "id": r["id"],
                    "md5": r["md5"],
                    "kept_partition": first[r["md5"]][0],
                    "kept_id": first[r["md5"]][1],
                }
                for r in allc
                if (r["partition"], r["id"]) != first[r["md5"]]
            ],
            schema=LOSER_SCHEMA,
        )
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
    return {
        pt
        for a, pt in zip(t.column("asset").to_pylist(), t.column("partition").to_pylist())
        if a == asset
    }


def _repeated_hashes(files: Sequence[Path], sizes: Sequence[int]) -> np.ndarray:
    """The hashes found more than once across the hash files ``files`` (``sizes`` hashes
    each, after their 3-word header): all of them in one array, sorted in place (PD12M:
    ~12M, 100 MB; 5,000 partitions: 400 MB)."""
    h = np.empty(sum(sizes), np.uint64)
    at = 0
    for p, n in zip(files, sizes):
        with open(p, "rb") as f:
            f.seek(24)
            f.readinto(memoryview(h[at : at + n]).cast("B"))
        at += n
    h.sort()
    return np.unique(h[1:][h[1:] == h[:-1]])


def _card_is_current(layout: DataLayout, s: Path, partition: str, losers: set[str]) -> bool:
    try:
        meta = pq.read_schema(card_summary_path(layout, partition)).metadata or {}
        made = json.loads(meta.get(b"flowmatch_inputs", b"null"))
    except (OSError, ValueError, pa.ArrowInvalid):
        return False
    return made == card_inputs(layout, partition, losers)


def _near_changed(layout: DataLayout, s: Path) -> set[str]:
    """The partitions whose near duplicates changed since the last refresh (the table is
    written empty when missing, so that the view always reads one)."""
    p = near_path(layout)
    if not p.exists():
        _write_table(p, NEAR_SCHEMA.empty_table())
    st = p.stat()
    ident = [st.st_ino, st.st_size, st.st_mtime_ns]
    prev_p = s / "near_duplicates.partitions.json"
    prev = json.loads(prev_p.read_text()) if prev_p.exists() else {"ident": None, "parts": []}
    if prev["ident"] == ident:
        return set()
    now = set(pq.read_table(p, columns=["partition"]).column("partition").to_pylist())
    _write_bytes(prev_p, json.dumps({"ident": ident, "parts": sorted(now)}).encode())
    return now | set(prev["parts"])


def _refresh_cards(
    layout: DataLayout,
    s: Path,
    state: State,
    changes: Changes,
    losers_changed: bool,
    near: set[str] = frozenset(),
) -> None:
    """Re-summarise the cards whose inputs changed (their card records, their metadata or
    image row records, their content losers) and whose summary was not written with them."""
    empty = card_summary_path(layout, "_empty")
    if not empty.exists():  # so that the view's glob always matches
        _write_table(empty, CARD_SUMMARY_SCHEMA.empty_table())
    for f in changes.gone.get("cards", []):
        card_summary_path(layout, f.partition).unlink(missing_ok=True)
    rows = [*changes.changed.get("rows", []), *changes.gone.get("rows", [])]
    touched = {f.partition for f in changes.changed.get("cards", [])}
    touched |= {f.partition for f in rows if f.asset in ("metadata", "images")}
    touched |= near
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
    losers = losers_of(layout, todo)
    for p in todo:
        if not _card_is_current(layout, s, p, losers[p]):
            write_card_summary(layout, p, losers[p])
