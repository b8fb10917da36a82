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
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_models.atomic import atomic_path
from flowmatch_models.layout import PARTITIONED_ASSETS, DataLayout

CATALOG_VERSION = 11

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
    for kind in ("materializations", "rows", "duplicates", "content"):
        p = layout.catalog_dir / kind / asset / f"{partition}.parquet"
        p.unlink(missing_ok=True)


DUPLICATE_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("id", pa.string()),
        ("kind", pa.string()),  # "hash" (metadata, before download) or "content" (bytes' md5)
        ("hash", pa.string()),  # the metadata hash (kind hash) or the bytes' md5 (kind content)
        ("kept_partition", pa.string()),
        ("kept_id", pa.string()),
    ]
)

CONTENT_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("id", pa.string()),
        ("position", pa.int64()),  # the row's index in its metadata file: dataset order
        ("md5", pa.string()),
    ]
)


def record_duplicates(
    data_root: str | Path, asset: str, partition: str, kind: str, rows: Sequence[dict]
) -> Path:
    """Write (replace) the rows ``asset`` dropped as duplicates (``{id, hash, kept_partition,
    kept_id}``) in one partition: ``catalog/duplicates/<asset>/<partition>.parquet``."""
    path = DataLayout(data_root).catalog_dir / "duplicates" / asset / f"{partition}.parquet"
    data = [
        {
            "asset": asset,
            "partition": partition,
            "kind": kind,
            **{k: r.get(k) for k in ("id", "hash", "kept_partition", "kept_id")},
        }
        for r in rows
    ]
    _write_parquet(path, pa.Table.from_pylist(data, schema=DUPLICATE_SCHEMA))
    return path


def record_content(data_root: str | Path, partition: str, rows: Sequence[dict]) -> Path:
    """Write (replace) the md5 of the bytes of every row stored in one images_256 shard
    (``{id, position, md5}``): what content dedupe and the ``content_duplicates`` view read."""
    path = DataLayout(data_root).catalog_dir / "content" / "images_256" / f"{partition}.parquet"
    data = [
        {
            "asset": "images_256",
            "partition": partition,
            **{k: r[k] for k in ("id", "position", "md5")},
        }
        for r in rows
    ]
    _write_parquet(path, pa.Table.from_pylist(data, schema=CONTENT_SCHEMA))
    return path


CARD_SCHEMA = pa.schema(
    [
        ("asset", pa.string()),
        ("partition", pa.string()),
        ("id", pa.string()),
        ("caption_chars", pa.int32()),
        ("caption_tokens", pa.int32()),  # the text encoder's tokens, before truncation
        ("max_tokens", pa.int32()),
        ("width", pa.int64()),  # claimed by the metadata
        ("height", pa.int64()),
        ("orig_width", pa.int32()),  # decoded (stored rows)
        ("orig_height", pa.int32()),
        ("license", pa.string()),
        ("source", pa.string()),
    ]
)


#: The data card's sections, in the order the card shows them.
CARD_SECTIONS = (
    "rows",
    "outcome",
    "license",
    "source",
    "aspect",
    "caption_chars",
    "caption_tokens",
    "orig_long_side",
    "orig_short_side",
    "text",
)


def record_card_rows(data_root: str | Path, partition: str, rows: Sequence[dict]) -> Path:
    """Write (replace) the data card's per-row record of one partition
    (flowmatch_assets/data_card.py)."""
    path = DataLayout(data_root).catalog_dir / "cards" / "data_card" / f"{partition}.parquet"
    data = [{"asset": "data_card", "partition": partition, **r} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=CARD_SCHEMA))
    return path


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


LEDGER_SAMPLE_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("checkpoint_step", pa.int64()),
        ("sample_id", pa.string()),
        ("partition", pa.string()),
        ("times_seen", pa.int64()),
        ("first_step", pa.int64()),
        ("last_step", pa.int64()),
        ("partition_size", pa.int64()),
    ]
)
LEDGER_EPOCH_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("checkpoint_step", pa.int64()),
        ("epoch", pa.int64()),
        ("partitions", pa.list_(pa.string())),
        ("sizes", pa.list_(pa.int64())),
        ("seed", pa.int64()),
        ("shuffle_window", pa.int64()),
        ("global_batch", pa.int64()),
        ("accumulate", pa.int64()),
        ("pos_from", pa.int64()),
        ("pos_to", pa.int64()),
        ("step_from", pa.int64()),
        ("available_partitions", pa.int64()),
        ("available_samples", pa.int64()),
    ]
)


LEDGER_CHAIN_SCHEMA = pa.schema(
    [("run", pa.string()), ("checkpoint_step", pa.int64()), ("delta_step", pa.int64())]
)


