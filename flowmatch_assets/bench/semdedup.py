"""Benchmark: the semantic near-duplicate decision within clusters (``ingest/neardup_semantic.py``)
against brute force (``neardup.decide_cosine``), on synthetic DINOv2-like CLS vectors.

- recall: ``--rows`` unit vectors of ``--dim`` around ``rows / 200`` random centres plus 2%
  planted copies (a row of the second half at cosine 0.95-0.99 with one of the first half),
  decided at ``--min-cosine`` by brute force and within ``clusters_for(rows)`` fitted centroids
  (1 and 2 probes): recall of brute force's losers, rows removed that brute force keeps, the
  lowest cosine of a removed row with its winner (never below the threshold), CPU-seconds.
- brute force's cost: 10,000 rows against 20,000 kept ones, scaled to 12.4M kept rows.
- the cost at PD12M's size: for each ``--sizes`` N, N rows in clusters of ``--cluster-rows``
  rows (PD12M's 12.4M rows over 4,000 centroids: ~3,100 a cluster), the centres as centroids,
  in blocks of 256 rows a centroid (PD12M's default: each cluster compares ~512 rows at once),
  the whole decision timed: its CPU-seconds per 10,000 rows stay flat as N grows (the work of a
  row is its clusters' rows, not every kept row). Plus the assignment of 10,000 rows to
  ``MAX_CLUSTERS`` centroids, and one k-means iteration of ``FIT_ROWS`` rows (projected from a
  smaller one). Projected to 12.4M: rows x (per-row decision + assignment), and the vectors'
  bytes.

Run: ``flowmatch bench semdedup [--rows 5000] [--sizes 25000,100000] [--out F]`` (~45 s; the
recorded run: ``--rows 20000 --sizes 50000,200000``, ~2 min); ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Sequence

import numpy as np

from flowmatch_assets.ingest import neardup_semantic as sem
from flowmatch_assets.ingest.neardup import decide_cosine

PD12M = 12_400_000


def clustered(rng, n: int, d: int, centers: int, share: float = 0.02, spread: float = 1.5):
    """(unit rows around ``centers`` random centres with ``share`` planted copies, centres)."""
    c = sem.unit(rng.standard_normal((centers, d)))
    v = sem.unit(c[rng.integers(0, centers, n)] + spread * sem.unit(rng.standard_normal((n, d))))
    m = int(n * share)
    src = rng.choice(n // 2, m, replace=False)
    dst = rng.choice(np.arange(n // 2, n), m, replace=False)
    cos = rng.uniform(0.95, 0.99, m)[:, None]
    e = sem.unit(rng.standard_normal((m, d)))
    e = sem.unit(e - (e * v[src]).sum(1, keepdims=True) * v[src])
    v[dst] = cos * v[src] + np.sqrt(1 - cos**2) * e
    return v.astype(np.float32), c


def recall(rng, n: int, d: int, t: float) -> dict:
    v, _ = clustered(rng, n, d, max(1, n // 200))
    c0 = time.process_time()
    ref_w, _ = decide_cosine(v, t)
    brute = time.process_time() - c0
    ref = set(np.flatnonzero(ref_w >= 0).tolist())
    c0 = time.process_time()
    cent = sem.fit_centroids(v, sem.clusters_for(n))
    out = {"rows": n, "dim": d, "centres": max(1, n // 200), "planted": int(n * 0.02)}
    out |= {"clusters": len(cent), "fit_cpu_s": round(time.process_time() - c0, 2)}
    out |= {"brute_losers": len(ref), "brute_cpu_s": round(brute, 2)}
    for probes in (1, 2):
        c0 = time.process_time()
        w, _ = sem.decide_clustered(v, t, cent, probes=probes)
        cpu = time.process_time() - c0
        lost = np.flatnonzero(w >= 0)
        got = set(lost.tolist())
        cos = np.einsum("ij,ij->i", v[lost], v[w[lost]])
        out[f"probes_{probes}"] = {
            "recall": round(len(got & ref) / max(1, len(ref)), 4),
            "removed_brute_keeps": len(got - ref),
            "lowest_removed_cosine": round(float(cos.min()), 4) if len(cos) else None,
            "decide_cpu_s": round(cpu, 2),
        }
    return out


def cost(rng, n: int, d: int, cluster_rows: int, t: float) -> dict:
    k = max(1, n // cluster_rows)
    v, c = clustered(rng, n, d, k)
    c0 = time.process_time()
    # blocks of 256 rows a centroid, as at PD12M (decide_clustered's default there): each
    # cluster compares ~512 rows at once, whatever the number of clusters
    w, _ = sem.decide_clustered(v, t, c, block=256 * k)
    cpu = time.process_time() - c0
    return {
        "rows": n,
        "clusters": k,
        "block_rows": 256 * k,
        "decide_cpu_s": round(cpu, 2),
        "cpu_s_per_10k_rows": round(cpu * 10_000 / n, 3),
        "found": int((w >= 0).sum()),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench semdedup", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=int, default=5_000, help="rows of the recall set")
    p.add_argument("--dim", type=int, default=768, help="CLS width (DINOv2-base: 768)")
    p.add_argument("--min-cosine", type=float, default=0.9)
    p.add_argument("--sizes", default="25000,100000", help="rows of the cost runs")
    p.add_argument("--cluster-rows", type=int, default=PD12M // sem.clusters_for(sem.FIT_ROWS))
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rec = recall(rng, a.rows, a.dim, a.min_cosine)
    runs = [cost(rng, int(n), a.dim, a.cluster_rows, a.min_cosine) for n in a.sizes.split(",")]
    # the assignment to PD12M's centroids (clusters_for(FIT_ROWS)), 10,000 rows
    k = sem.clusters_for(sem.FIT_ROWS)
    v = sem.unit(rng.standard_normal((10_000, a.dim)))
    cent = sem.unit(rng.standard_normal((k, a.dim)))
    c0 = time.process_time()
    sem.nearest(v, cent, sem.PROBES)
    assign = time.process_time() - c0
    # one k-means iteration on 20,000 rows, scaled to FIT_ROWS rows (flops: rows x k)
    x = sem.unit(rng.standard_normal((20_000, a.dim)))
    c0 = time.process_time()
    sem.fit_centroids(x, k, iterations=1)
    fit_iter = (time.process_time() - c0) * sem.FIT_ROWS / 20_000
    # brute force's step: 10,000 rows against 20,000 kept ones (blocks of 1,024, a matrix
    # product each), scaled to 12.4M kept rows (one partition) and summed over the dataset
    kept = sem.unit(rng.standard_normal((20_000, a.dim)))
    c0 = time.process_time()
    for s in range(0, len(v), 1024):
        _ = (v[s : s + 1024] @ kept.T >= a.min_cosine).any(axis=1)
    brute = time.process_time() - c0
    per_10k = runs[-1]["cpu_s_per_10k_rows"] + assign
    result = {
        "bench": "semdedup",
        "min_cosine": a.min_cosine,
        "recall": rec,
        "cost_runs": runs,
        "cluster_rows": a.cluster_rows,
        "pd12m_clusters": k,
        "assign_cpu_s_per_10k_rows": round(assign, 3),
        "projected_12m_cpu_s_per_10k_rows": round(per_10k, 2),
        "projected_12m_decision_cpu_s": round(per_10k * PD12M / 10_000),
        "projected_12m_fit_cpu_s": round(fit_iter * sem.ITERATIONS),
        "brute_10k_vs_20k_cpu_s": round(brute, 2),
        "brute_projected_12m_cpu_s_per_10k_rows": round(brute * PD12M / 20_000),
        # every row against every kept row before it: on average half the dataset
        "brute_projected_12m_decision_cpu_s": round(brute * PD12M / 20_000 * PD12M / 20_000),
        # float32 vectors twice at the peak: the caller's (read_cls) and the decision's sorted copy
        "projected_12m_vectors_gb": round(2 * PD12M * a.dim * 4 / 1e9, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3),
        "command": "flowmatch bench semdedup"
        + (f" --rows {a.rows}" if a.rows != 5_000 else "")
        + (f" --sizes {a.sizes}" if a.sizes != "25000,100000" else ""),
    }
    for key, x in result.items():
        if key not in ("recall", "cost_runs"):
            print(f"{key:40s} {x}")
    print(json.dumps(rec))
    for r in runs:
        print(json.dumps(r))
    if a.out:
        from flowmatch_models.storage.atomic import atomic_write_text

        atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
