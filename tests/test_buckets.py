"""Aspect-ratio buckets (issue 21, first part): the bucket table, images cutting each image
to its nearest bucket with the smallest crop, the stored size and kept share per row, the data
card's bucket and crop panels, and the fingerprint: in a real Dagster instance and DuckDB file
on the embedded sample (whose originals are 1:1 to 3:1, landscape and portrait)."""

from __future__ import annotations

import io
import math
import random
from collections import Counter

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.defs.definitions import all_assets_and_checks, resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness.fingerprints import staleness
from flowmatch_assets.ingest.decode import process_image
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_models.data.buckets import buckets_for, kept_fraction, label, nearest
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.image_shard import read_image_meta
from flowmatch_models.storage.store import read_shard
from tests.conftest import make_resource


def test_the_bucket_table_is_the_32_pixel_grid_at_the_256_pixel_budget():
    b = buckets_for(256)
    assert [label(x) for x in b] == [
        "192x384",
        "192x352",
        "192x320",
        "224x320",
        "224x288",
        "224x256",
        "256x256",
        "256x224",
        "288x224",
        "320x224",
        "320x192",
        "352x192",
        "384x192",
    ]
    for h, w in b:
        assert h % 32 == 0 and w % 32 == 0
        assert abs(h * w / 65536 - 1) <= 0.125
        assert 0.5 <= h / w <= 2
        assert (w, h) in b  # portrait and landscape alike
    tokens = [(h // 32) * (w // 32) for h, w in b]
    assert min(tokens) == 56 and max(tokens) == 72 and 62 <= np.mean(tokens) <= 66
    # the nearest bucket is the one whose crop keeps the most (brute force over every bucket)
    rng = random.Random(0)
    for _ in range(2000):
        w, h = rng.randint(64, 6000), rng.randint(64, 6000)
        best = max(kept_fraction(w, h, x) for x in b)
        assert kept_fraction(w, h, nearest(w, h, b)) == pytest.approx(best, abs=1e-12)
    assert nearest(1000, 1000, b) == (256, 256) and kept_fraction(1000, 1000, (256, 256)) == 1
    assert nearest(3000, 1000, b) == (192, 384)  # 3:1 -> the widest, keeping 2/3
    assert kept_fraction(3000, 1000, (192, 384)) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="not a multiple of the 32-pixel grid"):
        buckets_for(250)


def _jpeg(a: np.ndarray, orientation: int | None = None, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(a)
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        im.save(buf, fmt, exif=exif, quality=95)
    else:
        im.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _red(o: np.ndarray) -> np.ndarray:
    return (o[..., 0] > 200) & (o[..., 1] < 80) & (o[..., 2] < 80)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])  # the simplejpeg and the Pillow paths
def test_a_3_by_2_photo_keeps_what_is_at_its_sides(fmt):
    """A red mark at the left edge of a 1500x1000 picture: the centre square cuts it away,
    the 224x320 bucket keeps it, on the left, and the grey stays grey."""
    a = np.full((1000, 1500, 3), 128, np.uint8)
    a[450:550, 20:120] = (255, 0, 0)
    sq, w, h = process_image(_jpeg(a, fmt=fmt), IngestConfig())
    out, _, _ = process_image(_jpeg(a, fmt=fmt), IngestConfig(buckets="aspect"))
    sq, out = (np.asarray(Image.open(io.BytesIO(x)).convert("RGB")) for x in (sq, out))
    assert (w, h) == (1500, 1000) and sq.shape == (256, 256, 3) and out.shape == (224, 320, 3)
    assert _red(sq).sum() == 0
    cols = np.where(_red(out).any(0))[0]
    # 1500x1000 covers 320x224 at 320/1500 = 0.2133 (height 213.3 < 224: scale by 224/1000
    # = 0.224, width 336, 8 px cut each side): the mark at x 20-120 lands at x ~-4 to ~19
    assert cols.min() == 0 and 15 <= cols.max() <= 21, cols
    rows = np.where(_red(out).any(1))[0]
    assert abs((rows.min() + rows.max()) / 2 - 112) <= 2  # vertically centred
    grey = out[150:, 100:]
    assert np.abs(grey.astype(int) - 128).max() <= 6


