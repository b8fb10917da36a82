"""GPU leases: two holders never get the same GPU; a lease is released when its holder ends."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from flowmatch_models.encoders.devices import lease_device


def _hold(q, lease_env: str, n: int) -> None:
    import os
    import time

    os.environ["FLOWMATCH_LEASE_DIR"] = lease_env
    with lease_device("auto", n_gpus=n, wait_s=0.5, poll_s=0.05) as dev:
        q.put(dev)
        time.sleep(1.0)


def test_leases_are_exclusive_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWMATCH_LEASE_DIR", str(tmp_path))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_hold, args=(q, str(tmp_path), 2)) for _ in range(2)]
    for p in ps:
        p.start()
    got = sorted(q.get(timeout=60) for _ in ps)
    assert got == ["cuda:0", "cuda:1"]
    # both GPUs are held now: a third caller times out with a clear error
    with pytest.raises(TimeoutError, match="no free GPU"):
        with lease_device("auto", n_gpus=2, wait_s=0.2, poll_s=0.05):
            pass
    for p in ps:
        p.join(30)
    with lease_device("cuda:1", n_gpus=2, wait_s=1) as dev:  # released when the holder ended
        assert dev == "cuda:1"


def test_cpu_when_no_gpu():
    with lease_device("auto", n_gpus=0) as dev:
        assert dev == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        with lease_device("cuda", n_gpus=0):
            pass
