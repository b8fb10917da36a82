"""Every use of a Dagster API that is private or storage-level, in one place.

Dagster is pinned (``dagster>=1.13,<1.14``); these are the calls an upgrade may break without a
deprecation warning. Each has a test in ``tests/test_compat.py`` that exercises it against a
real instance and fails loudly, naming the function here, on the version where it stops
working. Nothing else in flowmatch imports ``dagster._*`` or reaches into ``instance.*_storage``.
"""

# (no ``from __future__ import annotations``: Dagster reads the op's context hint as a type)
import contextlib
import hashlib
import os
import time
from collections.abc import Iterator, Sequence

import dagster as dg

#: The Dagster minor version the functions below were written and tested against.
TESTED_WITH = "1.13"


def dagster_error_type() -> type[BaseException]:
    """Dagster's base error class (``dagster._core.errors.DagsterError``): the CLI prints one
    of these as one line instead of a traceback."""
    from dagster._core.errors import DagsterError

    return DagsterError


@contextlib.contextmanager
def one_sqlite_transaction(instance: dg.DagsterInstance) -> Iterator[None]:
    """Inside the block, the event log's writes to each sqlite file go through one connection
    and commit together when it ends (rolled back if it raises). Dagster's sqlite event storage
    opens an engine and a connection for every statement, and another to ask whether a table
    exists (seven per check evaluation, most of its ~9-13 ms). Other event storages (Postgres)
    are left as they are. Private: ``SqliteEventLogStorage._connect``, ``has_table``,
    ``conn_string_for_shard`` and ``_initdb``."""
    from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
        SQLITE_BUSY_TIMEOUT_SECONDS,
        SqliteEventLogStorage,
    )
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    storage = instance.event_log_storage
    if not isinstance(storage, SqliteEventLogStorage) or "_connect" in vars(storage):
        yield  # another storage, or inside such a block already: its transaction
        return
    open_: dict[str, tuple] = {}

    @contextlib.contextmanager
    def connect(shard: str):
        if shard not in open_:
            engine = create_engine(
                storage.conn_string_for_shard(shard),
                poolclass=NullPool,
                connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS},
            )
            if shard not in storage._initialized_dbs:  # noqa: SLF001
                storage._initdb(engine)  # noqa: SLF001
                storage._initialized_dbs.add(shard)  # noqa: SLF001
            conn = engine.connect()
            open_[shard] = (engine, conn, conn.begin())
        yield open_[shard][1]

    tables: dict[str, bool] = {}
    has_table = storage.has_table

    def has_table_once(name: str) -> bool:  # asked once per event otherwise (a new engine each)
        if name not in tables:
            tables[name] = has_table(name)
        return tables[name]

    storage._connect = connect  # noqa: SLF001 - the instance attribute shadows the method
    storage.has_table = has_table_once
    ok = False
    try:
        yield
        ok = True
    finally:
        del storage._connect  # noqa: SLF001
        del storage.has_table
        for engine, conn, tx in open_.values():
            try:
                tx.commit() if ok else tx.rollback()
            finally:
                conn.close()
                engine.dispose()


def report_check_evaluations(
    instance: dg.DagsterInstance,
    evaluations: Sequence[dg.AssetCheckEvaluation],
    job: tuple[str, str, str],
    tags: dict,
    run_config: dict | None = None,
) -> None:
    """Record ``evaluations`` (partitioned check evaluations) in one run of a one-op job,
    ``job`` = (job name, its description, the op's name).

    Why a run: Dagster 1.13 keys check executions by (check, run id, partition), so a second
    runless evaluation (``report_runless_asset_event``) of one partition's check fails its
    UNIQUE constraint. Private: ``dagster._core.events.DagsterEvent`` reported by hand."""
    from dagster._core.events import DagsterEvent, DagsterEventType

    job_name, description, op_name = job

    @dg.op(name=op_name)
    def _report(context: dg.OpExecutionContext) -> None:
        # a transaction per 200 (~0.3 s of the index's write lock: the daemon and running
        # backfills write there too, and wait at most Dagster's 30 s busy timeout)
        for i in range(0, len(evaluations), 200):
            with one_sqlite_transaction(context.instance):
                for ev in evaluations[i : i + 200]:
                    context.instance.report_dagster_event(
                        DagsterEvent(
                            event_type_value=DagsterEventType.ASSET_CHECK_EVALUATION.value,
                            job_name=context.job_name,
                            event_specific_data=ev,
                        ),
                        run_id=context.run_id,
                    )
        context.log.info(f"{len(evaluations)} check results reported")

    @dg.job(name=job_name, description=description)
    def _job() -> None:
        _report()

    _job.execute_in_process(instance=instance, tags=tags, run_config=run_config)


