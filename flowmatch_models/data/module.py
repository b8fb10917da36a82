"""The training data module: batches of (scaled latents, DINOv2 patches, padded captions) from the
store, in an order that survives any resume.

Order of one epoch (a pure function of ``seed``, ``epoch`` and the partition list):
shards are permuted, grouped into windows of ``shuffle_window`` shards, and the samples of each
window are permuted together — so a worker only keeps a window of shards open while batches
still mix partitions. Global batch ``b`` covers epoch positions ``[start + b G, start + (b+1) G)``
with ``G = batch_size * world_size``; rank ``r`` takes its ``r``-th slice of ``batch_size``;
dataloader worker ``w`` builds the batches ``k`` of the whole stream (counted across epochs, as
the DataLoader counts) with ``k mod num_workers = w``, so any number of workers yields exactly
the single-process sequence. The data position ``(epoch, sample offset)`` is ours, not Lightning's: the training
step reports each consumed batch through :meth:`EmbeddingDataModule.mark_consumed`, and the
position plus per-partition trained counts travel in the checkpoint (``state_dict``), so a
mid-epoch resume continues exactly where the run stopped, even with a new batch size, worker
count or number of ranks. Settings that define the order (``seed``, ``shuffle_window``) must match
the checkpoint's: a resume that changes one stops with an error naming it, unless
``allow_order_change`` is set; a changed partition list starts the next epoch (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from flowmatch_models.data import exclude as exclusions
from flowmatch_models.data.batch import DecodedBatch, StoredBatch
from flowmatch_models.data.order import ORDER, OrderChangedError, train_rows
from flowmatch_models.data.ring import BatchRing
from flowmatch_models.data.source import PartitionChangedError, ShardSource, shard_fingerprint
from flowmatch_models.data.stream import BatchStream, RingLoader, ThreadLoader
from flowmatch_models.embeddings.kinds import model_inputs
from flowmatch_models.storage import remote
from flowmatch_models.storage.fingerprint import Fingerprint
from flowmatch_models.storage.layout import DataLayout
from flowmatch_models.storage.store import read_shard
from flowmatch_models.train import lightning_compat

log = logging.getLogger(__name__)

#: how a rank's batches are built: ``threads`` of the training process (:class:`ThreadLoader`),
#: or DataLoader worker ``processes`` (:class:`RingLoader`; the loader before threads). Both
#: yield the same sequence of batches.
LOADERS = ("threads", "processes")


def rank_disagreement(rank0: dict, mine: dict, rank: int) -> str | None:
    """Why this rank's epoch differs from rank 0's (``{"partitions", "sizes"}`` each), naming
    the first partition that differs; None when they agree."""
    if rank0["partitions"] != mine["partitions"]:
        a, b = rank0["partitions"], mine["partitions"]
        diff = sorted(set(a) ^ set(b)) or [next(x for x, y in zip(a, b) if x != y)]
        return (
            f"rank {rank} and rank 0 train different partitions this epoch (first: {diff[0]}): "
            "a partition was made or removed while they read the folder; resume with "
            "--resume auto"
        )
    for p, n0, n in zip(mine["partitions"], rank0["sizes"], mine["sizes"]):
        if n0 != n:
            return (
                f"partition {p} has {n} trainable samples on rank {rank} but {n0} on rank 0: "
                "it was re-made while the ranks read it; resume with --resume auto"
            )
    return None


class EmbeddingDataModule(L.LightningDataModule):
    """Lightning data module over the complete partitions (or an explicit list) of a data root.

    One loader per epoch: at each epoch start the epoch's partition set is decided (rank 0,
    broadcast to every rank): the explicit list, or with ``grow`` every partition complete at
    that moment, so a run started at low coverage picks up partitions completed since, at epoch
    boundaries, without a restart. ``state_dict`` holds the data position ``(epoch, position)``,
    the current epoch's partition set (a resume finishes the epoch with it), the per-partition
    count of samples trained so far (over all ranks) and the ledger: one segment per (epoch,
    session) -- partition set, shard sizes, seed, shuffle window, global batch, accumulation,
    consumed positions and the optimizer step at their start -- from which every trained sample
    id and its steps are reconstructed (:func:`ledger_samples`).
    """

    def __init__(
        self,
        root: str | Path,
        partitions: Sequence[str] | None = None,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_window: int = 4,
        text_max_len: int = 128,
        load_dino: bool = True,
        allow_order_change: bool = False,
        grow: bool = False,
        accumulate: int = 1,
        fixed_text_len: bool = False,
        heldout: tuple[float, int] = (0.0, 0),
        bucket_chunk: int = 256,
        loader: str = "threads",
        exclude: bool = True,
    ):
        super().__init__()
        if loader not in LOADERS:
            raise ValueError(f"data.loader {loader!r}: choose one of {', '.join(LOADERS)}")
        self.loader = loader
        self.exclude = exclude  # skip the exclusion list's rows (near and content duplicates)
        self.bucket_chunk = int(bucket_chunk)
        self.fixed_text_len = fixed_text_len
        self.heldout = (float(heldout[0]), int(heldout[1]))
        self.allow_order_change = allow_order_change
        self.root = Path(root)
        self.fixed = list(partitions) if partitions else None
        self.grow = grow
        self.partitions = self.fixed or DataLayout(root).complete_partitions()
        self._initial = list(self.partitions)
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.shuffle_window, self.text_max_len = shuffle_window, text_max_len
        self.load_dino = load_dino
        self.accumulate = accumulate
        self.source = self._open(self.partitions)
        self.epoch, self.position = 0, 0
        self.trained_counts: dict[str, int] = {p: 0 for p in self.partitions}
        self.ledger: list[dict] = []
        self._decided_epoch: int | None = None
        self._available: list[str] | None = None  # complete partitions at the epoch's start
        self._skipped: dict[str, str] = {}  # grow: complete but made with other settings
        self._fp_cache: dict[tuple, Fingerprint | None] = {}
        self._orders: dict[int, np.ndarray] = {}
        #: the data moved on to the next epoch while Lightning's epoch (its batch counter, which
        #: ends the accumulation groups) is still open: set by the epoch's last batch, cleared
        #: by the next epoch's loader, saved in the state
        self._epoch_end = False

    def _wanted(self) -> exclusions.Exclusions:  # the catalog's list now (or none)
        return exclusions.current(self.root) if self.exclude else exclusions.NONE

    def _open(self, partitions: list[str], ex: exclusions.Exclusions | None = None) -> ShardSource:
        return ShardSource(
            self.root,
            partitions,
            self.text_max_len,
            self.load_dino,
            2 * self.shuffle_window + 1,
            fixed_text_len=self.fixed_text_len,
            heldout=self.heldout,
            exclude=self._wanted() if ex is None else ex,
        )

    @property
    def scaling_factor(self) -> float:
        return self.source.scaling_factor

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _decide_epoch(self) -> None:
        """At an epoch's start: its partition set (rank 0 decides, every rank gets it)."""
        if self.position != 0 or self._decided_epoch == self.epoch:
            return
        self._decided_epoch = self.epoch
        trainer = getattr(self, "trainer", None)
        ddp = trainer is not None and trainer.world_size > 1
        decided = None
        if not ddp or trainer.is_global_zero:  # rank 0 reads the folder and the fingerprints
            if self.grow and (store := remote.active(self.root)) is not None:
                store.sync()  # what other machines published since: a growing run takes it
            complete = DataLayout(self.root).complete_partitions()
            found = complete if self.grow else (self.fixed or self._initial)
            skipped = self._other_fingerprints(found) if self.grow else {}
            decided = (complete, found, skipped, self._wanted().digest)  # the list now
        if ddp:  # every rank takes rank 0's decision (a partition re-made in between: the same)
            decided = trainer.strategy.broadcast(decided, src=0)
        complete, found, skipped, digest = decided
        self._available = complete
        self._skipped = skipped
        if self._skipped:
            found = [p for p in found if p not in self._skipped]
            log.warning(
                "epoch %d: skipping %d partitions made with other settings than this run's "
                "(training never mixes fingerprints within one kind): %s",
                self.epoch,
                len(self._skipped),
                "; ".join(f"{p} ({w})" for p, w in list(self._skipped.items())[:5]),
            )
        ex = self.source.exclude  # the exclusion list: rank 0's version (its snapshot), on all
        ex = ex if ex.digest == digest else exclusions.recorded(self.root, digest)
        if found and found != self.partitions:
            new = sorted(set(found) - set(self.partitions))
            gone = sorted(set(self.partitions) - set(found))
            log.warning(
                "epoch %d: %d partitions (%s%s)",
                self.epoch,
                len(found),
                f"+{len(new)} new: {', '.join(new[:5])}" if new else "",
                f" -{len(gone)} gone: {', '.join(gone[:5])}" if gone else "",
            )
        if (found and found != self.partitions) or ex.digest != self.source.exclude.digest:
            found = found or self.partitions
            self.partitions, self.source, self._orders = list(found), self._open(found, ex), {}
            for p in found:
                self.trained_counts.setdefault(p, 0)
        if ddp:
            self._agree_with_rank0(trainer)

    def _agree_with_rank0(self, trainer) -> None:
        """Every rank's partitions and sizes (trainable samples) are rank 0's, or every rank
        stops with :class:`PartitionChangedError` naming the partition that differs (ranks with
        different epoch lengths would wait for each other forever, or train other orders)."""
        import torch.distributed as dist

        mine = {"partitions": list(self.partitions), "sizes": [int(n) for n in self.source.sizes]}
        theirs = trainer.strategy.broadcast(mine, src=0)
        whys: list[str | None] = [None] * trainer.world_size
        dist.all_gather_object(whys, rank_disagreement(theirs, mine, trainer.global_rank))
        bad = [w for w in whys if w]
        if bad:
            raise PartitionChangedError(bad[0])

    def _other_fingerprints(self, partitions: list[str]) -> dict[str, str]:
        """Partitions whose shards were made with another fingerprint than this run's, and why
        (headers read once per file version)."""
        out = {}
        for p in partitions:
            for kind in self.source.kinds:
                path = self.source.layout.asset_path(kind, p)
                try:
                    key = (kind, p, path.stat().st_mtime_ns)
                except OSError:
                    continue
                if key not in self._fp_cache:
                    self._fp_cache[key] = shard_fingerprint(self.source.layout, kind, p)
                why = self.source.mismatch(kind, self._fp_cache[key], p)
                if why:
                    out[p] = why
                    break
        return out

    def train_dataloader(self) -> DataLoader | ThreadLoader:
        self._epoch_end = False
        self._decide_epoch()
        rank, world = self._rank_world()
        g = self.batch_size * world
        if len(self.source.grids) > 1 and self.position % g:
            # an elastic resume with a larger global batch: its batches are one bucket only on
            # its own multiples (chunk boundaries are); the samples up to the next are left for
            # the next epoch (the ledger's segment starts there)
            skip = g - self.position % g
            log.warning(
                "epoch %d: position %d is not a multiple of the global batch %d; "
                "starting at %d (%d samples of this epoch skipped to keep batches one "
                "bucket)",
                self.epoch,
                self.position,
                g,
                self.position + skip,
                skip,
            )
            self.position += skip
        stream = BatchStream(
            self.source,
            self.batch_size,
            self.seed,
            self.shuffle_window,
            rank,
            world,
            self.epoch,
            self.position,
            end_epoch=self.epoch,
            bucket_chunk=self.bucket_chunk,
        )
        trainer = getattr(self, "trainer", None)
        self.ledger.append(
            {
                "epoch": self.epoch,
                "partitions": list(self.partitions),
                "sizes": [int(n) for n in self.source.sizes],
                "seed": self.seed,
                "shuffle_window": self.shuffle_window,
                "heldout": list(self.heldout),
                **({"exclude": d} if (d := self.source.exclude.digest) else {}),
                "global_batch": stream.global_batch,
                "accumulate": self.accumulate,
                "pos_from": self.position,
                "pos_to": self.position,
                "step_from": int(trainer.global_step) if trainer is not None else 0,
                # several buckets: the chunks the order was cut in (ledger.segment_samples)
                **({"bucket_chunk": stream.chunk} if stream.chunk else {}),
                **self._available_counts(),
                **({"skipped": dict(self._skipped)} if self._skipped else {}),
            }
        )
        self._log_coverage(trainer)
        if self.loader == "threads":
            # num_workers threads of this process fill a ring of reusable buffers
            loader = ThreadLoader(stream, self.num_workers)
            log.info(
                "loader: %d threads, %d batch buffers, %.0f MB",
                self.num_workers,
                len(loader.ring.buffers),
                loader.ring.nbytes / 1e6,
            )
            return loader
        # a ring of reusable shared buffers: batches are neither copied between processes
        # nor written to fresh memory (sized for the longest batch; memory as logged)
        prefetch = 4 if self.num_workers > 0 else None
        stream.ring = BatchRing(self.source, self.batch_size, self.num_workers, (prefetch or 0) + 3)
        log.info(
            "loader: %d workers, %d batch buffers, %.0f MB",
            self.num_workers,
            len(stream.ring.buffers),
            stream.ring.nbytes / 1e6,
        )
        return RingLoader(
            stream,
            stream.ring,
            num_workers=self.num_workers,
            prefetch_factor=prefetch,
            persistent_workers=False,
        )

    def decode_batch(self, batch: StoredBatch, device) -> DecodedBatch:
        """A stored training batch as float32 model inputs on ``device`` (where it was moved):
        codes decoded with the tables of the file versions they were read from
        (:meth:`ShardSource.tables`, on ``device``)."""
        return self.source.decode(batch, device)

    def _available_counts(self) -> dict:
        """Partitions and trainable samples (held-out ones excluded, as in ``sizes``) complete
        at the epoch's start (beside those used)."""
        avail = self._available if self._available is not None else self.partitions
        if set(avail) == set(self.partitions):
            samples = int(self.source.sizes.sum())
        else:
            layout = DataLayout(self.root)
            samples = sum(
                len(
                    train_rows(
                        read_shard(layout.asset_path(model_inputs()["latents"].name, p)).ids,
                        *self.heldout,
                        self.source.exclude.ids.get(p, ()),
                    )
                )
                for p in avail
            )
        return {"available_partitions": len(avail), "available_samples": samples}

    def _log_coverage(self, trainer) -> None:
        """The epoch's coverage (partitions and samples used) into the run's loggers."""
        if trainer is None or not trainer.is_global_zero:
            return
        seg = self.ledger[-1]
        row = {
            "coverage/epoch": float(self.epoch),
            "coverage/partitions_used": float(len(self.partitions)),
            "coverage/samples_used": float(self.source.sizes.sum()),
            "coverage/partitions_available": float(seg["available_partitions"]),
            "coverage/samples_available": float(seg["available_samples"]),
        }
        for logger in trainer.loggers:
            logger.log_metrics(row, step=trainer.global_step)

    def mark_consumed(self, epoch: int, position: int, global_batch: int) -> None:
        """Record that the global batch at ``(epoch, position)`` was trained on (all ranks)."""
        if epoch not in self._orders:
            self._orders = {
                epoch: self.source.epoch_order(
                    epoch, self.seed, self.shuffle_window, self.bucket_chunk
                )
            }
        idx = self._orders[epoch][position : position + global_batch]
        shard = np.searchsorted(np.cumsum(self.source.sizes), idx, side="right")
        for s, c in zip(*np.unique(shard, return_counts=True)):
            p = self.partitions[int(s)]
            self.trained_counts[p] = self.trained_counts.get(p, 0) + int(c)
        if self.ledger and self.ledger[-1]["epoch"] == epoch:
            self.ledger[-1]["pos_to"] = position + global_batch
        self.epoch, self.position = epoch, position + global_batch
        if self.position + global_batch > len(self._orders[epoch]):
            self.epoch, self.position = epoch + 1, 0
            self._epoch_end = True

    def state_dict(self) -> dict:
        return {
            "order": ORDER,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle_window": self.shuffle_window,
            # the chunks cut this epoch's order only with several buckets
            **({"bucket_chunk": self.bucket_chunk} if len(self.source.grids) > 1 else {}),
            "heldout": list(self.heldout),
            **({"exclude": d} if (d := self.source.exclude.digest) else {}),
            "partitions": list(self.partitions),
            "trained_counts": dict(self.trained_counts),
            "ledger": [dict(s) for s in self.ledger if s["pos_to"] > s["pos_from"]],
            **({"epoch_end": True} if self._epoch_end else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        theirs_order = state.get("order", "window-v1")  # checkpoints before the key: v1
        if theirs_order != ORDER:
            raise OrderChangedError(
                f"the checkpoint's sample order is {theirs_order!r}, this code's is {ORDER!r}: "
                "its data position means nothing here; resume with the flowmatch version that "
                "wrote it, or start a new run from its weights"
            )
        self.trained_counts = {p: 0 for p in self.partitions}
        self.trained_counts.update({k: int(v) for k, v in state["trained_counts"].items()})
        self.ledger = [dict(s) for s in state.get("ledger", [])]
        ours = {
            "seed": self.seed,
            "shuffle_window": self.shuffle_window,
            "heldout": [float(x) for x in self.heldout],
        }
        if "bucket_chunk" in state:  # its epoch was cut in chunks (several buckets)
            ours["bucket_chunk"] = self.bucket_chunk
        # a checkpoint from before held-out splits held nothing out
        theirs_all = {"heldout": [0.0, 0], **state}
        theirs_all["heldout"] = [float(x) for x in theirs_all["heldout"]]
        changed = {
            k: (theirs_all[k], v) for k, v in ours.items() if k in theirs_all and theirs_all[k] != v
        }
        if changed and not self.allow_order_change:
            what = ", ".join(
                f"data.{k}: checkpoint {a!r} -> now {b!r}" for k, (a, b) in changed.items()
            )
            what = what.replace("data.seed", "run.seed").replace(
                "data.heldout", "data.heldout_fraction/heldout_max_per_partition"
            )
            raise OrderChangedError(
                f"resume would change the data order ({what}); set it back, or pass "
                "--set data.allow_order_change=true to continue with a new order from the next epoch"
            )
        epoch, position, theirs = (
            int(state["epoch"]),
            int(state["position"]),
            list(state["partitions"]),
        )
        complete = set(DataLayout(self.root).complete_partitions())
        if not changed and position > 0 and set(theirs) <= complete:
            # mid-epoch: finish the epoch on its recorded partitions and exclusion list, exactly
            ex = state.get("exclude") or ""
            if theirs != self.partitions or ex != self.source.exclude.digest:
                ex = exclusions.recorded(self.root, ex)
                self.partitions, self.source, self._orders = theirs, self._open(theirs, ex), {}
            self.epoch, self.position = epoch, position
            self._decided_epoch = epoch
            return
        # saved inside Lightning's epoch (mid-epoch, or at the step that ended the data's): that
        # epoch is closed in the checkpoint Lightning is about to restore its loops from, so that
        # its batch counter starts the data's next epoch at 0, as uninterrupted
        if position > 0 or state.get("epoch_end"):
            trainer = getattr(self, "trainer", None)
            lightning_compat.close_epoch(lightning_compat.loaded_checkpoint(trainer))
        if not changed and position == 0:
            self.epoch, self.position = epoch, 0  # a boundary: the new epoch decides anew
            return
        self.epoch, self.position = epoch + 1, 0
        log.warning(
            "%s changed since the checkpoint; resuming at the start of epoch %d",
            ", ".join(changed)
            or "partitions of the current epoch are gone:"
            + ", ".join(sorted(set(theirs) - complete)),
            self.epoch,
        )
