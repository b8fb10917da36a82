"""One definition of a partition's state, used by every command that says "missing".

An asset partition is **present** when all three hold:

1. its file exists and is valid: a parquet footer that reads (``metadata``,
   ``images``), or a flowmatch store shard whose header reads and, with ``deep=True``, whose
   checksums match (embeddings);
2. the catalog holds its materialization record;
3. Dagster has a materialization of it (skipped where no instance is given).

Anything else is **missing**, with the first failing condition as its state: ``never`` (no
file, no catalog record, no Dagster materialization: never made), ``gone`` (no file, but the
catalog or Dagster says it was made), ``corrupt`` (unreadable file), ``no_record`` (catalog),
``not_in_dagster``.
`flowmatch materialize --missing`, `flowmatch backfill --missing`, `flowmatch verify` and the
(off by default) ``verify_sensor`` all use :func:`partition_states`.

:func:`verify` makes the three agree where a file is gone or corrupt: the corrupt file is moved
aside (hidden ``.corrupt-*``), the catalog records are removed, a failed materialization of the
partition is recorded in Dagster (open-source Dagster cannot wipe one partition, so the UI shows
it as failed; "missing and failed" backfills and ``--missing`` pick it up) and a failed
asset-check evaluation says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from flowmatch_assets import compat
from flowmatch_assets.catalog.record_kinds import record_path
from flowmatch_models.storage import remote
from flowmatch_models.storage.layout import PARTITIONED_ASSETS, DataLayout

PRESENT = "present"
#: The check whose failure `verify` reports per asset (None: the asset has no check); every
#: embedding kind has ``<kind>_valid`` (flowmatch_assets/defs/embedding_assets.py).
DATA_CHECKS = {"metadata": None, "images": "images_complete"}


def check_of(asset: str) -> str | None:
    """The validity check of ``asset`` (None: it has none)."""
    return DATA_CHECKS[asset] if asset in DATA_CHECKS else f"{asset}_valid"


@dataclass(frozen=True)
class PartitionState:
    """The state of one asset partition: ``present`` or why it is missing."""

    asset: str
    partition: str
    state: str
    detail: str = ""

    @property
    def missing(self) -> bool:
        return self.state != PRESENT


def file_state(
    layout: DataLayout, asset: str, partition: str, deep: bool = False
) -> tuple[str, str]:
    """(``present`` | ``gone`` | ``corrupt``, detail) of the partition's file alone."""
    path = layout.asset_path(asset, partition)
    if not path.is_file() and partition in _published(layout, asset):
        return PRESENT, ""  # published by another machine: fetched (and checked) on first read
    if not path.is_file():
        return "gone", f"no file {path}"
    try:
        if path.suffix == ".parquet":
            pq.read_metadata(path)
        else:
            from flowmatch_models.storage.store import read_shard

            shard = read_shard(path, verify=deep)
            len(shard)
    except Exception as e:  # noqa: BLE001 - any unreadable file is corrupt
        return "corrupt", f"{path.name}: {type(e).__name__}: {e}"[:300]
    return PRESENT, ""


def _published(layout: DataLayout, asset: str) -> set[str]:
    """With a remote data root: the partitions of ``asset`` published on any machine."""
    return remote.published(layout.root, asset) if remote.active(layout.root) else set()


def _record_path(layout: DataLayout, asset: str, partition: str) -> Path:
    return record_path(layout, "materializations", asset, partition)


def partition_states(
    layout: DataLayout,
    partitions: Iterable[str],
    assets: Sequence[str] = tuple(PARTITIONED_ASSETS),
    instance=None,
    deep: bool = False,
) -> list[PartitionState]:
    """The state of every (asset, partition); Dagster is consulted only when ``instance``."""

    parts = list(partitions)
    done = {a: dagster_materialized(instance, a) for a in assets} if instance is not None else {}
    # a partition published to the remote by another machine is materialized there, whatever
    # this machine's Dagster instance knows (machines that share no instance)
    done = {a: done[a] | _published(layout, a) for a in done}
    out = []
    for p in parts:
        for a in assets:
            state, detail = file_state(layout, a, p, deep)
            recorded = _record_path(layout, a, p).exists()
            if state == "gone" and not recorded and (instance is None or p not in done[a]):
                state, detail = "never", "never materialized"
            if state == PRESENT and not _record_path(layout, a, p).exists():
                state, detail = "no_record", "no catalog record"
            if state == PRESENT and instance is not None and p not in done[a]:
                state, detail = "not_in_dagster", "no Dagster materialization"
            out.append(PartitionState(a, p, state, detail))
    return out


