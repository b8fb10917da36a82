"""The data lineage in a real Dagster instance: load, materialize, re-run, run in parallel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import make_dagster_home
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.definitions import resources_for
from flowmatch_assets.defs.partitions import SHARDS, register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_models.storage.image_shard import iter_image_batches
from tests.conftest import REPO, make_resource


def _assets():
    return list(defs.assets)


def test_definitions_load_with_groups_kinds_and_descriptions():
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {"metadata", "images"} <= keys
    for k in graph.get_all_asset_keys():
        node = graph.get(k)
        assert node.group_name, k
        assert node.description, k
    assert repo.get_sensor_def("metadata_partition_sensor")


def _materialize(res, key, instance):
    return dg.materialize(
        _assets(),
        selection=["metadata", "images"],
        partition_key=key,
        instance=instance,
        resources=resources_for(res),
    )


def test_partition_materializes_every_row_gets_one_outcome_and_rerun_is_idempotent(
    resource, small_sample
):
    expected = small_sample["expected_outcomes"]
    with dg.instance_for_test() as instance:
        assert register_partitions(instance, resource) == ["000-00", "001-00"]
        assert register_partitions(instance, resource) == []  # idempotent
        assert _materialize(resource, "000-00", instance).success

        cat = Catalog(resource.data_root)
        outcomes = cat.query(
            "SELECT asset, id, outcome, reason FROM rows WHERE partition = '000-00' ORDER BY asset, id"
        )
        # the final outcome of each input row: filtered by metadata, or the image stage's outcome
        final = {}
        for r in outcomes:
            if r["asset"] == "metadata" and r["outcome"] == "filtered":
                final[r["id"]] = f"filtered:{r['reason']}"
            elif r["asset"] == "images":
                final[r["id"]] = "stored" if r["outcome"] == "stored" else f"failed:{r['reason']}"
        want = {i: o for i, o in expected.items() if i in final}
        assert final == want
        n_rows_000 = pq.read_metadata(Path(small_sample["metadata"]) / "pd12m.000.parquet").num_rows
        assert len(final) == n_rows_000  # every input row has exactly one final outcome

        # good rows are 256x256 RGB, aligned with captions
        shard = resource.layout.asset_path("images", "000-00")
        ids, caps, imgs = next(iter_image_batches(shard, batch_size=100))
        assert {im.shape for im in imgs} == {(256, 256, 3)} and len(ids) == len(caps) == 10
        assert resource.layout.preview_path("images", "000-00").exists()

        before = cat.query("SELECT count(*) AS n FROM rows")[0]["n"]
        assert _materialize(resource, "000-00", instance).success  # again
        assert cat.query("SELECT count(*) AS n FROM rows")[0]["n"] == before
        assert (
            cat.query("SELECT count(*) AS n FROM materializations WHERE partition='000-00'")[0]["n"]
            == 2
        )

        mats = instance.fetch_materializations(dg.AssetKey("images"), limit=10).records
        md = mats[0].asset_materialization.metadata
        assert md["stored"].value == 10 and md["failed"].value + md["filtered"].value == 6
        # failed and filtered apart, as `flowmatch catalog failures` counts them
        counts = {
            r["outcome"]: r["n"]
            for r in cat.query(
                "SELECT outcome, count(*) AS n FROM rows WHERE asset = 'images' "
                "AND partition = '000-00' GROUP BY outcome"
            )
        }
        assert md["failed"].value == counts.get("failed", 0) > 0
        assert md["filtered"].value == counts.get("filtered", 0)  # duplicates by content
        assert "data:image/jpeg;base64" in md["preview"].value


def test_sensor_registers_new_metadata_files(resource, small_sample):
    from flowmatch_assets.defs.partitions import metadata_partition_sensor

    with dg.instance_for_test() as instance:
        ctx = dg.build_sensor_context(instance=instance, resources={"flowmatch": resource})
        result = metadata_partition_sensor(ctx)
        assert isinstance(result, dg.SensorResult)
        assert result.dynamic_partitions_requests[0].partition_keys == ["000-00", "001-00"]
        instance.add_dynamic_partitions(SHARDS, ["000-00", "001-00"])
        assert isinstance(metadata_partition_sensor(ctx), dg.SkipReason)
        # a key added by hand with no metadata file behind it: flagged on every tick
        instance.add_dynamic_partitions(SHARDS, ["003-00"])
        assert metadata_partition_sensor(ctx).skip_message == (
            "2 shards, all registered; 1 partition keys have no metadata behind them (003-00); "
            "a run of them fails: remove them with `flowmatch partitions remove --orphans`"
        )
        instance.delete_dynamic_partition(SHARDS, "003-00")
        # no metadata source (yet): a skip that says how to fix it, not an error every tick
        gone = FlowmatchResource(
            data_root=resource.data_root, metadata_source=str(resource.data_root) + "/none"
        )
        ctx = dg.build_sensor_context(instance=instance, resources={"flowmatch": gone})
        skip = metadata_partition_sensor(ctx)
        assert isinstance(skip, dg.SkipReason) and "flowmatch demo-data" in skip.skip_message


@pytest.mark.slow
def test_parallel_partitions_in_separate_processes_with_sqlite_home(tmp_path, small_sample):
    """Three partitions materialize at once, each in its own `dagster asset materialize`
    process, against one sqlite DAGSTER_HOME and one data root:
    no DuckDB or sqlite lock errors, and the catalog is consistent afterwards."""
    home = make_dagster_home(tmp_path / "dagster_home")
    data = tmp_path / "data"
    res = make_resource(data, small_sample, shard_size=5)
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": small_sample["metadata"],
        "FLOWMATCH_FILE_ROOT": small_sample["dest"],
        "FLOWMATCH_SHARD_SIZE": "5",
        "FLOWMATCH_MIN_STORED_FRACTION": "0",  # 5-row shards of the bad rows store < half
    }
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        with dg.DagsterInstance.get() as instance:
            keys = sorted(register_partitions(instance, res))
    finally:
        del os.environ["DAGSTER_HOME"]
    assert keys == ["000-00", "000-01", "000-02", "000-03", "001-00", "001-01"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dagster",
                "asset",
                "materialize",
                "-m",
                "flowmatch_assets.definitions",
                "--select",
                "metadata,images",
                "--partition",
                k,
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in keys[:3]
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "locked" not in out.lower(), out[-3000:]
        assert "RUN_SUCCESS" in out
    cat = Catalog(data)
    rows = cat.query(
        "SELECT asset, partition, count(*) AS n FROM materializations GROUP BY ALL ORDER BY ALL"
    )
    assert [(r["asset"], r["partition"]) for r in rows] == [
        (a, k) for a in ("images", "metadata") for k in keys[:3]
    ]
    assert all(r["n"] == 1 for r in rows)
    # 3 shards of 5 rows: every row has exactly one metadata outcome
    n = cat.query("SELECT count(DISTINCT id) AS n, count(*) AS m FROM rows WHERE asset='metadata'")[
        0
    ]
    assert n == {"n": 15, "m": 15}


def test_a_key_with_no_data_behind_it_fails_in_one_line_that_names_the_fix(resource):
    """A key added by hand (the UI's Materialize dialog accepts any) with no metadata file
    behind it: ``metadata`` fails at once, not retried, with one line that says why and what to
    run, as the failure's description (the UI's first line), not inside a stack trace."""
    from flowmatch_assets.defs.partitions import SHARDS

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SHARDS, ["003-00"])
        result = dg.materialize(
            _assets(),
            selection=["metadata"],
            partition_key="003-00",
            instance=instance,
            resources=resources_for(resource),
            raise_on_error=False,
        )
        assert not result.success
        (failure,) = [e for e in result.all_events if e.is_step_failure]
        data = failure.step_failure_data.user_failure_data
        assert data is not None and "\n" not in data.description
        assert data.description.startswith("partition 003-00 has no data behind it (")
        assert data.description.endswith(
            "remove it with `flowmatch partitions remove --orphans` (or `-p 003-00`)"
        )
        assert "no metadata file number 3" in data.description
        # and no second trace under it (the read error's chained cause): the line is the story
        assert failure.step_failure_data.error.cause is None