def record_failed_materialization(
    instance: dg.DagsterInstance,
    asset: str,
    partitions_def: dg.PartitionsDefinition,
    partition: str,
    message: str,
    tags: dict,
    run_config: dict | None = None,
) -> None:
    """Make Dagster's latest attempt of ``asset``'s ``partition`` a failure (the UI shows it as
    Failed, no longer Materialized), by materializing a stand-in asset with the real key and
    partitions that only fails with ``message``. Open-source Dagster 1.13 cannot wipe one
    partition (``wipe_asset_partitions`` raises NotImplementedError on its SQL storages); this
    relies on the latest-attempt bookkeeping below."""

    @dg.asset(key=asset, partitions_def=partitions_def, name=None)
    def _stand_in() -> None:
        raise dg.Failure(message)

    dg.materialize(
        [_stand_in],
        partition_key=partition,
        instance=instance,
        raise_on_error=False,
        tags=tags,
        run_config=run_config or {},
    )


def failed_latest_attempts(instance: dg.DagsterInstance, asset: str) -> set[str]:
    """Partitions of ``asset`` whose latest materialization attempt did not materialize it
    (failed or still running). Storage-level: ``event_log_storage``."""
    storage = instance.event_log_storage
    return set(
        storage.get_latest_asset_partition_materialization_attempts_without_materializations(
            dg.AssetKey(asset)
        )
    )


def check_status(instance: dg.DagsterInstance, key: dg.AssetCheckKey) -> str | None:
    """The latest evaluation of a (non-partitioned) check: SUCCEEDED, FAILED, ... or None.
    Storage-level: ``event_log_storage.get_latest_asset_check_execution_by_key``."""
    rec = instance.event_log_storage.get_latest_asset_check_execution_by_key([key]).get(key)
    if rec is None:
        return None
    ev = rec.evaluation
    if ev is not None:  # the record's status is the run's; the evaluation says pass or fail
        return "SUCCEEDED" if ev.passed else "FAILED"
    return rec.status.value


def check_partition_status(instance: dg.DagsterInstance, key: dg.AssetCheckKey) -> dict[str, str]:
    """``{partition: SUCCEEDED | FAILED | ...}``: the latest evaluation of a partitioned check.
    Storage-level: ``event_log_storage.get_asset_check_partition_info``."""
    return {
        i.partition_key: i.latest_execution_status.value
        for i in instance.event_log_storage.get_asset_check_partition_info([key])
    }


def partition_materialization_tags(
    instance: dg.DagsterInstance,
    data_version: dg.DataVersion,
    code_version: str,
    inputs: Sequence[tuple[str, str]],
) -> dict[str, str]:
    """The data-version tags Dagster puts on an output's materialization (code version, data
    version given by the asset, and each input partition's data version and event pointer), for
    an ``AssetMaterialization`` of one partition logged by a step that runs many (a
    multi-partition run reports each partition it published on its own). ``inputs``: ``(asset,
    partition)`` read (its latest materialization). Private:
    ``dagster._core.definitions.data_version``."""
    from dagster._core.definitions.data_version import (
        CODE_VERSION_TAG,
        DATA_VERSION_IS_USER_PROVIDED_TAG,
        DATA_VERSION_TAG,
    )

    tags = {
        CODE_VERSION_TAG: code_version,
        DATA_VERSION_TAG: data_version.value,
        DATA_VERSION_IS_USER_PROVIDED_TAG: "true",
    }
    for asset, partition in inputs:
        tags.update(input_tags(instance, asset, partition))
    return tags


def input_tags(
    instance: dg.DagsterInstance, asset: str, partition: str, version: str | None = None
) -> dict[str, str]:
    """The input data version and event pointer tags of one input partition read: the
    ``version`` given (the data version of the file version actually read) and the latest of its
    materializations that recorded it; without ``version``, the latest materialization's.
    Dagster's own are taken when the output is handled, from whatever materialization is latest
    then (a partition re-made during the step would be named though its old file was read):
    these override them (``MaterializeResult(tags=...)``). Private:
    ``dagster._core.definitions.data_version``."""
    from dagster._core.definitions.data_version import (
        DATA_VERSION_TAG,
        NULL_EVENT_POINTER,
        get_input_data_version_tag,
        get_input_event_pointer_tag,
    )

    key = dg.AssetKey(asset)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]),
        limit=1 if version is None else 20,
    ).records

    def version_of(r) -> str | None:
        m = r.asset_materialization
        return (m.tags or {}).get(DATA_VERSION_TAG) if m is not None else None

    event = next((r for r in records if version is None or version_of(r) == version), None)
    if event is None and records:  # recorded long ago, or outside Dagster: the latest's place
        event = records[0]
    if version is None and event is not None:
        version = version_of(event)
    # as Dagster versions a partitioned input: sha256 over its partitions' data versions
    # (dagster._core.execution.context.data_version_cache), here the one partition read
    return {
        get_input_data_version_tag(key): (
            hashlib.sha256(version.encode()).hexdigest() if version else "INITIAL"
        ),
        get_input_event_pointer_tag(key): (
            str(event.storage_id) if event is not None else NULL_EVENT_POINTER
        ),
    }


