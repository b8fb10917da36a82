"""`flowmatch upgrade` carries a data root and Dagster instance made under the old names
(pd12m_metadata, images_256, pd12m_shards) over to today's, once, safely again."""

from __future__ import annotations

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets import catalog
from flowmatch_assets.catalog import MaterializationRecord, RowOutcome
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.freshness.state import partition_states
from flowmatch_models.storage.layout import DataLayout


def test_upgrade_carries_an_old_data_root_and_instance_over(tmp_path, monkeypatch, capsys):
    root, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(root))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    # what the old names left: files, previews, catalog records, Dagster's keys and history
    for folder in ("metadata", "images_256"):
        (root / folder).mkdir(parents=True)
        pq.write_table(pa.table({"id": ["a"], "was": [folder]}), root / folder / "000-00.parquet")
    (root / "previews" / "images_256").mkdir(parents=True)
    (root / "previews" / "images_256" / "000-00.png").write_bytes(b"png")
    for old in ("pd12m_metadata", "images_256"):
        catalog.record_rows(root, old, "000-00", [RowOutcome("a", "u", "stored")])
        catalog.record_materialization(root, MaterializationRecord(old, "000-00", samples=1))
    with dg.DagsterInstance.get() as inst:
        inst.add_dynamic_partitions("pd12m_shards", ["000-00", "001-00"])
        for old in ("pd12m_metadata", "images_256"):
            inst.report_runless_asset_event(dg.AssetMaterialization(old, partition="000-00"))

    capsys.readouterr()
    assert cli_main(["upgrade"]) == 0
    out = capsys.readouterr().out
    assert "moved" in out and "2 keys of pd12m_shards registered in shards" in out
    assert pq.read_table(root / "images" / "000-00.parquet").column("was").to_pylist() == [
        "images_256"
    ]
    assert (root / "previews" / "images" / "000-00.png").exists()
    assert not (root / "images_256").exists()
    for new in ("metadata", "images"):
        for kind in ("rows", "materializations"):
            t = pq.read_table(root / "catalog" / kind / new / "000-00.parquet")
            assert t.column("asset").to_pylist() == [new]
        assert not (
            root / "catalog" / "rows" / {"metadata": "pd12m_metadata", "images": "images_256"}[new]
        ).exists()
    with dg.DagsterInstance.get() as inst:
        assert sorted(inst.get_dynamic_partitions("shards")) == ["000-00", "001-00"]
        states = partition_states(DataLayout(root), ["000-00"], ["metadata", "images"], inst)
        assert [s.missing for s in states] == [False, False]
    capsys.readouterr()
    assert cli_main(["upgrade"]) == 0  # again: nothing left to do
    assert capsys.readouterr().out.startswith("nothing to upgrade")
