"""`flowmatch bench orchestration`: Dagster's cost at PD12M's scale of ~1,240 partitions.

In a real instance (sqlite DAGSTER_HOME, `dagster dev` running on loopback) with 1,240
registered partitions, measure:

- the time to find the missing partitions of one asset and to launch a missing-only backfill
  over all of them (the GraphQL ``launchPartitionBackfill`` round trip; then cancelled),
- the asset page's partition-status query (GraphQL ``assetPartitionStatuses`` over 1,240 keys),
- the per-partition overhead of a run: a tiny (1-row) partition's run, wall time from
  creation to end minus the compute its assets recorded in the catalog, as a fraction of the
  time a 10,000-image partition takes (from an assumed images/s, printed with the result).

Targets: launch <= 10 s, status query <= 2 s, overhead <= 5% of a 10k-image partition.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import dagster_dev, make_dagster_home
from flowmatch_assets.defs.partitions import register_partitions
from flowmatch_assets.defs.resources import FlowmatchResource
from flowmatch_assets.demo.dataset import draw_image
from flowmatch_assets.freshness import backfill

CANCEL = """
mutation Cancel($id: String!) {
  cancelPartitionBackfill(backfillId: $id) { __typename ... on PythonError { message } }
}
"""
RUN_TIMES = """
query RunTimes($runId: ID!) {
  runOrError(runId: $runId) { ... on Run { status creationTime startTime endTime } }
}
"""


REPOS = """
query Repos {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection { nodes { name location { name } } }
    ... on PythonError { message }
  }
}
"""

LAUNCH_RUN = """
mutation LaunchRun($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on PythonError { message }
    ... on Error { message }
  }
}
"""

RUN_STATUS = """
query RunStatus($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId status }
    ... on PythonError { message }
  }
}
"""

RUN_DONE = {"SUCCESS", "FAILURE", "CANCELED"}

#: What the UI's "Terminate" button sends (SAFE_TERMINATE: the run worker is interrupted and its
#: steps may clean up; training saves a full state through Pipes).
TERMINATE_RUN = """
mutation Terminate($runId: String!) {
  terminateRun(runId: $runId, terminatePolicy: SAFE_TERMINATE) {
    __typename
    ... on TerminateRunFailure { message }
    ... on PythonError { message }
  }
}
"""

#: A run as the UI's run page and Timeline read it.
RUN_DETAILS = """
query RunDetails($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run {
      runId status jobName startTime endTime pipelineSnapshotId parentPipelineSnapshotId
      repositoryOrigin { repositoryName repositoryLocationName }
      tags { key value }
    }
  }
}
"""


JOB_SNAPSHOT = """
query JobSnapshot($selector: PipelineSelector!) {
  pipelineOrError(params: $selector) {
    __typename
    ... on Pipeline { pipelineSnapshotId }
  }
}
"""


def job_snapshot_id(url: str, job: str) -> str:
    """The snapshot id of ``job`` as the webserver's code location holds it now."""
    repo = backfill.graphql(url, REPOS)["repositoriesOrError"]["nodes"][0]
    selector = {
        "repositoryLocationName": repo["location"]["name"],
        "repositoryName": repo["name"],
        "pipelineName": job,
    }
    return backfill.graphql(url, JOB_SNAPSHOT, {"selector": selector})["pipelineOrError"][
        "pipelineSnapshotId"
    ]


def terminate_run(url: str, run_id: str) -> None:
    """Terminate a run as the UI's Terminate button does (GraphQL ``terminateRun``)."""
    res = backfill.graphql(url, TERMINATE_RUN, {"runId": run_id})["terminateRun"]
    if res["__typename"] != "TerminateRunSuccess":
        raise backfill.BackfillError(f"terminateRun failed ({res['__typename']}): {res}")


def run_details(url: str, run_id: str) -> dict:
    """The run's status, job, times, snapshot ids, origin and tags (``{key: value}``)."""
    run = backfill.graphql(url, RUN_DETAILS, {"runId": run_id})["runOrError"]
    run["tags"] = {t["key"]: t["value"] for t in run.get("tags", [])}
    return run


