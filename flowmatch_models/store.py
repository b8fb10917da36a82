"""The embedding store: one self-describing, checksummed ``.fms`` file per asset partition.

File layout (all integers little-endian)::

    prefix   32 B   magic b"FMSTORE\\0", version u32, flags u32, header_len u64, data_start u64
    header   JSON   {"ids", "attrs", "arrays": {name: {dtype, shape, codec, offset, nbytes,
                     raw_nbytes, checksum, [lossy, scale]}}, "checksum": "xxh3_64"}
    padding  to data_start (64-byte aligned)
    arrays   each 64-byte aligned; ``offset`` is relative to data_start
    footer   32 B   magic b"FMSEND\\0\\0", total file length u64, xxh3_64(prefix + header) u64,
                    reserved u64

Codecs (per array): ``none`` (raw bytes, read zero-copy through ``np.memmap``), ``zstd``
(byte-shuffle: the bytes of each element split into planes, then zstd level 3), ``xz`` (lzma
preset 9, the seed-compatible baseline). Lossy 1-byte storage (``int8`` or ``fp8`` e4m3) keeps a
per-channel (last dim) fp32 scale array beside the data and records its error in
``attrs["lossy"]``; reading returns the dequantized fp16 array transparently.

Integrity: a truncated file (footer missing or wrong length), a corrupted header (checksum) or a
corrupted array (per-array checksum of the stored bytes, checked on first decode or by
``Shard.verify``) raise :class:`StoreError` naming the file. Nothing is ever unpickled.

Ragged text: ``tokens [T, D]`` holds only the valid tokens of all captions concatenated and
``lengths [N] int32`` their counts; :func:`ragged_offsets` and :func:`pad_ragged` turn that into
padded batches plus attention masks for training.
"""

from __future__ import annotations

import json
import lzma
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from flowmatch_models.atomic import atomic_path

CODECS = ("none", "zstd", "xz")
LOSSY_MODES = ("int8", "fp8")
FORMAT_VERSION = 1
MAGIC = b"FMSTORE\x00"
FOOTER_MAGIC = b"FMSEND\x00\x00"
ALIGN = 64
ZSTD_LEVEL = 3
XZ_PRESET = 9
_PREFIX = struct.Struct("<8sIIQQ")
_FOOTER = struct.Struct("<8sQQQ")
_SCALE_SUFFIX = ".__scale__"
_FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_INT8_MAX = 127.0


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


# --------------------------------------------------------------------------------------------
# codecs
# --------------------------------------------------------------------------------------------


def _checksum(buf: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(buf):016x}"


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_FAST_SHUFFLE = sys.byteorder == "little"


def _shuffle(arr: np.ndarray) -> bytes:
    """Byte planes: all first (lowest) bytes of the elements, then all second bytes, ..."""
    itemsize = arr.dtype.itemsize
    raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    if itemsize == 1:
        return raw.tobytes()
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).tobytes()


