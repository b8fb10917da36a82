"""Global dedupe: the first occurrence of an image in dataset order wins, in every partition.

Dataset order is (metadata file number, row in the file); partition keys ``NNN-KK`` sort in it.

**By metadata hash (before download).** The winner of a PD12M md5 ``hash`` is its first row in
dataset order among the rows the other filters keep (a row dropped for its caption or license
never shadows a good copy). That depends on the metadata files and the filter settings only,
never on which partitions ran first, so every partition decides alone from one index:

    <root>/dedupe/<filters digest>/files/NNN-<file identity>.npz   per metadata file: its
        distinct hash keys (16 bytes) and the first kept row of each (built once per file)
    <root>/dedupe/<filters digest>/global-<digest of the file list>/{keys,file,row}.npy
        every file's keys merged: the first (file, row) of each key, sorted by key

Both are pure functions of their inputs, written atomically (a per-file ``.npz`` by rename,
the global folder by renaming a finished temp folder), so parallel runs agree without locks; a
lock file only saves them from building the same index twice at once. A partition memory-maps
the global arrays and looks its keys up (binary search). Adding a metadata file builds a new
global index from the cached per-file ones; earlier winners cannot change (a new file only adds
later rows).

**By content (after download).** ``images`` records the md5 of every stored row's bytes
(``catalog/content/images/<partition>.parquet``). A row whose bytes were already stored by an
earlier row (earlier in its own shard, or in an earlier partition materialized before it) is
dropped there as ``duplicate_content``. When the earlier partition is materialized *after* the
later one (reverse order, or in parallel), both are stored; the catalog's
``content_duplicates`` view names the later one by dataset order, and ``dataset_rows`` counts it
as ``duplicate_content``, so the kept set the catalog reports is the same in any order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flowmatch_assets.catalog import file_lock, record_kind
from flowmatch_assets.catalog.derived import content_hashes_path, md5_hashes
from flowmatch_assets.ingest.metadata import (
    FilterConfig,
    HashWinners,
    MetadataError,
    filter_fields,
    filter_rows,
    list_metadata_files,
    shard_key,
)
from flowmatch_models.storage.atomic import atomic_path, usual_mode
from flowmatch_models.storage.layout import DataLayout

#: Filter fields that are not row-local (they do not decide which rows are eligible winners).
_DEDUPE_FIELDS = {"drop_duplicate_hash", "drop_duplicate_content"}
_FILTER_COLUMNS = ["id", "url", "caption", "width", "height", "license", "hash"]
_HEX = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i


# ------------------------------------------------------------------------------------ keys


def hash_keys(hashes: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """16-byte keys (``S16``) of md5 hex strings, and which rows have a hash at all.

    A 32-hex-digit hash (any case) is its 16 bytes; any other non-empty string is keyed by the
    md5 of its text, so odd hashes still dedupe among themselves; empty/null: no key."""
    arr = hashes.combine_chunks() if isinstance(hashes, pa.ChunkedArray) else hashes
    s = pc.utf8_lower(pc.utf8_trim_whitespace(arr.cast(pa.string())))
    present = pc.fill_null(pc.greater(pc.utf8_length(s), 0), False).to_numpy(zero_copy_only=False)
    is_hex = pc.fill_null(pc.match_substring_regex(s, "^[0-9a-f]{32}$"), False)
    filled = pc.if_else(is_hex, s, pa.scalar("0" * 32)).cast(pa.binary())
    fixed = filled.cast(pa.binary(32))
    n = len(fixed)
    raw = np.frombuffer(fixed.buffers()[1], np.uint8)[fixed.offset * 32 : (fixed.offset + n) * 32]
    nib = _HEX[raw.reshape(n, 32)]
    keys = ((nib[:, 0::2] << 4) | nib[:, 1::2]).astype(np.uint8).copy().view("S16").reshape(n)
    odd = np.flatnonzero(present & ~is_hex.to_numpy(zero_copy_only=False))
    for i in odd:
        keys[i] = hashlib.md5(s[int(i)].as_py().encode()).digest()
    return keys, present


def first_occurrences(keys: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys sorted, index into ``keys`` of each one's smallest ``order``)."""
    halves = keys.view(">u8").reshape(len(keys), 2)  # big-endian: sorts as the bytes do
    idx = np.lexsort((order, halves[:, 1], halves[:, 0]))  # by key, then by order
    sk = keys[idx]
    first = np.ones(len(sk), bool)
    first[1:] = sk[1:] != sk[:-1]
    return sk[first], idx[first]


# --------------------------------------------------------------------------- the hash index


