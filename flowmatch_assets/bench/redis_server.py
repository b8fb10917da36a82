"""A real Redis on loopback (Debian's ``redis-server``) for the many-machines test and
`flowmatch bench launcher`: the Celery broker and result store, on a free port, no disk
persistence, stopped at the end."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@contextlib.contextmanager
def redis_server(folder: Path, timeout: float = 20) -> Iterator[str]:
    """Start ``redis-server`` bound to 127.0.0.1 on a free port; yield its ``redis://`` URL."""
    exe = redis_binary()
    if exe is None:
        raise RuntimeError("no redis-server: apt-get install -y redis-server")
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    cmd += ["--dir", str(folder), "--protected-mode", "yes"]
    with open(folder / "redis.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: see {folder / 'redis.log'}")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
