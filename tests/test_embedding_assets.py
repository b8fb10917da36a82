"""The embedding assets in a real Dagster instance on the tiny zoo: alignment, idempotency,
checks, bad captions, and a corrupted shard detected with a clear error."""

from __future__ import annotations

import dataclasses

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import build_definitions, resources_for
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.training_assets import coverage_or_fail
from flowmatch_assets.freshness.fingerprints import stored as shard_fp
from flowmatch_assets.ingest.metadata import FilterConfig
from flowmatch_assets.reports.measured import measure
from flowmatch_models.embeddings.kinds import KINDS, registered
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.image_shard import read_image_meta
from flowmatch_models.storage.store import read_shard
from tests.conftest import make_resource

EMB = ["vae_latents", "dino_features", "text_embeddings"]


def _run(res, key, instance, selection):
    return dg.materialize(
        list(defs.assets),
        selection=selection,
        partition_key=key,
        instance=instance,
        resources=resources_for(res),
        raise_on_error=False,
    )


def _checks(res, key, instance):
    job = dg.define_asset_job("checks", selection=dg.AssetSelection.all_asset_checks())
    d = dg.Definitions(
        assets=list(defs.assets),
        asset_checks=list(defs.asset_checks),
        jobs=[job],
        resources=resources_for(res),
    )
    result = d.resolve_job_def("checks").execute_in_process(
        instance=instance, tags={"dagster/partition": key}, raise_on_error=False
    )  # the checks are blocking: a failed one fails the run
    return {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }


def test_three_embedding_assets_align_by_id_rerun_is_idempotent_and_checks_pass(
    tmp_path, small_sample, zoo
):
    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, batch_size=8))
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _run(res, "000-00", instance, ["metadata", "images", *EMB]).success
        ids = read_image_meta(res.layout.asset_path("images", "000-00")).column("id").to_pylist()
        shards = {a: read_shard(res.layout.asset_path(a, "000-00"), verify=True) for a in EMB}
        for s in shards.values():
            assert list(s.ids) == ids
        assert shards["vae_latents"]["latents"].shape == (len(ids), 32, 8, 8)
        assert shards["dino_features"]["patch"].shape == (len(ids), 64, 384)
        assert shards["vae_latents"].attrs["random_weights"] is True
        lengths = shards["text_embeddings"]["lengths"]
        assert shards["text_embeddings"]["tokens"].shape == (int(lengths.sum()), 640)

        cat = Catalog(res.data_root)
        cov = {r["partition"]: r for r in cat.coverage()}["000-00"]
        assert all(cov[a] == len(ids) for a in EMB)
        comp = {r["asset"]: r for r in cat.compression()}
        # only valid tokens are stored: far fewer bytes than the seed's padded fp16
        assert comp["text_embeddings"]["ratio"] > 3

        before = cat.query("SELECT count(*) AS n FROM rows")[0]["n"]
        # re-run only the text embeddings (a subset of the multi-asset)
        result = _run(res, "000-00", instance, ["text_embeddings"])
        assert result.success
        done = [e.asset_key.to_user_string() for e in result.get_asset_materialization_events()]
        assert done == ["text_embeddings"]
        assert cat.query("SELECT count(*) AS n FROM rows")[0]["n"] == before

        checks = _checks(res, "000-00", instance)
        assert {n: c.passed for n, c in checks.items()} == {
            "images_complete": True,
            "vae_latents_valid": True,
            "dino_features_valid": True,
            "text_embeddings_valid": True,
            "text_embeddings_fp16_saturation": True,  # the zoo's states stay within fp16
            # made with the current settings (flowmatch_assets/freshness/fingerprints.py)
            **{f"{a}_fresh": True for a in ["metadata", "images", *EMB, "flow_model", "fine_tune"]},
        }
        text = read_shard(res.layout.asset_path("text_embeddings", "000-00"))
        assert text.attrs["fp16_saturated"] == 0 and text.attrs["text_dtype"] == "torch.float32"
        # the null caption is the encoded empty prompt: one (BOS) token, not zeros
        assert text["null_tokens"].shape == (1, 640) and np.abs(text["null_tokens"]).sum() > 0

        # corrupt one byte in the middle of the latents shard: the check names the file
        path = res.layout.asset_path("vae_latents", "000-00")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        checks = _checks(res, "000-00", instance)
        assert not checks["vae_latents_valid"].passed
        assert str(path) in str(checks["vae_latents_valid"].metadata["problems"].value)


