"""Training data: batches of (scaled latents, DINOv2 patches, padded captions) from the store.

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
import os
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
import xxhash
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from flowmatch_models import transform_codec
from flowmatch_models.embeddings import FIRST_TOKEN_ATTR
from flowmatch_models.fingerprint import ATTR as FINGERPRINT_ATTR
from flowmatch_models.fingerprint import Fingerprint, diff, disagreement, hash_of
from flowmatch_models.layout import DataLayout, source_of
from flowmatch_models.store import Shard, StoreError, ragged_offsets, read_shard

log = logging.getLogger(__name__)


#: What the DiT reads of the registry's kinds: its caption states and its REPA target, as
#: ``(kind, array)``. The model's ``text_dim``/``repa_dim`` are these arrays' widths in the shards
#: the run trains on (:attr:`ShardSource.widths`), so an encoder swaps by configuration alone.
MODEL_INPUTS = {"text": ("text_embeddings", "tokens"), "repa": ("dino_features", "patch")}

#: The definition of the sample order (:func:`epoch_order` + :class:`BatchStream`'s split over
#: ranks and workers), recorded in every checkpoint's data state: a resume under another
#: definition stops and names both (checkpoints without it used this one).
ORDER = "window-v1"


def array_width(shard: Shard, array: str) -> int:
    """The last dimension of ``array`` in ``shard`` (from its header; nothing decoded)."""
    return int(shard.info(array)["shape"][-1])


class OrderChangedError(ValueError):
    """A resume whose order-defining settings differ from the checkpoint's."""


class FingerprintMismatchError(ValueError):
    """Partitions of one embedding kind made by different settings (fingerprints)."""


class PartitionChangedError(RuntimeError):
    """A partition's file was re-made while a batch read from the old one was on its way: its
    codes would be decoded with another file's tables. The run stops (it never trains on it)."""


def shard_fingerprint(layout: DataLayout, kind: str, partition: str) -> Fingerprint | None:
    """The fingerprint in a shard's attrs (None: made before fingerprints, or unreadable)."""
    try:
        attrs = read_shard(layout.asset_path(kind, partition)).attrs
    except (OSError, StoreError):
        return None
    return Fingerprint.from_json(attrs.get(FINGERPRINT_ATTR))


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


def train_rows(ids: Sequence[str], fraction: float, cap: int) -> np.ndarray:
    """The rows of a partition that training uses: all but :func:`heldout_rows`."""
    keep = np.ones(len(ids), bool)
    keep[heldout_rows(ids, fraction, cap)] = False
    return np.flatnonzero(keep).astype(np.int64)


