"""The sensors besides the partition sensor (``partitions.py``): ``verify_sensor``."""

import dagster as dg

from flowmatch_assets.freshness.state import verify


def _verify_sensor_fn(context, flowmatch):
    from flowmatch_assets.defs.partitions import SHARDS

    keys = sorted(context.instance.get_dynamic_partitions(SHARDS))
    bad = verify(flowmatch.layout, keys, context.instance, deep=False)
    fixed = [f"{s.asset}/{s.partition} {s.state}" for s in bad if s.state in ("gone", "corrupt")]
    if fixed:
        context.log.warning(f"marked missing: {', '.join(fixed[:20])}")
    return dg.SkipReason(
        f"{len(keys)} partitions verified; {len(bad)} asset partitions missing"
        + (f", {len(fixed)} newly gone or corrupt: {', '.join(fixed[:5])}" if fixed else "")
    )


def build_verify_sensor():
    """``verify_sensor`` (STOPPED by default; start it in the UI): every hour, `flowmatch
    verify --quick` on every registered partition, so the UI's "Missing" filter and a missing
    backfill pick up shards deleted or damaged outside Dagster."""

    @dg.sensor(
        name="verify_sensor",
        minimum_interval_seconds=3600,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Hourly: shards gone or corrupt on disk are marked missing in the catalog "
        "and Dagster (a failed check says why). Off by default.",
        required_resource_keys={"flowmatch"},
    )
    def verify_sensor(context):
        return _verify_sensor_fn(context, context.resources.flowmatch)

    return verify_sensor
