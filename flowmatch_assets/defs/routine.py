"""The one routine every partitioned asset follows, and the run helpers assets and checks share.

    out = PartitionOutput(context, flowmatch, "images_256")   # clears a killed run's temp files
    write_image_shard(out.path, rows)                         # the writer renames atomically
    return out.publish(record_fields..., rows=outcomes, metadata={...})

``publish`` records the partition's row outcomes and its materialization in the catalog (each
file replaced atomically: readers see the old records until then), clears a rejected attempt's
records and returns the ``MaterializeResult`` with the metadata and the file's path. An asset
function is then wiring: read inputs, call the plain function that does the work, publish.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import dagster as dg

from flowmatch_assets import catalog
from flowmatch_assets.catalog import MaterializationRecord, RowOutcome
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness import fingerprints
from flowmatch_models.atomic import remove_stale_temps
from flowmatch_models.fingerprint import Fingerprint


def run_id(context: dg.AssetExecutionContext) -> str | None:
    """The id of the run an asset executes in (None when invoked directly)."""
    try:
        return context.run.run_id
    except Exception:  # noqa: BLE001 - direct invocation has no run
        return None


def run_partitions(context: dg.AssetCheckExecutionContext) -> list[str]:
    """The partition(s) of the run a check executes in (empty: check every partition)."""
    tags = context.run.tags if context.run else {}
    if "dagster/partition" in tags:
        return [tags["dagster/partition"]]
    return []


def shards_check_result(parts: list[str], problems: list[str]) -> dg.AssetCheckResult:
    """A blocking shard check's verdict: passed when no shard of ``parts`` has a problem; the
    first 20 problems in its metadata."""
    return dg.AssetCheckResult(
        passed=not problems,
        metadata={
            "partitions_checked": len(parts),
            "problems": dg.MetadataValue.json(problems[:20]),
        },
    )


class PartitionOutput:
    """One asset partition's file and its catalog records: made, then published."""

    def __init__(
        self,
        context: dg.AssetExecutionContext,
        flowmatch: FlowmatchResource,
        asset: str,
        partition: str | None = None,
    ):
        self.context, self.flowmatch, self.asset = context, flowmatch, asset
        self.partition = partition or context.partition_key
        self.path: Path = flowmatch.layout.asset_path(asset, self.partition)
        if remove_stale_temps(self.path):
            context.log.warning(
                f"{self.partition}: removed the temp files of an earlier, killed {asset} run"
            )

    def reject(self, rows: Iterable[RowOutcome]) -> None:
        """Record a rejected attempt's outcomes (``rejected_attempts``); nothing else changes."""
        catalog.record_attempt(self.flowmatch.data_root, self.asset, self.partition, list(rows))

    def publish(
        self,
        *,
        samples: int,
        rows: Iterable[RowOutcome],
        metadata: dict,
        seconds: float,
        raw_bytes: int = 0,
        stored_bytes: int | None = None,
        fingerprint: Fingerprint | None = None,
        **record: object,
    ) -> dg.MaterializeResult:
        """Record rows and the materialization (``record``: the other MaterializationRecord
        fields) in the catalog and return the result with ``metadata`` and the path; with the
        ``fingerprint`` of what made it (default: the asset's current one,
        flowmatch_assets/freshness/fingerprints.py) in the record, the metadata and the data version."""
        fp = fingerprint or fingerprints.current(self.flowmatch, self.asset, self.partition)
        extra = {**dict(record.pop("extra", None) or {}), "fingerprint": fp.to_json()}  # type: ignore[call-overload]
        root = self.flowmatch.data_root
        size = self.path.stat().st_size if stored_bytes is None else stored_bytes
        catalog.record_rows(root, self.asset, self.partition, rows)
        catalog.clear_attempt(root, self.asset, self.partition)
        catalog.record_materialization(
            root,
            MaterializationRecord(
                asset=self.asset,
                partition=self.partition,
                samples=samples,
                raw_bytes=raw_bytes,
                stored_bytes=size,
                seconds=seconds,
                run_id=run_id(self.context),
                extra=extra,
                **record,  # type: ignore[arg-type]
            ),
        )
        return dg.MaterializeResult(
            asset_key=self.asset,
            metadata={
                **metadata,
                **fingerprints.metadata(fp),
                "path": dg.MetadataValue.path(str(self.path)),
            },
            data_version=fingerprints.data_version(fp, self.path),
        )
