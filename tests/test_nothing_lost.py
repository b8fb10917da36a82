"""Nothing lost, nothing silent: a bad run never replaces good data, the data root moves,
"missing" means one thing, failed rows can be retried, numbers are honest, and CLI mistakes get
a one-line answer (issue 9)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets import cli
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.definitions import defs
from flowmatch_assets.defs.budget_assets import rounded
from flowmatch_assets.defs.definitions import all_assets_and_checks, resources_for
from flowmatch_assets.defs.partitions import SHARDS, register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.defs.training_assets import round_meta
from flowmatch_assets.demo.dataset import SampleSpec, write_sample
from flowmatch_assets.freshness import backfill
from flowmatch_assets.freshness.state import dagster_materialized, partition_states
from flowmatch_assets.ingest.images import IngestConfig, is_retryable
from flowmatch_assets.reports.measured import steady_rate
from flowmatch_models.encoders.spec import EncoderSpec
from flowmatch_models.storage.layout import PARTITIONED_ASSETS
from tests.conftest import make_resource
from tests.http_fixtures import LoopbackHTTPServer, Reply

DATA = ["metadata", "images"]


def _res(root: Path, sample: dict, **ingest) -> FlowmatchResource:
    """A resource like conftest's make_resource, with ingest settings changed."""
    return FlowmatchResource(
        data_root=str(root),
        metadata_source=sample["metadata"],
        ingest=IngestConfig(
            **{"file_root": sample["dest"], "threads": 4, "allow_networks": ["127.0.0.0/8"]}
            | ingest
        ),
    )


def _mat(res, key, instance, selection=DATA, run_config=None):
    return dg.materialize(
        all_assets_and_checks(),
        selection=selection,
        partition_key=key,
        instance=instance,
        resources=resources_for(res),
        raise_on_error=False,
        run_config=run_config or {},
    )


def _failure_message(result) -> str:
    return "\n".join(
        ev.step_failure_data.error.message
        for ev in result.all_events
        if ev.is_step_failure and ev.step_failure_data.error
    )


def _records(root: Path, asset: str, key: str) -> tuple[bytes, bytes]:
    c = root / "catalog"
    return (
        (c / "materializations" / asset / f"{key}.parquet").read_bytes(),
        (c / "rows" / asset / f"{key}.parquet").read_bytes(),
    )


