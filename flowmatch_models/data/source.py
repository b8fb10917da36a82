"""The partitions a run trains on: their shards opened and checked, widths, fingerprints, decoding tables."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from flowmatch_models.data.agreement import FingerprintMismatchError, agreeing, shard_fingerprint
from flowmatch_models.data.batch import (
    BatchPlan,
    DecodedBatch,
    StoredBatch,
    plan_batch,
    read_batch,
    slot_views,
)
from flowmatch_models.data.decode import decode_batch
from flowmatch_models.data.exclude import NONE, Exclusions
from flowmatch_models.data.order import epoch_order, heldout_rows
from flowmatch_models.data.rows import ReadPool, empty_buffer, open_rows, sample_grids
from flowmatch_models.embeddings.kinds import FIRST_TOKEN_ATTR, KINDS, model_inputs
from flowmatch_models.storage import remote
from flowmatch_models.storage import transform as transform_codec
from flowmatch_models.storage.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.storage.fingerprint import (
    Fingerprint,
    diff,
    disagreement,
    hash_of,
)
from flowmatch_models.storage.layout import DataLayout, source_of
from flowmatch_models.storage.store import Shard, ragged_offsets, read_shard

log = logging.getLogger(__name__)


def array_width(shard: Shard, array: str) -> int:
    """The last dimension of ``array`` in ``shard`` (from its header; nothing decoded)."""
    return int(shard.info(array)["shape"][-1])


class PartitionChangedError(RuntimeError):
    """A partition's file was re-made while a batch read from the old one was on its way: its
    codes would be decoded with another file's tables. The run stops (it never trains on it)."""


