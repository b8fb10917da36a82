"""Every shard says truly what made it (issue 44): the images version it was read from (an
images partition re-made while it is encoded), the weights its model was loaded from (a weights
folder rewritten mid-encode) and the dtype and device it was computed in (fp32 and bf16 never
share a fingerprint; fingerprints recorded before, with ``auto``, read as what ``auto``
resolves to here). Real parts throughout: in-process Dagster, the zoo encoders, the catalog."""

from __future__ import annotations

import hashlib
import io
import shutil
import threading
import time

import dagster as dg
import numpy as np
import pytest
import torch

from flowmatch_assets.catalog import MaterializationRecord, record_materialization
from flowmatch_assets.defs import embedding_assets
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness import fingerprints
from flowmatch_assets.freshness.fingerprints import staleness
from flowmatch_assets.freshness.fingerprints import stored as stored_fp
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_models.embeddings import precalc
from flowmatch_models.embeddings.kinds import KINDS
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.fingerprint import Fingerprint, disagreement, folder_sha256
from tests.conftest import make_resource
from tests.test_embedding_assets import EMB, _range_run, _run

INPUT_VERSION = "dagster/input_data_version/images"


def _images_version(instance, part: str) -> str:
    """The data version of ``part``'s latest images materialization in Dagster."""
    ev = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("images"), asset_partitions=[part]), limit=1
    ).records[0]
    return ev.asset_materialization.tags["dagster/data_version"]


def _input_version(instance, asset: str, part: str) -> str:
    ev = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[part]), limit=1
    ).records[0]
    return ev.asset_materialization.tags[INPUT_VERSION]


def _sha(version: str) -> str:
    return hashlib.sha256(version.encode()).hexdigest()


def _images(folder, n: int, captions: list[str] | None = None):
    """An images shard of ``n`` 256 px noise JPEGs (as the ``images`` asset writes them)."""
    from PIL import Image

    from flowmatch_models.storage.image_shard import write_image_shard

    rng, rows = np.random.default_rng(0), []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), np.uint8)).save(buf, "JPEG")
        rows.append(
            {
                **dict.fromkeys(("md5", "url"), ""),
                "id": f"000-00-{i:06d}",
                "caption": captions[i] if captions else f"noise {i}",
                "image": buf.getvalue(),
                "format": "jpeg",
                **dict.fromkeys(("orig_width", "orig_height", "height", "width"), 256),
                "kept": 1.0,
            }
        )
    path = folder / "000-00.parquet"
    write_image_shard(path, rows)
    return path


@pytest.fixture
def two_qualities(tmp_path, small_sample, zoo):
    """The resource (JPEG q95) and the same with q50: ``images`` re-made under the second."""
    spec = EncoderSpec(**zoo, batch_size=8)
    q95, q50 = (
        FlowmatchResource(
            data_root=str(tmp_path / "data"),
            metadata_source=small_sample["metadata"],
            ingest=IngestConfig(file_root=small_sample["dest"], threads=4, quality=q),
            encoders=spec,
        )
        for q in (95, 50)
    )
    precalc.clear_shared_encoders()
    yield q95, q50
    precalc.clear_shared_encoders()


def _judge(q95, q50, instance, part: str, old_hash: str, old_version: str) -> None:
    """``part``'s image kinds were made from the q95 images, now re-made at q50: they record
    the q95 version (fingerprint input, Dagster input data version) and so read stale to the
    q50 settings; the caption kind reads only ids and captions (unchanged): fresh."""
    new_hash = stored_fp(q50, "images", part).hash
    assert new_hash != old_hash
    for kind in ("vae_latents", "dino_features"):
        assert stored_fp(q95, kind, part).inputs == {"images": old_hash}
        assert _input_version(instance, kind, part) == _sha(old_version)
    assert _images_version(instance, part) != old_version
    found = {s.asset: s.reason for s in staleness(q50, [part], EMB)}
    want = f"images was re-made with another fingerprint since ({old_hash} -> {new_hash})"
    assert found == {"vae_latents": want, "dino_features": want}