def _unshuffle(buf: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`_shuffle`. Uses contiguous shift/or passes (~15x a strided transpose)."""
    itemsize = dtype.itemsize
    planes = np.frombuffer(buf, dtype=np.uint8)
    if itemsize == 1:
        return planes.view(dtype).reshape(shape)
    n = planes.size // itemsize
    if _FAST_SHUFFLE and itemsize in _UINT:
        utype = _UINT[itemsize]
        out = planes[:n].astype(utype)
        tmp = np.empty(n, utype)
        for k in range(1, itemsize):
            np.left_shift(planes[k * n : (k + 1) * n], 8 * k, out=tmp, dtype=utype)
            out |= tmp
        return out.view(dtype).reshape(shape)
    return np.ascontiguousarray(planes.reshape(itemsize, -1).T).view(dtype).reshape(shape)


def _encode(arr: np.ndarray, codec: str) -> bytes:
    if codec == "none":
        return np.ascontiguousarray(arr).tobytes()
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_shuffle(arr))
    if codec == "xz":
        return lzma.compress(np.ascontiguousarray(arr).tobytes(), preset=XZ_PRESET)
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")


def _decode(
    buf: bytes, codec: str, dtype: np.dtype, shape: tuple[int, ...], raw: int
) -> np.ndarray:
    if codec == "zstd":
        out = zstandard.ZstdDecompressor().decompress(buf, max_output_size=raw)
        if len(out) != raw:
            raise ValueError(f"zstd produced {len(out)} bytes, expected {raw}")
        return _unshuffle(out, dtype, shape)
    if codec == "xz":
        out = lzma.decompress(buf)
        if len(out) != raw:
            raise ValueError(f"xz produced {len(out)} bytes, expected {raw}")
        return np.frombuffer(out, dtype=dtype).reshape(shape)
    raise ValueError(f"unknown codec {codec!r}")


# --------------------------------------------------------------------------------------------
# lossy 1-byte storage
# --------------------------------------------------------------------------------------------


def _channel_absmax(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1, x.shape[-1]) if x.size else np.zeros((0, x.shape[-1]), np.float32)
    amax = np.abs(flat).max(axis=0) if flat.shape[0] else np.zeros(x.shape[-1], np.float32)
    return amax.astype(np.float32)


def _quantize(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symmetric 1-byte quantization; returns (uint8/int8 data, fp32 scale [D])."""
    x32 = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x32).all():
        raise ValueError("lossy storage needs finite values (found NaN/inf)")
    amax = _channel_absmax(x32)
    top = _INT8_MAX if mode == "int8" else _FP8_MAX
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    if mode == "int8":
        q = np.clip(np.rint(x32 / scale), -_INT8_MAX, _INT8_MAX).astype(np.int8)
        return q, scale
    if mode == "fp8":
        import torch

        t = torch.from_numpy(np.clip(x32 / scale, -_FP8_MAX, _FP8_MAX))
        q = t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return q, scale
    raise ValueError(f"unknown lossy mode {mode!r}; choose one of {LOSSY_MODES}")


def _dequantize(q: np.ndarray, scale: np.ndarray, mode: str) -> np.ndarray:
    if mode == "int8":
        x = q.astype(np.float32)
    else:
        import torch

        x = torch.from_numpy(np.array(q, copy=True)).view(torch.float8_e4m3fn).float().numpy()
    return (x * scale).astype(np.float16)


