"""A kill -9 in the middle of a partition leaves nothing half-written visible and no catalog
record claiming it; running the partition again completes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowmatch_assets.catalog import Catalog
from flowmatch_assets.cli.devserver import make_dagster_home
from tests.conftest import REPO
from tests.http_fixtures import LoopbackHTTPServer, Reply


@pytest.mark.slow
def test_kill_9_mid_partition_then_rerun(tmp_path, small_sample):
    src = pq.read_table(Path(small_sample["metadata"]) / "pd12m.001.parquet")
    state = {"delay": 1.0}
    with LoopbackHTTPServer() as srv:
        urls = []
        for r in src.to_pylist():
            body = (Path(small_sample["dest"]) / r["url"].removeprefix("file:")).read_bytes()
            path = f"/img/{r['id']}.jpg"
            srv.add(
                path,
                lambda attempt, b=body: Reply(
                    body=b, headers={"Content-Type": "image/jpeg"}, delay_s=state["delay"]
                ),
            )
            urls.append(srv.url(path))
        table = src.set_column(src.schema.get_field_index("url"), "url", pa.array(urls))
        md_dir = tmp_path / "metadata"
        md_dir.mkdir()
        pq.write_table(table, md_dir / "pd12m.000.parquet")
        home, data = make_dagster_home(tmp_path / "home"), tmp_path / "data"
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "FLOWMATCH_DATA_ROOT": str(data),
            "FLOWMATCH_METADATA": str(md_dir),
            "FLOWMATCH_ALLOW_NETWORKS": "127.0.0.0/8",  # the loopback image server
        }
        reg = subprocess.run(
            [sys.executable, "-m", "flowmatch_assets.cli", "partitions", "register"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "000-00" in reg.stdout, reg.stdout + reg.stderr
        cmd = [
            sys.executable,
            "-m",
            "dagster",
            "asset",
            "materialize",
            "-m",
            "flowmatch_assets.definitions",
            "--select",
            "metadata,images",
            "--partition",
            "000-00",
        ]
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 180
            while sum(srv.hits(f"/img/{r['id']}.jpg") for r in src.to_pylist()) < 3:
                assert proc.poll() is None, "the run ended before it could be killed"
                assert time.monotonic() < deadline, "images never started downloading"
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its step processes
            proc.wait(30)

        layout_img = data / "images"
        visible = (
            [p.name for p in layout_img.iterdir() if not p.name.startswith(".")]
            if layout_img.exists()
            else []
        )
        assert visible == []  # no partial shard
        cat = Catalog(data)
        assert cat.query("SELECT * FROM materializations WHERE asset = 'images'") == []
        assert cat.query("SELECT * FROM rows WHERE asset = 'images'") == []
        cov = {r["partition"]: r for r in cat.coverage()}
        assert cov["000-00"]["images"] is None

        state["delay"] = 0.0
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (layout_img / "000-00.parquet").exists()
    assert not list(layout_img.glob(".tmp-*"))
    assert {r["partition"]: r for r in Catalog(data).coverage()}["000-00"]["images"] == src.num_rows