def execute_code_location_run(
    workspace_yaml: str,
    job_name: str,
    asset_selection: Sequence[dg.AssetKey],
    run_config: dict,
    tags: dict,
    instance: dg.DagsterInstance,
    raise_on_error: bool = False,
):
    """Run the code location's job ``job_name`` (the ``Definitions`` that ``workspace_yaml``
    loads, imported in this process) for ``asset_selection``, in this process, recorded as the
    webserver records a run it launches: with the code location's origin (the UI lists it on the
    Timeline, under its job, on the job's Runs tab; Dagster tags it ``.dagster/repository``) and
    the job's own snapshot (re-executing it from the UI raises no "may be a different version"
    warning). ``execute_in_process`` records neither. Returns Dagster's result (``.success``,
    ``.all_events``). Private: ``dagster._core.workspace.load.location_origins_from_yaml_paths``,
    ``dagster._core.remote_origin``, ``ReconstructableRepository`` and ``execute_run``."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.definitions.repository_definition.valid_definitions import (
        SINGLETON_REPOSITORY_NAME,
    )
    from dagster._core.execution.api import execute_run
    from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.workspace.load import location_origins_from_yaml_paths

    (origin,) = location_origins_from_yaml_paths([workspace_yaml])
    target = origin.loadable_target_origin
    repo = ReconstructableRepository.for_module(
        target.module_name, target.attribute, target.working_directory or os.getcwd()
    )
    recon = repo.get_reconstructable_job(job_name)
    job = recon.get_definition()
    selection = frozenset(asset_selection)
    run = instance.create_run_for_job(
        job_def=job,
        run_config=run_config,
        tags=tags,
        asset_selection=selection,
        remote_job_origin=RemoteJobOrigin(
            RemoteRepositoryOrigin(origin, SINGLETON_REPOSITORY_NAME), job_name
        ),
        job_code_origin=recon.get_python_origin(),
    )
    return execute_run(recon.get_subset(asset_selection=selection), run, instance, raise_on_error)


@contextlib.contextmanager
def console_silenced() -> Iterator[None]:
    """Inside the block, the console logger of Dagster runs executed in this process prints
    nothing (their event log is stored as always): the CLI's quiet terminal without a
    ``loggers`` entry in the run's config, which a re-execution from the UI would inherit.
    Dagster makes that logger per run as ``logging.getLoggerClass()("dagster", level)`` with a
    stderr handler (``dagster._utils.log.create_console_logger``); the class set here drops every
    record of a logger so named made inside the block."""
    import logging

    base = logging.getLoggerClass()

    class _Silenced(base):  # type: ignore[valid-type, misc]
        def __init__(self, name: str, level: int | str = 0) -> None:
            super().__init__(name, level)
            if name == "dagster":
                self.addFilter(lambda _record: False)

    logging.setLoggerClass(_Silenced)
    try:
        yield
    finally:
        logging.setLoggerClass(base)


@contextlib.contextmanager
def log_mirrors_apart() -> Iterator[None]:
    """Inside the block, the processes Dagster starts to mirror a step's compute log to this
    terminal (``tail -F`` and its orphan watcher) run in a process group of their own: a Ctrl-C
    in the terminal (SIGINT to the foreground group) no longer kills the tail (what the training
    process says while it saves its state was lost) nor prints the watcher's KeyboardInterrupt
    traceback. The watcher still ends the tail when this process dies. Private:
    ``dagster._core.execution.compute_logs.execute_posix_tail`` (replaced by a copy of it that
    passes ``process_group=0``)."""
    import subprocess
    import sys

    from dagster._core.execution import compute_logs

    real = compute_logs.execute_posix_tail

    @contextlib.contextmanager
    def apart(path, stream):
        stream = stream if compute_logs._fileno(stream) else None
        tail = watcher = None
        try:
            tail = subprocess.Popen(
                ["tail", "-F", "-c", "+0", path], stdout=stream, process_group=0
            )
            watcher = subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(compute_logs.watch_orphans.__file__),
                    str(os.getpid()),
                    str(tail.pid),
                ],
                process_group=0,
            )
            yield (tail.pid, watcher.pid)
        finally:
            time.sleep(float(os.getenv("DAGSTER_COMPUTE_LOG_TAIL_WAIT_AFTER_FINISH", "0")))
            for proc in (tail, watcher):
                _end(proc)

    compute_logs.execute_posix_tail = apart
    try:
        yield
    finally:
        compute_logs.execute_posix_tail = real


def _end(proc, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds: a process that inherited SIGTERM ignored
    (Dagster's own clean-up waits 30 s and then raises) still ends, and is reaped."""
    import subprocess

    if proc is None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except OSError:
        pass


def run_launcher_api() -> tuple[type, type, type]:
    """``(LaunchRunContext, CheckRunHealthResult, WorkerStatus)`` of ``dagster._core.launcher``:
    the extension points a run launcher overrides (every launcher package, dagster-celery's
    included, imports them from there). flowmatch's Celery launcher
    (defs/celery_launcher.py) routes runs to queues and reports dead workers with them."""
    from dagster._core.launcher import CheckRunHealthResult, LaunchRunContext, WorkerStatus

    return LaunchRunContext, CheckRunHealthResult, WorkerStatus
