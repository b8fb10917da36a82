"""The catalog's summaries: compact tables the reports read instead of every record file.

Materializations keep writing one small parquet record per partition and asset (and the per-row
records beside it), lock-free and atomic: that is what lets parallel partitions never contend.
But a report that opened every record file would cost ~5 files a partition per query (PD12M:
~6,200), and the data card would join ~12M per-row records each time. So the catalog keeps
derived tables under ``<root>/catalog/summary/``, brought up to date from the records that
changed since (``refresh``, under a file lock, before every catalog query):

    materializations.parquet   every materialization record, one row each (older record
                               schemas padded with NULLs: ``union_by_name``)
    outcomes.parquet           rows per (asset, partition, outcome, reason) of the row records
    content/<partition>.u64    the sorted 64-bit hashes of a partition's stored md5s
    content_losers.parquet     stored rows whose bytes an earlier row (dataset order) stored too
    cards/<partition>.parquet  a partition's data card: counts per item, and per value of each
                               distribution (exact histograms: quantiles of any scope are exact)
    state/<dir>.json           what each summary was made from: per record file its inode,
                               size and mtime, and whether it has today's schema

A record file is re-read only when its identity changed (a rewrite is an atomic rename: a new
inode); a directory whose mtime did not change is not even listed. Nothing here is a source of
truth: deleting the folder rebuilds it (``SUMMARY_VERSION`` or another DuckDB rebuilds it too).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
#: Partitions summarised per DuckDB query (bounds the memory of the first build).
BATCH = 64
#: Hashes held at once while looking for repeated md5s (x 8 bytes).
HASHES_PER_PASS = 8_000_000
#: A directory changed less than this long ago is listed even if its mtime looks unchanged
#: (two renames within one timestamp tick).
FRESH_DIR_S = 2.0


def summary_dir(layout: DataLayout) -> Path:
    return layout.catalog_dir / "summary"


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


@dataclass
class _Changes:
    """Per kind: the record files changed or new (re-read them) and gone (drop them)."""

    changed: dict[str, list[Path]] = field(default_factory=dict)
    gone: dict[str, list[Path]] = field(default_factory=dict)

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
            if st is not None:
                for e in os.scandir(folder):
                    if not e.name.endswith(".parquet") or e.name.startswith("."):
                        continue
                    try:
                        t = e.stat()
                    except FileNotFoundError:
                        continue
                    new[e.name] = [t.st_ino, t.st_size, t.st_mtime_ns]
                    if old.get(e.name) != new[e.name]:
                        changes.changed.setdefault(kind, []).append(folder / e.name)
            for name in old.keys() - new.keys():
                changes.gone.setdefault(kind, []).append(folder / name)
            state.files[rel] = new
            if st is None:
                state.dirs.pop(rel, None)
            else:
                prev = seen.get("legacy", []) if seen else []
                state.dirs[rel] = {"at": [st.st_mtime_ns, st.st_ino], "listed": now,
                                   "legacy": sorted(set(prev) & set(new))}  # fmt: skip
            listed.append(rel)
    return changes, listed


def _current(path: Path, schema: pa.Schema) -> bool:
    """Whether a record file has every column of today's ``schema`` (else: an older record,
    read with ``union_by_name``)."""
    try:
        names = set(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - unreadable or gone: the views' glob will say so
        return True
    return set(schema.names) <= names


# --------------------------------------------------------------------------------- refresh


def _con(spill: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("SET memory_limit = '600MB'")
    con.execute("SET preserve_insertion_order = false")
    con.execute("SET temp_directory = '" + str(spill).replace("'", "''") + "'")
    return con


def _sql_list(paths: Iterable[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _read(con, paths: Sequence[Path], select: str, tail: str = "") -> pa.Table:
    """``select`` over the record files ``paths`` (``union_by_name``: older schemas too); a file
    that vanished meanwhile is skipped (a partition re-made or cleared while we read)."""
    paths = list(paths)
    while True:
        present = [p for p in paths if p.exists()]
        if not present:
            return None
        try:
            src = f"read_parquet({_sql_list(present)}, union_by_name=true, filename=true)"
            return con.sql(f"SELECT {select} FROM {src} {tail}").to_arrow_table()
        except duckdb.IOException:
            if all(p.exists() for p in present):
                raise
            paths = present


def _replace_rows(path: Path, keep_out: set[str], new: pa.Table | None, schema: pa.Schema):
    """A summary table (with a ``filename`` column) without the rows of ``keep_out`` files,
    plus ``new``'s rows; written atomically."""
    full = schema.append(pa.field("filename", pa.string()))
    old = pq.read_table(path) if path.exists() else full.empty_table()
    if keep_out and old.num_rows:
        import pyarrow.compute as pc

        mask = pc.invert(pc.is_in(old.column("filename"), value_set=pa.array(sorted(keep_out))))
        old = old.filter(mask)
    parts = [old.select(full.names).cast(full)]
    if new is not None and new.num_rows:
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
    made = ("materializations.parquet", "outcomes.parquet", "content_losers.parquet",
            "cards/_empty.parquet")  # fmt: skip
    if changes.changed or changes.gone or not all((s / m).exists() for m in made):
        _update(layout, s, state, changes)
    for kind, schema in ROW_KINDS.items():  # which files are of an older schema
        for p in changes.changed.get(kind, []):
            d = state.dirs.get(f"{kind}/{p.parent.name}")
            if d is not None and not _current(p, schema):
                d["legacy"] = sorted({*d["legacy"], p.name})
            elif d is not None and p.name in d["legacy"]:
                d["legacy"].remove(p.name)
    if listed:
        state.save(listed)
    legacy = frozenset(r.split("/", 1)[0] for r, d in state.dirs.items() if d["legacy"])
    _save_legacy(s, legacy)
    return legacy


