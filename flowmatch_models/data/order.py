"""The order of an epoch and the held-out split: pure functions of the seed, the epoch and the partitions."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import numpy as np
import xxhash

log = logging.getLogger(__name__)


#: The definition of the sample order (:func:`epoch_order` + :class:`BatchStream`'s split over
#: ranks and workers), recorded in every checkpoint's data state: a resume under another
#: definition stops and names both (checkpoints without it used this one).
ORDER = "window-v1"


class OrderChangedError(ValueError):
    """A resume whose order-defining settings differ from the checkpoint's."""


def heldout_rows(ids: Sequence[str], fraction: float, cap: int) -> np.ndarray:
    """Rows of a partition never trained on: the ids whose xxh3_64 hash is below ``fraction``
    of its range, at most ``cap`` of them (the smallest hashes), in row order. A pure function
    of the ids: the same samples are held out by every run, rank, worker and resume."""
    if fraction <= 0 or cap <= 0 or not len(ids):
        return np.zeros(0, np.int64)
    h = np.fromiter((xxhash.xxh3_64_intdigest(i.encode()) for i in ids), np.uint64, len(ids))
    chosen = np.flatnonzero(h < np.uint64(min(fraction, 1.0) * float(2**64 - 1)))
    if len(chosen) > cap:
        chosen = np.sort(chosen[np.argsort(h[chosen], kind="stable")[:cap]])
    return chosen.astype(np.int64)


def train_rows(
    ids: Sequence[str], fraction: float, cap: int, excluded: Collection[str] = ()
) -> np.ndarray:
    """The rows of a partition that training uses: all but :func:`heldout_rows` and the rows
    whose ids are ``excluded`` (the exclusion list's, :mod:`flowmatch_models.data.exclude`)."""
    keep = np.ones(len(ids), bool)
    keep[heldout_rows(ids, fraction, cap)] = False
    if excluded:
        keep[[i in excluded for i in ids]] = False
    return np.flatnonzero(keep).astype(np.int64)


def _windows(sizes: np.ndarray, epoch: int, seed: int, window: int):
    """The epoch's generator (after its first draw) and its shuffle windows: the partitions of
    each, in order."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(sizes))
    return rng, [order[w : w + window] for w in range(0, len(order), window)]


def epoch_windows(sizes: np.ndarray, epoch: int, seed: int, window: int) -> list[np.ndarray]:
    """The partitions of each shuffle window of an epoch, in order (:func:`epoch_order`'s)."""
    return _windows(sizes, epoch, seed, window)[1]


def epoch_order(
    sizes: np.ndarray,
    epoch: int,
    seed: int,
    window: int,
    buckets: np.ndarray | None = None,
    chunk: int = 0,
) -> np.ndarray:
    """Global sample indices of one epoch: shuffled shard order, shuffled within windows.
    int32 when they fit (PD12M's 12.4M: 50 MB an epoch instead of 100 in every worker).

    With ``buckets`` (every sample's bucket, of more than one) each window's permuted samples
    are split by bucket and cut into chunks of ``chunk`` samples, a bucket's remainder carried
    into its next window's (the epoch's last remainders are left out: at most ``chunk - 1``
    samples a bucket, others each epoch); the window's chunks are shuffled. Any global batch
    that divides ``chunk`` then lies in one chunk: one bucket. Still a pure function of its
    arguments; with one bucket exactly the order without buckets."""
    rng, windows = _windows(sizes, epoch, seed, window)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    dtype = np.int32 if starts[-1] < 2**31 else np.int64
    multi = buckets is not None and len(buckets) and int(buckets.max()) != int(buckets.min())
    if multi and chunk < 1:
        raise ValueError("samples of several buckets need a chunk size (data.bucket_chunk)")
    parts, carry = [], {}
    for members in windows:
        idx = np.concatenate([np.arange(starts[s], starts[s + 1], dtype=dtype) for s in members])
        perm = rng.permutation(idx)
        if not multi:
            parts.append(perm)
            continue
        b = buckets[perm]
        chunks = []
        for u in np.unique(b):
            sel = np.concatenate([carry.get(int(u), perm[:0]), perm[b == u]])
            full = len(sel) // chunk * chunk
            chunks += [sel[i : i + chunk] for i in range(0, full, chunk)]
            carry[int(u)] = sel[full:]
        parts += [chunks[i] for i in rng.permutation(len(chunks))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)
