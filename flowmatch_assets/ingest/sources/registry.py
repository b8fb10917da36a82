"""The partitions of a source: which samples each one holds, fixed when it is registered.

Registering a source scans its location and cuts every sample not yet in a partition into new
partitions of at most ``shard_size`` samples, keyed ``<name>-NNNNN`` in registration order. What
a partition holds is written down once, in its manifest, and never changes:

    <root>/sources/<name>/shards/<key>.json    the partition's samples (manifest)
    <root>/sources/<name>/index.json           every partition: key, unit, range, samples

so adding images to a folder, or a new tar or parquet file, adds partitions and leaves the
existing ones (and everything made from them) as they were; a re-scan that finds nothing new
adds nothing. A file or image that disappears after registration becomes a failed row with its
reason when its partition is next materialized, never a silent drop. The manifests are written
atomically (each file, then the index), under a lock, so a sensor and ``flowmatch partitions
register`` never number two partitions alike.

A manifest is ``{key, source, kind, unit, start, end, entries}``: ``unit`` the file (parquet,
webdataset) or folder the samples come from; ``start``/``end`` the rows of a parquet file or the
sample positions in a tar; ``entries`` the folder samples (``{id, image, caption}`` paths relative
to the location, or ``problem`` for a metadata.jsonl line that cannot be read) or the tar's
sample keys.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pyarrow as pa

from flowmatch_assets.catalog import file_lock
from flowmatch_assets.ingest.images import IngestError
from flowmatch_assets.ingest.sources.common import failure
from flowmatch_assets.ingest.sources.config import (
    SOURCE_KINDS,
    SourceConfig,
    SourceError,
    check_name,
    redact,
)
from flowmatch_assets.ingest.sources.folder import FolderKind
from flowmatch_assets.ingest.sources.kind import Manifest, PartitionSource, SourceKind
from flowmatch_assets.ingest.sources.parquet import ParquetKind
from flowmatch_assets.ingest.sources.urls import BUILT_IN, UrlsKind
from flowmatch_assets.ingest.sources.webdataset import WebDatasetKind
from flowmatch_models.storage.atomic import atomic_write_text
from flowmatch_models.storage.layout import source_of

#: THE REGISTRY of source kinds: one :class:`SourceKind` per ``kind`` a source may have
#: (``config.SOURCE_KINDS``, which the config validates against, names the same ones).
SOURCE_KIND_REGISTRY: dict[str, SourceKind] = {
    k.name: k for k in (FolderKind(), ParquetKind(), WebDatasetKind(), UrlsKind())
}
if tuple(SOURCE_KIND_REGISTRY) != SOURCE_KINDS:
    raise ImportError(f"source kinds {tuple(SOURCE_KIND_REGISTRY)} != config's {SOURCE_KINDS}")


def source_kind(name: str) -> SourceKind:
    """The registered :class:`SourceKind` ``name``."""
    return SOURCE_KIND_REGISTRY[name]


def source_dir(root: str | Path, name: str) -> Path:
    return Path(root) / "sources" / name


def partition_key(name: str, number: int) -> str:
    return f"{name}-{number:05d}"


def registered(root: str | Path, name: str) -> list[dict]:
    """The index of a source's partitions (``{key, unit, start, end}``), in key order."""
    p = source_dir(root, name) / "index.json"
    return json.loads(p.read_text()) if p.is_file() else []


def manifest(root: str | Path, key: str) -> Manifest:
    """The manifest of partition ``key`` (a source's), or SourceError naming the fix."""
    name = key.split("-", 1)[0]
    p = source_dir(root, name) / "shards" / f"{key}.json"
    if not p.is_file():
        raise SourceError(
            f"partition {key}: no manifest at {p}; register the source's partitions first "
            f"(`flowmatch partitions register --source {name}`)"
        )
    return Manifest(**json.loads(p.read_text()))


@dataclass
class Scan:
    """What a scan of a source found: the partitions it would add (keys as :func:`register`
    numbers them) and the files it skipped because they cannot be read whole (a truncated or
    lying tar, a damaged parquet file, a link out of the location), each ``(file, reason,
    detail)``. A skipped file is looked at again by the next scan."""

    new: list[Manifest]
    skipped: list[tuple[str, str, str]]

    def skipped_line(self, name: str) -> str:
        """One line: what was skipped and why (empty when nothing was)."""
        return "; ".join(f"{name}: {u} ({r}: {d})" for u, r, d in self.skipped)


def _stamp(loc, unit: str) -> list | None:
    """A unit file's size and modification time (None when it cannot be looked at)."""
    try:
        if loc.local:
            st = os.stat(loc.path(unit))
            return [st.st_size, st.st_mtime_ns]
        info = loc.fs.info(loc.path(unit))
        return [info.get("size"), str(info.get("mtime") or info.get("ETag") or "")]
    except (OSError, ValueError, IngestError):
        return None