@pytest.mark.parametrize("path", ["simplejpeg", "pillow"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_is_cut_like_the_picture_as_shown(orientation, path, monkeypatch):
    """A 1500x1000 JPEG with a mark off centre (upper left) under each EXIF orientation, on the
    libjpeg-turbo path and on Pillow's: the output equals the reference (turn the full picture
    as a viewer shows it, pick its nearest bucket, resize to cover, crop the centre) within JPEG
    noise, and the mark is where the reference has it."""
    import flowmatch_assets.ingest.decode as images

    if path == "pillow":
        monkeypatch.setattr(images, "simplejpeg", None)
    a = np.full((1000, 1500, 3), 128, np.uint8)
    a[150:350, 200:450] = (255, 0, 0)
    data = _jpeg(a, orientation)
    out, w, h = process_image(data, IngestConfig(buckets="aspect"))
    got = np.asarray(Image.open(io.BytesIO(out)).convert("RGB"))

    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")  # as a viewer
    W, H = shown.size
    assert (w, h) == (W, H)
    bh, bw = nearest(W, H, buckets_for(256))
    scale = max(bw / W, bh / H)
    rw, rh = round(W * scale), round(H * scale)
    big = shown.resize((rw, rh), Image.Resampling.LANCZOS)
    left, top = (rw - bw) // 2, (rh - bh) // 2
    want = np.asarray(big.crop((left, top, left + bw, top + bh)))
    assert got.shape == want.shape == (bh, bw, 3)
    err = np.abs(got.astype(int) - want.astype(int)).mean()
    assert err < 2.5, err
    g, r = _red(got), _red(want)
    assert r.sum() > 1000  # the mark is in the crop: the comparison means something
    assert (g & r).sum() >= 0.9 * r.sum() and (g & ~r).sum() <= 0.1 * r.sum()


def test_aspect_buckets_through_the_images_asset_and_the_data_card(tmp_path, small_sample, zoo):
    """The sample's partition (originals 1:1 to 3:1, both orientations) with ingest.buckets:
    aspect: every stored row is at its original's nearest bucket and decodes to that size, the
    row's kept share is the crop's, the check passes, the catalog's data card counts the
    buckets and the kept shares as the shard has them; switching back to squares makes the
    shard stale, naming the setting; the embeddings are computed per bucket (the cell layout,
    each sample as its image encoded alone)."""
    data = tmp_path / "data"
    enc = EncoderSpec(**zoo, batch_size=8)
    aspect = FlowmatchResource(
        data_root=str(data),
        metadata_source=small_sample["metadata"],
        shard_size=10_000,
        ingest=IngestConfig(file_root=small_sample["dest"], threads=4, buckets="aspect"),
        encoders=enc,
    )
    key = "000-00"
    with dg.instance_for_test() as instance:
        register_partitions(instance, aspect)
        result = dg.materialize(
            all_assets_and_checks(),
            selection=["metadata", "images", "data_card"],
            partition_key=key,
            instance=instance,
            resources=resources_for(aspect),
        )
        assert result.success
        checks = {
            e.check_name: e.passed for e in result.get_asset_check_evaluations()
        }  # the size check reads every stored size
        assert checks["images_complete"] is True
        # one row per partition in the UI's check table (a partitioned check, not "-")
        parts = {e.check_name: e.partition for e in result.get_asset_check_evaluations()}
        assert parts["images_complete"] == key
        # evaluated after the materialization it checks (its metadata says when)
        mat = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("images"), asset_partitions=[key]), limit=1
        ).records[0]
        ev = [e for e in result.get_asset_check_evaluations() if e.check_name == "images_complete"]
        assert ev[0].metadata["evaluated_at"].value >= mat.timestamp
        md = result.asset_materializations_for_node("images")[0].metadata

        shard = data / "images" / f"{key}.parquet"
        rows = pq.read_table(shard).to_pylist()
        assert len(rows) >= 5
        table = buckets_for(256)
        for r in rows:
            want = nearest(r["orig_width"], r["orig_height"], table)
            assert (r["height"], r["width"]) == want, r["id"]
            im = Image.open(io.BytesIO(r["image"]))
            assert im.size == (want[1], want[0])
            # the crop's share of the original, from the crop itself: the original covers the
            # bucket at scale s, so the crop is (bw / s) x (bh / s) of its pixels
            ow, oh, (bh, bw) = r["orig_width"], r["orig_height"], want
            s = max(bw / ow, bh / oh)
            assert r["kept"] == pytest.approx((bw / s) * (bh / s) / (ow * oh), rel=1e-6)
            assert r["kept"] >= kept_fraction(r["orig_width"], r["orig_height"], (256, 256)) - 1e-6
        sizes = Counter(f"{r['height']}x{r['width']}" for r in rows)
        assert len(sizes) >= 2, sizes  # the sample is mixed: this test means something
        assert md["buckets"].value == dict(sizes)
        assert md["kept_mean"].value == pytest.approx(np.mean([r["kept"] for r in rows]), abs=1e-4)

        cat = Catalog(data)
        card = cat.query("SELECT section, item, value, share FROM data_card WHERE scope = ?", [key])
        got = {r["item"]: int(r["value"]) for r in card if r["section"] == "bucket"}
        assert got == dict(sizes)
        share = sum(r["share"] for r in card if r["section"] == "bucket")
        assert share == pytest.approx(1.0)
        kept = {r["item"]: r["value"] for r in card if r["section"] == "kept"}
        assert kept["mean"] == pytest.approx(np.mean([r["kept"] for r in rows]), abs=1e-6)
        assert kept["max"] == pytest.approx(max(r["kept"] for r in rows), abs=1e-6)

        # the square mode's fingerprint is the one from before buckets: switching back makes
        # this shard stale, and the reason names the buckets
        square = make_resource(data, small_sample, encoders=enc)
        (s,) = [x for x in staleness(square, [key], ["images"])]
        assert s.asset == "images" and "buckets" in str(s.reason)
        assert staleness(aspect, [key], ["images"]) == []

        # a retry under the other mode would mix two crops in one shard: refused, one line
        retry = dg.materialize(
            all_assets_and_checks(),
            selection=["images"],
            partition_key=key,
            instance=instance,
            resources=resources_for(square),
            run_config={"ops": {"images": {"config": {"retry": True}}}},
            raise_on_error=False,
        )
        assert not retry.success
        why = str(retry.get_step_failure_events()[0].event_specific_data.error)
        assert "would not make; re-materialize images without retry" in why
        assert pq.read_table(shard).to_pylist() == rows  # nothing replaced

        # the embeddings per bucket: one pass, the cell layout, every sample as encoded alone
        emb = dg.materialize(
            all_assets_and_checks(),
            selection=["vae_latents", "dino_features", "text_embeddings"],
            partition_key=key,
            instance=instance,
            resources=resources_for(aspect),
        )
        assert emb.success
        assert all(e.passed for e in emb.get_asset_check_evaluations())
    vae = read_shard(aspect.layout.asset_path("vae_latents", key), verify=True)
    dino = read_shard(aspect.layout.asset_path("dino_features", key), verify=True)
    grid = np.asarray(vae["grid"])
    assert grid.tolist() == [[r["height"] // 32, r["width"] // 32] for r in rows]
    assert np.array_equal(np.asarray(dino["grid"]), grid)
    cells = grid.prod(1)
    offsets = np.concatenate([[0], np.cumsum(cells)])
    assert vae["latents"].shape == (offsets[-1], 32)
    from flowmatch_models.encoders.frozen import Encoders

    encoders = Encoders(EncoderSpec(**zoo, device="cpu"))
    for i in (0, int(np.argmax(cells != 64)), len(rows) - 1):
        im = np.asarray(Image.open(io.BytesIO(rows[i]["image"])).convert("RGB"))[None]
        lat = encoders.encode_vae(im)[0]  # [32, h, w]
        assert lat.shape == (32, *grid[i])
        mine = np.asarray(vae["latents"][offsets[i] : offsets[i + 1]]).reshape(lat.shape)
        np.testing.assert_allclose(mine.astype(np.float32), lat.astype(np.float32), atol=2e-3)
        patch = encoders.encode_dino(im)[0][0]  # [h*w, D], stored coded (pca4): approximate
        got = np.asarray(dino["patch"][offsets[i] : offsets[i + 1]], np.float32)
        assert got.shape == patch.shape
        cos = (got * patch).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(patch, axis=1)
        assert cos.min() > 0.9, cos.min()


def test_shards_from_before_buckets_read_as_squares(tmp_path):
    """An images shard written before the size columns: its rows read as size x size
    squares with kept = short side / long side."""
    import pyarrow as pa

    p = tmp_path / "old.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "caption": ["x", "y"],
                "image": [b"", b""],
                "format": ["jpeg"] * 2,
                "orig_width": [1500, 800],
                "orig_height": [1000, 800],
                "md5": ["0", "1"],
                "url": ["u", "v"],
            },
            schema=pa.schema(
                [
                    (f.name, f.type)
                    for f in __import__(
                        "flowmatch_models.storage.image_shard"
                    ).storage.image_shard.IMAGE_SHARD_SCHEMA
                    if f.name not in ("height", "width", "kept")
                ]
            ),
        ),
        p,
    )
    with_images = read_image_meta(p, 256, images=True).to_pylist()  # what a retry merges
    assert [r["image"] for r in with_images] == [b"", b""]
    assert [(r["height"], r["width"], round(r["kept"], 6)) for r in with_images] == [
        (256, 256, round(2 / 3, 6)),
        (256, 256, 1.0),
    ]
    t = read_image_meta(p, 256).to_pylist()
    assert [(r["height"], r["width"]) for r in t] == [(256, 256), (256, 256)]
    assert [r["kept"] for r in t] == pytest.approx([2 / 3, 1.0])
    assert math.isclose(t[0]["kept"], 1000 / 1500, rel_tol=1e-6)