def test_bad_captions_are_embedded_not_crashed(tmp_path, small_sample, zoo):
    captions = ["", "   \n\t ", "x" * 10_000, "çà 漢字 🙂 \u200b\u202e mixed", "a red circle"]
    src = pq.read_table(small_sample["metadata"] + "/pd12m.001.parquet").slice(0, len(captions))
    src = src.set_column(src.schema.get_field_index("caption"), "caption", pa.array(captions))
    md_dir = tmp_path / "md"
    md_dir.mkdir()
    pq.write_table(src, md_dir / "pd12m.005.parquet")
    sample = {**small_sample, "metadata": str(md_dir)}
    res = make_resource(
        tmp_path / "data",
        sample,
        filters=FilterConfig(min_caption_chars=0, max_caption_chars=20_000),
        encoders=EncoderSpec(**zoo, max_tokens=16),
    )
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _run(res, "005-00", instance, ["metadata", "images", "text_embeddings"]).success
    shard = read_shard(res.layout.asset_path("text_embeddings", "005-00"))
    lengths = shard["lengths"]
    assert len(lengths) == len(captions)
    assert (lengths >= 1).all() and (lengths <= 16).all()
    assert lengths[2] == 16  # the 10,000-character caption is truncated
    assert np.isfinite(shard["tokens"]).all()


def test_a_new_embedding_kind_is_one_registry_entry(tmp_path, small_sample, zoo):
    """A second text encoder registered in one place gets its asset, checks, catalog rows,
    budget share and a place in training's coverage, with no other file edited."""
    # the arrays, seed reference and lossy options of the Gemma3 kind; its own name and model
    second = dataclasses.replace(
        KINDS["text_embeddings"],
        name="caption_states",
        description="A second text encoder's caption states (here the zoo's Gemma3 again).",
        model=zoo["text"],
        warnings=(),
    )
    res = make_resource(
        tmp_path / "data",
        small_sample,
        encoders=EncoderSpec(**zoo, batch_size=8, lossy={"caption_states": "int8"}),
    )
    with registered(second), dg.instance_for_test() as instance:
        d = build_definitions()
        graph = d.resolve_asset_graph()
        assert dg.AssetKey("caption_states") in graph.get_all_asset_keys()
        deps = graph.get(dg.AssetKey("flow_model")).parent_keys
        assert dg.AssetKey("caption_states") in deps
        register_partitions(instance, res)
        assets = [*d.assets, *d.asset_checks]

        def run(selection):
            return dg.materialize(
                assets,
                selection=selection,
                partition_key="000-00",
                instance=instance,
                resources=resources_for(res),
                raise_on_error=False,
            )

        assert run(["metadata", "images", *EMB]).success
        # training needs every training input: without the new kind the partition is not covered
        assert res.layout.complete_partitions() == []
        with pytest.raises(dg.Failure, match="missing caption_states"):
            coverage_or_fail(res, ["000-00"], 1.0)
        result = run(["caption_states"])
        assert result.success
        evals = {
            e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data.passed
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        }
        assert evals == {"caption_states_valid": True, "caption_states_fresh": True}
        fp = shard_fp(res, "caption_states", "000-00")
        assert fp.fields["max_tokens"] == 128  # its fingerprint: its role's settings
        assert res.layout.complete_partitions() == ["000-00"]
        assert coverage_or_fail(res, ["000-00"], 1.0)[0] == ["000-00"]

        shard = read_shard(res.layout.asset_path("caption_states", "000-00"), verify=True)
        assert shard.attrs["model"] == zoo["text"] and shard.attrs["random_weights"] is True
        assert shard["tokens"].shape == (int(shard["lengths"].sum()), 640)
        cat = Catalog(res.data_root)
        cov = {r["partition"]: r for r in cat.coverage()}["000-00"]
        assert cov["caption_states"] == len(shard.ids)
        comp = {r["asset"]: r for r in cat.compression()}["caption_states"]
        assert comp["codec"] == "none+int8" and comp["lossy_min_cosine"] > 0.99
        stored = cat.query(
            "SELECT count(*) AS n FROM rows WHERE asset = 'caption_states' AND outcome = 'stored'"
        )
        assert stored[0]["n"] == len(shard.ids)
        (precalc,) = measure(cat)["precalc"]
        assert precalc.samples == len(shard.ids) and "sum of the 4 encoders'" in precalc.note
    # the registry is back to the three kinds, and so is everything built from it
    assert list(KINDS) == EMB
    assert "caption_states" not in [
        s.name for c in build_definitions().asset_checks for s in c.check_specs
    ]