def test_images_remade_while_the_run_before_it_encodes_reads_stale(
    two_qualities, monkeypatch
) -> None:
    """A run of two partitions: while 000-00 encodes, 001-00's images (already read ahead) are
    re-made at JPEG q50. 001-00's image shards were computed from the q95 pixels: they record
    the q95 images version and read stale (they recorded the q50 one and read fresh before)."""
    q95, q50 = two_qualities
    parts = ["000-00", "001-00"]
    real_ahead, real_encode = embedding_assets._read_ahead, embedding_assets.encode_partition
    remade: list[str] = []

    def read_ahead(flowmatch, part, selected, device):
        ahead = real_ahead(flowmatch, part, selected, device)
        ahead.meta()  # mapped: the window is open from here (deterministic, not a race)
        return ahead

    def encode(images_path, *a, **kw):
        if "000-00" in str(images_path) and not remade:  # 001-00 was read ahead of this
            assert _run(q50, "001-00", instance, ["images"]).success
            remade.append("001-00")
        return real_encode(images_path, *a, **kw)

    monkeypatch.setattr(embedding_assets, "_read_ahead", read_ahead)
    monkeypatch.setattr(embedding_assets, "encode_partition", encode)
    with dg.instance_for_test() as instance:
        register_partitions(instance, q95)
        for p in parts:
            assert _run(q95, p, instance, ["metadata", "images"]).success
        old_hash = stored_fp(q95, "images", "001-00").hash
        old_version = _images_version(instance, "001-00")
        assert _range_run(q95, instance, parts).success
        assert remade == ["001-00"]
        _judge(q95, q50, instance, "001-00", old_hash, old_version)
        assert not staleness(q95, ["000-00"], EMB)  # the partition left alone: fresh


def test_images_remade_while_one_partition_encodes_reads_stale(two_qualities, monkeypatch):
    """The one-partition path: the images re-made at q50 just after the step mapped the q95
    file (its rows read), before its fingerprint and input version are taken."""
    q95, q50 = two_qualities
    real_meta = precalc.Ahead.meta
    remade: list[str] = []

    def meta(self):
        got = real_meta(self)
        if not remade:
            remade.append("000-00")
            assert _run(q50, "000-00", instance, ["images"]).success
        return got

    with dg.instance_for_test() as instance:
        register_partitions(instance, q95)
        assert _run(q95, "000-00", instance, ["metadata", "images"]).success
        old_hash = stored_fp(q95, "images", "000-00").hash
        old_version = _images_version(instance, "000-00")
        monkeypatch.setattr(precalc.Ahead, "meta", meta)
        assert _run(q95, "000-00", instance, EMB).success
        monkeypatch.undo()
        assert remade == ["000-00"]
        _judge(q95, q50, instance, "000-00", old_hash, old_version)


def _other_weights(folder, into) -> None:
    """Save ``folder``'s VAE with every weight changed into ``into`` (``save_pretrained``, as a
    fine-tune saved over its folder: the files rewritten where they are)."""
    import torch
    from diffusers import AutoencoderDC

    vae = AutoencoderDC.from_pretrained(str(folder))
    with torch.no_grad():
        for p in vae.parameters():
            p.mul_(0.5).add_(0.01)
    vae.save_pretrained(str(into))


def test_a_weights_folder_rewritten_mid_encode_is_not_what_the_shard_names(
    tmp_path, zoo, monkeypatch
) -> None:
    """The VAE folder is rewritten in place after the model is loaded, during the encode: the
    shard's latents are the loaded (old) weights' and its fingerprint names those weights, not
    the folder's new ones."""
    from flowmatch_models.encoders.frozen import Encoders

    images = _images(tmp_path, 4)
    vae, old = tmp_path / "vae", tmp_path / "vae-old"
    shutil.copytree(zoo["vae"], vae)
    shutil.copytree(zoo["vae"], old)
    spec = EncoderSpec(**{**zoo, "vae": str(vae)}, batch_size=4, device="cpu")
    kind = KINDS["vae_latents"]
    real = Encoders.encode_vae
    rewritten: list[bool] = []

    def encode_vae(self, x):
        if not rewritten:
            _other_weights(vae, vae)
            rewritten.append(True)
        return real(self, x)

    precalc.clear_shared_encoders()
    monkeypatch.setattr(Encoders, "encode_vae", encode_vae)
    try:
        got = precalc.encode_partition(images, [kind], spec, "cpu", log=lambda m: None)
    finally:
        monkeypatch.undo()
        precalc.clear_shared_encoders()
    assert rewritten
    fp = Fingerprint.from_json(got["vae_latents"].attrs["fingerprint"])
    assert folder_sha256(vae) != folder_sha256(old)
    assert fp.fields["weights_sha256"] == folder_sha256(old)
    meta = precalc.Ahead(images, [kind], {}, 4)
    pixels = np.concatenate([imgs for _, _, imgs in meta.batches()])
    meta.close()
    want = Encoders(spec.model_copy(update={"vae": str(old)})).encode_vae(pixels)
    now = Encoders(spec).encode_vae(pixels)
    assert np.array_equal(got["vae_latents"].arrays["latents"], want)
    assert not np.array_equal(want, now)


