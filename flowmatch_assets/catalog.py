"""The DuckDB catalog: coverage, sample counts, bytes, throughput and every row's outcome.

Design (why parallel partitions never contend on a DuckDB lock): a materialization never opens
DuckDB. It writes two small parquet records of its own, atomically and per partition:

    <root>/catalog/materializations/<asset>/<partition>.parquet   one row: counts, bytes, time
    <root>/catalog/rows/<asset>/<partition>.parquet               one row per input row: outcome
    <root>/catalog/attempts/<asset>/<partition>.parquet           failures of a rejected attempt

``catalog.duckdb`` holds only *views* over those files (plus the known partitions), so it is
written once (under a file lock) and afterwards opened read-only by any number of processes.
Re-materializing a partition replaces its two files when it succeeds (each by an atomic rename;
the old records stay visible until then): no duplicate rows, and a partition never vanishes from
the catalog during a re-run. An attempt that is rejected (too few rows stored) leaves both files
as they were and records its failures under ``attempts/`` (the ``rejected_attempts`` view).
The views are rebuilt when the data root moves (the file records its root), so a data root can
be copied or moved, and when an embedding kind is registered (it records the asset list).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_models.atomic import atomic_path
from flowmatch_models.layout import PARTITIONED_ASSETS, DataLayout

CATALOG_VERSION = 9

OUTCOMES = ("stored", "filtered", "failed")

MATERIALIZATION_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("samples", pa.int64()),
        ("input_rows", pa.int64()),
        ("raw_bytes", pa.int64()),
        ("stored_bytes", pa.int64()),
        ("ratio", pa.float64()),
        ("seconds", pa.float64()),
        ("samples_per_s", pa.float64()),
        ("codec", pa.string()),
        ("device", pa.string()),
        ("lossy_min_cosine", pa.float64()),
        ("lossy_rel_rms", pa.float64()),
        ("run_id", pa.string()),
        ("written_at", pa.timestamp("us", tz="UTC")),
        ("extra", pa.string()),
    ]
)

ROW_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("id", pa.string()),
        ("url", pa.string()),
        ("outcome", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)

PARTITION_SCHEMA = pa.schema(
    [
        ("partition", pa.string()),
        ("source_file", pa.string()),
        ("row_start", pa.int64()),
        ("row_end", pa.int64()),
    ]
)


@dataclass
class MaterializationRecord:
    """What one asset materialization of one partition produced."""

    asset: str
    partition: str
    samples: int
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    input_rows: int | None = None
    codec: str | None = None
    device: str | None = None
    lossy_min_cosine: float | None = None
    lossy_rel_rms: float | None = None
    run_id: str | None = None
    extra: dict = field(default_factory=dict)
    #: samples/s when it is not samples / seconds (training: the median of its steady windows)
    rate: float | None = None

    def as_row(self) -> dict:
        d = asdict(self)
        d["input_rows"] = self.samples if self.input_rows is None else self.input_rows
        d["ratio"] = (self.raw_bytes / self.stored_bytes) if self.stored_bytes else None
        d.pop("rate")
        if self.rate is not None:
            d["samples_per_s"] = self.rate
        else:
            d["samples_per_s"] = (self.samples / self.seconds) if self.seconds > 0 else None
        d["written_at"] = _now_utc()
        d["extra"] = json.dumps(self.extra, sort_keys=True, default=str)
        return d


@dataclass
class RowOutcome:
    """The single outcome of one input row in one asset: stored, filtered or failed (+ reason)."""

    id: str
    url: str | None
    outcome: str
    reason: str | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


def _now_utc():
    import datetime as _dt

    return _dt.datetime.now(_dt.timezone.utc)


def _write_parquet(path: Path, table: pa.Table) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def record_materialization(data_root: str | Path, record: MaterializationRecord) -> Path:
    """Write (replace) the materialization record of one asset partition, atomically."""
    layout = DataLayout(data_root)
    path = layout.catalog_dir / "materializations" / record.asset / f"{record.partition}.parquet"
    _write_parquet(path, pa.Table.from_pylist([record.as_row()], schema=MATERIALIZATION_SCHEMA))
    return path


def record_rows(
    data_root: str | Path, asset: str, partition: str, rows: Iterable[RowOutcome]
) -> Path:
    """Write (replace) the per-row outcomes of one asset partition, atomically."""
    return _write_rows(data_root, "rows", asset, partition, rows)


def record_attempt(
    data_root: str | Path, asset: str, partition: str, rows: Iterable[RowOutcome]
) -> Path:
    """Record the row outcomes of a rejected attempt, leaving the partition's records alone."""
    return _write_rows(data_root, "attempts", asset, partition, rows)


