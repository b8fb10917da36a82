"""The rules a kind's stored shard must follow (the embedding assets' checks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowmatch_models.embeddings.kinds import EmbeddingKind
from flowmatch_models.storage.store import Shard


def shard_problems(kind: EmbeddingKind, shard: Shard, ids: Sequence[str]) -> list[str]:
    """What is wrong with one of ``kind``'s shards against the images ids it was made from:
    ids, every array's shape and dtype, finite values, rows per sample and ragged lengths.
    Shapes come from the header; a transform-coded array is finite when its tables are (its
    codes are bounded integers), so nothing is decoded whole."""
    problems = []
    specs = kind.arrays_of(shard)
    info = {a.name: shard.info(a.name) for a in specs if a.name in shard}
    by_name = {a.name: a for a in specs}
    widths = {
        name: int(i["shape"][-1])
        for name, i in info.items()
        if len(i["shape"]) > 1 and by_name[name].shape and by_name[name].shape[-1] is None
    }
    if len(set(widths.values())) > 1:  # the encoder's width, one per shard
        problems.append(f"arrays of the encoder's width disagree: {widths}")
    if list(shard.ids) != list(ids):
        problems.append(f"{len(shard.ids)} ids do not match images's {len(ids)}")
    n = len(shard.ids)
    cells = None
    if "grid" in shard and "grid" in {a.name for a in specs}:
        g = np.asarray(shard["grid"])
        if g.ndim == 2 and g.shape == (n, 2) and (g >= 1).all():
            cells = int(g.astype(np.int64).prod(1).sum())
        else:
            problems.append(f"grid has shape {g.shape} or cells < 1; expected ({n}, 2) >= 1")
    for spec in specs:
        if spec.name not in shard:
            problems.append(f"no array {spec.name}")
            continue
        shape, dtype = tuple(info[spec.name]["shape"]), np.dtype(info[spec.name]["dtype"])
        tail_ok = len(shape) == len(spec.shape) + 1 and all(
            want is None or got == want for got, want in zip(shape[1:], spec.shape)
        )
        if not tail_ok or dtype != np.dtype(spec.dtype):
            problems.append(
                f"{spec.name} has shape {shape} dtype {dtype}, expected "
                f"(N, *{spec.shape}) {spec.dtype}"
            )
            continue
        if dtype.kind == "f":
            if "aux" in info[spec.name]:
                t = shard.coded(spec.name).tables
                finite = all(
                    np.isfinite(np.asarray(x, np.float32)).all()
                    for x in (t.mean, t.weight, t.lo, t.step)
                )
            else:
                finite = bool(np.isfinite(shard[spec.name]).all())
            if not finite:
                problems.append(f"{spec.name} has non-finite values")
        if spec.rows == "sample" and shape[0] != n:
            problems.append(f"{spec.name}: {shape[0]} rows != {n} ids")
        if spec.rows == "cell" and cells is not None and shape[0] != cells:
            problems.append(f"{spec.name}: {shape[0]} rows != the grid's {cells} cells")
        if spec.rows == "token" and "lengths" in shard:
            lengths = shard["lengths"]
            if len(lengths) != n or int(lengths.sum()) != shape[0] or (lengths < 1).any():
                problems.append(f"lengths do not add up to the {spec.name}")
    return problems