def _update(layout: DataLayout, s: Path, state: _State, changes: _Changes) -> None:
    spill = s / ".tmp-duckdb"
    try:
        with _con(spill) as con:
            if changes.any("materializations") or not (s / "materializations.parquet").exists():
                _refresh_materializations(con, s, changes)
            if changes.any("rows") or not (s / "outcomes.parquet").exists():
                _refresh_outcomes(con, s, changes)
            losers_changed = _refresh_content(con, layout, s, changes)
            _refresh_cards(con, layout, s, state, changes, losers_changed)
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


def _refresh_materializations(con, s: Path, changes: _Changes) -> None:
    changed = changes.changed.get("materializations", [])
    out = {str(p) for p in [*changed, *changes.gone.get("materializations", [])]}
    new = _read(con, changed, "*", "WHERE asset IS NOT NULL") if changed else None
    _replace_rows(s / "materializations.parquet", out, new, MATERIALIZATION_SCHEMA)


def _refresh_outcomes(con, s: Path, changes: _Changes) -> None:
    changed = changes.changed.get("rows", [])
    out = {str(p) for p in [*changed, *changes.gone.get("rows", [])]}
    new = None
    if changed:
        new = _read(con, changed, "asset, partition, outcome, reason, count(*) AS rows, filename",
                    "WHERE asset IS NOT NULL GROUP BY ALL")  # fmt: skip
    _replace_rows(s / "outcomes.parquet", out, new, OUTCOME_SCHEMA)


# ------------------------------------------------------------------------ content duplicates