def _write_rows(
    data_root: str | Path, kind: str, asset: str, partition: str, rows: Iterable[RowOutcome]
) -> Path:
    path = DataLayout(data_root).catalog_dir / kind / asset / f"{partition}.parquet"
    data = [{"asset": asset, "partition": partition, **asdict(r)} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=ROW_SCHEMA))
    return path


def clear_attempt(data_root: str | Path, asset: str, partition: str) -> None:
    """Forget a rejected attempt's failures (a later attempt succeeded)."""
    p = DataLayout(data_root).catalog_dir / "attempts" / asset / f"{partition}.parquet"
    p.unlink(missing_ok=True)


def clear_partition(data_root: str | Path, asset: str, partition: str) -> None:
    """Remove the catalog records of one asset partition (`flowmatch verify`: its file is gone)."""
    layout = DataLayout(data_root)
    for kind in ("materializations", "rows"):
        p = layout.catalog_dir / kind / asset / f"{partition}.parquet"
        p.unlink(missing_ok=True)


EVALUATION_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("step", pa.int64()),
        ("checkpoint", pa.string()),
        ("attribute", pa.string()),
        ("accuracy", pa.float64()),
        ("chance", pa.float64()),
        ("n", pa.int64()),
        ("unknown", pa.int64()),
        ("evaluated_at", pa.timestamp("us", tz="UTC")),
    ]
)


def record_evaluation(data_root: str | Path, run: str, step: int, rows: Sequence[dict]) -> Path:
    """Write (replace) the caption-following scores of one checkpoint (one row per attribute)."""
    layout = DataLayout(data_root)
    path = layout.catalog_dir / "evaluations" / run / f"step{step:07d}.parquet"
    now = _now_utc()
    data = [{**r, "evaluated_at": now} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=EVALUATION_SCHEMA))
    return path


def read_materialization(data_root: str | Path, asset: str, partition: str) -> dict | None:
    """The materialization record of one asset partition, or None."""
    p = DataLayout(data_root).catalog_dir / "materializations" / asset / f"{partition}.parquet"
    rows = pq.read_table(p).to_pylist() if p.exists() else []
    return rows[0] if rows else None


def read_rows(data_root: str | Path, asset: str, partition: str) -> pa.Table | None:
    """The per-row outcomes of one asset partition, or None if there are none."""
    p = DataLayout(data_root).catalog_dir / "rows" / asset / f"{partition}.parquet"
    return pq.read_table(p) if p.exists() else None


def record_partitions(data_root: str | Path, partitions: Sequence[dict]) -> Path:
    """Replace the list of known partitions (key, source file, row range)."""
    layout = DataLayout(data_root)
    path = layout.catalog_dir / "partitions.parquet"
    _write_parquet(path, pa.Table.from_pylist(list(partitions), schema=PARTITION_SCHEMA))
    return path


# ---------------------------------------------------------------------------------------------
# DuckDB views
# ---------------------------------------------------------------------------------------------


def _sql_str(s: str | Path) -> str:
    return "'" + str(s).replace("'", "''") + "'"


#: Pairs in the whole PD12M dataset (for projections).
PD12M_PAIRS = 12_400_000


def _assets_key() -> str:
    """The partitioned assets the views were built for (a newly registered kind rebuilds them)."""
    return ",".join(PARTITIONED_ASSETS)


