"""The one routine every partitioned asset follows (a training run: ``publish_run``), and the
run helpers assets and checks share.

    with PartitionOutput(context, flowmatch, "images") as out:  # lock; clear killed temps
        write_image_shard(out.path, rows)                           # written, not yet renamed
        return out.publish(record_fields..., rows=outcomes, metadata={...})

Inside the block the partition is locked (a second run of the same asset and partition waits
for the first, so neither removes the other's temp files or publishes half of a mix), and every
file of the partition (its shard, its catalog records, its preview) is written to a temp file
and published together when the block ends (``flowmatch_models.storage.atomic.deferred``): a step that
fails at any point publishes nothing and leaves the previous files as they were, one that
succeeds publishes all of them, the materialization record last. ``publish`` records the
partition's row outcomes and its materialization, clears a rejected attempt's records and
returns the ``MaterializeResult`` with the metadata and the file's path; ``reject`` records a
rejected attempt's failures (only them). A failure of the file system (``No space left on
device``) becomes a ``dg.Failure`` that says so. An asset function is then wiring: read inputs,
call the plain function that does the work, publish.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from flowmatch_assets import catalog, compat
from flowmatch_assets.catalog import MaterializationRecord, RowOutcome
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness import fingerprints
from flowmatch_models.storage import atomic, remote
from flowmatch_models.storage.atomic import remove_stale_temps
from flowmatch_models.storage.fingerprint import Fingerprint, hash_of
from flowmatch_models.storage.layout import PARTITIONED_ASSETS


@contextlib.contextmanager
def partition_lock(path: Path, log, partition: str, asset: str) -> Iterator[None]:
    """Hold ``path``'s exclusive lock (one run of an asset's partition at a time, across
    processes; released when the block ends or the process dies); says so when it waits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(f"{partition}: another run is materializing {asset}; waiting for it")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def lock_path(flowmatch: FlowmatchResource, asset: str, partition: str) -> Path:
    """The file whose lock a writer of ``asset``'s ``partition`` holds (:class:`PartitionOutput`)."""
    return flowmatch.layout.root / ".locks" / asset / f"{partition}.lock"


@contextlib.contextmanager
def reading(flowmatch: FlowmatchResource, asset: str, partition: str) -> Iterator[None]:
    """Hold ``asset``'s ``partition`` lock shared: no writer publishes it inside the block (one
    in the middle of its write is waited for), so its catalog record and its file read there
    are one version (what the embedding step reads of an images partition). Readers do not wait
    for each other; a data root that cannot hold a lock file is read unlocked."""
    path = lock_path(flowmatch, asset, partition)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError:  # a read-only data root: nothing writes it either
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True)
class ReadVersion:
    """The version of an upstream partition's file a step read: ``inputs`` for the fingerprint
    (``{asset: its fingerprint hash}``) and its Dagster data version (None: no record)."""

    asset: str
    partition: str
    inputs: dict[str, str]
    data_version: str | None

    def tags(self, instance: dg.DagsterInstance) -> dict[str, str]:
        """The input tags of a materialization made from it (:func:`compat.input_tags`)."""
        return compat.input_tags(instance, self.asset, self.partition, self.data_version)


def pin_version(
    flowmatch: FlowmatchResource, asset: str, partition: str
) -> Callable[[Callable[[], Any]], ReadVersion]:
    """A read-ahead's ``pin`` (flowmatch_models.embeddings.precalc.Ahead) for ``asset``'s
    ``partition``: under the partition's reader lock (:func:`reading`) its record's fingerprint
    is read and its file mapped (so they are one version whatever re-makes it after), then the
    mapped bytes' content id gives its data version (:func:`fingerprints.data_version`)."""

    def pin(open_file: Callable[[], Any]) -> ReadVersion:
        with reading(flowmatch, asset, partition):
            fp = fingerprints.stored(flowmatch, asset, partition)
            src = open_file()
        version = f"{fp.hash}-{fingerprints.content_id(src)}" if fp is not None else None
        return ReadVersion(asset, partition, {asset: hash_of(fp)}, version)

    return pin


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