def _skipped_before(root: str | Path, name: str) -> dict[str, dict]:
    """The files the last registration skipped: ``{unit: {stamp, reason, detail}}``."""
    p = source_dir(root, name) / "skipped.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, ValueError):
        return {}


def unregistered(root: str | Path, name: str, cfg: SourceConfig) -> Scan:
    """What :func:`register` would add now, writing nothing. A file the last registration
    skipped is not read again while its size and modification time are the same (a sensor
    tick would otherwise re-read every broken tar): it is skipped with the same reason."""
    index = registered(root, name)
    known = [manifest(root, s["key"]) for s in index]
    before = _skipped_before(root, name)
    same: dict[str, dict] = {}
    if before:
        from flowmatch_assets.ingest.sources.location import Location

        loc = Location(cfg)
        same = {u: r for u, r in before.items() if (s := _stamp(loc, u)) and s == r["stamp"]}
    held = [Manifest("", name, cfg.kind, u, 0, 0, []) for u in same]
    found = source_kind(cfg.kind).scan(cfg, known + held)
    skipped = [(u, r, redact(d, cfg.location)) for u, r, d in found.skipped]
    skipped = sorted(skipped + [(u, r["reason"], r["detail"]) for u, r in same.items()])
    return Scan(
        [
            Manifest(
                partition_key(name, len(index) + i),
                name,
                cfg.kind,
                p.unit,
                p.start,
                p.end,
                p.entries,
                p.span,
            )
            for i, p in enumerate(found.new)
        ],
        skipped,
    )


def register(root: str | Path, name: str, cfg: SourceConfig) -> Scan:
    """Scan source ``name`` and register partitions for every sample not in one yet; returns
    the scan (``new``: none when nothing is new; ``skipped``: files that cannot be read whole).
    Safe to call from several processes. Raises SourceError when the location is missing."""
    check_name(name)
    d = source_dir(root, name)
    with file_lock(d / ".register.lock"):
        scan = unregistered(root, name, cfg)
        for m in scan.new:  # the manifests first, then the index that lists them
            atomic_write_text(d / "shards" / f"{m.key}.json", json.dumps(m.__dict__))
        before = _skipped_before(root, name)
        if scan.skipped or before:
            from flowmatch_assets.ingest.sources.location import Location

            loc = Location(cfg)
            skipped = {
                u: {"stamp": _stamp(loc, u), "reason": r, "detail": dt} for u, r, dt in scan.skipped
            }
            skipped = {u: v for u, v in skipped.items() if v["stamp"] is not None}
            atomic_write_text(d / "skipped.json", json.dumps(skipped, indent=0))
        if scan.new:
            index = [*registered(root, name), *(m.summary() for m in scan.new)]
            atomic_write_text(d / "index.json", json.dumps(index, indent=0))
            _share(root, [d / "shards" / f"{m.key}.json" for m in scan.new] + [d / "index.json"])
    return scan


def _share(root: str | Path, paths: list[Path]) -> None:
    """With a remote data root, what a registration wrote goes to the other machines too."""
    from flowmatch_models.storage import remote

    store = remote.active(root)
    if store is not None:
        store.push_files(paths)


def forget(root: str | Path, name: str) -> None:
    """Remove a source's manifests (``flowmatch sources remove --purge``)."""
    d = source_dir(root, name)
    if d.exists():
        shutil.rmtree(d)


# ---------------------------------------------------------------------------- a partition's data

#: The columns of a listed partition (PD12M's metadata columns + ``row_index``).
ROW_COLUMNS = {
    "id": pa.string(),
    "url": pa.string(),
    "caption": pa.string(),
    "width": pa.int64(),
    "height": pa.int64(),
    "mime_type": pa.string(),
    "hash": pa.string(),
    "license": pa.string(),
    "source": pa.string(),
    "row_index": pa.int64(),
}


