"""The catalog's records: what each materialization writes (never DuckDB).

A materialization writes small parquet records of its own, atomically and per partition:

    <root>/catalog/materializations/<asset>/<partition>.parquet   one row: counts, bytes, time
    <root>/catalog/rows/<asset>/<partition>.parquet               one row per input row: outcome
    <root>/catalog/attempts/<asset>/<partition>.parquet           failures of a rejected attempt

plus duplicates, content hashes, data-card rows, evaluations and ledgers: each a
:class:`~flowmatch_assets.catalog.record_kinds.RecordKind` (folder, schema, grain, path) of
the registry ``RECORD_KINDS``, whose paths every writer here takes; the views over them are
:mod:`flowmatch_assets.catalog.views`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog.derived import write_card_summary, write_content_hashes
from flowmatch_assets.catalog.record_kinds import (  # noqa: F401 (the schemas: imported here)
    CARD_SCHEMA,
    CONTENT_SCHEMA,
    DUPLICATE_SCHEMA,
    EVALUATION_SCHEMA,
    FD_SCHEMA,
    LEDGER_CHAIN_SCHEMA,
    LEDGER_EPOCH_SCHEMA,
    LEDGER_SAMPLE_SCHEMA,
    MATERIALIZATION_SCHEMA,
    PARTITION_SCHEMA,
    RECORD_KINDS,
    ROW_SCHEMA,
    VALIDATION_SCHEMA,
    record_path,
    step_key,
)
from flowmatch_models.model.loss_terms import VAL_BIN, VAL_LOSS, VAL_SAMPLES
from flowmatch_models.storage.atomic import atomic_path, write_parquet
from flowmatch_models.storage.layout import DataLayout

OUTCOMES = ("stored", "filtered", "failed")


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


#: The footer key of a record file's own summary (JSON): a materialization record's row, a row
#: record's outcome counts. The catalog's summaries (catalog/summary.py) read footers, which
#: costs a tenth of reading a small file's data; written with the file, so never out of step.
SUMMARY_KEY = b"flowmatch.summary"


def _write_parquet(path: Path, table: pa.Table, summary: object = None) -> list[int]:
    """Write ``table`` atomically (with ``summary`` in its footer); returns the file's
    identity, ``[inode, size, mtime_ns]`` (a rename keeps them)."""
    if summary is not None:
        meta = {**(table.schema.metadata or {}), SUMMARY_KEY: json.dumps(summary, default=str)}
        table = table.replace_schema_metadata(meta)
    with atomic_path(path) as tmp:
        write_parquet(table, tmp)
        st = tmp.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def record_materialization(data_root: str | Path, record: MaterializationRecord) -> Path:
    """Write (replace) the materialization record of one asset partition, atomically."""
    path = record_path(data_root, "materializations", record.asset, record.partition)
    row = record.as_row()
    _write_parquet(path, pa.Table.from_pylist([row], schema=MATERIALIZATION_SCHEMA), row)
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
    path = record_path(data_root, kind, asset, partition)
    rows = list(rows)
    counts = Counter((r.outcome, r.reason) for r in rows)
    outcomes = [[o, why, n] for (o, why), n in sorted(counts.items(), key=str)]
    _write_parquet(path, _rows_table(asset, partition, rows), {"outcomes": outcomes})
    return path


def _rows_table(asset: str, partition: str, rows: Sequence[RowOutcome]) -> pa.Table:
    """The ``ROW_SCHEMA`` table of ``rows``, built column by column (a dict per row costs
    ~0.4 s for a 10k-row partition; this ~10 ms)."""
    n = len(rows)
    cols = {
        "asset": pa.repeat(pa.scalar(asset, pa.string()), n),
        "partition": pa.repeat(pa.scalar(partition, pa.string()), n),
        "id": pa.array([r.id for r in rows], pa.string()),
        "url": pa.array([r.url for r in rows], pa.string()),
        "outcome": pa.array([r.outcome for r in rows], pa.string()),
        "reason": pa.array([r.reason for r in rows], pa.string()),
        "detail": pa.array([r.detail for r in rows], pa.string()),
    }
    return pa.Table.from_pydict(cols, schema=ROW_SCHEMA)


def clear_attempt(data_root: str | Path, asset: str, partition: str) -> None:
    """Forget a rejected attempt's failures (a later attempt succeeded)."""
    record_path(data_root, "attempts", asset, partition).unlink(missing_ok=True)


def clear_partition(data_root: str | Path, asset: str, partition: str) -> None:
    """Remove the catalog records of one asset partition (`flowmatch verify`: its file is gone)."""
    for kind in RECORD_KINDS.values():
        if kind.cleared_with_file:
            kind.path(data_root, asset, partition).unlink(missing_ok=True)


def record_duplicates(
    data_root: str | Path, asset: str, partition: str, kind: str, rows: Sequence[dict]
) -> Path:
    """Write (replace) the rows ``asset`` dropped as duplicates (``{id, hash, kept_partition,
    kept_id}``) in one partition: ``catalog/duplicates/<asset>/<partition>.parquet``."""
    path = record_path(data_root, "duplicates", asset, partition)
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
    """Write (replace) the md5 of the bytes of every row stored in one images shard
    (``{id, position, md5}``): what content dedupe and the ``content_duplicates`` view read."""
    layout = DataLayout(data_root)
    path = record_path(layout, "content", "images", partition)
    data = [
        {
            "asset": "images",
            "partition": partition,
            **{k: r[k] for k in ("id", "position", "md5")},
        }
        for r in rows
    ]
    table = pa.Table.from_pylist(data, schema=CONTENT_SCHEMA)
    ident = _write_parquet(path, table)
    write_content_hashes(layout, partition, table.column("md5"), ident)  # what dedupe reads
    return path


