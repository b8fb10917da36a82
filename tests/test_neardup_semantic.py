"""The semantic near-duplicate decision within clusters (``ingest/neardup_semantic.py``): equal
to brute force where every near pair shares a cluster, its recall on planted copies otherwise,
never a pair below the threshold, and the same losers whatever the materialization order."""

from __future__ import annotations

import numpy as np
import pytest

from flowmatch_assets.bench.semdedup import clustered as synthetic
from flowmatch_assets.ingest import neardup
from flowmatch_assets.ingest import neardup_semantic as sem


def clustered(n: int, d: int, centers: int, share: float, spread: float, seed: int):
    """Unit rows around ``centers`` random centres (``spread``: noise to centre) and
    ``share * n`` planted copies: a row of the second half at cosine 0.95-0.99 with a row of the
    first half (the bench's). Returns (vectors, centres)."""
    return synthetic(np.random.default_rng(seed), n, d, centers, share, spread)


def test_the_clustered_decision_equals_brute_force_when_near_pairs_share_a_cluster():
    """Tight clusters, their centres as the centroids: every pair at cosine >= 0.9 shares a
    home cluster, so the decision is brute force's, winner for winner, cosine for cosine, in
    any block size (blocks see kept rows before them, then settle their own pairs in order)."""
    v, c = clustered(3000, 256, 12, 0.03, 0.5, seed=1)
    ref_w, ref_c = neardup.decide_cosine(v, 0.9)
    losers = np.flatnonzero(ref_w >= 0)
    assert 80 <= len(losers) <= 95  # the 90 planted copies (a few share a source)
    for block in (64, 1000, 65536):
        for probes in (1, 2):
            w, cos = sem.decide_clustered(v, 0.9, c, probes=probes, block=block)
            assert np.array_equal(w, ref_w), (block, probes)
            np.testing.assert_allclose(cos, ref_c, atol=1e-5)
    # one cluster: brute force itself
    w, cos = sem.decide_clustered(v, 0.9, c[:1], probes=1, block=128)
    assert np.array_equal(w, ref_w)


def test_chains_and_order_inside_a_block():
    """a ~ b ~ c with a, c apart: b loses to a, c is kept (compared with kept rows only); d
    near c loses to c; one block or one row a block."""
    rng = np.random.default_rng(2)
    a = sem.unit(rng.standard_normal((1, 64)))[0]
    e = sem.unit(rng.standard_normal((1, 64)))[0]
    e = sem.unit((e - (e @ a) * a)[None])[0]

    def at(angle: float) -> np.ndarray:
        return np.cos(angle) * a + np.sin(angle) * e

    t = np.arccos(0.93)
    v = np.stack([at(0), at(t), at(2 * t), at(2 * t + 0.05), at(np.pi)]).astype(np.float32)
    ref_w, _ = neardup.decide_cosine(v, 0.9)
    assert ref_w.tolist() == [-1, 0, -1, 2, -1]
    for block in (1, 2, 5):
        w, cos = sem.decide_clustered(v, 0.9, v[:1], probes=1, block=block)
        assert w.tolist() == ref_w.tolist(), block
        assert cos[1] == pytest.approx(0.93, abs=1e-5)


def test_recall_on_planted_copies_against_brute_force_and_no_pair_below_the_threshold():
    """Fitted centroids (spherical k-means, 2x more than the data's centres, so clusters are
    cut), 4,000 rows of dim 384 with 80 planted copies: recall >= 0.95 with one probe (79 of
    80 when written: one pair is split across clusters), all of them with the default two, no
    row removed that brute force keeps, and every removed row at cosine >= the threshold with
    an earlier kept row."""
    v, _ = clustered(4000, 384, 40, 0.02, 1.5, seed=5)
    ref_w, _ = neardup.decide_cosine(v, 0.9)
    ref = set(np.flatnonzero(ref_w >= 0).tolist())
    assert len(ref) == 80
    c = sem.fit_centroids(v, sem.clusters_for(len(v)))
    assert len(c) == 80
    recalls = {}
    for probes in (1, 2):
        w, cos = sem.decide_clustered(v, 0.9, c, probes=probes)
        lost = np.flatnonzero(w >= 0)
        got = set(lost.tolist())
        recalls[probes] = len(got & ref) / len(ref)
        assert got <= ref  # nothing brute force keeps
        assert (w[lost] < lost).all() and (w[w[lost]] == -1).all()  # earlier, kept
        real = np.einsum("ij,ij->i", v[lost], v[w[lost]])
        assert real.min() >= 0.9
        np.testing.assert_allclose(cos[lost], real, atol=1e-5)
    assert recalls[1] >= 0.95 and recalls[2] == 1.0, recalls