def test_a_folder_changed_during_its_load_is_loaded_again(tmp_path, zoo) -> None:
    """The identity is taken around the load: a folder that changes while it loads is loaded
    again, and the identity kept is the one that was loaded."""
    from flowmatch_models.encoders.loading import load_identified

    vae = tmp_path / "vae"
    shutil.copytree(zoo["vae"], vae)
    first = folder_sha256(vae)
    loads: list[str] = []

    def load() -> str:
        loads.append(folder_sha256(vae))
        if len(loads) == 1:
            (vae / "config.json").write_text((vae / "config.json").read_text() + "\n")
        return f"model {len(loads)}"

    got, ident = load_identified(str(vae), load)
    assert got == "model 2" and loads[0] == first
    assert ident == {"weights_sha256": folder_sha256(vae)} != {"weights_sha256": first}


def test_fp32_and_bf16_shards_never_share_a_fingerprint(tmp_path, small_sample, zoo) -> None:
    """The same images encoded in fp32 and in bf16 (on the CPU) give two fingerprints, whose
    difference names the dtype (training refuses them together); ``auto`` here is fp32: the
    same fingerprint. A fingerprint recorded before (``compute_dtype: auto``, no device) reads
    fresh where auto resolves to the dtype the settings ask now, stale where they ask another,
    and trains beside the shards made here since."""
    from flowmatch_models.data.agreement import agreeing

    images = _images(tmp_path, 2)
    kind = KINDS["vae_latents"]
    fps = {}
    precalc.clear_shared_encoders()
    for dtype in ("fp32", "bf16", "auto"):
        spec = EncoderSpec(**zoo, batch_size=2, dtype=dtype)
        got = precalc.encode_partition(images, [kind], spec, "cpu", inputs={"images": "h"})
        fps[dtype] = Fingerprint.from_json(got["vae_latents"].attrs["fingerprint"])
    precalc.clear_shared_encoders()
    assert fps["fp32"].hash != fps["bf16"].hash
    assert fps["bf16"].fields["compute_dtype"] == "bf16"
    assert fps["fp32"].fields["device"] == "cpu"
    assert fps["auto"].hash == fps["fp32"].hash  # auto on the CPU is fp32: the same values
    assert "compute_dtype: fp32 -> bf16" in disagreement({"a": fps["fp32"], "b": fps["bf16"]})

    # a shard recorded before the resolved dtype, planted in a catalog with its images record
    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo))
    up = fingerprints.current(res, "images", "000-00")
    record_materialization(
        res.data_root,
        MaterializationRecord("images", "000-00", 4, extra={"fingerprint": up.to_json()}),
    )
    fields = dict(fingerprints.expected_fields(res, "vae_latents"))
    assert (fields.pop("compute_dtype"), fields.pop("device")) == ("fp32", "cpu")
    legacy = Fingerprint({**fields, "compute_dtype": "auto"}, {"images": up.hash})
    record_materialization(
        res.data_root,
        MaterializationRecord("vae_latents", "000-00", 4, extra={"fingerprint": legacy.to_json()}),
    )
    assert staleness(res, ["000-00"], ["vae_latents"]) == []
    for dtype, stale in (("fp32", None), ("bf16", "compute_dtype: fp32 -> bf16")):
        now = make_resource(
            tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, dtype=dtype)
        )
        found = [s.reason for s in staleness(now, ["000-00"], ["vae_latents"])]
        assert found == ([stale] if stale else [])
    made_here = Fingerprint({**legacy.fields, "compute_dtype": "fp32", "device": "cpu"})
    assert (
        disagreement({"old": legacy, "new": Fingerprint(made_here.fields, legacy.inputs)}) is None
    )
    assert agreeing("vae_latents", legacy).hash != legacy.hash  # read, never rewritten
    assert "compute_dtype: fp32 -> bf16" in disagreement({"old": legacy, "gpu": fps["bf16"]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (auto: bf16 there)")
def test_auto_on_a_gpu_and_on_the_cpu_never_share_a_fingerprint(tmp_path, zoo) -> None:
    """``dtype: auto`` computes in bf16 on a GPU and fp32 on the CPU: two fingerprints."""
    images, kind = _images(tmp_path, 2), KINDS["vae_latents"]
    spec = EncoderSpec(**zoo, batch_size=2)
    fps = {}
    precalc.clear_shared_encoders()
    for device in ("cuda", "cpu"):
        got = precalc.encode_partition(images, [kind], spec, device, inputs={"images": "h"})
        fps[device] = Fingerprint.from_json(got["vae_latents"].attrs["fingerprint"])
    precalc.clear_shared_encoders()
    assert fps["cuda"].fields["compute_dtype"] == "bf16" and fps["cuda"].fields["device"] == "cuda"
    assert fps["cuda"].hash != fps["cpu"].hash
    assert "compute_dtype: bf16 -> fp32" in disagreement({"a": fps["cuda"], "b": fps["cpu"]})


def test_the_images_reader_waits_for_a_writer_in_progress(tmp_path, small_sample) -> None:
    """The read-ahead's reader lock (``routine.reading``) waits while an images partition is
    being written (``PartitionOutput`` holds the exclusive lock from its first write to its
    record), so the record and the file it reads are one version."""
    from flowmatch_assets.defs.routine import lock_path, partition_lock, reading

    res = make_resource(tmp_path / "data", small_sample)
    order: list[str] = []

    class Log:
        def info(self, m: str) -> None:
            order.append("writer waits")

    def read() -> None:
        with reading(res, "images", "000-00"):
            order.append("read")

    with partition_lock(lock_path(res, "images", "000-00"), Log(), "000-00", "images"):
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.3)
        order.append("written")
    reader.join(5)
    assert order == ["written", "read"]

    def write() -> None:
        with partition_lock(lock_path(res, "images", "000-00"), Log(), "000-00", "images"):
            order.append("writer in")

    with reading(res, "images", "000-00"):  # readers share; a writer waits for them
        with reading(res, "images", "000-00"):
            order.append("two readers")
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.3)
        order.append("read done")
    writer.join(5)
    assert order[2:] == ["two readers", "writer waits", "read done", "writer in"]