def _range_run(res, instance, keys: list[str]):
    """One run of the embedding kinds over ``keys`` (as a backfill's multi-partition run)."""
    d = build_definitions()
    job = dg.Definitions(
        assets=list(d.assets), asset_checks=list(d.asset_checks), resources=resources_for(res)
    ).resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance,
        tags={
            "dagster/asset_partition_range_start": keys[0],
            "dagster/asset_partition_range_end": keys[-1],
        },
        asset_selection=[dg.AssetKey(a) for a in EMB],
        raise_on_error=False,
    )


def _published(res, instance, part: str) -> dict:
    """What one asset partition's publication left: shard arrays and attrs, the catalog record
    and the Dagster materialization (what does not depend on when or by which run)."""
    from flowmatch_assets.catalog import read_materialization

    out = {}
    for a in EMB:
        shard = read_shard(res.layout.asset_path(a, part), verify=True)
        rec = read_materialization(res.data_root, a, part)
        ev = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(a), asset_partitions=[part]), limit=1
        ).records[0]
        m = ev.asset_materialization
        out[a] = {
            "arrays": {k: shard[k].tobytes() for k in shard.names},
            "attrs": {k: v for k, v in shard.attrs.items() if k != "seconds"},
            "record": {
                k: v
                for k, v in rec.items()
                if k not in ("run_id", "seconds", "samples_per_s", "written_at")
            },
            "metadata": {k: v.value for k, v in m.metadata.items() if k != "samples_per_s"},
            "data_version": m.tags["dagster/data_version"],
            "code_version": m.tags["dagster/code_version"],
            "input_version": m.tags["dagster/input_data_version/images"],
        }
    return out


def test_one_run_of_many_partitions_publishes_each_as_a_run_of_one_does(
    tmp_path, small_sample, zoo
):
    """A backfill's run over several partitions (issue 35) loads the encoders once and
    publishes each partition as a one-partition run would: the same shard, catalog record and
    Dagster materialization (data version, input version, metadata), its own ``_fresh`` check
    evaluation; a partition made to fail (no images shard) fails alone."""
    from flowmatch_models.embeddings import precalc

    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, batch_size=8))
    parts = ["000-00", "001-00"]
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        one = {}
        for p in parts:
            assert _run(res, p, instance, ["metadata", "images"]).success
            assert _run(res, p, instance, EMB).success
            one[p] = _published(res, instance, p)
        precalc.clear_shared_encoders()
        result = _range_run(res, instance, parts)
        assert result.success
        for p in parts:
            now = _published(res, instance, p)
            assert now.keys() == one[p].keys()
            for a in EMB:
                for what in now[a]:
                    assert now[a][what] == one[p][a][what], (p, a, what)
        # one load for the whole run: the kinds' encoders are the process's shared ones
        assert len(precalc._SHARED) == len(EMB)
        evals = [
            e.asset_check_evaluation_data
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
        fresh = {
            (e.asset_key.to_user_string(), e.partition)
            for e in evals
            if e.check_name.endswith("_fresh")
        }
        assert fresh == {(a, p) for a in EMB for p in parts}
        assert all(e.passed for e in evals)
        valid = {e.check_name: e for e in evals if e.check_name.endswith("_valid")}
        assert {k: v.metadata["partitions_checked"].value for k, v in valid.items()} == {
            f"{a}_valid": 2 for a in EMB
        }

        # 000-00 has no images shard now: it fails alone, 001-00 is published by this run
        res.layout.asset_path("images", "000-00").unlink()
        result = _range_run(res, instance, parts)
        assert not result.success
        run_id = result.run_id
        mats = {
            (e.asset_key.to_user_string(), e.partition)
            for e in instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("text_embeddings")), limit=10
            ).records
            if e.run_id == run_id
            for e in [e.asset_materialization]
        }
        assert mats == {("text_embeddings", "001-00")}
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        msg = failure.step_failure_data.user_failure_data.description
        assert msg.startswith(
            "1 of 2 partitions failed (1 published): 000-00: partition 000-00 has no images shard"
        )


