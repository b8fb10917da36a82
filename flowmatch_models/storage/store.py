"""The embedding store: one self-describing, checksummed ``.fms`` file per asset partition.

File layout (all integers little-endian)::

    prefix   32 B   magic b"FMSTORE\0", version u32, flags u32, header_len u64, data_start u64
    header   JSON   {"ids", "attrs", "arrays": {name: {dtype, shape, codec, offset, nbytes,
                     raw_nbytes, checksum, [lossy, scale]}}, "checksum": "xxh3_64"}
    padding  to data_start (64-byte aligned)
    arrays   each 64-byte aligned; ``offset`` is relative to data_start
    footer   32 B   magic b"FMSEND\0\0", total file length u64, xxh3_64(prefix + header) u64,
                    reserved u64

Codecs (per array): ``none`` (raw bytes, read zero-copy through one read-only ``mmap`` of the
file), ``zstd`` (byte-shuffle: the bytes of each element split into planes, then zstd level 3),
``xz`` (lzma preset 9, the seed-compatible baseline). Lossy 1-byte storage (``int8`` or ``fp8``
e4m3) keeps a per-channel (last dim) fp32 scale array beside the data; lossy ``pcaB`` (transform
coding at B bits per value, :mod:`flowmatch_models.storage.transform`) keeps fixed-rate codes and
their decoding tables, always uncompressed, so rows are read at their offsets
(:meth:`Shard.coded`) and decoded where the batch goes (the GPU). Every lossy mode records its
error in ``attrs["lossy"]``; ``shard[name]`` returns the decoded fp16 array transparently.
Internal arrays (scales, codes, tables) are named ``<array>.__<role>__`` and not listed.

Integrity: a truncated file (footer missing or wrong length), a corrupted header (checksum) or a
corrupted array (per-array checksum of the stored bytes, checked on first decode or by
``Shard.verify``) raise :class:`StoreError` naming the file. Nothing is ever unpickled.

One version of a file: a :class:`Shard` keeps the file it opened open and reads every array
through it, so a partition re-made by an atomic rename while a reader holds it (a training run
that grows) never mixes the old header with the new file's bytes; :meth:`Shard.table_key` names
the decoding tables of a transform-coded array (from the header's checksums), so codes read from
one version are never decoded with another's tables (``flowmatch_models.data``).

Ragged text: ``tokens [T, D]`` holds only the valid tokens of all captions concatenated and
``lengths [N] int32`` their counts; :func:`ragged_offsets` and :func:`pad_ragged` turn that into
padded batches plus attention masks for training.
"""

# Above ~500 lines on purpose: the .fms container's writer and reader are one format, kept in
# one file so the two cannot drift (codecs, lossy modes and transform coding live beside it).

from __future__ import annotations

import json
import lzma
import mmap
import os
import struct
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from flowmatch_models.storage import remote
from flowmatch_models.storage import transform as transform_codec
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.storage.codecs import CODECS, decode, encode
from flowmatch_models.storage.lossy import (
    LOSSY_MODES,
    Coded,
    dequantize,
    lossy_error,
    pca_error,
    quantize,
)

FORMAT_VERSION = 1

MAGIC = b"FMSTORE\x00"

FOOTER_MAGIC = b"FMSEND\x00\x00"

ALIGN = 64

_PREFIX = struct.Struct("<8sIIQQ")

_FOOTER = struct.Struct("<8sQQQ")

_SCALE_SUFFIX = ".__scale__"

_AUX = ".__"  # internal arrays: <array>.__<role>__


class StoreError(Exception):
    """A shard file is unreadable: truncated, corrupted or not an embedding-store file."""


