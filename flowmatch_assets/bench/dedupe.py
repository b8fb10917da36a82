"""Benchmark: the cost of global dedupe at PD12M scale (12.4M rows), on synthetic metadata.

- hash index: ``--files`` metadata files of ``--rows`` rows (default 124 x 100k = 12.4M) with
  random md5 hashes, ``--dup`` of them repeated from earlier rows. Measured: the per-file pass
  (hex -> 16-byte keys, first occurrence per key) over all files, the global merge (first
  (file, row) of every key, sorted), the bytes of the global index, and one partition's lookup
  (``--shard`` keys, binary search in the memory-mapped index). The per-file pass of the real
  pipeline also reads and filters every column the filters use (``file_index``): measured on
  one real-format file of ``--rows`` rows with PD12M-like captions (~``--caption-chars``) and
  scaled by ``--files``.
- content dedupe: one partition's ``stored_before`` over ``--content-parts`` earlier content
  records of ``--shard`` rows (scaled to the 1,240 of PD12M at 10k rows per shard).

Run: ``flowmatch bench dedupe [--files 124 --rows 100000]``; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets import catalog
from flowmatch_assets.ingest.dedupe import (
    file_index,
    first_occurrences,
    hash_keys,
    stored_before,
)
from flowmatch_assets.ingest.metadata import FilterConfig

_HEXCHARS = np.frombuffer(b"0123456789abcdef", np.uint8)


def random_md5_hex(rng: np.random.Generator, n: int) -> pa.Array:
    """``n`` random 32-hex-digit strings, built without a Python loop."""
    raw = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    hexed = np.empty((n, 32), np.uint8)
    hexed[:, 0::2] = _HEXCHARS[raw >> 4]
    hexed[:, 1::2] = _HEXCHARS[raw & 15]
    offsets = pa.py_buffer(np.arange(0, 32 * (n + 1), 32, dtype=np.int32).tobytes())
    return pa.Array.from_buffers(pa.string(), n, [None, offsets, pa.py_buffer(hexed.tobytes())])


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench dedupe", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=124)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dup", type=float, default=0.01, help="fraction of rows that repeat a hash")
    p.add_argument("--shard", type=int, default=10_000)
    p.add_argument("--caption-chars", type=int, default=400)
    p.add_argument("--content-parts", type=int, default=124)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    total = a.files * a.rows

    # --- the per-file pass over synthetic hash columns -------------------------------------
    t_keys = t_first = 0.0
    per_k, per_r, per_f = [], [], []
    pool = random_md5_hex(rng, total)
    for n in range(a.files):
        col = pool.slice(n * a.rows, a.rows)
        if a.dup and n:  # repeat hashes of earlier rows
            idx = rng.integers(0, n * a.rows, size=int(a.dup * a.rows))
            col = pa.concat_arrays([col.slice(0, a.rows - len(idx)), pool.take(pa.array(idx))])
        t0 = time.perf_counter()
        keys, _ = hash_keys(col)
        t1 = time.perf_counter()
        k, first = first_occurrences(keys, np.arange(len(keys)))
        t2 = time.perf_counter()
        t_keys += t1 - t0
        t_first += t2 - t1
        per_k.append(k)
        per_r.append(first.astype(np.int32))
        per_f.append(np.full(len(k), n, np.int32))
    del pool
    # --- the global merge -------------------------------------------------------------------
    t0 = time.perf_counter()
    keys = np.concatenate(per_k)
    files = np.concatenate(per_f)
    rows = np.concatenate(per_r)
    sk, first = first_occurrences(keys, files)
    gfile, grow = files[first], rows[first]
    t_merge = time.perf_counter() - t0
    index_bytes = sk.nbytes + gfile.nbytes + grow.nbytes
    # --- one partition's lookup -------------------------------------------------------------
    probe = keys[rng.integers(0, len(keys), size=a.shard)]
    t0 = time.perf_counter()
    pos = np.searchsorted(sk, probe)
    assert (sk[pos] == probe).all()
    _ = gfile[pos], grow[pos]
    t_lookup = time.perf_counter() - t0
    del keys, files, rows, per_k, per_r, per_f

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # --- the real per-file pass on one PD12M-format file ------------------------------
        words = np.array(
            "a painting of an old house near the river with trees and a sky at dusk".split()
        )
        n_words = max(1, a.caption_chars // 5)
        captions = [" ".join(rng.choice(words, n_words)) for _ in range(a.rows)]
        meta = pa.table(
            {
                "id": [f"id-{i}" for i in range(a.rows)],
                "url": [f"https://example.org/{i}.jpg" for i in range(a.rows)],
                "caption": captions,
                "width": rng.integers(200, 4000, a.rows),
                "height": rng.integers(200, 4000, a.rows),
                "mime_type": ["image/jpeg"] * a.rows,
                "hash": random_md5_hex(rng, a.rows),
                "license": ["cc0-1.0"] * a.rows,
                "source": ["wikimedia"] * a.rows,
            }
        )
        path = tmp / "pd12m.000.parquet"
        pq.write_table(meta, path)
        t0 = time.perf_counter()
        file_index(str(path), FilterConfig())
        t_file = time.perf_counter() - t0
        # --- content dedupe: one partition against the earlier content records -------------
        for i in range(a.content_parts):
            md5 = random_md5_hex(rng, a.shard).to_pylist()
            catalog.record_content(
                tmp / "data",
                f"{i:03d}-00",
                [{"id": f"{i}-{j}", "position": j, "md5": m} for j, m in enumerate(md5)],
            )
        mine = random_md5_hex(rng, a.shard).to_pylist()
        t0 = time.perf_counter()
        stored_before(tmp / "data", "999-99", mine)
        t_content = time.perf_counter() - t0
    parts_pd12m = 12_400_000 // a.shard
    result = {
        "bench": "dedupe",
        "rows": total,
        "per_file_keys_s": round(t_keys, 2),
        "per_file_first_s": round(t_first, 2),
        "global_merge_s": round(t_merge, 2),
        "global_index_mb": round(index_bytes / 1e6, 1),
        "lookup_ms_per_partition": round(t_lookup * 1e3, 2),
        "real_file_index_s_per_file": round(t_file, 2),
        "real_file_index_s_all_files": round(t_file * a.files, 1),
        "content_check_s": round(t_content, 2),
        "content_check_s_at_last_pd12m_partition": round(
            t_content * parts_pd12m / a.content_parts, 1
        ),
    }
    for k, v in result.items():
        print(f"{k:42s} {v}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