class ShardSource:
    """The partitions' three aligned shards (latents, DINO, text), opened lazily and cached.

    Rows are read from the files, never whole partitions: raw arrays (codec ``none``) and
    transform-coded ones (lossy ``pcaB``, the default storage) are read row by row with
    ``pread`` straight into the batch's buffers (:class:`FileRows`): the process maps nothing
    of the files and keeps no decoded partition, so a loader's memory is its batches, whatever
    the partition size, window or worker count (the OS page cache holds the files). Arrays
    stored compressed (``zstd``/``xz``, or int8/fp8) cannot be read by row: they are decoded
    whole per partition (``cache_shards`` partitions kept; memory grows with them).

    A batch comes out *stored* (:meth:`gather` with ``decode=False``: fp16 latents, codes of
    coded arrays, the partitions whose tables decode them) or decoded to float32 model inputs
    (:func:`decode_batch`, on any device: the GPU in training).

    ``heldout = (fraction, cap)`` holds out :func:`heldout_rows` of every partition: ``sizes``
    count the trainable rows, :meth:`gather_train` maps a trainable index to its row and
    :meth:`heldout_batch` serves the held-out ones (validation, FD)."""

    def __init__(
        self,
        root: str | Path,
        partitions: Sequence[str],
        text_max_len: int = 128,
        load_dino: bool = True,
        cache_shards: int = 4,
        fixed_text_len: bool = False,
        heldout: tuple[float, int] = (0.0, 0),
    ):
        self.layout = DataLayout(root)
        self.heldout = (float(heldout[0]), int(heldout[1]))
        self.fixed_text_len = fixed_text_len  # pad every batch to text_max_len (torch.compile)
        self.partitions = list(partitions)
        if not self.partitions:
            raise ValueError(
                f"no complete partitions under {self.layout.root}: training needs vae_latents, "
                "dino_features and text_embeddings for the same partition; materialize them first"
            )
        self.text_max_len = text_max_len
        self.load_dino = load_dino
        self.cache_shards = max(1, cache_shards)
        self._open: OrderedDict[int, dict] = OrderedDict()
        self._tables: OrderedDict[tuple[str, str, str], transform_codec.DeviceTables] = (
            OrderedDict()
        )
        #: kind -> the fingerprint hash every partition of this source shares
        self.fingerprints = self._agreed_fingerprints()
        ids = [self._shard("vae_latents", p).ids for p in self.partitions]
        self.heldout_rows = [heldout_rows(i, *self.heldout) for i in ids]
        self.sizes = np.array(
            [len(i) - len(h) for i, h in zip(ids, self.heldout_rows)], dtype=np.int64
        )
        del ids  # 10k strings a partition: not kept (nor copied into every worker)
        # every trainable sample's bucket: an index into ``grids``, the (h, w) latent grids
        # found (one byte a sample: 12 MB for PD12M, beside the order)
        every = [sample_grids(self._shard("vae_latents", p)) for p in self.partitions]
        trained = np.concatenate(
            [np.delete(g, h, axis=0) for g, h in zip(every, self.heldout_rows)]
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
        first = self._shard("vae_latents", self.partitions[0])
        if "scaling_factor" not in first.attrs:
            raise ValueError(
                f"{first.path}: attrs has no 'scaling_factor'; re-materialize vae_latents"
            )
        self.scaling_factor = float(first.attrs["scaling_factor"])
        #: the widths the DiT is built for: {"text": caption width, "repa": REPA target width}
        self.widths = self._agreed_widths()
        text0 = self._shard("text_embeddings", self.partitions[0])
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
        return epoch_order(self.sizes, epoch, seed, window, self.buckets if multi else None,
                           chunk if multi else 0)  # fmt: skip

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader worker under ``spawn``): without open files; reopened there."""
        return {**self.__dict__, "_open": OrderedDict(), "_tables": OrderedDict()}

    @property
    def kinds(self) -> list[str]:
        return ["vae_latents", "text_embeddings", *(["dino_features"] if self.load_dino else [])]

    def _agreed_fingerprints(self) -> dict[str, dict[str, str]]:
        """Per kind and source (flowmatch_models.layout.source_of), the one fingerprint hash of
        every partition; refuses a mix, naming the partitions that disagree and the fields they
        disagree on. Partitions of different sources agree on the kind's fields (their rows
        stages record their own source's settings). Shards without a fingerprint (made before
        them) are ``unknown``: trainable together, never with known ones."""
        out, self.fingerprint_of = {}, {}
        for kind in self.kinds:
            fps = {p: shard_fingerprint(self.layout, kind, p) for p in self.partitions}
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
        """Per model input (:data:`MODEL_INPUTS`), the one width of every partition's array."""
        out = {}
        for role, (kind, array) in MODEL_INPUTS.items():
            if role == "repa" and not self.load_dino:
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
        """Per-channel mean and std of the caption states (``text_embeddings.tokens``) over the
        first partitions, up to ``max_tokens`` tokens (float64 sums): the caption
        standardisation of ``model.text_norm``."""
        total = count = sq = None
        n, chunk = 0, 16_384
        for p in self.partitions:
            shard = self._shard("text_embeddings", p)
            tokens = _rows(shard, "tokens")
            rows = min(tokens.shape[0], max_tokens - n)
            dev = tokens.coded and self.tables("text_embeddings", p, key=shard.table_key("tokens"),
                                               shard=shard)  # fmt: skip
            # a causal encoder's first states: the null caption's, as training decodes them
            firsts = (ragged_offsets(np.asarray(shard["lengths"]))[:-1]
                      if shard.attrs.get(FIRST_TOKEN_ATTR) and self.null_tokens is not None
                      else np.zeros(0, np.int64))  # fmt: skip
            for a in range(0, rows, chunk):
                part = torch.from_numpy(np.empty((min(chunk, rows - a), *tokens.row_shape),
                                                 tokens.dtype))  # fmt: skip
                tokens.read([a], len(part), part, [0])
                t = (transform_codec.decode(part, dev) if dev else part.float()).double().numpy()
                at = firsts[(firsts >= a) & (firsts < a + len(t))] - a
                if len(at):
                    t[at] = self.null_tokens[0]
                total = t.sum(0) if total is None else total + t.sum(0)
                sq = (t**2).sum(0) if sq is None else sq + (t**2).sum(0)
            n += rows
            if n >= max_tokens:
                break
        count = max(n, 1)
        mean = total / count
        std = np.sqrt(np.maximum(sq / count - mean**2, 0.0))
        return torch.from_numpy(mean).float(), torch.from_numpy(std).float()

    def mismatch(self, kind: str, fp: Fingerprint | None, partition: str) -> str | None:
        """Why ``partition``'s shard of ``kind`` with fingerprint ``fp`` does not belong with
        this source (a data source this run has no partition of yet: the kind's fields)."""
        refs = self.fingerprint_of[kind]
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
        stored compressed); an LRU of ``cache_shards`` partitions."""
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        p = self.partitions[i]
        vae, text = self._shard("vae_latents", p), self._shard("text_embeddings", p)
        shards = [vae, text]
        grids = sample_grids(vae)
        channels = int(vae.info("latents")["shape"][1])
        out = {"ids": vae.ids, "tokens": _rows(text, "tokens"), "grids": grids,
               "latents": _rows(vae, "latents", cells=True, width=channels)}  # fmt: skip
        out["lengths"] = np.asarray(text["lengths"]).astype(np.int64)
        out["offsets"] = ragged_offsets(out["lengths"])
        # a sample's latent cells and its DINO rows start at the same cell offset
        out["cells"] = ragged_offsets(grids.astype(np.int64).prod(1))
        if self.load_dino:
            dino = self._shard("dino_features", p)
            shards.append(dino)
            out["patch"] = _rows(dino, "patch", cells=True)
        # the versions read: their tables decode the codes (tables(); never by path alone)
        out["shards"] = dict(zip(self.kinds[1:], shards[1:]))
        out["table_keys"] = {
            key: out["shards"][kind].table_key(array) if out[rows].coded else None
            for key, (kind, array, rows) in _INPUTS.items() if rows in out
        }  # fmt: skip
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
        self._open[i] = out
        while len(self._open) > self.cache_shards:
            self._open.popitem(last=False)
        return out

    def gather_train(self, shard_idx: np.ndarray, local: np.ndarray, decode: bool = True) -> dict:
        """:meth:`gather` of trainable samples: ``local[j]`` indexes partition
        ``shard_idx[j]``'s trainable rows (all rows when nothing is held out)."""
        return self.gather(shard_idx, self.train_to_rows(shard_idx, local), decode=decode)

    def train_to_rows(self, shard_idx: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Rows of the trainable indices ``local`` (held-out rows skipped)."""
        rows = np.asarray(local, np.int64).copy()
        for s in np.unique(shard_idx):
            h = self.heldout_rows[int(s)]
            if len(h):
                j = shard_idx == s
                rows[j] += np.searchsorted(h - np.arange(len(h)), rows[j], side="right")
        return rows

    def heldout_batch(self, max_samples: int, latents: bool = True) -> dict | None:
        """The held-out samples (partition order, at most ``max_samples``) as one batch (of one
        bucket; ``latents=False``: their captions only, any buckets)."""
        pairs = self._heldout_pairs(max_samples)
        if not pairs:
            return None
        shard, rows = (np.array(x, np.int64) for x in zip(*pairs))
        return self.gather(shard, rows, latents=latents)

    def heldout_batches(self, max_samples: int) -> list[dict]:
        """The held-out samples (the first ``max_samples`` in partition order) as one batch per
        latent grid (bucket), by grid; each in partition order."""
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

    def gather(
        self,
        shard_idx: np.ndarray,
        rows: np.ndarray,
        decode: bool = True,
        out: dict | None = None,
        latents: bool = True,
    ) -> dict:
        """Batch of samples ``(shard_idx[j], rows[j])`` in that order; text padded to the
        batch's longest caption, or to ``text_max_len`` with ``fixed_text_len``. ``decode``:
        float32 model inputs on the host (:func:`decode_batch`); else the stored batch:

        - ``latents`` fp16 ``[B, ...]`` (unscaled), ``mask`` ``[B, W]``, ``ids``, ``shard``;
        - per coded-or-not input (``text``, ``dino``): ``<key>_rows`` — the stored rows of
          the batch grouped by partition (text: only its valid tokens, ragged; codes, or fp16
          values), ``<key>_dst`` — where each row goes in the flat padded ``[B * W]`` (text) or
          ``[B]`` (DINO) batch, ``<key>_counts`` — rows per group;
        - ``parts``: the partition of each group (whose tables decode its codes).

        Each sample's rows are read with one ``pread`` per array straight from the files into
        the buffers (:class:`FileRows`): no padding or decoding on the host. ``out``: buffers
        to fill (a :class:`BatchRing` slot, :meth:`buffers`), else new ones.

        The samples share one latent grid ``(h, w)`` (one aspect-ratio bucket; ``sizes["grid"]``):
        ``latents`` ``[B, 32, h, w]`` and DINO rows ``[B, h*w, ...]``, each sample's cells read
        as one run from its cell offset. ``latents=False``: captions only (any buckets)."""
        shard_idx = np.asarray(shard_idx, np.int64)
        rows = np.asarray(rows, np.int64)
        groups = [(int(s), np.flatnonzero(shard_idx == s)) for s in np.unique(shard_idx)]
        arrays = {s: self._arrays(s) for s, _ in groups}
        lengths = [np.minimum(arrays[s]["lengths"][rows[j]], self.text_max_len) for s, j in groups]
        width = max(int(n.max(initial=1)) for n in lengths)
        width = self.text_max_len if self.fixed_text_len else max(1, width)
        b, first = len(rows), arrays[groups[0][0]]
        grids = np.unique(np.concatenate([arrays[s]["grids"][rows[j]] for s, j in groups]), axis=0)
        if latents and len(grids) > 1:
            raise ValueError(
                f"a batch of samples of {len(grids)} latent grids "
                f"({', '.join(f'{h}x{w}' for h, w in grids)}): a batch is of one bucket "
                "(epoch_order keeps them so; heldout_batches groups by bucket)"
            )
        gh, gw = (int(x) for x in grids[0])
        cells = gh * gw
        counts = [int(n.sum()) for n in lengths]
        buf = out or self.buffers(b, sum(counts), first)
        text_dst, mask = buf["text_dst"].numpy(), buf["mask"].numpy()[:b, :width]
        mask[:] = False
        ids: list[str] = [""] * b
        t0 = d0 = 0
        for (s, j), n, c in zip(groups, lengths, counts):
            a, r = arrays[s], rows[j]
            if latents:  # a sample's cells are one run of rows in both layouts
                a["latents"].read(a["cells"][r], cells, buf["latents"], j * cells)
            # the valid tokens of each selected caption, in order, then where they go
            a["tokens"].read(a["offsets"][r], n, buf["text_rows"], t0 + np.cumsum(n) - n)
            within = np.arange(c) - np.repeat(np.cumsum(n) - n, n)
            text_dst[t0 : t0 + c] = np.repeat(j * width, n) + within
            mask[np.repeat(j, n), within] = True
            if self.load_dino and latents:
                dst = (d0 + np.arange(len(r))) * cells
                a["patch"].read(a["cells"][r], cells, buf["dino_rows"], dst)
                buf["dino_dst"].numpy()[d0 : d0 + len(r)] = j
            ids_p = a["ids"]
            for jj, rr in zip(j.tolist(), r.tolist()):
                ids[jj] = ids_p[rr]
            t0, d0 = t0 + c, d0 + len(r)
        sizes = {"b": b, "width": width, "text": t0, "grid": (gh, gw) if latents else None}
        out_batch = {
            **slot_views(buf, sizes),
            "ids": ids,
            "shard": shard_idx,  # host bookkeeping (a tensor would cost a shared-memory segment)
            "parts": [self.partitions[s] for s, _ in groups],
            "coded": [
                k
                for k, v in (("text", first["tokens"]), ("dino", first.get("patch")))
                if v is not None and v.coded
            ],  # fmt: skip
            "text_counts": counts,
            # the tables of the file versions these rows were read from, per group
            "text_tables": [arrays[s]["table_keys"]["text"] for s, _ in groups],
            # per group: its captions' first state is the null caption's (exact on decode)
            "text_first_null": [arrays[s]["first_null"] for s, _ in groups],
            **({"dino_counts": [len(j) for _, j in groups],
                "dino_tables": [arrays[s]["table_keys"]["dino"] for s, _ in groups]}
               if self.load_dino and latents else {}),
            "sizes": sizes,
        }  # fmt: skip
        if decode:
            tables = lambda k, p, key: self.tables(k, p, "cpu", key)  # noqa: E731
            return decode_batch(out_batch, tables, self.scaling_factor, "cpu", self.null_first())
        return out_batch

    def buffers(self, b: int, tokens: int, first: dict | None = None, shared: bool = False) -> dict:
        """Empty buffers for a stored batch of ``b`` samples and ``tokens`` caption tokens."""
        first = first or self._arrays(0)
        lat, text = first["latents"], first["tokens"]
        cells = b * self.max_cells  # the largest bucket's
        out = {
            "latents": _buffer((cells, *lat.row_shape), lat.dtype, shared),
            "mask": _buffer((b, self.text_max_len), np.bool_, shared),
            "text_rows": _buffer((tokens, *text.row_shape), text.dtype, shared),
            "text_dst": _buffer((tokens,), np.int64, shared),
        }
        if self.load_dino:
            dino = first["patch"]
            out["dino_rows"] = _buffer((cells, *dino.row_shape), dino.dtype, shared)
            out["dino_dst"] = _buffer((b,), np.int64, shared)
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
        tables are checked by their checksums; the codes are not re-hashed (see :func:`_rows`)."""
        array = {k: a for k, a in MODEL_INPUTS.values()}[kind]
        if key is not None and (kind, key, str(device)) in self._tables:
            self._tables.move_to_end((kind, key, str(device)))
            return self._tables[(kind, key, str(device))]
        opened = [a["shards"].get(kind) for i, a in self._open.items()
                  if self.partitions[i] == partition]  # fmt: skip
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


def _rows(shard: Shard, name: str, cells: bool = False, width: int | None = None):
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


def _buffer(shape: tuple[int, ...], dtype, shared: bool) -> torch.Tensor:
    """An empty tensor to fill from the files (in shared memory for a :class:`BatchRing`)."""
    t = torch.from_numpy(np.empty(shape, np.dtype(dtype)))
    return t.share_memory_() if shared and t.numel() else t


def slot_views(buf: dict, sizes: dict) -> dict:
    """The stored batch's tensors: views of ``buf`` cut to the batch's ``sizes``."""
    b, width, n = sizes["b"], sizes["width"], sizes["text"]
    out = {
        "mask": buf["mask"][:b, :width],
        "text_rows": buf["text_rows"][:n],
        "text_dst": buf["text_dst"][:n],
    }
    if sizes.get("grid") is None:  # captions only
        return out
    gh, gw = sizes["grid"]
    c = gh * gw
    lat = buf["latents"]  # [cells, 32]: each sample's [32, h, w] values back to back
    out["latents"] = lat[: b * c].view(b, lat.shape[1], gh, gw)
    if "dino_rows" in buf:
        rows = buf["dino_rows"]
        out["dino_rows"] = rows[: b * c].view(b, c, *rows.shape[1:])
        out["dino_dst"] = buf["dino_dst"][:b]
    return out


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

    def __init__(self, source: ShardSource, batch_size: int, workers: int, slots_per_worker: int):
        self.workers, self.slots = max(1, workers), slots_per_worker
        tokens = batch_size * source.text_max_len
        n = self.workers * self.slots
        self.buffers = [source.buffers(batch_size, tokens, shared=True) for _ in range(n)]
        self.seq = torch.full((n,), -1, dtype=torch.int64).share_memory_()
        self._held: tuple[int, int] | None = None
        self.nbytes = sum(t.nbytes for buf in self.buffers for t in buf.values())

    def slot(self, worker: int, count: int) -> int:
        """The slot of a worker's ``count``-th batch."""
        return worker * self.slots + count % self.slots

    def open(self, item: dict) -> dict:
        """The stored batch of a worker's hand-over ``item`` (views of the slot)."""
        slot, seq = item.pop("slot"), item.pop("seq")
        if self._held is not None and int(self.seq[self._held[0]]) != self._held[1]:
            raise RuntimeError(
                f"loader slot {self._held[0]} was refilled while batch {self._held[1]} was in "
                "use; the ring is too small for this DataLoader's prefetching"
            )
        if int(self.seq[slot]) != seq:
            raise RuntimeError(f"loader slot {slot} holds batch {int(self.seq[slot])}, not {seq}")
        self._held = (slot, seq)
        return {**slot_views(self.buffers[slot], item["sizes"]), **item}


class RingLoader(DataLoader):
    """A DataLoader whose workers fill a :class:`BatchRing`: iterating it yields the batches
    as views of the ring (opened in the main process)."""

    def __init__(self, stream: BatchStream, ring: BatchRing, **kwargs):
        super().__init__(stream, batch_size=None, **kwargs)
        self.ring = ring

    def __iter__(self):
        for item in super().__iter__():
            yield self.ring.open(item)


#: model input -> the store kind whose tables decode its codes
_CODED = {"text": "text_embeddings", "dino": "dino_features"}
#: model input -> (kind, array, the key of its rows in ShardSource._arrays)
_INPUTS = {"text": ("text_embeddings", "tokens", "tokens"),
           "dino": ("dino_features", "patch", "patch")}  # fmt: skip


def decode_batch(
    batch: dict, tables, scaling_factor: float, device, null_first: torch.Tensor | None = None
) -> dict:
    """A stored batch (:meth:`ShardSource.gather` with ``decode=False``) as float32 model inputs
    on ``device``: latents scaled; each group's text/DINO rows decoded with the tables of the
    file they were read from (``tables(kind, partition, key)`` ->
    :class:`~flowmatch_models.transform_codec.DeviceTables` on ``device``,
    :meth:`ShardSource.tables`; ``key``: the batch's ``<input>_tables``), or fp16 rows widened,
    then put in place (``index_copy_`` to ``<key>_dst``; text padding stays zero); the first
    caption state of a group flagged in ``text_first_null`` is ``null_first`` exactly (a
    causal encoder's, :data:`~flowmatch_models.embeddings.FIRST_TOKEN_ATTR`). Tensors already
    on ``device`` stay there; nothing here waits on the device."""
    if "text_rows" not in batch:
        return batch  # decoded already
    out = {k: v for k, v in batch.items() if not k.startswith(("text_", "dino_"))}
    for k in ("parts", "coded", "sizes"):
        out.pop(k, None)
    if "latents" in batch:
        out["latents"] = batch["latents"].to(device).float() * scaling_factor
    mask = batch["mask"].to(device)
    out["mask"] = mask
    b, width = mask.shape

    for key in ("text", "dino"):
        if f"{key}_rows" not in batch:
            continue
        rows = batch[f"{key}_rows"].to(device)
        if key in batch["coded"]:
            parts, start = [], 0
            keys = batch.get(f"{key}_tables") or [None] * len(batch["parts"])
            for p, n, k in zip(batch["parts"], batch[f"{key}_counts"], keys):
                parts.append(
                    transform_codec.decode(rows[start : start + n], tables(_CODED[key], p, k))
                )
                start += n
            values = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:
            values = rows.float()
        lead = (b * width,) if key == "text" else (b,)
        x = torch.zeros((*lead, *values.shape[1:]), device=values.device)
        dst = batch[f"{key}_dst"].to(device)
        flags = batch.get("text_first_null") if key == "text" else None
        if flags and any(flags):  # a caption's first row goes to position 0 of its sample
            if null_first is None:
                raise ValueError("a batch with exact first states needs null_first")
            first = dst % width == 0
            if not all(flags):  # partitions stored before the flag: as stored
                first &= torch.cat([torch.full((n,), f, dtype=torch.bool, device=dst.device)
                                    for f, n in zip(flags, batch["text_counts"])])  # fmt: skip
            values = torch.where(first[:, None], null_first.to(values.device), values)
        x.index_copy_(0, dst, values)
        out[key] = x.view(b, width, -1) if key == "text" else x
    return out


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


class BatchStream(IterableDataset):
    """This rank's batches from ``(start_epoch, start_sample)`` on: endless, or to the end of
    ``end_epoch`` (the data module streams one epoch per loader, so that the next epoch's
    partition set can be decided at the boundary)."""

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
        decode: bool = True,
        ring: BatchRing | None = None,
        bucket_chunk: int = 256,
    ):
        self.source, self.batch_size, self.seed = source, batch_size, seed
        #: samples of several buckets: chunks of this many, one bucket each (epoch_order)
        self.chunk = bucket_chunk if len(source.grids) > 1 else 0
        self.decode = decode  # False: stored batches, decoded where they go (decode_batch)
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
            self._order = (epoch, self.source.epoch_order(epoch, self.seed, self.window,
                                                          self.chunk))  # fmt: skip
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

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        order_epoch, order, produced = -1, None, 0
        # The DataLoader asks worker k % nw for the k-th batch of the whole iterator (not of the
        # epoch), so worker w takes items w, w + nw, ... of one global sequence across epochs.
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
            w = int(np.searchsorted(ends, g0, side="right"))
            if w + 1 < len(windows):
                start = ends[w - 1] if w else 0
                due = int((g0 - start) / max(ends[w] - start, 1) * (len(windows[w + 1]) + 1))
                todo = [int(p) for p in windows[w + 1][:due] if int(p) not in self.source._open]
                if todo:
                    self.source._arrays(todo[0])
            lo = g0 + self.rank * self.batch_size
            idx = order[lo : lo + self.batch_size]
            shard = np.searchsorted(self.starts, idx, side="right") - 1
            local = idx - self.starts[shard]
            if self.ring is not None:
                slot = self.ring.slot(wid, produced)
                buf = self.ring.buffers[slot]
                batch = self.source.gather(
                    shard, self.source.train_to_rows(shard, local), decode=False, out=buf
                )
                batch = {k: v for k, v in batch.items() if k not in buf}  # the ring holds those
                self.ring.seq[slot] = k
                batch.update(slot=slot, seq=k)
            else:
                batch = self.source.gather_train(shard, local, self.decode)
            produced += 1
            # bookkeeping as host values beside the tensors: the module takes it off the batch
            # before the transfer, so reading it never waits on the device
            batch["meta"] = {"epoch": int(epoch), "position": int(g0),
                             "global_batch": int(self.global_batch), "ids": batch.pop("ids"),
                             "shard": batch.pop("shard")}  # fmt: skip
            yield batch


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
    ):
        super().__init__()
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
        self.shuffle_window, self.text_max_len, self.load_dino = (
            shuffle_window,
            text_max_len,
            load_dino,
        )
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

    def _open(self, partitions: list[str]) -> ShardSource:
        return ShardSource(
            self.root, partitions, self.text_max_len, self.load_dino, 2 * self.shuffle_window + 1,
            fixed_text_len=self.fixed_text_len, heldout=self.heldout,
        )  # fmt: skip

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
        complete = DataLayout(self.root).complete_partitions()
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            complete = trainer.strategy.broadcast(complete, src=0)
        found = complete if self.grow else (self.fixed or self._initial)
        self._available = complete
        self._skipped = self._other_fingerprints(found) if self.grow else {}
        if self._skipped:
            found = [p for p in found if p not in self._skipped]
            log.warning(
                "epoch %d: skipping %d partitions made with other settings than this run's "
                "(training never mixes fingerprints within one kind): %s", self.epoch,
                len(self._skipped), "; ".join(f"{p} ({w})" for p, w in list(self._skipped.items())[:5]),
            )  # fmt: skip
        if found and found != self.partitions:
            new = sorted(set(found) - set(self.partitions))
            gone = sorted(set(self.partitions) - set(found))
            log.warning(
                "epoch %d: %d partitions (%s%s)", self.epoch, len(found),
                f"+{len(new)} new: {', '.join(new[:5])}" if new else "",
                f" -{len(gone)} gone: {', '.join(gone[:5])}" if gone else "",
            )  # fmt: skip
            self.partitions, self.source, self._orders = list(found), self._open(found), {}
            for p in found:
                self.trained_counts.setdefault(p, 0)

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

    def train_dataloader(self) -> DataLoader:
        self._decide_epoch()
        rank, world = self._rank_world()
        g = self.batch_size * world
        if len(self.source.grids) > 1 and self.position % g:
            # an elastic resume with a larger global batch: its batches are one bucket only on
            # its own multiples (chunk boundaries are); the samples up to the next are left for
            # the next epoch (the ledger's segment starts there)
            skip = g - self.position % g
            log.warning("epoch %d: position %d is not a multiple of the global batch %d; "
                        "starting at %d (%d samples of this epoch skipped to keep batches one "
                        "bucket)", self.epoch, self.position, g, self.position + skip, skip)  # fmt: skip
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
            decode=False,  # codes travel to the device; decode_batch runs there
            bucket_chunk=self.bucket_chunk,
        )
        prefetch = 4 if self.num_workers > 0 else None
        trainer = getattr(self, "trainer", None)
        self.ledger.append(
            {
                "epoch": self.epoch,
                "partitions": list(self.partitions),
                "sizes": [int(n) for n in self.source.sizes],
                "seed": self.seed,
                "shuffle_window": self.shuffle_window,
                "heldout": list(self.heldout),
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
        # a ring of reusable shared buffers: batches are neither copied between processes
        # nor written to fresh memory (sized for the longest batch; memory as logged)
        stream.ring = BatchRing(self.source, self.batch_size, self.num_workers, (prefetch or 0) + 3)
        log.info("loader: %d workers, %d batch buffers, %.0f MB", self.num_workers,
                 len(stream.ring.buffers), stream.ring.nbytes / 1e6)  # fmt: skip
        return RingLoader(
            stream, stream.ring, num_workers=self.num_workers, prefetch_factor=prefetch,
            persistent_workers=False,
        )  # fmt: skip

    def decode_batch(self, batch: dict, device) -> dict:
        """A stored training batch as float32 model inputs on ``device`` (where it was moved):
        codes decoded with the tables of the file versions they were read from
        (:meth:`ShardSource.tables`, on ``device``)."""
        src = self.source
        return decode_batch(
            batch, lambda k, p, key: src.tables(k, p, device, key), src.scaling_factor, device,
            src.null_first(device),
        )  # fmt: skip

    def _available_counts(self) -> dict:
        """Partitions and trainable samples (held-out ones excluded, as in ``sizes``) complete
        at the epoch's start (beside those used)."""
        avail = self._available if self._available is not None else self.partitions
        if set(avail) == set(self.partitions):
            samples = int(self.source.sizes.sum())
        else:
            layout = DataLayout(self.root)
            samples = sum(
                len(train_rows(read_shard(layout.asset_path("vae_latents", p)).ids, *self.heldout))
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
            self._orders = {epoch: self.source.epoch_order(epoch, self.seed, self.shuffle_window,
                                                           self.bucket_chunk)}  # fmt: skip
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
            "partitions": list(self.partitions),
            "trained_counts": dict(self.trained_counts),
            "ledger": [dict(s) for s in self.ledger if s["pos_to"] > s["pos_from"]],
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
        ours = {"seed": self.seed, "shuffle_window": self.shuffle_window,
                "heldout": [float(x) for x in self.heldout]}  # fmt: skip
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
            # mid-epoch: finish the epoch on its recorded partition set, exactly
            if theirs != self.partitions:
                self.partitions, self.source, self._orders = theirs, self._open(theirs), {}
            self.epoch, self.position = epoch, position
            self._decided_epoch = epoch
            return
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