def _view_sql(layout: DataLayout) -> list[str]:
    c = layout.catalog_dir
    mat = _sql_str(c / "materializations" / "*" / "*.parquet")
    rows = _sql_str(c / "rows" / "*" / "*.parquet")
    attempts = _sql_str(c / "attempts" / "*" / "*.parquet")
    parts = _sql_str(c / "partitions.parquet")
    evals = _sql_str(c / "evaluations" / "*" / "*.parquet")
    assets = ", ".join(f"({_sql_str(a)}, {i})" for i, a in enumerate(PARTITIONED_ASSETS))
    return [
        f"CREATE OR REPLACE VIEW materializations AS SELECT * FROM read_parquet({mat}, union_by_name=true) WHERE asset IS NOT NULL",
        f"CREATE OR REPLACE VIEW rows AS SELECT * FROM read_parquet({rows}, union_by_name=true) WHERE asset IS NOT NULL",
        f"CREATE OR REPLACE VIEW partitions AS SELECT * FROM read_parquet({parts}) WHERE partition IS NOT NULL",
        # caption following per run, checkpoint step and attribute, beside the chance level
        f"CREATE OR REPLACE VIEW evaluations AS SELECT *, accuracy / nullif(chance, 0) AS x_chance FROM read_parquet({evals}, union_by_name=true) WHERE run IS NOT NULL",
        f"CREATE OR REPLACE TABLE assets AS SELECT * FROM (VALUES {assets}) t(asset, lineage_order)",
        # every (partition, asset) pair with whether it is materialized; partitions known either
        # from registration or from a materialization
        """CREATE OR REPLACE VIEW coverage AS
           WITH p AS (SELECT partition FROM partitions
                      UNION SELECT partition FROM materializations
                      WHERE asset IN (SELECT asset FROM assets))
           SELECT p.partition, a.asset, a.lineage_order, m.samples, m.written_at,
                  m.partition IS NOT NULL AS materialized
           FROM p CROSS JOIN assets a
           LEFT JOIN materializations m ON m.partition = p.partition AND m.asset = a.asset""",
        f"CREATE OR REPLACE MACRO retryable(r) AS {_retryable_sql('r')}",
        """CREATE OR REPLACE VIEW failures AS
           SELECT asset, partition, id, url, outcome, reason, detail,
                  outcome = 'failed' AND retryable(reason) AS retryable FROM rows
           WHERE outcome IN ('failed', 'filtered')""",
        f"""CREATE OR REPLACE VIEW rejected_attempts AS
           SELECT asset, partition, id, url, outcome, reason, detail,
                  outcome = 'failed' AND retryable(reason) AS retryable
           FROM read_parquet({attempts}, union_by_name=true)
           WHERE asset IS NOT NULL AND outcome = 'failed'""",
        f"""CREATE OR REPLACE VIEW compression AS
           SELECT asset, any_value(codec) AS codec, count(*) AS partitions, sum(samples) AS samples,
                  sum(raw_bytes) AS raw_bytes, sum(stored_bytes) AS stored_bytes,
                  sum(raw_bytes) / nullif(sum(stored_bytes), 0) AS ratio,
                  sum(stored_bytes) / nullif(sum(samples), 0) AS stored_bytes_per_sample,
                  sum(stored_bytes) / nullif(sum(samples), 0) * {PD12M_PAIRS} / 1e9
                      AS projected_pd12m_gb,
                  min(lossy_min_cosine) AS lossy_min_cosine, max(lossy_rel_rms) AS lossy_rel_rms
           FROM materializations WHERE stored_bytes > 0 GROUP BY asset""",
        # training's rate is its latest run's median steady-window rate (the budget's figure);
        # every other asset's is samples / seconds over its partitions
        """CREATE OR REPLACE VIEW throughput AS
           SELECT asset, any_value(device) AS device, count(*) AS partitions,
                  sum(samples) AS samples, sum(seconds) AS seconds,
                  CASE WHEN asset = 'flow_model' THEN arg_max(samples_per_s, written_at)
                       ELSE sum(samples) / nullif(sum(seconds), 0) END AS samples_per_s
           FROM materializations GROUP BY asset""",
        # what made each asset partition (flowmatch_assets/fingerprints.py); NULL: made before
        # fingerprints. `flowmatch stale` compares these with the current settings.
        """CREATE OR REPLACE VIEW fingerprints AS
           SELECT asset, partition, json_extract_string(extra, '$.fingerprint.hash') AS fingerprint,
                  json_extract(extra, '$.fingerprint.fields') AS fields,
                  json_extract(extra, '$.fingerprint.inputs') AS inputs,
                  CAST(json_extract(extra, '$.fingerprint') AS VARCHAR) AS fingerprint_json,
                  written_at
           FROM materializations WHERE asset != 'flow_model'""",
    ]


def _retryable_sql(col: str) -> str:
    """SQL twin of ingest.is_retryable (one list of reasons: ingest.RETRYABLE)."""
    from flowmatch_assets.ingest import RETRYABLE

    names = ", ".join(_sql_str(r) for r in sorted(RETRYABLE))
    return (
        f"coalesce({col} IN ({names}) OR regexp_full_match({col}, 'http_(5[0-9][0-9]|408|429)'),"
        " false)"
    )


