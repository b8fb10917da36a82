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

This module writes (:func:`write_shard`); :mod:`.shard` reads (:class:`Shard`,
:func:`read_shard`) and holds the format's constants both use, so the two cannot drift.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from flowmatch_models.storage import transform as transform_codec
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.storage.codecs import CODECS, encode
from flowmatch_models.storage.lossy import (
    LOSSY_MODES,
    dequantize,
    lossy_error,
    pca_error,
    quantize,
)
from flowmatch_models.storage.shard import (
    _AUX,
    _FOOTER,
    _PREFIX,
    _SCALE_SUFFIX,
    ALIGN,
    FOOTER_MAGIC,
    FORMAT_VERSION,
    MAGIC,
    Shard,
    StoreError,
    _align,
    _aux_names,
    _checksum,
    read_shard,
)

#: What importers have always taken from here (the reader lives in shard.py).
__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "Shard",
    "ShardStats",
    "StoreError",
    "pad_ragged",
    "ragged_offsets",
    "read_shard",
    "write_shard",
]


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