def test_a_partition_read_ahead_is_one_version_of_its_file(tmp_path) -> None:
    """The precalc reads partition i+1 while it encodes i (issue 35): its rows and its image
    batches come from one version of the file even when ``images`` re-makes it (atomic
    replace) in between, so the ids stored beside the arrays are the rows encoded; closing
    joins every thread it started."""
    import os
    import threading

    from flowmatch_assets.bench.precompute import write_images
    from flowmatch_models.embeddings.precalc import Ahead
    from flowmatch_models.storage.layout import DataLayout

    old, new = tmp_path / "old", tmp_path / "new"
    write_images(old, 1, 12)
    write_images(new, 2, 12)  # its 000-00 has other captions' order; take 000-01's rows
    path = DataLayout(old).asset_path("images", "000-00")
    ahead = Ahead(path, [KINDS["vae_latents"]], {}, batch_size=5)
    ids = ahead.meta().column("id").to_pylist()
    os.replace(DataLayout(new).asset_path("images", "000-01"), path)  # re-made under it
    got = [i for batch_ids, _, imgs in ahead.batches() for i in batch_ids]
    ahead.close()
    assert ids == [f"000-00-{i:06d}" for i in range(12)]
    assert got == ids  # the old file's rows, not 000-01-...
    assert read_image_meta(path).column("id").to_pylist()[0] == "000-01-000000"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("flowmatch-")]


def test_a_kind_that_fails_on_the_writer_thread_fails_alone(
    tmp_path, small_sample, zoo, monkeypatch
) -> None:
    """In a run of many partitions, writing one kind of one partition fails (on the writer
    thread, as a full disk would): that kind of that partition is not published and is named in
    the run's failure; every other kind and partition is published, with its materialization."""
    from flowmatch_assets.defs import embedding_assets

    res = make_resource(tmp_path / "data", small_sample, encoders=EncoderSpec(**zoo, batch_size=8))
    parts = ["000-00", "001-00"]
    real = embedding_assets._store

    def store(context, flowmatch, e, ids, part):
        if (e.kind.name, part) == ("dino_features", "000-00"):
            raise OSError(28, "No space left on device (planted)")
        return real(context, flowmatch, e, ids, part)

    monkeypatch.setattr(embedding_assets, "_store", store)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        for p in parts:
            assert _run(res, p, instance, ["metadata", "images"]).success
        result = _range_run(res, instance, parts)
        assert not result.success
        mats = {
            (e.asset_key.to_user_string(), e.partition)
            for e in result.all_events
            if e.event_type_value == "ASSET_MATERIALIZATION"
            for e in [e.event_specific_data.materialization]
        }
        want = {(a, p) for a in EMB for p in parts} - {("dino_features", "000-00")}
        assert mats == want
        assert not res.layout.asset_path("dino_features", "000-00").exists()
        assert all(res.layout.asset_path(a, p).exists() for a, p in want)
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        msg = failure.step_failure_data.user_failure_data.description
        assert msg.startswith("1 of 2 partitions failed (2 published): 000-00: dino_features: ")
        assert "No space left on device (planted)" in msg


def test_the_seed_format_comparison_says_larger_when_larger() -> None:
    """The metadata compares a shard with the seed's format in the right direction (a
    newcomer read "smaller_than_seed_format 1.0x (384 KiB -> 389 KiB)" for a larger shard)."""
    from flowmatch_assets.defs.embedding_assets import _vs_seed

    assert _vs_seed(1 << 20, 1 << 18) == (
        "4.0x smaller (1 MiB in the seed's per-sample xz format -> 256 KiB here)"
    )
    assert _vs_seed(393_216, 398_336).startswith("1.01x larger (384 KiB in the seed's")
    assert _vs_seed(0, 10) == _vs_seed(10, 0) == "-"