def ledger_path(data_root: str | Path, run: str, step: int, what: str = "ledger") -> Path:
    return DataLayout(data_root).catalog_dir / what / run / f"step{step:07d}.parquet"


def read_ledger_segments(
    data_root: str | Path, run: str, step: int
) -> tuple[list[dict], list[int]]:
    """A recorded checkpoint's segments and its delta chain (``[], []`` if none)."""
    p = ledger_path(data_root, run, step, "ledger_epochs")
    c = ledger_path(data_root, run, step, "ledger_chain")
    if not (p.exists() and c.exists()):
        return [], []
    segs = [{k: v for k, v in r.items() if k not in ("run", "checkpoint_step")}
            for r in pq.read_table(p).to_pylist()]  # fmt: skip
    return segs, [r["delta_step"] for r in pq.read_table(c).to_pylist()]


def record_ledger(
    data_root: str | Path,
    run: str,
    step: int,
    samples: dict,
    segments: Sequence[dict],
    chain: Sequence[int],
) -> Path:
    """Write (replace) checkpoint ``step``'s ledger: its compact segments (``ledger_epochs``),
    the samples trained since its base checkpoint (``samples``: a delta, from
    :func:`flowmatch_models.ledger.expand`) and its chain of deltas (``chain``: the base's chain
    plus ``step``), which the ``ledger_samples`` view sums. The chain is written last: a
    checkpoint counts as recorded only once it is there."""
    seg_rows = [
        {**{k: seg.get(k) for k in LEDGER_EPOCH_SCHEMA.names}, "run": run, "checkpoint_step": step}
        for seg in segments
    ]
    _write_parquet(ledger_path(data_root, run, step, "ledger_epochs"),
                   pa.Table.from_pylist(seg_rows, schema=LEDGER_EPOCH_SCHEMA))  # fmt: skip
    n = len(samples["sample_id"])
    cols = {
        "run": pa.repeat(pa.scalar(run, pa.string()), n),
        "checkpoint_step": pa.array(np.full(n, step, np.int64)),
        **{k: samples[k] for k in LEDGER_SAMPLE_SCHEMA.names[2:]},
    }
    table = pa.Table.from_pydict(cols).cast(LEDGER_SAMPLE_SCHEMA)
    path = ledger_path(data_root, run, step)
    _write_parquet(path, table)
    chain_rows = [{"run": run, "checkpoint_step": step, "delta_step": d} for d in chain]
    _write_parquet(ledger_path(data_root, run, step, "ledger_chain"),
                   pa.Table.from_pylist(chain_rows, schema=LEDGER_CHAIN_SCHEMA))  # fmt: skip
    return path


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
    ledger = _sql_str(c / "ledger" / "*" / "*.parquet")
    ledger_epochs = _sql_str(c / "ledger_epochs" / "*" / "*.parquet")
    ledger_chain = _sql_str(c / "ledger_chain" / "*" / "*.parquet")
    assets = ", ".join(f"({_sql_str(a)}, {i})" for i, a in enumerate(PARTITIONED_ASSETS))
    return [
        f"CREATE OR REPLACE VIEW materializations AS SELECT * FROM read_parquet({mat}, union_by_name=true) WHERE asset IS NOT NULL",
        f"CREATE OR REPLACE VIEW rows AS SELECT * FROM read_parquet({rows}, union_by_name=true) WHERE asset IS NOT NULL",
        f"CREATE OR REPLACE VIEW partitions AS SELECT * FROM read_parquet({parts}) WHERE partition IS NOT NULL",
        # caption following per run, checkpoint step and attribute, beside the chance level
        f"CREATE OR REPLACE VIEW evaluations AS SELECT *, accuracy / nullif(chance, 0) AS x_chance FROM read_parquet({evals}, union_by_name=true) WHERE run IS NOT NULL",
        # the ledger: per run checkpoint, every trained sample (times seen, first and last
        # optimizer step), the compact per-epoch segments it was expanded from, per partition
        f"CREATE OR REPLACE VIEW ledger_deltas AS SELECT * FROM read_parquet({ledger}) WHERE run IS NOT NULL",
        f"CREATE OR REPLACE VIEW ledger_chain AS SELECT * FROM read_parquet({ledger_chain}) WHERE run IS NOT NULL",
        """CREATE OR REPLACE VIEW ledger_samples AS
           SELECT ch.run, ch.checkpoint_step, d.sample_id, any_value(d.partition) AS partition,
                  sum(d.times_seen) AS times_seen, min(d.first_step) AS first_step,
                  max(d.last_step) AS last_step, any_value(d.partition_size) AS partition_size
           FROM ledger_chain ch JOIN ledger_deltas d
             ON d.run = ch.run AND d.checkpoint_step = ch.delta_step
           GROUP BY ch.run, ch.checkpoint_step, d.sample_id""",
        f"CREATE OR REPLACE VIEW ledger_epochs AS SELECT *, pos_to - pos_from AS samples FROM read_parquet({ledger_epochs}) WHERE run IS NOT NULL",
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
        *_dedupe_views(layout),
        *_data_card_views(layout),
    ]


