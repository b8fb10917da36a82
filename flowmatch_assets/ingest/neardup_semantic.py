"""Near-duplicates, the semantic detector at PD12M's size: the DINOv2 CLS decision within
clusters (SemDeDup-style: Abbas et al. 2023), not every row against every kept row.

**The rule** is :func:`.neardup.decide_cosine`'s, with fewer candidates: a row loses to the
earliest kept row (dataset order: partition, position) whose cosine with it is >= ``min_cosine``
*among the kept rows of its nearest clusters*. Every row has a home cluster (its nearest
centroid) and is compared with the kept rows whose home is one of
its ``probes`` nearest centroids (an IVF index: each row stored once, probed ``probes`` times).
Within those clusters the decision is exact (blocks of rows against the clusters' kept rows,
matrix products), so a row removed always has cosine >= ``min_cosine`` with the kept row named;
the approximation is a pair split across clusters that are not probed: the later row is then
kept (or loses to a later kept row that is probed). Measured on clustered synthetic CLS with
planted copies at cosine 0.95-0.99 (``flowmatch bench semdedup``, BENCHMARKS.md "Near
duplicates"): recall vs brute force and the cost per 10,000 rows. With one cluster the decision
*is* brute force (:func:`.neardup.decide_cosine`, kept as the reference: ``brute=True``).

**The centroids**: spherical k-means (unit vectors, cosine), ``clusters_for(n)`` centroids
fitted on the first ``fit_rows`` rows in dataset order (all rows with a CLS, before any other
detector removes some), started from rows drawn with a fixed seed, a fixed number of
iterations. They are a function of that sample alone, so the losers depend on the rows and the
settings only, never on the materialization order. They are kept in
``catalog/neardup/semantic/centroids-<digest>.npy`` (atomic; the digest is the sample's ids,
vectors and the fit settings): once the dataset has ``fit_rows`` rows, appending partitions
later in dataset order leaves the sample as it was, and the appended rows are assigned to the
stored centroids instead of refitting. A partition inserted before them, or rewritten, changes
the sample: refit (as the pHash decision re-decides). The decision itself is not kept between
runs: each run re-decides every row (its cost grows with rows x cluster size, not rows x kept).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.storage.layout import DataLayout

#: Rows of the dataset's start the centroids are fitted on.
FIT_ROWS = 200_000
#: Fit rows per centroid (so few rows keep one cluster: brute force), and the most centroids.
ROWS_PER_CLUSTER = 50
MAX_CLUSTERS = 4096
#: Nearest centroids a row is compared in.
PROBES = 2
ITERATIONS = 10
SEED = 0


def unit(v: np.ndarray) -> np.ndarray:
    """Rows of ``v`` as float32 unit vectors (a zero row stays zero)."""
    v = np.asarray(v, np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def clusters_for(n_fit: int) -> int:
    """How many centroids a fit sample of ``n_fit`` rows gets."""
    return int(min(MAX_CLUSTERS, max(1, n_fit // ROWS_PER_CLUSTER)))


def nearest(v: np.ndarray, centroids: np.ndarray, probes: int, block: int = 16384) -> np.ndarray:
    """``[n, probes]``: each unit row's nearest centroids, nearest first."""
    p = min(probes, len(centroids))
    out = np.zeros((len(v), p), np.int32)
    for s in range(0, len(v), block):
        sim = v[s : s + block] @ centroids.T
        if p == 1:
            out[s : s + block, 0] = sim.argmax(axis=1)
            continue
        top = np.argpartition(-sim, p - 1, axis=1)[:, :p]
        top_sim = np.take_along_axis(sim, top, axis=1)
        out[s : s + block] = np.take_along_axis(top, np.argsort(-top_sim, axis=1), axis=1)
    return out


def fit_centroids(
    sample: np.ndarray, k: int, iterations: int = ITERATIONS, seed: int = SEED
) -> np.ndarray:
    """``[k, d]`` unit centroids of the unit rows ``sample`` (spherical k-means, Lloyd): start
    at ``k`` distinct rows drawn with ``seed``; a centroid left empty restarts at the row
    farthest from its own centroid (deterministic)."""
    x = unit(sample)
    k = min(k, len(x))
    c = x[np.sort(np.random.default_rng(seed).choice(len(x), k, replace=False))].copy()
    for _ in range(iterations):
        home = nearest(x, c, 1)[:, 0]
        sums = np.zeros_like(c)
        np.add.at(sums, home, x)
        counts = np.bincount(home, minlength=k)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            fit = np.einsum("ij,ij->i", x, c[home])
            far = np.argsort(fit, kind="stable")[: len(empty)]
            sums[empty] = x[far]
        c = unit(sums)
    return c


