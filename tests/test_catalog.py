"""The DuckDB catalog: records replace (never duplicate), views answer the reports, and many
processes can write records and read the catalog at once without lock errors."""

from __future__ import annotations

import multiprocessing as mp

import duckdb
import pytest

from flowmatch_assets.catalog import (
    Catalog,
    MaterializationRecord,
    RowOutcome,
    record_card_rows,
    record_content,
    record_materialization,
    record_partitions,
    record_rows,
)


def test_empty_catalog_answers_every_report(tmp_path):
    cat = Catalog(tmp_path)
    assert cat.coverage() == []
    assert cat.failures_by_reason() == []
    assert cat.compression() == []
    # the file opens with plain duckdb too
    with duckdb.connect(str(cat.ensure()), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM materializations").fetchone() == (0,)


def test_records_replace_and_reports(tmp_path):
    record_partitions(
        tmp_path,
        [
            {"partition": k, "source_file": "f", "row_start": 0, "row_end": 10}
            for k in ("000-00", "000-01")
        ],
    )
    for _ in range(2):  # the same partition twice: replaced, not duplicated
        record_materialization(
            tmp_path,
            MaterializationRecord(
                "images", "000-00", samples=8, raw_bytes=800, stored_bytes=100, seconds=2.0
            ),
        )
        record_rows(
            tmp_path,
            "images",
            "000-00",
            [RowOutcome(f"i{k}", "u", "stored") for k in range(8)]
            + [RowOutcome("bad", "u", "failed", "http_404", "404")],
        )
    cat = Catalog(tmp_path)
    cov = {r["partition"]: r for r in cat.coverage()}
    assert cov["000-00"]["images"] == 8 and cov["000-01"]["images"] is None
    assert cov["000-00"]["vae_latents"] is None
    comp = cat.compression()[0]
    assert comp["ratio"] == 8.0 and comp["samples"] == 8
    assert comp["projected_pd12m_gb"] == 100 / 8 * 12_400_000 / 1e9  # bytes/sample x 12.4M
    assert cat.throughput()[0]["samples_per_s"] == 4.0
    assert cat.failures_by_reason() == [
        {
            "asset": "images",
            "outcome": "failed",
            "reason": "http_404",
            "retryable": False,
            "rows": 1,
        }
    ]
    assert cat.query("SELECT count(*) AS n FROM rows")[0]["n"] == 9


def test_sizes_are_disk_bytes_per_asset(tmp_path, monkeypatch, capsys):
    """`flowmatch catalog sizes`: one line per asset, its partitions' stored bytes summed, in
    human units (`--json`: the exact bytes), partitioned assets in lineage order."""
    from flowmatch_assets.cli import main

    for asset, part, size in [
        ("vae_latents", "000-00", 3 << 20),
        ("images", "000-00", 1000),
        ("images", "000-01", 1048),
    ]:
        record_materialization(
            tmp_path, MaterializationRecord(asset, part, samples=1, stored_bytes=size)
        )
    # a training run's record as publish_run writes it: no stored file, its folder in extra
    record_materialization(
        tmp_path,
        MaterializationRecord(
            "flow_model", "demo", samples=1, extra={"step": 7, "disk_bytes": 5 << 30}
        ),
    )
    assert Catalog(tmp_path).sizes() == [
        {"asset": "images", "partitions": 2, "bytes": 2048},
        {"asset": "vae_latents", "partitions": 1, "bytes": 3 << 20},
        {"asset": "flow_model", "partitions": 1, "bytes": 5 << 30},
    ]
    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path))
    capsys.readouterr()
    assert main(["catalog", "sizes"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        ["images", "2", "KiB"],
        ["vae_latents", "3", "MiB"],
        ["flow_model", "5", "GiB"],
    ]


def _writer(root: str, k: int) -> None:
    for j in range(15):
        part = f"{k:03d}-{j:02d}"
        record_rows(
            root, "images", part, [RowOutcome(f"{part}-{i}", None, "stored") for i in range(20)]
        )
        record_materialization(root, MaterializationRecord("images", part, samples=20, seconds=1.0))
        # read the catalog while others write
        Catalog(root).query("SELECT count(*) FROM materializations")


def test_many_processes_write_and_read_without_lock_errors(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    cat = Catalog(tmp_path)
    assert cat.query("SELECT count(*) AS n, sum(samples) AS s FROM materializations")[0] == {
        "n": 60,
        "s": 1200,
    }
    assert cat.query("SELECT count(DISTINCT id) AS n FROM rows")[0]["n"] == 1200


# ---------------------------------------------------------------- summaries (issue 28)


def _partition(root, key: str, md5s: list[str], images: bool = True, card: bool = True) -> None:
    """One partition's records as the assets write them: every row stored."""
    ids = [f"{key}-{i}" for i in range(len(md5s))]
    record_rows(root, "metadata", key, [RowOutcome(i, "u", "stored") for i in ids])
    record_materialization(root, MaterializationRecord("metadata", key, samples=len(ids)))
    if images:
        record_rows(root, "images", key, [RowOutcome(i, "u", "stored") for i in ids])
        record_content(
            root,
            key,
            [{"id": i, "position": k, "md5": m} for k, (i, m) in enumerate(zip(ids, md5s))],
        )
        record_materialization(root, MaterializationRecord("images", key, samples=len(ids)))
    if card:
        record_card_rows(
            root,
            key,
            [
                {
                    "id": i,
                    "caption_chars": 10 + k,
                    "caption_tokens": 3,
                    "max_tokens": 8,
                    "width": 300,
                    "height": 300,
                    "orig_width": 300 + k,
                    "orig_height": 300,
                    "bucket": "256x256",
                    "kept": 1.0,
                    "license": "cc0-1.0",
                    "source": "x",
                }
                for k, i in enumerate(ids)
            ],
        )


def _outcomes(cat: Catalog, scope: str) -> dict:
    rows = cat.query(
        "SELECT item, value FROM data_card WHERE scope = ? AND section = 'outcome'", [scope]
    )
    return {r["item"]: r["value"] for r in rows}


def test_the_card_follows_a_duplicate_found_later_and_a_retried_partition(tmp_path):
    """The later partition's card is made before the earlier one has images; when it gets
    them, the row with the same bytes becomes a duplicate in the later card (its summary is
    redone); re-recording its images redoes it again."""
    _partition(tmp_path, "000-01", ["b" * 32, "c" * 32])
    _partition(tmp_path, "000-00", ["a" * 32, "b" * 32], images=False)
    cat = Catalog(tmp_path)
    assert _outcomes(cat, "000-01") == {"stored": 2}
    assert cat.query("SELECT count(*) AS n FROM content_duplicates")[0]["n"] == 0
    _partition(tmp_path, "000-00", ["a" * 32, "b" * 32])  # earlier in dataset order
    assert _outcomes(cat, "000-01") == {"stored": 1, "filtered:duplicate_content": 1}
    assert cat.query("SELECT partition, id, kept_partition, kept_id FROM content_duplicates") == [
        {"partition": "000-01", "id": "000-01-0", "kept_partition": "000-00", "kept_id": "000-00-1"}
    ]
    assert _outcomes(cat, "dataset") == {"stored": 3, "filtered:duplicate_content": 1}
    record_rows(
        tmp_path,
        "images",
        "000-01",
        [RowOutcome("000-01-0", "u", "stored"), RowOutcome("000-01-1", "u", "failed", "http_404")],
    )
    card = _outcomes(cat, "000-01")
    assert card == {"failed:http_404": 1, "filtered:duplicate_content": 1}
    assert cat.query(
        "SELECT section, item, value FROM data_card_of('000-01') "
        "WHERE section = 'outcome' ORDER BY item"
    ) == [{"section": "outcome", "item": k, "value": v} for k, v in sorted(card.items())]


def test_records_of_older_schemas_still_read(tmp_path):
    """Record files from before a column existed read with it empty: the materialization
    record's, a card without bucket and kept, a row record without detail; the views switch
    to reading by name while such a file is there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowmatch_assets.catalog import CARD_SCHEMA, MATERIALIZATION_SCHEMA, ROW_SCHEMA

    _partition(tmp_path, "000-00", ["a" * 32])
    c = tmp_path / "catalog"
    old_mat = pa.schema([f for f in MATERIALIZATION_SCHEMA if not f.name.startswith("lossy")])
    pq.write_table(
        pa.Table.from_pylist(
            [{"asset": "images", "partition": "000-01", "samples": 5, "seconds": 1.0}],
            schema=old_mat,
        ),
        c / "materializations" / "images" / "000-01.parquet",
    )
    old_rows = pa.schema([f for f in ROW_SCHEMA if f.name != "detail"])
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "asset": "images",
                    "partition": "000-01",
                    "id": "x",
                    "url": "u",
                    "outcome": "failed",
                    "reason": "http_404",
                }
            ],
            schema=old_rows,
        ),
        c / "rows" / "images" / "000-01.parquet",
    )
    old_card = pa.schema([f for f in CARD_SCHEMA if f.name not in ("bucket", "kept")])
    card = pq.read_table(c / "cards" / "data_card" / "000-00.parquet").select(old_card.names)
    pq.write_table(card, c / "cards" / "data_card" / "000-00.parquet")
    cat = Catalog(tmp_path)
    cov = {r["partition"]: r for r in cat.coverage()}
    assert cov["000-01"]["images"] == 5 and cov["000-00"]["images"] == 1
    assert cat.query("SELECT lossy_rel_rms FROM materializations WHERE partition = '000-01'") == [
        {"lossy_rel_rms": None}
    ]
    assert cat.failures_by_reason() == [
        {
            "asset": "images",
            "outcome": "failed",
            "reason": "http_404",
            "retryable": False,
            "rows": 1,
        }
    ]
    assert cat.query("SELECT id, detail FROM rows WHERE partition = '000-01'") == [
        {"id": "x", "detail": None}
    ]
    assert _outcomes(cat, "000-00") == {"stored": 1}
    assert cat.query("SELECT count(*) AS n FROM data_card_summary WHERE section = 'bucket'") == [
        {"n": 0}
    ]
    assert cat.query("SELECT count(bucket) AS n, count(*) AS rows FROM data_card_rows") == [
        {"n": 0, "rows": 1}
    ]


def test_a_failed_build_or_query_leaves_nothing_behind(tmp_path, monkeypatch):
    """A catalog build that fails (here: a view that does not bind; on a full disk: its
    write) leaves no temp file or WAL; a query that fails leaves no spill folder."""
    from flowmatch_assets.catalog import views

    _partition(tmp_path, "000-00", ["a" * 32])
    built = views._view_sql
    monkeypatch.setattr(
        views,
        "_view_sql",
        lambda layout: [*built(layout), "CREATE VIEW broken AS SELECT * FROM nope"],
    )
    with pytest.raises(duckdb.Error):
        Catalog(tmp_path).ensure()
    monkeypatch.setattr(views, "_view_sql", built)
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "catalog.duckdb").exists()
    with pytest.raises(duckdb.Error):
        Catalog(tmp_path).query("SELECT * FROM no_such_view")
    leftovers = [p for p in (tmp_path / "catalog").rglob("*") if p.name.startswith(".tmp-")]
    assert leftovers == [] and not list(tmp_path.glob(".tmp-*"))


def test_docs_name_every_view_and_table_of_the_catalog(tmp_path):
    """docs/catalog.md's views table names exactly what catalog.duckdb holds: a view added to
    views.py or record_kinds.py without its row fails here (ten were missing once)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "catalog.md").read_text()
    section = text.split("## The views", 1)[1].split("\n## ", 1)[0]
    documented = {
        name
        for line in section.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([a-z0-9_]+)`", line.split(" | ")[0])
    }
    made = {
        r["table_name"]
        for r in Catalog(tmp_path).query("SELECT table_name FROM information_schema.tables")
    }
    assert made, "the catalog made no views"
    assert documented == made, {"undocumented": made - documented, "gone": documented - made}