def _dedupe_views(layout: DataLayout) -> list[str]:
    """Duplicates (flowmatch_assets/dedupe.py) and every input row's final outcome."""
    c = layout.catalog_dir
    dups = _sql_str(c / "duplicates" / "*" / "*.parquet")
    content = _sql_str(c / "content" / "*" / "*.parquet")
    return [
        f"CREATE OR REPLACE VIEW duplicate_records AS SELECT * FROM read_parquet({dups}, union_by_name=true) WHERE asset IS NOT NULL",
        # md5 of the bytes of every row stored in a (materialized) images_256 shard
        f"""CREATE OR REPLACE VIEW content_md5 AS
           SELECT partition, id, position, md5 FROM read_parquet({content}, union_by_name=true)
           WHERE asset IS NOT NULL AND md5 IS NOT NULL AND partition IN
                 (SELECT partition FROM materializations WHERE asset = 'images_256')""",
        """CREATE OR REPLACE VIEW content_first AS
           SELECT md5, partition AS kept_partition, id AS kept_id FROM (
               SELECT *, row_number() OVER (PARTITION BY md5 ORDER BY partition, position) AS k
               FROM content_md5) WHERE k = 1""",
        # stored rows whose bytes an earlier row (dataset order) also stored: the later ones
        # lose (their partition ran before the winner's, or at the same time)
        """CREATE OR REPLACE VIEW content_duplicates AS
           SELECT m.partition, m.id, m.md5, f.kept_partition, f.kept_id FROM content_md5 m
           JOIN content_first f ON f.md5 = m.md5
           WHERE (m.partition, m.id) <> (f.kept_partition, f.kept_id)""",
        """CREATE OR REPLACE VIEW duplicates AS
           SELECT partition, id, 'hash' AS kind, hash, kept_partition, kept_id,
                  false AS still_stored
           FROM duplicate_records WHERE kind = 'hash'
           UNION ALL
           SELECT d.partition, d.id, 'content', d.hash,
                  coalesce(f.kept_partition, d.kept_partition), coalesce(f.kept_id, d.kept_id), false
           FROM duplicate_records d LEFT JOIN content_first f ON f.md5 = d.hash
           WHERE d.kind = 'content'
           UNION ALL
           SELECT partition, id, 'content', md5, kept_partition, kept_id, true
           FROM content_duplicates""",
        # every input row's final outcome: filtered by the metadata filters, else the image
        # stage's outcome (pending before it ran), a content duplicate counted as filtered
        """CREATE OR REPLACE VIEW dataset_rows AS
           SELECT m.partition, m.id, m.url,
                  CASE WHEN m.outcome = 'filtered' THEN 'metadata'
                       WHEN i.id IS NOT NULL THEN 'images' END AS stage,
                  CASE WHEN m.outcome = 'filtered' THEN 'filtered'
                       WHEN i.id IS NULL THEN 'pending'
                       WHEN c.id IS NOT NULL THEN 'filtered'
                       ELSE i.outcome END AS outcome,
                  CASE WHEN m.outcome = 'filtered' THEN m.reason
                       WHEN c.id IS NOT NULL THEN 'duplicate_content'
                       ELSE i.reason END AS reason,
                  d.kept_partition, d.kept_id
           FROM rows m
           LEFT JOIN rows i ON i.asset = 'images_256' AND i.partition = m.partition AND i.id = m.id
           LEFT JOIN content_duplicates c ON c.partition = m.partition AND c.id = m.id
           LEFT JOIN duplicates d ON d.partition = m.partition AND d.id = m.id
           WHERE m.asset = 'pd12m_metadata'""",
    ]


def _card_counts(section: str, expr: str, src: str) -> str:
    """A count section of the data card: one item per value of ``expr``, per scope."""
    return f"""SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END AS scope,
               '{section}' AS section, coalesce(CAST(k AS VARCHAR), '(none)') AS item,
               count(*)::DOUBLE AS value, NULL::DOUBLE AS share
               FROM (SELECT partition, {expr} AS k FROM {src})
               GROUP BY GROUPING SETS ((partition, k), (k))"""


def _card_stats(section: str, col: str, src: str) -> str:
    """A distribution section of the data card: p10 / p50 / p90 / mean / max, per scope."""
    return f"""SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END AS scope,
               '{section}' AS section, unnest(['p10', 'p50', 'p90', 'mean', 'max']) AS item,
               unnest([quantile_cont({col}, 0.1), quantile_cont({col}, 0.5),
                       quantile_cont({col}, 0.9), avg({col}), max({col})])::DOUBLE AS value,
               NULL::DOUBLE AS share
               FROM {src} WHERE {col} IS NOT NULL GROUP BY GROUPING SETS ((partition), ())"""


