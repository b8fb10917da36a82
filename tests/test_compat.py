"""The private and storage-level Dagster APIs flowmatch uses (flowmatch_assets/compat.py), each
against a real instance: a Dagster upgrade that changes one fails here, naming it, instead of
breaking `flowmatch stale`, `verify` or the CLI's one-line errors silently."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg
import pytest

from flowmatch_assets import compat

PARTS = dg.DynamicPartitionsDefinition(name="compat_parts")


def test_the_pinned_dagster_is_the_one_compat_was_tested_with():
    major_minor = ".".join(dg.__version__.split(".")[:2])
    assert major_minor == compat.TESTED_WITH, (
        f"dagster {dg.__version__}: flowmatch_assets/compat.py was written for "
        f"{compat.TESTED_WITH}; run tests/test_compat.py, fix what fails, then bump TESTED_WITH"
    )


def test_dagster_error_type_is_dagsters_base_error():
    base = compat.dagster_error_type()
    assert issubclass(dg.DagsterInvariantViolationError, base)
    assert issubclass(dg.DagsterInvalidDefinitionError, base)
    assert not issubclass(ValueError, base)


def _eval(passed: bool, partition: str) -> dg.AssetCheckEvaluation:
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("thing"),
        check_name="thing_fresh",
        passed=passed,
        partition=partition,
        description="why",
    )


def test_check_evaluations_reported_in_a_run_twice_per_partition():
    """report_check_evaluations + check_partition_status: the second report of one
    partition's check (the reason for a run) lands, and the latest status follows it."""
    key = dg.AssetCheckKey(dg.AssetKey("thing"), "thing_fresh")
    job = ("compat_report", "compat test", "compat_report_op")
    with dg.instance_for_test() as instance:
        compat.report_check_evaluations(instance, [_eval(False, "p1"), _eval(True, "p2")], job, {})
        assert compat.check_partition_status(instance, key) == {"p1": "FAILED", "p2": "SUCCEEDED"}
        compat.report_check_evaluations(instance, [_eval(True, "p1")], job, {"k": "v"})
        assert compat.check_partition_status(instance, key)["p1"] == "SUCCEEDED"
        runs = instance.get_runs(dg.RunsFilter(job_name="compat_report"))
        assert len(runs) == 2 and runs[0].tags.get("k") == "v"


@pytest.mark.parametrize("partition", ["p1"])
def test_a_failed_stand_in_makes_the_latest_attempt_failed(partition):
    """record_failed_materialization + failed_latest_attempts: a materialized partition's
    latest attempt becomes a failure (what verify relies on), the others stay as they were."""

    @dg.asset(key="thing", partitions_def=PARTS)
    def thing() -> None:
        return None

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(PARTS.name, ["p1", "p2"])
        for p in ("p1", "p2"):
            assert dg.materialize([thing], partition_key=p, instance=instance).success
        assert compat.failed_latest_attempts(instance, "thing") == set()
        compat.record_failed_materialization(
            instance, "thing", PARTS, partition, "gone", {"flowmatch/cli": "verify"}
        )
        assert compat.failed_latest_attempts(instance, "thing") == {partition}
        assert set(instance.get_materialized_partitions(dg.AssetKey("thing"))) == {"p1", "p2"}
        run = instance.get_runs(dg.RunsFilter(tags={"flowmatch/cli": "verify"}))[0]
        assert run.status == dg.DagsterRunStatus.FAILURE


def test_a_runs_check_status_follows_its_latest_report():
    """check_status: the latest evaluation of a non-partitioned check (flow_model_fresh,
    fine_tune_fresh as `flowmatch stale` reports them), reported twice in runs."""
    key = dg.AssetCheckKey(dg.AssetKey("model"), "model_fresh")
    job = ("compat_report_model", "compat test", "compat_report_model_op")

    def ev(passed: bool) -> dg.AssetCheckEvaluation:
        return dg.AssetCheckEvaluation(
            asset_key=key.asset_key, check_name=key.name, passed=passed, description="why"
        )

    with dg.instance_for_test() as instance:
        assert compat.check_status(instance, key) is None
        compat.report_check_evaluations(instance, [ev(False)], job, {})
        assert compat.check_status(instance, key) == "FAILED"
        compat.report_check_evaluations(instance, [ev(True)], job, {})
        assert compat.check_status(instance, key) == "SUCCEEDED"


def test_partition_materialization_tags_version_an_input_as_dagster_does():
    """compat.partition_materialization_tags: the input partition's data version hashed as
    Dagster hashes a partitioned input's (tests/test_embedding_assets.py compares a whole
    multi-partition run's materializations with one-partition runs')."""
    import hashlib

    @dg.asset(partitions_def=PARTS)
    def up() -> dg.MaterializeResult:
        return dg.MaterializeResult(data_version=dg.DataVersion("v-1"))

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("compat_parts", ["a"])
        assert dg.materialize([up], instance=instance, partition_key="a").success
        tags = compat.partition_materialization_tags(
            instance, dg.DataVersion("mine"), "7", [("up", "a")]
        )
        never = compat.partition_materialization_tags(
            instance, dg.DataVersion("x"), "7", [("up", "b")]
        )
        ev = instance.fetch_materializations(dg.AssetKey("up"), limit=1).records[0]
    assert tags["dagster/data_version"] == "mine" and tags["dagster/code_version"] == "7"
    assert tags["dagster/input_data_version/up"] == hashlib.sha256(b"v-1").hexdigest()
    assert tags["dagster/input_event_pointer/up"] == str(ev.storage_id)
    assert never["dagster/input_data_version/up"] == "INITIAL"  # no materialization of b


