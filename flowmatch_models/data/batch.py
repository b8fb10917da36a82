"""A batch in two steps: its plan (which rows of which opened partitions, where each goes) and
the reads that fill buffers from the files (a stored batch); decoding is its caller's
(:func:`~flowmatch_models.data.decode.decode_batch`, on the device in training)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch

from flowmatch_models.data.rows import ReadPool, read_rows


class BatchSizes(TypedDict):
    """What a stored batch fills of its buffers: ``b`` samples, captions padded to ``width``,
    ``text`` caption rows, latent ``grid`` (h, w) (None: captions only)."""

    b: int
    width: int
    text: int
    grid: tuple[int, int] | None


class StoredBatch(TypedDict, total=False):
    """A batch as stored (what :meth:`ShardSource.read` returns; decoded by
    :func:`~flowmatch_models.data.decode.decode_batch`). A dict, because a :class:`BatchRing`
    worker hands over only the small fields and the main process adds the tensors as views of
    the slot (``slot_views``), and Lightning moves it to the device as one."""

    #: the tensors (views of the buffers, cut by ``sizes``): fp16 latents ``[B, 32, h, w]``
    #: (unscaled), caption mask ``[B, width]``; per input (``text``, ``dino``) its stored rows
    #: grouped by partition (codes, or fp16 values; text: only the valid tokens) and where each
    #: row goes in the flat padded ``[B * width]`` (text) or ``[B]`` (DINO) batch
    latents: torch.Tensor
    mask: torch.Tensor
    text_rows: torch.Tensor
    text_dst: torch.Tensor
    dino_rows: torch.Tensor
    dino_dst: torch.Tensor
    #: host bookkeeping: every sample's id and partition index (batch order)
    ids: list[str]
    shard: np.ndarray
    #: per group (the samples of one partition): its partition, rows of each input, the table
    #: keys of the file versions read (decoded with those tables only), first-state flag
    parts: list[str]
    coded: list[str]
    text_counts: list[int]
    text_tables: list[str | None]
    text_first_null: list[bool]
    dino_counts: list[int]
    dino_tables: list[str | None]
    sizes: BatchSizes


class DecodedBatch(TypedDict, total=False):
    """A batch as the model reads it: float32 scaled ``latents``, ``text`` ``[B, W, D]``,
    ``mask`` ``[B, W]``, ``dino`` ``[B, h*w, D]`` (with REPA), and the host bookkeeping."""

    latents: torch.Tensor
    mask: torch.Tensor
    text: torch.Tensor
    dino: torch.Tensor
    ids: list[str]
    shard: np.ndarray


@dataclass(frozen=True)
class BatchPlan:
    """Which rows of which opened partitions a batch reads, and its sizes.

    The samples are grouped by partition (groups in partition order, samples in batch order
    within; ``order`` maps grouped to batch positions): a group's rows are decoded with its
    partition's tables. The per-sample arrays below are in grouped order."""

    shard: np.ndarray  #: [B] each sample's partition index (batch order)
    rows: np.ndarray  #: [B] its row in the partition's files (batch order)
    order: np.ndarray  #: [B] the batch position of the j-th grouped sample
    parts: list[int]  #: the groups' partitions
    counts: list[int]  #: samples per group
    arrays: list[dict]  #: the groups' opened partitions (ShardSource._arrays): the versions read
    first_token: np.ndarray  #: [B] each caption's first token row
    tokens: np.ndarray  #: [B] its tokens read (at most text_max_len)
    first_cell: np.ndarray  #: [B] its first latent cell (and DINO row)
    grid: tuple[int, int]  #: the batch's latent grid (h, w): one bucket
    width: int  #: the padded caption width
    latents: bool  #: False: captions only (any buckets)

    @property
    def b(self) -> int:
        return len(self.rows)

    @property
    def text_rows(self) -> int:
        """Caption rows the batch reads."""
        return int(self.tokens.sum())


