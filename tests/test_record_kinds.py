"""The catalog's record kinds are one registry (flowmatch_assets/catalog/record_kinds.py): a new
kind is one entry plus its writer, and its placeholder, view and summary tracking follow; every
existing kind keeps the paths its records always had."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog import (
    RECORD_KINDS,
    Catalog,
    RecordKind,
    catalog_version,
    record_path,
    record_scan,
    summary,
    view_names,
)
from flowmatch_assets.catalog.records import _write_parquet
from flowmatch_models.storage.layout import DataLayout

NEAR = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("source", pa.string()),
        ("near_duplicates", pa.int64()),
        ("threshold", pa.float64()),
    ]
)


def _record_near(root, partition: str, rows: list[dict], schema: pa.Schema = NEAR) -> None:
    """The planted kind's writer: what a record_<name> function in records.py would be."""
    data = [{"asset": "images", "partition": partition, **r} for r in rows]
    _write_parquet(
        record_path(root, "near_dups", "images", partition),
        pa.Table.from_pylist(data, schema=schema),
    )


def test_a_new_record_kind_is_one_entry_and_its_writer(tmp_path, monkeypatch):
    """Per-source near-duplicate counts: registering the kind gives its placeholder, its view
    (listed, rebuilt into an existing catalog), and summary tracking of older-schema files,
    with no edit to views.py or summary.py."""
    layout = DataLayout(tmp_path)
    before = catalog_version(layout)
    Catalog(tmp_path).ensure()
    kind = RecordKind("near_dups", NEAR, "row", view="near_duplicate_records")
    monkeypatch.setitem(RECORD_KINDS, kind.name, kind)
    assert catalog_version(layout) != before and "near_duplicate_records" in view_names()
    cat = Catalog(tmp_path)
    assert cat.query("SELECT count(*) AS n FROM near_duplicate_records") == [{"n": 0}]
    placeholder = tmp_path / "catalog" / "near_dups" / "_empty" / "_empty.parquet"
    assert pq.read_schema(placeholder).names == NEAR.names
    _record_near(
        tmp_path,
        "000-00",
        [
            {"source": "pd12m", "near_duplicates": 3, "threshold": 0.9},
            {"source": "photos", "near_duplicates": 1, "threshold": 0.9},
        ],
    )
    sql = (
        "SELECT partition, source, near_duplicates AS n, threshold FROM "
        "near_duplicate_records ORDER BY partition, source"
    )
    assert cat.query(sql) == [
        {"partition": "000-00", "source": "pd12m", "n": 3, "threshold": 0.9},
        {"partition": "000-00", "source": "photos", "n": 1, "threshold": 0.9},
    ]
    # a record of the kind's older schema (before `threshold`): the summary finds it and the
    # view reads by name, the missing column NULL
    old = pa.schema([f for f in NEAR if f.name != "threshold"])
    _record_near(tmp_path, "000-01", [{"source": "pd12m", "near_duplicates": 2}], old)
    assert cat.query(sql)[-1] == {
        "partition": "000-01",
        "source": "pd12m",
        "n": 2,
        "threshold": None,
    }
    assert "near_dups" in summary.legacy_kinds(layout)
    assert "near_dups/images" in record_scan.State(summary.summary_dir(layout)).dirs
    # a custom view over it is one more CREATE in views.py; here the registry's plain view
    # already answers the report
    assert cat.query(
        "SELECT source, sum(near_duplicates)::BIGINT AS n FROM "
        "near_duplicate_records GROUP BY source ORDER BY source"
    ) == [{"source": "pd12m", "n": 5}, {"source": "photos", "n": 1}]
    monkeypatch.delitem(RECORD_KINDS, kind.name)
    assert catalog_version(layout) == before  # unregistered: the catalog as it was
    assert "near_duplicate_records" not in view_names()


def test_every_record_kind_keeps_the_paths_its_records_always_had(tmp_path):
    """No data root moves: the registry's paths are the literal ones of the records before it
    (a data root written by an older flowmatch reads as is; tests/test_catalog.py reads such
    records of older schemas)."""
    c = tmp_path / "catalog"
    expected = {
        ("materializations", "images", "000-00"): c / "materializations/images/000-00.parquet",
        ("rows", "metadata", "000-00"): c / "rows/metadata/000-00.parquet",
        ("attempts", "images", "000-00"): c / "attempts/images/000-00.parquet",
        ("duplicates", "images", "000-00"): c / "duplicates/images/000-00.parquet",
        ("content", "images", "000-00"): c / "content/images/000-00.parquet",
        ("cards", "data_card", "000-00"): c / "cards/data_card/000-00.parquet",
        ("evaluations", "r1", "step0000200"): c / "evaluations/r1/step0000200.parquet",
        ("fd", "r1", "step0000200"): c / "fd/r1/step0000200.parquet",
        ("ledger", "r1", "step0000200"): c / "ledger/r1/step0000200.parquet",
        ("ledger_chain", "r1", "step0000200"): c / "ledger_chain/r1/step0000200.parquet",
        ("ledger_epochs", "r1", "step0000200"): c / "ledger_epochs/r1/step0000200.parquet",
        ("validation", "r1", ""): c / "validation/r1.parquet",
        ("partitions", "", ""): c / "partitions.parquet",
    }
    assert {k[0] for k in expected} == set(RECORD_KINDS)
    for (kind, group, key), path in expected.items():
        assert record_path(tmp_path, kind, group, key) == path, kind
    from flowmatch_assets.catalog import ledger_path

    assert (
        ledger_path(tmp_path, "r1", 200, "ledger_chain")
        == expected[("ledger_chain", "r1", "step0000200")]
    )
    Catalog(tmp_path).ensure()  # one placeholder per kind, where the globs look
    empties = sorted(
        p.relative_to(c).as_posix()
        for p in c.rglob("_empty.parquet")
        if p.relative_to(c).parts[0] in RECORD_KINDS
    )  # not card_summaries/
    assert empties == sorted(
        f"{k}/_empty.parquet" if RECORD_KINDS[k].per == "run" else f"{k}/_empty/_empty.parquet"
        for k in RECORD_KINDS
        if RECORD_KINDS[k].per != "root"
    )
