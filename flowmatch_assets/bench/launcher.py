"""`flowmatch bench launcher`: what running on Celery workers costs a run, and how long a
PD12M-size backfill takes to queue (issue 46).

Two real deployments on loopback, one after the other, each with its own PostgreSQL (runs and
events) and `dagster dev` (webserver + daemon), on the same PD12M-format metadata of
``--partitions`` one-row shards:

- **default**: deploy/dagster.postgres.yaml, Dagster's default run launcher (a new process per
  run, which imports the code location);
- **celery**: deploy/dagster.celery.yaml, flowmatch's Celery run launcher with Redis and one
  worker (``dagster-celery worker start ... -c 1``), which keeps the code imported.

For each, ``--runs`` one-partition runs of metadata + images one after another: a run's
overhead is its wall time from creation to end minus the compute its assets recorded in the
catalog. Then, on the Celery deployment with its worker stopped, a backfill of the metadata of
every partition (one run per partition) is launched through GraphQL as the UI does, and the
time until its last run exists (queued) is measured, then it is cancelled.

Ends with one JSON line (BENCHMARKS.md "Many machines: the Celery launcher").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

from flowmatch_assets.bench.orchestration import (
    CANCEL,
    RUN_TIMES,
    launch_run,
    wait_run,
    write_metadata,
)
from flowmatch_assets.bench.postgres_server import postgres_server
from flowmatch_assets.bench.redis_server import redis_server
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import REPO, dagster_dev, stop_group
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.freshness import backfill


def _worker(home: Path, env: dict, log: Path) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "dagster-celery"), "worker", "start"]
    cmd += ["-A", "dagster_celery.app", "-n", "bench", "-q", "cpu,gpu"]
    cmd += ["-y", str(REPO / "deploy" / "celery-worker.yaml"), "--", "-c", "1"]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # its `celery`
    full = {**os.environ, **env, "DAGSTER_HOME": str(home), "PATH": path}
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, env=full, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _run_overheads(url: str, data: Path, keys: list[str]) -> list[float]:
    out = []
    for key in keys:
        run_id = launch_run(url, ["metadata", "images"], {}, tags={"dagster/partition": key})
        status = wait_run(url, run_id, timeout=120, poll=0.2)
        if status != "SUCCESS":
            raise RuntimeError(f"run {run_id} of {key}: {status}")
        t = backfill.graphql(url, RUN_TIMES, {"runId": run_id})["runOrError"]
        compute = sum(
            r["seconds"]
            for r in Catalog(data).query(
                "SELECT seconds FROM materializations WHERE partition = ?", [key]
            )
        )
        out.append(t["endTime"] - t["creationTime"] - compute)
        print(f"  run of {key}: overhead {out[-1]:.2f}s (compute {compute:.2f}s)", flush=True)
    return out


def _queue_time(url: str, home: Path, keys: list[str], timeout: float) -> dict:
    """Launch a backfill of metadata over ``keys``; seconds until its last run exists."""
    t0 = time.monotonic()
    bid = backfill.launch_backfill(url, keys, ["metadata"], title="bench launcher")
    launch_s = time.monotonic() - t0
    seen, last_print = 0, 0.0
    with dg.DagsterInstance.from_config(str(home)) as instance:
        flt = dg.RunsFilter(tags={"dagster/backfill": bid})
        while time.monotonic() - t0 < timeout:
            seen = instance.get_runs_count(filters=flt)
            if seen >= len(keys):
                break
            if time.monotonic() - last_print > 30:
                print(f"  {seen} runs queued after {time.monotonic() - t0:.0f}s", flush=True)
                last_print = time.monotonic()
            time.sleep(1)
        queued_s = time.monotonic() - t0
        launched = sum(
            instance.get_runs_count(filters=dg.RunsFilter(tags=flt.tags, statuses=[s]))
            for s in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
        )
    backfill.graphql(url, CANCEL, {"id": bid})
    return {
        "runs": seen,
        "launch_s": round(launch_s, 2),
        "all_queued_s": round(queued_s, 1) if seen >= len(keys) else None,
        "runs_per_s": round(seen / queued_s, 2),
        "sent_to_broker": launched,
    }


def _deployment(kind: str, tmp: Path, md_dir: Path, a) -> dict:
    print(f"{kind}:", flush=True)
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(postgres_server())
        env = {
            "DAGSTER_PG_URL": f"postgresql+psycopg2://{pg.user}@{pg.host}:{pg.port}/{pg.db}",
            "FLOWMATCH_DATA_ROOT": str(tmp / kind / "data"),
            "FLOWMATCH_METADATA": str(md_dir),
            "FLOWMATCH_FILE_ROOT": str(tmp / "src"),
            "FLOWMATCH_SHARD_SIZE": "1",
        }
        yaml = "dagster.celery.yaml" if kind == "celery" else "dagster.postgres.yaml"
        if kind == "celery":
            env["FLOWMATCH_BROKER"] = stack.enter_context(redis_server(tmp / "redis"))
        home = tmp / kind / "home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text((REPO / "deploy" / yaml).read_text())
        os.environ.update(env)  # the instance config reads DAGSTER_PG_URL
        res = FlowmatchResource(data_root=env["FLOWMATCH_DATA_ROOT"], metadata_source=str(md_dir))
        with dg.DagsterInstance.from_config(str(home)) as instance:
            keys = sorted(register_partitions(instance, res.model_copy(update={"shard_size": 1})))
        worker = _worker(home, env, tmp / "worker.log") if kind == "celery" else None
        try:
            dev = stack.enter_context(dagster_dev(home, env, tmp / kind / "dev.log"))
            overheads = _run_overheads(dev.url, tmp / kind / "data", keys[: a.runs])
            out = {
                "first_run_overhead_s": round(overheads[0], 2),
                "run_overhead_median_s": round(statistics.median(overheads[1:] or overheads), 2),
            }
            if kind == "celery" and a.partitions:
                stop_group(worker, grace=10)  # nothing executes: only the queueing is measured
                out["backfill"] = _queue_time(dev.url, home, keys[: a.partitions], a.timeout)
        except Exception:
            if worker is not None:
                print((tmp / "worker.log").read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
        finally:
            if worker is not None:
                stop_group(worker, grace=10)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench launcher", description=__doc__.split("\n")[0])
    p.add_argument("--partitions", type=int, default=1240, help="the backfill's (0: skip it)")
    p.add_argument("--runs", type=int, default=6, help="one-partition runs timed per launcher")
    p.add_argument("--timeout", type=float, default=3600, help="for the backfill to queue")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flowmatch-bench-launcher-") as tmp:
        tmp = Path(tmp)
        md_dir, _ = write_metadata(tmp / "src", max(a.partitions, a.runs))
        result = {"bench": "launcher", "partitions": a.partitions, "runs": a.runs}
        for kind in ("default", "celery"):
            result[kind] = _deployment(kind, tmp, md_dir, a)
    d, c = result["default"], result["celery"]
    result["celery_added_s_per_run"] = round(
        c["run_overhead_median_s"] - d["run_overhead_median_s"], 2
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