def launch_run(
    url: str,
    asset_keys: Sequence[str],
    run_config: dict | None = None,
    tags: dict | None = None,
    job: str = "__ASSET_JOB",
    partition: str | None = None,
) -> str:
    """Launch one run of ``job`` (default Dagster's own asset job, as the UI's Materialize
    button) materializing ``asset_keys`` (of ``partition``, or unpartitioned, e.g. flow_model)
    with launchpad ``run_config``, through the webserver's GraphQL ``launchRun``; returns the
    run id."""
    repos = backfill.graphql(url, REPOS)["repositoriesOrError"]
    if repos["__typename"] != "RepositoryConnection" or not repos["nodes"]:
        raise backfill.BackfillError(f"no code location loaded at {url}: {repos}")
    repo = repos["nodes"][0]
    params = {
        "selector": {
            "repositoryLocationName": repo["location"]["name"],
            "repositoryName": repo["name"],
            "jobName": job,
            "assetSelection": [backfill.key_input(a) for a in asset_keys],
        },
        "runConfigData": run_config or {},
        "mode": "default",
        "executionMetadata": {
            "tags": [{"key": k, "value": v} for k, v in (tags or {"flowmatch/cli": "run"}).items()]
        },
    }
    if partition is not None:
        params["executionMetadata"]["tags"].append({"key": "dagster/partition", "value": partition})
    res = backfill.graphql(url, LAUNCH_RUN, {"params": params})["launchRun"]
    if res["__typename"] != "LaunchRunSuccess":
        detail = res.get("message") or "; ".join(e["message"] for e in res.get("errors", []))
        raise backfill.BackfillError(f"launchRun failed ({res['__typename']}): {detail}")
    return res["run"]["runId"]


def wait_run(url: str, run_id: str, timeout: float = 3600, poll: float = 3.0) -> str:
    """Poll a run until it ends; returns its final status (SUCCESS, FAILURE or CANCELED)."""
    deadline = time.monotonic() + timeout
    status = "UNKNOWN"
    while time.monotonic() < deadline:
        try:
            r = backfill.graphql(url, RUN_STATUS, {"runId": run_id})["runOrError"]
            status = r.get("status", r["__typename"])
        except backfill.BackfillError:
            pass  # a busy webserver; try again
        if status in RUN_DONE:
            return status
        time.sleep(poll)
    raise TimeoutError(f"run {run_id} still {status} after {timeout:.0f}s")


