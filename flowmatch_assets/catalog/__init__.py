"""The DuckDB catalog: per-partition records (:mod:`.records`, written by materializations) and
the views over them (:mod:`.views`, what ``catalog.duckdb`` holds and :class:`Catalog` reads).
No Dagster."""

from flowmatch_assets.catalog.records import (  # noqa: F401
    CARD_SCHEMA,
    CARD_SECTIONS,
    CONTENT_SCHEMA,
    DUPLICATE_SCHEMA,
    EVALUATION_SCHEMA,
    LEDGER_CHAIN_SCHEMA,
    LEDGER_EPOCH_SCHEMA,
    LEDGER_SAMPLE_SCHEMA,
    MATERIALIZATION_SCHEMA,
    OUTCOMES,
    PARTITION_SCHEMA,
    ROW_SCHEMA,
    MaterializationRecord,
    RowOutcome,
    clear_attempt,
    clear_partition,
    ledger_path,
    read_ledger_segments,
    read_materialization,
    read_rows,
    record_attempt,
    record_card_rows,
    record_content,
    record_duplicates,
    record_evaluation,
    record_ledger,
    record_materialization,
    record_partitions,
    record_rows,
)
from flowmatch_assets.catalog.views import (  # noqa: F401
    PD12M_PAIRS,
    Catalog,
    catalog_version,
    file_lock,
    format_table,
    view_names,
)