def human_bytes(n: float) -> str:
    """``1139347512`` -> ``"1.06 GiB"``: a size for people, beside the exact int."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


def shards_check_result(
    parts: list[str], problems: list[str], rows_checked: int | None = None
) -> dg.AssetCheckResult:
    """A blocking shard check's verdict: passed when no shard of ``parts`` has a problem. Its
    metadata reads as a history in the UI: which partitions (a run checks its own), how many
    problems (the plot: 0 while all is well), how many rows were checked, the first 20 lines."""
    names = ", ".join(parts) if len(parts) <= 3 else f"{parts[0]} .. {parts[-1]}"
    md = {
        "partitions": names or "none",
        "partitions_checked": len(parts),
        "problem_count": len(problems),
        "problems": dg.MetadataValue.json(problems[:20]),
        # when it ran: the UI's "Latest execution" is when its run was created (Dagster records
        # a check's execution then, dagster-io/dagster#16091), before the materialization
        "evaluated_at": dg.MetadataValue.timestamp(time.time()),
    }
    if rows_checked is not None:
        md["rows_checked"] = rows_checked
    return dg.AssetCheckResult(
        passed=not problems,
        description=(
            f"{len(problems)} problems in {names}: {problems[0]}"
            if problems
            else f"{names}: every shard checked is whole"
        ),
        metadata=md,
    )


class PartitionOutput:
    """One asset partition's file and its catalog records: made, then published together (a
    context manager: see the module doc)."""

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
        self._stack: contextlib.ExitStack | None = None
        self._tx: atomic.Transaction | None = None

    def owns(self, target: Path) -> bool:
        """The partition's files: its shard, its preview, and its catalog files (named
        ``<partition>.*`` anywhere under the catalog but in another asset's folders: records,
        content hashes, ...)."""
        t = Path(os.path.abspath(target))
        layout = self.flowmatch.layout
        if t in (
            Path(os.path.abspath(self.path)),
            Path(os.path.abspath(layout.preview_path(self.asset, self.partition))),
        ):
            return True
        catalog = Path(os.path.abspath(layout.catalog_dir))
        if not (t.is_relative_to(catalog) and t.name.startswith(f"{self.partition}.")):
            return False
        others = set(PARTITIONED_ASSETS) - {self.asset}
        return not others & set(t.relative_to(catalog).parts[:-1])

    def __enter__(self) -> PartitionOutput:
        stack = contextlib.ExitStack()
        lock = lock_path(self.flowmatch, self.asset, self.partition)
        stack.enter_context(partition_lock(lock, self.context.log, self.partition, self.asset))
        if remove_stale_temps(self.path):  # safe: no other run of this partition is writing
            self.context.log.warning(
                f"{self.partition}: removed the temp files of an earlier, killed {self.asset} run"
            )
        self._tx = stack.enter_context(atomic.deferred(self.owns))
        store = remote.active(self.flowmatch.data_root)
        if store is not None:  # the remote's publish first, its marker last; then the renames
            self._tx.before(lambda files: store.publish(files, self.asset, self.partition))
        self._stack = stack
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                stack.__exit__(kind, exc, tb)  # commit (or discard) the writes, unlock
        except OSError as e:  # the commit itself failed (a full disk while renaming)
            raise self._failure(e) from e
        except remote.RemoteError as e:  # the remote could not take the publish: nothing is
            raise dg.Failure(f"{self.asset} {self.partition}: {e}; nothing was published") from None
        if isinstance(exc, OSError):
            raise self._failure(exc) from exc
        return False

    def _failure(self, e: OSError) -> dg.Failure:
        what = e.strerror or str(e) or type(e).__name__
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        return dg.Failure(
            f"{self.asset} {self.partition}: {what}{where}; nothing was published (the previous "
            "file and catalog records are unchanged)"
        )

    def written(self) -> Path:
        """The file that holds the partition's new content (until the block ends: its temp)."""
        return self._tx.path(self.path) if self._tx is not None else self.path

    def reject(self, rows: Iterable[RowOutcome]) -> None:
        """Record a rejected attempt's outcomes (``rejected_attempts``); nothing else changes:
        whatever the attempt wrote is discarded."""
        if self._tx is not None:
            self._tx.discard()
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
        tags: dict[str, str] | None = None,
        **record: object,
    ) -> dg.MaterializeResult:
        """Record rows and the materialization (``record``: the other MaterializationRecord
        fields) in the catalog and return the result with ``metadata`` and the path; with the
        ``fingerprint`` of what made it (default: the asset's current one,
        flowmatch_assets/freshness/fingerprints.py) in the record, the metadata and the data version;
        ``tags``: the materialization's (e.g. the input versions read, ``compat.input_tags``)."""
        fp = fingerprint or fingerprints.current(self.flowmatch, self.asset, self.partition)
        extra = {**dict(record.pop("extra", None) or {}), "fingerprint": fp.to_json()}  # type: ignore[call-overload]
        root = self.flowmatch.data_root
        size = self.written().stat().st_size if stored_bytes is None else stored_bytes
        catalog.record_rows(root, self.asset, self.partition, rows)
        record_materialization(
            self.context,
            self.flowmatch,
            self.asset,
            self.partition,
            samples=samples,
            raw_bytes=raw_bytes,
            stored_bytes=size,
            seconds=seconds,
            extra=extra,
            **record,
        )
        clear = lambda: catalog.clear_attempt(root, self.asset, self.partition)  # noqa: E731
        if self._tx is not None and self._tx.open:
            self._tx.after(clear)  # a rejected attempt's records go when this one is published
        else:
            clear()
        return dg.MaterializeResult(
            asset_key=self.asset,
            metadata={
                **metadata,
                **fingerprints.metadata(fp),
                "path": dg.MetadataValue.path(str(self.path)),
            },
            data_version=fingerprints.data_version(fp, self.written()),
            tags=tags,
        )


