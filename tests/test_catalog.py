"""The DuckDB catalog: records replace (never duplicate), views answer the reports, and many
processes can write records and read the catalog at once without lock errors."""

from __future__ import annotations

import multiprocessing as mp

import duckdb

from flowmatch_assets.catalog import (
    Catalog,
    MaterializationRecord,
    RowOutcome,
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
                "images_256", "000-00", samples=8, raw_bytes=800, stored_bytes=100, seconds=2.0
            ),
        )
        record_rows(
            tmp_path,
            "images_256",
            "000-00",
            [RowOutcome(f"i{k}", "u", "stored") for k in range(8)]
            + [RowOutcome("bad", "u", "failed", "http_404", "404")],
        )
    cat = Catalog(tmp_path)
    cov = {r["partition"]: r for r in cat.coverage()}
    assert cov["000-00"]["images_256"] == 8 and cov["000-01"]["images_256"] is None
    assert cov["000-00"]["vae_latents"] is None
    comp = cat.compression()[0]
    assert comp["ratio"] == 8.0 and comp["samples"] == 8
    assert comp["projected_pd12m_gb"] == 100 / 8 * 12_400_000 / 1e9  # bytes/sample x 12.4M
    assert cat.throughput()[0]["samples_per_s"] == 4.0
    assert cat.failures_by_reason() == [
        {
            "asset": "images_256",
            "outcome": "failed",
            "reason": "http_404",
            "retryable": False,
            "rows": 1,
        }
    ]
    assert cat.query("SELECT count(*) AS n FROM rows")[0]["n"] == 9


def _writer(root: str, k: int) -> None:
    for j in range(15):
        part = f"{k:03d}-{j:02d}"
        record_rows(
            root, "images_256", part, [RowOutcome(f"{part}-{i}", None, "stored") for i in range(20)]
        )
        record_materialization(
            root, MaterializationRecord("images_256", part, samples=20, seconds=1.0)
        )
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
