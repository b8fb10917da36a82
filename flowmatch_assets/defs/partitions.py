"""Partitions: one dynamic partition per shard, of PD12M and of every configured source.

Each source says what its partitions are (``ingest/sources`` ``PartitionSource``): PD12M, the
built-in source, finds its shards anew from its metadata files (keys ``NNN-KK``,
``sources/urls.py``); a source of the user's own images registers its partitions (keys
``<name>-NNNNN``, ``sources/registry.py``).
All of them live in the one dynamic partitions definition ``shards`` (``shards`` before;
``flowmatch upgrade`` carries an instance over), so every partitioned asset, backfill and check
treats them alike. Two sensors add new ones:
``metadata_partition_sensor`` for new metadata files, ``source_partition_sensor`` for new images,
files, tars or lists of the configured sources.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import dagster as dg
import pyarrow as pa

from flowmatch_assets.catalog import read_partitions, record_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness.shards import SHARDS, shard_partitions  # noqa: F401 (here too)
from flowmatch_assets.ingest import sources as src
from flowmatch_assets.ingest.metadata import MetadataError
from flowmatch_models.storage.layout import source_of

_LOG = logging.getLogger(__name__)


@dataclass
class Problem:
    """Something a discovery skipped: a whole source (``whole``: its location is missing or
    unreachable, PD12M's metadata unreadable) or some of its files, and why, in one line."""

    source: str
    line: str
    whole: bool


@dataclass
class Discovery:
    """Every partition found (catalog ``partitions`` rows, key order) and what was skipped."""

    partitions: list[dict]
    problems: list[Problem] = field(default_factory=list)


_UNREADABLE = (MetadataError, src.SourceError, OSError, ValueError, pa.ArrowException)


def discover(flowmatch: FlowmatchResource, scan: Sequence[str] | None = None) -> Discovery:
    """Every partition of PD12M and of the configured sources (``{partition, source,
    source_file, row_start, row_end}``, key order); the sources in ``scan`` are scanned for
    new samples first (registered as new partitions). One broken source never stops the
    others: a source that cannot be scanned, or files it skipped, are :class:`Problem` s; when
    PD12M's metadata cannot be listed (and sources are configured) its partitions are the ones
    the catalog knew. Refreshes the catalog's ``partitions``."""
    problems: list[Problem] = []
    for name in scan or []:  # sources that register their partitions (``scanned``)
        try:
            found = src.register(flowmatch.data_root, name, flowmatch.source(name))
        except _UNREADABLE as e:
            problems.append(Problem(name, f"{name}: {e}", True))
            continue
        if found.skipped:
            problems.append(Problem(name, found.skipped_line(name), False))
    parts: list[dict] = []
    for source in src.all_sources(flowmatch):
        try:
            parts += source.partitions()
        except _UNREADABLE as e:
            if not flowmatch.sources:
                raise  # the built-in source is all there is: the CLI says why in one line
            problems.append(Problem(source.name, f"{source.name}: {e}", True))
            known = read_partitions(flowmatch.data_root)
            parts += [p for p in known if p["source"] == source.name]
    record_partitions(flowmatch.data_root, parts)
    return Discovery(parts, problems)


def scanned(flowmatch: FlowmatchResource, source: str | Sequence[str] | None) -> list[str]:
    """The configured sources a registration scans: ``source`` (one name or several; a
    built-in source, ``pd12m``, is not scanned: its partitions come from its files), default
    every one. An unknown name: SourceError naming the configured ones."""
    if source is None:
        return sorted(flowmatch.sources)
    names = [source] if isinstance(source, str) else list(source)
    return [n for n in names if src.source_named(flowmatch, n).registers]


def found_anew(flowmatch: FlowmatchResource) -> set[str]:
    """The sources whose partitions are found from their files each time, not registered
    (the built-in ones: ``metadata_partition_sensor`` adds their new keys)."""
    return {s.name for s in src.all_sources(flowmatch) if not s.registers}


def register_partitions(
    instance: dg.DagsterInstance,
    flowmatch: FlowmatchResource,
    source: str | Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
    strict: bool = False,
) -> list[str]:
    """Add partitions for shards not yet registered in ``instance``; returns the new keys.
    ``source``: scan only that source (or those) for new samples (``pd12m``: none), so a
    broken other source is never read; default every configured source. What was skipped
    goes to ``log`` (default: this module's logger), one line each; ``strict``: a scanned
    source that cannot be read at all raises SourceError instead (nothing is registered)."""
    names = scanned(flowmatch, source)
    found = discover(flowmatch, names)
    if strict:
        for p in found.problems:
            if p.whole and p.source in names:
                raise src.SourceError(p.line)
    for p in found.problems:
        (log or _LOG.warning)(f"skipped {p.line}")
    existing = set(instance.get_dynamic_partitions(SHARDS))
    new = [p["partition"] for p in found.partitions if p["partition"] not in existing]
    if new:
        instance.add_dynamic_partitions(SHARDS, new)
    return new


@dg.sensor(
    name="metadata_partition_sensor",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers a partition for every shard of every PD12M metadata file in the source.",
)
def metadata_partition_sensor(
    context: dg.SensorEvaluationContext, flowmatch: FlowmatchResource
) -> dg.SensorResult | dg.SkipReason:
    try:
        found = discover(flowmatch)
        mine = found_anew(flowmatch)
    except _UNREADABLE as e:  # e.g. no metadata yet: say why in the UI
        return dg.SkipReason(str(e))
    for p in found.problems:
        if p.source in mine:
            return dg.SkipReason(p.line)
    keys = [p["partition"] for p in found.partitions if p["source"] in mine]
    result = _add_new(context, keys, "shards")
    # keys with no metadata behind them (added by hand in the Materialize dialog): flagged on
    # every tick, before a run of them fails
    have = set(keys)
    orphans = sorted(
        k
        for k in context.instance.get_dynamic_partitions(SHARDS)
        if source_of(k) in mine and k not in have
    )
    if orphans:
        line = (
            f"{len(orphans)} partition keys have no metadata behind them "
            f"({', '.join(orphans[:5])}{' ...' if len(orphans) > 5 else ''}); a run of them "
            "fails: remove them with `flowmatch partitions remove --orphans`"
        )
        context.log.warning(line)
        if isinstance(result, dg.SkipReason):
            return dg.SkipReason(f"{result.skip_message}; {line}")
    return result


@dg.sensor(
    name="source_partition_sensor",
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers partitions for new images, parquet files, tars or URL lists of every "
    "configured source of your own images (`flowmatch sources list`).",
)
def source_partition_sensor(
    context: dg.SensorEvaluationContext, flowmatch: FlowmatchResource
) -> dg.SensorResult | dg.SkipReason:
    if not flowmatch.sources:
        return dg.SkipReason("no sources configured (`flowmatch sources add`)")
    try:  # one broken source never blocks the others: its problem is a line of the tick
        found = discover(flowmatch, sorted(flowmatch.sources))
        anew = found_anew(flowmatch)
    except _UNREADABLE as e:
        return dg.SkipReason(str(e))
    problems = [p.line for p in found.problems if p.source not in anew]
    keys = [p["partition"] for p in found.partitions if p["source"] not in anew]
    result = _add_new(context, keys, "source partitions")
    if problems:
        context.log.warning("skipped " + "; ".join(problems))
        if isinstance(result, dg.SkipReason):
            return dg.SkipReason(f"{result.skip_message}; skipped: {'; '.join(problems)}")
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