def test_sampling_sizes_are_whole_latent_grids():
    from flowmatch_models.inference.sample import latent_grid

    assert latent_grid((224, 320)) == (7, 10) and latent_grid(None) is None
    with pytest.raises(ValueError, match="multiples of 32.*192x384"):
        latent_grid((250, 256))


def test_the_size_check_fails_on_a_wrong_or_unknown_size(tmp_path):
    """images_complete's size check: a row whose image is not the size it says, and a size
    that is no bucket of the settings, are both reported."""
    from flowmatch_assets.defs.data_assets import _size_problems
    from flowmatch_models.storage.image_shard import write_image_shard

    def row(i, img_hw, says_hw):
        buf = io.BytesIO()
        Image.new("RGB", img_hw[::-1], (90, 90, 90)).save(buf, "JPEG")
        return {
            "id": str(i),
            "caption": "c",
            "image": buf.getvalue(),
            "format": "jpeg",
            "orig_width": 900,
            "orig_height": 600,
            "md5": str(i),
            "url": "u",
            "height": says_hw[0],
            "width": says_hw[1],
            "kept": 1.0,
        }

    p = tmp_path / "000-00.parquet"
    write_image_shard(p, [row(0, (224, 320), (224, 320)), row(1, (224, 320), (224, 320))])
    assert _size_problems("000-00", p, IngestConfig(buckets="aspect")) == []
    write_image_shard(p, [row(0, (256, 256), (224, 320)), row(1, (200, 300), (200, 300))])
    problems = _size_problems("000-00", p, IngestConfig(buckets="aspect"))
    assert problems == [
        "000-00: stored size 200x300 is not a bucket of ingest (size 256, buckets aspect)",
        "000-00: image shape (256, 256, 3), its row says 224x320",
    ]
    square = _size_problems("000-00", p, IngestConfig())
    assert (
        "000-00: stored size 224x320 is not a bucket of ingest (size 256, buckets square)" in square
    )
    with pytest.raises(ValueError, match="must be a multiple of 32"):
        IngestConfig(size=250, buckets="aspect")