def partition_rows(
    root: str | Path, cfg: SourceConfig, key: str
) -> tuple[pa.Table, list[dict], Manifest]:
    """Partition ``key``'s samples as a table in the PD12M metadata columns (the filters and
    the images stage take it as they take PD12M's), the samples that cannot be rows
    (``{id, url, reason, detail}``: common.LISTING_REASONS) and its manifest."""
    m = manifest(root, key)
    if m.kind != cfg.kind:
        raise SourceError(
            f"partition {key} was registered as a {m.kind} source, but {m.source} is configured "
            f"as {cfg.kind} now; register the new location under another source name"
        )
    kind = source_kind(cfg.kind)
    try:
        listing = kind.rows(cfg, m.source, m)
        rows, failed = listing.rows, listing.failed
    except (IngestError, OSError) as e:  # the whole unit cannot be read: each sample says why
        err = e if isinstance(e, IngestError) else IngestError("unreadable", f"{m.unit}: {e}")
        rows = []
        failed = [failure(i, m.unit, err.reason, err.detail) for i in kind.sample_ids(m)]
    seen: set[str] = set()
    unique = []
    for r in rows:  # an id names one row of the partition (catalog records, the images stage)
        if r["id"] in seen:
            failed.append(
                failure(
                    r["id"],
                    r["url"],
                    "duplicate_id",
                    f"another sample of {key} has the id {r['id']!r}",
                )
            )
            continue
        seen.add(r["id"])
        unique.append(r)
    table = pa.Table.from_pylist(unique, schema=pa.schema(ROW_COLUMNS))
    for f in failed:  # an error from a remote filesystem can quote the location's URL
        f["detail"] = redact(f.get("detail"), cfg.location)
    return table, failed, m


def partition_images(
    root: str | Path, cfg: SourceConfig, key: str, rows: list[dict], max_bytes: int
) -> Iterator[tuple[dict, bytes | IngestError]]:
    """``(row, the bytes of its image or the IngestError why not)`` for each of ``rows``; a
    read that fails in a way the kind did not foresee costs the rows not read yet (each a
    failure with the error), never the partition."""
    todo = {r["id"]: r for r in rows}
    try:
        for r, data in source_kind(cfg.kind).images(cfg, manifest(root, key), rows, max_bytes):
            todo.pop(r["id"], None)
            if isinstance(data, IngestError):  # its detail may quote the location's URL
                data = IngestError(data.reason, redact(data.detail, cfg.location))
            yield r, data
    except IngestError as e:
        err = e
    except (OSError, ValueError, EOFError) as e:
        err = IngestError("unreadable", f"{type(e).__name__}: {e}"[:300])
    else:
        return
    err = IngestError(err.reason, redact(err.detail, cfg.location))
    for r in todo.values():
        yield r, err


# ------------------------------------------------------------------------ a partition's source


class ConfiguredSource(PartitionSource):
    """A configured source of the user's own images (``res.source(name)``; SourceError when
    it is not configured) as the stages ask it: registered partitions, listed rows, its
    kind's reads (or, a kind that ``downloads``, none). ``res``: the FlowmatchResource."""

    registers: ClassVar[bool] = True

    def __init__(self, res, name: str) -> None:
        self.res, self.name, self.cfg = res, name, res.source(name)

    def partitions(self) -> list[dict]:
        """Its registered partitions, from its manifests' index (the location is not read)."""
        cfg = self.cfg
        return [
            Manifest(**s, source=self.name, kind=cfg.kind).as_partition(cfg.location)
            for s in registered(self.res.data_root, self.name)
        ]

    def rows(self, key: str, log: Callable[[str], None]) -> tuple[pa.Table, list[dict], dict]:
        """Listed from the partition's manifest: rows, and the samples that cannot be rows."""
        table, failed, m = partition_rows(self.res.data_root, self.cfg, key)
        where = m.as_partition(self.cfg.location)
        extra = {
            "source_file": where["source_file"],
            "row_start": m.start,
            "row_end": m.end,
            "source_kind": self.cfg.kind,
            "manifest": m.digest(),
        }
        return table, failed, extra

    def reader(self, key: str, max_bytes: int):
        if source_kind(self.cfg.kind).downloads:
            return None
        root, cfg = self.res.data_root, self.cfg
        return lambda todo: partition_images(root, cfg, key, todo, max_bytes)

    def row_fields(self) -> dict:
        return {"source": self.name, "source_settings": self.cfg.row_fields()}

    def listing(self, key: str) -> list[dict]:
        table, failed, _ = partition_rows(self.res.data_root, self.cfg, key)
        extra = {"caption": "", "license": self.cfg.license, "source": self.name}
        return table.to_pylist() + [{**f, **extra} for f in failed]


def source_named(res, name: str) -> PartitionSource:
    """Source ``name``: a built-in one (``urls.BUILT_IN``: PD12M) or a configured one
    (SourceError naming the configured ones when it is neither)."""
    built_in = BUILT_IN.get(name)
    return built_in(res) if built_in is not None else ConfiguredSource(res, name)


def partition_source(res, key: str | None) -> PartitionSource:
    """The source partition ``key`` belongs to (``source_of``); None: the first built-in
    source (what a key-less fingerprint of ``metadata`` describes)."""
    return source_named(res, source_of(key) if key else next(iter(BUILT_IN)))


def all_sources(res) -> list[PartitionSource]:
    """Every source: the built-in ones, then the configured ones by name (key order)."""
    return [cls(res) for cls in BUILT_IN.values()] + [
        ConfiguredSource(res, n) for n in sorted(res.sources)
    ]
