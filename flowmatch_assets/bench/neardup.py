"""Benchmark: the near-duplicate decision at PD12M's size (12.4M rows), on synthetic hashes.

- pHash: for each ``--sizes`` N, a multi-index hash (``ingest/neardup_index.py``) of N random
  kept 64-bit hashes with random 32-byte colour signatures, then one partition of
  ``--partition`` rows (``--planted`` of them copies of kept rows with 0..threshold bits flipped
  and their colours moved by up to the tolerance) decided against it (:func:`decide_block`: the
  index, then the partition's own rows in order) and its kept rows added. Measured: the index's
  bytes, the CPU-seconds of the partition (decide + add), the rows within the threshold whose
  colours agree (every planted copy; the few random rows that close in bits,
  ``found_hash_only``, fail the colour check with random colours: real colours cluster, so more
  pass there). Projected to 12.4M: the bytes per row from the largest N (the chunk tables are
  fixed: 2^21-2^22 offsets each), the CPU-seconds by a line through the two sizes (probes cost
  the same at any N; candidates grow with N).
- the reference: brute force (every row against every kept row) for one partition against
  ``--brute`` kept rows, scaled linearly.
- DINO CLS (the semantic path, brute force in blocks): one partition's 384-d vectors against
  ``--cls-kept`` kept ones (a float32 matrix product), scaled linearly to 12.4M.

Run: ``flowmatch bench neardup [--sizes 100000,1000000] [--out docs/benchmarks/neardup.json]``;
ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from collections.abc import Sequence

import numpy as np

from flowmatch_assets.ingest.neardup_colour import DEFAULT_TOLERANCE, SIGNATURE_BYTES
from flowmatch_assets.ingest.neardup_index import HashIndex, decide_block

PD12M = 12_400_000


def _within(t: int) -> float:
    """Chance that two uniform 64-bit hashes are within ``t`` bits."""
    return sum(math.comb(64, k) for k in range(t + 1)) / 2.0**64


def _cpu() -> float:
    return time.process_time()


def _colours(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, SIGNATURE_BYTES), dtype=np.uint8)


def _planted(
    rng, kept: np.ndarray, kept_colours: np.ndarray, n: int, share: float, t: int, tol: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``n`` random hashes and colours, ``share`` of them copies of kept rows with 0..t bits
    flipped and each colour byte moved by up to ``tol``."""
    h, c = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True), _colours(rng, n)
    k = int(n * share)
    pick = rng.integers(0, len(kept), k)
    flips = np.zeros(k, np.uint64)
    for j, bits in enumerate(rng.integers(0, t + 1, k)):
        for b in rng.choice(64, int(bits), replace=False):
            flips[j] |= np.uint64(1 << int(b))
    at = rng.choice(n, k, replace=False)
    h[at] = kept[pick] ^ flips
    moved = kept_colours[pick].astype(np.int16) + rng.integers(-tol, tol + 1, (k, SIGNATURE_BYTES))
    c[at] = np.clip(moved, 0, 255).astype(np.uint8)
    return h, c, k


