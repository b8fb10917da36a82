"""A run loses minutes, not hours, to a fault: real signals on a subprocess training run save a
full state and stop with exit 75, a kill -9 loses at most the full-state interval, and either
resume continues bit-exactly like an uninterrupted run (CPU)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_train import REPO, make_store, read_records, tiny_config

from flowmatch_models.train.signals import EXIT_STOPPED


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("faults_store"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


class Run:
    """``python -m flowmatch_models.train`` in its own session; stdout lines as they come."""

    def __init__(self, tmp_path: Path, cfg: dict, name: str, *extra: str):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowmatch_models.train", "--config", str(path), *extra],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.err = ""
        self._out = threading.Thread(target=self._read, daemon=True)
        self._out.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def step(self) -> int:
        """The newest step a progress line reported (0 before the first)."""
        done = [ln for ln in self.lines if ln.startswith("step ")]
        return int(done[-1].split()[1].split("/")[0]) if done else 0

    def wait_step(self, n: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while self.step() < n:
            assert self.proc.poll() is None, "".join(self.lines[-20:]) + self.proc.stderr.read()
            assert time.monotonic() < deadline, f"the run never reached step {n}"
            time.sleep(0.01)
        return self.step()

    def finish(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout)
        self._out.join(10)
        self.err = self.proc.stderr.read()
        return rc


def _losses(out: Path, rank: int = 0) -> dict[tuple[int, int], float]:
    """(step, micro-batch) -> loss of every batch the run trained (the last session's wins)."""
    seen: dict[tuple[int, int], float] = {}
    count: dict[int, int] = {}
    for rec in read_records(out, rank):
        if rec["step"] not in count:  # a resumed step starts its micro-batches again
            count[rec["step"]] = 0
        seen[(rec["step"], count[rec["step"]])] = rec["loss"]
        count[rec["step"]] += 1
    return seen


def _weights(out: Path) -> dict[str, torch.Tensor]:
    ck = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    return {**ck["state_dict"], **{f"adam.{k}": v for k, v in _adam(ck).items()}}


def _adam(ck: dict) -> dict[str, torch.Tensor]:
    st = ck["optimizer_states"][0]["state"]
    return {f"{i}.{k}": v for i, s in st.items() for k, v in s.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def test_sigterm_saves_a_full_state_exits_75_and_resumes_exactly(store, tmp_path) -> None:
    """SIGTERM mid-run (after a random step): every micro-batch of the step in progress is
    finished, a full state of that step is saved, the run says so in one line and exits 75;
    resuming gives the uninterrupted run's losses and final weights, bit for bit."""
    over = dict(
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=1000,
        trainer__checkpoint_every=1000,
    )
    cut = tmp_path / "cut"
    run = Run(tmp_path, tiny_config(store, cut, **over), "cut")
    at = random.Random().randint(3, 9)
    run.wait_step(at)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish() == EXIT_STOPPED, run.err
    err = [ln for ln in run.err.strip().splitlines() if "SIGTERM" in ln]  # (the store warns)
    assert len(err) == 1 and err[0].startswith("stopped at step ")
    assert " by SIGTERM: full state saved at " in err[0] and run.err.strip().endswith(err[0])
    step = int(err[0].split("at step ")[1].split(" ")[0])
    ck = cut / "checkpoints"
    assert step >= at and f"{ck / f'step{step:07d}.ckpt'}" in err[0]
    assert os.path.samefile(ck / "last.ckpt", ck / f"step{step:07d}.ckpt")
    assert not list(ck.glob(".tmp-*")) and "resume with --resume auto" in err[0]
    assert not (cut / "pipeline").exists()  # a stop is quick: no export
    total = step + 5
    # the resume and an uninterrupted run of the same length
    resumed = Run(tmp_path, tiny_config(store, cut, **over), "resume", "--max-steps", str(total))
    whole = tmp_path / "whole"
    straight = Run(tmp_path, tiny_config(store, whole, **over), "whole", "--max-steps", str(total))
    assert resumed.finish() == 0, resumed.err
    assert straight.finish() == 0, straight.err
    a, b = _losses(cut), _losses(whole)
    assert len(a) == len(b) == 2 * total and a == b  # every micro-batch's loss, exactly
    _same(_weights(cut), _weights(whole))


def test_kill_9_loses_at_most_the_interval_and_resumes_exactly(store, tmp_path) -> None:
    """kill -9 at a random step (no chance to save): the resume starts from the newest complete
    full state, at most ``full_every`` steps back (plus the steps of a write still in flight),
    nothing half-written is read, and the run then ends exactly as an uninterrupted one."""
    every = 4
    over = dict(
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=every,
        trainer__checkpoint_every=1000,
        trainer__keep_full=2,
    )
    cut = tmp_path / "cut"
    run = Run(tmp_path, tiny_config(store, cut, **over), "cut")
    seen = run.wait_step(random.Random().randint(every + 1, 4 * every))
    os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    ck = cut / "checkpoints"
    start = torch.load(ck / "last.ckpt", weights_only=True, mmap=True)["global_step"]
    # the newest state whose write had completed: the newest multiple of `every` at the kill,
    # or the one before when its background write was still in flight (a few ms here)
    m = seen - seen % every
    assert start % every == 0 and m - every <= start <= m + every, (seen, start)
    total = seen + every
    resumed = Run(tmp_path, tiny_config(store, cut, **over), "resume", "--max-steps", str(total))
    whole = tmp_path / "whole"
    straight = Run(tmp_path, tiny_config(store, whole, **over), "whole", "--max-steps", str(total))
    assert resumed.finish() == 0, resumed.err
    assert straight.finish() == 0, straight.err
    assert sorted(p.name for p in ck.glob("step*.ckpt"))[-1] == f"step{total:07d}.ckpt"
    _same(_weights(cut), _weights(whole))
    a, b = read_records(cut), read_records(whole)
    n = 2 * (total - start)  # the resumed session's micro-batches (accumulate 2)
    assert [r["loss"] for r in a[-n:]] == [r["loss"] for r in b[-n:]]
    assert [r["ids"] for r in a[-n:]] == [r["ids"] for r in b[-n:]]


def test_sigterm_to_the_launcher_stops_both_ddp_ranks_and_resumes_exactly(store, tmp_path):
    """2 gloo ranks, SIGTERM to the launcher only (as ``kill PID`` does): the ranks agree at the
    next step boundary, save one full state of that step, exit 75; resuming gives the
    uninterrupted 2-rank run's losses (both ranks) and final weights, bit for bit."""
    over = dict(
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=1000,
        trainer__checkpoint_every=1000,
        trainer__devices=2,
        trainer__strategy="ddp",
        trainer__accelerator="cpu",
        trainer__accumulate_grad_batches=1,
    )
    cut = tmp_path / "cut"
    run = Run(tmp_path, tiny_config(store, cut, **over), "cut")
    run.wait_step(random.Random().randint(3, 6))
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish() == EXIT_STOPPED, run.err
    line = [ln for ln in run.err.splitlines() if ln.startswith("stopped at step")]
    assert len(line) == 1 and " by SIGTERM: full state saved at " in line[0], run.err
    step = int(line[0].split("at step ")[1].split(" ")[0])
    total = step + 3
    resumed = Run(tmp_path, tiny_config(store, cut, **over), "resume", "--max-steps", str(total))
    assert resumed.finish() == 0, resumed.err
    whole = tmp_path / "whole"
    straight = Run(tmp_path, tiny_config(store, whole, **over), "whole", "--max-steps", str(total))
    assert straight.finish() == 0, straight.err
    for rank in (0, 1):
        a, b = read_records(cut, rank), read_records(whole, rank)
        assert len(a) == len(b) == total
        assert [r["loss"] for r in a] == [r["loss"] for r in b]
    _same(_weights(cut), _weights(whole))


def _groups(out: Path) -> list[list[int]]:
    """Per optimizer step, the epoch positions of its micro-batches (a record's step is the
    global step after its batch: the group's last micro-batch is the one that stepped)."""
    groups, cur, prev = [], [], 0
    for rec in read_records(out):
        cur.append(rec["position"])
        if rec["step"] != prev:
            groups.append(cur)
            cur, prev = [], rec["step"]
    return groups + ([cur] if cur else [])


def test_a_resume_at_an_epochs_end_keeps_the_accumulation_groups(tmp_path) -> None:
    """22 batches an epoch, accumulate 4: the state saved at the step that ends epoch 0 (step
    6, a group of 2) resumes into epoch 1 with groups of 4 from its first batch, as the
    uninterrupted run: no step of 2 micro-batches divided by 4, the ledger's steps right."""
    from test_train import run_training

    root = make_store(tmp_path / "store", {"000-00": 176})
    over = dict(
        data__heldout_fraction=0.0,
        trainer__accumulate_grad_batches=4,
        trainer__full_every=6,
        trainer__checkpoint_every=1000,
    )
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    run_training(tiny_config(root, cut, trainer__max_steps=6, **over))
    run_training(tiny_config(root, cut, trainer__max_steps=10, **over))
    run_training(tiny_config(root, whole, trainer__max_steps=10, **over))
    want = _groups(whole)
    assert want[5:8] == [[160, 168], [0, 8, 16, 24], [32, 40, 48, 56]]
    assert _groups(cut) == want
    ck = lambda out: torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)  # noqa: E731
    a, b = ck(cut), ck(whole)
    assert a["EmbeddingDataModule"]["ledger"] == b["EmbeddingDataModule"]["ledger"]
    _same(a["state_dict"], b["state_dict"])


def test_a_fine_tunes_ema_from_raw_weights_starts_young(tmp_path) -> None:
    """init.weights=raw: the EMA holds the parent's raw weights, which it has not averaged: its
    first update weighs the new weights 0.9 (age 0, the ramp), not 1.8e-4 (the parent's 50k
    steps; at 0.9999 and 50k steps that left 61% of the parent's raw weights in the EMA after 5k steps). An EMA taken
    from the parent's EMA goes on at its age; a run too short for it gets a note."""
    from flowmatch_models.train.config import load_config
    from flowmatch_models.train.finetune import ema_start_share, ema_warning
    from flowmatch_models.train.module import FlowMatchModule

    cfg = load_config(tiny_config(tmp_path, tmp_path / "r"), ["optim.ema_decay=0.9999"])
    module = FlowMatchModule(cfg)
    for weights, moved in (("raw", 0.9), ("ema", 9 / 50_010)):  # 1 - (1 + n) / (10 + n)
        module.parent = {"run": "parent", "step": 50_000, "weights": weights}
        with torch.no_grad():
            for p in module.ema.parameters():
                p.zero_()
            for p in module.model.transformer.parameters():
                p.fill_(1.0)
        module.update_ema()
        assert module.ema_steps() == (0 if weights == "raw" else 50_000)
        got = next(module.ema.parameters()).flatten()[0].item()
        assert got == pytest.approx(moved, rel=1e-4), weights
    # the ramp's (1 + n) / (10 + n) telescopes: prod over k < 9 of (50_001 + k) / (55_001 + k)
    ramp = float(np.prod([(50_001 + k) / (55_001 + k) for k in range(9)]))
    assert ema_start_share(0.9999, 50_000, 5_000) == pytest.approx(ramp, rel=1e-9)  # 42%
    assert ema_start_share(0.9999, 200_000, 5_000) == pytest.approx(0.9999**5000)  # 61%
    assert ema_start_share(0.9999, 0, 5_000) < 1e-6
    note = ema_warning(0.9999, 50_000, 5_000, {"run": "parent"})
    assert "42% of its EMA is still parent's EMA" in note and "ema_decay <= 0.999" in note
    assert ema_warning(0.9999, 0, 5_000, {"run": "parent"}) is None  # raw: a new EMA


# --------------------------------------------------------------------------------------------
# the thread loader: io-thread errors said, one pass at a time, RWF_NOWAIT refused
# --------------------------------------------------------------------------------------------


def _loader(store: Path, threads: int):
    from flowmatch_models.data.source import ShardSource
    from flowmatch_models.data.stream import BatchStream, ThreadLoader

    src = ShardSource(store, ["000-00", "000-01", "000-02", "001-00"], cache_shards=3)
    return ThreadLoader(BatchStream(src, 8, shuffle_window=1, end_epoch=0), threads)


def _pass(loader) -> list[tuple[list[str], torch.Tensor]]:
    return [(list(b["meta"]["ids"]), b["latents"].clone()) for b in loader]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_an_io_threads_error_is_said_and_the_batches_stay_right(store, caplog) -> None:
    """Opening the next window's partition fails on an io thread: the failure is logged with
    its partition (it was dropped), the building thread opens it again, the batches are those
    of a loader without io threads."""
    want = _pass(_loader(store, 0))
    loader = _loader(store, 2)
    src, real, failed = loader.stream.source, loader.stream.source._arrays, []

    def flaky(i):
        if threading.current_thread().name.startswith("flowmatch-io") and not failed:
            failed.append(src.partitions[i])
            raise OSError(5, "Input/output error")
        return real(i)

    src._arrays = flaky
    with caplog.at_level("WARNING", logger="flowmatch_models.data.stream"):
        assert _equal(_pass(loader), want)
    said = [r.getMessage() for r in caplog.records if "ahead failed" in r.getMessage()]
    assert failed and said == [
        f"loader: opening partition {failed[0]} ahead failed (OSError: [Errno 5] Input/output "
        "error); the batch that needs it opens it again"
    ]


def test_a_new_pass_of_the_loader_closes_and_joins_the_previous(store) -> None:
    loader = _loader(store, 2)
    threads = lambda: [t for t in threading.enumerate() if t.name.startswith("flowmatch-")]  # noqa: E731
    first = iter(loader)
    next(first)
    assert threads()
    second = iter(loader)  # as Lightning does from epoch 1 on
    assert threads() == []  # the first pass's builder and io threads are joined
    assert first.gi_frame is None  # closed
    assert _equal(_pass(loader), _pass(_loader(store, 0))) and threads() == []
    del second


def test_an_unexpected_rwf_nowait_errno_reads_blocking_once_said(store, caplog) -> None:
    """A kernel or seccomp sandbox that refuses RWF_NOWAIT with ENOSYS: the process switches
    to blocking reads (one log line), the batches are right (it raised and stopped the run)."""
    from flowmatch_models.data import rows

    want = _pass(_loader(store, 0))
    real, calls = os.preadv, {"nowait": 0}

    def preadv(fd, bufs, off, flags=0):
        if flags:
            calls["nowait"] += 1
            raise OSError(38, "Function not implemented")
        return real(fd, bufs, off)

    try:
        os.preadv = preadv
        with caplog.at_level("WARNING", logger="flowmatch_models.data.rows"):
            got = _pass(_loader(store, 2))
    finally:
        os.preadv = real
        rows._nowait["on"] = True
    assert _equal(got, want)
    said = [r.getMessage() for r in caplog.records if "RWF_NOWAIT" in r.getMessage()]
    assert calls["nowait"] == 1 and len(said) == 1 and "ENOSYS" in said[0]


def test_a_rank_that_sees_another_partition_or_size_names_it() -> None:
    """Rank 0's epoch (partitions, trainable sizes) against another rank's: the first partition
    that differs is named (every rank then stops with PartitionChangedError, exit 3)."""
    from flowmatch_models.data.module import rank_disagreement

    r0 = {"partitions": ["000-00", "000-01", "000-02"], "sizes": [24, 20, 28]}
    assert rank_disagreement(r0, dict(r0), 1) is None
    resized = {"partitions": r0["partitions"], "sizes": [24, 19, 28]}
    assert rank_disagreement(r0, resized, 1) == (
        "partition 000-01 has 19 trainable samples on rank 1 but 20 on rank 0: it was re-made "
        "while the ranks read it; resume with --resume auto"
    )
    grown = {"partitions": [*r0["partitions"], "000-03"], "sizes": [24, 20, 28, 30]}
    assert "(first: 000-03)" in rank_disagreement(r0, grown, 1)


def test_full_states_follow_the_wall_clock_interval(store, tmp_path) -> None:
    """``full_every_minutes`` elapsed at every step boundary (a tiny interval): a full state of
    every step, without ``full_every`` ever falling due; ``keep_full`` of them kept, each
    complete (written in the background, linked when in place); with the clock off only the
    end's state."""
    from test_train import run_training

    over = dict(
        trainer__max_steps=5,
        trainer__full_every=1000,
        trainer__checkpoint_every=1000,
        trainer__keep_full=3,
    )
    on, off = tmp_path / "on", tmp_path / "off"
    run_training(tiny_config(store, on, trainer__full_every_minutes=1e-9, **over))
    run_training(tiny_config(store, off, trainer__full_every_minutes=0, **over))
    full = lambda out: sorted(p.name for p in (out / "checkpoints").glob("step???????.ckpt"))  # noqa: E731
    assert full(on) == ["step0000003.ckpt", "step0000004.ckpt", "step0000005.ckpt"]
    assert full(off) == ["step0000005.ckpt"]
    for name in full(on):
        ck = torch.load(on / "checkpoints" / name, weights_only=True)
        assert ck["global_step"] == int(name[4:11]) and ck["optimizer_states"]
    assert os.path.samefile(on / "checkpoints" / "last.ckpt", on / "checkpoints" / full(on)[-1])
    assert not list((on / "checkpoints").glob(".tmp-*"))


def test_a_second_signal_exits_at_once() -> None:
    """The first SIGUSR1 is recorded (the run saves at the next step boundary); the second
    exits the process at once with 128 + 10, saying so in one line."""
    code = (
        "import os, signal, time\n"
        "from flowmatch_models.train.signals import SignalStop\n"
        "s = SignalStop(); s.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2)\n"
        "print('recorded', s.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(10)\n"
        "print('not reached', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 128 + signal.SIGUSR1
    assert "recorded SIGUSR1" in proc.stdout and "not reached" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "SIGUSR1 again: exiting now without saving; the newest complete full state "
        "(checkpoints/last.ckpt) is kept"
    ]


class _Strategy:
    """Lightning's DDP strategy's object broadcast, over the real gloo group."""

    def broadcast(self, obj, src: int = 0):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


class _Trainer:
    """What the data module asks of its trainer at an epoch's start (rank, world, strategy)."""

    def __init__(self, rank: int, world: int):
        self.global_rank, self.world_size, self.is_global_zero = rank, world, rank == 0
        self.strategy, self.loggers, self.global_step = _Strategy(), [], 0


def _rank_epoch(rank: int, port: int, root: str, out) -> None:
    import torch.distributed as dist

    from flowmatch_models.data.module import EmbeddingDataModule
    from flowmatch_models.data.source import PartitionChangedError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dm = EmbeddingDataModule(root, batch_size=8, grow=True, heldout=(0.0, 0))
        dm.trainer = _Trainer(rank, 2)
        dm.train_dataloader()
        out.put((rank, "ok"))
    except PartitionChangedError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def test_ranks_that_see_a_partition_differently_both_stop_naming_it(tmp_path) -> None:
    """Two real gloo ranks start an epoch; rank 1 reads partition 000-01 as re-made with 19
    samples (its own data root), rank 0 as 20: both stop with the same PartitionChangedError
    naming it (before: each trained its own epoch length -- a collective hang at its end)."""
    import multiprocessing as mp
    import socket

    roots = [
        make_store(tmp_path / "a", {"000-00": 24, "000-01": 20}),
        make_store(tmp_path / "b", {"000-00": 24, "000-01": 19}),
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_epoch, args=(r, port, str(roots[r]), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    want = (
        "partition 000-01 has 19 trainable samples on rank 1 but 20 on rank 0: it was "
        "re-made while the ranks read it; resume with --resume auto"
    )
    assert got == {0: want, 1: want}


_RANK1_FAULT = """\
import os, sys
from flowmatch_models.data import module, source
if os.environ.get("LOCAL_RANK") == "1":  # only the rank the launcher started
    calls, real = [0], module.EmbeddingDataModule.decode_batch
    def decode_batch(self, batch, device):  # as ShardSource.tables raises on a re-made file
        calls[0] += 1
        if calls[0] > 4:
            raise source.PartitionChangedError("partition '000-00': re-made (planted)")
        return real(self, batch, device)
    module.EmbeddingDataModule.decode_batch = decode_batch
from flowmatch_models.train.run import main
sys.exit(main())
"""


def test_a_partition_changed_on_one_other_rank_gives_its_line_and_exit_3(store, tmp_path):
    """2 gloo ranks; rank 1 alone (not the launcher) hits a PartitionChangedError mid-run. Before,
    Lightning's child observer SIGKILLed the launcher: exit -9 and no line. Now the launcher
    says the rank's one line on stderr and in $FLOWMATCH_ERROR_FILE and exits 3."""
    over = dict(
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=1000,
        trainer__checkpoint_every=1000,
        trainer__devices=2,
        trainer__strategy="ddp",
        trainer__accelerator="cpu",
        trainer__accumulate_grad_batches=1,
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(store, tmp_path / "out", **over)))
    script = tmp_path / "rank1_fault.py"
    script.write_text(_RANK1_FAULT)
    err_file = tmp_path / "error.txt"
    proc = subprocess.run(
        [sys.executable, str(script), "--config", str(cfg)],
        cwd=tmp_path,
        env={**_env(), "FLOWMATCH_ERROR_FILE": str(err_file)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    want = "error: partition '000-00': re-made (planted)"
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")] == [want, want]
    assert err_file.read_text() == want