def _write(root, partition: str, rows: np.ndarray) -> None:
    from flowmatch_models.storage.layout import DataLayout
    from flowmatch_models.storage.store import write_shard

    path = DataLayout(root).asset_path("dino_features", partition)
    write_shard(path, {"cls": rows}, [f"{partition}-{i}" for i in range(len(rows))])


def _losers(t) -> dict:
    cols = ("partition", "id", "kept_partition", "kept_id")
    return {(p, i): (kp, ki) for p, i, kp, ki in zip(*(t.column(c).to_pylist() for c in cols))}


def test_any_materialization_order_keeps_the_same_rows_and_appends_reuse_the_centroids(
    tmp_path, monkeypatch
):
    """Four partitions with copies across them, materialized (and decided after each) in two
    orders: the same losers as one decision over all four, and as brute force; the centroids
    are fitted once the first partitions hold FIT_ROWS rows and an appended partition is
    assigned to them (the stored file stays as it was), where an earlier one refits."""
    monkeypatch.setattr(sem, "FIT_ROWS", 600)
    monkeypatch.setattr(sem, "ROWS_PER_CLUSTER", 20)  # 30 centroids
    v, _ = clustered(1600, 96, 10, 0.04, 0.8, seed=4)
    parts = {f"00{k}-00": v[400 * k : 400 * (k + 1)] for k in range(4)}
    names = sorted(parts)

    def run(root, order):
        for k, p in enumerate(order):
            _write(root, p, parts[p])
            t = neardup.semantic_duplicates(root, 0.9, order[: k + 1])
        return _losers(t)

    for p in names:
        _write(tmp_path / "brute", p, parts[p])
    want = _losers(neardup.semantic_duplicates(tmp_path / "brute", 0.9, names, brute=True))
    assert len(want) >= 55
    forward = tmp_path / "forward"
    got = []
    for k, p in enumerate(names):
        _write(forward, p, parts[p])
        got.append(_losers(neardup.semantic_duplicates(forward, 0.9, names[: k + 1])))
        files = sorted(sem.centroid_dir(forward).glob("centroids-*.npy"))
        assert len(files) == 1
        if k == 1:  # 800 rows: the sample (the first 600) is complete
            fitted = (files[0], files[0].stat().st_mtime_ns)
        if k > 1:  # appended partitions: assigned to the stored centroids, not refitted
            assert (files[0], files[0].stat().st_mtime_ns) == fitted
    assert got[-1] == want
    shuffled = tmp_path / "shuffled"
    assert run(shuffled, ["003-00", "001-00", "000-00", "002-00"]) == want
    # shuffled's last decision saw the same sample: the same centroids, byte for byte
    a = np.load(fitted[0])
    (b,) = sem.centroid_dir(shuffled).glob("centroids-*.npy")
    assert b.name == fitted[0].name and np.array_equal(np.load(b), a)


def test_the_stored_cls_test_through_real_clusters(tmp_path, monkeypatch):
    """tests/test_neardup.py's planted CLS neighbours (80 rows: one cluster by default) with 8
    clusters instead: the same losers, the same chain, the same pHash skip."""
    from tests.test_neardup import (
        test_the_semantic_detector_finds_planted_neighbours_in_stored_cls_vectors as planted,
    )

    monkeypatch.setattr(sem, "ROWS_PER_CLUSTER", 10)
    planted(tmp_path)
    (f,) = sem.centroid_dir(tmp_path).glob("centroids-*.npy")
    assert np.load(f).shape == (8, 384)