def lossy_error(original: np.ndarray, restored: np.ndarray) -> dict:
    """Error of a lossy round trip, per row vector along the last dim.

    Returns ``{"min_cosine", "mean_cosine", "rel_rms"}``; rows that are zero in both arrays count
    as cosine 1, ``rel_rms = rms(original - restored) / rms(original)``.
    """
    a = np.asarray(original, dtype=np.float64).reshape(-1, original.shape[-1])
    b = np.asarray(restored, dtype=np.float64).reshape(-1, restored.shape[-1])
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {original.shape} vs {restored.shape}")
    if a.shape[0] == 0:
        return {"min_cosine": 1.0, "mean_cosine": 1.0, "rel_rms": 0.0}
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = (a * b).sum(axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-300))
    rms_a = float(np.sqrt(np.mean(a * a)))
    rms_d = float(np.sqrt(np.mean((a - b) ** 2)))
    return {
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "rel_rms": rms_d / rms_a if rms_a > 0 else rms_d,
    }


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


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
) -> ShardStats:
    """Write ``arrays`` (name -> numeric array) and sample ``ids`` to ``path`` atomically.

    ``codec`` applies to every array. ``lossy`` maps array names to ``"int8"`` or ``"fp8"``
    (float arrays only); their per-channel scales are stored beside them and the round-trip
    error (see :func:`lossy_error`) is recorded in ``attrs["lossy"][name]`` and in the returned
    stats. ``attrs`` must be JSON-serialisable. ``raw_bytes`` counts the arrays as given.
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
        if name.endswith(_SCALE_SUFFIX):
            raise ValueError(f"array name {name!r} uses the reserved suffix {_SCALE_SUFFIX!r}")
        arr = _as_storable(name, value)
        raw_total += arr.nbytes
        mode = lossy.get(name)
        if mode is None:
            plan.append((name, arr, {"raw_dtype": arr.dtype.str}))
            continue
        if mode not in LOSSY_MODES:
            raise ValueError(f"lossy mode {mode!r} for {name!r}; choose one of {LOSSY_MODES}")
        if arr.dtype.kind != "f" or arr.ndim == 0:
            raise ValueError(
                f"lossy storage needs a float array with >= 1 dim; {name!r} is "
                f"{arr.dtype} {arr.shape}"
            )
        q, scale = _quantize(arr, mode)
        err = lossy_error(arr, _dequantize(q, scale, mode))
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
        blob = _encode(arr, codec)
        entries[name] = {
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "codec": codec,
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
        if name.endswith(_SCALE_SUFFIX):
            continue
        e = entries[name]
        stored = e["nbytes"] + (entries[e["scale"]]["nbytes"] if "scale" in e else 0)
        raw = int(np.asarray(arrays[name]).nbytes)
        stats_arrays[name] = {
            "dtype": np.dtype(e["raw_dtype"]).name,
            "shape": e["shape"],
            "codec": codec,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": raw / stored if stored else float("nan"),
            **({"lossy": lossy_attrs[name]} if name in lossy_attrs else {}),
        }
    return ShardStats(raw_bytes=raw_total, stored_bytes=total, arrays=stats_arrays)


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


class Shard:
    """An opened ``.fms`` file: ids, attrs and lazily decoded (then cached) read-only arrays.

    ``shard["latents"]`` returns a ``np.memmap`` for codec ``none`` (zero copy) and a decoded
    array otherwise; lossy arrays come back dequantized to fp16. Each array's checksum is
    checked the first time it is decoded; :meth:`verify` checks all of them.
    """

    def __init__(self, path: Path, header: dict, data_start: int):
        self.path = path
        self.ids: list[str] = header["ids"]
        self.attrs: dict = header["attrs"]
        self._entries: dict[str, dict] = header["arrays"]
        self._data_start = data_start
        self._cache: dict[str, np.ndarray] = {}
        self._verified: set[str] = set()
        self.names: list[str] = [n for n in self._entries if not n.endswith(_SCALE_SUFFIX)]

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"Shard({str(self.path)!r}, n={len(self)}, arrays={self.names})"

    def info(self, name: str) -> dict:
        """Header entry of array ``name`` (dtype, shape, codec, stored/raw bytes, lossy mode)."""
        self._entry(name)
        return dict(self._entries[name])

    @property
    def stored_bytes(self) -> int:
        """Size of the file on disk."""
        return self.path.stat().st_size

    def _entry(self, name: str) -> dict:
        if name not in self.names:
            raise KeyError(f"{self.path}: no array {name!r}; arrays are {self.names}")
        return self._entries[name]

    def _read_stored(self, name: str) -> bytes:
        e = self._entries[name]
        with open(self.path, "rb") as f:
            f.seek(self._data_start + e["offset"])
            buf = f.read(e["nbytes"])
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

    def _load_raw(self, name: str) -> np.ndarray:
        """The stored (possibly quantized) array, checksum-verified."""
        e = self._entries[name]
        dtype, shape = np.dtype(e["dtype"]), tuple(e["shape"])
        if e["codec"] == "none":
            if e["nbytes"] == 0:
                empty = np.zeros(shape, dtype)
                empty.flags.writeable = False
                return empty
            mm = np.memmap(
                self.path,
                dtype=dtype,
                mode="r",
                offset=self._data_start + e["offset"],
                shape=shape,
            )
            self._check(name, memoryview(mm.reshape(-1).view(np.uint8)))
            return mm
        buf = self._read_stored(name)
        self._check(name, buf)
        try:
            out = _decode(buf, e["codec"], dtype, shape, e["raw_nbytes"])
        except (ValueError, lzma.LZMAError, zstandard.ZstdError) as exc:
            raise StoreError(f"{self.path}: cannot decode array {name!r}: {exc}") from exc
        out.flags.writeable = False
        return out

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._cache:
            return self._cache[name]
        e = self._entry(name)
        arr = self._load_raw(name)
        if "lossy" in e:
            arr = _dequantize(arr, self._load_raw(e["scale"]), e["lossy"])
            arr.flags.writeable = False
        self._cache[name] = arr
        return arr

    def verify(self) -> None:
        """Check every array's checksum (reads the whole file); raise StoreError on mismatch."""
        for name in self._entries:
            self._verified.discard(name)
            e = self._entries[name]
            if e["codec"] == "none" and e["nbytes"]:
                self._load_raw(name)
            else:
                self._check(name, self._read_stored(name))


def read_shard(path: str | os.PathLike, verify: bool = False) -> Shard:
    """Open a shard: checks magic, version, length and header checksum (cheap; arrays lazy).

    ``verify=True`` also checks every array's checksum now.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(f"{path}: no such shard file; materialize the partition first") from None
    with open(path, "rb") as f:
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
    shard = Shard(path, header, data_start)
    if verify:
        shard.verify()
    return shard


# --------------------------------------------------------------------------------------------
# ragged text helpers
# --------------------------------------------------------------------------------------------


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
