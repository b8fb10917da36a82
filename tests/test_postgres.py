"""Scale-out storage: a backfill of two partitions runs against a real PostgreSQL (the
deploy/dagster.postgres.yaml instance config), launched through `dagster dev`'s GraphQL and run
with the code location's executor (each run executes its steps in its process); the runs and their events live in Postgres."""

from __future__ import annotations

import time

import dagster as dg
import pytest

from flowmatch_assets.bench.postgres_server import pg_bin, postgres_server
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import dagster_dev
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.freshness import backfill
from tests.conftest import REPO, make_resource

ASSETS = ["metadata", "images"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backfill_on_postgres_storage(tmp_path, small_sample, monkeypatch):
    if pg_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql; .ci/run does)")
    with postgres_server() as pg:
        env = {
            "DAGSTER_PG_URL": f"postgresql+psycopg2://{pg.user}@{pg.host}:{pg.port}/{pg.db}",
            "FLOWMATCH_DATA_ROOT": str(tmp_path / "data"),
            "FLOWMATCH_METADATA": small_sample["metadata"],
            "FLOWMATCH_FILE_ROOT": small_sample["dest"],
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        home = tmp_path / "home"
        home.mkdir()
        (home / "dagster.yaml").write_text((REPO / "deploy" / "dagster.postgres.yaml").read_text())
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            keys = sorted(
                register_partitions(instance, make_resource(tmp_path / "data", small_sample))
            )
        assert keys == ["000-00", "001-00"]

        with dagster_dev(home, env, tmp_path / "dagster_dev.log") as dev:
            bid = backfill.launch_backfill(dev.url, keys, ASSETS, title="postgres test")
            try:
                st = backfill.wait_backfill(dev.url, bid, timeout=400, poll=5)
            except TimeoutError as e:
                pytest.fail(dev.fail_msg(str(e)))
            assert st["ok"], dev.fail_msg(str(st))
            time.sleep(1)

        with dg.DagsterInstance.from_config(str(home)) as instance:
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": bid}))
            assert sorted(r.tags["dagster/partition"] for r in runs) == keys
            assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
            # each run executed its steps in its own process (the code location's executor)
            logs = instance.all_logs(runs[0].run_id)
            assert any("steps in process" in (e.user_message or "").lower() for e in logs)
            for a in ASSETS:
                assert instance.get_materialized_partitions(dg.AssetKey(a)) == set(keys)
    cov = {r["partition"]: r for r in Catalog(tmp_path / "data").coverage()}
    assert all(cov[k]["images"] for k in keys)