def test_console_silenced_drops_the_console_but_keeps_the_stored_log(capfd):
    """A run inside ``console_silenced`` prints none of Dagster's console lines, with no logger
    in its run config, and its stored log still has the op's INFO line; outside, it prints."""

    @dg.op
    def say(context) -> None:
        context.log.info("hello from the op")

    @dg.job
    def talk() -> None:
        say()

    with dg.DagsterInstance.ephemeral() as instance:
        with compat.console_silenced():
            quiet = talk.execute_in_process(instance=instance)
        assert "hello from the op" not in capfd.readouterr().err
        logs = [r.user_message for r in instance.all_logs(quiet.run_id) if not r.is_dagster_event]
        assert "hello from the op" in logs and quiet.dagster_run.run_config == {}
        talk.execute_in_process(instance=instance)
        assert "hello from the op" in capfd.readouterr().err


def test_a_code_location_run_carries_its_origin_and_the_jobs_snapshot(tmp_path, monkeypatch):
    """``execute_code_location_run`` (the CLI's runs) records the run as the webserver would:
    the workspace's location as its origin, the job's own snapshot as its parent."""
    from flowmatch_assets.definitions import defs
    from flowmatch_assets.runs import WORKSPACE

    monkeypatch.setenv("FLOWMATCH_DATA_ROOT", str(tmp_path / "data"))
    with dg.DagsterInstance.ephemeral() as instance:
        result = compat.execute_code_location_run(
            str(WORKSPACE), "reports_job", [dg.AssetKey("budget_report")], {}, {}, instance
        )
        assert result.success
        run = instance.get_run_by_id(result.run_id)
        origin = run.remote_job_origin
        assert origin.location_name == "flowmatch_assets.definitions:defs"
        assert origin.repository_origin.repository_name == "__repository__"
        snap = instance.get_job_snapshot(run.job_snapshot_id)
        parent = defs.resolve_job_def("reports_job").get_job_snapshot_id()
        assert snap.lineage_snapshot.parent_snapshot_id == parent


def test_log_mirrors_apart_start_dagsters_tail_in_a_group_of_its_own(tmp_path):
    """A Ctrl-C in the terminal (SIGINT to the foreground group) must not reach the processes
    that mirror a step's compute log: the tail and its orphan watcher run in their own process
    group inside the block (and are ended after it); outside it Dagster's own function is back."""
    from dagster._core.execution import compute_logs

    from flowmatch_assets import compat

    real = compute_logs.execute_posix_tail
    log = tmp_path / "step.log"
    log.write_text("a line\n")
    with open(tmp_path / "mirror.txt", "w") as out, compat.log_mirrors_apart():
        assert compute_logs.execute_posix_tail is not real
        with compute_logs.execute_posix_tail(str(log), out) as (tail, watcher):
            for pid in (tail, watcher):
                assert os.getpgid(pid) == pid != os.getpgid(0)
        for pid in (tail, watcher):  # ended (and reaped) with the block
            assert not os.path.exists(f"/proc/{pid}")
    assert compute_logs.execute_posix_tail is real


def test_log_mirrors_end_even_when_sigterm_was_ignored_before_them(tmp_path):
    """A process that ignores SIGTERM passes that on to the tail it starts (Lightning ignores
    SIGINT after a Ctrl-C and never restores it): the mirror still ends within seconds."""
    import signal

    from dagster._core.execution import compute_logs

    from flowmatch_assets import compat

    log = tmp_path / "step.log"
    log.write_text("a line\n")
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with open(tmp_path / "mirror.txt", "w") as out, compat.log_mirrors_apart():
            t0 = time.monotonic()
            with compute_logs.execute_posix_tail(str(log), out) as (tail, watcher):
                ignored = int(_status(tail)["SigIgn"], 16)
                assert ignored & (1 << (signal.SIGTERM - 1)), "the tail should inherit it"
                t0 = time.monotonic()
            assert time.monotonic() - t0 < 10
            for pid in (tail, watcher):
                assert not os.path.exists(f"/proc/{pid}")
    finally:
        signal.signal(signal.SIGTERM, before)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def test_run_launcher_api_has_what_the_celery_launcher_overrides():
    from dagster_celery.launcher import CeleryRunLauncher

    from flowmatch_assets.compat import run_launcher_api

    launch_ctx, health, status = run_launcher_api()
    assert {"RUNNING", "FAILED", "SUCCESS", "UNKNOWN"} <= {s.name for s in status}
    r = health(status.FAILED, "gone")
    assert (r.status, r.msg) == (status.FAILED, "gone"), "compat.run_launcher_api changed"
    assert set(launch_ctx._fields) >= {"dagster_run", "workspace"}, "compat.run_launcher_api"
    for name in ("launch_run", "check_run_worker_health", "get_run_worker_debug_info"):
        assert callable(getattr(CeleryRunLauncher, name)), name
    assert CeleryRunLauncher.supports_check_run_worker_health.fget(None) is True