def filters_digest(cfg: FilterConfig) -> str:
    """Which rows are eligible winners depends on the row-local filters only."""
    d = filter_fields(cfg, exclude=_DEDUPE_FIELDS)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def file_identity(path: str) -> str:
    """Size and modification time (or ETag) of a metadata file: a changed file is re-indexed."""
    fs, p = fsspec.core.url_to_fs(path)
    info = fs.info(p)
    stamp = next(
        (info[k] for k in ("mtime", "LastModified", "last_modified", "ETag", "etag") if k in info),
        "",
    )
    return hashlib.sha256(f"{info.get('size')}|{stamp}".encode()).hexdigest()[:12]


def file_index(path: str, cfg: FilterConfig) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys sorted, first eligible row of each) of one metadata file."""
    with fsspec.open(path, "rb") as f:
        table = pq.read_table(f, columns=_FILTER_COLUMNS)
    table = table.append_column("row_index", pa.array(np.arange(table.num_rows), pa.int64()))
    kept, _ = filter_rows(table, cfg.model_copy(update=dict.fromkeys(_DEDUPE_FIELDS, False)))
    keys, present = hash_keys(kept.column("hash"))
    rows = kept.column("row_index").to_numpy()[present]
    sk, first = first_occurrences(keys[present], rows)
    return sk, rows[first].astype(np.int32)


@dataclass
class HashIndex:
    """The first eligible (file, row) of every metadata hash; memory-mapped arrays."""

    keys: np.ndarray  # S16, sorted
    file: np.ndarray  # int32
    row: np.ndarray  # int32
    files: dict[int, str]  # file number -> path (to look up kept ids)
    shard_size: int

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(file, row) of the winner of each key; -1 where the key is unknown."""
        pos = np.searchsorted(self.keys, keys)
        pos = np.minimum(pos, max(len(self.keys) - 1, 0))
        found = (self.keys[pos] == keys) if len(self.keys) else np.zeros(len(keys), bool)
        f = np.where(found, self.file[pos] if len(self.keys) else -1, -1)
        r = np.where(found, self.row[pos] if len(self.keys) else -1, -1)
        return f.astype(np.int64), r.astype(np.int64)

    def ids(self, file_rows: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """The metadata ``id`` at each (file, row)."""
        out: dict[tuple[int, int], str] = {}
        for n in sorted({f for f, _ in file_rows}):
            with fsspec.open(self.files[n], "rb") as fh:
                ids = pq.read_table(fh, columns=["id"]).column("id")
            for f, r in file_rows:
                if f == n:
                    out[(f, r)] = str(ids[r].as_py())
        return out

    def partition_of(self, file: int, row: int) -> str:
        return shard_key(file, row // self.shard_size)


def build_hash_index(
    root: str | Path,
    source: str,
    cfg: FilterConfig,
    shard_size: int,
    log: Callable[[str], None] = lambda m: None,
) -> HashIndex:
    """The global hash index of every metadata file under ``source`` (built or reused)."""
    files = list_metadata_files(source)
    base = Path(root) / "dedupe" / filters_digest(cfg)
    ident = {n: file_identity(p) for n, p in files.items()}
    digest = hashlib.sha256(json.dumps(sorted(ident.items())).encode()).hexdigest()[:16]
    final = base / f"global-{digest}"
    if not (final / "row.npy").exists():
        with file_lock(base / ".build.lock"):  # saves duplicate work only; the writes are atomic
            if not (final / "row.npy").exists():
                _build_global(base, final, files, ident, cfg, log)
    keys, file_, row = (np.load(final / f"{a}.npy", mmap_mode="r") for a in ("keys", "file", "row"))
    return HashIndex(keys, file_, row, files, shard_size)


def hash_winners(index: HashIndex, file_number: int) -> HashWinners:
    """``filter_rows``'s ``winners`` for rows of metadata file ``file_number``."""

    def winners(table: pa.Table, eligible: list[int]) -> dict[int, tuple[str, str]]:
        if not eligible:
            return {}
        sub = table.take(pa.array(eligible, pa.int64()))
        keys, present = hash_keys(sub.column("hash"))
        f, r = index.lookup(keys)
        rows = sub.column("row_index").to_numpy()
        if (present & (f < 0)).any():
            raise MetadataError(
                f"metadata file {file_number:03d} changed after its hashes were indexed; "
                "materialize the partition again (the index is rebuilt for the new file)"
            )
        dup = np.flatnonzero(present & ~((f == file_number) & (r == rows)))
        ids = index.ids([(int(f[j]), int(r[j])) for j in dup])
        return {
            eligible[j]: (index.partition_of(int(f[j]), int(r[j])), ids[(int(f[j]), int(r[j]))])
            for j in dup
        }

    return winners


def _build_global(base, final, files, ident, cfg, log) -> None:
    parts_k, parts_f, parts_r = [], [], []
    for n, path in files.items():
        cached = base / "files" / f"{n:03d}-{ident[n]}.npz"
        if not cached.exists():
            log(f"dedupe: indexing the hashes of {path}")
            k, r = file_index(path, cfg)
            with atomic_path(cached) as tmp, open(tmp, "wb") as fh:
                np.savez(fh, keys=k, row=r)
        with np.load(cached, allow_pickle=False) as z:
            parts_k.append(z["keys"])
            parts_r.append(z["row"])
        parts_f.append(np.full(len(parts_k[-1]), n, np.int32))

    def joined(parts: list, empty: np.ndarray) -> np.ndarray:
        out = np.concatenate(parts) if parts else empty
        parts.clear()  # one copy at a time (PD12M: the keys are ~200 MB)
        return out

    keys = joined(parts_k, np.zeros(0, "S16"))
    file_ = joined(parts_f, np.zeros(0, np.int32))
    row = joined(parts_r, np.zeros(0, np.int32))
    # files are concatenated in file order, each key once per file: first by key, then file
    sk, first = first_occurrences(keys, file_)
    del keys
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-global-", dir=base))
    usual_mode(tmp, directory=True)  # another user's metadata run reads it too
    try:
        for name, a in (("keys", sk), ("file", file_[first]), ("row", row[first])):
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(a), allow_pickle=False)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same index first: identical content
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"dedupe: global hash index of {len(files)} files, {len(sk)} distinct hashes")
    for old in base.glob("global-*"):  # earlier file lists (open memory maps stay valid)
        if old != final:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- content dedupe


