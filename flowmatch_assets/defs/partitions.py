"""Partitions: one dynamic partition per PD12M shard, discovered from the metadata source."""

import dagster as dg

from flowmatch_assets.catalog import record_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.ingest.metadata import MetadataError, ShardSpec, discover_shards

SHARDS = "pd12m_shards"
shard_partitions = dg.DynamicPartitionsDefinition(name=SHARDS)


def discover(flowmatch: FlowmatchResource) -> list[ShardSpec]:
    """All shards of the metadata source; also refreshes the catalog's list of partitions."""
    specs = discover_shards(flowmatch.metadata_source, flowmatch.shard_size)
    record_partitions(flowmatch.data_root, [s.as_dict() for s in specs])
    return specs


def register_partitions(instance: dg.DagsterInstance, flowmatch: FlowmatchResource) -> list[str]:
    """Add partitions for shards not yet registered in ``instance``; returns the new keys."""
    specs = discover(flowmatch)
    existing = set(instance.get_dynamic_partitions(SHARDS))
    new = [s.key for s in specs if s.key not in existing]
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
        specs = discover(flowmatch)
    except MetadataError as e:  # e.g. no metadata yet: say why in the UI, don't error each tick
        return dg.SkipReason(str(e))
    existing = set(context.instance.get_dynamic_partitions(SHARDS))
    new = [s.key for s in specs if s.key not in existing]
    if not new:
        return dg.SkipReason(f"{len(specs)} shards, all registered")
    context.log.info(
        f"registering {len(new)} new partitions: {new[:5]}{'...' if len(new) > 5 else ''}"
    )
    return dg.SensorResult(dynamic_partitions_requests=[shard_partitions.build_add_request(new)])
