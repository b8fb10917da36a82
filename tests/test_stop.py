"""Every way a run is stopped keeps its work (issue 50): ``flowmatch train`` in a terminal
stopped by Ctrl-C (SIGINT to the foreground process group), by SIGTERM to the CLI alone or to
the whole group (SLURM's scancel, ``timeout``), and by Ctrl-C twice; a 2-rank gloo run whose
ranks each get their own copy of a job-wide signal after they agreed to stop; a second signal
to the DDP launcher; a write error on rank 0. Real processes and signals, no mocks (CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import torch
import yaml
from test_faults import Run, _same
from test_train import REPO, make_store, tiny_config

from flowmatch_models.train.signals import EXIT_STOPPED

SIGNALLED_AT = 4  # the step logged when the signal is sent
TOTAL = 10  # the resumed and the uninterrupted runs' length


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("stop_store"))


@pytest.fixture(scope="module")
def encoders(zoo) -> dict[str, str]:
    """The tiny random zoo as the resource's encoders (a finished run exports with them)."""
    return {
        "FLOWMATCH_VAE": zoo["vae"],
        "FLOWMATCH_TEXT": zoo["text"],
        "FLOWMATCH_DINO": zoo["dino"],
    }


def _yaml(store: Path, folder: Path, out_dir: Path | None = None, **over) -> Path:
    cfg = tiny_config(
        store,
        folder / "unused",
        trainer__max_steps=100_000,
        trainer__log_every=1,
        trainer__full_every=1000,
        trainer__checkpoint_every=1000,
        **over,
    )
    # the CLI's run folder: <data root>/runs/<name>, unless the YAML names one (run.out_dir)
    cfg["run"]["out_dir"] = str(out_dir) if out_dir else None
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Cli:
    """``flowmatch train NAME`` in its own session (a terminal's foreground group), output
    lines as they come; the data root and the Dagster instance are the test's."""

    def __init__(self, folder: Path, store: Path, name: str, steps: int, encoders: dict):
        folder.mkdir(parents=True, exist_ok=True)
        self.home, self.ack = folder / "home", folder / f"{name}.ack"
        self.home.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "LOCAL_RANK")}
        env.update(
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            DAGSTER_HOME=str(self.home),
            FLOWMATCH_DATA_ROOT=str(store),
            FLOWMATCH_STOP_ACK=str(self.ack),  # the training process notes a first signal
            **encoders,
        )
        cmd = [sys.executable, "-m", "flowmatch_assets.cli", "train", "--run-name", name]
        cmd += ["--steps", str(steps), "--config", str(folder / "run.yaml"), "--no-samples"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._out = threading.Thread(target=self._read, daemon=True)
        self._out.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_step(self, n: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(ln.startswith(f"step {n}/") for ln in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines[-30:])
            assert time.monotonic() < deadline, f"never reached step {n}"
            time.sleep(0.01)

    def wait_ack(self, text: str, timeout: float = 60) -> None:
        """Until the training process says it handled ``text`` (signals.py: ``SIGINT
        received=2 forwarded=1``)."""
        deadline = time.monotonic() + timeout
        while not (self.ack.exists() and text in self.ack.read_text()):
            assert time.monotonic() < deadline, "the training process never took the signal"
            time.sleep(0.01)

    def finish(self, timeout: float = 240) -> int:
        rc = self.proc.wait(timeout)
        self._out.join(10)
        return rc

    def last_run(self) -> dg.DagsterRun:
        with dg.DagsterInstance.from_config(str(self.home)) as inst:
            return inst.get_runs(limit=1)[0]


def _state(store: Path, name: str) -> dict[str, torch.Tensor]:
    ck = torch.load(store / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True)
    st = ck["optimizer_states"][0]["state"]
    adam = {f"adam.{i}.{k}": v for i, s in st.items() for k, v in s.items()}
    return {**ck["state_dict"], **adam}


@pytest.fixture(scope="module")
def whole(store, encoders, tmp_path_factory) -> dict[str, torch.Tensor]:
    """An uninterrupted ``flowmatch train`` of TOTAL steps: what every resume must equal."""
    folder = tmp_path_factory.mktemp("whole")
    _yaml(store, folder)
    cli = Cli(folder, store, "whole", TOTAL, encoders)
    assert cli.finish() == 0, "\n".join(cli.lines[-30:])
    return _state(store, "whole")


def _stop(cli: Cli, how: str) -> None:
    """Send the signal(s) of one row of the issue's table."""
    pid = cli.proc.pid
    if how == "ctrl-c":  # the terminal signals its foreground process group
        os.killpg(pid, signal.SIGINT)
    elif how == "sigterm-to-the-group":  # scancel, timeout, a supervisor
        os.killpg(pid, signal.SIGTERM)
    elif how == "sigterm-to-the-cli":  # Kubernetes' PID 1
        os.kill(pid, signal.SIGTERM)
    elif how == "ctrl-c-twice":  # the second once both copies of the first were taken:
        os.killpg(pid, signal.SIGINT)  # two pending SIGINTs of one process are one
        cli.wait_ack("forwarded=1")  # (the CLI's copy counted: the training process saw it)
        os.killpg(pid, signal.SIGINT)


@pytest.mark.parametrize(
    "how", ["ctrl-c", "sigterm-to-the-group", "sigterm-to-the-cli", "ctrl-c-twice"]
)
def test_every_way_of_stopping_flowmatch_train_keeps_the_work(
    store, encoders, whole, tmp_path, how
):
    """Each way ends with exit 75, the run CANCELED, and the one line as the last; one signal
    saves a full state at >= the step logged at the signal, and the resume equals the
    uninterrupted run (torch.equal); two exit at once, saying what is kept. (Before issue 50:
    exit 1 and "training FAILED", and Ctrl-C or a SIGTERM to the group saved nothing.)"""
    name = how.replace("-", "_")
    # one row keeps its run folder elsewhere (run.out_dir): the stop's tags must find it there
    out = tmp_path / "elsewhere" if how == "sigterm-to-the-cli" else None
    _yaml(store, tmp_path, out_dir=out)
    cli = Cli(tmp_path, store, name, 100_000, encoders)
    cli.wait_step(SIGNALLED_AT)
    _stop(cli, how)
    assert cli.finish() == EXIT_STOPPED, "\n".join(cli.lines[-30:])
    last = cli.lines[-1]
    run = cli.last_run()
    assert run.status == dg.DagsterRunStatus.CANCELED
    assert run.tags["flowmatch/stopped"] == last
    assert not any("FAILED" in ln or "Traceback" in ln for ln in cli.lines), cli.lines[-30:]
    sig = "SIGTERM" if "sigterm" in how else "SIGINT"
    if how == "ctrl-c-twice":
        assert last.startswith(f"stopped by {sig} twice (exited at once) before a full state")
        assert f"{sig} again: exiting now without saving" in "\n".join(cli.lines)
        return
    assert last.startswith("stopped at step ") and f" by {sig}: full state saved at " in last
    assert sum("full state saved at" in ln for ln in cli.lines) == 1
    step = int(last.split("at step ")[1].split(" ")[0])
    ck = (out or store / "runs" / name) / "checkpoints"
    assert step >= SIGNALLED_AT and str(ck / f"step{step:07d}.ckpt") in last
    assert os.path.samefile(ck / "last.ckpt", ck / f"step{step:07d}.ckpt")
    assert run.tags["flowmatch/stopped_at_step"] == str(step)
    assert run.tags["flowmatch/checkpoint"] == str(ck / f"step{step:07d}.ckpt")
    if how != "ctrl-c":  # one resume for the first-signal rows: each saved its full state
        return  # by the same path, asserted above (sigterm-to-the-cli's: test_faults' SIGTERM)
    resumed = Cli(tmp_path, store, name, TOTAL, encoders)
    assert resumed.finish() == 0, "\n".join(resumed.lines[-30:])
    _same(_state(store, name), whole)


# --------------------------------------------------------------------------------------------
# DDP: 2 gloo ranks
# --------------------------------------------------------------------------------------------

DDP = dict(
    trainer__max_steps=100_000,
    trainer__log_every=1,
    trainer__full_every=1000,
    trainer__checkpoint_every=1000,
    trainer__devices=2,
    trainer__strategy="ddp",
    trainer__accelerator="cpu",
    trainer__accumulate_grad_batches=1,
)


def _rank1(launcher: int, timeout: float = 60) -> int:
    """The pid of the rank the launcher started (a child running the same module)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd = (d / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher and b"flowmatch_models.train" in cmd:
                return int(d.name)
        time.sleep(0.05)
    raise AssertionError("the launcher started no rank")


def test_each_ranks_own_copy_of_a_job_wide_signal_after_the_agreement_is_one_stop(store, tmp_path):
    """SIGTERM to the launcher; once the ranks agreed and the full state is being written,
    rank 1's own copy of the job-wide signal arrives: one stop (it was taken as a second
    signal: exit 143 and the agreed state's file never renamed). Exit 75, the one line, a full
    state at >= the signalled step, and a resume equal to an uninterrupted 2-rank run."""
    cut = tmp_path / "cut"
    run = Run(tmp_path, tiny_config(store, cut, **DDP), "cut")
    rank1 = _rank1(run.proc.pid)
    at = run.wait_step(3)
    os.kill(run.proc.pid, signal.SIGTERM)
    ck = cut / "checkpoints"
    deadline = time.monotonic() + 60
    while not (list(ck.glob(".tmp-step*")) or list(ck.glob("step*.ckpt"))):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.lines[-20:]
        time.sleep(0.002)
    os.kill(rank1, signal.SIGTERM)  # after the agreement: its own first signal
    assert run.finish() == EXIT_STOPPED, run.err
    line = [ln for ln in run.err.splitlines() if ln.startswith("stopped at step")]
    assert len(line) == 1 and run.err.strip().endswith(line[0]), run.err
    step = int(line[0].split("at step ")[1].split(" ")[0])
    assert step >= at and os.path.samefile(ck / "last.ckpt", ck / f"step{step:07d}.ckpt")
    total = step + 2
    resumed = Run(tmp_path, tiny_config(store, cut, **DDP), "resume", "--max-steps", str(total))
    assert resumed.finish() == 0, resumed.err
    whole = tmp_path / "whole"
    straight = Run(tmp_path, tiny_config(store, whole, **DDP), "whole", "--max-steps", str(total))
    assert straight.finish() == 0, straight.err
    w = lambda out: torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]  # noqa: E731
    _same(w(cut), w(whole))


def test_a_second_signal_to_the_ddp_launcher_ends_every_rank(store, tmp_path):
    """SIGINT twice to the launcher alone: it exits at once (130) and no rank is left running
    (they would wait in a collective: with NCCL for 30 minutes)."""
    cut = tmp_path / "cut"
    ack = tmp_path / "ack"
    os.environ["FLOWMATCH_STOP_ACK"] = str(ack)
    try:
        run = Run(tmp_path, tiny_config(store, cut, **DDP), "cut")
    finally:
        del os.environ["FLOWMATCH_STOP_ACK"]
    rank1 = _rank1(run.proc.pid)
    run.wait_step(2)
    os.kill(run.proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while not ack.exists():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(run.proc.pid, signal.SIGINT)
    assert run.finish() == 128 + signal.SIGINT, run.err
    assert "SIGINT again: exiting now without saving" in run.err
    time.sleep(0.5)
    assert not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text()


def test_a_write_error_on_rank_0_ends_every_rank_with_one_line(store, tmp_path):
    """The checkpoint folder replaced by a file mid-run (a real ENOTDIR, not a full disk):
    rank 0's write fails; every rank stops with the one line and exit 3 (the others waited in
    a broadcast forever)."""
    cut = tmp_path / "cut"
    over = {**DDP, "trainer__full_every": 6}
    run = Run(tmp_path, tiny_config(store, cut, **over), "cut")
    run.wait_step(2)
    if (cut / "checkpoints").exists():
        (cut / "checkpoints").rename(tmp_path / "moved")
    (cut / "checkpoints").write_text("not a folder")
    assert run.finish(timeout=120) == 3, run.err
    line = [ln for ln in run.err.splitlines() if ln.startswith("error: writing step0000006.ckpt")]
    assert len(line) == 1 and run.err.strip().endswith(line[0]), run.err


def _catches(pid: int, signum: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` has a handler for ``signum`` (its /proc status SigCgt)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(
            next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16
        )
        if caught >> (signum - 1) & 1:
            return
        time.sleep(0.002)
    raise AssertionError(f"{pid} never caught signal {signum}")


def test_a_stop_during_start_up_says_what_is_kept(store, tmp_path):
    """SIGTERM while the training process still imports (its handlers are installed first):
    exit 75 and one line saying no state could be saved and which complete one is kept (the
    previous session's), not a traceback."""
    out = tmp_path / "run"
    first = Run(tmp_path, tiny_config(store, out, trainer__max_steps=2), "first")
    assert first.finish() == 0, first.err
    over = dict(trainer__max_steps=4)
    run = Run(tmp_path, tiny_config(store, out, **over), "again")
    _catches(run.proc.pid, signal.SIGTERM)
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish() == EXIT_STOPPED, run.err
    last = run.err.strip().splitlines()[-1]
    kept = out / "checkpoints" / "last.ckpt"
    assert last.startswith(
        f"stopped by SIGTERM before a full state could be saved: the newest complete full "
        f"state {kept} (step 2) is kept; resume with --resume auto"
    ), run.err
    assert "Traceback" not in run.err
    assert torch.load(kept, weights_only=True, mmap=True)["global_step"] == 2


def test_a_forwarded_copy_and_a_direct_copy_of_one_signal_are_one_stop(tmp_path):
    """The counting itself (signals.py), in a real process: a direct SIGINT and the parent's
    forwarded copy (counted in the file first) are one stop; the next forwarded one is the
    second and exits at once (130). Each signal waits for the previous one's acknowledgement
    (two pending SIGINTs of one process are one delivery)."""
    count, ack = tmp_path / "forwarded", tmp_path / "ack"
    code = (
        "import time\n"
        "from flowmatch_models.train.signals import SignalStop\n"
        "s = SignalStop(); s.install()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.update(PYTHONPATH=str(REPO), FLOWMATCH_FORWARDED_SIGNALS=str(count))
    env["FLOWMATCH_STOP_ACK"] = str(ack)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"ready\n"

    def send(text: str) -> None:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not (ack.exists() and ack.read_text() == text):
            assert time.monotonic() < deadline and proc.poll() is None, ack.read_text()
            time.sleep(0.005)

    send("SIGINT received=1 forwarded=0")  # direct: the first stop
    count.write_text("1")
    send("SIGINT received=2 forwarded=1")  # the parent's copy of it
    assert proc.poll() is None
    count.write_text("2")
    proc.send_signal(signal.SIGINT)  # the parent's second: exit at once
    assert proc.wait(30) == 128 + signal.SIGINT
    assert b"SIGINT again: exiting now without saving" in proc.stderr.read()
