"""What changed in the catalog's record folders since the summaries were last refreshed
(:mod:`.summary`): the folders listed only when their mtime moved, per file its inode, size
and mtime, and the writer's own summary read from each changed file's parquet footer as bytes.

A record file is re-read only when its identity changed (a rewrite is an atomic rename: a new
inode); a folder whose mtime did not change is not even listed (every writer renames into its
folder, which changes its mtime; a file edited in place is seen when its folder next changes)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq

from flowmatch_assets.catalog.derived import _write_bytes
from flowmatch_assets.catalog.record_kinds import row_kinds
from flowmatch_assets.catalog.records import SUMMARY_KEY
from flowmatch_models.storage.layout import DataLayout

#: A directory changed less than this long ago is listed even if its mtime looks unchanged
#: (two renames within one timestamp tick).
FRESH_DIR_S = 2.0


class RecordFile(NamedTuple):
    """A record file: its path, its folder's name (the asset) and its stem (the partition)."""

    path: str
    asset: str
    partition: str


@dataclass
class Changes:
    """Per kind: the record files changed or new (re-read them) and gone (drop them)."""

    changed: dict[str, list[RecordFile]] = field(default_factory=dict)
    gone: dict[str, list[RecordFile]] = field(default_factory=dict)

    def any(self, kind: str) -> bool:
        return bool(self.changed.get(kind) or self.gone.get(kind))


class State:
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


def scan(layout: DataLayout, state: State, kinds: Sequence[str]) -> tuple[Changes, list[str]]:
    """What changed in the record folders of ``kinds`` since the last refresh (a folder whose
    mtime and inode did not change, and that was listed well after its mtime, is not listed);
    and the folders listed."""
    c = layout.catalog_dir
    changes, listed = Changes(), []
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
            if (
                st is not None
                and seen is not None
                and [st.st_mtime_ns, st.st_ino] == seen["at"]
                and seen["listed"] > st.st_mtime_ns / 1e9 + FRESH_DIR_S
            ):
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
                        changed.append(RecordFile(e.path, asset, e.name[: -len(".parquet")]))
            for name in old.keys() - new.keys():
                path = os.path.join(base, name)
                changes.gone.setdefault(kind, []).append(RecordFile(path, asset, name[:-8]))
            state.files[rel] = new
            if st is None:
                state.dirs.pop(rel, None)
            else:
                prev = seen.get("legacy", []) if seen else []
                state.dirs[rel] = {
                    "at": [st.st_mtime_ns, st.st_ino],
                    "listed": now,
                    "legacy": sorted(set(prev) & set(new)),
                }
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


def _footer(path: str) -> bytes:
    """A parquet file's footer as bytes (one read for the files the catalog writes)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - 65536))
        chunk = f.read()
    if chunk[-4:] != b"PAR1":
        raise ValueError(f"{path}: not a parquet file")
    n = int.from_bytes(chunk[-8:-4], "little")
    if n + 8 > len(chunk):
        with open(path, "rb") as f:
            f.seek(-8 - n, os.SEEK_END)
            return f.read(n)
    return chunk[-8 - n : -8]


def _own_summary(raw: bytes, path: str):
    """The summary the writer put in the footer (a key-value pair: the key, then field 2 of
    type binary, 0x18, its length and bytes); None if there is none."""
    i = raw.find(_SUMMARY)
    if i < 0:
        return None
    j = i + len(_SUMMARY)
    if raw[j] != 0x18:  # not laid out as pyarrow writes it: parse it properly
        value = (pq.read_metadata(path).metadata or {}).get(SUMMARY_KEY)
        return None if value is None else json.loads(value)
    j, n, shift = j + 1, 0, 0
    while True:
        b = raw[j]
        j += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            break
    return json.loads(raw[j : j + n])


class Seen(NamedTuple):
    """What a changed record file's footer says: its own summary (materializations and row
    records), and whether it has today's columns (per-row records)."""

    summary: object
    current: bool


def read_footers(changes: Changes) -> dict[str, Seen]:
    """What the footer of each changed record file says (read as bytes, a tenth of what
    parsing it costs; a file gone meanwhile, or unreadable, is left out: the views' globs will
    say so)."""
    kinds = row_kinds()  # the registry's per-row kinds and their schemas (record_kinds.py)
    names = {k: [_thrift_string(n.encode()) for n in sch.names] for k, sch in kinds.items()}
    out = {}
    for kind in ("materializations", *kinds):
        own = kind in ("materializations", "rows")
        for f in changes.changed.get(kind, []):
            try:
                raw = _footer(f.path)
                out[f.path] = Seen(
                    _own_summary(raw, f.path) if own else None,
                    all(n in raw for n in names.get(kind, ())),
                )
            except (OSError, ValueError):
                continue
    return out
