"""The lossless codecs of the embedding store, one table: none (read in place), zstd (byte-shuffled), xz (the seed's)."""

from __future__ import annotations

import lzma
import sys

import numpy as np
import zstandard

CODECS = ("none", "zstd", "xz")

ZSTD_LEVEL = 3

XZ_PRESET = 9

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


def encode(arr: np.ndarray, codec: str) -> bytes:
    if codec == "none":
        return np.ascontiguousarray(arr).tobytes()
    if codec == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_shuffle(arr))
    if codec == "xz":
        return lzma.compress(np.ascontiguousarray(arr).tobytes(), preset=XZ_PRESET)
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")


def decode(buf: bytes, codec: str, dtype: np.dtype, shape: tuple[int, ...], raw: int) -> np.ndarray:
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