def test_the_centre_square_cuts_side_objects_that_buckets_keep(tmp_path):
    """`flowmatch bench crop` on a small sides sample (24 pictures, 1.3:1 to 2:1, through the
    pipeline both ways): the analyser reads every side object whole in the bucketed images and
    in under 60% of the centre squares; centre objects survive both; the buckets cost about the
    square's 64 latent tokens."""
    from flowmatch_assets.bench.crop import run

    out = run(tmp_path, files=1, rows=24, seed=0)
    sq, asp = out["square"], out["aspect"]
    assert sq["unreadable_originals"] == asp["unreadable_originals"] == 0
    assert sq["sides"]["images"] == asp["sides"]["images"] >= 10
    assert asp["sides"]["all_four_right"] >= 0.9 and sq["sides"]["all_four_right"] <= 0.6
    assert sq["sides"]["shape_right"] < asp["sides"]["shape_right"]
    assert sq["centre"]["all_four_right"] >= 0.9 and asp["centre"]["all_four_right"] >= 0.9
    assert sq["kept_share_mean"] < 0.7 < 0.9 < asp["kept_share_mean"]
    assert sq["tokens_mean"] == 64 and 60 <= asp["tokens_mean"] <= 68

    # the A/B's wiring (`bench crop --train`), in miniature: embeddings both ways, a few steps
    # each (the bucketed run in one-bucket chunks), scored at the square and a wide bucket
    import torch

    from flowmatch_assets.bench.crop import train_both

    sample = {"metadata": str(tmp_path / "sample" / "metadata"), "dest": str(tmp_path / "sample")}
    ab = train_both(
        tmp_path,
        ["000-00"],
        sample,
        steps=4,
        batch=2,
        text_encoder="none",
        sizes=["256x256", "224x320"],
        n_prompts=2,
    )
    for mode in ("square", "aspect"):
        assert set(ab[mode]["sizes"]) == {"256x256", "224x320"}
        assert all(0 <= v <= 1 for r in ab[mode]["sizes"].values() for v in r.values())
        ckpt = torch.load(tmp_path / "runs" / mode / "checkpoints" / "last.ckpt", weights_only=True)
        segs = ckpt["EmbeddingDataModule"]["ledger"]
        assert {s.get("bucket_chunk") for s in segs} == ({2} if mode == "aspect" else {None})


