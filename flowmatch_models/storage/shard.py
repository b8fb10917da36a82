"""Reading an ``.fms`` shard (the format is :mod:`.store`'s docstring): :func:`read_shard`
checks magic, version, length and header checksum, and :class:`Shard` decodes arrays lazily,
checking each one's checksum the first time. The format's constants live here; the writer
(:func:`flowmatch_models.storage.store.write_shard`) imports them."""

from __future__ import annotations

import json
import lzma
import mmap
import os
import struct
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from flowmatch_models.storage import remote
from flowmatch_models.storage import transform as transform_codec
from flowmatch_models.storage.codecs import decode
from flowmatch_models.storage.lossy import (
    Coded,
    dequantize,
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


def _checksum(buf: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(buf):016x}"


def _aux_names(entry: dict) -> list[str]:
    """The internal arrays of an array's header entry (its scale, or its codes and tables)."""
    return [entry["scale"]] if "scale" in entry else list(entry.get("aux", {}).values())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