class ShardSource:
    """The partitions' three aligned shards (latents, DINO, text), opened lazily and cached.

    Rows are read from the files, never whole partitions: raw arrays (codec ``none``) and
    transform-coded ones (lossy ``pcaB``, the default storage) are read row by row with
    ``pread`` straight into the batch's buffers (:class:`FileRows`): the process maps nothing
    of the files and keeps no decoded partition, so a loader's memory is its batches, whatever
    the partition size, window or worker count (the OS page cache holds the files). Arrays
    stored compressed (``zstd``/``xz``, or int8/fp8) cannot be read by row: they are decoded
    whole per partition (``cache_shards`` partitions kept; memory grows with them).

    A batch is planned (:meth:`plan`: which rows of which opened partitions), read
    (:meth:`read`: a :class:`StoredBatch` of fp16 latents, codes of coded arrays, the
    partitions whose tables decode them; :meth:`gather` does both) and decoded by its caller to
    float32 model inputs (:meth:`decode`, :func:`decode_batch`, on any device: the GPU in
    training).

    ``heldout = (fraction, cap)`` holds out :func:`heldout_rows` of every partition: ``sizes``
    count the trainable rows, :meth:`plan` with ``train`` maps a trainable index to its row and
    :meth:`heldout_batch` serves the held-out ones (validation, FD). ``exclude`` (an
    :class:`Exclusions` version): rows never trained on either (near and content duplicates)."""

    def __init__(
        self,
        root: str | Path,
        partitions: Sequence[str],
        text_max_len: int = 128,
        load_dino: bool = True,
        cache_shards: int = 4,
        fixed_text_len: bool = False,
        heldout: tuple[float, int] = (0.0, 0),
        exclude: Exclusions = NONE,
    ):
        self.layout = DataLayout(root)
        inputs = model_inputs()  # which kinds hold the latents, caption states, DINO target
        self.latents, self.text, self.dino = (inputs[k].name for k in ("latents", "text", "dino"))
        self.heldout = (float(heldout[0]), int(heldout[1]))
        self.fixed_text_len = fixed_text_len  # pad every batch to text_max_len (torch.compile)
        self.partitions = list(partitions)
        if not self.partitions:
            raise ValueError(
                f"no complete partitions under {self.layout.root}: training needs "
                f"{', '.join(self.kinds)} for the same partition; materialize them first"
            )
        self.text_max_len = text_max_len
        self.load_dino = load_dino
        # with a remote data root: the embeddings another machine made, fetched in parallel
        remote.prefetch(
            root,
            [(k, p, self.layout.asset_path(k, p)) for p in self.partitions for k in self.kinds],
        )
        self.cache_shards = max(1, cache_shards)
        self._open: OrderedDict[int, dict] = OrderedDict()
        self._lock = threading.Lock()  # the caches, for a loader's threads (ThreadLoader)
        self._tables: OrderedDict[tuple[str, str, str], transform_codec.DeviceTables] = (
            OrderedDict()
        )
        #: kind -> the fingerprint hash every partition of this source shares
        self.fingerprints = self._agreed_fingerprints()
        ids = [self._shard(self.latents, p).ids for p in self.partitions]
        self.heldout_rows = [heldout_rows(i, *self.heldout) for i in ids]
        self.exclude = exclude
        #: per partition, the rows never trained on: held out or excluded
        self.untrained = [
            np.union1d(h, exclude.rows(p, i)).astype(np.int64)
            for p, i, h in zip(self.partitions, ids, self.heldout_rows)
        ]
        self.sizes = np.array([len(i) - len(u) for i, u in zip(ids, self.untrained)], np.int64)
        del ids  # 10k strings a partition: not kept (nor copied into every worker)
        # every trainable sample's bucket: an index into ``grids``, the (h, w) latent grids
        # found (one byte a sample: 12 MB for PD12M, beside the order)
        every = [sample_grids(self._shard(self.latents, p)) for p in self.partitions]
        trained = np.concatenate(
            [np.delete(g, u, axis=0) for g, u in zip(every, self.untrained)]
        ).reshape(-1, 2)
        found, code = np.unique(trained, axis=0, return_inverse=True)
        #: the buckets (latent grids) of the trainable samples; ``buckets`` indexes them
        self.grids: list[tuple[int, int]] = [(int(h), int(w)) for h, w in found]
        if len(found) > 255:
            raise ValueError(f"{len(found)} latent grids: at most 255 buckets are supported")
        self.buckets = code.reshape(-1).astype(np.uint8)
        # buffers hold the largest sample, held-out ones included
        self.max_cells = max((int(g.prod(1).max()) for g in every if len(g)), default=64)
        del every, trained, code
        first = self._shard(self.latents, self.partitions[0])
        if "scaling_factor" not in first.attrs:
            raise ValueError(
                f"{first.path}: attrs has no 'scaling_factor'; re-materialize vae_latents"
            )
        self.scaling_factor = float(first.attrs["scaling_factor"])
        #: the widths the DiT is built for: {"text": caption width, "repa": REPA target width}
        self.widths = self._agreed_widths()
        text0 = self._shard(self.text, self.partitions[0])
        self.null_tokens: np.ndarray | None = (
            np.asarray(text0["null_tokens"], np.float32) if "null_tokens" in text0 else None
        )
        if self.null_tokens is None:
            log.warning(
                "%s has no null_tokens (encoded empty prompt): caption dropout and CFG use a "
                "zero token; re-materialize text_embeddings to store it",
                text0.path,
            )

    def epoch_order(self, epoch: int, seed: int, window: int, chunk: int) -> np.ndarray:
        """:func:`epoch_order` of these partitions' trainable samples (with their buckets when
        there are several, in chunks of ``chunk``)."""
        multi = len(self.grids) > 1
        return epoch_order(
            self.sizes, epoch, seed, window, self.buckets if multi else None, chunk if multi else 0
        )

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader worker under ``spawn``): without open files; reopened there."""
        state = {**self.__dict__, "_open": OrderedDict(), "_tables": OrderedDict()}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def is_open(self, i: int) -> bool:
        """Whether partition ``i``'s arrays are open (in the cache)."""
        return i in self._open

    @property
    def kinds(self) -> list[str]:
        """The kinds read: latents, caption states and (with REPA) the DINO target."""
        return [self.latents, self.text, *([self.dino] if self.load_dino else [])]

    def _agreed_fingerprints(self) -> dict[str, dict[str, str]]:
        """Per kind and source (flowmatch_models.storage.layout.source_of), the one fingerprint hash of
        every partition; refuses a mix, naming the partitions that disagree and the fields they
        disagree on. Partitions of different sources agree on the kind's fields (their rows
        stages record their own source's settings). Shards without a fingerprint (made before
        them) are ``unknown``: trainable together, never with known ones."""
        out, self.fingerprint_of = {}, {}
        for kind in self.kinds:
            fps = {
                p: agreeing(kind, shard_fingerprint(self.layout, kind, p)) for p in self.partitions
            }
            why = disagreement(fps, source_of)
            if why:
                raise FingerprintMismatchError(
                    f"{kind}: partitions made with different settings: {why}. Training never "
                    "mixes fingerprints within one kind: re-make the stale ones (`flowmatch "
                    "stale` lists them, `flowmatch backfill --stale` re-runs them) or train on "
                    "partitions that agree"
                )
            self.fingerprint_of[kind] = {source_of(p): fp for p, fp in reversed(fps.items())}
            out[kind] = {s: hash_of(fp) for s, fp in self.fingerprint_of[kind].items()}
        return out

    def _agreed_widths(self) -> dict[str, int]:
        """Per model input with a width (``model_inputs``: ``text``, ``repa``), the one width
        of every partition's array."""
        out = {}
        for k in model_inputs().values():
            role, kind, array = k.model_input.width, k.name, k.model_input.array
            if role is None or kind not in self.kinds:
                continue
            widths = {p: array_width(self._shard(kind, p), array) for p in self.partitions}
            if len(set(widths.values())) > 1:
                raise FingerprintMismatchError(
                    f"{kind}.{array}: partitions of different widths {widths} (made by different "
                    "encoders); re-make them with one encoder"
                )
            out[role] = next(iter(widths.values()))
        return out

    def text_stats(self, max_tokens: int = 200_000) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std of the caption states: :func:`.text_stats.caption_stats`."""
        from flowmatch_models.data.text_stats import caption_stats

        return caption_stats(self, max_tokens)

    def mismatch(self, kind: str, fp: Fingerprint | None, partition: str) -> str | None:
        """Why ``partition``'s shard of ``kind`` with fingerprint ``fp`` does not belong with
        this source (a data source this run has no partition of yet: the kind's fields)."""
        fp, refs = agreeing(kind, fp), self.fingerprint_of[kind]
        if source_of(partition) not in refs:
            ref = next(iter(refs.values()))
            fp, ours = (Fingerprint(x.fields) if x else None for x in (fp, ref))
            if hash_of(fp) == hash_of(ours):
                return None
        elif hash_of(fp) == self.fingerprints[kind][source_of(partition)]:
            return None
        else:
            ours = refs[source_of(partition)]
        if fp is None or ours is None:
            return f"{kind}: fingerprint {hash_of(fp)} vs this run's {hash_of(ours)}"
        return f"{kind}: " + (
            "; ".join(diff(ours.fields, fp.fields)) or f"inputs {ours.inputs} -> {fp.inputs}"
        )

    @property
    def null_text(self) -> torch.Tensor | None:
        """The encoded empty prompt ``[L0, D]`` (float32) shared by every partition, or None."""
        return None if self.null_tokens is None else torch.from_numpy(self.null_tokens)

    def _shard(self, asset: str, partition: str) -> Shard:
        return read_shard(self.layout.asset_path(asset, partition))

    def _arrays(self, i: int) -> dict:
        """Row-readable arrays of partition ``i`` (views, codes, or arrays decoded whole when
        stored compressed); an LRU of ``cache_shards`` partitions. Safe from several threads:
        a partition is opened outside the lock (two threads may both open it; one is kept)."""
        with self._lock:
            if i in self._open:
                self._open.move_to_end(i)
                return self._open[i]
        p = self.partitions[i]
        vae, text = self._shard(self.latents, p), self._shard(self.text, p)
        shards = [vae, text]
        grids = sample_grids(vae)
        channels = int(vae.info("latents")["shape"][1])
        out = {
            "ids": vae.ids,
            "tokens": open_rows(text, "tokens"),
            "grids": grids,
            "latents": open_rows(vae, "latents", cells=True, width=channels),
        }
        out["lengths"] = np.asarray(text["lengths"]).astype(np.int64)
        out["offsets"] = ragged_offsets(out["lengths"])
        # a sample's latent cells and its DINO rows start at the same cell offset
        out["cells"] = ragged_offsets(grids.astype(np.int64).prod(1))
        #: per row what a plan needs, one take a partition: caption length, first token, first
        #: cell, latent grid (h, w); and the trainable rows (held-out ones left out)
        out["rows"] = np.stack(
            [out["lengths"], out["offsets"][:-1], out["cells"][:-1], *grids.astype(np.int64).T],
            axis=1,
        )
        out["train_rows"] = np.delete(np.arange(len(grids)), self.untrained[i])
        if self.load_dino:
            dino = self._shard(self.dino, p)
            shards.append(dino)
            out["patch"] = open_rows(dino, "patch", cells=True)
        # the versions read: their tables decode the codes (tables(); never by path alone)
        out["shards"] = dict(zip(self.kinds[1:], shards[1:]))
        out["table_keys"] = {
            key: out["shards"][k.name].table_key(a) if out[a].coded else None
            for key, k in model_inputs().items()
            if key in ("text", "dino") and (a := k.model_input.array) in out
        }
        for kind, s in zip(self.kinds, shards):
            why = self.mismatch(kind, Fingerprint.from_json(s.attrs.get(FINGERPRINT_ATTR)), p)
            if why:  # re-made while this run trains on it
                raise FingerprintMismatchError(
                    f"partition {p!r} was re-made with other settings during training ({why}); "
                    "training never mixes fingerprints within one kind: resume to start the "
                    "next epoch (data.grow skips it) or re-make every partition alike"
                )
        for s in shards[1:]:
            if s.ids != vae.ids:
                raise ValueError(
                    f"partition {p!r}: ids of {s.path.name} in {s.path.parent.name} differ from "
                    "vae_latents; re-materialize the partition's embedding assets"
                )
        null = text["null_tokens"] if "null_tokens" in text else None
        if (null is None) != (self.null_tokens is None) or (
            null is not None and not np.array_equal(np.asarray(null, np.float32), self.null_tokens)
        ):
            raise ValueError(
                f"partition {p!r}: its text_embeddings were made by another text encoder than "
                f"{self.partitions[0]!r}'s (the encoded empty prompts differ); re-materialize "
                "text_embeddings so that every partition uses the same encoder"
            )
        # a causal text encoder: every caption's first state is the null caption's (stored
        # lossy, it is put back exactly where the batch is decoded, as CFG and sampling feed it)
        out["first_null"] = null is not None and bool(text.attrs.get(FIRST_TOKEN_ATTR))
        sf = float(vae.attrs.get("scaling_factor", self.scaling_factor))
        if sf != self.scaling_factor:
            raise ValueError(f"partition {p!r}: scaling_factor {sf} != {self.scaling_factor}")
        with self._lock:
            out = self._open.setdefault(i, out)
            self._open.move_to_end(i)
            while len(self._open) > self.cache_shards:
                self._open.popitem(last=False)
        return out

    def heldout_batch(self, max_samples: int, latents: bool = True) -> StoredBatch | None:
        """The held-out samples (partition order, at most ``max_samples``) as one stored batch
        (of one bucket; ``latents=False``: their captions only, any buckets)."""
        pairs = self._heldout_pairs(max_samples)
        if not pairs:
            return None
        shard, rows = (np.array(x, np.int64) for x in zip(*pairs))
        return self.gather(shard, rows, latents=latents)

    def heldout_batches(self, max_samples: int) -> list[StoredBatch]:
        """The held-out samples (the first ``max_samples`` in partition order) as one stored
        batch per latent grid (bucket), by grid; each in partition order."""
        pairs = self._heldout_pairs(max_samples)
        if not pairs:
            return []
        shard, rows = (np.array(x, np.int64) for x in zip(*pairs))
        grids = np.array([self._arrays(int(s))["grids"][r] for s, r in pairs])
        out = []
        for g in np.unique(grids, axis=0):
            j = np.flatnonzero((grids == g).all(1))
            out.append(self.gather(shard[j], rows[j]))
        return out

    def _heldout_pairs(self, max_samples: int) -> list[tuple[int, int]]:
        return [(i, r) for i, rows in enumerate(self.heldout_rows) for r in rows][:max_samples]

    def plan(
        self, shard_idx: np.ndarray, rows: np.ndarray, latents: bool = True, train: bool = False
    ) -> BatchPlan:
        """The :class:`BatchPlan` of samples ``(shard_idx[j], rows[j])`` (:func:`plan_batch`:
        their partitions opened; ``train``: ``rows`` index each partition's trainable rows, the
        held-out ones skipped). The samples share one latent grid (one aspect-ratio bucket)
        unless ``latents`` is False (captions only, any buckets)."""
        return plan_batch(
            shard_idx, rows, self._arrays, self.text_max_len, self.fixed_text_len, latents, train
        )

    def read(
        self,
        plan: BatchPlan,
        out: dict | None = None,
        out_arrays: dict | None = None,
        io: ReadPool | None = None,
    ) -> StoredBatch:
        """The stored batch of ``plan`` (:func:`read_batch`). ``out``: buffers to fill (a
        :class:`BatchRing` slot, :meth:`buffers`; ``out_arrays`` their numpy views): the batch
        then leaves the tensors out (they are ``out``'s, cut by ``sizes``: :func:`slot_views`);
        else new buffers, whose views it holds. ``io``: :class:`ReadPool` threads for the
        reads that would wait on the disk."""
        buf = out or self.buffers(plan.b, plan.text_rows, plan.arrays[0])
        views = out_arrays or {k: v.numpy() for k, v in buf.items()}
        batch = read_batch(plan, views, self.partitions, self.load_dino, io)
        return batch if out is not None else {**slot_views(buf, batch["sizes"]), **batch}

    def gather(self, shard_idx: np.ndarray, rows: np.ndarray, latents: bool = True) -> StoredBatch:
        """The stored batch of samples ``(shard_idx[j], rows[j])`` in that order, in new
        buffers: :meth:`read` of :meth:`plan`; :meth:`decode` makes it model inputs."""
        return self.read(self.plan(shard_idx, rows, latents))

    def decode(self, batch: StoredBatch, device="cpu") -> DecodedBatch:
        """A stored batch as float32 model inputs on ``device`` (where its tensors are):
        :func:`decode_batch` with this source's tables (:meth:`tables`, on ``device``)."""
        return decode_batch(
            batch,
            lambda k, p, key: self.tables(k, p, device, key),
            self.scaling_factor,
            device,
            self.null_first(device),
        )

    def buffers(self, b: int, tokens: int, first: dict | None = None, shared: bool = False) -> dict:
        """Empty buffers for a stored batch of ``b`` samples and ``tokens`` caption tokens."""
        first = first or self._arrays(0)
        lat, text = first["latents"], first["tokens"]
        cells = b * self.max_cells  # the largest bucket's
        out = {
            "latents": empty_buffer((cells, *lat.row_shape), lat.dtype, shared),
            "mask": empty_buffer((b, self.text_max_len), np.bool_, shared),
            "text_rows": empty_buffer((tokens, *text.row_shape), text.dtype, shared),
            "text_dst": empty_buffer((tokens,), np.int64, shared),
        }
        if self.load_dino:
            dino = first["patch"]
            out["dino_rows"] = empty_buffer((cells, *dino.row_shape), dino.dtype, shared)
            out["dino_dst"] = empty_buffer((b,), np.int64, shared)
        return out

    def tables(
        self,
        kind: str,
        partition: str,
        device="cpu",
        key: str | None = None,
        shard: Shard | None = None,
    ) -> transform_codec.DeviceTables:
        """The decoding tables of ``kind``'s coded model input in ``partition`` as tensors on
        ``device`` (small; the newest 64 kept), by their :meth:`~Shard.table_key` ``key`` (the
        version of the file the codes were read from; None: the file on disk now). Found in
        ``shard``, in this process's open version of the partition, else in the file on disk;
        a file re-made since the codes were read raises :class:`PartitionChangedError`. The
        tables are checked by their checksums; the codes are not re-hashed (see :func:`open_rows`)."""
        array = KINDS[kind].model_input.array
        if key is not None and (kind, key, str(device)) in self._tables:
            self._tables.move_to_end((kind, key, str(device)))
            return self._tables[(kind, key, str(device))]
        with self._lock:
            opened = [
                a["shards"].get(kind)
                for i, a in self._open.items()
                if self.partitions[i] == partition
            ]
        found = None
        for s in [shard, *opened]:
            if s is not None and (key is None or s.table_key(array) == key):
                found = s
                break
        found = found or self._shard(kind, partition)
        have = found.table_key(array)
        if key is not None and have != key:
            raise PartitionChangedError(
                f"partition {partition!r}: its {kind} file was re-made while this run read it "
                f"(the batch's codes are of tables {key}, the file now has {have}); a batch is "
                "never decoded with another file's tables: resume (--resume auto) to go on "
                "from the last checkpoint with the new file"
            )
        cache = (kind, have, str(device))
        if cache not in self._tables:
            tables = found.coded(array, verify=False).tables
            self._tables[cache] = transform_codec.DeviceTables.of(tables, device)
            while len(self._tables) > 64:
                self._tables.popitem(last=False)
        self._tables.move_to_end(cache)
        return self._tables[cache]

    def null_first(self, device="cpu") -> torch.Tensor | None:
        """The null caption's first state (float32 ``[D]``) on ``device``, cached: what a
        causal text encoder's first state of every caption is (``text_first_null``)."""
        if self.null_tokens is None:
            return None
        if getattr(self, "_null_first", (None,))[0] != str(device):
            self._null_first = (str(device), torch.from_numpy(self.null_tokens[0]).to(device))
        return self._null_first[1]
