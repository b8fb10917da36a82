"""Row readers: a batch's rows read straight from a shard's arrays into its buffer."""

from __future__ import annotations

import errno
import logging
import math
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from flowmatch_models.storage.store import Shard, StoreError

log = logging.getLogger(__name__)

#: preadv2's flag: read only what is in the page cache (Linux >= 4.14); 0 elsewhere
NOWAIT = getattr(os, "RWF_NOWAIT", 0)

#: cleared (once, logged) in a process whose kernel or sandbox refuses ``RWF_NOWAIT`` with an
#: error other than "not cached" (ENOSYS, EINVAL, EPERM: old kernels, seccomp): its reads are
#: then all blocking ones, on the io threads
_nowait = {"on": True}


def _nowait_refused(e: OSError) -> None:
    if _nowait["on"]:
        _nowait["on"] = False
        log.warning(
            "preadv(RWF_NOWAIT) failed with %s (%s): this process reads with blocking "
            "reads on the loader's io threads from now on",
            errno.errorcode.get(e.errno, e.errno),
            e.strerror,
        )


class FileRows:
    """Rows of one array as stored in a shard file (raw values, or codes of a transform-coded
    array), read with ``pread`` straight into a batch buffer: the process maps nothing of the
    file and holds nothing of it between batches. A row is everything after the first axis
    (a sample's latents, its 64 DINO patches, one caption token)."""

    def __init__(self, shard: Shard, name: str, width: int | None = 0):
        """``width``: 0 rows as stored; else rows of ``width`` stored values (None: the last
        axis), the file's bytes cut so."""
        self.dtype, shape, self.base = shard.stored_rows(name)
        if width != 0:
            w = int(width or shape[-1])
            shape = (int(np.prod(shape, dtype=np.int64)) // w, w)
        self.rows, self.row_shape = shape[0], tuple(shape[1:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        #: transform-coded: the rows are codes (:meth:`ShardSource.tables` decodes them)
        self.coded = "aux" in shard.info(name)
        self.path = shard.path
        self.fd = os.dup(shard.fileno())  # the version of the file the header came from
        weakref.finalize(self, os.close, self.fd)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.row_shape)

    def read(self, start: np.ndarray, count, out: torch.Tensor, dst: np.ndarray) -> None:
        """Rows ``start[i] .. start[i] + count[i]`` into ``out``'s rows from ``dst[i]`` on
        (``count``: an int or one per item). One ``preadv`` per item, nothing else per row."""
        mv = memoryview(out.numpy()).cast("B")
        rb, base, fd = self.row_bytes, self.base, self.fd
        if int(np.prod(out.shape[1:])) * out.element_size() != rb:
            raise StoreError(
                f"{self.path}: rows of {rb} bytes, the batch's differ: its "
                "partitions were stored differently; re-make them with one storage setting"
            )
        starts, dsts = np.asarray(start).tolist(), np.asarray(dst).tolist()
        counts = [count] * len(starts) if np.ndim(count) == 0 else np.asarray(count).tolist()
        preadv = os.preadv
        for s, n, d in zip(starts, counts, dsts):
            if preadv(fd, [mv[d * rb : (d + n) * rb]], base + s * rb) != n * rb:
                raise StoreError(f"{self.path}: short read at row {s}; the file is truncated")


class ReadPool:
    """Threads for the reads that would wait on the disk. A loader's one building thread reads
    every run with ``RWF_NOWAIT`` (:func:`read_rows`): served from the page cache, as a
    warm window is, it never blocks and no other thread contends for the GIL (several
    threads reading at once hand the GIL over at every ``preadv``: measured ~15-30% more CPU a
    sample at 6 threads); the runs not (all) in the page cache are read here, spread over
    ``threads`` threads, so that a cold window still has ``threads`` reads in flight."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flowmatch-io")

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def read(self, mv: memoryview, runs: list[tuple[int, int, int, int]], rows: list) -> None:
        """Blocking reads of ``runs`` ``(fd, offset, lo, hi)`` into ``mv[lo:hi]``, over the
        threads; returns when all are read."""
        k = min(self.threads, len(runs))
        for f in [self.pool.submit(_read_blocking, mv, runs[i::k], rows) for i in range(k)]:
            f.result()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _read_blocking(mv: memoryview, runs: list[tuple[int, int, int, int]], rows: list) -> None:
    preadv = os.preadv
    for fd, off, a, z in runs:
        if preadv(fd, [mv[a:z]], off) != z - a:
            path = next(r.path for r in rows if r.fd == fd)
            raise StoreError(f"{path}: short read at byte {off}; the file is truncated")


def read_rows(
    out: np.ndarray,
    rows: list,
    sizes: list[int],
    start: np.ndarray,
    count,
    dst: np.ndarray,
    io: ReadPool | None = None,
) -> None:
    """A batch's runs of rows of several partitions' arrays into ``out`` (the numpy view of a
    batch buffer): group ``g`` (``sizes[g]`` runs) from ``rows[g]`` (a :class:`FileRows` or
    :class:`ArrayRows`); run ``i`` is rows ``start[i] .. start[i] + count[i]`` to ``out``'s
    rows from ``dst[i]`` on (``count``: an int or one per run). The groups' runs are read in
    one loop, one ``preadv`` each: per batch and array a few numpy operations over all its
    runs, per run a slice and a system call (no numpy per partition). With ``io``: each run
    read only if it is in the page cache (``RWF_NOWAIT``), the rest by ``io``'s threads."""
    rb = out.itemsize * math.prod(out.shape[1:])
    if not all(isinstance(r, FileRows) for r in rows):  # stored compressed: decoded whole
        ends = np.cumsum(sizes)
        counts = np.broadcast_to(count, np.shape(start))
        for r, hi, n in zip(rows, ends, sizes):
            lo = hi - n
            r.read(start[lo:hi], counts[lo:hi], torch.from_numpy(out), dst[lo:hi])
        return
    for r in rows:
        if r.row_bytes != rb:
            raise StoreError(
                f"{r.path}: rows of {r.row_bytes} bytes, the batch's {rb}: its partitions "
                "were stored differently; re-make them with one storage setting"
            )
    mv = memoryview(out).cast("B")
    base = np.repeat(np.array([r.base for r in rows], np.int64), sizes)
    fds = np.repeat(np.array([r.fd for r in rows]), sizes).tolist()
    lo = dst * rb
    runs = zip(
        fds, (base + start * rb).tolist(), lo.tolist(), (lo + np.multiply(count, rb)).tolist()
    )
    if io is None:
        _read_blocking(mv, runs, rows)
        return
    preadv, missed = os.preadv, []
    for fd, off, a, z in runs:
        if not _nowait["on"]:
            missed.append((fd, off, a, z))
            continue
        try:
            n = preadv(fd, [mv[a:z]], off, NOWAIT)
        except OSError as e:  # not in the page cache (or no RWF_NOWAIT here): the io threads'
            if e.errno not in (errno.EAGAIN, errno.EOPNOTSUPP):
                _nowait_refused(e)  # anything else: blocking reads from now on (said once)
            n = 0
        if n != z - a:
            missed.append((fd, off + n, a + n, z))
    if missed:
        io.read(mv, missed, rows)


class ArrayRows:
    """Rows of an array in memory (stored compressed: decoded whole), read like
    :class:`FileRows`."""

    def __init__(self, array: np.ndarray):
        self.array, self.coded = array, False
        self.dtype, self.shape, self.row_shape = array.dtype, array.shape, array.shape[1:]

    def read(self, start: np.ndarray, count, out: torch.Tensor, dst: np.ndarray) -> None:
        counts = np.broadcast_to(count, np.shape(start)).astype(np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        out.numpy()[np.repeat(dst, counts) + within] = self.array[np.repeat(start, counts) + within]


def open_rows(shard: Shard, name: str, cells: bool = False, width: int | None = None):
    """``name`` of ``shard`` for reading rows: from the file (raw or coded), or (stored
    compressed) decoded whole. ``cells``: as one row per latent cell, of ``width`` values (the
    last axis when None) -- a one-size shard's ``[N, 32, h, w]`` latents and ``[N, c, D]``
    patches read exactly as the cell layout's rows (the same bytes), so a batch reads a
    sample's cells as one run from its cell offset whichever layout stored it. Rows are read
    without hashing the whole array (every worker would re-read every file at each window
    boundary, together: the stall this loader avoids); the file's header, footer and length are
    checked at open, its decoding tables by checksum, and every checksum when the shard is
    made (the asset's blocking check) and by ``flowmatch verify``."""
    if shard.is_row_readable(name):
        return FileRows(shard, name, width if cells else 0)
    log.debug("%s: %s is stored %s; decoding it whole", shard.path, name, shard.info(name)["codec"])
    array = np.asarray(shard[name])
    return ArrayRows(array.reshape(-1, width or array.shape[-1]) if cells else array)


def sample_grids(vae: Shard) -> np.ndarray:
    """Every sample's latent grid ``(h, w)`` in cells, int32 ``[N, 2]``: the ``grid`` array of a
    shard of several buckets, else the one size of its ``[N, 32, h, w]`` latents."""
    if "grid" in vae:
        return np.asarray(vae["grid"]).astype(np.int32)
    shape = vae.info("latents")["shape"]
    return np.tile(np.array([shape[2], shape[3]], np.int32), (int(shape[0]), 1))


def empty_buffer(shape: tuple[int, ...], dtype, shared: bool) -> torch.Tensor:
    """An empty tensor to fill from the files (in shared memory for a :class:`BatchRing`)."""
    t = torch.from_numpy(np.empty(shape, np.dtype(dtype)))
    return t.share_memory_() if shared and t.numel() else t