def test_a_partitions_captions_are_encoded_in_batches_of_like_length(tmp_path, zoo):
    """The text encoder gets the whole partition: its batches are cut from the captions sorted
    by length, so each pads to captions of its own length (handed a batch at a time, the sort
    never reached past one batch and every batch padded to its longest random row); the
    states are the ones of encoding each caption, back in row order."""
    from flowmatch_models.encoders.frozen import Encoders

    rng = np.random.default_rng(3)
    captions = [" ".join(["word"] * int(k)) for k in rng.permutation([1, 2, 3, 4, 30] * 4)]
    images = _images(tmp_path, len(captions), captions)
    spec = EncoderSpec(**zoo, batch_size=5, device="cpu")
    kind = KINDS["text_embeddings"]
    precalc.clear_shared_encoders()
    shapes: list[tuple[int, int]] = []
    try:
        enc = precalc._encoders([kind], spec, "cpu", None)[kind.name]  # the ones it uses
        hook = enc.text_model.register_forward_pre_hook(
            lambda _m, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
        try:
            got = precalc.encode_partition(images, [kind], spec, "cpu", log=lambda m: None)
        finally:
            hook.remove()
    finally:
        precalc.clear_shared_encoders()
    lengths = got["text_embeddings"].arrays["lengths"]
    assert shapes.pop() == (1, 1)  # the null caption, encoded last
    by_length = np.sort(lengths)[::-1]
    want = [(5, int(by_length[i])) for i in range(0, len(lengths), 5)]
    assert sorted(shapes) == sorted(want), shapes  # the long captions in one batch
    in_row_order = sum(5 * int(lengths[i : i + 5].max()) for i in range(0, len(lengths), 5))
    padded = sum(b * n for b, n in shapes)
    assert padded < 0.6 * in_row_order, (padded, in_row_order)  # 605 vs 1,040 tokens
    alone = Encoders(spec)
    tokens, lens = alone.encode_text(captions)
    assert np.array_equal(lens, lengths)
    assert np.allclose(got["text_embeddings"].arrays["tokens"], tokens, atol=2e-3)