def _stale(instance, asset: str, partition: str) -> str:
    """Dagster's staleness of one asset partition, as the UI shows it (FRESH / STALE)."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._core.loader import LoadingContextForTest

    graph = defs.get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
    return resolver.get_status(dg.AssetKey(asset), partition).name


# --- 1. a bad run never replaces good data ----------------------------------------------------


def test_bad_attempt_keeps_the_shard_and_its_records_and_records_its_failures(
    tmp_path, small_sample
):
    good = make_resource(tmp_path / "data", small_sample)
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()
    bad = _res(tmp_path / "data", small_sample, file_root=str(elsewhere))
    with dg.instance_for_test() as instance:
        register_partitions(instance, good)
        assert _mat(good, "000-00", instance).success
        shard = good.layout.asset_path("images", "000-00")
        before, records = shard.read_bytes(), _records(tmp_path / "data", "images", "000-00")
        n_mats = len(instance.fetch_materializations(dg.AssetKey("images"), limit=10).records)

        result = _mat(bad, "000-00", instance, selection=["images"])
        assert not result.success
        msg = _failure_message(result)
        assert "stored 0/16 images" in msg and "not_found x16" in msg, msg
        # the good shard, its catalog records and Dagster's latest materialization are untouched
        assert shard.read_bytes() == before
        assert _records(tmp_path / "data", "images", "000-00") == records
        n_after = len(instance.fetch_materializations(dg.AssetKey("images"), limit=10).records)
        assert n_after == n_mats
        cat = Catalog(good.data_root)
        assert cat.query(
            "SELECT samples FROM coverage WHERE asset='images' AND partition='000-00'"
        ) == [{"samples": 10}]
        # ... and the attempt's failures are inspectable
        rej = cat.query(
            "SELECT reason, retryable, count(*) AS n FROM rejected_attempts GROUP BY ALL"
        )
        assert rej == [{"reason": "not_found", "retryable": False, "n": 16}]

        # a good run afterwards replaces the records and clears the rejected attempt
        assert _mat(good, "000-00", instance, selection=["images"]).success
        assert cat.query("SELECT count(*) AS n FROM rejected_attempts") == [{"n": 0}]


def test_zero_images_never_become_an_embedding_shard(tmp_path, small_sample):
    res = _res(tmp_path / "data", small_sample, file_root=str(tmp_path), min_stored_fraction=0)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _mat(res, "001-00", instance).success  # floor 0: an empty images shard
        assert pq.read_metadata(res.layout.asset_path("images", "001-00")).num_rows == 0
        result = _mat(res, "001-00", instance, selection=["vae_latents"])
        assert not result.success
        assert "has 0 images, nothing to encode" in _failure_message(result)
        assert not res.layout.asset_path("vae_latents", "001-00").exists()


@pytest.mark.slow
def test_a_data_root_moves(tmp_path, zoo):
    """The sample's URLs are relative to the file root and the catalog rebuilds its views, so
    a data root moved elsewhere re-materializes, answers queries and trains from its new place."""
    old = tmp_path / "old"
    sample = write_sample(old / "sample", SampleSpec(files=1, rows_per_file=6, seed=3))
    enc = EncoderSpec(**zoo, batch_size=8)
    res = make_resource(old, sample, encoders=enc)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _mat(res, "000-00", instance, list(PARTITIONED_ASSETS)).success
        assert Catalog(old).query(
            "SELECT sum(samples) AS n FROM coverage WHERE asset='images'"
        ) == [{"n": 6}]
    new = tmp_path / "moved"
    shutil.move(old, new)
    where = {"metadata": str(new / "sample" / "metadata"), "dest": str(new / "sample")}
    moved = make_resource(new, where, encoders=enc)
    with dg.instance_for_test() as instance:
        register_partitions(instance, moved)
        cat = Catalog(new)
        assert cat.query("SELECT asset, samples FROM coverage ORDER BY lineage_order") == [
            {"asset": a, "samples": 6 if a != "metadata" else 12} for a in PARTITIONED_ASSETS
        ]
        result = _mat(moved, "000-00", instance, list(PARTITIONED_ASSETS))
        assert result.success, _failure_message(result)
        assert cat.query(
            "SELECT outcome, count(*) AS n FROM rows WHERE asset='images' GROUP BY ALL ORDER BY ALL"
        ) == [
            {"outcome": "failed", "n": 6},  # the sample's deliberately bad rows
            {"outcome": "stored", "n": 6},
        ]
        # a replaced shard makes its downstream partitions out of date (the UI's "upstream
        # changed"), a rejected attempt does not
        assert _stale(instance, "vae_latents", "000-00") == "FRESH"
        bad = make_resource(new, {**where, "dest": str(tmp_path)}, encoders=enc)
        assert not _mat(bad, "000-00", instance, ["images"]).success
        assert _stale(instance, "vae_latents", "000-00") == "FRESH"
        assert _mat(moved, "000-00", instance, ["images"]).success
        # the same shard again: same data version (fingerprint + content), nothing to redo
        assert _stale(instance, "vae_latents", "000-00") == "FRESH"
        other = FlowmatchResource(  # another JPEG quality: another fingerprint, data version
            data_root=str(new),
            metadata_source=where["metadata"],
            encoders=enc,
            ingest=IngestConfig(file_root=where["dest"], threads=4, quality=80),
        )
        assert _mat(other, "000-00", instance, ["images"]).success
        assert _stale(instance, "vae_latents", "000-00") == "STALE"
        settings = {
            "data": {"batch_size": 4},
            "sample": {"steps": 2},
            "trainer": {"log_every": 1, "sample_every": 1000, "checkpoint_every": 1000},
        }
        result = dg.materialize(
            list(defs.assets),
            selection=["flow_model"],
            instance=instance,
            resources=resources_for(moved),
            run_config={
                "ops": {
                    "flow_model": {
                        "config": {"run_name": "m", "max_steps": 3, "settings": settings}
                    }
                }
            },
            raise_on_error=False,
        )
        assert result.success, _failure_message(result)
        assert (new / "runs" / "m" / "checkpoints" / "last.ckpt").is_file()
        tp = cat.query("SELECT samples_per_s FROM throughput WHERE asset = 'flow_model'")
        md = instance.fetch_materializations(dg.AssetKey("flow_model"), limit=1).records[0]
        assert tp[0]["samples_per_s"] > 0  # one training speed: the catalog's is the metadata's
        assert md.asset_materialization.metadata["samples_per_s"].value == round_meta(
            tp[0]["samples_per_s"]
        )
    assert str(old) not in Path(cat.ensure()).read_bytes().decode(errors="ignore")


# --- 3. "missing" means one thing -------------------------------------------------------------


def test_verify_then_missing_recreates_exactly_the_deleted_and_the_corrupt_shard(
    tmp_path, small_sample, monkeypatch, capsys
):
    data = tmp_path / "data"
    home = tmp_path / "home"
    home.mkdir()
    for k, v in {
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": small_sample["metadata"],
        "FLOWMATCH_FILE_ROOT": small_sample["dest"],
    }.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["materialize", "-a", "metadata", "-a", "images"]) == 0
    layout = make_resource(data, small_sample).layout
    with dg.DagsterInstance.get() as instance:
        # the checks ran with the CLI's materialization, and passed
        ev = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(dg.AssetKey("images"), "images_complete")]
        )
        assert list(ev.values())[0].status.value == "SUCCEEDED"
        assert backfill.missing_partitions(instance, DATA, str(data)) == []
        layout.asset_path("images", "000-00").unlink()
        p = layout.asset_path("images", "001-00")
        p.write_bytes(p.read_bytes()[:100])
        capsys.readouterr()
        assert cli.main(["verify"]) == 1
        out = capsys.readouterr().out
        assert "000-00  images  gone" in out and "001-00  images  corrupt" in out
        assert "2 asset partitions missing" in out
        # Dagster, the catalog and the files now agree
        # Dagster's latest attempt for each is a failure recorded by verify (the UI: Failed)
        assert dagster_materialized(instance, "images") == set()
        runs = instance.get_runs(dg.RunsFilter(tags={"flowmatch/cli": "verify"}))
        assert sorted(r.tags["dagster/partition"] for r in runs) == ["000-00", "001-00"]
        assert {r.status for r in runs} == {dg.DagsterRunStatus.FAILURE}
        assert backfill.missing_partitions(instance, DATA, str(data)) == ["000-00", "001-00"]
        cov = Catalog(data).query(
            "SELECT partition, materialized FROM coverage WHERE asset IN ('images', 'metadata') ORDER BY ALL"
        )
        assert [(r["partition"], r["materialized"]) for r in cov] == [
            ("000-00", False),
            ("000-00", True),
            ("001-00", False),
            ("001-00", True),
        ]
        n_meta = len(instance.fetch_materializations(dg.AssetKey("metadata"), limit=10).records)
    capsys.readouterr()
    assert cli.main(["materialize", "--missing", "-a", "metadata", "-a", "images"]) == 0
    out = capsys.readouterr().out
    assert "000-00: images ok" in out and "001-00: images ok" in out
    with dg.DagsterInstance.get() as instance:
        assert n_meta == len(
            instance.fetch_materializations(dg.AssetKey("metadata"), limit=10).records
        )
        assert backfill.missing_partitions(instance, DATA, str(data)) == []
    states = partition_states(layout, ["000-00", "001-00"], DATA)
    assert {s.state for s in states} == {"present"}


# --- 4. failures you can act on ---------------------------------------------------------------


@pytest.mark.parametrize(
    "reason, retryable",
    [
        ("timeout", True),
        ("connection_error", True),
        ("http_503", True),
        ("http_429", True),
        ("http_404", False),
        ("corrupt", False),
        ("not_image", False),
        ("too_small", False),
        ("decompression_bomb", False),
        ("too_large", False),
        ("redirect_refused", False),
        ("file_not_allowed", False),
        (None, False),
    ],
)
def test_retryable_reasons(reason, retryable):
    assert is_retryable(reason) is retryable


def test_retry_refetches_only_retryable_rows_and_merges_them_in_order(
    tmp_path, small_sample, monkeypatch, capsys
):
    """`flowmatch retry` re-fetches the rows that failed as http_503 (4 attempts each the first
    time) and merges them into the shard; meanwhile the catalog keeps showing the old records."""
    src = pq.read_table(Path(small_sample["metadata"]) / "pd12m.001.parquet")
    flaky = set(src.column("id").to_pylist()[2:5])  # 3 of 10 rows fail the first run
    attempts = IngestConfig().retries + 1
    with LoopbackHTTPServer() as srv:
        urls = []
        for r in src.to_pylist():
            body = (Path(small_sample["dest"]) / r["url"].removeprefix("file:")).read_bytes()
            ok = Reply(body=body, headers={"Content-Type": "image/jpeg"})
            slow = Reply(body=body, headers={"Content-Type": "image/jpeg"}, delay_s=1.5)
            route = (
                (lambda n, ok=slow: Reply(status=503) if n <= attempts else ok)
                if r["id"] in flaky
                else ok
            )
            urls.append(srv.add(f"/{r['id']}.jpg", route))
        md = tmp_path / "metadata"
        md.mkdir()
        pq.write_table(
            src.set_column(src.schema.get_field_index("url"), "url", pa.array(urls)),
            md / "pd12m.000.parquet",
        )
        data = tmp_path / "data"
        for k, v in {
            "DAGSTER_HOME": str(tmp_path),
            "FLOWMATCH_DATA_ROOT": str(data),
            "FLOWMATCH_METADATA": str(md),
            "FLOWMATCH_ALLOW_NETWORKS": "127.0.0.0/8",  # the loopback image server
        }.items():
            monkeypatch.setenv(k, v)
        assert cli.main(["materialize", "-a", "metadata", "-a", "images"]) == 0
        cat = Catalog(data)
        assert cat.query("SELECT reason, retryable, count(*) AS n FROM failures GROUP BY ALL") == [
            {"reason": "http_503", "retryable": True, "n": 3}
        ]
        shard = data / "images" / "000-00.parquet"
        first = {
            r["id"]: r["image"] for r in pq.read_table(shard, columns=["id", "image"]).to_pylist()
        }
        assert len(first) == 7
        capsys.readouterr()
        rc: list[int] = []
        t = threading.Thread(target=lambda: rc.append(cli.main(["retry"])))
        t.start()
        deadline = time.monotonic() + 120
        while not any(srv.hits(f"/{i}.jpg") > attempts for i in flaky):  # the retry is fetching
            assert t.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        # mid-run (the retried rows are served 1.5 s late): the catalog shows the old records
        assert cat.query("SELECT samples FROM coverage WHERE asset = 'images'") == [{"samples": 7}]
        assert cat.query("SELECT count(*) AS n FROM rows WHERE asset = 'images'") == [{"n": 10}]
        t.join(300)
        assert rc == [0]
        assert "000-00: retrying 3 failed rows" in capsys.readouterr().out
        for r in src.to_pylist():  # only the 3 failed rows were fetched again
            assert srv.hits(f"/{r['id']}.jpg") == (attempts + 1 if r["id"] in flaky else 1)
    t = pq.read_table(shard, columns=["id", "image"]).to_pylist()
    assert [r["id"] for r in t] == src.column("id").to_pylist()  # metadata order, no duplicates
    assert all(first[r["id"]] == r["image"] for r in t if r["id"] in first)  # kept as they were
    assert cat.query("SELECT count(*) AS n FROM failures") == [{"n": 0}]
    rec = cat.query(
        """SELECT samples, seconds, CAST(extra->>'$.retry.fetched' AS INT) AS fetched,
                  CAST(extra->>'$.retry.seconds' AS DOUBLE) AS retry_s
           FROM materializations WHERE asset = 'images'"""
    )[0]
    assert (rec["samples"], rec["fetched"]) == (10, 3)
    assert rec["seconds"] > rec["retry_s"] >= 1.5  # both runs' seconds: honest images/s
    capsys.readouterr()
    assert cli.main(["retry"]) == 0  # nothing left to retry
    assert "no failed rows with a retryable reason" in capsys.readouterr().out


# --- 5. honest numbers ------------------------------------------------------------------------


def test_downloaded_bytes_are_the_bytes_read(tmp_path, small_sample):
    res = make_resource(tmp_path / "data", small_sample)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _mat(res, "001-00", instance).success
        md = instance.fetch_materializations(dg.AssetKey("images"), limit=1).records[0]
        got = md.asset_materialization.metadata["downloaded_bytes"].value
    rows = pq.read_table(res.layout.asset_path("metadata", "001-00")).to_pylist()
    want = sum((Path(small_sample["dest"]) / r["url"][5:]).stat().st_size for r in rows)
    assert got == want and want > 100_000


def test_steady_rate_is_the_median_without_the_first_and_last_window():
    # the run: start-up window, steady windows ~237/s, a last window with checkpoint
    assert steady_rate([30.0, 230.0, 237.0, 240.0, 236.0, 54.0]) == 236.5
    assert steady_rate([30.0, 200.0]) == 200.0
    assert steady_rate([]) is None
    assert round_meta(0.5136181712150574) == 0.5136
    assert round_meta(dg.FloatMetadataValue(1234.5678)) == 1235.0
    assert rounded({"hours": [0.5136181712150574, 12345678.9], "n": 3}) == {
        "hours": [0.5136, 12350000.0],
        "n": 3,
    }


# --- 6. one-line answers ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, small_sample, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    for k, v in {
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_DATA_ROOT": str(tmp_path / "data"),
        "FLOWMATCH_METADATA": small_sample["metadata"],
        "FLOWMATCH_FILE_ROOT": small_sample["dest"],
    }.items():
        monkeypatch.setenv(k, v)
    with dg.DagsterInstance.get() as instance:
        register_partitions(instance, make_resource(tmp_path / "data", small_sample))
        assert sorted(instance.get_dynamic_partitions(SHARDS)) == ["000-00", "001-00"]

    def err(argv: list[str]) -> str:
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        e = capsys.readouterr().err.strip()
        assert "Traceback" not in e and len(e.splitlines()) == 1, e
        return e

    assert "unknown partition '000-0'; nearest: 000-00, 001-00" in err(
        ["materialize", "-p", "000-0"]
    )
    e = err(["materialize", "-a", "images256"])
    assert "unknown asset 'images256'; did you mean 'images'?" in e and "text_embeddings" in e
    assert 'catalog sql needs the SQL: flowmatch catalog sql "SELECT' in err(["catalog", "sql"])
    assert "the catalog rejected the SQL" in err(["catalog", "sql", "SELEC 1"])
    assert "unknown benchmark 'imgs'" in err(["bench", "imgs"])
    assert "unknown partition 'nope'" in err(["retry", "-p", "nope"])
    port = _free_port()
    capsys.readouterr()
    assert cli.main(["backfill", "--missing", "--url", f"http://127.0.0.1:{port}"]) == 2
    e = capsys.readouterr().err.strip()
    assert e.startswith(f"flowmatch backfill: no Dagster webserver at http://127.0.0.1:{port}")
    assert len(e.splitlines()) == 1
    capsys.readouterr()
    assert cli.main(["backfill", "--missing", "--assets", "images256"]) == 2
    assert capsys.readouterr().err.strip() == (
        "flowmatch backfill: unknown asset 'images256'; partitioned assets: metadata, "
        "images, vae_latents, dino_features, text_embeddings"
    )
    monkeypatch.setenv("FLOWMATCH_MIN_STORED_FRACTION", "2")
    e = err(["materialize", "-p", "000-00"])
    assert (
        "bad setting FLOWMATCH_MIN_STORED_FRACTION='2' (min_stored_fraction: Input should be less than or equal to 1)"
        in e
    )
    monkeypatch.delenv("FLOWMATCH_MIN_STORED_FRACTION")
    monkeypatch.setenv("FLOWMATCH_SHARD_SIZE", "ten")
    assert "bad setting FLOWMATCH_SHARD_SIZE='ten' is not a whole number; fix that" in err(
        ["partitions", "list"]
    )
    monkeypatch.delenv("FLOWMATCH_SHARD_SIZE")
    monkeypatch.setenv("FLOWMATCH_METADATA", str(tmp_path / "no-such-folder"))
    e = err(["partitions", "list"])
    assert "FLOWMATCH_METADATA" in e and "flowmatch demo-data" in e
    # --help is help, not an error
    capsys.readouterr()
    assert cli.main(["bench", "--help"]) == 0
    from flowmatch_assets.bench import BENCHES

    assert f"flowmatch bench {{{','.join(sorted(BENCHES))}}}" in capsys.readouterr().out
    # --debug: the traceback
    with pytest.raises(cli.CliError):
        cli.main(["catalog", "sql", "--debug"])


# --- a step publishes all of a partition or nothing; one run of a partition at a time ---------


def _published(root: Path, key: str) -> dict[str, bytes]:
    """Every published file of images 000-00: the shard, its records, its preview."""
    c = root / "catalog"
    files = [
        root / "images" / f"{key}.parquet",
        root / "previews" / "images" / f"{key}.png",
    ]
    files += [
        c / k / "images" / f"{key}.parquet"
        for k in ("materializations", "rows", "content", "duplicates")
    ]
    return {str(f.relative_to(root)): f.read_bytes() for f in files if f.exists()}


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def test_a_late_failure_publishes_nothing(tmp_path, small_sample):
    """images fails after its shard, content and duplicate records are written (the preview
    cannot be written): none of them is published, the previous ones stay, no temp is left."""
    from flowmatch_assets.runs import step_failures

    root = tmp_path / "data"
    res = make_resource(root, small_sample)
    other = _res(root, small_sample, quality=70)  # a re-run that would change the shard
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _mat(res, "000-00", instance).success
        before = _published(root, "000-00")
        assert len(before) == 6
        previews = root / "previews" / "images"
        shutil.rmtree(previews)
        previews.write_text("a file where the previews folder should be")
        result = _mat(other, "000-00", instance, selection=["images"])
        assert not result.success
        ((step, msg),) = step_failures(result)
        assert step == "images" and "nothing was published" in msg, msg
        assert "Not a directory" in msg or "File exists" in msg, msg
        previews.unlink()
        assert {k: v for k, v in _published(root, "000-00").items() if "previews" not in k} == {
            k: v for k, v in before.items() if "previews" not in k
        }
        assert _temps(root) == []
        assert _mat(other, "000-00", instance, selection=["images"]).success
        after = _published(root, "000-00")
        assert after["images/000-00.parquet"] != before["images/000-00.parquet"]


def test_a_full_disk_is_named_and_publishes_nothing(tmp_path, small_sample):
    """On a real full filesystem (a small tmpfs, as root) the step fails saying "No space left
    on device", the previous shard and records stay, and nothing temporary is left."""
    from flowmatch_assets.runs import step_failures
    from tests.test_run_safety import _mount_tmpfs

    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "16m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        root = disk / "data"
        res = make_resource(root, small_sample)
        with dg.instance_for_test() as instance:
            register_partitions(instance, res)
            assert _mat(res, "000-00", instance).success
            before = _published(root, "000-00")
            free = shutil.disk_usage(disk).free
            with open(disk / "ballast", "wb") as f:
                f.write(b"\0" * max(0, free - 64 * 1024))
            result = _mat(
                _res(root, small_sample, quality=70), "000-00", instance, selection=["images"]
            )
            assert not result.success
            ((step, msg),) = step_failures(result)
            assert "No space left on device" in msg and "nothing was published" in msg, msg
            assert _published(root, "000-00") == before
            assert _temps(root) == []
        # nothing of the failed write is still open (pyarrow's handle once kept the deleted
        # temp file, and the filesystem, busy): a plain umount succeeds
        r = subprocess.run(["umount", str(disk)], capture_output=True, text=True, timeout=20)
        assert r.returncode == 0, r.stderr
    finally:
        if os.path.ismount(disk):
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=20)