def write_metadata(root: Path, partitions: int, rows_per_file: int = 10) -> tuple[Path, Path]:
    """PD12M-format metadata giving ``partitions`` one-row shards; every row is one real JPEG."""
    img_dir, md_dir = root / "images", root / "metadata"
    img_dir.mkdir(parents=True)
    md_dir.mkdir(parents=True)
    im, caption = draw_image(np.random.default_rng(0))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    img = img_dir / "one.jpg"
    img.write_bytes(buf.getvalue())
    n = 0
    for f in range(-(-partitions // rows_per_file)):
        rows = []
        for _ in range(min(rows_per_file, partitions - n)):
            rows.append(
                {
                    "id": f"bench-{n:06d}",
                    "url": img.as_uri(),
                    "caption": caption,
                    "width": im.size[0],
                    "height": im.size[1],
                    "mime_type": "image/jpeg",
                    "hash": f"h{n}",
                    "license": "cc0-1.0",
                    "source": "bench",
                }
            )
            n += 1
        pq.write_table(pa.Table.from_pylist(rows), md_dir / f"pd12m.{f:03d}.parquet")
    return md_dir, root


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="flowmatch bench orchestration", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--partitions", type=int, default=1240)
    p.add_argument("--asset", default="metadata", help="asset of the missing-only backfill")
    p.add_argument("--status-asset", default="images")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--images-per-s",
        type=float,
        default=216.0,
        help="assumed image-stage rate of one partition (BENCHMARKS.md: ~108 images per "
        "CPU-second per core x 2 cores)",
    )
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="flowmatch-bench-orch-") as tmp:
        tmp = Path(tmp)
        md_dir, file_root = write_metadata(tmp / "src", a.partitions)
        data = tmp / "data"
        home = make_dagster_home(tmp / "home")
        res = FlowmatchResource(data_root=str(data), metadata_source=str(md_dir), shard_size=1)
        with dg.DagsterInstance.from_config(str(home)) as instance:
            keys, register_s = _timed(register_partitions, instance, res)
        keys = sorted(keys)
        print(f"registered {len(keys)} partitions in {register_s:.2f}s")
        env = {
            "FLOWMATCH_DATA_ROOT": str(data),
            "FLOWMATCH_METADATA": str(md_dir),
            "FLOWMATCH_FILE_ROOT": str(file_root),
            "FLOWMATCH_SHARD_SIZE": "1",
        }
        with dagster_dev(home, env, tmp / "dagster_dev.log") as dev:
            print(f"dagster dev on {dev.url}")
            # the asset page's partition status over all partitions
            times = []
            for _ in range(a.repeats):
                _, s = _timed(
                    backfill.graphql,
                    dev.url,
                    backfill.PARTITIONS,
                    {"keys": [{"path": [a.status_asset]}]},
                )
                times.append(s)
            status_s = statistics.median(times)
            print(
                f"partition-status query over {len(keys)} partitions: median {status_s:.3f}s "
                f"({', '.join(f'{t:.2f}' for t in times)})"
            )

            # one tiny partition's run through the daemon: overhead = wall - compute
            key = keys[0]
            run_id = launch_run(
                dev.url, ["metadata", "images"], {}, tags={"dagster/partition": key}
            )
            status = wait_run(dev.url, run_id, timeout=600, poll=0.5)
            t = backfill.graphql(dev.url, RUN_TIMES, {"runId": run_id})["runOrError"]
            compute = sum(
                r["seconds"]
                for r in Catalog(data).query(
                    "SELECT seconds FROM materializations WHERE partition = ?", [key]
                )
            )
            run_wall = t["endTime"] - t["startTime"]
            queued_wall = t["endTime"] - t["creationTime"]
            overhead = run_wall - compute
            partition_10k_s = 10_000 / a.images_per_s
            print(
                f"run {run_id} {status}: created->end {queued_wall:.1f}s, start->end "
                f"{run_wall:.1f}s, compute {compute:.2f}s, overhead {overhead:.1f}s "
                f"= {overhead / partition_10k_s:.1%} of a 10k-image partition "
                f"({partition_10k_s:.0f}s at {a.images_per_s:g} images/s)"
            )

            # missing-only backfill over every partition, launched then cancelled
            missing, missing_s = _timed(backfill.missing_partitions, dev.url, [a.asset], str(data))
            bid, launch_s = _timed(
                backfill.launch_backfill, dev.url, missing, [a.asset], title="bench orchestration"
            )
            backfill.graphql(dev.url, CANCEL, {"id": bid})
            print(
                f"missing partitions of {a.asset}: {len(missing)} in {missing_s:.2f}s; "
                f"backfill launched in {launch_s:.2f}s (then cancelled)"
            )

    result = {
        "bench": "orchestration",
        "partitions": len(keys),
        "register_s": round(register_s, 3),
        "missing_partitions": len(missing),
        "missing_s": round(missing_s, 3),
        "launch_s": round(launch_s, 3),
        "status_query_s": round(status_s, 3),
        "run_status": status,
        "run_queued_to_end_s": round(queued_wall, 2),
        "run_wall_s": round(run_wall, 2),
        "run_compute_s": round(compute, 3),
        "run_overhead_s": round(overhead, 2),
        "assumed_10k_partition_s": round(partition_10k_s, 1),
        "overhead_fraction_of_10k_partition": round(overhead / partition_10k_s, 4),
        "targets": {
            "launch<=10s": launch_s <= 10,
            "status_query<=2s": status_s <= 2,
            "overhead<=5%": overhead / partition_10k_s <= 0.05,
        },
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
