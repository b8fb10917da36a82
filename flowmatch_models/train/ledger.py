"""The ledger of trained samples: which samples a checkpoint has seen, how often, and when.

A checkpoint's data state holds one compact segment per (epoch, session) -- the epoch's
partition set and shard sizes, the order seed and shuffle window, the global batch ``G`` and
the gradient accumulation ``A``, the consumed positions ``[pos_from, pos_to)`` and the optimizer
step at ``pos_from``. The epoch's order is a pure function of those (:func:`epoch_order`), so
every trained sample, and the optimizer step that used it, is reconstructed exactly:
position ``p`` of the segment was in global batch ``k = (p - pos_from) // G`` and updated the
weights at step ``step_from + k // A + 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from flowmatch_models.data.exclude import Exclusions
from flowmatch_models.data.order import epoch_order, train_rows


def segment_samples(
    seg: dict, grids_of: Callable[[str], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shard index into seg['partitions'], row in that shard, step)`` of every sample the
    segment trained, in training order. A segment of several buckets (``bucket_chunk``) needs
    ``grids_of(partition)``: its trainable rows' latent grids ``[n, 2]`` (the shards' own)."""
    sizes = np.asarray(seg["sizes"], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    buckets, chunk = None, int(seg.get("bucket_chunk") or 0)
    if chunk:
        if grids_of is None:
            raise ValueError("a segment of several buckets: segment_samples needs grids_of")
        g = np.concatenate(
            [np.asarray(grids_of(p), np.int64).reshape(-1, 2) for p in seg["partitions"]]
        )
        buckets = np.unique(g, axis=0, return_inverse=True)[1].reshape(-1).astype(np.uint8)
    order = epoch_order(
        sizes, int(seg["epoch"]), int(seg["seed"]), int(seg["shuffle_window"]), buckets, chunk
    )
    start = int(seg.get("emit_from", seg["pos_from"]))  # a delta: only positions from here
    idx = order[start : int(seg["pos_to"])]
    k = (np.arange(len(idx)) + start - int(seg["pos_from"])) // int(seg["global_batch"])
    steps = int(seg["step_from"]) + k // int(seg["accumulate"]) + 1
    shard = np.searchsorted(starts, idx, side="right") - 1
    return shard, idx - starts[shard], steps


#: What places a segment's samples (its other fields are reports: available, skipped).
ORDER_KEYS = (
    "epoch",
    "partitions",
    "sizes",
    "seed",
    "shuffle_window",
    "heldout",
    "exclude",
    "bucket_chunk",
    "global_batch",
    "accumulate",
    "pos_from",
    "step_from",
)


def is_prefix(base: Sequence[dict], segs: Sequence[dict]) -> bool:
    """True when the ledger ``segs`` continues ``base`` (a later checkpoint of the same lineage:
    the same segments, the last one possibly extended, more appended)."""
    if not base or len(base) > len(segs):
        return not base
    last = len(base) - 1

    def key(seg: dict, with_end: bool = True) -> tuple:
        return tuple(seg.get(k) for k in ORDER_KEYS) + ((seg["pos_to"],) if with_end else ())

    same = all(key(base[i]) == key(segs[i]) for i in range(last))
    return (
        same
        and key(base[last], False) == key(segs[last], False)
        and (base[last]["pos_to"] <= segs[last]["pos_to"])
    )


def delta(base: Sequence[dict], segs: Sequence[dict]) -> list[dict]:
    """The segments of ``segs`` not already in ``base`` (``is_prefix(base, segs)``): the
    extension of base's last segment (``emit_from`` = where base stopped) and the new ones."""
    if not base:
        return [dict(s) for s in segs]
    last = len(base) - 1
    out = [{**segs[last], "emit_from": int(base[last]["pos_to"])}]
    return out + [dict(s) for s in segs[last + 1 :]]


def expand(
    segments: Sequence[dict],
    ids_of: Callable[[str], Sequence[str]],
    grids_of: Callable[[str], np.ndarray] | None = None,
    excluded_of: Callable[[str], Exclusions] | None = None,
) -> dict[str, np.ndarray]:
    """Per trained sample: ``sample_id, partition`` (arrow arrays), ``times_seen, first_step,
    last_step, partition_size`` (numpy), from ledger segments (whole, or a :func:`delta`);
    ``ids_of(partition)`` gives a partition's sample ids in shard order, ``grids_of`` its
    samples' latent grids ``[N, 2]`` (segments of several buckets; all rows, shard order).
    A segment's positions index its partitions' trainable rows: all but the held-out ones
    and those of its exclusion list (``exclude``: a digest; ``excluded_of(digest)`` reads that
    version back, e.g. :func:`flowmatch_models.data.exclude.recorded` of the data root), so
    each segment is mapped to shard rows with its own rules, whatever later ones used."""
    names: list[str] = []
    index: dict[str, int] = {}
    sizes: dict[str, int] = {}  # trainable samples, as the partition's first segment had them
    rows_n: dict[str, int] = {}  # every row of the shard
    offsets: dict[str, int] = {}
    keys, steps = [], []
    ids: dict[str, Sequence[str]] = {}
    trainable: dict[tuple, np.ndarray] = {}

    def train_of(p: str, seg: dict) -> np.ndarray:
        """The shard rows that ``seg``'s positions in partition ``p`` index."""
        rule = tuple(seg.get("heldout") or (0.0, 0))
        digest = seg.get("exclude") or ""
        if (p, rule, digest) not in trainable:
            if digest and excluded_of is None:
                raise ValueError(f"segment trained with exclusion list {digest}: pass excluded_of")
            skip = excluded_of(digest).ids.get(p, ()) if digest else ()  # type: ignore[misc]
            if p not in ids:
                ids[p] = ids_of(p)
            trainable[(p, rule, digest)] = train_rows(ids[p], float(rule[0]), int(rule[1]), skip)
        return trainable[(p, rule, digest)]

    for seg in segments:

        def trained_grids(p: str, seg=seg) -> np.ndarray:
            return np.asarray(grids_of(p))[train_of(p, seg)]  # type: ignore[misc]

        shard, row, step = segment_samples(seg, trained_grids if grids_of else None)
        rows = [train_of(p, seg) for p in seg["partitions"]]
        for p, n, r in zip(seg["partitions"], seg["sizes"], rows):
            if len(r) != int(n):
                raise ValueError(f"partition {p}: {len(r)} trainable rows, the segment had {n}")
            if p not in index:
                index[p], offsets[p] = len(names), sum(rows_n.values())
                names.append(p)
                sizes[p], rows_n[p] = int(n), len(ids[p])
        off = np.array([offsets[p] for p in seg["partitions"]], np.int64)
        starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        keys.append(off[shard] + flat[starts[shard] + row])
        steps.append(step)
    if not keys:
        key, step = np.zeros(0, np.int64), np.zeros(0, np.int64)
    else:
        key, step = np.concatenate(keys), np.concatenate(steps)
    order = np.argsort(key, kind="stable")
    key, step = key[order], step[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else key
    uniq = key[first]
    bounds = np.array([offsets[p] for p in names] + [sum(rows_n.values())], np.int64)
    part = (np.searchsorted(bounds, uniq, side="right") - 1).astype(np.int32)
    all_ids = pa.array([i for p in names for i in ids[p]], pa.string())
    return {
        "sample_id": all_ids.take(pa.array(uniq)),
        "partition": pa.DictionaryArray.from_arrays(part, pa.array(names, pa.string())),
        "times_seen": np.diff(np.r_[first, len(key)]).astype(np.int64),
        "first_step": np.minimum.reduceat(step, first) if len(key) else step,
        "last_step": np.maximum.reduceat(step, first) if len(key) else step,
        "partition_size": np.array([sizes[p] for p in names], np.int64)[part],
    }


def checkpoint_ledgers(
    run: Path,
    recorded: dict[int, tuple[list[dict], list[int]]],
    ids_of: Callable[[str], Sequence[str]],
    grids_of: Callable[[str], np.ndarray] | None,
    is_recorded: Callable[[int, Path], bool],
    excluded_of: Callable[[str], Exclusions] | None = None,
) -> Iterator[tuple[int, list[dict], list[dict], list[int]]]:
    """The ledgers of a run's checkpoints that are not recorded yet (``is_recorded(step,
    checkpoint)`` says which are), in step order: ``(step, rows trained since its base, its
    segments, its chain of steps)``. Each checkpoint records only the samples trained since its
    base -- the latest recorded checkpoint its ledger continues (``recorded``: step ->
    (segments, chain), updated as it goes) -- so the cost is one expansion per trained sample,
    however many checkpoints; a checkpoint's samples are the sum of its chain's deltas.
    ``excluded_of(digest)``: the exclusion lists the segments name (:func:`expand`)."""
    import torch

    ckpts = []
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
        ckpts.append((int(state["global_step"]), ckpt, state))
    done: set[int] = set()
    for step, ckpt, state in sorted(ckpts, key=lambda c: c[0]):
        if step in done or is_recorded(step, ckpt):
            continue
        segs = (state.get("EmbeddingDataModule") or {}).get("ledger") or []
        bases = [
            b
            for b in sorted(recorded, reverse=True)
            if b < step and is_prefix(recorded[b][0], segs)
        ]
        base_segs, base_chain = recorded[bases[0]] if bases else ([], [])
        rows = expand(delta(base_segs, segs), ids_of, grids_of, excluded_of)
        chain = [*base_chain, step]
        recorded[step] = (segs, chain)
        done.add(step)
        yield step, rows, segs, chain
