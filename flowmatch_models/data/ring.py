"""The batch ring: reusable batch buffers (in shared memory for worker processes), filled by the
loader's workers or threads, opened where the batches are used."""

from __future__ import annotations

import logging

import torch

from flowmatch_models.data.batch import StoredBatch, slot_views
from flowmatch_models.data.source import ShardSource

log = logging.getLogger(__name__)


class BatchRing:
    """Reusable batch buffers shared by the main process and its DataLoader workers.

    Made in the main process before the workers start (so every worker maps the same memory):
    ``slots_per_worker`` buffer sets per worker, each as large as a batch can be. A worker fills
    its next slot and hands over only the slot's number and the batch's small fields; the main
    process reads the batch as views of its own mapping (:meth:`open`). No batch is copied
    between processes and no fresh memory is touched per batch (fresh pages, not the copies,
    are what cost: a page fault per 4 KB). Memory: ``workers x slots x`` one batch, whatever
    the partitions.

    A slot is refilled ``slots_per_worker`` batches of its worker later. The DataLoader keeps at
    most ``prefetch_factor`` batches per worker in flight and Lightning's fetcher holds one more
    beside the one in use, so ``prefetch_factor + 3`` slots keep a refill behind its reader.
    Each slot records the number of the batch it holds: :meth:`open` checks it, and checks the
    previous batch's again, so a refill that raced its reader raises instead of training on a
    mix of two batches.
    """

    def __init__(
        self,
        source: ShardSource,
        batch_size: int,
        workers: int,
        slots_per_worker: int,
        shared: bool = True,
    ):
        """``shared`` False: ordinary memory, for threads of one process (:class:`ThreadLoader`),
        faulted in here once (zeroed) rather than page by page under the first batches."""
        self.workers, self.slots = max(1, workers), slots_per_worker
        tokens = batch_size * source.text_max_len
        n = self.workers * self.slots
        self.buffers = [source.buffers(batch_size, tokens, shared=shared) for _ in range(n)]
        if not shared:
            for buf in self.buffers:
                for t in buf.values():
                    t.zero_()
        self.seq = torch.full((n,), -1, dtype=torch.int64)
        if shared:
            self.seq.share_memory_()
        self._held: tuple[int, int] | None = None
        self.nbytes = sum(t.nbytes for buf in self.buffers for t in buf.values())
        self._views()

    def _views(self) -> None:
        #: numpy views of each slot's buffers (what the reads fill) and of ``seq``: made once
        self.arrays = [{k: t.numpy() for k, t in buf.items()} for buf in self.buffers]
        self.seqs = self.seq.numpy()

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader worker under ``spawn``): the tensors by their shared memory,
        the numpy views made again there (pickled they would be copies)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("arrays", "seqs")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    def slot(self, worker: int, count: int) -> int:
        """The slot of a worker's ``count``-th batch."""
        return worker * self.slots + count % self.slots

    def open(self, item: dict) -> StoredBatch:
        """The stored batch of a worker's hand-over ``item`` (views of the slot)."""
        slot, seq = item.pop("slot"), item.pop("seq")
        if self._held is not None and int(self.seqs[self._held[0]]) != self._held[1]:
            raise RuntimeError(
                f"loader slot {self._held[0]} was refilled while batch {self._held[1]} was in "
                "use; the ring is too small for this DataLoader's prefetching"
            )
        if int(self.seqs[slot]) != seq:
            raise RuntimeError(f"loader slot {slot} holds batch {int(self.seqs[slot])}, not {seq}")
        self._held = (slot, seq)
        return {**slot_views(self.buffers[slot], item["sizes"]), **item}
