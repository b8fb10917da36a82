"""The pHash decision at PD12M's size: the multi-index hash finds exactly what brute force
finds, and the kept decision decides an appended partition alone, with the same result."""

from __future__ import annotations

import numpy as np
import pytest

from flowmatch_assets.ingest.neardup import decide
from flowmatch_assets.ingest.neardup_index import (
    HashIndex,
    chunks_for,
    decide_incremental,
    decision_dir,
    radii,
)


def _planted(rng, n: int, t: int) -> np.ndarray:
    """Random hashes, a tenth of them replaced by copies of others with 0..t+2 bits flipped
    (within and just past the threshold), some copies of copies (chains)."""
    h = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    for s, d in zip(rng.integers(0, n, n // 10), rng.integers(0, n, n // 10)):
        bits = rng.choice(64, int(rng.integers(0, t + 3)), replace=False)
        h[d] = h[s] ^ np.uint64(sum(1 << int(b) for b in bits))
    return h


def _brute_query(index_hashes: np.ndarray, q: np.ndarray, t: int) -> np.ndarray:
    d = np.bitwise_count(q[:, None] ^ index_hashes[None, :])
    ok = d <= t
    return np.where(ok.any(1), ok.argmax(1), -1)


@pytest.mark.parametrize("t", [4, 10, 14, 40])
def test_the_index_answers_exactly_what_brute_force_answers(t):
    rng = np.random.default_rng(t)
    members = _planted(rng, 3000, t)
    near = members[rng.integers(0, 3000, 500)] ^ np.uint64(1 << 7)  # 1 bit off a member
    q = np.concatenate([near, _planted(rng, 1000, t), members[:50]])
    ix = HashIndex(t, rows=100_000 if t == 4 else 12_400_000)
    for s in range(0, 3000, 700):  # added in parts: the merge keeps every bucket in age order
        ix.add(members[s : s + 700])
    win, dist = ix.query(q)
    want = _brute_query(members, q, t)
    np.testing.assert_array_equal(win, want)
    hit = want >= 0
    np.testing.assert_array_equal(dist[hit], np.bitwise_count(members[want[hit]] ^ q[hit]))
    assert hit.sum() >= 550 and ((~hit).any() or t == 40)
    # the chunks: m (r_i + 1) > t, an index for a 10-bit threshold, brute force at 40 bits
    assert sum(r + 1 for r in radii(t, ix.m)) > t or ix.m == 0
    assert ix.m == {4: 3, 10: 3, 14: 3, 40: 0}[t]


def test_the_kept_decision_decides_appended_partitions_alone_and_equals_brute_force(tmp_path):
    t = 10
    rng = np.random.default_rng(1)
    h = _planted(rng, 6000, t)
    names = [f"000-{k:02d}" for k in range(6)]
    parts = {
        n: (np.array([f"{n}/{i}" for i in range(1000)], object), h[k * 1000 : (k + 1) * 1000])
        for k, n in enumerate(names)
    }
    loaded: list[str] = []

    def load(name):
        loaded.append(name)
        return parts[name]

    def brute(upto: list[str]) -> set[tuple]:
        allh = np.concatenate([parts[n][1] for n in upto])
        ids = np.concatenate([parts[n][0] for n in upto])
        w, d = decide(allh, t)
        return {(ids[i], ids[w[i]], int(d[i])) for i in np.flatnonzero(w >= 0)}

    def got(table) -> set[tuple]:
        c = table.to_pydict()
        assert all(k.split("/")[0] == p for k, p in zip(c["kept_id"], c["kept_partition"]))
        return set(zip(c["id"], c["kept_id"], c["distance"]))

    first, info = decide_incremental(tmp_path, t, [(n, "v1") for n in names[:4]], load)
    assert got(first) == brute(names[:4]) and info == {"reused": 0, "decided": names[:4]}
    assert len(first) > 150
    # two partitions appended: only they are read and decided (winners' partitions read for ids)
    loaded.clear()
    table, info = decide_incremental(tmp_path, t, [(n, "v1") for n in names], load)
    assert info == {"reused": 4, "decided": names[4:]}
    assert set(loaded) - set(names[4:]) <= set(table.column("kept_partition").to_pylist())
    assert got(table) == brute(names) and table.slice(0, len(first)).equals(first)
    # nothing new: nothing decided, nothing read
    loaded.clear()
    same, info = decide_incremental(tmp_path, t, [(n, "v1") for n in names], load)
    assert info == {"reused": 6, "decided": []} and same.equals(table) and not loaded
    # a changed record (or an earlier partition inserted): re-decided from scratch, exactly
    parts[names[2]] = (parts[names[2]][0], _planted(rng, 1000, t))
    changed = [(n, "v2" if n == names[2] else "v1") for n in names]
    table, info = decide_incremental(tmp_path, t, changed, load)
    assert info == {"reused": 0, "decided": names} and got(table) == brute(names)
    # a crash leaves the last committed state: files are named by version, state.json last
    d = decision_dir(tmp_path, t)
    assert len(list(d.glob("kept-*.npz"))) == len(list(d.glob("losers-*.parquet"))) == 1
    # another threshold keeps its own decision
    _, info = decide_incremental(tmp_path, 40, [(n, "v1") for n in names[:2]], load)
    assert info["reused"] == 0 and chunks_for(40) == 0


def test_the_index_stays_small_at_pd12m_size():
    ix = HashIndex(10)
    # the arrays a 12.4M index holds: hashes, 3 chunk tables of 2^21-2^22 offsets, members and
    # their hashes in bucket order (measured by `flowmatch bench neardup`)
    rows = 12_400_000
    size = rows * 8 + sum((2**w + 1) * 4 + rows * (4 + 8) for w in ix.widths)
    assert ix.m == 3 and ix.widths == [22, 21, 21] and size < 2e9
    assert [len(f) for f in ix.flips] == [1794, 1562, 232]  # probes: C(w, <= r_i), r = 3, 3, 2


def test_the_bench_finds_every_planted_copy_and_projects_within_the_goals():
    from flowmatch_assets.bench.neardup import main

    out = main(
        ["--sizes", "3000,6000", "--partition", "1000", "--brute", "2000", "--cls-kept", "500"]
    )
    assert [r["kept_rows"] for r in out["runs"]] == [3000, 6000]
    for r in out["runs"]:
        assert r["chunks"] == 3 and r["probes_per_query"] == 3588
        assert r["planted"] == 10 and r["found"] >= 10  # + random rows that close, if any
    assert 0 < out["projected_12m_index_mb"] < out["goals"]["index_mb"]
    assert out["brute_projected_12m_partition_cpu_s"] > 0 and out["command"].endswith(
        "--sizes 3000,6000"
    )