#: The data card's sections, in the order the card shows them.
CARD_SECTIONS = (
    "rows",
    "outcome",
    "license",
    "source",
    "aspect",
    "bucket",
    "kept",
    "caption_chars",
    "caption_tokens",
    "orig_long_side",
    "orig_short_side",
    "text",
)


def record_card_rows(data_root: str | Path, partition: str, rows: Sequence[dict]) -> Path:
    """Write (replace) the data card's per-row record of one partition
    (flowmatch_assets/reports/data_card.py), and its summary (catalog/summary.py: the card
    as counts, statistics and bins, from the partition's row records as they are now)."""
    layout = DataLayout(data_root)
    path = record_path(layout, "cards", "data_card", partition)
    data = [{"asset": "data_card", "partition": partition, **r} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=CARD_SCHEMA))
    write_card_summary(layout, partition)  # the partition's card, so no query has to
    return path


def ledger_path(data_root: str | Path, run: str, step: int, what: str = "ledger") -> Path:
    return record_path(data_root, what, run, step_key(step))


def read_ledger_segments(
    data_root: str | Path, run: str, step: int
) -> tuple[list[dict], list[int]]:
    """A recorded checkpoint's segments and its delta chain (``[], []`` if none)."""
    p = ledger_path(data_root, run, step, "ledger_epochs")
    c = ledger_path(data_root, run, step, "ledger_chain")
    if not (p.exists() and c.exists()):
        return [], []
    segs = [
        {
            k: v
            for k, v in r.items()
            if k not in ("run", "checkpoint_step") and not (k == "bucket_chunk" and v is None)
        }
        for r in pq.read_table(p).to_pylist()
    ]
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
    :func:`flowmatch_models.train.ledger.expand`) and its chain of deltas (``chain``: the base's chain
    plus ``step``), which the ``ledger_samples`` view sums. The chain is written last: a
    checkpoint counts as recorded only once it is there."""
    seg_rows = [
        {**{k: seg.get(k) for k in LEDGER_EPOCH_SCHEMA.names}, "run": run, "checkpoint_step": step}
        for seg in segments
    ]
    _write_parquet(
        ledger_path(data_root, run, step, "ledger_epochs"),
        pa.Table.from_pylist(seg_rows, schema=LEDGER_EPOCH_SCHEMA),
    )
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
    _write_parquet(
        ledger_path(data_root, run, step, "ledger_chain"),
        pa.Table.from_pylist(chain_rows, schema=LEDGER_CHAIN_SCHEMA),
    )
    return path


def record_evaluation(data_root: str | Path, run: str, step: int, rows: Sequence[dict]) -> Path:
    """Write (replace) the caption-following scores of one checkpoint (one row per attribute)."""
    path = record_path(data_root, "evaluations", run, step_key(step))
    now = _now_utc()
    data = [{**r, "evaluated_at": now} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=EVALUATION_SCHEMA))
    return path


def validation_rows(metrics_csv: str | Path, run: str) -> list[dict]:
    """The held-out validation losses of a run's merged ``metrics.csv`` (``val/loss`` and
    ``val/t{k}`` columns, written every ``trainer.val_every`` steps), one row per step and bin."""
    import csv

    out = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            if not r.get(VAL_LOSS):
                continue
            step, n = int(r["step"]), int(float(r.get(VAL_SAMPLES) or 0))
            out.append(
                {"run": run, "step": step, "t_bin": -1, "loss": float(r[VAL_LOSS]), "samples": n}
            )
            for k, v in r.items():
                if k.startswith(VAL_BIN) and v:
                    out.append(
                        {
                            "run": run,
                            "step": step,
                            "t_bin": int(k[len(VAL_BIN) :]),
                            "loss": float(v),
                            "samples": n,
                        }
                    )
    return out


def record_validation(data_root: str | Path, run: str, rows: Sequence[dict]) -> Path:
    """Write (replace) a run's validation losses (see :func:`validation_rows`)."""
    path = record_path(data_root, "validation", run)
    now = _now_utc()
    data = [{**r, "recorded_at": now} for r in rows]
    _write_parquet(path, pa.Table.from_pylist(data, schema=VALIDATION_SCHEMA))
    return path


def record_fd(data_root: str | Path, run: str, step: int, row: dict) -> Path:
    """Write (replace) the FD-DINOv2 of one checkpoint."""
    path = record_path(data_root, "fd", run, step_key(step))
    data = [{"run": run, "step": step, **row, "evaluated_at": _now_utc()}]
    _write_parquet(path, pa.Table.from_pylist(data, schema=FD_SCHEMA))
    return path


def read_materialization(data_root: str | Path, asset: str, partition: str) -> dict | None:
    """The materialization record of one asset partition, or None."""
    p = record_path(data_root, "materializations", asset, partition)
    rows = pq.read_table(p).to_pylist() if p.exists() else []
    return rows[0] if rows else None


def read_rows(data_root: str | Path, asset: str, partition: str) -> pa.Table | None:
    """The per-row outcomes of one asset partition, or None if there are none."""
    p = record_path(data_root, "rows", asset, partition)
    return pq.read_table(p) if p.exists() else None


def record_partitions(data_root: str | Path, partitions: Sequence[dict]) -> Path:
    """Replace the list of known partitions (key, source file, row range)."""
    path = record_path(data_root, "partitions")
    _write_parquet(path, pa.Table.from_pylist(list(partitions), schema=PARTITION_SCHEMA))
    return path


def read_partitions(data_root: str | Path) -> list[dict]:
    """The list of known partitions as last recorded (none before the first discovery)."""
    path = record_path(data_root, "partitions")
    return pq.read_table(path).to_pylist() if path.exists() else []
