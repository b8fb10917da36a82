"""The store's lossy modes (int8, fp8 with per-channel scales; pcaB transform coding) and the error they record."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowmatch_models.storage import transform as transform_codec

#: 1-byte modes; ``pcaB`` (B bits per value, e.g. ``pca4.5``) is the transform-coded one
LOSSY_MODES = ("int8", "fp8", "pca4")

_FP8_MAX = 448.0  # largest finite float8_e4m3fn value

_INT8_MAX = 127.0


def _channel_absmax(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1, x.shape[-1]) if x.size else np.zeros((0, x.shape[-1]), np.float32)
    amax = np.abs(flat).max(axis=0) if flat.shape[0] else np.zeros(x.shape[-1], np.float32)
    return amax.astype(np.float32)


def quantize(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
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


def dequantize(q: np.ndarray, scale: np.ndarray, mode: str) -> np.ndarray:
    if mode == "int8":
        x = q.astype(np.float32)
    else:
        import torch

        x = torch.from_numpy(np.array(q, copy=True)).view(torch.float8_e4m3fn).float().numpy()
    return (x * scale).astype(np.float16)


class ErrorStats:
    """:func:`lossy_error` accumulated over chunks of rows (float64 per chunk only)."""

    def __init__(self):
        self.min_cos, self.sum_cos, self.rows, self.sq_a, self.sq_d, self.values = (
            1.0,
            0.0,
            0,
            0.0,
            0.0,
            0,
        )

    def add(self, original: np.ndarray, restored: np.ndarray) -> None:
        a = np.asarray(original, dtype=np.float64).reshape(-1, original.shape[-1])
        b = np.asarray(restored, dtype=np.float64).reshape(-1, restored.shape[-1])
        if a.shape != b.shape:
            raise ValueError(f"shape mismatch: {original.shape} vs {restored.shape}")
        if not a.shape[0]:
            return
        na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
        dot = (a * b).sum(axis=1)
        both_zero = (na == 0) & (nb == 0)
        cos = np.where(both_zero, 1.0, dot / np.maximum(na * nb, 1e-300))
        self.min_cos = min(self.min_cos, float(cos.min()))
        self.sum_cos += float(cos.sum())
        self.rows += len(cos)
        self.sq_a += float((a * a).sum())
        self.sq_d += float(((a - b) ** 2).sum())
        self.values += a.size

    def result(self) -> dict:
        if not self.rows:
            return {"min_cosine": 1.0, "mean_cosine": 1.0, "rel_rms": 0.0}
        rms_a, rms_d = np.sqrt(self.sq_a / self.values), np.sqrt(self.sq_d / self.values)
        return {
            "min_cosine": self.min_cos,
            "mean_cosine": self.sum_cos / self.rows,
            "rel_rms": float(rms_d / rms_a) if rms_a > 0 else float(rms_d),
        }


def lossy_error(original: np.ndarray, restored: np.ndarray, chunk: int = 65_536) -> dict:
    """Error of a lossy round trip, per row vector along the last dim.

    Returns ``{"min_cosine", "mean_cosine", "rel_rms"}``; rows that are zero in both arrays count
    as cosine 1, ``rel_rms = rms(original - restored) / rms(original)``. Computed ``chunk`` rows
    at a time (a PD12M text shard is ~1M rows: float64 copies of it would be 5 GB each).
    """
    if original.shape != restored.shape:
        raise ValueError(f"shape mismatch: {original.shape} vs {restored.shape}")
    a = np.asarray(original).reshape(-1, original.shape[-1])
    b = np.asarray(restored).reshape(-1, restored.shape[-1])
    stats = ErrorStats()
    for i in range(0, len(a), chunk):
        stats.add(a[i : i + chunk], b[i : i + chunk])
    return stats.result()


def _pca_decode_np(
    codes: np.ndarray, tables: transform_codec.Tables, chunk: int = 65_536
) -> np.ndarray:
    """Host decode of transform-coded rows ``codes [..., row_bytes]`` -> fp16 ``[..., D]``."""
    import torch

    lead = codes.shape[:-1]
    flat = np.asarray(codes).reshape(-1, codes.shape[-1])
    out = np.empty((len(flat), tables.width), np.float16)
    t = transform_codec.DeviceTables.of(tables, "cpu")
    for a in range(0, len(flat), chunk):
        part = torch.from_numpy(np.array(flat[a : a + chunk]))
        out[a : a + chunk] = transform_codec.decode(part, t).numpy()
    return out.reshape(*lead, tables.width)


def pca_error(rows: np.ndarray, codes: np.ndarray, tables, device: str, chunk: int = 65_536):
    """:func:`lossy_error` of coded ``rows``, decoded (as reading will: fp16) on ``device`` a
    chunk at a time."""
    import torch

    t = transform_codec.DeviceTables.of(tables, device)
    stats = ErrorStats()
    for a in range(0, len(rows), chunk):
        part = torch.from_numpy(np.array(codes[a : a + chunk])).to(device)
        restored = transform_codec.decode(part, t).half().cpu().numpy()
        stats.add(rows[a : a + chunk], restored)
    return stats.result()


@dataclass
class Coded:
    """A transform-coded array as stored: its uint8 codes ``[..., row_bytes]`` (a zero-copy
    view of the file; rows sliced like the array they code) and the
    :class:`~flowmatch_models.storage.transform.Tables` that decode them."""

    codes: np.ndarray
    tables: transform_codec.Tables

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded array's shape."""
        return (*self.codes.shape[:-1], self.tables.width)

    def decode(self, codes: np.ndarray | None = None) -> np.ndarray:
        """fp16 rows of ``codes`` (default: the whole array) on the host."""
        return _pca_decode_np(self.codes if codes is None else codes, self.tables)

    @property
    def row_bytes(self) -> int:
        return self.tables.row_bytes()