def test_two_runs_of_one_partition_wait_for_each_other(tmp_path, small_sample):
    """A run of a partition waits while another holds it, and never removes that run's temp
    file (the second of two runs at once used to remove the first one's and fail it)."""
    import fcntl

    root = tmp_path / "data"
    res = make_resource(root, small_sample)
    with dg.instance_for_test() as instance:
        register_partitions(instance, res)
        assert _mat(res, "000-00", instance, selection=["metadata"]).success
        lock = root / ".locks" / "images" / "000-00.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        theirs = root / "images" / ".tmp-000-00.parquet.theirs.tmp"
        theirs.parent.mkdir(parents=True, exist_ok=True)
        results = []
        with open(lock, "a+") as held:  # another run of images 000-00 is writing
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            theirs.write_bytes(b"half a shard")
            t = threading.Thread(
                target=lambda: results.append(_mat(res, "000-00", instance, ["images"]))
            )
            t.start()
            time.sleep(3)
            assert t.is_alive() and theirs.exists()  # it waits; their temp file is theirs
            assert not (root / "images" / "000-00.parquet").exists()
            fcntl.flock(held.fileno(), fcntl.LOCK_UN)
        t.join(timeout=120)
        assert results and results[0].success
        assert not theirs.exists()  # stale once the lock was free: removed
        assert pq.read_metadata(root / "images" / "000-00.parquet").num_rows == 10