def _data_card_views(layout: DataLayout) -> list[str]:
    """The data card (flowmatch_assets/data_card.py): per partition and whole dataset."""
    cards = _sql_str(layout.catalog_dir / "cards" / "*" / "*.parquet")
    stored = "(SELECT * FROM data_card_rows WHERE outcome = 'stored')"
    aspect = """CASE WHEN orig_width IS NULL THEN NULL
                     ELSE greatest(orig_width, orig_height) / least(orig_width, orig_height) END"""
    bucket = f"""CASE WHEN {aspect} IS NULL THEN NULL WHEN {aspect} < 1.25 THEN '1-1.25'
                      WHEN {aspect} < 1.5 THEN '1.25-1.5' WHEN {aspect} < 2 THEN '1.5-2'
                      WHEN {aspect} < 3 THEN '2-3' ELSE '>=3' END"""
    order = ", ".join(f"('{s}', {i})" for i, s in enumerate(CARD_SECTIONS))
    shared = ("outcome", "license", "source", "aspect")
    return [
        f"""CREATE OR REPLACE VIEW data_card_rows AS
            SELECT c.* EXCLUDE (asset), d.outcome, d.reason, d.kept_id
            FROM read_parquet({cards}, union_by_name=true) c
            JOIN dataset_rows d ON d.partition = c.partition AND d.id = c.id
            WHERE c.asset IS NOT NULL""",
        f"""CREATE OR REPLACE VIEW data_card AS
            WITH parts AS (
              SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END AS scope,
                     'rows' AS section,
                     unnest(['input', 'stored', 'filtered', 'failed', 'pending']) AS item,
                     unnest([count(*), count(*) FILTER (outcome = 'stored'),
                             count(*) FILTER (outcome = 'filtered'),
                             count(*) FILTER (outcome = 'failed'),
                             count(*) FILTER (outcome = 'pending')])::DOUBLE AS value,
                     unnest([1.0, count(*) FILTER (outcome = 'stored') / count(*),
                             count(*) FILTER (outcome = 'filtered') / count(*),
                             count(*) FILTER (outcome = 'failed') / count(*),
                             count(*) FILTER (outcome = 'pending') / count(*)]) AS share
              FROM data_card_rows GROUP BY GROUPING SETS ((partition), ())
              UNION ALL {_card_counts("outcome", "outcome || coalesce(':' || reason, '')", "data_card_rows")}
              UNION ALL {_card_counts("license", "license", stored)}
              UNION ALL {_card_counts("source", "source", stored)}
              UNION ALL {_card_counts("aspect", bucket, f"(SELECT * FROM {stored} WHERE orig_width IS NOT NULL)")}
              UNION ALL {_card_stats("caption_chars", "caption_chars", stored)}
              UNION ALL {_card_stats("caption_tokens", "caption_tokens", stored)}
              UNION ALL {_card_stats("orig_long_side", "greatest(orig_width, orig_height)", stored)}
              UNION ALL {_card_stats("orig_short_side", "least(orig_width, orig_height)", stored)}
              UNION ALL
              SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END,
                     'text', 'captions_over_max_tokens',
                     count(*) FILTER (caption_tokens > max_tokens)::DOUBLE,
                     count(*) FILTER (caption_tokens > max_tokens) / nullif(count(caption_tokens), 0)
              FROM {stored} GROUP BY GROUPING SETS ((partition), ())
              UNION ALL
              SELECT CASE WHEN grouping(partition) = 1 THEN 'dataset' ELSE partition END,
                     'text', 'fp16_saturated_values',
                     sum(CAST(extra->>'$.fp16_saturated' AS BIGINT))::DOUBLE, NULL
              FROM materializations
              WHERE extra->>'$.fp16_saturated' IS NOT NULL
                AND partition IN (SELECT partition FROM data_card_rows)
              GROUP BY GROUPING SETS ((partition), ())
            )
            SELECT p.scope, p.section, p.item, p.value,
                   CASE WHEN p.section IN {shared}
                        THEN p.value / sum(p.value) OVER (PARTITION BY p.scope, p.section)
                        ELSE p.share END AS share,
                   o.section_order
            FROM parts p JOIN (VALUES {order}) o(section, section_order) USING (section)""",
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
        ("ledger", LEDGER_SAMPLE_SCHEMA),
        ("ledger_epochs", LEDGER_EPOCH_SCHEMA),
        ("ledger_chain", LEDGER_CHAIN_SCHEMA),
        ("duplicates", DUPLICATE_SCHEMA),
        ("content", CONTENT_SCHEMA),
        ("cards", CARD_SCHEMA),
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