def dagster_materialized(instance, asset: str) -> set[str]:
    """Partitions whose latest Dagster materialization attempt succeeded (as the UI's
    "Materialized": a later failed or running attempt does not count)."""
    import dagster as dg

    key = dg.AssetKey(asset)
    ever = set(instance.get_materialized_partitions(key))
    return ever - compat.failed_latest_attempts(instance, asset)


def missing_partitions(states: Iterable[PartitionState]) -> list[str]:
    """Partitions at least one of whose assets is missing, sorted."""
    return sorted({s.partition for s in states if s.missing})


def verify(
    layout: DataLayout,
    partitions: Iterable[str],
    instance,
    assets: Sequence[str] = tuple(PARTITIONED_ASSETS),
    deep: bool = True,
    run_config: dict | None = None,
) -> list[PartitionState]:
    """Find shards that are gone or corrupt and make the catalog and Dagster say so too
    (``run_config``: of the run that records a failed attempt, e.g. its loggers).

    Returns the states that are not present, except ``never`` (not made yet). For ``gone`` / ``corrupt``: the corrupt file is
    renamed to a hidden ``.corrupt-<name>`` beside it, the catalog records are removed, a run
    tagged ``flowmatch/cli=verify`` records a *failed* materialization of that asset partition
    and a failed check evaluation says why. (Open-source Dagster 1.13 cannot wipe one partition
    of an asset: ``wipe_asset_partitions`` raises NotImplementedError on its SQL storages. A
    failed latest attempt is what the UI shows as Failed, what GraphQL leaves out of
    ``materializedPartitions`` and what a "missing and failed" backfill picks up.)
    ``no_record`` / ``not_in_dagster`` (a valid file the catalog or Dagster does not know) are
    reported only: re-materializing the partition fixes them.
    """
    import dagster as dg

    from flowmatch_assets import catalog

    states = partition_states(layout, partitions, assets, instance, deep)
    bad = [s for s in states if s.missing and s.state != "never"]
    for s in bad:
        if s.state not in ("gone", "corrupt"):
            continue
        path = layout.asset_path(s.asset, s.partition)
        if s.state == "corrupt":
            path.rename(path.with_name(f".corrupt-{path.name}"))
        catalog.clear_partition(layout.root, s.asset, s.partition)
        key = dg.AssetKey(s.asset)
        if s.partition in dagster_materialized(instance, s.asset):
            _record_failed_attempt(instance, s, run_config)
        check = check_of(s.asset)
        if check:
            instance.report_runless_asset_event(
                dg.AssetCheckEvaluation(
                    asset_key=key,
                    check_name=check,
                    passed=False,
                    metadata={"partition": s.partition, "verify": f"{s.state}: {s.detail}"},
                    description=f"flowmatch verify: {s.partition} {s.state}",
                )
            )
    return bad


def _record_failed_attempt(instance, s: PartitionState, run_config: dict | None = None) -> None:
    """Dagster's latest attempt for ``s.asset``'s partition becomes a failure naming what
    verify found (the partition shows as Failed, no longer Materialized)."""
    from flowmatch_assets.freshness.shards import shard_partitions

    message = f"flowmatch verify: {s.asset} {s.partition} is {s.state} ({s.detail})"
    compat.record_failed_materialization(
        instance,
        s.asset,
        shard_partitions,
        s.partition,
        message,
        {"flowmatch/cli": "verify"},
        run_config,
    )
