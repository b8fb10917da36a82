"""The stream of batches of a rank and worker: one global sequence across epochs, windows opened ahead;
built by DataLoader worker processes (:class:`RingLoader`) or threads of the process (:class:`ThreadLoader`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from flowmatch_models.data.batch import StoredBatch
from flowmatch_models.data.order import epoch_windows
from flowmatch_models.data.ring import BatchRing
from flowmatch_models.data.rows import ReadPool
from flowmatch_models.data.source import ShardSource

log = logging.getLogger(__name__)


class BatchStream(IterableDataset):
    """This rank's batches from ``(start_epoch, start_sample)`` on: endless, or to the end of
    ``end_epoch`` (the data module streams one epoch per loader, so that the next epoch's
    partition set can be decided at the boundary). The batches are stored ones
    (:class:`StoredBatch` with ``meta``), decoded where they go (:meth:`ShardSource.decode`)."""

    def __init__(
        self,
        source: ShardSource,
        batch_size: int,
        seed: int = 0,
        shuffle_window: int = 4,
        rank: int = 0,
        world_size: int = 1,
        start_epoch: int = 0,
        start_sample: int = 0,
        end_epoch: int | None = None,
        ring: BatchRing | None = None,
        bucket_chunk: int = 256,
    ):
        self.source, self.batch_size, self.seed = source, batch_size, seed
        #: samples of several buckets: chunks of this many, one bucket each (epoch_order)
        self.chunk = bucket_chunk if len(source.grids) > 1 else 0
        self.ring = ring  # stored batches written into its slots (RingLoader opens them)
        self.end_epoch = end_epoch
        self.window, self.rank, self.world_size = shuffle_window, rank, world_size
        self.start_epoch, self.start_sample = start_epoch, start_sample
        self.global_batch = batch_size * world_size
        self.starts = np.concatenate([[0], np.cumsum(source.sizes)])
        if self.global_batch > int(source.sizes.sum()):
            raise ValueError(
                f"global batch {self.global_batch} (batch_size x {world_size} ranks) exceeds the "
                f"{int(source.sizes.sum())} samples of {len(source.sizes)} partitions; "
                "lower data.batch_size or add partitions"
            )
        if self.chunk and start_sample % self.global_batch:
            raise ValueError(
                f"start position {start_sample} is not a multiple of the global batch "
                f"{self.global_batch}: with aspect-ratio buckets batches are one bucket only there"
            )
        if self.chunk and self.chunk % self.global_batch:
            raise ValueError(
                f"global batch {self.global_batch} (batch_size x {world_size} ranks) does not "
                f"divide data.bucket_chunk {self.chunk}: with aspect-ratio buckets every batch "
                "is cut from one chunk of one bucket; pick a batch size that divides it (or a "
                "chunk that is a multiple of every global batch the run will use)"
            )
        self._order: tuple[int, np.ndarray] | None = None
        if self.chunk and len(self.order(start_epoch)) < self.global_batch:
            raise ValueError(
                f"no bucket has a chunk of data.bucket_chunk {self.chunk} samples in an epoch "
                f"({int(source.sizes.sum())} samples in {len(source.grids)} buckets): lower "
                "data.bucket_chunk (and data.batch_size, which divides it) or add partitions"
            )

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (:func:`epoch_order`; the newest epoch's kept)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (
                epoch,
                self.source.epoch_order(epoch, self.seed, self.window, self.chunk),
            )
        return self._order[1]

    def positions(self) -> Iterator[tuple[int, int]]:
        """``(epoch, position)`` of every global batch from the start on, in training order.

        The k-th item is the k-th batch of the stream whatever the number of workers: each epoch
        holds ``n // G`` full global batches from position 0 (the tail is dropped), the first
        epoch those from ``start_sample`` on.
        """
        epoch, pos = self.start_epoch, self.start_sample
        while self.end_epoch is None or epoch <= self.end_epoch:
            n_total = len(self.order(epoch)) if self.chunk else int(self.starts[-1])
            while pos + self.global_batch <= n_total:
                yield epoch, pos
                pos += self.global_batch
            epoch, pos = epoch + 1, 0

    def plan(self, wid: int = 0, nw: int = 1) -> Iterator[tuple]:
        """``(k, epoch, position, idx, todo)`` of the stream's batches ``k`` with
        ``k mod nw == wid``: this rank's global sample indices ``idx`` of batch ``k`` and the
        partition to open before it (``todo``: one of the next window's, or None)."""
        order_epoch, order, windows, ends = -1, None, [], np.zeros(0)
        for k, (epoch, g0) in enumerate(self.positions()):
            if k % nw != wid:
                continue
            if epoch != order_epoch:
                order_epoch = epoch
                order = self.order(epoch)
                windows = epoch_windows(self.source.sizes, epoch, self.seed, self.window)
                ends = np.cumsum([self.source.sizes[w].sum() for w in windows])
            # open the next window's partitions spread over this window (the j-th of n once
            # j/(n+1) of the window has passed), so that no worker opens a whole window when
            # the boundary comes (a stall: ~10 ms a partition, in every worker at once)
            todo = None
            w = int(np.searchsorted(ends, g0, side="right"))
            if w + 1 < len(windows):
                start = ends[w - 1] if w else 0
                due = int((g0 - start) / max(ends[w] - start, 1) * (len(windows[w + 1]) + 1))
                todo = next(
                    (int(p) for p in windows[w + 1][:due] if not self.source.is_open(int(p))), None
                )
            lo = g0 + self.rank * self.batch_size
            yield k, epoch, g0, order[lo : lo + self.batch_size], todo

    def build(
        self,
        epoch: int,
        g0: int,
        idx: np.ndarray,
        todo: int | None,
        slot: int | None = None,
        ring: BatchRing | None = None,
        io: ReadPool | None = None,
    ) -> StoredBatch:
        """The stored batch of samples ``idx`` (of :meth:`plan`) with its ``meta``: read into
        ``ring``'s ``slot`` (the batch then holds only what is not in the slot's buffers), or
        new buffers. ``io``: reads that would wait on the disk go to its threads
        (:class:`ReadPool`)."""
        if todo is not None:
            self.source._arrays(todo)
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        local = idx - self.starts[shard]
        plan = self.source.plan(shard, local, train=True)
        if ring is not None:
            batch = self.source.read(plan, ring.buffers[slot], ring.arrays[slot], io)
        else:
            batch = self.source.read(plan)
        # bookkeeping as host values beside the tensors: the module takes it off the batch
        # before the transfer, so reading it never waits on the device
        batch["meta"] = {
            "epoch": int(epoch),
            "position": int(g0),
            "global_batch": int(self.global_batch),
            "ids": batch.pop("ids"),
            "shard": batch.pop("shard"),
        }
        return batch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        # The DataLoader asks worker k % nw for the k-th batch of the whole iterator (not of the
        # epoch), so worker w takes items w, w + nw, ... of one global sequence across epochs.
        for produced, (k, epoch, g0, idx, todo) in enumerate(self.plan(wid, nw)):
            if self.ring is None:
                yield self.build(epoch, g0, idx, todo)
                continue
            slot = self.ring.slot(wid, produced)
            batch = self.build(epoch, g0, idx, todo, slot, self.ring)
            self.ring.seqs[slot] = k
            batch.update(slot=slot, seq=k)
            yield batch


class RingLoader(DataLoader):
    """A DataLoader whose workers fill a :class:`BatchRing`: iterating it yields the batches
    as views of the ring (opened in the main process)."""

    def __init__(self, stream: BatchStream, ring: BatchRing, **kwargs):
        super().__init__(stream, batch_size=None, **kwargs)
        self.ring = ring

    def __iter__(self):
        for item in super().__iter__():
            yield self.ring.open(item)


class ThreadLoader:
    """This rank's batches of ``stream`` built in a thread of this process into a
    :class:`BatchRing` of ordinary (not shared) buffers, in the stream's order (so exactly the
    single-process sequence, whatever ``threads``), with ``threads`` more threads for what
    would wait: reads not in the page cache (:class:`ReadPool`) and the next window's
    partitions, opened ahead (:meth:`BatchStream.plan`). No worker processes: nothing is
    pickled or handed between processes, no interpreter per worker, the buffers are faulted in
    once. One thread builds because building is CPU work under the GIL: several building
    threads hand the GIL over at every read, and from the page cache a read is a few us.
    ``threads`` 0: built in the consuming thread, every read blocking. ``prefetch``: batches
    built ahead (default 2: ~3 ms of batches at full speed, many training steps' worth); the
    ring has ``prefetch + 3`` slots (the consumer holds the batch in use and the one fetched
    ahead, :class:`BatchRing`). Fewer slots read faster: the buffers stay in the CPU's caches
    (27 slots cost ~10% more kernel time a sample than 3, measured). Iterating is lazy:
    nothing starts before the first ``next``."""

    def __init__(self, stream: BatchStream, threads: int, prefetch: int = 2):
        self.stream, self.threads, self.prefetch = stream, max(0, int(threads)), prefetch
        self.ring = BatchRing(stream.source, stream.batch_size, 1, self.prefetch + 3, shared=False)
        stream.ring = None  # this loader fills its ring itself
        self._pass: Iterator[dict] | None = None  # the pass in progress

    def _task(self, k: int, epoch: int, g0: int, idx: np.ndarray, io: ReadPool | None) -> dict:
        slot = self.ring.slot(0, k)
        batch = self.stream.build(epoch, g0, idx, None, slot, self.ring, io)
        self.ring.seqs[slot] = k
        batch.update(slot=slot, seq=k)
        return batch

    def __iter__(self) -> Iterator[dict]:
        """A new pass over the stream; the previous pass (Lightning iterates a loader twice an
        epoch from epoch 1 on) is closed first: its threads joined, its ring slot released."""
        if self._pass is not None:
            self._pass.close()  # runs its finally: builder and io threads joined
        self._pass = self._iterate()
        return self._pass

    def close(self) -> None:
        """End the pass in progress (if any) and join its threads."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None

    def _opened(self, part: int, f: Future) -> None:
        """An io thread's opening ahead failed: said (the batch that needs the partition opens
        it again in the building thread, and fails there if the error stays)."""
        if not f.cancelled() and f.exception() is not None:
            e = f.exception()
            log.warning(
                "loader: opening partition %s ahead failed (%s: %s); the batch that "
                "needs it opens it again",
                self.stream.source.partitions[part],
                type(e).__name__,
                e,
            )

    def _iterate(self) -> Iterator[dict]:
        plan = self.stream.plan()
        self.ring._held = None  # a new pass over the stream
        if self.threads == 0:
            for k, epoch, g0, idx, todo in plan:
                if todo is not None:
                    self.stream.source._arrays(todo)
                yield self.ring.open(self._task(k, epoch, g0, idx, None))
            return
        pending: deque[Future] = deque()
        opening: dict[int, Future] = {}
        builder = ThreadPoolExecutor(1, thread_name_prefix="flowmatch-loader")
        io = ReadPool(self.threads)
        try:
            for k, epoch, g0, idx, todo in plan:
                if todo is not None and todo not in opening:  # opened by an io thread
                    opening[todo] = io.submit(self.stream.source._arrays, todo)
                    opening[todo].add_done_callback(lambda f, t=todo: self._opened(t, f))
                pending.append(builder.submit(self._task, k, epoch, g0, idx, io))
                if len(pending) > self.prefetch:
                    yield self.ring.open(pending.popleft().result())
            while pending:
                yield self.ring.open(pending.popleft().result())
        finally:
            for f in pending:
                f.cancel()
            builder.shutdown(wait=True)
            io.shutdown()