def _refresh_content(con, layout: DataLayout, s: Path, changes: _Changes) -> bool:
    """Per changed content record its sorted md5 hashes; then, if any changed (or which
    partitions have images_256 changed), the rows whose bytes an earlier row stored too.
    Returns whether the losers were recomputed."""
    d = s / "content"
    d.mkdir(exist_ok=True)
    for p in changes.gone.get("content", []):
        (d / f"{p.stem}.u64").unlink(missing_ok=True)
    changed = changes.changed.get("content", [])
    for i in range(0, len(changed), BATCH * 4):
        t = _read(con, changed[i : i + BATCH * 4],
                  "parse_filename(filename, true) AS p, list(hash(md5) ORDER BY hash(md5)) AS h",
                  "WHERE asset IS NOT NULL AND md5 IS NOT NULL GROUP BY ALL")  # fmt: skip
        done = set()
        for p, h in zip(t.column("p").to_pylist(), t.column("h").to_numpy(zero_copy_only=False)):
            _write_bytes(d / f"{p}.u64", np.asarray(h, np.uint64).tobytes())
            done.add(p)
        for p in changed[i : i + BATCH * 4]:  # no stored md5 at all
            if p.stem not in done:
                _write_bytes(d / f"{p.stem}.u64", b"")
    images_changed = any("/images_256/" in str(p) for p in [
        *changes.changed.get("materializations", []), *changes.gone.get("materializations", [])])  # fmt: skip
    losers = s / "content_losers.parquet"
    if not (changed or changes.gone.get("content") or images_changed or not losers.exists()):
        return False
    made = _materialized(s, "images_256")
    parts = sorted(p.stem for p in d.glob("*.u64") if p.stem in made)
    dup = _repeated_hashes([d / f"{p}.u64" for p in parts])
    rows = LOSER_SCHEMA.empty_table()
    if len(dup):
        c = layout.catalog_dir / "content" / "images_256"
        con.register("dup_hashes", pa.table({"h": pa.array(dup, pa.uint64())}))
        hit = [c / f"{p}.parquet" for p, f in zip(parts, _files_with(d, parts, dup)) if f]
        t = _read(con, hit, "partition, id, position, md5",
                  "WHERE asset IS NOT NULL AND md5 IS NOT NULL "
                  "AND hash(md5) IN (SELECT h FROM dup_hashes)")  # fmt: skip
        con.register("cand", t)
        rows = (
            con.sql(
                """SELECT partition, id, md5, first(partition ORDER BY partition, position)
                   OVER w AS kept_partition, first(id ORDER BY partition, position) OVER w AS
                   kept_id FROM cand WINDOW w AS (PARTITION BY md5)
               QUALIFY (partition, id) <> (kept_partition, kept_id)"""
            )
            .to_arrow_table()
            .cast(LOSER_SCHEMA)
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
    return {pt for a, pt in zip(t.column("asset").to_pylist(), t.column("partition").to_pylist())
            if a == asset}  # fmt: skip


def _repeated_hashes(files: Sequence[Path]) -> np.ndarray:
    """The hashes found more than once across ``files`` (each sorted uint64), in passes over
    ranges of the hash space so that at most ``HASHES_PER_PASS`` are in memory at once."""
    total = sum(p.stat().st_size for p in files) // 8
    passes = max(1, -(-total // HASHES_PER_PASS))
    edges = [2**64 * k // passes for k in range(passes + 1)]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        lo_, hi_ = np.uint64(lo), np.uint64(min(hi, 2**64 - 1))
        chunk = []
        for p in files:
            h = np.fromfile(p, np.uint64)
            a, b = np.searchsorted(h, lo_), len(h) if hi >= 2**64 else np.searchsorted(h, hi_)
            chunk.append(h[a:b])
        if not chunk:
            continue
        h = np.concatenate(chunk)
        h.sort()
        out.append(np.unique(h[1:][h[1:] == h[:-1]]))
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


def _files_with(d: Path, parts: Sequence[str], hashes: np.ndarray) -> list[bool]:
    """Which partitions' hash files hold any of ``hashes`` (sorted)."""
    out = []
    for p in parts:
        h = np.fromfile(d / f"{p}.u64", np.uint64)
        out.append(bool(len(h)) and bool(np.isin(h, hashes, assume_unique=False).any()))
    return out


# -------------------------------------------------------------------------------- data cards

_ASPECT = "greatest(orig_width, orig_height) / least(orig_width, orig_height)"


def _card_sql(cards: str, meta: str, images: str) -> str:
    """Per partition of the card records ``cards``: its card as counts and exact histograms,
    from each row's final outcome (the ``dataset_rows`` rules: the metadata's, else the image
    stage's, pending before it ran, a content duplicate's ``filtered: duplicate_content``)."""
    stored = "FROM r WHERE outcome = 'stored'"

    def counts(section: str, expr: str, where: str = "") -> str:
        return (f"SELECT partition, '{section}', coalesce(CAST({expr} AS VARCHAR), '(none)'), "
                f"NULL::DOUBLE, count(*) {stored} {where} GROUP BY ALL")  # fmt: skip

    def hist(section: str, expr: str) -> str:
        return (f"SELECT partition, '{section}', NULL, ({expr})::DOUBLE AS v, count(*) {stored} "
                f"AND v IS NOT NULL GROUP BY ALL")  # fmt: skip

    bucket = f"""CASE WHEN {_ASPECT} < 1.25 THEN '1-1.25' WHEN {_ASPECT} < 1.5 THEN '1.25-1.5'
                      WHEN {_ASPECT} < 2 THEN '1.5-2' WHEN {_ASPECT} < 3 THEN '2-3'
                      ELSE '>=3' END"""
    return f"""
    WITH r AS MATERIALIZED (
      SELECT c.* EXCLUDE (asset, id),
             CASE WHEN m.outcome != 'stored' THEN m.outcome
                  WHEN i.id IS NULL THEN 'pending'
                  WHEN l.id IS NOT NULL THEN 'filtered'
                  ELSE i.outcome END AS outcome,
             CASE WHEN m.outcome != 'stored' THEN m.reason
                  WHEN l.id IS NOT NULL THEN 'duplicate_content'
                  ELSE i.reason END AS reason
      FROM read_parquet({cards}, union_by_name=true) c
      JOIN (SELECT partition, id, outcome, reason FROM read_parquet({meta}, union_by_name=true)
            WHERE asset = 'pd12m_metadata') m ON m.partition = c.partition AND m.id = c.id
      LEFT JOIN (SELECT partition, id, outcome, reason FROM read_parquet({images},
                 union_by_name=true) WHERE asset = 'images_256') i
             ON i.partition = c.partition AND i.id = c.id
      LEFT JOIN losers l ON l.partition = c.partition AND l.id = c.id
      WHERE c.asset IS NOT NULL)
    SELECT partition, 'outcome' AS section, outcome || coalesce(':' || reason, '') AS item,
           NULL::DOUBLE AS value, count(*) AS n FROM r GROUP BY ALL
    UNION ALL {counts("license", "license")}
    UNION ALL {counts("source", "source")}
    UNION ALL {counts("aspect", bucket, "AND orig_width IS NOT NULL")}
    UNION ALL {counts("bucket", "bucket", "AND bucket IS NOT NULL")}
    UNION ALL {hist("kept", "kept")}
    UNION ALL {hist("caption_chars", "caption_chars")}
    UNION ALL {hist("caption_tokens", "caption_tokens")}
    UNION ALL {hist("orig_long_side", "greatest(orig_width, orig_height)")}
    UNION ALL {hist("orig_short_side", "least(orig_width, orig_height)")}
    UNION ALL {hist("aspect_value", f"round({_ASPECT}, 3)")}
    UNION ALL {hist("max_tokens", "max_tokens")}
    UNION ALL SELECT partition, 'text', 'captions_over_max_tokens', NULL,
                     count(*) FILTER (caption_tokens > max_tokens) {stored} GROUP BY ALL
    UNION ALL SELECT partition, 'text', 'tokenized', NULL, count(caption_tokens) {stored}
              GROUP BY ALL"""


def _refresh_cards(con, layout: DataLayout, s: Path, state: _State, changes: _Changes,
                   losers_changed: bool) -> None:  # fmt: skip
    """Re-summarise the cards whose inputs changed: the card records, the partition's metadata
    and image row records, or its content losers."""
    c, d = layout.catalog_dir, s / "cards"
    if not (d / "_empty.parquet").exists():  # so that the view's glob always matches
        _write_table(d / "_empty.parquet", CARD_SUMMARY_SCHEMA.empty_table())
    for p in changes.gone.get("cards", []):
        (d / f"{p.stem}.parquet").unlink(missing_ok=True)
    rows = [*changes.changed.get("rows", []), *changes.gone.get("rows", [])]
    touched = {p.stem for p in changes.changed.get("cards", [])}
    touched |= {p.stem for p in rows if p.parent.name in ("pd12m_metadata", "images_256")}
    if not (touched or losers_changed):
        return
    card_files = {Path(n).stem: c / "cards" / "data_card" / n
                  for n in state.listing("cards/data_card")}  # fmt: skip
    losers = pq.read_table(s / "content_losers.parquet", columns=["partition", "id"])
    if losers_changed:  # a partition whose losers changed: its card changes
        now = set(losers.column("partition").to_pylist())
        prev = s / "content_losers.partitions.json"
        touched |= now | (set(json.loads(prev.read_text())) if prev.exists() else set())
        _write_bytes(prev, json.dumps(sorted(now)).encode())
    todo = sorted(p for p in touched if p in card_files)
    con.register("losers", losers)
    meta_dir, img_dir = c / "rows" / "pd12m_metadata", c / "rows" / "images_256"
    empty = c / "rows" / "_empty" / "_empty.parquet"
    for i in range(0, len(todo), BATCH):
        batch = todo[i : i + BATCH]
        meta = [meta_dir / f"{p}.parquet" for p in batch if (meta_dir / f"{p}.parquet").exists()]
        imgs = [img_dir / f"{p}.parquet" for p in batch if (img_dir / f"{p}.parquet").exists()]
        sql = _card_sql(_sql_list([card_files[p] for p in batch]), _sql_list([empty, *meta]),
                        _sql_list([empty, *imgs]))  # fmt: skip
        t = con.sql(sql).to_arrow_table()
        t = t.rename_columns(CARD_SUMMARY_SCHEMA.names).cast(CARD_SUMMARY_SCHEMA)
        t = t.sort_by([("partition", "ascending"), ("section", "ascending"),
                       ("value", "ascending")])  # fmt: skip
        parts = t.column("partition").to_numpy(zero_copy_only=False)
        bounds = np.flatnonzero(np.r_[True, parts[1:] != parts[:-1], True])
        made = set()
        for a, b in zip(bounds[:-1], bounds[1:]):
            _write_table(d / f"{parts[a]}.parquet", t.slice(a, b - a))
            made.add(parts[a])
        for p in batch:  # a card with no rows joined (no metadata records): an empty card
            if p not in made:
                _write_table(d / f"{p}.parquet", CARD_SUMMARY_SCHEMA.empty_table())
