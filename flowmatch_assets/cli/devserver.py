"""Start and stop a real `dagster dev` (webserver + daemon) for end-to-end tests and benchmarks.

    with dagster_dev(home, env, log) as dev:
        dev.url  # http://127.0.0.1:<free port>, answering GraphQL with our code location loaded

The server runs in its own process group, bound to 127.0.0.1 on a free port, and the whole
group (webserver, daemon, code server, run workers) is stopped on exit, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_dagster_home(path: Path) -> Path:
    """A fresh DAGSTER_HOME holding a copy of the repo's dagster_home/dagster.yaml."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "dagster.yaml").write_text((REPO / "dagster_home" / "dagster.yaml").read_text())
    return path


@dataclass
class DagsterDev:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    home: Path

    def log_tail(self, chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no dagster dev log: {e}>"
        return text[-chars:]

    def fail_msg(self, msg: str) -> str:
        """``msg`` followed by the tail of the dagster dev log (for assertion messages)."""
        return f"{msg}\n--- tail of dagster dev log {self.log_path} ---\n{self.log_tail()}"


def _ready(url: str, asset: str) -> bool:
    """The webserver answers GraphQL and the code location defines ``asset``."""
    body = json.dumps({"query": "{ assetNodes { assetKey { path } } }"}).encode()
    req = urllib.request.Request(
        url + "/graphql", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            data = json.loads(resp.read().decode())
    except (OSError, ValueError):
        return False
    nodes = (data.get("data") or {}).get("assetNodes") or []
    return any(n["assetKey"]["path"] == [asset] for n in nodes)


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the process group of ``proc`` (dagster dev shuts its children down), then
    SIGKILL whatever is left after ``grace`` seconds."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    # children (run workers, code server) may outlive the dagster dev process itself
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def dagster_dev(
    home: Path,
    env: dict[str, str],
    log_path: Path,
    startup_timeout: float = 240,
    ready_asset: str = "metadata",
) -> Iterator[DagsterDev]:
    """Run ``python -m dagster dev -w workspace.yaml`` from the repo root with DAGSTER_HOME=home
    and ``env`` on top of os.environ; yields once GraphQL answers with ``ready_asset`` loaded."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full_env = {
        **os.environ,
        **env,
        "DAGSTER_HOME": str(home),
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dagster", "dev", "-w", str(REPO / "workspace.yaml")]
    cmd += ["-h", "127.0.0.1", "-p", str(port)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stopped as a whole below
        )
    dev = DagsterDev(url=url, port=port, proc=proc, log_path=log_path, home=home)
    try:
        deadline = time.monotonic() + startup_timeout
        while not _ready(url, ready_asset):
            if proc.poll() is not None:
                raise RuntimeError(dev.fail_msg(f"dagster dev exited with {proc.returncode}"))
            if time.monotonic() > deadline:
                raise TimeoutError(
                    dev.fail_msg(f"dagster dev not ready on {url} after {startup_timeout:.0f}s")
                )
            time.sleep(2)
        yield dev
    finally:
        stop_group(proc)