def test_wide_and_tall_evaluation_prompts_keep_the_draws_and_take_their_orientation():
    from flowmatch_assets.reports.caption_eval import parse_caption, prompts

    mixed = [parse_caption(p) for p in prompts(48, 3)]
    wide = [parse_caption(p) for p in prompts(48, 3, orientation="landscape")]
    tall = [parse_caption(p) for p in prompts(48, 3, orientation="portrait")]
    assert {w["position"] for w in wide} == {"left", "centre", "right"}
    assert {t["position"] for t in tall} == {"top", "centre", "bottom"}
    for m, w, t in zip(mixed, wide, tall):
        assert (m["colour"], m["shape"], m["size"]) == (w["colour"], w["shape"], w["size"])
        assert (m["colour"], m["shape"], m["size"]) == (t["colour"], t["shape"], t["size"])
        assert m["position"] in (w["position"], t["position"])
    with pytest.raises(ValueError, match="landscape, portrait or None"):
        prompts(2, 0, orientation="square")


def test_sizes_to_generate_at_are_checked_in_one_place():
    from flowmatch_models.data.buckets import parse_sizes

    assert parse_sizes(["256x256", "224x320"]) == [(256, 256), (224, 320)]
    for bad in ([], ["256"], ["250x256"], ["0x256"]):
        with pytest.raises(ValueError, match="sizes"):
            parse_sizes(bad)
