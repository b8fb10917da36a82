"""A real PostgreSQL server for the tests and `flowmatch bench launcher`: initdb in a temp dir, listening on 127.0.0.1:<free port>,
stopped (and deleted) afterwards. Uses Debian's postgresql binaries; as root it runs them as
the ``postgres`` user (PostgreSQL refuses to run as root)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass


def pg_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(found[-1]) if found else None


@dataclass
class PgServer:
    host: str
    port: int
    user: str
    db: str

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.db}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server() -> Iterator[PgServer]:
    bindir = pg_bin()
    if bindir is None:
        raise RuntimeError("PostgreSQL is not installed: apt-get install -y postgresql")
    as_root = os.geteuid() == 0
    run_as = ["runuser", "-u", "postgres", "--"] if as_root else []
    base = tempfile.mkdtemp(prefix="flowmatch-pg-")
    os.chmod(base, 0o755)
    data, sock = os.path.join(base, "data"), os.path.join(base, "sock")
    os.makedirs(sock)
    if as_root:
        shutil.chown(base, "postgres")
        shutil.chown(sock, "postgres")
    user = "postgres" if as_root else os.environ.get("USER", "postgres")
    port = _free_port()
    log = os.path.join(base, "server.log")
    try:
        subprocess.run(
            [*run_as, f"{bindir}/initdb", "-D", data, "-U", user, "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [
                *run_as,
                f"{bindir}/pg_ctl",
                "-D",
                data,
                "-l",
                log,
                "-w",
                "-t",
                "60",
                "start",
                "-o",
                f"-h 127.0.0.1 -p {port} -k {sock} -c fsync=off",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", user, "dagster"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        yield PgServer("127.0.0.1", port, user, "dagster")
    finally:
        subprocess.run(
            [*run_as, f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        time.sleep(0.2)
        shutil.rmtree(base, ignore_errors=True)