def stored_before(root: str | Path, partition: str, md5s: list[str]) -> dict[str, tuple[str, str]]:
    """md5 -> (partition, id) of its first stored row in the partitions before ``partition``
    (those materialized now), for the ``md5s`` asked about (vectorised: each earlier content
    record's md5 column is matched against them, no dataset-wide dict is built). An earlier
    partition whose md5 hashes (catalog/derived.py, written with its record) hold none of
    them is not read: the cost per partition stays ~30 µs per earlier partition, not a read."""
    layout = DataLayout(root)
    d = record_kind("content").folder(layout) / "images"
    files = sorted(p for p in d.glob("*.parquet") if p.stem < partition) if d.is_dir() else []
    wanted = pa.array(sorted({m for m in md5s if m}), pa.string())
    out: dict[str, tuple[str, str]] = {}
    if not len(wanted):
        return out
    hashes = np.sort(md5_hashes(wanted))
    for p in files:  # partition order, rows in dataset order: the first one seen wins
        if not _may_hold(layout, p, hashes):
            continue
        t = pq.read_table(p, columns=["id", "md5"])
        hit = t.filter(pc.is_in(t.column("md5"), value_set=wanted))
        for i, m in zip(hit.column("id").to_pylist(), hit.column("md5").to_pylist()):
            out.setdefault(m, (p.stem, i))
    return out


def _may_hold(layout: DataLayout, record, hashes: np.ndarray) -> bool:
    """Whether a content record may hold one of ``hashes`` (sorted): False only when the md5
    hashes written with that very record (same inode, size, mtime) hold none of them."""
    try:
        st = record.stat()
        raw = np.fromfile(content_hashes_path(layout, record.stem), np.uint64)
    except (OSError, ValueError):
        return True
    if len(raw) < 3 or raw[:3].tolist() != [st.st_ino, st.st_size, st.st_mtime_ns]:
        return True
    return bool(np.isin(raw[3:], hashes, assume_unique=False).any())


def drop_content_duplicates(
    stored: list[dict], earlier: dict[str, tuple[str, str]], partition: str
) -> tuple[list[dict], list[dict]]:
    """(rows to keep, dropped ``{id, url, hash, kept_partition, kept_id}``; ``hash`` is the
    bytes' md5): a row is dropped
    when its bytes' md5 was stored by an earlier partition or an earlier row of this one."""
    seen = dict(earlier)
    keep, dropped = [], []
    for r in stored:
        m = r.get("md5")
        if m and m in seen:
            kp, kid = seen[m]
            dropped.append(
                {"id": r["id"], "url": r["url"], "hash": m, "kept_partition": kp, "kept_id": kid}
            )
            continue
        if m:
            seen[m] = (partition, r["id"])
        keep.append(r)
    return keep, dropped
