"""The pHash decision at PD12M's size: the multi-index hash finds exactly what brute force
finds (the earliest kept row within the threshold whose colours agree), and the kept decision
decides an appended partition alone, with the same result."""

from __future__ import annotations

import numpy as np
import pytest

from flowmatch_assets.ingest.neardup import decide
from flowmatch_assets.ingest.neardup_colour import SIGNATURE_BYTES
from flowmatch_assets.ingest.neardup_index import (
    HashIndex,
    chunks_for,
    decide_incremental,
    decision_dir,
    radii,
)

TOL = 20  # the colour tolerance of these tests


def _planted(rng, n: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Random hashes and colour signatures, a tenth of them replaced by copies of others with
    0..t+2 bits flipped (within and just past the threshold), some copies of copies (chains);
    4 bytes of each copy's colours moved by up to 2 x TOL (about half of the copies agree)."""
    h = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    c = rng.integers(0, 256, (n, SIGNATURE_BYTES), dtype=np.uint8)
    for s, d in zip(rng.integers(0, n, n // 10), rng.integers(0, n, n // 10)):
        bits = rng.choice(64, int(rng.integers(0, t + 3)), replace=False)
        h[d] = h[s] ^ np.uint64(sum(1 << int(b) for b in bits))
        move = np.zeros(SIGNATURE_BYTES, np.int16)
        move[rng.choice(SIGNATURE_BYTES, 4, replace=False)] = rng.integers(0, 2 * TOL + 1)
        c[d] = np.where(c[s] < 128, c[s] + move, c[s] - move)
    return h, c


def _brute_query(members, colours, q, qc, t: int, tol: int = TOL) -> np.ndarray:
    out = []
    for s in range(0, len(q), 64):
        ok = np.bitwise_count(q[s : s + 64, None] ^ members[None, :]) <= t
        r, k = np.nonzero(ok)  # the colours of the hash's matches (all agree at 255)
        if tol < 255:  # the mean of the 4 largest differences
            diff = np.abs(qc[s + r].astype(np.int16) - colours[k])
            ok[r, k] = np.sort(diff, axis=-1)[:, -4:].mean(-1) <= tol
        out.append(np.where(ok.any(1), ok.argmax(1), -1))
    return np.concatenate(out)


@pytest.mark.parametrize("t", [4, 10, 14, 40])
def test_the_index_answers_exactly_what_brute_force_answers(t):
    rng = np.random.default_rng(t)
    members, colours = _planted(rng, 3000, t)
    # the last 10 members: rows 0..9's hashes in another colour
    members[-10:], colours[-10:] = members[:10], colours[:10] ^ np.uint8(0x80)
    src = rng.integers(0, 3000, 600)
    near = members[src] ^ np.uint64(1 << 7)  # 1 bit off a member
    near_c = colours[src].copy()
    near_c[500:, 3] ^= np.uint8(0x80)  # and 100 of them in another colour
    more, more_c = _planted(rng, 1000, t)
    q = np.concatenate([near, more, members[:50], members[:10]])
    qc = np.concatenate([near_c, more_c, colours[:50], colours[-10:]])
    ix = HashIndex(t, TOL, rows=100_000 if t == 4 else 12_400_000)
    for s in range(0, 3000, 700):  # added in parts: the merge keeps every bucket in age order
        ix.add(members[s : s + 700], colours[s : s + 700])
    win, dist = ix.query(q, qc)
    want = _brute_query(members, colours, q, qc, t)
    np.testing.assert_array_equal(win, want)
    hit = want >= 0
    np.testing.assert_array_equal(dist[hit], np.bitwise_count(members[want[hit]] ^ q[hit]))
    assert hit.sum() >= 550 and ((~hit).any() or t == 40)
    # the colour decides: hash matches in another colour are not matches, and where the
    # earliest kept row within t bits is in another colour the earliest that agrees wins
    hash_only = _brute_query(members, colours, q, qc, t, tol=255)
    assert ((hash_only >= 0) & (want == -1)).sum() >= 50
    assert win[-10:].tolist() == list(range(2990, 3000)) and (hash_only[-10:] < 10).all()
    # the chunks: m (r_i + 1) > t, an index for a 10-bit threshold, brute force at 40 bits
    assert sum(r + 1 for r in radii(t, ix.m)) > t or ix.m == 0
    assert ix.m == {4: 3, 10: 3, 14: 3, 40: 0}[t]


def test_the_kept_decision_decides_appended_partitions_alone_and_equals_brute_force(tmp_path):
    t = 10
    rng = np.random.default_rng(1)
    h, c = _planted(rng, 6000, t)
    names = [f"000-{k:02d}" for k in range(6)]
    parts = {
        n: (
            np.array([f"{n}/{i}" for i in range(1000)], object),
            h[k * 1000 : (k + 1) * 1000],
            c[k * 1000 : (k + 1) * 1000],
        )
        for k, n in enumerate(names)
    }
    loaded: list[str] = []

    def load(name):
        loaded.append(name)
        return parts[name]

    def brute(upto: list[str], tol: int = TOL) -> set[tuple]:
        ids, allh, allc = (np.concatenate([parts[n][k] for n in upto]) for k in range(3))
        w, d = decide(allh, t, allc, tol)
        return {(ids[i], ids[w[i]], int(d[i])) for i in np.flatnonzero(w >= 0)}

    def got(table) -> set[tuple]:
        c = table.to_pydict()
        assert all(k.split("/")[0] == p for k, p in zip(c["kept_id"], c["kept_partition"]))
        return set(zip(c["id"], c["kept_id"], c["distance"]))

    first, info = decide_incremental(tmp_path, t, TOL, [(n, "v1") for n in names[:4]], load)
    assert got(first) == brute(names[:4]) and info == {"reused": 0, "decided": names[:4]}
    # the colour decides: without it (255: every colour agrees) other rows lose
    hash_only = brute(names[:4], 255)
    assert len(first) > 100 and len(hash_only - got(first)) > 80
    # two partitions appended: only they are read and decided (winners' partitions read for ids)
    loaded.clear()
    table, info = decide_incremental(tmp_path, t, TOL, [(n, "v1") for n in names], load)
    assert info == {"reused": 4, "decided": names[4:]}
    assert set(loaded) - set(names[4:]) <= set(table.column("kept_partition").to_pylist())
    assert got(table) == brute(names) and table.slice(0, len(first)).equals(first)
    # nothing new: nothing decided, nothing read
    loaded.clear()
    same, info = decide_incremental(tmp_path, t, TOL, [(n, "v1") for n in names], load)
    assert info == {"reused": 6, "decided": []} and same.equals(table) and not loaded
    # a changed record (or an earlier partition inserted): re-decided from scratch, exactly
    parts[names[2]] = (parts[names[2]][0], *_planted(rng, 1000, t))
    changed = [(n, "v2" if n == names[2] else "v1") for n in names]
    table, info = decide_incremental(tmp_path, t, TOL, changed, load)
    assert info == {"reused": 0, "decided": names} and got(table) == brute(names)
    # a crash leaves the last committed state: files are named by version, state.json last
    d = decision_dir(tmp_path, t, TOL)
    assert len(list(d.glob("kept-*.npz"))) == len(list(d.glob("losers-*.parquet"))) == 1
    # another threshold, or another tolerance, keeps its own decision
    _, info = decide_incremental(tmp_path, 40, TOL, [(n, "v1") for n in names[:2]], load)
    assert info["reused"] == 0 and chunks_for(40) == 0
    other, info = decide_incremental(tmp_path, t, 255, changed[:2], load)
    assert info["reused"] == 0 and got(other) == brute(names[:2], 255) != brute(names[:2])
    assert decision_dir(tmp_path, t, 255) != d and (d / "state.json").exists()


def test_the_index_stays_small_at_pd12m_size():
    ix = HashIndex(10, TOL)
    # the arrays a 12.4M index holds: hashes and colour signatures, 3 chunk tables of
    # 2^21-2^22 offsets, members and their hashes in bucket order (measured by `flowmatch bench
    # neardup`)
    rows = 12_400_000
    size = rows * (8 + SIGNATURE_BYTES)
    size += sum((2**w + 1) * 4 + rows * (4 + 8) for w in ix.widths)
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
        # the planted copies, colours agreeing: random rows close in bits fail the colour
        assert r["planted"] == 10 and r["found"] == 10 <= r["found_hash_only"]
    assert 0 < out["projected_12m_index_mb"] < out["goals"]["index_mb"]
    assert out["brute_projected_12m_partition_cpu_s"] > 0 and out["command"].endswith(
        "--sizes 3000,6000"
    )