def phash_size(rng, n: int, partition: int, share: float, t: int, tol: int) -> dict:
    ix = HashIndex(t, tol)
    c0 = _cpu()
    # the index holds the only copy (as a loaded decision does): no second one in the peak RSS
    ix.add(rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True), _colours(rng, n))
    build = _cpu() - c0
    part, part_c, planted = _planted(rng, ix.hashes, ix.colours, partition, share, t, tol)
    ix.tolerance = 255  # the hash alone (every colour agrees): what the colour check removes
    hash_only = int((ix.query(part, part_c)[0] >= 0).sum())
    ix.tolerance = tol
    c0, w0 = _cpu(), time.perf_counter()
    win, _ = decide_block(ix, part, part_c)
    c1 = _cpu()
    ix.add(part[win == -1], part_c[win == -1])
    c2, w2 = _cpu(), time.perf_counter()
    return {
        "kept_rows": n,
        "chunks": ix.m,
        "chunk_bits": ix.widths,
        "probes_per_query": int(sum(len(f) for f in ix.flips)),
        "index_mb": round(ix.nbytes / 1e6, 1),
        "index_bytes_per_row": round(ix.nbytes / len(ix), 2),
        "build_cpu_s": round(build, 2),
        "partition_decide_cpu_s": round(c1 - c0, 2),
        "partition_add_cpu_s": round(c2 - c1, 2),
        "partition_cpu_s": round(c2 - c0, 2),
        "partition_wall_s": round(w2 - w0, 2),
        "planted": planted,
        # rows within the threshold of a kept row, colours agreeing: the planted ones
        # (tests/test_neardup_index.py holds the index to brute force exactly)
        "found": int((win >= 0).sum()),
        # within the threshold of a kept row in bits alone: + the random rows that close
        "found_hash_only": hash_only,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench neardup", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sizes", default="100000,1000000", help="kept rows in the index, per run")
    p.add_argument("--partition", type=int, default=10_000)
    p.add_argument("--planted", type=float, default=0.01, help="share of planted copies")
    p.add_argument("--threshold", type=int, default=10)
    p.add_argument("--colour-tolerance", type=int, default=DEFAULT_TOLERANCE)
    p.add_argument("--brute", type=int, default=100_000, help="kept rows for the brute force")
    p.add_argument("--cls-kept", type=int, default=20_000)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in a.sizes.split(",")]
    tol = a.colour_tolerance
    runs = [phash_size(rng, n, a.partition, a.planted, a.threshold, tol) for n in sizes]
    # the reference: brute force of one partition against --brute kept rows
    kept = rng.integers(0, 2**64 - 1, a.brute, dtype=np.uint64, endpoint=True)
    part, _, _ = _planted(rng, kept, _colours(rng, a.brute), a.partition, a.planted, a.threshold, 0)
    c0 = _cpu()
    for s in range(0, len(part), 256):
        _ = (np.bitwise_count(part[s : s + 256, None] ^ kept[None, :]) <= a.threshold).any(1)
    brute = _cpu() - c0
    # the semantic path: one partition's CLS against --cls-kept kept ones (brute force, blocked)
    # (decide_cosine's step per block of 1,024 rows: a matrix product with every kept row)
    v = rng.standard_normal((a.cls_kept + a.partition, 384)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    kept_v, part_v = v[: a.cls_kept], v[a.cls_kept :]
    c0 = _cpu()
    for s in range(0, len(part_v), 1024):
        _ = (part_v[s : s + 1024] @ kept_v.T >= 0.95).any(axis=1)
    cls_all = _cpu() - c0
    last = runs[-1]
    if len(runs) > 1:  # CPU-s = fixed + per kept row, through the two largest sizes
        a0, a1 = runs[-2], runs[-1]
        slope = (a1["partition_cpu_s"] - a0["partition_cpu_s"]) / (
            a1["kept_rows"] - a0["kept_rows"]
        )
        cpu_12m = a1["partition_cpu_s"] + max(slope, 0.0) * (PD12M - a1["kept_rows"])
    else:
        cpu_12m = last["partition_cpu_s"] * PD12M / last["kept_rows"]
    fixed_mb = sum((2**w + 1) * 4 for w in HashIndex(a.threshold, tol).widths) / 1e6
    per_row = (last["index_mb"] - fixed_mb) * 1e6 / last["kept_rows"]
    result = {
        "bench": "neardup",
        "threshold": a.threshold,
        "colour_tolerance": tol,
        "partition_rows": a.partition,
        "runs": runs,
        "projected_12m_index_mb": round(fixed_mb + per_row * PD12M / 1e6, 0),
        "projected_12m_partition_cpu_s": round(cpu_12m, 1),
        "goals": {"index_mb": 2000, "partition_cpu_s": 10},
        # chance that a new row with a uniform random hash has a kept row within the threshold
        # among 12.4M (1 - (1 - p)^N): the floor of false matches at that size; real pHashes
        # cluster, so theirs is higher
        "random_match_chance_at_12m": round(1 - (1 - _within(a.threshold)) ** PD12M, 4),
        "brute_kept_rows": a.brute,
        "brute_partition_cpu_s": round(brute, 2),
        "brute_projected_12m_partition_cpu_s": round(brute * PD12M / a.brute, 0),
        "cls_kept_rows": a.cls_kept,
        "cls_partition_cpu_s": round(cls_all, 2),
        "cls_projected_12m_partition_cpu_s": round(cls_all * PD12M / a.cls_kept),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3),
        "command": "flowmatch bench neardup"
        + (f" --sizes {a.sizes}" if a.sizes != "100000,1000000" else ""),
    }
    for k, x in result.items():
        if k != "runs":
            print(f"{k:42s} {x}")
    for r in runs:
        print(json.dumps(r))
    if a.out:
        from flowmatch_models.storage.atomic import atomic_write_text

        atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