def _ensure_placeholders(layout: DataLayout) -> None:
    """Empty, schema-carrying files so that the views' globs always match something."""
    c = layout.catalog_dir
    for kind, schema in (
        ("materializations", MATERIALIZATION_SCHEMA),
        ("rows", ROW_SCHEMA),
        ("evaluations", EVALUATION_SCHEMA),
        ("attempts", ROW_SCHEMA),
    ):
        p = c / kind / "_empty" / "_empty.parquet"
        if not p.exists():
            _write_parquet(p, schema.empty_table())
    p = c / "partitions.parquet"
    if not p.exists():
        _write_parquet(p, PARTITION_SCHEMA.empty_table())


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class Catalog:
    """Read access to the catalog of one data root (``<root>/catalog.duckdb``)."""

    def __init__(self, data_root: str | Path):
        self.layout = DataLayout(data_root)
        self.path = self.layout.catalog_db

    def _is_current(self) -> bool:
        if not self.path.exists():
            return False
        try:
            with duckdb.connect(str(self.path), read_only=True) as con:
                row = con.execute("SELECT version, root, assets FROM catalog_meta").fetchone()
            return row == (CATALOG_VERSION, str(self.layout.root), _assets_key())
        except duckdb.Error:
            return False

    def ensure(self) -> Path:
        """Create or upgrade ``catalog.duckdb`` (views only); safe from many processes at once."""
        _ensure_placeholders(self.layout)
        if self._is_current():
            return self.path
        with _file_lock(self.layout.catalog_dir / ".catalog.lock"):
            if self._is_current():
                return self.path
            with atomic_path(self.path) as tmp:
                tmp.unlink()  # duckdb wants to create the file itself
                with duckdb.connect(str(tmp)) as con:
                    for sql in _view_sql(self.layout):
                        con.execute(sql)
                    con.execute(
                        "CREATE TABLE catalog_meta(version INTEGER, root VARCHAR, assets VARCHAR)"
                    )
                    con.execute(
                        "INSERT INTO catalog_meta VALUES (?, ?, ?)",
                        [CATALOG_VERSION, str(self.layout.root), _assets_key()],
                    )
                    con.execute("CHECKPOINT")
                wal = tmp.with_name(tmp.name + ".wal")
                wal.unlink(missing_ok=True)
        return self.path

    @contextlib.contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only connection; many may be open at once, also while partitions run."""
        self.ensure()
        con = duckdb.connect(str(self.path), read_only=True)
        try:
            yield con
        finally:
            con.close()

    def query(self, sql: str, params: Sequence | None = None) -> list[dict]:
        """Run SQL against the catalog views; rows as dicts."""
        with self.connect() as con:
            cur = con.execute(sql, params or [])
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    # --- built-in reports -------------------------------------------------------------------

    def coverage(self) -> list[dict]:
        """One row per partition; one column per partitioned asset (samples, or None)."""
        rows = self.query(
            "SELECT partition, asset, samples, materialized FROM coverage ORDER BY partition, lineage_order"
        )
        out: dict[str, dict] = {}
        for r in rows:
            d = out.setdefault(r["partition"], {"partition": r["partition"]})
            d[r["asset"]] = r["samples"] if r["materialized"] else None
        return list(out.values())

    def coverage_summary(self) -> list[dict]:
        return self.query(
            """SELECT asset, count(*) FILTER (WHERE materialized) AS materialized,
                      count(*) AS partitions, sum(samples) AS samples
               FROM coverage GROUP BY asset, lineage_order ORDER BY lineage_order"""
        )

    def failures_by_reason(self) -> list[dict]:
        return self.query(
            """SELECT asset, outcome, reason, retryable, count(*) AS rows FROM failures
               GROUP BY ALL ORDER BY asset, outcome, rows DESC, reason"""
        )

    def compression(self) -> list[dict]:
        return self.query("SELECT * FROM compression ORDER BY asset")

    def throughput(self) -> list[dict]:
        return self.query("SELECT * FROM throughput ORDER BY asset")


def format_table(rows: list[dict], floatfmt: str = "{:.3g}") -> str:
    """A plain markdown table of ``rows`` (for the CLI and the UI)."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0].keys())

    def fmt(v) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return floatfmt.format(v)
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