def plan_batch(
    shard_idx: np.ndarray,
    rows: np.ndarray,
    open_arrays: Callable[[int], dict],
    text_max_len: int,
    fixed_text_len: bool = False,
    latents: bool = True,
    train: bool = False,
) -> BatchPlan:
    """The plan of the samples ``(shard_idx[j], rows[j])``: each group's partition opened by
    ``open_arrays``; captions padded to the batch's longest (capped at ``text_max_len``), or
    to ``text_max_len`` with ``fixed_text_len``. ``train``: ``rows`` index each partition's
    trainable rows (held-out ones left out). The samples share one latent grid unless
    ``latents`` is False (captions only)."""
    shard_idx = np.asarray(shard_idx, np.int64)
    rows = np.asarray(rows, np.int64)
    b = len(rows)
    order = np.argsort(shard_idx, kind="stable")
    s_sorted = shard_idx[order]
    cut = np.flatnonzero(s_sorted[1:] != s_sorted[:-1]) + 1
    parts = s_sorted[np.concatenate([[0], cut])].tolist() if b else []
    ends = [*cut.tolist(), b]
    counts = np.diff([0, *ends]).tolist()
    arrays = [open_arrays(s) for s in parts]
    r_sorted = rows[order]
    #: per sample (grouped): caption length, first token, first cell, latent grid (h, w)
    info = np.empty((b, 5), np.int64)
    for a, hi, n in zip(arrays, ends, counts):
        r = r_sorted[hi - n : hi]
        if train:
            r = r_sorted[hi - n : hi] = a["train_rows"].take(r)
        a["rows"].take(r, axis=0, out=info[hi - n : hi])
    if train:
        rows = np.empty(b, np.int64)
        rows[order] = r_sorted
    grid = info[:, 3:]
    n_tok = np.minimum(info[:, 0], text_max_len)
    width = text_max_len if fixed_text_len else max(1, int(n_tok.max(initial=1)))
    if latents and not (grid == grid[0]).all():
        grids = np.unique(grid, axis=0)
        raise ValueError(
            f"a batch of samples of {len(grids)} latent grids "
            f"({', '.join(f'{h}x{w}' for h, w in grids)}): a batch is of one bucket "
            "(epoch_order keeps them so; heldout_batches groups by bucket)"
        )
    gh, gw = (int(x) for x in grid[0])
    return BatchPlan(
        shard_idx,
        rows,
        order,
        parts,
        counts,
        arrays,
        info[:, 1],
        n_tok,
        info[:, 2],
        (gh, gw),
        width,
        latents,
    )


def read_batch(
    plan: BatchPlan,
    views: dict[str, np.ndarray],
    partitions: Sequence[str],
    dino: bool,
    io: ReadPool | None = None,
) -> StoredBatch:
    """The reads of ``plan`` into the buffers ``views`` (numpy views of a :meth:`buffers` set):
    each sample's caption tokens as one run, its cells (latents, DINO patches) as one run in
    both layouts, each with one ``pread`` per array straight from the files (:func:`read_rows`;
    ``io``: the reads that would wait on the disk go to its threads). Returns the batch's
    bookkeeping; its tensors are the buffers cut by ``sizes`` (:func:`slot_views`)."""
    b, order, counts, arrays = plan.b, plan.order, plan.counts, plan.arrays
    n_tok, (gh, gw) = plan.tokens, plan.grid
    cells, width = gh * gw, plan.width
    t_end = np.cumsum(n_tok)
    t0 = int(t_end[-1]) if b else 0
    read_rows(
        views["text_rows"],
        [a["tokens"] for a in arrays],
        counts,
        plan.first_token,
        n_tok,
        t_end - n_tok,
        io,
    )
    if plan.latents:
        read_rows(
            views["latents"],
            [a["latents"] for a in arrays],
            counts,
            plan.first_cell,
            cells,
            order * cells,
            io,
        )
        if dino:
            read_rows(
                views["dino_rows"],
                [a["patch"] for a in arrays],
                counts,
                plan.first_cell,
                cells,
                np.arange(b) * cells,
                io,
            )
            views["dino_dst"][:b] = order
    # where each token goes in the flat padded [B * W] batch, and the mask
    within = np.arange(t0) - np.repeat(t_end - n_tok, n_tok)
    views["text_dst"][:t0] = np.repeat(order * width, n_tok) + within
    per_sample = np.empty(b, np.int64)
    per_sample[order] = n_tok
    np.less(np.arange(width), per_sample[:, None], out=views["mask"][:b, :width])
    group = np.empty(b, np.int64)
    group[order] = np.repeat(np.arange(len(plan.parts)), counts)
    id_lists = [a["ids"] for a in arrays]
    ids = [id_lists[g][r] for g, r in zip(group.tolist(), plan.rows.tolist())]
    t_counts = np.add.reduceat(n_tok, np.cumsum([0, *counts[:-1]])) if b else n_tok
    sizes = BatchSizes(b=b, width=width, text=t0, grid=(gh, gw) if plan.latents else None)
    first = arrays[0]
    return {
        "ids": ids,
        "shard": plan.shard,  # host bookkeeping (a tensor would cost a shared-memory segment)
        "parts": [partitions[s] for s in plan.parts],
        "coded": [
            k
            for k, v in (("text", first["tokens"]), ("dino", first.get("patch")))
            if v is not None and v.coded
        ],
        "text_counts": t_counts.tolist(),
        # the tables of the file versions these rows were read from, per group
        "text_tables": [a["table_keys"]["text"] for a in arrays],
        # per group: its captions' first state is the null caption's (exact on decode)
        "text_first_null": [a["first_null"] for a in arrays],
        **(
            {"dino_counts": counts, "dino_tables": [a["table_keys"]["dino"] for a in arrays]}
            if dino and plan.latents
            else {}
        ),
        "sizes": sizes,
    }


def slot_views(buf: dict[str, torch.Tensor], sizes: BatchSizes) -> StoredBatch:
    """The stored batch's tensors: views of ``buf`` cut to the batch's ``sizes``."""
    b, width, n = sizes["b"], sizes["width"], sizes["text"]
    out: StoredBatch = {
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