def record_materialization(
    context: dg.AssetExecutionContext,
    flowmatch: FlowmatchResource,
    asset: str,
    partition: str,
    **fields: object,
) -> None:
    """The catalog's record of one materialization (``fields``: MaterializationRecord's), with
    the id of the run it executes in: what ``publish`` and ``publish_run`` write last."""
    catalog.record_materialization(
        flowmatch.data_root,
        MaterializationRecord(asset=asset, partition=partition, run_id=run_id(context), **fields),  # type: ignore[arg-type]
    )


def publish_run(
    context: dg.AssetExecutionContext,
    flowmatch: FlowmatchResource,
    asset: str,
    run_name: str,
    *,
    metadata: dict,
    **record: object,
) -> dg.MaterializeResult:
    """``publish`` for an unpartitioned training session (flow_model, fine_tune): its
    materialization record under the run's name (the ``partition`` column, which ``flowmatch
    budget``/``stale`` and the reports read as the run), then the result with ``metadata``. The
    run folder is the training process's own (written atomically there), so nothing here is
    locked or deferred, and no fingerprint, path or data version is added: a run's inputs are
    its record's ``input_fingerprints``. With a remote data root the record is published there
    too (its marker under the run's name), so every machine's catalog and budget see the run."""
    store = remote.active(flowmatch.data_root)
    if store is None:
        record_materialization(context, flowmatch, asset, run_name, **record)
        return dg.MaterializeResult(metadata=metadata)
    catalog_dir = flowmatch.layout.catalog_dir.resolve()
    try:
        with atomic.deferred(lambda p: Path(os.path.abspath(p)).is_relative_to(catalog_dir)) as tx:
            tx.before(lambda files: store.publish(files, asset, run_name))
            record_materialization(context, flowmatch, asset, run_name, **record)
    except remote.RemoteError as e:
        raise dg.Failure(f"{asset} {run_name}: {e}; its record was not published") from None
    return dg.MaterializeResult(metadata=metadata)
