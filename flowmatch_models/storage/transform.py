"""Transform coding of embedding rows at a fixed rate: lossy mode ``pcaB`` of the store.

One shard's array of row vectors ``x [R, D]`` (caption token states, DINOv2 patches) is coded as:

1. standardise each channel with the shard's mean and std (the text encoder's few huge channels
   then weigh what every other channel weighs, as they do for the DiT after ``model.text_norm``);
2. rotate onto the principal axes of the standardised rows (``eigh`` of their correlation); the
   variance of real hidden states is concentrated (Gemma3-270M: 128 of 640 axes hold 89%), which
   transform coding turns into bits: ~8 dB more signal-to-noise than per-channel 4-bit codes;
3. give each axis 8, 4, 2, 1 or 0 bits by greedy reverse water-filling on its variance, so that
   a row costs ``B`` bits per value on average (``B * D / 8`` bytes, e.g. 320 B for a 640-wide
   token at ``pca4``), and quantize each axis uniformly over the range that minimises its
   squared error on the shard;
4. pack the codes into bytes, widest first: one uint8 array ``[R, row_bytes]``.

Every row costs the same bytes, so a row is read at its offset without reading or decoding
anything else (the training loader reads rows straight from the file), and nothing is
entropy-coded: decoding is an unpack, a multiply-add and one ``[K, D]`` matmul
(:func:`decode`, in torch on whatever device holds the batch; on the GPU it is free).

The tables (``mean [D]``, ``weight [K, D]`` fp16 = the kept axes scaled by the channel stds,
``lo``/``step [K]``) are ~0.8 MB for a 640-wide array: ~80 B per sample of a 10k-sample shard.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

#: the code widths in bits (each packs whole bytes); 0 bits = the axis is dropped
WIDTHS = (8, 4, 2, 1)
#: mean squared error of a uniform quantizer of ``b`` bits with its best range on a unit
#: Gaussian (Max 1960 / Jayant & Noll table 4.1): what the allocation trades against
_MSE = {0: 1.0, 1: 0.3634, 2: 0.1188, 4: 0.01154, 8: 0.0000711}
#: candidate half-ranges of an axis's quantizer, in its standard deviations (best one kept)
_RANGES = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
#: rows the fit sees at most: the axes, and the quantizer ranges (every row is then coded)
FIT_ROWS = 65_536
RANGE_ROWS = 8_192
_MODE = re.compile(r"^pca(\d+(?:\.\d+)?)$")


def bits_of(mode: str) -> float | None:
    """``"pca4"`` -> 4.0 bits per value; None for any other mode."""
    m = _MODE.match(mode or "")
    if not m:
        return None
    bits = float(m.group(1))
    if not 0 < bits <= 8:
        raise ValueError(f"lossy mode {mode!r}: bits per value must be in (0, 8]")
    return bits


@dataclass
class Tables:
    """What decodes one coded array: ``x = (lo + (q + 0.5) * step) @ weight + mean``.

    ``counts[w]`` axes have ``w`` bits, in the order of :data:`WIDTHS` (the axes sorted by
    variance, widest codes first); ``K = sum(counts)``."""

    mean: np.ndarray  # [D] float32
    weight: np.ndarray  # [K, D] float16
    lo: np.ndarray  # [K] float32
    step: np.ndarray  # [K] float32
    counts: dict[int, int]
    #: stored bytes of a row: fixed by the width and the bits (:func:`row_size`), whatever
    #: the data; the codes fill ``sum(n * w / 8)`` of them, the rest are zero
    row_size: int = 0
    #: ``[D, K]``: rows -> axes (``(x - mean) @ proj``); known at fit time only, not stored
    proj: np.ndarray | None = None

    @property
    def width(self) -> int:
        return int(self.mean.shape[-1])

    def row_bytes(self) -> int:
        """Stored bytes of one row."""
        return self.row_size or sum(n * w // 8 for w, n in self.counts.items())


def row_size(width: int, bits: float) -> int:
    """Bytes of a coded row of ``width`` values at ``bits`` per value: the same for every
    shard of a run, so batches mix partitions (a rank-deficient shard pads its rows)."""
    return int(np.floor(bits * width / 8 + 1e-9))


def allocate(variances: np.ndarray, bits: float) -> np.ndarray:
    """Bits per axis (``variances`` sorted descending): greedy reverse water-filling over
    :data:`WIDTHS` with at most ``bits * len(variances)`` bits, each width's count then
    rounded so its codes fill whole bytes. Non-increasing along the axes. Axes without variance
    get none (a shard of few rows spans few axes: they are coded at 8 bits, the rest dropped)."""
    d = len(variances)
    budget = 8 * row_size(d, bits)
    ladder = (0, 1, 2, 4, 8)
    b = np.zeros(d, np.int64)
    # axes below 1e-5 of the mean variance are numerically empty (rank-deficient fits: small
    # shards; the fp32 correlation leaves ~1e-6 there), real ones are >= 1e-3 (Gemma3-270M)
    floor = 1e-5 * float(np.mean(variances)) if d else 0.0
    heap = [(-float(v) * (_MSE[0] - _MSE[1]), i) for i, v in enumerate(variances) if v > floor]
    heapq.heapify(heap)
    used = 0
    while heap:
        _gain, i = heapq.heappop(heap)
        cur = int(b[i])
        nxt = ladder[ladder.index(cur) + 1]
        if used + nxt - cur > budget:
            continue
        b[i], used = nxt, used + nxt - cur
        if nxt < 8:
            up = ladder[ladder.index(nxt) + 1]
            gain = float(variances[i]) * (_MSE[nxt] - _MSE[up]) / (up - nxt)
            heapq.heappush(heap, (-gain, i))
    b = np.sort(b)[::-1].copy()  # widest first (variances are sorted, so this keeps the pairing)
    for w, lower in ((4, 2), (2, 1), (1, 0)):  # whole bytes: demote the leftover axes
        idx = np.flatnonzero(b == w)
        extra = len(idx) % (8 // w)
        if extra:
            b[idx[-extra:]] = lower
    return np.sort(b)[::-1].copy()


def _torch():
    import torch

    return torch


def fit(x: np.ndarray, bits: float, device: str = "cpu") -> Tables:
    """Fit the tables of :func:`encode` to rows ``x [R, D]`` (at most :data:`FIT_ROWS` of them,
    spread over the array) for ``bits`` per value on average, computing on ``device``."""
    torch = _torch()
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"transform coding takes rows [R, D], got shape {x.shape}")
    r, d = x.shape
    if r and not np.isfinite(x).all():
        raise ValueError("lossy storage needs finite values (found NaN/inf)")
    sample = x if r <= FIT_ROWS else x[np.linspace(0, r - 1, FIT_ROWS).astype(np.int64)]
    xs = torch.from_numpy(np.asarray(sample, np.float32)).to(device)
    if r < 2:  # nothing to learn axes from: the rows are the mean
        mean = xs.mean(0).cpu() if r else torch.zeros(d)
        return Tables(
            mean.numpy(),
            np.zeros((0, d), np.float16),
            np.zeros(0, np.float32),
            np.zeros(0, np.float32),
            dict.fromkeys(WIDTHS, 0),
            row_size(d, bits),
            np.zeros((d, 0), np.float32),
        )
    mean = xs.double().mean(0)
    std = xs.double().std(0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    z = ((xs - mean.float()) / std.float()).contiguous()
    cov = (z.T @ z).double() / len(z)
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True)
    evals, evecs = evals[order].clamp_min(0), evecs[:, order]
    widths = allocate(evals.cpu().numpy(), bits)
    k = int((widths > 0).sum())
    axes = evecs[:, :k].float()
    pick = torch.linspace(0, len(z) - 1, min(len(z), RANGE_ROWS), device=z.device).long()
    lo, step = _ranges(z[pick] @ axes, torch.from_numpy(widths[:k]).to(z.device))
    weight = (axes * std[:, None].float()).T  # [K, D]: x = y @ weight + mean
    counts = {w: int((widths == w).sum()) for w in WIDTHS}
    proj = (axes / std[:, None].float()).cpu().numpy()
    cpu = lambda t: t.float().cpu().numpy()  # noqa: E731
    return Tables(
        cpu(mean), weight.half().cpu().numpy(), cpu(lo), cpu(step), counts, row_size(d, bits), proj
    )


def _ranges(y, widths):
    """Per axis the uniform quantizer (``lo``, ``step``) with the least squared error on ``y``
    among half-ranges of :data:`_RANGES` standard deviations and the full min..max range."""
    torch = _torch()
    levels = (2.0**widths).float()
    m, s = y.mean(0), y.std(0, correction=0).clamp_min(1e-12)
    cands = [(m - k * s, 2 * k * s / levels) for k in _RANGES]
    lo_mm, hi_mm = y.min(0).values, y.max(0).values
    cands.append((lo_mm, (hi_mm - lo_mm).clamp_min(1e-12) / levels))
    best_err = best_lo = best_step = None
    for lo, step in cands:
        q = torch.clamp(torch.floor((y - lo) / step), min=torch.zeros_like(levels), max=levels - 1)
        err = ((lo + (q + 0.5) * step - y) ** 2).mean(0)
        if best_err is None:
            best_err, best_lo, best_step = err, lo.clone(), step.clone()
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, lo, best_lo)
            best_step = torch.where(better, step, best_step)
    return best_lo, best_step


def _spans(counts: Mapping[int, int]):
    """``(width, first axis, axes)`` of each non-empty code width, in axis order."""
    start = 0
    for w in WIDTHS:
        n = int(counts.get(w, 0))
        if n:
            yield w, start, n
        start += n


def encode(x: np.ndarray, tables: Tables, chunk: int = 65_536, device: str = "cpu") -> np.ndarray:
    """Codes of rows ``x [R, D]`` under the tables :func:`fit` made: uint8 ``[R, row_bytes]``,
    the packed codes of each width side by side (widest first; zero bytes pad the row to its
    fixed size), computed on ``device``."""
    if tables.proj is None:
        raise ValueError("encode needs the tables fit() returned (their projection is not stored)")
    torch = _torch()
    x = np.asarray(x)
    r = x.shape[0]
    out = np.zeros((r, tables.row_bytes()), np.uint8)
    if not out.size:
        return out
    on = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(device)  # noqa: E731
    mean, proj, lo, step = on(tables.mean), on(tables.proj), on(tables.lo), on(tables.step)
    for a in range(0, r, chunk):
        y = (on(x[a : a + chunk]) - mean) @ proj
        col = 0
        for w, s, n in _spans(tables.counts):
            q = torch.clamp(
                torch.floor((y[:, s : s + n] - lo[s : s + n]) / step[s : s + n]), 0, 2**w - 1
            ).to(torch.uint8)
            out[a : a + chunk, col : col + n * w // 8] = _pack(q, w).cpu().numpy()
            col += n * w // 8
    return out


def _pack(q, w: int):
    """``[R, n]`` codes of ``w`` bits -> ``[R, n * w / 8]`` bytes (code j at bits (j % (8/w))*w
    of byte j // (8/w))."""
    torch = _torch()
    if w == 8:
        return q
    per = 8 // w
    shifts = torch.arange(0, 8, w, dtype=torch.uint8, device=q.device)
    q = q.reshape(q.shape[0], -1, per) << shifts
    return q.sum(-1, dtype=torch.uint8)


def _unpack(codes, w: int):
    """Inverse of :func:`_pack` on any leading shape ``[..., bytes] -> [..., bytes * 8 / w]``."""
    torch = _torch()
    if w == 8:
        return codes
    shifts = torch.arange(0, 8, w, dtype=torch.uint8, device=codes.device)
    return ((codes.unsqueeze(-1) >> shifts) & (2**w - 1)).flatten(-2)


@dataclass
class DeviceTables:
    """:class:`Tables` as torch tensors on one device (what :func:`decode` reads)."""

    mean: object
    weight: object
    lo: object
    step: object
    counts: dict[int, int]

    @classmethod
    def of(cls, t: Tables, device) -> DeviceTables:
        torch = _torch()
        as_t = lambda a: torch.tensor(np.asarray(a, np.float32), device=device)  # noqa: E731
        return cls(as_t(t.mean), as_t(t.weight), as_t(t.lo), as_t(t.step), dict(t.counts))


def decode(codes, t: DeviceTables):
    """Rows from their codes (uint8 ``[..., row_bytes]`` on ``t``'s device): float32
    ``[..., D]``."""
    torch = _torch()
    spans = list(_spans(t.counts))
    if not spans:
        return t.mean.expand(*codes.shape[:-1], -1).clone()
    parts, col = [], 0
    for w, _, n in spans:
        parts.append(_unpack(codes[..., col : col + n * w // 8], w))
        col += n * w // 8
    q = torch.cat(parts, dim=-1).float()
    y = torch.addcmul(t.lo, q + 0.5, t.step)
    return y @ t.weight + t.mean
