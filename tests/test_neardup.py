"""Near-duplicates, the perceptual detector (issue 48): planted copies of a sample's own images
(re-encoded at quality 40, resized 0.5x and back, cropped 4%, a 10-px border added) stored by
the real metadata + images stages are found across partitions, unrelated look-alikes (same
shape and colour) are kept, the kept samples do not depend on the order the partitions were materialized in, and a threshold
or colour tolerance change re-decides the near duplicates alone."""

from __future__ import annotations

import hashlib
import io
import json
from functools import partial
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from flowmatch_assets.catalog import Catalog, record_card_rows
from flowmatch_assets.cli.main import main
from flowmatch_assets.cli.reports import _neardup
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.demo.dataset import draw_image, near_copy
from flowmatch_assets.ingest import neardup
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_assets.ingest.neardup_colour import colour_difference
from flowmatch_assets.reports.data_card import card_rows

KEYS = ["000-00", "001-00"]
BASES = 12


def _jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


#: the planted copies, made as the demo sample makes its own (near_copy)
VARIANTS = {how: partial(near_copy, how=how) for how in ("q40", "half", "crop4", "border")}


def _words(caption: str) -> tuple[str, str]:
    w = caption.split()
    return w[2], w[3]  # colour, shape


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Two metadata files: 000 holds the originals and look-alikes of some, 001 the planted
    copies (4 per original) and more look-alikes. Yields (sample dir, {copy id: original id},
    look-alike ids, original ids)."""
    base = tmp_path_factory.mktemp("neardup")
    img_dir, md = base / "images", base / "metadata"
    img_dir.mkdir()
    md.mkdir()
    rng = np.random.default_rng(3)
    files: list[list[dict]] = [[], []]
    planted_of, lookalikes, originals = {}, [], []

    def add(fno: int, rid: str, img: Image.Image, caption: str) -> None:
        data = _jpeg(img)
        (img_dir / f"{rid}.jpg").write_bytes(data)
        files[fno].append(
            {
                "id": rid,
                "url": f"file:images/{rid}.jpg",
                "caption": caption,
                "width": img.width,
                "height": img.height,
                "mime_type": "image/jpeg",
                "hash": hashlib.md5(data).hexdigest(),
                "license": "cc0-1.0",
                "source": "test",
            }
        )

    sides = (520, 800)
    for b in range(BASES):
        img, cap = draw_image(rng, long_sides=sides)
        add(0, f"orig-{b:02d}", img, cap)
        originals.append(f"orig-{b:02d}")
        for name, f in VARIANTS.items():
            add(1, f"copy-{b:02d}-{name}", f(img), cap)
            planted_of[f"copy-{b:02d}-{name}"] = f"orig-{b:02d}"
        colour, shape = _words(cap)
        for k in range(2):  # unrelated: the same shape and colour, drawn anew
            for _ in range(200):
                other, ocap = draw_image(rng, shapes=(shape,), long_sides=sides)
                if _words(ocap) == (colour, shape):
                    break
            add(k, f"alike-{b:02d}-{k}", other, ocap)
            lookalikes.append(f"alike-{b:02d}-{k}")
    for n, rows in enumerate(files):
        pq.write_table(pa.Table.from_pylist(rows), md / f"pd12m.{n:03d}.parquet")
    return base, planted_of, lookalikes, originals


def _materialize(data: Path, sample: Path, order: list[str]) -> FlowmatchResource:
    res = FlowmatchResource(
        data_root=str(data),
        metadata_source=str(sample / "metadata"),
        ingest=IngestConfig(file_root=str(sample), threads=2),
    )
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        for k in order:
            r = dg.materialize(
                list(defs.assets),
                selection=["metadata", "images"],
                partition_key=k,
                instance=instance,
                resources=resources_for(res),
            )
            assert r.success
    return res


def _kept_and_losers(data: Path) -> tuple[set[str], dict[str, str]]:
    rows = Catalog(data).query("SELECT id, outcome, reason, kept_id FROM dataset_rows")
    kept = {r["id"] for r in rows if r["outcome"] == "stored"}
    losers = {r["id"]: r["kept_id"] for r in rows if r["reason"] == "near_duplicate"}
    return kept, losers


def _card_outcomes(data: Path, scope: str) -> dict[str, int]:
    rows = Catalog(data).query(
        "SELECT item, value FROM data_card WHERE scope = ? AND section = 'outcome'", [scope]
    )
    return {r["item"]: int(r["value"]) for r in rows}


def test_planted_near_duplicates_are_found_in_any_order_and_look_alikes_kept(
    tmp_path, planted, capsys, monkeypatch
):
    sample, planted_of, lookalikes, originals = planted
    fwd = tmp_path / "fwd"
    res = _materialize(fwd, sample, KEYS)
    for k in KEYS:  # the data card first (as its asset would), the decision after it
        rows = card_rows(res.layout, res.metadata_source, res.shard_size, k, None, 64)
        record_card_rows(fwd, k, rows)
    assert _card_outcomes(fwd, "dataset").get("filtered:near_duplicate") is None
    capsys.readouterr()
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(fwd))
    assert main(["catalog", "neardup", "--json"]) == 0  # the one command that measures it
    report = json.loads(capsys.readouterr().out)
    kept, losers = _kept_and_losers(fwd)
    right = {i for i, w in losers.items() if planted_of.get(i) == w}
    precision, recall = len(right) / max(1, len(losers)), len(right) / len(planted_of)
    print(f"neardup planted: precision {precision:.3f} recall {recall:.3f} of {len(planted_of)}")
    assert precision >= 0.95 and recall >= 0.95, (precision, recall, losers)
    assert not set(lookalikes) & set(losers), "an unrelated look-alike was removed"
    assert set(originals) <= kept
    assert report["near_duplicates"] == len(losers)
    assert report["kept"] == len(originals) + len(lookalikes) + len(planted_of) - len(losers)
    # the pairs, side by side, the least similar first: the kept image left, its copy right
    png, pairs = neardup.pairs_picture(
        fwd, pq.read_table(neardup.near_path(neardup.DataLayout(fwd)))
    )
    assert report["pairs_png"] == str(png) and all(planted_of[b] == a for a, b in pairs)
    assert Image.open(png).size == (2 * 130 + 2, min(12, len(losers)) * 130 + 2)
    worst = max(
        d
        for d in (r["distance"] for r in Catalog(fwd).query("SELECT distance FROM near_duplicates"))
    )
    first = Catalog(fwd).query("SELECT distance FROM near_duplicates WHERE id = ?", [pairs[0][1]])
    assert first[0]["distance"] == worst
    # the catalog names each loser's detector, distance and winner
    cat = Catalog(fwd)
    rows = cat.query("SELECT * FROM near_duplicates ORDER BY partition, id")
    assert {r["detector"] for r in rows} == {"phash"}
    assert all(0 <= r["distance"] <= neardup.DEFAULT_THRESHOLD for r in rows)
    dups = cat.query("SELECT id, kept_id FROM duplicates WHERE kind = 'near_phash'")
    assert {r["id"]: r["kept_id"] for r in dups} == losers
    failures = {
        (r["outcome"], r["reason"]): r["rows"]
        for r in cat.query(
            "SELECT outcome, reason, count(*) AS rows FROM dataset_rows GROUP BY ALL"
        )
    }
    assert failures[("filtered", "near_duplicate")] == len(losers)
    by_reason = {(r["asset"], r["reason"]): r["rows"] for r in cat.failures_by_reason()}
    assert by_reason[("images", "near_duplicate")] == len(losers)  # `flowmatch catalog failures`
    # the data card follows the decision made after it (its summary is redone)
    assert _card_outcomes(fwd, "001-00")["filtered:near_duplicate"] == len(losers)
    assert _card_outcomes(fwd, "dataset")["filtered:near_duplicate"] == len(losers)
    assert _card_outcomes(fwd, "dataset")["stored"] == report["kept"]

    # reverse order: 001-00 first (its copies stored, nothing earlier to lose to), then
    # 000-00; the same samples are kept, each loser names the same winner
    rev = tmp_path / "rev"
    _materialize(rev, sample, KEYS[::-1])
    _neardup(Catalog(rev), None, True)
    assert _kept_and_losers(rev) == (kept, losers)

    # incremental: deciding again reads the small hash records, never an images shard again
    records = {p: p.stat().st_mtime_ns for p in neardup.phash_dir(rev).glob("*.parquet")}
    _neardup(Catalog(rev), None, True)
    assert {p: p.stat().st_mtime_ns for p in records} == records
    # a record of the version before the colour check (no colour column) is hashed again
    rec = neardup.phash_dir(rev) / f"{KEYS[0]}.parquet"
    old = pq.read_table(rec)
    shard = {b"flowmatch_shard": old.schema.metadata[b"flowmatch_shard"]}
    pq.write_table(old.drop_columns(["colour"]).replace_schema_metadata(shard), rec)
    _neardup(Catalog(rev), None, True)
    assert pq.read_table(rec).equals(old) and _kept_and_losers(rev) == (kept, losers)


def test_a_threshold_change_re_decides_the_near_duplicates_alone(tmp_path, planted, zoo, capsys):
    """The originals and their look-alikes with every embedding made (the tiny zoo encoders):
    re-deciding at another pHash threshold or with the CLS detector on changes the outcomes
    and leaves every asset partition fresh, every shard and hash record as it was."""
    from flowmatch_assets.defs.definitions import all_assets_and_checks
    from flowmatch_assets.freshness.fingerprints import staleness
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage.layout import PARTITIONED_ASSETS

    sample, _, lookalikes, originals = planted
    data = tmp_path / "data"
    res = FlowmatchResource(
        data_root=str(data),
        metadata_source=str(sample / "metadata"),
        ingest=IngestConfig(file_root=str(sample), threads=2),
        encoders=EncoderSpec(**zoo, batch_size=8),
    )
    kinds = ["vae_latents", "dino_features", "text_embeddings"]
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        r = dg.materialize(
            all_assets_and_checks(),
            selection=["metadata", "images", *kinds],
            partition_key=KEYS[0],  # the originals and their look-alikes only
            instance=instance,
            resources=resources_for(res),
        )
        assert r.success
    assert staleness(res, None, list(PARTITIONED_ASSETS)) == []
    _neardup(Catalog(data), None, True)
    assert _kept_and_losers(data)[1] == {}

    def snapshot() -> dict[str, int]:  # every file but the catalog (the decision lives there)
        return {
            str(p.relative_to(data)): p.stat().st_mtime_ns
            for p in data.rglob("*")
            if p.is_file() and not str(p.relative_to(data)).startswith(("catalog", "reports"))
        }

    before = snapshot()
    assert any(k.startswith("dino_features/") for k in before)
    hashes = {p: p.stat().st_mtime_ns for p in neardup.phash_dir(data).glob("*.parquet")}
    _neardup(Catalog(data), 40, True, colour_tolerance=255)  # far too loose, the hash alone
    loose = _kept_and_losers(data)[1]
    assert loose, "a 40-bit threshold should call some look-alikes duplicates"
    png = data / "reports" / "near_duplicates.png"
    assert png.is_file()  # the pairs, side by side
    _neardup(Catalog(data), 40, True)  # the colour check keeps those in other colours
    assert set(_kept_and_losers(data)[1]) < set(loose)
    _neardup(Catalog(data), neardup.DEFAULT_THRESHOLD, True, min_cosine=-1.0)  # every CLS "near"
    kept, losers = _kept_and_losers(data)
    assert kept == {"orig-00"} and len(losers) == len(originals) + len(lookalikes) // 2 - 1
    cls = Catalog(data).query("SELECT DISTINCT detector FROM near_duplicates")
    assert cls == [{"detector": "dino_cls"}]
    _neardup(Catalog(data), neardup.DEFAULT_THRESHOLD, True)
    assert _kept_and_losers(data)[1] == {}
    assert not png.exists()  # no pairs now: the earlier decision's picture is gone
    # nothing upstream read the settings: every partition fresh, no file rewritten
    assert staleness(res, None, list(PARTITIONED_ASSETS)) == []
    assert snapshot() == before
    assert {p: p.stat().st_mtime_ns for p in hashes} == hashes
    meta = pq.read_schema(neardup.near_path(neardup.DataLayout(data))).metadata
    settings = json.loads(meta[b"flowmatch_neardup"])["thresholds"]
    assert settings == {"phash": 10, "phash_colour": 10, "dino_cls": None}


def test_the_decision_keeps_the_earliest_and_compares_with_kept_rows_only():
    """A chain a ~ b ~ c where a and c are far apart: b loses to a, c (compared with the
    kept a only) is kept; d near c loses to it unless its colours differ; blocks do not change
    the result."""
    a = np.uint64(0)
    b = np.uint64((1 << 6) - 1)  # 6 bits from a
    c = np.uint64((1 << 12) - 1)  # 6 bits from b, 12 from a
    d = np.uint64((1 << 12) - 1 + (1 << 40))  # 1 bit from c
    h = np.array([a, b, c, d], np.uint64)
    c = np.zeros((4, 32), np.uint8)
    other = c.copy()
    other[3, 4:8] = 11  # d in another colour: 4 cells, each 1 past the default tolerance
    for block in (1, 2, 1024):
        w, dist = neardup.decide(h, 8, c, block=block)
        assert w.tolist() == [-1, 0, -1, 2] and dist.tolist() == [0, 6, 0, 1]
        w, dist = neardup.decide(h, 8, other, block=block)
        assert w.tolist() == [-1, 0, -1, -1] and dist.tolist() == [0, 6, 0, 0]


def test_the_hash_at_the_stored_size_keeps_copies_close_and_look_alikes_far():
    """On 256 px images themselves (a 10-px border is then 4% of a side: the flat frame is
    trimmed before hashing): every copy within the default threshold of its original and its
    colours well within the default tolerance, every look-alike (same shape and colour)
    beyond the threshold."""
    rng = np.random.default_rng(5)
    thr = neardup.DEFAULT_THRESHOLD
    originals, alikes = [], []
    for _ in range(16):
        img, cap = draw_image(rng, long_sides=(300, 400))
        originals.append(ImageOps.fit(img, (256, 256)))
        colour, shape = _words(cap)
        for _ in range(200):
            other, ocap = draw_image(rng, shapes=(shape,), long_sides=(300, 400))
            if _words(ocap) == (colour, shape):
                break
        alikes.append(ImageOps.fit(other, (256, 256)))
    h, c = neardup.signatures(originals)
    for name, f in VARIANTS.items():
        copies = [ImageOps.fit(f(im), (256, 256)) for im in originals]
        hc, cc = neardup.signatures(copies)
        d = neardup.hamming(h, hc)
        assert d.max() <= thr, (name, d.tolist())
        diff = colour_difference(c, cc)
        print(f"{name}: colours {diff.max()} apart at most")  # measured 2, 1, 6.25, 3
        assert diff.max() <= 0.7 * neardup.DEFAULT_COLOUR_TOLERANCE, (name, diff.tolist())
    d = neardup.hamming(h[:, None], neardup.phash(originals + alikes)[None, :])
    d[np.arange(16), np.arange(16)] = 64  # each image with itself
    far = int(d.min())
    assert far > thr, far


def test_the_semantic_detector_finds_planted_neighbours_in_stored_cls_vectors(tmp_path):
    """dino_features shards of two partitions (the real store) with planted neighbours: a
    row whose CLS has cosine >= 0.9 with an earlier kept row's loses to it, across partitions
    and within one; a row near only a loser is kept; rows the pHash removed take no part."""
    from flowmatch_models.storage.layout import DataLayout
    from flowmatch_models.storage.store import write_shard

    rng = np.random.default_rng(0)
    layout = DataLayout(tmp_path)
    a = rng.normal(size=(40, 384)).astype(np.float32)
    b = rng.normal(size=(40, 384)).astype(np.float32)

    def near(v: np.ndarray, eps: float = 0.2) -> np.ndarray:  # cosine ~0.98
        return v + eps * np.linalg.norm(v) / np.sqrt(384) * rng.normal(size=384)

    want = {}
    for k in range(8):  # b's rows 0..7: neighbours of a's rows 10..17 (across partitions)
        b[k] = near(a[10 + k])
        want[("001-00", f"b{k}")] = ("000-00", f"a{10 + k}")
    b[20] = near(b[15])  # within a partition
    want[("001-00", "b20")] = ("001-00", "b15")
    # a chain: b30 is near a loser (b0) but not near its winner a10 -> kept
    u0, ua = b[0] / np.linalg.norm(b[0]), a[10] / np.linalg.norm(a[10])
    e = ua - (ua @ u0) * u0
    b[30] = 0.92 * u0 - np.sqrt(1 - 0.92**2) * e / np.linalg.norm(e)  # 0.92 to b0, ~0.82 to a10
    for name, p, v in (("a", "000-00", a), ("b", "001-00", b)):
        write_shard(
            layout.asset_path("dino_features", p),
            {"cls": v},
            [f"{name}{i}" for i in range(len(v))],
        )
    t = neardup.semantic_duplicates(tmp_path, 0.9, ["001-00", "000-00"])
    got = {
        (p, i): (kp, ki)
        for p, i, kp, ki in zip(
            *(t.column(c).to_pylist() for c in ("partition", "id", "kept_partition", "kept_id"))
        )
    }
    assert got == want
    assert min(t.column("similarity").to_pylist()) >= 0.9
    assert set(t.column("detector").to_pylist()) == {"dino_cls"}
    # a row already removed by the pHash (a10) is no winner: its neighbour b0 is kept, and
    # b30 (near b0, now kept) loses to it
    t2 = neardup.semantic_duplicates(tmp_path, 0.9, ["000-00", "001-00"], {("000-00", "a10")})
    got2 = dict(zip(t2.column("id").to_pylist(), t2.column("kept_id").to_pylist()))
    want2 = {i: ki for (_, i), (_, ki) in want.items() if i != "b0"} | {"b30": "b0"}
    assert got2 == want2