@dataclass
class ShardStats:
    """What :func:`write_shard` wrote: bytes before/after encoding, per-array details."""

    raw_bytes: int
    stored_bytes: int
    arrays: dict[str, dict] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """raw / stored bytes (the whole file, header included)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else float("nan")


def _checksum(buf: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(buf):016x}"


def _aux_names(entry: dict) -> list[str]:
    """The internal arrays of an array's header entry (its scale, or its codes and tables)."""
    return [entry["scale"]] if "scale" in entry else list(entry.get("aux", {}).values())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_storable(name: str, arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"array {name!r} has dtype {arr.dtype}; the store holds only numeric arrays "
            "(bool/int/uint/float) — encode strings in `ids` or `attrs`"
        )
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def write_shard(
    path: str | os.PathLike,
    arrays: Mapping[str, np.ndarray],
    ids: Sequence[str],
    *,
    codec: str = "zstd",
    attrs: Mapping | None = None,
    lossy: Mapping[str, str] | None = None,
    fit_device: str = "cpu",
) -> ShardStats:
    """Write ``arrays`` (name -> numeric array) and sample ``ids`` to ``path`` atomically.

    ``codec`` applies to every array except transform-coded ones. ``lossy`` maps array names
    to ``"int8"``/``"fp8"`` (1 byte per value, per-channel scales stored beside) or ``"pcaB"``
    (fixed-rate transform coding at B bits per value: codes and tables stored uncompressed;
    ``fit_device`` computes its fit); float arrays only. The round-trip error (see
    :func:`lossy_error`) is recorded in ``attrs["lossy"][name]`` and in the returned stats.
    ``attrs`` must be JSON-serialisable. ``raw_bytes`` counts the arrays as given.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    lossy = dict(lossy or {})
    unknown = set(lossy) - set(arrays)
    if unknown:
        raise ValueError(f"lossy names {sorted(unknown)} are not arrays of this shard")
    ids = [str(i) for i in ids]
    attrs_out = dict(attrs or {})
    lossy_attrs: dict[str, dict] = {}

    # name -> (array to store, header entry extras)
    plan: list[tuple[str, np.ndarray, dict]] = []
    raw_total = 0
    for name, value in arrays.items():
        if _AUX in name:
            raise ValueError(f"array name {name!r} uses the reserved infix {_AUX!r}")
        arr = _as_storable(name, value)
        raw_total += arr.nbytes
        mode = lossy.get(name)
        if mode is None:
            plan.append((name, arr, {"raw_dtype": arr.dtype.str}))
            continue
        bits = transform_codec.bits_of(mode)
        if mode not in LOSSY_MODES and bits is None:
            raise ValueError(
                f"lossy mode {mode!r} for {name!r}; choose one of int8, fp8, pcaB (B bits per "
                "value, e.g. pca4.5)"
            )
        if arr.dtype.kind != "f" or arr.ndim == 0:
            raise ValueError(
                f"lossy storage needs a float array with >= 1 dim; {name!r} is "
                f"{arr.dtype} {arr.shape}"
            )
        if bits is not None:
            rows = arr.reshape(-1, arr.shape[-1])
            tables = transform_codec.fit(rows, bits, fit_device)
            codes = transform_codec.encode(rows, tables, device=fit_device)
            err = pca_error(rows, codes, tables, fit_device)
            lossy_attrs[name] = {
                "mode": mode,
                **err,
                "bits_per_value": 8 * tables.row_bytes() / arr.shape[-1],
            }
            aux = {
                "codes": codes.reshape(*arr.shape[:-1], codes.shape[-1]),
                "mean": tables.mean,
                "weight": tables.weight,
                "lo": tables.lo,
                "step": tables.step,
            }
            extra = {
                "raw_dtype": arr.dtype.str,
                "lossy": mode,
                "codes_none": True,
                "counts": {str(w): n for w, n in tables.counts.items()},
                "aux": {role: f"{name}{_AUX}{role}__" for role in aux},
            }
            plan.append((name, np.zeros((*arr.shape[:-1], 0), np.float16), extra))
            for role, a in aux.items():
                plan.append(
                    (f"{name}{_AUX}{role}__", a, {"raw_dtype": a.dtype.str, "codec": "none"})
                )
            continue
        q, scale = quantize(arr, mode)
        err = lossy_error(arr, dequantize(q, scale, mode))
        lossy_attrs[name] = {"mode": mode, **err}
        extra = {"raw_dtype": arr.dtype.str, "lossy": mode, "scale": name + _SCALE_SUFFIX}
        plan.append((name, q, extra))
        plan.append((name + _SCALE_SUFFIX, scale, {"raw_dtype": scale.dtype.str}))
    if lossy_attrs:
        attrs_out["lossy"] = {**attrs_out.get("lossy", {}), **lossy_attrs}

    blobs: list[bytes] = []
    entries: dict[str, dict] = {}
    offset = 0
    for name, arr, extra in plan:
        extra = dict(extra)
        acodec = extra.pop("codec", None) or ("none" if extra.get("codes_none") else codec)
        extra.pop("codes_none", None)
        blob = encode(arr, acodec)
        entries[name] = {
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "codec": acodec,
            "offset": offset,
            "nbytes": len(blob),
            "raw_nbytes": arr.nbytes,
            "checksum": _checksum(blob),
            **extra,
        }
        blobs.append(blob)
        offset = _align(offset + len(blob))

    header = {"ids": ids, "attrs": attrs_out, "arrays": entries, "checksum": "xxh3_64"}
    try:
        header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    except TypeError as exc:
        raise TypeError(f"shard attrs for {path} must be JSON-serialisable: {exc}") from exc
    data_start = _align(_PREFIX.size + len(header_bytes))
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header_bytes), data_start)
    total = data_start + offset + _FOOTER.size
    footer = _FOOTER.pack(FOOTER_MAGIC, total, xxhash.xxh3_64_intdigest(prefix + header_bytes), 0)

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(prefix)
        f.write(header_bytes)
        f.write(b"\x00" * (data_start - _PREFIX.size - len(header_bytes)))
        pos = 0
        for blob in blobs:
            f.write(blob)
            pos += len(blob)
            pad = _align(pos) - pos
            f.write(b"\x00" * pad)
            pos += pad
        f.write(footer)

    stats_arrays: dict[str, dict] = {}
    for name, _arr, _extra in plan:
        if _AUX in name:
            continue
        e = entries[name]
        stored = e["nbytes"] + sum(entries[a]["nbytes"] for a in _aux_names(e))
        raw = int(np.asarray(arrays[name]).nbytes)
        stats_arrays[name] = {
            "dtype": np.dtype(e["raw_dtype"]).name,
            "shape": list(np.asarray(arrays[name]).shape),
            "codec": "none" if "aux" in e else codec,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": raw / stored if stored else float("nan"),
            **({"lossy": lossy_attrs[name]} if name in lossy_attrs else {}),
        }
        if "aux" in e:  # fixed rate: the bytes of one row (one token, one patch)
            stats_arrays[name]["row_bytes"] = int(entries[e["aux"]["codes"]]["shape"][-1])
    return ShardStats(raw_bytes=raw_total, stored_bytes=total, arrays=stats_arrays)


class Shard:
    """An opened ``.fms`` file: ids, attrs and lazily decoded (then cached) read-only arrays.

    ``shard["latents"]`` returns a zero-copy view of the file for codec ``none`` and a decoded
    array otherwise; lossy arrays come back decoded to fp16. Each array's checksum is checked
    the first time it is decoded; :meth:`verify` checks all of them. For reading rows without
    decoding a whole array (the training loader): :meth:`stored_rows` (where a raw or
    transform-coded array's rows lie in the file) and :meth:`coded` (codes + tables).
    """

    def __init__(self, path: Path, header: dict, data_start: int, fd: int | None = None):
        self.path = path
        #: the file this shard was read from, held open: every read goes to that version of it
        self._fd = os.open(path, os.O_RDONLY) if fd is None else fd
        weakref.finalize(self, os.close, self._fd)
        self.ids: list[str] = header["ids"]
        self.attrs: dict = header["attrs"]
        self._entries: dict[str, dict] = header["arrays"]
        self._data_start = data_start
        self._cache: dict[str, np.ndarray] = {}
        self._verified: set[str] = set()
        self._map: mmap.mmap | None = None
        self.names: list[str] = [n for n in self._entries if _AUX not in n]

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"Shard({str(self.path)!r}, n={len(self)}, arrays={self.names})"

    def fileno(self) -> int:
        """The descriptor of the file version this shard reads (``os.dup`` it to keep it)."""
        return self._fd

    def table_key(self, name: str) -> str:
        """An id of the decoding tables of transform-coded ``name`` (xxh3 of their checksums
        and code widths, from the header): codes are only ever decoded with tables of the same
        key, whichever version of the partition's file is on disk by then."""
        e = self._entry(name)
        if "aux" not in e:
            raise ValueError(f"{self.path}: array {name!r} is not transform-coded")
        parts = [self._entries[e["aux"][r]]["checksum"] for r in ("mean", "weight", "lo", "step")]
        counts = ",".join(f"{w}:{n}" for w, n in sorted(e["counts"].items()))
        return f"{xxhash.xxh3_64_intdigest('/'.join([*parts, counts]).encode()):016x}"

    def info(self, name: str) -> dict:
        """Header entry of array ``name`` (dtype, shape, codec, stored/raw bytes, lossy mode);
        a lossy array reports the dtype (and a transform-coded one the shape) it decodes to;
        ``stored_dtype`` is what the file holds."""
        e = dict(self._entry(name))
        e["stored_dtype"] = e["dtype"]
        if "lossy" in e:
            e["dtype"] = np.dtype(np.float16).str
        if "aux" in e:
            width = self._entries[e["aux"]["mean"]]["shape"][-1]
            lead = self._entries[e["aux"]["codes"]]["shape"][:-1]
            e.update(
                dtype=np.dtype(np.float16).str,
                shape=[*lead, width],
                nbytes=sum(self._entries[a]["nbytes"] for a in _aux_names(e)),
            )
        return e

    @property
    def stored_bytes(self) -> int:
        """Size of the file on disk."""
        return os.fstat(self._fd).st_size

    def _entry(self, name: str) -> dict:
        if name not in self.names:
            raise KeyError(f"{self.path}: no array {name!r}; arrays are {self.names}")
        return self._entries[name]

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        return self._map

    def _read_stored(self, name: str) -> bytes:
        e = self._entries[name]
        buf = os.pread(self._fd, e["nbytes"], self._data_start + e["offset"])
        if len(buf) != e["nbytes"]:
            raise StoreError(f"{self.path}: array {name!r} is truncated; re-materialize it")
        return buf

    def _check(self, name: str, buf: Any) -> None:
        if name in self._verified:
            return
        want = self._entries[name]["checksum"]
        got = _checksum(buf)
        if got != want:
            raise StoreError(
                f"{self.path}: checksum mismatch in array {name!r} (stored {want}, computed "
                f"{got}); the file is corrupted — delete it and re-materialize the partition"
            )
        self._verified.add(name)

    def _raw_view(self, name: str, check: bool) -> np.ndarray:
        """A read-only view of a codec ``none`` array in the file's mmap."""
        e = self._entries[name]
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        if e["nbytes"] == 0:
            empty = np.zeros(shape, dtype)
            empty.flags.writeable = False
            return empty
        view = np.frombuffer(
            self._mapped(),
            dtype=dtype,
            count=int(np.prod(shape)),
            offset=self._data_start + e["offset"],
        ).reshape(shape)
        if check and name not in self._verified:
            self._check_streaming(name, view)
        return view

    def _check_streaming(self, name: str, view: np.ndarray, chunk: int = 16 << 20) -> None:
        """The checksum of a mapped array, read in chunks whose pages are released as it goes
        (a whole-array check would make the array resident in this process)."""
        flat = view.reshape(-1).view(np.uint8)
        h = xxhash.xxh3_64()
        base = self._data_start + self._entries[name]["offset"]
        for a in range(0, len(flat), chunk):
            h.update(memoryview(flat[a : a + chunk]))
            if hasattr(mmap, "MADV_DONTNEED"):  # drop what was just read (page-aligned)
                lo = (base + a) // mmap.PAGESIZE * mmap.PAGESIZE
                hi = min(base + a + chunk, len(self._mapped()))
                self._mapped().madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        got = f"{h.intdigest():016x}"
        if got != self._entries[name]["checksum"]:
            raise StoreError(
                f"{self.path}: checksum mismatch in array {name!r} (stored "
                f"{self._entries[name]['checksum']}, computed {got}); the file is corrupted — "
                "delete it and re-materialize the partition"
            )
        self._verified.add(name)

    def _load_raw(self, name: str) -> np.ndarray:
        """The stored (possibly quantized) array, checksum-verified."""
        e = self._entries[name]
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        if e["codec"] == "none":
            return self._raw_view(name, check=True)
        buf = self._read_stored(name)
        self._check(name, buf)
        try:
            out = decode(buf, e["codec"], dtype, shape, e["raw_nbytes"])
        except (ValueError, lzma.LZMAError, zstandard.ZstdError) as exc:
            raise StoreError(f"{self.path}: cannot decode array {name!r}: {exc}") from exc
        out.flags.writeable = False
        return out

    def is_row_readable(self, name: str) -> bool:
        """Rows of ``name`` can be read without decoding the array: raw (codec ``none``,
        lossless) or transform-coded."""
        e = self._entry(name)
        return "aux" in e or (e["codec"] == "none" and "lossy" not in e)

    def stored_rows(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        """Where the rows of a row-readable array (:meth:`is_row_readable`) lie in the file:
        the stored dtype and shape (a transform-coded array's codes) and the byte offset of row
        0, for reading rows with ``pread``."""
        if not self.is_row_readable(name):
            e = self._entry(name)
            raise ValueError(f"{self.path}: array {name!r} is {e['codec']}/{e.get('lossy')}")
        e = self._entry(name)
        stored = self._entries[e["aux"]["codes"]] if "aux" in e else e
        shape = tuple(int(n) for n in stored["shape"])
        return np.dtype(stored["dtype"]), shape, self._data_start + stored["offset"]

    def coded(self, name: str, verify: bool = True) -> Coded:
        """The codes (zero-copy views) and tables of a transform-coded array; ``verify``: the
        codes' checksums too (streaming; the tables are always checked)."""
        e = self._entry(name)
        if "aux" not in e:
            raise ValueError(f"{self.path}: array {name!r} is not transform-coded")
        aux = {
            role: self._raw_view(a, check=verify or role != "codes")  # tables: always
            for role, a in e["aux"].items()
        }
        counts = {int(w): int(n) for w, n in e["counts"].items()}
        tables = transform_codec.Tables(  # small: copied out of the file's mapping
            np.array(aux["mean"]),
            np.array(aux["weight"]),
            np.array(aux["lo"]),
            np.array(aux["step"]),
            counts,
            int(aux["codes"].shape[-1]),
        )
        return Coded(aux["codes"], tables)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._cache:
            return self._cache[name]
        e = self._entry(name)
        if "aux" in e:
            arr = self.coded(name).decode()
            arr.flags.writeable = False
        else:
            arr = self._load_raw(name)
            if "lossy" in e:
                arr = dequantize(arr, self._load_raw(e["scale"]), e["lossy"])
                arr.flags.writeable = False
        self._cache[name] = arr
        return arr

    def verify(self) -> None:
        """Check every array's checksum (reads the whole file); raise StoreError on mismatch."""
        for name in self._entries:
            self._verified.discard(name)
            e = self._entries[name]
            if e["codec"] == "none" and e["nbytes"]:
                self._raw_view(name, check=True)
            else:
                self._check(name, self._read_stored(name))


def read_shard(path: str | os.PathLike, verify: bool = False) -> Shard:
    """Open a shard: checks magic, version, length and header checksum (cheap; arrays lazy).

    ``verify=True`` also checks every array's checksum now.
    """
    path = remote.ensure(path)  # with a remote data root: in this machine's cache first
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such shard file; materialize the partition first") from None
    try:
        shard = _open_shard(path, fd)
    except BaseException:
        os.close(fd)
        raise
    if verify:
        shard.verify()
    return shard


def _open_shard(path: Path, fd: int) -> Shard:
    """The checks of :func:`read_shard` on an open file; the shard keeps ``fd``."""
    size = os.fstat(fd).st_size
    with open(fd, "rb", closefd=False) as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise StoreError(f"{path}: truncated ({size} bytes, shorter than the file prefix)")
        magic, version, _flags, header_len, data_start = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise StoreError(
                f"{path}: bad magic {magic!r}; not a flowmatch embedding-store (.fms) file"
            )
        if version != FORMAT_VERSION:
            raise StoreError(
                f"{path}: format version {version}, this code reads {FORMAT_VERSION}; "
                "re-materialize the partition or upgrade flowmatch"
            )
        if size < _PREFIX.size + header_len + _FOOTER.size:
            raise StoreError(f"{path}: truncated ({size} bytes); re-materialize the partition")
        header_bytes = f.read(header_len)
        f.seek(size - _FOOTER.size)
        fmagic, total, header_sum, _ = _FOOTER.unpack(f.read(_FOOTER.size))
    if fmagic != FOOTER_MAGIC or total != size:
        raise StoreError(
            f"{path}: truncated or incomplete (footer {'ok' if fmagic == FOOTER_MAGIC else 'missing'}"
            f", length {size} vs recorded {total if fmagic == FOOTER_MAGIC else '?'}); "
            "delete it and re-materialize the partition"
        )
    if xxhash.xxh3_64_intdigest(prefix + header_bytes) != header_sum:
        raise StoreError(f"{path}: header checksum mismatch; the file is corrupted")
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        raise StoreError(f"{path}: unreadable header JSON: {exc}") from exc
    end = data_start + max(
        (e["offset"] + e["nbytes"] for e in header["arrays"].values()), default=0
    )
    if end > size - _FOOTER.size:
        raise StoreError(f"{path}: arrays extend past the end of the file; truncated")
    return Shard(path, header, data_start, fd)


def ragged_offsets(lengths: np.ndarray) -> np.ndarray:
    """Start offsets of each sample in the concatenated ``tokens``: int64 ``[N + 1]``."""
    lengths = np.asarray(lengths)
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def pad_ragged(
    tokens: np.ndarray,
    lengths: np.ndarray,
    idx: Sequence[int],
    max_len: int | None = None,
    offsets: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gather samples ``idx`` of a ragged ``tokens [T, D]`` into ``(padded [B, L, D], mask [B, L])``.

    ``L = max_len`` if given (longer samples are truncated) else the longest selected sample
    (at least 1). Padding is zeros; ``mask`` is True on valid tokens. Pass precomputed
    ``offsets`` (:func:`ragged_offsets`) to skip the cumsum in a hot loop.
    """
    lengths = np.asarray(lengths)
    if offsets is None:
        offsets = ragged_offsets(lengths)
    idx = np.asarray(idx, dtype=np.int64)
    sel = lengths[idx].astype(np.int64)
    L = int(max_len) if max_len is not None else max(int(sel.max(initial=0)), 1)
    pos = np.arange(L, dtype=np.int64)
    mask = pos[None, :] < sel[:, None]
    padded = np.zeros((len(idx), L, tokens.shape[-1]), dtype=tokens.dtype)
    src = offsets[idx][:, None] + pos[None, :]
    padded[mask] = tokens[src[mask]]
    return padded, mask
