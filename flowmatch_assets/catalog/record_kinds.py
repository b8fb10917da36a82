"""THE REGISTRY of catalog record kinds: what a materialization (or a run) writes under
``<root>/catalog/``, one :class:`RecordKind` each (no DuckDB, no Dagster).

A record kind names its folder, its schema, its grain and so its path and glob:

    per "row"         <kind>/<asset>/<partition>.parquet   one row per input row (rows, ...)
    per "partition"   <kind>/<asset>/<partition>.parquet   one row per asset partition
    per "checkpoint"  <kind>/<run>/step<NNNNNNN>.parquet   per checkpoint of a training run
    per "run"         <kind>/<run>.parquet                 per training run
    per "root"        <kind>.parquet                       one file for the data root

Everything else reads this table, live: the writers (``records.py``) and every other path
construction (``record_path``), the views' placeholders and globs and the plain view of a kind
(``view``: ``SELECT <columns> FROM <its files>``; ``views.py``), and the summaries, which track
the per-row kinds' files and which of them have an older schema (``summary.py``). Adding a
record kind is one entry here plus its writer; a view that joins it to others is a view in
``views.py``. The paths are those the records always had: no data root moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa

from flowmatch_models.storage.layout import DataLayout

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
        ("source", pa.string()),  # pd12m, or a source of the user's own images
    ]
)

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
        ("bucket", pa.string()),  # stored size, "HxW"
        ("kept", pa.float32()),  # share of the original's area the crop kept
        ("license", pa.string()),
        ("source", pa.string()),
    ]
)

EVALUATION_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("step", pa.int64()),
        ("checkpoint", pa.string()),
        ("size", pa.string()),  # height x width generated at (null: before sizes, 256x256)
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
        ("heldout", pa.list_(pa.float64())),
        ("exclude", pa.string()),  # null: no exclusion list (flowmatch_models/data/exclude.py)
        ("bucket_chunk", pa.int64()),  # null: one bucket (no chunks)
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

VALIDATION_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("step", pa.int64()),
        ("t_bin", pa.int64()),  # -1: the mean over the t grid (val/loss)
        ("loss", pa.float64()),
        ("samples", pa.int64()),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
    ]
)

FD_SCHEMA = pa.schema(
    [
        ("run", pa.string()),
        ("step", pa.int64()),
        ("checkpoint", pa.string()),
        ("fd_dinov2", pa.float64()),
        ("n", pa.int64()),
        ("dino", pa.string()),
        ("dino_weights", pa.string()),  # "" = real weights; else what they are (random zoo)
        ("evaluated_at", pa.timestamp("us", tz="UTC")),
    ]
)

Grain = Literal["row", "partition", "checkpoint", "run", "root"]

#: The placeholder's folder and stem: an empty, schema-carrying file so that a glob always
#: matches (the summaries skip it).
EMPTY = "_empty"


@dataclass(frozen=True)
class RecordKind:
    """One kind of catalog record: its folder ``name`` under ``<root>/catalog/``, its
    ``schema`` (today's; older files still read by name), its grain ``per`` (see the module
    doc) and, if it has one, the ``view`` that selects ``columns`` from all its files."""

    name: str
    schema: pa.Schema
    per: Grain
    view: str | None = None
    columns: str = "*"
    #: read its files by name in the view always (``union_by_name``: schemas grew over time);
    #: a per-row kind is read by name only while some of its files have an older schema
    by_name: bool = False
    #: removed with the asset partition's records when its file is gone (``flowmatch verify``)
    cleared_with_file: bool = False

    def folder(self, layout: DataLayout) -> Path:
        """``<root>/catalog/<name>`` (for ``per == "root"``: the file itself)."""
        if self.per == "root":
            return layout.catalog_dir / f"{self.name}.parquet"
        return layout.catalog_dir / self.name

    def path(self, layout: DataLayout | str | Path, group: str = "", key: str = "") -> Path:
        """The file of one record: ``group`` is the asset (per row / partition) or the run
        (per checkpoint / run: then ``group`` alone); ``key`` the partition or
        :func:`step_key`."""
        layout = layout if isinstance(layout, DataLayout) else DataLayout(layout)
        if self.per == "root":
            return self.folder(layout)
        if self.per == "run":
            return self.folder(layout) / f"{group}.parquet"
        return self.folder(layout) / group / f"{key}.parquet"

    def glob(self, layout: DataLayout) -> str:
        """What ``read_parquet`` reads: every file of the kind (placeholder included)."""
        if self.per == "root":
            return str(self.folder(layout))
        if self.per == "run":
            return str(self.folder(layout) / "*.parquet")
        return str(self.folder(layout) / "*" / "*.parquet")

    def placeholder(self, layout: DataLayout) -> Path:
        """The empty, schema-carrying file that keeps the glob matching."""
        if self.per == "root":
            return self.folder(layout)
        if self.per == "run":
            return self.folder(layout) / f"{EMPTY}.parquet"
        return self.folder(layout) / EMPTY / f"{EMPTY}.parquet"


def step_key(step: int) -> str:
    """A checkpoint record's file stem: ``step0001234``."""
    return f"step{step:07d}"


#: Every record kind, in the order the views are built. ``materializations``' view reads its
#: summary (``summary.py``), so it has none here.
RECORD_KINDS: dict[str, RecordKind] = {
    k.name: k
    for k in (
        RecordKind("materializations", MATERIALIZATION_SCHEMA, "partition", cleared_with_file=True),
        RecordKind("rows", ROW_SCHEMA, "row", view="rows", cleared_with_file=True),
        RecordKind("partitions", PARTITION_SCHEMA, "root", view="partitions"),
        RecordKind(
            "evaluations",
            EVALUATION_SCHEMA,
            "checkpoint",
            view="evaluations",
            columns="*, accuracy / nullif(chance, 0) AS x_chance",
            by_name=True,
        ),
        RecordKind("validation", VALIDATION_SCHEMA, "run", view="validation", by_name=True),
        RecordKind("fd", FD_SCHEMA, "checkpoint", view="fd_dinov2", by_name=True),
        RecordKind("ledger", LEDGER_SAMPLE_SCHEMA, "checkpoint", view="ledger_deltas"),
        RecordKind("ledger_chain", LEDGER_CHAIN_SCHEMA, "checkpoint", view="ledger_chain"),
        RecordKind(
            "ledger_epochs",
            LEDGER_EPOCH_SCHEMA,
            "checkpoint",
            view="ledger_epochs",
            columns="*, pos_to - pos_from AS samples",
            by_name=True,
        ),
        RecordKind("attempts", ROW_SCHEMA, "row"),
        RecordKind(
            "duplicates", DUPLICATE_SCHEMA, "row", view="duplicate_records", cleared_with_file=True
        ),
        RecordKind("content", CONTENT_SCHEMA, "row", cleared_with_file=True),
        RecordKind("cards", CARD_SCHEMA, "row"),
    )
}


def record_kind(name: str) -> RecordKind:
    """The registered kind ``name`` (a KeyError names the known ones)."""
    try:
        return RECORD_KINDS[name]
    except KeyError:
        raise KeyError(f"no record kind {name!r}; known: {sorted(RECORD_KINDS)}") from None


def record_path(layout: DataLayout | str | Path, kind: str, group: str = "", key: str = "") -> Path:
    """The file of one record of ``kind`` (see :meth:`RecordKind.path`)."""
    return record_kind(kind).path(layout, group, key)


def row_kinds() -> dict[str, pa.Schema]:
    """The per-row kinds and their schemas (the summaries track their files' schemas)."""
    return {k.name: k.schema for k in RECORD_KINDS.values() if k.per == "row"}
