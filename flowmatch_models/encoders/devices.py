"""Device leases: one GPU per encoding/training process, never two processes on one GPU.

Dagster's ``gpu`` pool bounds how many GPU steps run at once (set it to the GPU count); the
lease says *which* GPU a step gets: an exclusive, non-blocking ``flock`` on one lock file per
GPU index. The kernel drops the lock when the process dies, so a killed step never strands a GPU.
On a machine without CUDA the lease is the CPU (no lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def lease_dir() -> Path:
    d = Path(
        os.environ.get(
            "FLOWMATCH_LEASE_DIR",
            Path(tempfile.gettempdir()) / f"flowmatch-gpu-leases-{os.getuid()}",
        )
    )
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def lease_device(
    requested: str = "auto", n_gpus: int | None = None, wait_s: float = 3600.0, poll_s: float = 0.5
) -> Iterator[str]:
    """Yield a device string (``cuda:K`` or ``cpu``) held exclusively for the ``with`` block.

    ``requested``: ``auto`` (a free GPU if there is CUDA, else cpu), ``cpu``, ``cuda`` (any free
    GPU) or ``cuda:K`` (that GPU; waits until it is free).
    """
    if n_gpus is None:
        import torch

        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cpu" or (requested == "auto" and n_gpus == 0):
        yield "cpu"
        return
    if n_gpus == 0:
        raise RuntimeError(f"device {requested!r} requested but no CUDA GPU is visible")
    candidates = [int(requested.split(":")[1])] if ":" in requested else list(range(n_gpus))
    deadline = time.monotonic() + wait_s
    while True:
        for k in candidates:
            f = open(lease_dir() / f"gpu{k}.lock", "a+")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                f.seek(0)
                f.truncate()
                f.write(f"{os.getpid()}\n")
                f.flush()
                yield f"cuda:{k}"
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                f.close()
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no free GPU among {candidates} after {wait_s:.0f}s (lease dir {lease_dir()})"
            )
        time.sleep(poll_s)