def decide_clustered(
    vectors: np.ndarray,
    min_cosine: float,
    centroids: np.ndarray,
    probes: int = PROBES,
    block: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(winner index or -1, cosine) of each row in order: row ``i`` loses to the first kept row
    ``j < i`` whose home cluster is one of ``i``'s ``probes`` nearest centroids and whose cosine
    with ``i`` is >= ``min_cosine``. A block of rows is compared, cluster by cluster, with the
    rows before it (kept ones only count), then among itself (pairs above the threshold, settled
    in order). A block (default: ``256 x centroids`` rows, at least 65,536) gives each cluster
    ~512 rows to compare at once: matrix products, not a cluster's rows read per row. Memory:
    one copy of the vectors (float32, sorted by home cluster) and ~40 bytes a row."""
    x = np.asarray(vectors, np.float32)
    n = len(x)
    winner = np.full(n, -1, np.int64)
    best = np.zeros(n, np.float64)
    if n == 0:
        return winner, best
    c = unit(centroids)
    block = block or max(65536, 256 * len(c))
    probe = nearest(x, c, probes)  # [n, p] (a row's length does not change its ranking)
    home = probe[:, 0]
    order = np.argsort(home, kind="stable")  # by cluster, then dataset order
    v = x[order]  # the one copy: cluster-contiguous (row order[r] at r), made unit in place
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    start = np.searchsorted(home[order], np.arange(len(c) + 1))
    lost = np.zeros(n, bool)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    for s in range(0, n, block):
        e = min(n, s + block)
        rows = np.arange(s, e)
        pairs_r = np.repeat(rows, probe.shape[1])
        pairs_c = probe[s:e].ravel()
        by = np.argsort(pairs_c, kind="stable")
        pairs_r, pairs_c = pairs_r[by], pairs_c[by]
        bounds = np.flatnonzero(np.diff(pairs_c)) + 1
        edges_i, edges_j, edges_s = [], [], []
        for q_rows, cl in zip(np.split(pairs_r, bounds), pairs_c[np.r_[0, bounds]]):
            members = order[start[cl] : start[cl + 1]]  # ascending dataset order
            before = np.searchsorted(members, s)
            inside = np.searchsorted(members, e)
            q = v[pos[q_rows]]
            if before:  # the kept rows of this cluster before the block: the earliest wins
                sim = q @ v[start[cl] : start[cl] + before].T
                ok = (sim >= min_cosine) & ~lost[members[:before]]
                first = ok.argmax(axis=1)
                for k in np.flatnonzero(ok.any(axis=1)):
                    j, i = members[first[k]], q_rows[k]
                    if winner[i] < 0 or j < winner[i]:
                        winner[i], best[i] = j, sim[k, first[k]]
            if inside > before:  # pairs inside the block, settled below
                sim = q @ v[start[cl] + before : start[cl] + inside].T
                cols = members[before:inside]
                ii, jj = np.nonzero((sim >= min_cosine) & (cols[None, :] < q_rows[:, None]))
                edges_i.append(q_rows[ii])
                edges_j.append(cols[jj])
                edges_s.append(sim[ii, jj])
        lost[rows] = winner[rows] >= 0  # lost to a row before the block: settled
        if edges_i:
            edges = (np.concatenate(x) for x in (edges_i, edges_j, edges_s))
            _settle(*edges, winner, best, lost)
    return winner, best


def _settle(i, j, s, winner, best, lost) -> None:
    """The block's own pairs (row i, earlier row j, cosine s), in dataset order: a row not lost
    yet loses to its first earlier row that is still kept (j's fate is settled before i's)."""
    if not len(i):
        return
    o = np.lexsort((j, i))
    i, j, s = i[o], j[o], s[o]
    bounds = np.r_[0, np.flatnonzero(np.diff(i)) + 1, len(i)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        row = i[a]
        if lost[row]:
            continue
        for t in range(a, b):
            if not lost[j[t]]:
                winner[row], best[row], lost[row] = j[t], s[t], True
                break


# ------------------------------------------------------------------ the stored centroids


def centroid_dir(root: str | Path) -> Path:
    return DataLayout(root).catalog_dir / "neardup" / "semantic"


def sample_digest(part: np.ndarray, ids: np.ndarray, v: np.ndarray, k: int) -> str:
    """The fit sample's identity: its rows (partition, id), their vectors and the settings."""
    h = hashlib.sha256(
        json.dumps([k, ITERATIONS, SEED, list(map(str, part)), list(map(str, ids))]).encode()
    )
    h.update(np.ascontiguousarray(v, np.float32).tobytes())
    return h.hexdigest()[:20]


def stored_centroids(
    root: str | Path,
    part: np.ndarray,
    ids: np.ndarray,
    v: np.ndarray,
    fit_rows: int | None = None,
) -> np.ndarray:
    """The centroids of the first ``fit_rows`` (default :data:`FIT_ROWS`) rows, in dataset
    order, of ``(part, ids, v)``: read from ``catalog/neardup/semantic/`` when that sample was
    fitted before, else fitted and written there (atomically; centroids of another sample are
    removed)."""
    n = min(FIT_ROWS if fit_rows is None else fit_rows, len(v))
    if n == 0:  # no CLS: nothing to decide, nothing kept
        return np.zeros((1, v.shape[1]), np.float32)
    k = clusters_for(n)
    digest = sample_digest(part[:n], ids[:n], v[:n], k)
    d = centroid_dir(root)
    path = d / f"centroids-{digest}.npy"
    if path.exists():
        return np.load(path, allow_pickle=False)
    c = fit_centroids(v[:n], k)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, c, allow_pickle=False)
    for old in d.glob("centroids-*.npy"):
        if old != path:
            old.unlink(missing_ok=True)
    return c
