"""The DuckDB catalog's views: coverage, sample counts, bytes, throughput and every row's outcome.

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
The views are rebuilt whenever the SQL that builds them changes (:func:`catalog_version`, a
hash of it): an edited view, a newly registered embedding kind, a moved or copied data root.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from flowmatch_assets.catalog import derived, outcome_rules, summary
from flowmatch_assets.catalog.card_views import data_card_views
from flowmatch_assets.catalog.record_kinds import RECORD_KINDS, RecordKind
from flowmatch_assets.catalog.records import _write_parquet
from flowmatch_assets.catalog.summary import file_lock
from flowmatch_models.storage.atomic import atomic_path
from flowmatch_models.storage.layout import PARTITIONED_ASSETS, DataLayout


def _sql_str(s: str | Path) -> str:
    return "'" + str(s).replace("'", "''") + "'"


#: Pairs in the whole PD12M dataset (for projections).
PD12M_PAIRS = 12_400_000


def _assets_key() -> str:
    """The partitioned assets the views were built for (a newly registered kind rebuilds them)."""
    return ",".join(PARTITIONED_ASSETS)


def catalog_version(layout: DataLayout) -> str:
    """The version of ``catalog.duckdb``: a hash of the SQL that builds its views, so a view
    whose SQL changes (an edit, a new embedding kind, a moved data root, records of an older
    schema appearing) rebuilds them all; no number to bump by hand."""
    return hashlib.sha256("\n;\n".join(_view_sql(layout)).encode()).hexdigest()[:16]


_CREATED = re.compile(r"CREATE OR REPLACE VIEW (\w+) AS")


def view_names() -> list[str]:
    """Every view of the catalog, in the order they are built (read from their SQL)."""
    return [m.group(1) for sql in _view_sql(DataLayout("/")) for m in [_CREATED.match(sql)] if m]


def _glob(layout: DataLayout, kind: str, legacy: frozenset[str]) -> str:
    """``read_parquet`` of a record kind's files (the registry's glob). A per-row kind is read
    by name (``union_by_name``) only when some of its files have an older schema (binding it
    opens every file; today's files all have the schema of the first one, the ``_empty``
    placeholder); another kind when its entry says ``by_name``."""
    k = RECORD_KINDS[kind]
    by_name = kind in legacy if k.per == "row" else k.by_name
    return f"read_parquet({_sql_str(k.glob(layout))}{', union_by_name=true' if by_name else ''})"


def _kind_views(layout: DataLayout, legacy: frozenset[str]) -> list[str]:
    """The plain view of every record kind that has one: ``SELECT <columns>`` over its files
    (the placeholder's NULL-free rows left out: its first column is never NULL in a record)."""
    return [
        f"CREATE OR REPLACE VIEW {k.view} AS SELECT {k.columns} FROM "
        f"{_glob(layout, k.name, legacy)} WHERE {k.schema.names[0]} IS NOT NULL"
        for k in RECORD_KINDS.values()
        if k.view
    ]


def _view_sql(layout: DataLayout) -> list[str]:
    """The SQL of every view (a per-row record kind with files of an older schema, as the last
    summary refresh found them, is read by name: :func:`_glob`)."""
    legacy = summary.legacy_kinds(layout)
    c = layout.catalog_dir
    s = summary.summary_dir(layout)
    mat = _sql_str(s / "materializations.parquet")
    outcomes = _sql_str(s / "outcomes.parquet")
    cards_summary = _sql_str(c / "card_summaries" / "*.parquet")
    losers = _sql_str(s / "content_losers.parquet")
    assets = ", ".join(f"({_sql_str(a)}, {i})" for i, a in enumerate(PARTITIONED_ASSETS))
    return [
        # every materialization record (the summary of catalog/materializations/*/*.parquet)
        f"CREATE OR REPLACE VIEW materializations AS SELECT * EXCLUDE (filename) FROM read_parquet({mat}) WHERE asset IS NOT NULL",
        # every record kind's own view (record_kinds.py: rows, partitions, evaluations (caption
        # following beside the chance level), validation (held-out EMA flow loss; t_bin -1:
        # the mean over the t grid), fd_dinov2, ledger_deltas / ledger_chain / ledger_epochs
        # (per run checkpoint every trained sample's delta, the chain of deltas, the compact
        # per-epoch segments), duplicate_records, ...)
        *_kind_views(layout, legacy),
        # the ledger summed over a checkpoint's chain: every trained sample (times seen, first
        # and last optimizer step), and per partition
        """CREATE OR REPLACE VIEW ledger_samples AS
           SELECT ch.run, ch.checkpoint_step, d.sample_id, any_value(d.partition) AS partition,
                  sum(d.times_seen) AS times_seen, min(d.first_step) AS first_step,
                  max(d.last_step) AS last_step, any_value(d.partition_size) AS partition_size
           FROM ledger_chain ch JOIN ledger_deltas d
             ON d.run = ch.run AND d.checkpoint_step = ch.delta_step
           GROUP BY ch.run, ch.checkpoint_step, d.sample_id""",
        """CREATE OR REPLACE VIEW ledger_partitions AS
           SELECT run, checkpoint_step, partition, count(*) AS samples_seen,
                  sum(times_seen) AS samples_trained, any_value(partition_size) AS partition_size,
                  sum(times_seen) / any_value(partition_size) AS epochs,
                  min(first_step) AS first_step, max(last_step) AS last_step
           FROM ledger_samples GROUP BY run, checkpoint_step, partition""",
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
        # the source of a partition key (flowmatch_models.storage.layout.source_of): photos-00003 -> photos
        """CREATE OR REPLACE MACRO source_of(p) AS
           CASE WHEN regexp_full_match(split_part(p, '-', 1), '[a-z][a-z0-9_]{0,31}')
                THEN split_part(p, '-', 1) ELSE 'pd12m' END""",
        # rows per (asset, partition, outcome, reason): what the reports count, without
        # opening the per-row records
        f"""CREATE OR REPLACE VIEW row_outcomes AS
           SELECT asset, partition, outcome, reason, rows,
                  outcome = 'failed' AND retryable(reason) AS retryable,
                  source_of(partition) AS source
           FROM read_parquet({outcomes}) WHERE asset IS NOT NULL""",
        """CREATE OR REPLACE VIEW failures AS
           SELECT asset, partition, id, url, outcome, reason, detail,
                  outcome = 'failed' AND retryable(reason) AS retryable,
                  source_of(partition) AS source FROM rows
           WHERE outcome IN ('failed', 'filtered')""",
        f"""CREATE OR REPLACE VIEW rejected_attempts AS
           SELECT asset, partition, id, url, outcome, reason, detail,
                  outcome = 'failed' AND retryable(reason) AS retryable
           FROM {_glob(layout, "attempts", legacy)}
           WHERE asset IS NOT NULL AND outcome = 'failed'""",
        f"""CREATE OR REPLACE VIEW compression AS
           SELECT asset, any_value(codec) AS codec, count(*) AS partitions, sum(samples) AS samples,
                  sum(raw_bytes) AS raw_bytes, sum(stored_bytes) AS stored_bytes,
                  sum(raw_bytes) / nullif(sum(stored_bytes), 0) AS ratio,
                  sum(stored_bytes) / nullif(sum(samples), 0) AS stored_bytes_per_sample,
                  sum(stored_bytes) / nullif(sum(samples), 0) * {PD12M_PAIRS} / 1e9
                      AS projected_pd12m_gb,
                  min(lossy_min_cosine) AS lossy_min_cosine, max(lossy_rel_rms) AS lossy_rel_rms,
                  -- ragged kinds (caption states): valid tokens stored and bytes per token row
                  sum(TRY_CAST(json_extract(extra, '$.tokens') AS DOUBLE)) AS tokens,
                  max(TRY_CAST(json_extract(extra, '$.token_row_bytes') AS DOUBLE))
                      AS token_row_bytes
           FROM materializations WHERE stored_bytes > 0 GROUP BY asset""",
        # training's rate is its latest run's median steady-window rate (the budget's figure);
        # every other asset's is samples / seconds over its partitions
        """CREATE OR REPLACE VIEW throughput AS
           SELECT asset, any_value(device) AS device, count(*) AS partitions,
                  sum(samples) AS samples, sum(seconds) AS seconds,
                  CASE WHEN asset = 'flow_model' THEN arg_max(samples_per_s, written_at)
                       ELSE sum(samples) / nullif(sum(seconds), 0) END AS samples_per_s
           FROM materializations GROUP BY asset""",
        # what made each asset partition (flowmatch_assets/freshness/fingerprints.py); NULL: made before
        # fingerprints. `flowmatch stale` compares these with the current settings.
        """CREATE OR REPLACE VIEW fingerprints AS
           SELECT asset, partition, json_extract_string(extra, '$.fingerprint.hash') AS fingerprint,
                  json_extract(extra, '$.fingerprint.fields') AS fields,
                  json_extract(extra, '$.fingerprint.inputs') AS inputs,
                  CAST(json_extract(extra, '$.fingerprint') AS VARCHAR) AS fingerprint_json,
                  written_at
           FROM materializations WHERE asset != 'flow_model'""",
        *_dedupe_views(layout, legacy, losers),
        *data_card_views(_glob(layout, "cards", legacy), cards_summary),
    ]


def _dedupe_views(layout: DataLayout, legacy: frozenset[str], losers: str) -> list[str]:
    """Duplicates (flowmatch_assets/ingest/dedupe.py, neardup.py) and every input row's final
    outcome."""
    near = _sql_str(derived.near_path(layout))
    return [
        # md5 of the bytes of every row stored in a (materialized) images shard
        f"""CREATE OR REPLACE VIEW content_md5 AS
           SELECT partition, id, position, md5 FROM {_glob(layout, "content", legacy)}
           WHERE asset IS NOT NULL AND md5 IS NOT NULL AND partition IN
                 (SELECT partition FROM materializations WHERE asset = 'images')""",
        """CREATE OR REPLACE VIEW content_first AS
           SELECT md5, partition AS kept_partition, id AS kept_id FROM (
               SELECT *, row_number() OVER (PARTITION BY md5 ORDER BY partition, position) AS k
               FROM content_md5) WHERE k = 1""",
        # stored rows whose bytes an earlier row (dataset order) also stored: the later ones
        # lose (their partition ran before the winner's, or at the same time)
        # (the summary of content_md5 x content_first: catalog/summary.py finds the repeated
        # md5s by their hashes, so no query joins every stored md5)
        f"""CREATE OR REPLACE VIEW content_duplicates AS
           SELECT partition, id, md5, kept_partition, kept_id FROM read_parquet({losers})""",
        # stored rows that lose to an earlier kept look-alike (ingest/neardup.py: the detector,
        # the Hamming distance of the 64-bit pHashes), as last decided (`flowmatch catalog
        # neardup`); a row whose bytes an earlier row stored too stays a content duplicate
        f"""CREATE OR REPLACE VIEW near_duplicates AS
           SELECT partition, id, kept_partition, kept_id, detector, distance, similarity
           FROM read_parquet({near}) WHERE (partition, id) NOT IN
                (SELECT (partition, id) FROM content_duplicates)""",
        """CREATE OR REPLACE VIEW duplicates AS
           SELECT partition, id, 'hash' AS kind, hash, kept_partition, kept_id,
                  false AS still_stored
           FROM duplicate_records WHERE kind = 'hash'
           UNION ALL
           SELECT d.partition, d.id, 'content', d.hash,
                  coalesce(f.kept_partition, d.kept_partition), coalesce(f.kept_id, d.kept_id), false
           FROM duplicate_records d LEFT JOIN (
               -- the first stored row of each dropped row's md5 (of those md5s only)
               SELECT md5, arg_min(partition, (partition, position)) AS kept_partition,
                      arg_min(id, (partition, position)) AS kept_id
               FROM content_md5 WHERE md5 IN
                    (SELECT hash FROM duplicate_records WHERE kind = 'content')
               GROUP BY md5) f ON f.md5 = d.hash
           WHERE d.kind = 'content'
           UNION ALL
           SELECT partition, id, 'content', md5, kept_partition, kept_id, true
           FROM content_duplicates
           UNION ALL
           SELECT partition, id, 'near_' || detector, NULL, kept_partition, kept_id, true
           FROM near_duplicates""",
        # every input row's final outcome by the one table of rules (outcome_rules.py, which
        # the data card's numpy reads too): the metadata's, else the image stage's (pending
        # before it ran), a content or near duplicate counted as filtered
        f"""CREATE OR REPLACE VIEW dataset_rows AS
           SELECT m.partition, m.id, m.url,
                  CASE WHEN m.outcome != 'stored' THEN 'metadata'
                       WHEN i.id IS NOT NULL THEN 'images' END AS stage,
                  {outcome_rules.sql_case("outcome")} AS outcome,
                  {outcome_rules.sql_case("reason")} AS reason,
                  d.kept_partition, d.kept_id
           FROM rows m
           LEFT JOIN rows i ON i.asset = 'images' AND i.partition = m.partition AND i.id = m.id
           LEFT JOIN content_duplicates c ON c.partition = m.partition AND c.id = m.id
           LEFT JOIN near_duplicates n ON n.partition = m.partition AND n.id = m.id
           LEFT JOIN duplicates d ON d.partition = m.partition AND d.id = m.id
           WHERE m.asset = 'metadata'""",
    ]


def _retryable_sql(col: str) -> str:
    """SQL of ingest.is_retryable, from its two tables (``RETRYABLE``, ``RETRYABLE_HTTP``)."""
    from flowmatch_assets.ingest.images import RETRYABLE, RETRYABLE_HTTP

    names = ", ".join(_sql_str(r) for r in sorted(RETRYABLE))
    http = f"regexp_full_match({col}, {_sql_str(RETRYABLE_HTTP)})"
    return f"coalesce({col} IN ({names}) OR {http}, false)"


def _ensure_placeholders(layout: DataLayout) -> None:
    """Empty, schema-carrying files (one per record kind) so that the views' globs always
    match something; rewritten when the schema grew (an older data root), so every column is
    in the glob."""
    for kind in RECORD_KINDS.values():
        _ensure_placeholder(layout, kind)


def _ensure_placeholder(layout: DataLayout, kind: RecordKind) -> None:
    p = kind.placeholder(layout)
    if kind.per == "root":  # the file itself: made empty only when there is none
        if not p.exists():
            _write_parquet(p, kind.schema.empty_table())
        return
    if not p.exists() or not pq.read_schema(p).equals(kind.schema, check_metadata=False):
        _write_parquet(p, kind.schema.empty_table())


#: What one catalog query may hold in memory; beyond it DuckDB spills to disk (a per-row view
#: over PD12M's ~12M rows per asset), so a query stays within ~1 GB of RSS.
QUERY_MEMORY = "600MB"


class Catalog:
    """Read access to the catalog of one data root (``<root>/catalog.duckdb``)."""

    def __init__(self, data_root: str | Path):
        self.layout = DataLayout(data_root)
        self.path = self.layout.catalog_db

    @staticmethod
    def _meta_matches(con: duckdb.DuckDBPyConnection, want: tuple) -> bool:
        try:
            return con.execute("SELECT version, root, assets FROM catalog_meta").fetchone() == want
        except duckdb.Error:
            return False

    def _want(self) -> tuple:
        """What a current ``catalog.duckdb`` records (after bringing the summaries up to date)."""
        _ensure_placeholders(self.layout)
        summary.refresh(self.layout)
        return (catalog_version(self.layout), str(self.layout.root), _assets_key())

    def _open(self, want: tuple) -> duckdb.DuckDBPyConnection | None:
        """A read-only connection to ``catalog.duckdb`` if it is current, else None."""
        if not self.path.exists():
            return None
        try:
            con = duckdb.connect(str(self.path), read_only=True)
        except duckdb.Error:
            return None
        if self._meta_matches(con, want):
            return con
        con.close()
        return None

    def ensure(self) -> Path:
        """Bring the summaries up to date with the records (catalog/summary.py) and create or
        upgrade ``catalog.duckdb`` (views only); safe from many processes at once."""
        want = self._want()
        con = self._open(want)
        if con is None:
            self._build(want)
        else:
            con.close()
        return self.path

    def _build(self, want: tuple) -> None:
        """Write ``catalog.duckdb`` anew (under a lock; another process may have just done it).
        A failed build leaves nothing behind: no temp file, no WAL."""
        with file_lock(self.layout.catalog_dir / ".catalog.lock"):
            con = self._open(want)
            if con is not None:
                con.close()
                return
            with atomic_path(self.path) as tmp:
                tmp.unlink()  # duckdb wants to create the file itself
                wal = tmp.with_name(tmp.name + ".wal")
                try:
                    with duckdb.connect(str(tmp)) as con:
                        for sql in _view_sql(self.layout):
                            con.execute(sql)
                        con.execute(
                            "CREATE TABLE catalog_meta(version VARCHAR, root VARCHAR, "
                            "assets VARCHAR)"
                        )
                        con.execute("INSERT INTO catalog_meta VALUES (?, ?, ?)", list(want))
                        con.execute("CHECKPOINT")
                finally:
                    wal.unlink(missing_ok=True)

    @contextlib.contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only connection; many may be open at once, also while partitions run. What a
        query spills goes to a folder of its own, removed when it closes (also on failure)."""
        want = self._want()
        con = self._open(want)
        if con is None:
            self._build(want)
            con = duckdb.connect(str(self.path), read_only=True)
        spill = Path(tempfile.mkdtemp(prefix=".tmp-duckdb-", dir=self.layout.catalog_dir))
        try:
            con.execute(f"SET temp_directory = {_sql_str(spill)}")
            con.execute(f"SET memory_limit = '{QUERY_MEMORY}'")
            con.execute("SET enable_progress_bar = false")
            con.execute(f"SET threads = {summary.cores()}")
            # (a query without ORDER BY has no order anyway; this lets big joins spill)
            con.execute("SET preserve_insertion_order = false")
            yield con
        finally:
            con.close()
            shutil.rmtree(spill, ignore_errors=True)

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
        # + the stored rows that lose to an earlier look-alike (decided after images ran),
        # as dataset_rows' rules say
        return self.query(
            """SELECT asset, outcome, reason, retryable, sum(rows)::BIGINT AS rows FROM (
                   SELECT asset, outcome, reason, retryable, rows FROM row_outcomes
                   WHERE outcome IN ('failed', 'filtered')
                   UNION ALL
                   SELECT 'images', outcome, reason, false, count(*) FROM dataset_rows
                   WHERE (partition, id) IN (SELECT (partition, id) FROM near_duplicates)
                   GROUP BY ALL)
               GROUP BY ALL ORDER BY asset, outcome, rows DESC, reason"""
        )

    def compression(self) -> list[dict]:
        return self.query("SELECT * FROM compression ORDER BY asset")

    def throughput(self) -> list[dict]:
        return self.query("SELECT * FROM throughput ORDER BY asset")

    def sizes(self) -> list[dict]:
        """Disk bytes per asset: the sum of its materializations' stored bytes (each partition's
        file; a training run's folder: its record's ``extra.disk_bytes``, as the run's
        ``disk_size`` metadata), partitioned assets in lineage order, then the others."""
        return self.query(
            """SELECT m.asset, count(*) AS partitions,
                      sum(coalesce(nullif(m.stored_bytes, 0),
                                   try_cast(json_extract_string(m.extra, '$.disk_bytes') AS BIGINT),
                                   0))::BIGINT AS bytes
               FROM materializations m LEFT JOIN assets a USING (asset)
               GROUP BY m.asset, a.lineage_order ORDER BY a.lineage_order NULLS LAST, m.asset"""
        )


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
