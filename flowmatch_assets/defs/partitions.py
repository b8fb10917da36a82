"""Partitions: one dynamic partition per shard, of PD12M and of every configured source.

PD12M's shards are discovered from its metadata files (keys ``NNN-KK``); a source of the user's
own images registers its partitions (keys ``<name>-NNNNN``, flowmatch_assets/ingest/sources).
All of them live in the one dynamic partitions definition (named ``pd12m_shards`` since before
sources existed: renaming it would orphan every instance's registered partitions), so every
partitioned asset, backfill and check treats them alike. Two sensors add new ones:
``pd12m_partition_sensor`` for new metadata files, ``source_partition_sensor`` for new images,
files or tars of the configured sources.
"""

import dagster as dg

from flowmatch_assets.catalog import record_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.ingest import sources as src
from flowmatch_assets.ingest.metadata import MetadataError, discover_shards, metadata_exists
from flowmatch_models.layout import PD12M

SHARDS = "pd12m_shards"
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)


def pd12m_partitions(flowmatch: FlowmatchResource) -> list[dict]:
    """PD12M's shards as catalog ``partitions`` rows; none when its metadata source is absent
    and sources of the user's own images are configured (otherwise: MetadataError)."""
    if flowmatch.sources and not metadata_exists(flowmatch.metadata_source):
        return []
    specs = discover_shards(flowmatch.metadata_source, flowmatch.shard_size)
    return [{**s.as_dict(), "source": PD12M} for s in specs]


def source_partitions(flowmatch: FlowmatchResource, name: str) -> list[dict]:
    """The registered partitions of source ``name`` as catalog ``partitions`` rows."""
    cfg = flowmatch.source(name)
    return [
        src.Manifest(**s, source=name, kind=cfg.kind).as_partition(cfg.location)
        for s in src.registered(flowmatch.data_root, name)
    ]


def discover(flowmatch: FlowmatchResource, scan: list[str] | None = None) -> list[dict]:
    """Every partition of PD12M and of the configured sources (``{partition, source,
    source_file, row_start, row_end}``, key order); the sources in ``scan`` are scanned for
    new samples first (registered as new partitions). Refreshes the catalog's ``partitions``."""
    for name in scan or []:
        src.register(flowmatch.data_root, name, flowmatch.source(name))
    found = pd12m_partitions(flowmatch)
    for name in sorted(flowmatch.sources):
        found += source_partitions(flowmatch, name)
    record_partitions(flowmatch.data_root, found)
    return found


def register_partitions(
    instance: dg.DagsterInstance, flowmatch: FlowmatchResource, source: str | None = None
) -> list[str]:
    """Add partitions for shards not yet registered in ``instance``; returns the new keys.
    ``source``: scan only that source for new samples (``pd12m``: none); default every
    configured source."""
    if source is not None and source != PD12M:
        flowmatch.source(source)  # unknown: SourceError naming the configured ones
    scan = sorted(flowmatch.sources) if source is None else [s for s in [source] if s != PD12M]
    found = discover(flowmatch, scan)
    existing = set(instance.get_dynamic_partitions(SHARDS))
    new = [p["partition"] for p in found if p["partition"] not in existing]
    if new:
        instance.add_dynamic_partitions(SHARDS, new)
    return new


@dg.sensor(
    name="pd12m_partition_sensor",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers a partition for every shard of every PD12M metadata file in the source.",
)
def pd12m_partition_sensor(
    context: dg.SensorEvaluationContext, flowmatch: FlowmatchResource
) -> dg.SensorResult | dg.SkipReason:
    try:
        found = discover(flowmatch)
    except (MetadataError, src.SourceError) as e:  # e.g. no metadata yet: say why in the UI
        return dg.SkipReason(str(e))
    return _add_new(context, [p["partition"] for p in found if p["source"] == PD12M], "shards")


@dg.sensor(
    name="source_partition_sensor",
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers partitions for new images, parquet files or tars of every configured "
    "source of your own images (`flowmatch sources list`).",
)
def source_partition_sensor(
    context: dg.SensorEvaluationContext, flowmatch: FlowmatchResource
) -> dg.SensorResult | dg.SkipReason:
    if not flowmatch.sources:
        return dg.SkipReason("no sources configured (`flowmatch sources add`)")
    problems, keys = [], []
    for name in sorted(flowmatch.sources):
        try:
            src.register(flowmatch.data_root, name, flowmatch.source(name))
        except (src.SourceError, OSError) as e:  # one broken source never blocks the others
            problems.append(f"{name}: {e}")
    try:
        found = discover(flowmatch)
    except (MetadataError, src.SourceError) as e:
        return dg.SkipReason(str(e))
    keys = [p["partition"] for p in found if p["source"] != PD12M]
    result = _add_new(context, keys, "source partitions")
    if problems:
        context.log.warning("; ".join(problems))
        if isinstance(result, dg.SkipReason):
            return dg.SkipReason(f"{result.skip_message}; problems: {'; '.join(problems)}")
    return result


def _add_new(
    context: dg.SensorEvaluationContext, keys: list[str], what: str
) -> dg.SensorResult | dg.SkipReason:
    existing = set(context.instance.get_dynamic_partitions(SHARDS))
    new = [k for k in keys if k not in existing]
    if not new:
        return dg.SkipReason(f"{len(keys)} {what}, all registered")
    context.log.info(
        f"registering {len(new)} new partitions: {new[:5]}{'...' if len(new) > 5 else ''}"
    )
    return dg.SensorResult(dynamic_partitions_requests=[shard_partitions.build_add_request(new)])
